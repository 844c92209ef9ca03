//! The built-in controllers: WebAssembly components of the controller world built
//! from `plugins/controllers/*` (by this crate's build script) and included in the
//! binary, so they run as the same kind of plugin a third party writes.
//!
//! Each has the short name Kubernetes' `--controllers` flag uses (`replicaset`) and
//! runs as the ServiceAccount `kube-system/NAME-controller`, which the API server
//! binds to `system:controller:NAME-controller` at bootstrap (the node IPAM
//! controller as `node-controller`, which it shares with the node lifecycle
//! controller, as in Kubernetes).

use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use trellis_plugin_host::GroupVersionResource;

use crate::config::{ControllerConfig, Mapping, Watch};

/// One built-in controller.
#[derive(Clone, Copy, Debug)]
pub struct Builtin {
    /// The name `--controllers` knows it by.
    pub name: &'static str,
    /// Its plugin name, and its ServiceAccount unless `service_account` names another.
    pub identity: &'static str,
    /// The ServiceAccount it runs as when two built-ins share one, as Kubernetes'
    /// node controllers share `node-controller`.
    pub service_account: Option<&'static str>,
    pub wasm: &'static [u8],
    /// `(group, version, resource)` of what it reconciles.
    pub primary: (&'static str, &'static str, &'static str),
    /// What it owns: a change of one reconciles its owner.
    pub owns: &'static [(&'static str, &'static str, &'static str)],
    /// Other resources it reads, and how their changes map to its keys.
    pub watches: &'static [((&'static str, &'static str, &'static str), Mapping)],
    /// Every primary object is reconciled again this often, changed or not.
    pub resync: Option<Duration>,
    /// Its configuration needs the cluster CA (`{"caCrt": PEM}`), which the
    /// controller manager knows.
    pub needs_root_ca: bool,
    /// Its configuration otherwise (JSON).
    pub configuration: &'static str,
    /// Keys reconciled at once: kube-controller-manager's `--concurrent-*-syncs`
    /// default (5), or 1 for a controller whose reconciles must not overlap.
    pub workers: usize,
}

fn gvr((group, version, resource): (&str, &str, &str)) -> GroupVersionResource {
    GroupVersionResource {
        group: group.into(),
        version: version.into(),
        resource: resource.into(),
    }
}

impl Builtin {
    /// The ServiceAccount (in `kube-system`) it runs as.
    pub fn account(&self) -> &'static str {
        self.service_account.unwrap_or(self.identity)
    }

    /// How it runs by default.
    pub fn config(&self) -> ControllerConfig {
        let mut config = ControllerConfig::new(
            self.identity,
            Arc::new(self.wasm.to_vec()),
            gvr(self.primary),
        );
        config.spec.configuration = self.configuration.to_owned();
        config.owns = self.owns.iter().copied().map(gvr).collect();
        config.watches = self
            .watches
            .iter()
            .map(|(resource, map)| Watch {
                resource: gvr(*resource),
                map: *map,
            })
            .collect();
        config.resync = self.resync;
        config.workers = self.workers;
        config
    }
}

