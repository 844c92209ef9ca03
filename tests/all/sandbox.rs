//! The sandbox of `process` containers, through the API as a user runs pods: a
//! container cannot read the runtime's data dir (where a node keeps keys), `/root`
//! or another pod's volume, sees only its own pod's processes, cannot become root,
//! runs as the user asked (nobody by default), has a `/tmp` of its own, listens on a
//! low port as a non-root user, and `readOnlyRootFilesystem` leaves only its volumes
//! writable; an exec runs as the container's user in its namespaces; a privileged
//! container is still the node's process. One node with a pod network of its own,
//! 10.244.91.0/24 (bridge `trellis-sb91`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_client::informer::{Informer, SharedInformers};
use trellis_tests::TestCluster;
use trellis_tests::pod_network::{NetworkedNode, NetworkedNodeOptions, PodNetwork, delete_pods};

use crate::node::{phase, wait_pod};

const NODE: &str = "node-sandbox";

/// What the probe prints, one `name=result` line each: `0` where the command
/// succeeded, its output or exit code otherwise.
const PROBE: &str = r#"
check() { name=$1; shift; out=$("$@" 2>/dev/null); echo "$name=$?:$out"; }
check uid id -u
check data-dir cat "$SECRET"
check root-home ls /root
check volume cat "$OTHER_VOLUME/marker"
check procs sh -c 'ls /proc | grep -c "^[0-9]"'
check setuid python3 -c 'import os; os.setuid(0)'
check other-tmp test -e /tmp/mine
check low-port python3 -c 'import socket; socket.socket().bind(("0.0.0.0", 80))'
check own-tmp sh -c 'echo x > /tmp/probe && cat /tmp/probe'
check write-root sh -c 'echo x > /x'
check write-volume sh -c 'echo x > /data/y'
"#;

/// A probe pod running [`PROBE`] with `security`, its volume at /data (none for a
/// privileged one: the node's root has no /data).
fn probe(name: &str, security: serde_json::Value, secret: &Path, other: &Path) -> Result<Pod> {
    let mounts = if security["privileged"] == true {
        json!([])
    } else {
        json!([{"name": "data", "mountPath": "/data"}])
    };
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"nodeName": NODE, "runtimeClassName": "process", "restartPolicy": "Never",
            "volumes": [{"name": "data", "emptyDir": {}}],
            "containers": [{"name": "main", "image": "file:///bin/sh",
                "command": ["/bin/sh", "-c", PROBE],
                "env": [{"name": "SECRET", "value": secret.display().to_string()},
                    {"name": "OTHER_VOLUME", "value": other.display().to_string()}],
                "volumeMounts": mounts,
                "securityContext": security}]}
    }))?)
}

