//! Pods on the pod network come and go through a node (agent and runtime over CRI)
//! without leaving anything of their network behind: no veth on the bridge, no
//! namespace pin, no record of an ADD, no address reserved by host-local; the agent
//! collects what the runtime holds of pods that are gone (deleted while it was down)
//! and a live pod's old sandboxes. Needs root and the CNI plugins; the node has the
//! runtime's default network (in-process) on a range and bridge of its own,
//! 10.244.82.128/25 and `trellis-nt82c`.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use k8s_cri::v1 as cri;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use tokio::time::Instant;
use trellis_client::informer::SharedInformers;
use trellis_tests::TestCluster;
use trellis_tests::pod_network::{NetworkedNode, NetworkedNodeOptions, PodNetwork};

use super::node::{phase, wait_pod};

const NODE: &str = "node-churn";
const POD_CIDR: &str = "10.244.82.128/25";
const BRIDGE: &str = "trellis-nt82c";
/// The default conflist's network name: host-local's directory.
const NETWORK: &str = "trellis";

fn names_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect()
}

/// What is left of the pods' network: pins, records of ADDs, reserved addresses and
/// the bridge's ports; all empty when nothing leaked.
#[derive(Debug, Default, PartialEq)]
struct Leftovers {
    /// Network, UTS and IPC namespace pins.
    pins: Vec<String>,
    /// Records of ADDs: the plugins' cached results, the in-process network's.
    added: Vec<String>,
    reserved: Vec<String>,
    veths: Vec<String>,
}

fn leftovers(root: &Path) -> Leftovers {
    Leftovers {
        pins: ["netns", "utsns", "ipcns"]
            .iter()
            .flat_map(|kind| names_in(&root.join("runtime").join(kind)))
            .collect(),
        added: ["cni/results", "bridge"]
            .iter()
            .flat_map(|kind| names_in(&root.join("runtime").join(kind)))
            .collect(),
        reserved: names_in(&root.join("cni/networks").join(NETWORK))
            .into_iter()
            .filter(|n| n.parse::<std::net::IpAddr>().is_ok())
            .collect(),
        veths: names_in(&Path::new("/sys/class/net").join(BRIDGE).join("brif")),
    }
}

/// Waits until nothing is left, looking again every 50 ms for up to `limit` (a
/// namespace's veth goes a moment after its pin).
async fn wait_clean(root: &Path, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let left = leftovers(root);
        if left == Leftovers::default() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("left after {limit:?}: {left:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn sleeper(name: &str) -> Result<Pod> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"nodeName": NODE, "runtimeClassName": "process",
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "file:///bin/sleep", "args": ["600"]}]}
    }))?)
}

/// The runtime's sandboxes of pod `uid`: id and whether it is ready.
async fn sandboxes_of(cri: &mut trellis_runtime::Client, uid: &str) -> Result<Vec<(String, bool)>> {
    Ok(cri
        .runtime
        .list_pod_sandbox(cri::ListPodSandboxRequest {
            filter: Some(cri::PodSandboxFilter {
                label_selector: [("io.kubernetes.pod.uid".to_string(), uid.to_string())].into(),
                ..Default::default()
            }),
        })
        .await?
        .into_inner()
        .items
        .into_iter()
        .map(|s| (s.id, s.state == cri::PodSandboxState::SandboxReady as i32))
        .collect())
}

