//! A `process` pod's namespaces and files through a node on the pod network: the
//! container sees its hostname (UTS), the kubelet's managed `/etc/hosts` (its IP with
//! its FQDN, its `hostAliases`), its `resolv.conf` from `dnsPolicy: None` and
//! `dnsConfig`, a hostPath volume at its `mountPath` with an emptyDir inside it;
//! `kubectl exec` sees the same; the node's own files are unchanged; a `mountPath`
//! the node lacks is made in a sandboxed container's own root, and fails a
//! privileged container (on the node's root) with the reason; nothing of the pods'
//! namespaces or files is left once they are deleted.
//!
//! Needs root and the CNI plugins; the node has a CNI network of its own on
//! 10.244.90.0/24 (bridge `trellis-nt90`, removed at the end).

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_client::informer::SharedInformers;
use trellis_tests::TestCluster;
use trellis_tests::pod_network::{NetworkedNode, NetworkedNodeOptions, PodNetwork, delete_pods};

use super::node::wait_pod;

const NODE: &str = "files-node";
const POD_CIDR: &str = "10.244.90.0/24";
const BRIDGE: &str = "trellis-nt90";
/// A directory every Debian machine has, and leaves empty.
const MOUNT_AT: &str = "/srv";

/// The node's files a pod must not change.
fn node_files() -> Vec<(String, Vec<u8>)> {
    [
        "/etc/hosts",
        "/etc/hostname",
        "/etc/resolv.conf",
        "/proc/sys/kernel/hostname",
    ]
    .into_iter()
    .map(|p| (p.to_owned(), std::fs::read(p).unwrap_or_default()))
    .chain(
        std::fs::read_dir(MOUNT_AT)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| (e.path().display().to_string(), Vec::new())),
    )
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_pod_sees_its_hostname_hosts_resolv_conf_and_volumes_and_so_does_exec()
-> Result<()> {
    if !rustix::process::geteuid().is_root()
        || !std::path::Path::new("/usr/lib/cni/bridge").exists()
        || !std::path::Path::new(MOUNT_AT).is_dir()
    {
        eprintln!("skipped: pod namespaces need root, the CNI plugins (make deps) and {MOUNT_AT}");
        return Ok(());
    }
    let before = node_files();
    let cluster = TestCluster::start().await?;
    let node = NetworkedNode::start(
        &cluster,
        NetworkedNodeOptions {
            node: NODE,
            pod_cidr: POD_CIDR,
            bridge: BRIDGE,
            network: PodNetwork::Bridge {
                name: "pod-files-test",
                hairpin: false,
            },
            client_ca: true,
            backoff_base: Some(Duration::from_millis(200)),
        },
    )
    .await?;
    let root = node.root();
    let admin = node.admin.clone();
    let host_data = root.join("host-data");
    std::fs::create_dir_all(&host_data)?;
    std::fs::write(host_data.join("in.txt"), "from the node\n")?;
    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let names = ["files", "nowhere", "somewhere"];
    let work = async {
        node.set_pod_cidr().await?;
        let script = format!(
            "echo hostname=$(cat /proc/sys/kernel/hostname); echo --- hostname; cat /etc/hostname; \
             echo --- hosts; cat /etc/hosts; echo --- resolv; cat /etc/resolv.conf; \
             echo --- volume; cat {MOUNT_AT}/in.txt; echo from-pod > {MOUNT_AT}/scratch/out; \
             echo --- done; exec sleep 600"
        );
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "files"},
            "spec": {"nodeName": NODE, "runtimeClassName": "process",
                "terminationGracePeriodSeconds": 1,
                "hostname": "db", "subdomain": "backend",
                "hostAliases": [{"ip": "10.1.2.3", "hostnames": ["foo.local", "bar.local"]}],
                "dnsPolicy": "None",
                "dnsConfig": {"nameservers": ["10.244.90.53"], "searches": ["backend.example"],
                    "options": [{"name": "ndots", "value": "2"}]},
                "volumes": [{"name": "data", "hostPath": {"path": host_data.display().to_string()}},
                    {"name": "scratch", "emptyDir": {}}],
                "containers": [{"name": "main", "image": "file:///bin/sh",
                    "command": ["/bin/sh", "-c", script],
                    "volumeMounts": [{"name": "data", "mountPath": MOUNT_AT},
                        {"name": "scratch", "mountPath": format!("{MOUNT_AT}/scratch")}]}]}
        }))?;
        api.create(&PostParams::default(), &pod).await?;
        for (name, privileged) in [("nowhere", true), ("somewhere", false)] {
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {"nodeName": NODE, "runtimeClassName": "process",
                    "terminationGracePeriodSeconds": 1,
                    "volumes": [{"name": "scratch", "emptyDir": {}}],
                    "containers": [{"name": "main", "image": "file:///bin/sleep", "args": ["600"],
                        "securityContext": {"privileged": privileged},
                        "volumeMounts": [{"name": "scratch", "mountPath": "/no-such-dir-on-the-node"}]}]}
            }))?;
            api.create(&PostParams::default(), &pod).await?;
        }

        let running = wait_pod(&pods, "files", Duration::from_secs(60), |p| {
            super::node::phase(p) == "Running"
        })
        .await?;
        let ip = running
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .context("no podIP")?;
        let kubectl = cluster.admin();
        // Bounded: the script's output is in the log as soon as it ran.
        let mut log = String::new();
        for _ in 0..100 {
            log = kubectl.ok(&["logs", "files"]).await?;
            if log.contains("--- done") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for line in [
            "hostname=db\n--- hostname\ndb\n--- hosts\n# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n",
            &format!("{ip}\tdb.backend.default.svc.cluster.local\tdb\n"),
            "# Entries added by HostAliases.\n10.1.2.3\tfoo.local\tbar.local\n",
            "--- resolv\nsearch backend.example\nnameserver 10.244.90.53\noptions ndots:2\n",
            "--- volume\nfrom the node\n--- done\n",
        ] {
            ensure!(log.contains(line), "{line:?} missing from the log:\n{log}");
        }
        let uid = running.metadata.uid.clone().unwrap_or_default();
        let out = root.join(format!("agent/pods/{uid}/volumes/scratch/out"));
        ensure!(
            std::fs::read_to_string(&out).ok().as_deref() == Some("from-pod\n"),
            "the emptyDir mounted in the hostPath volume got the write"
        );

        // An exec sees what the container sees.
        ensure!(kubectl.ok(&["exec", "files", "--", "uname", "-n"]).await? == "db\n");
        let resolv = kubectl.ok(&["exec", "files", "--", "cat", "/etc/resolv.conf"]).await?;
        ensure!(resolv.contains("nameserver 10.244.90.53\n"), "{resolv}");
        let read = kubectl
            .ok(&["exec", "files", "--", "cat", &format!("{MOUNT_AT}/scratch/out")])
            .await?;
        ensure!(read == "from-pod\n", "{read:?}");
        let addresses = kubectl
            .ok(&["exec", "files", "--", "cat", "/proc/net/fib_trie"])
            .await?;
        ensure!(addresses.contains(&ip), "the exec is in the pod's network: {addresses}");

        // A mountPath the node lacks: made in a sandboxed container's own root; a
        // privileged container, on the node's root, does not start, and says why.
        wait_pod(&pods, "somewhere", Duration::from_secs(30), |p| {
            super::node::phase(p) == "Running"
        })
        .await?;
        let says = |p: &Pod| {
            super::node::container(p)
                .and_then(|c| c.last_state.as_ref()?.terminated.as_ref()?.message.clone())
                .filter(|m| m.contains("/no-such-dir-on-the-node does not exist on this node"))
        };
        wait_pod(&pods, "nowhere", Duration::from_secs(30), |p| says(p).is_some()).await?;
        Ok::<_, anyhow::Error>(())
    }
    .await;

    // Deleted whatever happened above, so that no namespace outlives the test.
    let gone = delete_pods(&api, &pods, &names, Duration::from_secs(30)).await;
    // The agent removes the sandboxes right after the pods are gone from the API.
    let left = || {
        ["netns", "utsns", "ipcns"]
            .iter()
            .flat_map(|d| {
                std::fs::read_dir(root.join("runtime").join(d))
                    .into_iter()
                    .flatten()
            })
            .flatten()
            .map(|e| e.path().display().to_string())
            .chain(
                std::fs::read_dir(root.join("runtime/sandboxes"))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.path().display().to_string()),
            )
            .collect::<Vec<_>>()
    };
    let runtime = root.join("runtime");
    let dirs = ["netns", "utsns", "ipcns", "sandboxes"].map(|d| runtime.join(d));
    let _ = trellis_tests::wait_removed_in(
        &dirs.each_ref().map(|d| d.as_path()),
        &left,
        Duration::from_secs(15),
    )
    .await;
    let left = left();
    node.stop().await?;
    work?;
    gone.context("the pods were not removed")??;
    ensure!(left.is_empty(), "namespaces or files left: {left:?}");
    ensure!(node_files() == before, "the node's files changed");
    cluster.stop().await?;
    Ok(())
}