/// The probe's results, by check, from its log.
async fn results(
    pods: &Arc<Informer<Pod>>,
    root: &Path,
    name: &str,
) -> Result<std::collections::BTreeMap<String, String>> {
    let pod = wait_pod(pods, name, Duration::from_secs(30), |p| {
        matches!(phase(p), "Succeeded" | "Failed")
    })
    .await?;
    let dir = root.join("agent/logs").join(format!(
        "default_{name}_{}",
        pod.metadata.uid.as_deref().unwrap_or_default()
    ));
    let log = std::fs::read_to_string(dir.join("main/0.log"))
        .with_context(|| format!("the log of {name}: {:?}", pod.status))?;
    let got: std::collections::BTreeMap<String, String> = log
        .lines()
        .filter_map(|line| line.split_once(" stdout F ")?.1.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    ensure!(
        !got.is_empty(),
        "{name} printed nothing: {log} {:?}",
        pod.status
    );
    Ok(got)
}

/// The first file named `name` under `dir`.
fn find(dir: &Path, name: &str) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if path.file_name().is_some_and(|n| n == name) {
            return Some(path);
        }
        if entry.file_type().is_ok_and(|t| t.is_dir())
            && let Some(found) = find(&path, name)
        {
            return Some(found);
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_container_reaches_only_its_own_sandbox() -> Result<()> {
    if !rustix::process::geteuid().is_root()
        || !Path::new("/usr/lib/cni/bridge").exists()
        || !Path::new("/usr/bin/python3").exists()
    {
        eprintln!("skipped: the sandbox needs root, the CNI plugins (make deps) and python3");
        return Ok(());
    }
    let cluster = TestCluster::start().await?;
    let node = NetworkedNode::start(
        &cluster,
        NetworkedNodeOptions {
            node: NODE,
            pod_cidr: "10.244.91.0/24",
            bridge: "trellis-sb91",
            network: PodNetwork::Bridge {
                name: "sandbox-test",
                hairpin: false,
            },
            client_ca: false,
            backoff_base: None,
        },
    )
    .await?;
    node.set_pod_cidr().await?;
    let root = node.root().to_path_buf();
    // What a node keeps in its data dir: a key no pod may read.
    let secret = root.join("runtime/ca.key");
    std::fs::write(&secret, "TOPSECRET")?;
    let admin = node.admin.clone();
    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let names = ["other", "probe", "as-root", "privileged"];
    let work = async {
        // Another pod: a volume with a file, a file in its /tmp, visible as ready once
        // both are there (an exec probe, which runs in its sandbox too).
        let other: Pod = serde_json::from_value(json!({
            "metadata": {"name": "other"},
            "spec": {"nodeName": NODE, "runtimeClassName": "process", "terminationGracePeriodSeconds": 1,
                "volumes": [{"name": "data", "emptyDir": {}}],
                "containers": [{"name": "main", "image": "file:///bin/sh",
                    "command": ["/bin/sh", "-c", "echo mine > /data/marker; echo mine > /tmp/mine; exec sleep 600"],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                    "readinessProbe": {"exec": {"command": ["cat", "/tmp/mine"]}, "periodSeconds": 1}}]}
        }))?;
        api.create(&PostParams::default(), &other).await?;
        let ready = |p: &Pod| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        };
        wait_pod(&pods, "other", Duration::from_secs(30), ready).await?;
        let volume = find(&root.join("agent"), "marker")
            .and_then(|m| m.parent().map(Path::to_path_buf))
            .context("the other pod's volume")?;

        // An exec runs as the container's user, in its namespaces: its /tmp.
        let mut cri = node.cri().await?;
        let id = cri
            .runtime
            .list_containers(k8s_cri::v1::ListContainersRequest::default())
            .await?
            .into_inner()
            .containers
            .into_iter()
            .find(|c| c.metadata.as_ref().is_some_and(|m| m.name == "main"))
            .context("the other pod's container")?
            .id;
        let exec = cri
            .runtime
            .exec_sync(k8s_cri::v1::ExecSyncRequest {
                container_id: id,
                cmd: vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    "id -u; cat /tmp/mine; ls /proc | grep -c '^[0-9]'".into(),
                ],
                timeout: 10,
            })
            .await?
            .into_inner();
        let out = String::from_utf8_lossy(&exec.stdout);
        let lines: Vec<&str> = out.lines().collect();
        ensure!(
            exec.exit_code == 0 && lines[..2] == ["65534", "mine"],
            "{exec:?}"
        );
        // The container's sleep and shell, the exec's shell, ls and grep, and init.
        let seen: u32 = lines[2].parse()?;
        ensure!(seen <= 8, "the exec sees {seen} processes");

        // The default: nobody, nothing of the node's or the other pod's.
        api.create(
            &PostParams::default(),
            &probe("probe", json!({}), &secret, &volume)?,
        )
        .await?;
        let got = results(&pods, &root, "probe").await?;
        let failed = |name: &str| got.get(name).is_some_and(|r| !r.starts_with("0:"));
        ensure!(
            got.get("uid").map(String::as_str) == Some("0:65534"),
            "{got:?}"
        );
        for name in [
            "data-dir",
            "root-home",
            "volume",
            "setuid",
            "other-tmp",
            "write-root",
        ] {
            ensure!(failed(name), "{name}: {got:?}");
        }
        let procs: u32 = got
            .get("procs")
            .and_then(|r| r.strip_prefix("0:"))
            .context("procs")?
            .parse()?;
        ensure!(procs <= 6, "the pod sees {procs} processes: {got:?}");
        for name in ["low-port", "own-tmp"] {
            ensure!(
                got.get(name).is_some_and(|r| r.starts_with("0:")),
                "{name}: {got:?}"
            );
        }

        // Root, as asked, with a read-only root: its volume alone is writable; the
        // node's files are still out of reach.
        api.create(
            &PostParams::default(),
            &probe(
                "as-root",
                json!({"runAsUser": 0, "readOnlyRootFilesystem": true}),
                &secret,
                &volume,
            )?,
        )
        .await?;
        let got = results(&pods, &root, "as-root").await?;
        let failed = |name: &str| got.get(name).is_some_and(|r| !r.starts_with("0:"));
        ensure!(got.get("uid").map(String::as_str) == Some("0:0"), "{got:?}");
        for name in ["data-dir", "volume", "write-root", "own-tmp"] {
            ensure!(failed(name), "{name}: {got:?}");
        }
        ensure!(!failed("write-volume"), "{got:?}");

        // Privileged: the node's process, which reads what the node has.
        api.create(
            &PostParams::default(),
            &probe("privileged", json!({"privileged": true}), &secret, &volume)?,
        )
        .await?;
        let got = results(&pods, &root, "privileged").await?;
        ensure!(
            got.get("data-dir").map(String::as_str) == Some("0:TOPSECRET")
                && got.get("uid").map(String::as_str) == Some("0:0"),
            "{got:?}"
        );
        Ok::<_, anyhow::Error>(())
    };
    let result = work.await;
    let _ = delete_pods(&api, &pods, &names, Duration::from_secs(30)).await;
    node.stop().await?;
    result
}