/// Waits until pod `uid`'s sandboxes satisfy `done`, looking again every 50 ms.
async fn wait_sandboxes(
    cri: &mut trellis_runtime::Client,
    uid: &str,
    limit: Duration,
    done: impl Fn(&[(String, bool)]) -> bool,
) -> Result<Vec<(String, bool)>> {
    let deadline = Instant::now() + limit;
    loop {
        let sandboxes = sandboxes_of(cri, uid).await?;
        if done(&sandboxes) {
            return Ok(sandboxes);
        }
        if Instant::now() >= deadline {
            bail!("pod {uid}'s sandboxes after {limit:?}: {sandboxes:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_on_the_pod_network_leave_nothing_behind() -> Result<()> {
    if !rustix::process::geteuid().is_root()
        || !std::path::Path::new("/usr/lib/cni/bridge").exists()
    {
        eprintln!("skipped: pod networks need root and the CNI plugins (make deps)");
        return Ok(());
    }
    let cluster = TestCluster::start().await?;
    let mut node = NetworkedNode::start(
        &cluster,
        NetworkedNodeOptions {
            node: NODE,
            pod_cidr: POD_CIDR,
            bridge: BRIDGE,
            // The runtime's default network (made in-process), on a bridge of its own.
            network: PodNetwork::Default,
            client_ca: false,
            backoff_base: Some(Duration::from_millis(100)),
        },
    )
    .await?;
    let root = node.root().to_path_buf();
    let root = root.as_path();
    let mut cri = node.cri().await?;

    let admin = node.admin.clone();
    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    const CHURN: usize = 50;
    let work = async {
        node.set_pod_cidr().await?;

        // Churn: pods made and deleted through the node.
        let begun = Instant::now();
        for i in 0..CHURN {
            api.create(&PostParams::default(), &sleeper(&format!("churn-{i}"))?)
                .await?;
        }
        let mut changes = pods.subscribe();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let running = (0..CHURN)
                .filter(|i| {
                    pods.get(&format!("default/churn-{i}"))
                        .is_some_and(|p| phase(&p) == "Running")
                })
                .count();
            if running == CHURN {
                break;
            }
            match tokio::time::timeout_at(deadline, changes.recv()).await {
                Ok(Some(_)) => {}
                Ok(None) => bail!("the pod informer ended"),
                Err(_) => bail!("{running} of {CHURN} pods running"),
            }
        }
        let running = begun.elapsed();
        ensure!(
            leftovers(root).veths.len() == CHURN,
            "a veth per pod: {:?}",
            leftovers(root)
        );
        for i in 0..CHURN {
            api.delete(&format!("churn-{i}"), &DeleteParams::default())
                .await?;
        }
        wait_clean(root, Duration::from_secs(30))
            .await
            .context("after the churn")?;
        eprintln!(
            "{CHURN} pods: running after {running:?}, all gone after {:?}",
            begun.elapsed()
        );

        // A pod deleted while its node's agent is down: the agent collects its sandbox
        // when it is back.
        let begun = Instant::now();
        api.create(&PostParams::default(), &sleeper("orphan")?)
            .await?;
        let orphan = wait_pod(&pods, "orphan", Duration::from_secs(30), |p| {
            phase(p) == "Running"
        })
        .await?;
        let orphan_uid = orphan.metadata.uid.clone().context("no uid")?;
        node.stop_agent().await?;
        api.delete("orphan", &DeleteParams::default().grace_period(0))
            .await?;
        ensure!(
            sandboxes_of(&mut cri, &orphan_uid).await?.len() == 1,
            "the sandbox stays while the agent is down"
        );
        node.start_agent().await?;
        wait_sandboxes(&mut cri, &orphan_uid, Duration::from_secs(10), |s| {
            s.is_empty()
        })
        .await
        .context("the deleted pod's sandbox")?;
        wait_clean(root, Duration::from_secs(10))
            .await
            .context("after the agent's collection")?;
        eprintln!(
            "a pod deleted while the agent was down: collected after {:?}",
            begun.elapsed()
        );

        // A live pod's old sandbox (stopped, as a reboot leaves it): the pod gets a new
        // one, and the old one is collected.
        let begun = Instant::now();
        api.create(&PostParams::default(), &sleeper("renewed")?)
            .await?;
        let renewed = wait_pod(&pods, "renewed", Duration::from_secs(30), |p| {
            phase(p) == "Running"
        })
        .await?;
        let uid = renewed.metadata.uid.clone().context("no uid")?;
        let first = wait_sandboxes(&mut cri, &uid, Duration::from_secs(10), |s| {
            s.len() == 1 && s[0].1
        })
        .await?;
        cri.runtime
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: first[0].0.clone(),
            })
            .await?;
        let now = match wait_sandboxes(&mut cri, &uid, Duration::from_secs(10), |s| {
            s.len() == 1 && s[0].1 && s[0].0 != first[0].0
        })
        .await
        {
            Ok(now) => now,
            Err(e) => {
                let events: Api<k8s_openapi::api::core::v1::Event> =
                    Api::namespaced(admin.clone(), "default");
                let told: Vec<String> = events
                    .list(&Default::default())
                    .await?
                    .items
                    .into_iter()
                    .filter(|e| e.involved_object.name.as_deref() == Some("renewed"))
                    .map(|e| format!("{:?}: {:?}", e.reason, e.message))
                    .collect();
                return Err(e.context(format!(
                    "one new ready sandbox, the old one collected; the pod's events: {told:?}"
                )));
            }
        };
        api.delete("renewed", &DeleteParams::default()).await?;
        wait_clean(root, Duration::from_secs(10))
            .await
            .context("after the renewed pod")?;
        eprintln!(
            "a stopped sandbox replaced ({} -> {}) and collected after {:?}",
            first[0].0,
            now[0].0,
            begun.elapsed()
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;

    // Deleted whatever happened above, so that no namespace outlives the test.
    let forced = DeleteParams::default().grace_period(0);
    for pod in pods.list() {
        if let Some(name) = pod.metadata.name.as_deref() {
            let _ = api.delete(name, &forced).await;
        }
    }
    node.stop().await?;
    work?;
    cluster.stop().await?;
    Ok(())
}