/// Every built-in controller, in the order they start.
pub const BUILTINS: &[Builtin] = &[
    Builtin {
        name: "cronjob",
        identity: "cronjob-controller",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/cronjob.wasm")),
        primary: ("batch", "v1", "cronjobs"),
        owns: &[("batch", "v1", "jobs")],
        watches: &[],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "daemonset",
        identity: "daemon-set-controller",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/daemonset.wasm")),
        primary: ("apps", "v1", "daemonsets"),
        owns: &[("", "v1", "pods"), ("apps", "v1", "controllerrevisions")],
        watches: &[(("", "v1", "nodes"), Mapping::All)],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "deployment",
        identity: "deployment-controller",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/deployment.wasm")),
        primary: ("apps", "v1", "deployments"),
        owns: &[("apps", "v1", "replicasets")],
        watches: &[],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "disruption",
        identity: "disruption-controller",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/disruption.wasm")),
        primary: ("policy", "v1", "poddisruptionbudgets"),
        owns: &[],
        // A pod's readiness changes the budgets that select it; the scale of the
        // pods' controllers is read from the cache.
        watches: &[
            (("", "v1", "pods"), Mapping::Selector),
            (("apps", "v1", "replicasets"), Mapping::Cache),
            (("apps", "v1", "deployments"), Mapping::Cache),
            (("apps", "v1", "statefulsets"), Mapping::Cache),
            (("", "v1", "replicationcontrollers"), Mapping::Cache),
        ],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "endpoint",
        identity: "endpoint-controller",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/endpoints.wasm")),
        primary: ("", "v1", "services"),
        // Endpoints named after their Service, owned by it.
        owns: &[("", "v1", "endpoints")],
        watches: &[(("", "v1", "pods"), Mapping::Selector)],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "endpointslice",
        identity: "endpointslice-controller",
        service_account: None,
        // The Endpoints controller's component, writing EndpointSlices.
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/endpoints.wasm")),
        primary: ("", "v1", "services"),
        owns: &[("discovery.k8s.io", "v1", "endpointslices")],
        // Nodes for the endpoints' zones.
        watches: &[
            (("", "v1", "pods"), Mapping::Selector),
            (("", "v1", "nodes"), Mapping::Cache),
        ],
        resync: None,
        needs_root_ca: false,
        configuration: r#"{"write": "endpointslices"}"#,
        workers: 5,
    },
    Builtin {
        name: "garbage-collector",
        identity: "generic-garbage-collector",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/garbage-collector.wasm")),
        // Every resource that can be listed, watched and deleted.
        primary: ("*", "*", "*"),
        owns: &[],
        watches: &[],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "horizontalpodautoscaling",
        identity: "horizontal-pod-autoscaler",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/horizontal-pod-autoscaler.wasm")),
        primary: ("autoscaling", "v2", "horizontalpodautoscalers"),
        owns: &[],
        // The pods it measures, and the kinds with a scale subresource it finds a
        // target among (each autoscaler requeues itself every sync period).
        watches: &[
            (("", "v1", "pods"), Mapping::Cache),
            (("apps", "v1", "deployments"), Mapping::Cache),
            (("apps", "v1", "replicasets"), Mapping::Cache),
            (("apps", "v1", "statefulsets"), Mapping::Cache),
            (("", "v1", "replicationcontrollers"), Mapping::Cache),
        ],
        resync: None,
        needs_root_ca: false,
        configuration: r#"{"syncPeriodSeconds": 15}"#,
        workers: 5,
    },
    Builtin {
        name: "job",
        identity: "job-controller",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/job.wasm")),
        primary: ("batch", "v1", "jobs"),
        owns: &[("", "v1", "pods")],
        watches: &[],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "local-path-provisioner",
        identity: "local-path-provisioner",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/local-path-provisioner.wasm")),
        primary: ("", "v1", "persistentvolumeclaims"),
        owns: &[],
        // The selected node tells where the volume goes and its root directory.
        watches: &[
            (("", "v1", "persistentvolumes"), Mapping::Cache),
            (("storage.k8s.io", "v1", "storageclasses"), Mapping::Cache),
            (("", "v1", "nodes"), Mapping::Cache),
        ],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "namespace",
        identity: "namespace-controller",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/namespace.wasm")),
        primary: ("", "v1", "namespaces"),
        owns: &[],
        // Every resource: a removal in a namespace brings the namespace back.
        watches: &[(("*", "*", "*"), Mapping::Namespace)],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "nodeipam",
        identity: "node-ipam-controller",
        service_account: Some("node-controller"),
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/node-ipam.wasm")),
        primary: ("", "v1", "nodes"),
        owns: &[],
        watches: &[],
        resync: None,
        needs_root_ca: false,
        // kube-controller-manager's --cluster-cidr and --node-cidr-mask-size, as k3s
        // sets them; the controller manager fills in its flags' values.
        configuration: r#"{"clusterCIDRs": ["10.42.0.0/16"], "nodeCIDRMaskSize": 24}"#,
        // One allocation at a time: each counts the ranges the others gave.
        workers: 1,
    },
    Builtin {
        name: "nodelifecycle",
        identity: "node-controller",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/node-lifecycle.wasm")),
        primary: ("", "v1", "nodes"),
        owns: &[],
        // Read only: a node is looked at again when its lease would lapse, not at
        // every renewal.
        watches: &[
            (("coordination.k8s.io", "v1", "leases"), Mapping::Cache),
            (("", "v1", "pods"), Mapping::Cache),
        ],
        resync: None,
        needs_root_ca: false,
        configuration: r#"{"gracePeriodSeconds": 50}"#,
        workers: 5,
    },
    Builtin {
        name: "persistentvolume-binder",
        identity: "persistent-volume-binder",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/persistentvolume-binder.wasm")),
        primary: ("", "v1", "persistentvolumeclaims"),
        owns: &[],
        // A volume's change reconciles every claim: a new volume may be the one a
        // pending claim waits for (Kubernetes' binder resyncs them all every 15 s).
        watches: &[
            (("", "v1", "persistentvolumes"), Mapping::All),
            (("storage.k8s.io", "v1", "storageclasses"), Mapping::Cache),
        ],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "replicaset",
        identity: "replicaset-controller",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/replicaset.wasm")),
        primary: ("apps", "v1", "replicasets"),
        owns: &[("", "v1", "pods")],
        watches: &[],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "replicationcontroller",
        identity: "replication-controller",
        service_account: None,
        // Kubernetes' replication manager is its ReplicaSet controller run on
        // ReplicationControllers; so is this one.
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/replicaset.wasm")),
        primary: ("", "v1", "replicationcontrollers"),
        owns: &[("", "v1", "pods")],
        watches: &[],
        resync: None,
        needs_root_ca: false,
        configuration: r#"{"kind": "ReplicationController"}"#,
        workers: 5,
    },
    Builtin {
        name: "resourcequota",
        identity: "resourcequota-controller",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/resourcequota.wasm")),
        primary: ("", "v1", "resourcequotas"),
        owns: &[],
        // What quotas count: any change of one reconciles every quota of its
        // namespace. The quotas themselves too, for `resourcequotas`.
        watches: &[
            (("", "v1", "pods"), Mapping::Namespaced),
            (("", "v1", "configmaps"), Mapping::Namespaced),
            (("", "v1", "secrets"), Mapping::Namespaced),
            (("", "v1", "services"), Mapping::Namespaced),
            (("", "v1", "resourcequotas"), Mapping::Namespaced),
            // `count/<resource>` may name any resource: all are cached, and their
            // removals reach the namespace's quotas (creates are charged by the API
            // server; the resync catches the rest).
            (("*", "*", "*"), Mapping::Namespaced),
        ],
        // Kubernetes' --resource-quota-sync-period.
        resync: Some(Duration::from_secs(300)),
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "root-ca-cert-publisher",
        identity: "root-ca-cert-publisher",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/root-ca-cert-publisher.wasm")),
        primary: ("", "v1", "namespaces"),
        owns: &[],
        watches: &[(("", "v1", "configmaps"), Mapping::Namespace)],
        resync: None,
        needs_root_ca: true,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "serviceaccount",
        identity: "service-account-controller",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/serviceaccount.wasm")),
        primary: ("", "v1", "namespaces"),
        owns: &[],
        watches: &[(("", "v1", "serviceaccounts"), Mapping::Namespace)],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "statefulset",
        identity: "statefulset-controller",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/statefulset.wasm")),
        primary: ("apps", "v1", "statefulsets"),
        owns: &[("", "v1", "pods"), ("apps", "v1", "controllerrevisions")],
        watches: &[(("", "v1", "persistentvolumeclaims"), Mapping::Cache)],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
    Builtin {
        name: "ttl-after-finished",
        identity: "ttl-after-finished-controller",
        service_account: None,
        wasm: include_bytes!(concat!(env!("OUT_DIR"), "/ttl-after-finished.wasm")),
        primary: ("batch", "v1", "jobs"),
        owns: &[],
        watches: &[],
        resync: None,
        needs_root_ca: false,
        configuration: "{}",
        workers: 5,
    },
];

/// The built-ins a `--controllers` value selects, as Kubernetes reads it: a comma
/// list of names, `*` for all that are on by default, `-NAME` to leave one out.
pub fn select(spec: &str) -> anyhow::Result<Vec<&'static Builtin>> {
    let items: Vec<&str> = spec
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    for item in &items {
        let name = item.trim_start_matches('-');
        if name != "*" && !BUILTINS.iter().any(|b| b.name == name) {
            bail!(
                "--controllers: no controller {name:?}; the built-ins are {}",
                BUILTINS
                    .iter()
                    .map(|b| b.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    let all = items.contains(&"*");
    Ok(BUILTINS
        .iter()
        .filter(|b| {
            let on = all || items.contains(&b.name);
            let off = items.iter().any(|i| i.strip_prefix('-') == Some(b.name));
            on && !off
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(spec: &str) -> Vec<&'static str> {
        select(spec).unwrap().iter().map(|b| b.name).collect()
    }

    #[test]
    fn controllers_are_selected_as_kubernetes_flag_reads() {
        assert_eq!(
            names("*"),
            [
                "cronjob",
                "daemonset",
                "deployment",
                "disruption",
                "endpoint",
                "endpointslice",
                "garbage-collector",
                "horizontalpodautoscaling",
                "job",
                "local-path-provisioner",
                "namespace",
                "nodeipam",
                "nodelifecycle",
                "persistentvolume-binder",
                "replicaset",
                "replicationcontroller",
                "resourcequota",
                "root-ca-cert-publisher",
                "serviceaccount",
                "statefulset",
                "ttl-after-finished"
            ]
        );
        assert_eq!(
            names(
                "*,-cronjob,-daemonset,-deployment,-disruption,-endpoint,-endpointslice,-garbage-collector,-namespace,-nodeipam,-nodelifecycle,-replicationcontroller,-resourcequota,-serviceaccount,-horizontalpodautoscaling,-job,-local-path-provisioner,-persistentvolume-binder,-statefulset,-ttl-after-finished"
            ),
            ["replicaset", "root-ca-cert-publisher"]
        );
        assert_eq!(names("replicaset"), ["replicaset"]);
        assert!(names("").is_empty());
        let err = select("*,-nope").unwrap_err().to_string();
        assert!(err.contains("no controller \"nope\""), "{err}");
    }

    #[test]
    fn the_bundled_components_are_components() {
        for b in BUILTINS {
            // The component binary format's preamble: magic, then version 0x0d, layer 1.
            assert_eq!(&b.wasm[..4], b"\0asm", "{}", b.name);
            assert_eq!(&b.wasm[4..8], &[0x0d, 0, 1, 0], "{}", b.name);
        }
    }
}
