//! Storage end to end: claims, volumes and the local-path provisioner, with the
//! binder and the provisioner (bundled controllers), the scheduler and a node
//! running `process` pods. A pod whose claim does not exist yet is unschedulable
//! until the claim is created; a claim that names no class gets the default one
//! (`local-path`, WaitForFirstConsumer); its first pod is scheduled, the claim gets
//! its node, a volume on it and is bound; the pod writes to it; once that pod is
//! deleted a second pod of the claim, preferring the other node, runs on the
//! volume's and reads what the first wrote; kubectl lists claims,
//! volumes and classes with Kubernetes' columns; deleting the claim deletes its
//! volume (reclaim Delete). A static hostPath volume binds a claim of its class
//! and is Released, not deleted, when the claim goes (reclaim Retain).
//!
//! Needs root and the CNI plugins; the two nodes have CNI networks of their own on
//! 10.244.125.0/24 and 10.244.126.0/24 (bridges `trellis-st125` and `trellis-st126`,
//! removed at the end).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::runtime::watcher;
use serde_json::json;
use trellis_api::Shutdown;
use trellis_client::events::EventRecorder;
use trellis_client::identity;
use trellis_client::informer::SharedInformers;
use trellis_client::workqueue::QueueMetrics;
use trellis_controllers::Manager;
use trellis_plugin_host::{Compilers, HostConfig, PluginHost};
use trellis_tests::TestCluster;
use trellis_tests::pod_network::{NetworkedNode, NetworkedNodeOptions, PodNetwork, delete_pods};

use super::node::{phase, wait_pod};

/// Two nodes: the claim's second pod must follow its volume to the first one's node.
const NODES: [(&str, &str, &str); 2] = [
    ("storage-node", "10.244.125.0/24", "trellis-st125"),
    ("storage-node-2", "10.244.126.0/24", "trellis-st126"),
];
/// Where the pods mount the claim: a directory every Debian machine has.
const MOUNT_AT: &str = "/mnt";
/// The Node annotation that tells the provisioner where the node's volumes live.
const ROOT: &str = "trellis.dev/local-path-root";

/// Waits until `cond` holds for the object `name` (a watch), up to 60 s.
async fn until<K>(
    api: &Api<K>,
    name: &str,
    what: &str,
    cond: impl Fn(Option<&K>) -> bool,
) -> Result<()>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
    K::DynamicType: Default,
{
    match tokio::time::timeout(
        Duration::from_secs(60),
        await_condition(api.clone(), name, move |o: Option<&K>| cond(o)),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e).context(what.to_owned()),
        Err(_) => bail!(
            "{what}: not within 60 s; {name} is {:?}",
            api.get_opt(name).await?
        ),
    }
}

fn claim_phase(c: Option<&PersistentVolumeClaim>) -> &str {
    c.and_then(|c| c.status.as_ref()?.phase.as_deref())
        .unwrap_or("")
}

