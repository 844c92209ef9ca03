//! Hollow nodes (`trellis_agent::hollow`): the real agent on fake runtimes, many in one
//! process, against a real server with the built-in controllers and the scheduler:
//! the nodes register Ready, each with its own Lease; a Deployment's pods are spread
//! over them and reach Running; deleting it removes the fake containers; stopping the
//! nodes ends them cleanly.

use std::sync::Arc;
use std::time::Duration;
use trellis_api::Shutdown;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_agent::hollow::{HollowConfig, HollowNodes};
use trellis_api::UserInfo;
use trellis_client::identity;
use trellis_client::informer::SharedInformers;
use trellis_client::workqueue::QueueMetrics;
use trellis_controllers::Manager;
use trellis_plugin_host::{Compilers, HostConfig, PluginHost};
use trellis_tests::TestCluster;

const NODES: usize = 4;
const REPLICAS: i32 = 8;

/// Waits until `done` holds, looking again at each change `changes` brings.
async fn until<T>(
    changes: &mut tokio::sync::mpsc::UnboundedReceiver<T>,
    what: &str,
    mut done: impl FnMut() -> bool,
) -> Result<()> {
    tokio::time::timeout(Duration::from_secs(30), async {
        while !done() {
            if changes.recv().await.is_none() {
                bail!("the informer ended");
            }
        }
        Ok(())
    })
    .await
    .with_context(|| format!("{what} within 30 s"))?
}

fn ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn running(pod: &Pod) -> bool {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hollow_nodes_register_run_a_deployment_and_stop_cleanly() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let in_process = cluster.in_process();
    let admin = in_process.client(UserInfo::new("admin", ["system:masters"]));
    let (stop, stopped) = Shutdown::new();
    let host = PluginHost::new(HostConfig {
        compilers: Compilers::Baseline,
        ..HostConfig::default()
    })?;
    let manager = Manager {
        plugins: host.clone(),
        informers: SharedInformers::new(),
        lister: in_process.client(identity::controller_manager()),
        queues: QueueMetrics::default(),
        running: Default::default(),
    };
    let controllers = super::controllers::start_builtins(&manager, &in_process, &stopped).await?;
    let scheduler = super::scheduler::spawn(
        &in_process,
        host.clone(),
        vec![super::scheduler::default_plugins(&host).await?],
        stopped.clone(),
    );

    let watching = SharedInformers::new();
    let nodes = watching.informer::<Node>(Api::all(admin.clone()), watcher::Config::default());
    let leases = watching.informer::<Lease>(
        Api::namespaced(admin.clone(), "kube-node-lease"),
        watcher::Config::default(),
    );
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let mut node_changes = nodes.subscribe();
    let mut pod_changes = pods.subscribe();

    // The nodes' shared informer of pods lists as the scheduler does; each node acts
    // as itself, held to the Node authorizer.
    let (stop_nodes, nodes_stopped) = Shutdown::new();
    let root = cluster.data_dir.join("hollow");
    let informers = SharedInformers::new();
    let shared_pods = informers.informer::<Pod>(
        Api::all(in_process.client(identity::scheduler())),
        watcher::Config::default(),
    );
    let node_clients = in_process.clone();
    let hollow = HollowNodes::start(
        HollowConfig::new(NODES, root),
        move |name| node_clients.client(identity::node(name)),
        shared_pods,
        informers,
        nodes_stopped,
    );

    let names: Vec<String> = (0..NODES).map(|i| format!("hollow-{i:05}")).collect();
    until(&mut node_changes, "every hollow node Ready", || {
        names
            .iter()
            .all(|n| nodes.get(n).is_some_and(|node| ready(&node)))
    })
    .await?;
    leases.wait_synced().await;
    for name in &names {
        let lease = leases
            .get(&format!("kube-node-lease/{name}"))
            .or(Api::<Lease>::namespaced(admin.clone(), "kube-node-lease")
                .get_opt(name)
                .await?
                .map(Arc::new))
            .with_context(|| format!("the Lease of {name}"))?;
        ensure!(
            lease
                .spec
                .as_ref()
                .and_then(|s| s.holder_identity.as_deref())
                == Some(name.as_str()),
            "{lease:?}"
        );
        let node = nodes.get(name).context("the node")?;
        let status = node.status.as_ref().context("the node's status")?;
        ensure!(
            status
                .capacity
                .as_ref()
                .and_then(|c| c.get("cpu"))
                .map(|q| q.0.as_str())
                == Some("32"),
            "{status:?}"
        );
        let handlers: Vec<_> = status
            .runtime_handlers
            .iter()
            .flatten()
            .filter_map(|h| h.name.as_deref())
            .collect();
        ensure!(handlers == ["wasmtime", "process"], "{handlers:?}");
    }

    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), "default");
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": REPLICAS, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"containers": [{"name": "c", "image": "example.com/web:1"}]}}}
    }))?;
    deployments
        .create(&PostParams::default(), &deployment)
        .await?;
    let web = || {
        pods.list()
            .into_iter()
            .filter(|p| {
                p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("app"))
                    .map(String::as_str)
                    == Some("web")
            })
            .collect::<Vec<_>>()
    };
    until(
        &mut pod_changes,
        "every pod of the Deployment Running",
        || {
            let web = web();
            web.len() == REPLICAS as usize && web.iter().all(|p| running(p))
        },
    )
    .await?;
    let mut used: Vec<String> = web()
        .iter()
        .filter_map(|p| p.spec.as_ref().and_then(|s| s.node_name.clone()))
        .collect();
    used.sort();
    used.dedup();
    ensure!(used.len() > 1, "the pods were not spread: {used:?}");
    ensure!(used.iter().all(|n| names.contains(n)), "{used:?}");
    ensure!(
        hollow.containers() == REPLICAS as usize,
        "{} fake containers",
        hollow.containers()
    );

    // The garbage collector deletes the ReplicaSet and its pods; each agent stops and
    // removes its containers before the pod goes.
    deployments.delete("web", &DeleteParams::default()).await?;
    until(&mut pod_changes, "the Deployment's pods gone", || {
        web().is_empty()
    })
    .await?;
    ensure!(
        hollow.containers() == 0,
        "{} fake containers left",
        hollow.containers()
    );
    ensure!(
        hollow.runtimes().iter().all(|r| r.sandbox_count() == 0),
        "sandboxes left"
    );

    // Stopped, every node's agent ends at once and without error.
    stop_nodes.stop();
    tokio::time::timeout(Duration::from_secs(10), hollow.wait())
        .await
        .context("the hollow nodes did not stop within 10 s")??;

    stop.stop();
    scheduler.await??;
    for c in controllers {
        c.stop().await;
    }
    cluster.stop().await
}
