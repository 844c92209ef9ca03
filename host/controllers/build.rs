//! Builds the built-in controllers (`plugins/controllers/*`) for the binary to
//! include (see `trellis-bundle-build`), where `bundled.rs` takes them.

const CONTROLLERS: [&str; 19] = [
    "disruption",
    "endpoints",
    "namespace",
    "node-ipam",
    "node-lifecycle",
    "replicaset",
    "resourcequota",
    "deployment",
    "garbage-collector",
    "serviceaccount",
    "root-ca-cert-publisher",
    "daemonset",
    "statefulset",
    "job",
    "cronjob",
    "ttl-after-finished",
    "horizontal-pod-autoscaler",
    "persistentvolume-binder",
    "local-path-provisioner",
];

fn main() -> Result<(), String> {
    trellis_bundle_build::bundle(&CONTROLLERS, &["plugins/controllers"])
}