/// A `process` pod of the claim `data`, preferring `node` when given.
fn pod(name: &str, script: &str, prefer: Option<&str>) -> Result<Pod> {
    let affinity = match prefer {
        Some(node) => json!({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "preference": {"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}}]}}),
        None => json!(null),
    };
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"runtimeClassName": "process", "terminationGracePeriodSeconds": 1,
            "affinity": affinity,
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
            "containers": [{"name": "main", "image": "file:///bin/sh",
                "command": ["/bin/sh", "-c", script],
                "volumeMounts": [{"name": "data", "mountPath": MOUNT_AT}]}]}
    }))?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_of_the_default_class_keeps_its_data_on_its_node_across_pods() -> Result<()> {
    if !rustix::process::geteuid().is_root()
        || !std::path::Path::new("/usr/lib/cni/bridge").exists()
    {
        eprintln!("skipped: process pods need root and the CNI plugins (make deps)");
        return Ok(());
    }
    let cluster = TestCluster::start().await?;
    let mut started = Vec::new();
    for (name, pod_cidr, bridge) in NODES {
        let node = NetworkedNode::start(
            &cluster,
            NetworkedNodeOptions {
                node: name,
                pod_cidr,
                bridge,
                network: PodNetwork::Bridge {
                    name: bridge,
                    hairpin: false,
                },
                client_ca: true,
                backoff_base: Some(Duration::from_millis(200)),
            },
        )
        .await;
        match node {
            Ok(node) => started.push(node),
            Err(e) => {
                for node in started {
                    let _ = node.stop().await;
                }
                return Err(e);
            }
        }
    }
    let admin = started[0].admin.clone();
    let in_process = cluster.in_process();
    let (stop, stopped) = Shutdown::new();
    let manager = Manager {
        plugins: PluginHost::new(HostConfig {
            compilers: Compilers::Baseline,
            max_instances: 8,
            ..HostConfig::default()
        })?,
        informers: SharedInformers::new(),
        lister: in_process.client(identity::controller_manager()),
        queues: QueueMetrics::default(),
        running: Default::default(),
    };
    let mut running = Vec::new();
    for builtin in
        trellis_controllers::bundled::select("persistentvolume-binder,local-path-provisioner")?
    {
        let writer = in_process.client(identity::controller(builtin.account()));
        let events = EventRecorder::new(writer.clone(), builtin.identity, "test");
        running.push(
            manager
                .start(builtin.config(), writer, events, stopped.clone())
                .await
                .with_context(|| format!("start {}", builtin.name))?,
        );
    }
    let host = PluginHost::new(HostConfig {
        compilers: Compilers::Baseline,
        ..HostConfig::default()
    })?;
    let plugins = super::scheduler::default_plugins(&host).await?;
    let scheduler = super::scheduler::spawn(&in_process, host, vec![plugins], stopped.clone());

    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let pod_api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin.clone(), "default");
    let volumes: Api<PersistentVolume> = Api::all(admin.clone());
    let kubectl = cluster.admin();
    let names = ["writer", "reader"];
    let work = async {
        // Where each node keeps its local-path volumes: what its agent tells the
        // provisioner, else a directory of the node's (the provisioner's default is
        // the machine's /var/lib/trellis/storage).
        let nodes: Api<Node> = Api::all(admin.clone());
        for (node, (name, _, _)) in started.iter().zip(NODES) {
            node.set_pod_cidr().await?;
            let told = nodes.get(name).await?.metadata.annotations.unwrap_or_default();
            if !told.contains_key(ROOT) {
                let root = node.root().join("storage").display().to_string();
                let annotation = json!({"metadata": {"annotations": {ROOT: root}}});
                nodes
                    .patch(name, &PatchParams::default(), &Patch::Merge(&annotation))
                    .await?;
            }
        }
        // A pod whose claim does not exist yet waits, unschedulable, until it does.
        pod_api
            .create(
                &PostParams::default(),
                &pod(
                    "writer",
                    &format!("echo kept > {MOUNT_AT}/file; exec sleep 600"),
                    None,
                )?,
            )
            .await?;
        let unschedulable = |p: &Pod| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .into_iter()
                .flatten()
                .any(|c| {
                    c.type_ == "PodScheduled"
                        && c.status == "False"
                        && c.message
                            .as_deref()
                            .is_some_and(|m| m.contains("persistentvolumeclaim \"data\" not found"))
                })
        };
        wait_pod(&pods, "writer", Duration::from_secs(30), unschedulable).await?;
        ensure!(volumes.list(&Default::default()).await?.items.is_empty());
        // No class named: the default one, whose volume is made on the node the
        // scheduler picks for the pod.
        kubectl
            .ok_stdin(
                &["apply", "-f", "-"],
                "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: data\n\
                 spec:\n  accessModes: [ReadWriteOnce]\n  resources:\n    requests:\n      storage: 64Mi\n",
            )
            .await?;
        let claim = claims.get("data").await?;
        let class = claim.spec.as_ref().and_then(|s| s.storage_class_name.clone());
        ensure!(class.as_deref() == Some("local-path"), "defaulted class: {class:?}");
        until(&claims, "data", "the claim is bound", |c| claim_phase(c) == "Bound").await?;
        let claim = claims.get("data").await?;
        let annotations = claim.metadata.annotations.clone().unwrap_or_default();
        let selected = annotations
            .get("volume.kubernetes.io/selected-node")
            .cloned()
            .context("the scheduler selected no node for the claim")?;
        let (at, other) = match NODES.iter().position(|(name, _, _)| *name == selected) {
            Some(0) => (&started[0], NODES[1].0),
            Some(_) => (&started[1], NODES[0].0),
            None => bail!("the claim's node is none of the test's: {selected}"),
        };
        let volume_name = claim
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.clone())
            .context("bound without a volume")?;
        let volume = volumes.get(&volume_name).await?;
        let spec = volume.spec.clone().unwrap_or_default();
        let dir = PathBuf::from(spec.host_path.as_ref().context("no hostPath")?.path.clone());
        ensure!(
            dir.starts_with(at.root()) && dir.ends_with(&volume_name),
            "the volume is a directory of the node named after it: {dir:?}"
        );
        ensure!(spec.persistent_volume_reclaim_policy.as_deref() == Some("Delete"));
        let affinity = serde_json::to_string(&spec.node_affinity)?;
        ensure!(affinity.contains(&selected), "pinned to its node: {affinity}");

        let writer = wait_pod(&pods, "writer", Duration::from_secs(60), |p| phase(p) == "Running").await?;
        ensure!(
            writer.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&*selected),
            "the pod runs where its claim's volume was made"
        );
        // The pod writes once it runs: woken by the directory's inotify events.
        let file = dir.join("file");
        trellis_tests::wait_written(
            &dir,
            || std::fs::read_to_string(&file).is_ok_and(|s| s == "kept\n").then_some(()),
            Duration::from_secs(5),
        )
        .await?;
        ensure!(
            std::fs::read_to_string(&file).ok().as_deref() == Some("kept\n"),
            "the pod wrote into the volume's directory; its log: {:?}",
            kubectl.ok(&["logs", "writer"]).await
        );

        // The claim outlives its pod; the next pod of it reads what the first wrote.
        delete_pods(&pod_api, &pods, &["writer"], Duration::from_secs(30))
            .await??;
        pod_api
            .create(
                &PostParams::default(),
                &pod(
                    "reader",
                    &format!("cat {MOUNT_AT}/file; exec sleep 600"),
                    Some(other),
                )?,
            )
            .await?;
        // It would rather run on the other node; its volume's node affinity decides.
        let reader =
            wait_pod(&pods, "reader", Duration::from_secs(60), |p| phase(p) == "Running").await?;
        ensure!(
            reader.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&*selected),
            "the second pod follows the volume to {selected}, not {:?}",
            reader.spec.as_ref().and_then(|s| s.node_name.as_deref())
        );
        // Its first line of log, as `kubectl logs -f` streams it.
        let mut follow = kubectl
            .command(&["logs", "-f", "reader"])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = follow.stdout.take().context("kubectl's output")?;
        let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
        let first = tokio::time::timeout(Duration::from_secs(5), lines.next_line())
            .await
            .context("the second pod logged nothing within 5 s")??;
        let log = first.map(|l| format!("{l}\n")).unwrap_or_default();
        ensure!(log == "kept\n", "the second pod read {log:?}");

        // kubectl's columns, as Kubernetes lists them.
        let got = kubectl.ok(&["get", "pvc,pv,sc"]).await?;
        for wanted in [
            "persistentvolumeclaim/data",
            "Bound",
            &volume_name,
            "64Mi",
            "RWO",
            "local-path",
            "storageclass.storage.k8s.io/local-path (default)",
            "trellis.dev/local-path",
            "WaitForFirstConsumer",
            "default/data",
        ] {
            ensure!(got.contains(wanted), "{wanted:?} missing from kubectl get:\n{got}");
        }

        // The claim goes: its volume (reclaim Delete) goes with it.
        delete_pods(&pod_api, &pods, &["reader"], Duration::from_secs(30))
            .await??;
        claims.delete("data", &DeleteParams::default()).await?;
        until(&volumes, &volume_name, "the claim's volume is deleted", |v| v.is_none()).await?;

        // A static volume of a class of its own binds a claim of that class, and is
        // Released, not deleted, when the claim goes.
        let static_dir = started[0].root().join("static");
        kubectl
            .ok_stdin(
                &["apply", "-f", "-"],
                &format!(
                    "apiVersion: v1\nkind: PersistentVolume\nmetadata:\n  name: manual\n\
                     spec:\n  storageClassName: manual\n  capacity:\n    storage: 1Gi\n  \
                     accessModes: [ReadWriteOnce]\n  hostPath:\n    path: {}\n---\n\
                     apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: manual\n\
                     spec:\n  storageClassName: manual\n  accessModes: [ReadWriteOnce]\n  \
                     resources:\n    requests:\n      storage: 100Mi\n",
                    static_dir.display()
                ),
            )
            .await?;
        until(&claims, "manual", "the static volume is bound", |c| {
            claim_phase(c) == "Bound"
                && c.and_then(|c| c.spec.as_ref()?.volume_name.as_deref()) == Some("manual")
        })
        .await?;
        claims.delete("manual", &DeleteParams::default()).await?;
        until(&volumes, "manual", "the static volume is released", |v| {
            v.and_then(|v| v.status.as_ref()?.phase.as_deref()) == Some("Released")
        })
        .await?;
        Ok::<_, anyhow::Error>(())
    }
    .await;

    let gone = delete_pods(&pod_api, &pods, &names, Duration::from_secs(30)).await;
    stop.stop();
    let _ = scheduler.await;
    for r in running {
        r.stop().await;
    }
    for node in started {
        node.stop().await?;
    }
    work?;
    gone.context("the pods are deleted within 30 s")?
}
