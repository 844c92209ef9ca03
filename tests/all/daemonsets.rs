//! DaemonSets on hollow nodes (the real agent on fake runtimes) with the built-in
//! controllers and the scheduler, driven by kubectl as Kubernetes' conformance
//! checks drive them: one pod per node, revived when stopped; a node selector that
//! a node's labels come to fit and then stop fitting; a rolling update
//! (`kubectl set image`, `rollout status`, `rollout history`); a rollback that
//! restarts no pod that already ran the old template; a failed pod replaced; a node
//! that joins gets its pod and one tainted NoExecute loses it; `kubectl drain
//! --ignore-daemonsets` (current and 1.20) evicts the node's other pods and leaves
//! the daemon's, whose pod deleted there comes back; kubectl 1.20's rollout status
//! and history.
//! One server for the module.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_agent::hollow::{HollowConfig, HollowNodes};
use trellis_api::{Shutdown, UserInfo};
use trellis_client::identity;
use trellis_client::informer::{Informer, SharedInformers};
use trellis_client::workqueue::QueueMetrics;
use trellis_controllers::Manager;
use trellis_plugin_host::{Compilers, HostConfig, PluginHost};
use trellis_tests::TestCluster;

/// Waits until `done` holds, looking again at each change of the watched objects.
async fn until(
    changes: &mut tokio::sync::mpsc::UnboundedReceiver<()>,
    what: &str,
    mut done: impl FnMut() -> Result<bool>,
) -> Result<()> {
    tokio::time::timeout(Duration::from_secs(60), async {
        while !done()? {
            if changes.recv().await.is_none() {
                bail!("the informers ended");
            }
        }
        Ok(())
    })
    .await
    .with_context(|| format!("{what} within 60 s"))?
}

/// One channel that hears every change of the informers.
fn fan_in<K>(tx: &tokio::sync::mpsc::UnboundedSender<()>, informer: &Informer<K>)
where
    K: kube::Resource
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let mut rx = informer.subscribe();
    let tx = tx.clone();
    tokio::spawn(async move {
        while rx.recv().await.is_some() {
            if tx.send(()).is_err() {
                break;
            }
        }
    });
}

fn ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn image(pod: &Pod) -> &str {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.image.as_deref())
        .unwrap_or_default()
}

/// The live pods of the DaemonSet `app`, by node.
fn daemon_pods(pods: &Informer<Pod>, app: &str) -> BTreeMap<String, Vec<Arc<Pod>>> {
    let mut by_node: BTreeMap<String, Vec<Arc<Pod>>> = BTreeMap::new();
    for p in pods.list() {
        let labels = p.metadata.labels.clone().unwrap_or_default();
        if labels.get("app").map(String::as_str) != Some(app)
            || p.metadata.deletion_timestamp.is_some()
        {
            continue;
        }
        let node = p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        by_node.entry(node).or_default().push(p);
    }
    by_node
}

/// Every node in `nodes` runs one ready pod of `app` with `image`, and no other
/// node runs one.
fn runs_everywhere(pods: &Informer<Pod>, app: &str, nodes: &[String], img: &str) -> bool {
    let by_node = daemon_pods(pods, app);
    by_node.len() == nodes.len()
        && nodes.iter().all(|n| {
            by_node
                .get(n)
                .is_some_and(|ps| ps.len() == 1 && pod_ready(&ps[0]) && image(&ps[0]) == img)
        })
}

fn status(dss: &Informer<DaemonSet>, name: &str) -> serde_json::Value {
    dss.get(&format!("default/{name}"))
        .and_then(|d| serde_json::to_value(&d.status).ok())
        .unwrap_or_default()
}

const DAEMON: &str = r#"apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: daemon-set
spec:
  selector:
    matchLabels:
      app: daemon-set
  updateStrategy:
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 1
  template:
    metadata:
      labels:
        app: daemon-set
    spec:
      containers:
      - name: app
        image: registry.k8s.io/e2e-test-images/httpd:2.4.38-4
"#;

const COMPLEX: &str = r#"apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: complex
spec:
  selector:
    matchLabels:
      app: complex
  template:
    metadata:
      labels:
        app: complex
    spec:
      nodeSelector:
        color: blue
      containers:
      - name: app
        image: registry.k8s.io/e2e-test-images/httpd:2.4.38-4
"#;

const IMAGE: &str = "registry.k8s.io/e2e-test-images/httpd:2.4.38-4";
const NEW_IMAGE: &str = "registry.k8s.io/e2e-test-images/agnhost:2.47";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_sets_follow_nodes_roll_out_roll_back_and_survive_a_drain() -> Result<()> {
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
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let dss = watching.informer::<DaemonSet>(Api::all(admin.clone()), watcher::Config::default());
    let (tx, mut changes) = tokio::sync::mpsc::unbounded_channel();
    fan_in(&tx, &nodes);
    fan_in(&tx, &pods);
    fan_in(&tx, &dss);

    let start_nodes = |prefix: &str, count: usize| {
        let (stop_nodes, nodes_stopped) = Shutdown::new();
        let informers = SharedInformers::new();
        let shared_pods = informers.informer::<Pod>(
            Api::all(in_process.client(identity::scheduler())),
            watcher::Config::default(),
        );
        let node_clients = in_process.clone();
        let mut config = HollowConfig::new(count, cluster.data_dir.join(prefix));
        config.prefix = prefix.into();
        let names: Vec<String> = (0..count).map(|i| config.node_name(i)).collect();
        let hollow = HollowNodes::start(
            config,
            move |name| node_clients.client(identity::node(name)),
            shared_pods,
            informers,
            nodes_stopped,
        );
        (stop_nodes, hollow, names)
    };
    let (stop_first, first, mut names) = start_nodes("ds", 3);
    until(&mut changes, "every node Ready", || {
        Ok(names
            .iter()
            .all(|n| nodes.get(n).is_some_and(|node| ready(&node))))
    })
    .await?;

    // "should run and stop simple daemon": a pod on each node; one stopped is
    // revived.
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], DAEMON)
        .await?;
    until(&mut changes, "a ready daemon pod on every node", || {
        Ok(runs_everywhere(&pods, "daemon-set", &names, IMAGE)
            && status(&dss, "daemon-set")["numberAvailable"] == 3)
    })
    .await?;
    let st = status(&dss, "daemon-set");
    ensure!(
        st["desiredNumberScheduled"] == 3
            && st["currentNumberScheduled"] == 3
            && st["updatedNumberScheduled"] == 3
            && st["numberMisscheduled"] == 0
            && st["observedGeneration"] == 1,
        "{st}"
    );
    let victim = daemon_pods(&pods, "daemon-set")[&names[0]][0]
        .metadata
        .name
        .clone()
        .context("a pod name")?;
    let pod_api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    pod_api.delete(&victim, &Default::default()).await?;
    until(&mut changes, "the stopped daemon pod revived", || {
        let by_node = daemon_pods(&pods, "daemon-set");
        Ok(runs_everywhere(&pods, "daemon-set", &names, IMAGE)
            && by_node[&names[0]][0].metadata.name.as_deref() != Some(victim.as_str()))
    })
    .await?;

    // "should run and stop complex daemon": pods follow a node selector.
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], COMPLEX)
        .await?;
    until(&mut changes, "the complex daemon set observed", || {
        Ok(status(&dss, "complex")["observedGeneration"] == 1)
    })
    .await?;
    ensure!(
        daemon_pods(&pods, "complex").is_empty(),
        "a pod on no blue node"
    );
    cluster
        .kubectl_ok(&["label", "node", &names[1], "color=blue"])
        .await?;
    until(
        &mut changes,
        "a complex daemon pod on the blue node",
        || Ok(runs_everywhere(&pods, "complex", &names[1..2], IMAGE)),
    )
    .await?;
    cluster
        .kubectl_ok(&["label", "node", &names[1], "color=green", "--overwrite"])
        .await?;
    until(
        &mut changes,
        "the complex daemon pod gone from the green node",
        || {
            Ok(daemon_pods(&pods, "complex").is_empty()
                && status(&dss, "complex")["desiredNumberScheduled"] == 0)
        },
    )
    .await?;
    cluster.kubectl_ok(&["delete", "ds", "complex"]).await?;

    // "should update pod when spec was updated and update strategy is
    // RollingUpdate", and kubectl's rollout commands.
    cluster
        .kubectl_ok(&["set", "image", "ds/daemon-set", &format!("app={NEW_IMAGE}")])
        .await?;
    let out = cluster
        .kubectl_ok(&["rollout", "status", "ds/daemon-set", "--timeout=60s"])
        .await?;
    ensure!(out.contains("successfully rolled out"), "{out}");
    ensure!(
        runs_everywhere(&pods, "daemon-set", &names, NEW_IMAGE) || {
            until(&mut changes, "every pod of the new template", || {
                Ok(runs_everywhere(&pods, "daemon-set", &names, NEW_IMAGE))
            })
            .await
            .is_ok()
        }
    );
    let history = cluster
        .kubectl_ok(&["rollout", "history", "ds/daemon-set"])
        .await?;
    ensure!(
        history
            .lines()
            .filter(|l| l.starts_with('1') || l.starts_with('2'))
            .count()
            == 2,
        "{history}"
    );
    let revision2 = cluster
        .kubectl_ok(&["rollout", "history", "ds/daemon-set", "--revision=2"])
        .await?;
    ensure!(revision2.contains(NEW_IMAGE), "{revision2}");

    // "should rollback without unnecessary restarts": a template whose pods never
    // become ready stalls after one node; the rollback replaces that node's pod
    // and restarts none of the others.
    let before: BTreeMap<String, String> = daemon_pods(&pods, "daemon-set")
        .into_iter()
        .map(|(n, ps)| (n, ps[0].metadata.name.clone().unwrap_or_default()))
        .collect();
    let dss_api: Api<DaemonSet> = Api::namespaced(admin.clone(), "default");
    dss_api
        .patch(
            "daemon-set",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"template": {"spec": {"containers": [
                {"name": "app", "image": "registry.k8s.io/e2e-test-images/bad:1",
                 "readinessProbe": {"tcpSocket": {"port": 1}, "periodSeconds": 1}}]}}}})),
        )
        .await?;
    until(
        &mut changes,
        "one node on the template that never gets ready",
        || {
            let by_node = daemon_pods(&pods, "daemon-set");
            let bad = by_node
                .values()
                .flatten()
                .filter(|p| image(p).ends_with("bad:1"))
                .count();
            // Scheduled: its node is the one whose pod the rollback replaces.
            Ok(bad == 1
                && !by_node.contains_key("")
                && status(&dss, "daemon-set")["observedGeneration"] == 3)
        },
    )
    .await?;
    let stalled: Vec<String> = daemon_pods(&pods, "daemon-set")
        .into_iter()
        .filter(|(_, ps)| ps.iter().any(|p| image(p).ends_with("bad:1")))
        .map(|(n, _)| n)
        .collect();
    let out = cluster
        .kubectl_ok(&["rollout", "undo", "ds/daemon-set"])
        .await?;
    ensure!(out.contains("rolled back"), "{out}");
    until(&mut changes, "the rollback complete", || {
        Ok(runs_everywhere(&pods, "daemon-set", &names, NEW_IMAGE)
            && status(&dss, "daemon-set")["updatedNumberScheduled"] == 3)
    })
    .await?;
    for (node, pods_there) in daemon_pods(&pods, "daemon-set") {
        let name = pods_there[0].metadata.name.clone().unwrap_or_default();
        ensure!(
            stalled.contains(&node) != (before.get(&node) == Some(&name)),
            "node {node}: pod {name}, before {:?}, stalled {stalled:?}",
            before.get(&node)
        );
    }

    // "should retry creating failed daemon pods": a pod marked Failed is replaced.
    let failing = daemon_pods(&pods, "daemon-set")[&names[2]][0]
        .metadata
        .name
        .clone()
        .unwrap_or_default();
    pod_api
        .patch_status(
            &failing,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Failed"}})),
        )
        .await?;
    until(&mut changes, "the failed daemon pod replaced", || {
        let by_node = daemon_pods(&pods, "daemon-set");
        Ok(runs_everywhere(&pods, "daemon-set", &names, NEW_IMAGE)
            && by_node[&names[2]][0].metadata.name.as_deref() != Some(failing.as_str()))
    })
    .await?;

    // A node that joins gets its pod; a node tainted NoExecute loses it.
    let (stop_late, late, late_names) = start_nodes("ds-late", 1);
    names.extend(late_names);
    until(&mut changes, "the joined node runs the daemon", || {
        Ok(runs_everywhere(&pods, "daemon-set", &names, NEW_IMAGE))
    })
    .await?;
    cluster
        .kubectl_ok(&["taint", "node", &names[0], "dedicated=db:NoExecute"])
        .await?;
    until(&mut changes, "the tainted node's daemon pod gone", || {
        Ok(runs_everywhere(&pods, "daemon-set", &names[1..], NEW_IMAGE)
            && status(&dss, "daemon-set")["desiredNumberScheduled"] == 3)
    })
    .await?;

    // kubectl drain leaves the daemon's pods (they would come back) and evicts the
    // others; 1.20 as the current one.
    for (i, kubectl) in [cluster.admin().clone(), cluster.kubectl_1_20()?]
        .into_iter()
        .enumerate()
    {
        let node = &names[1 + i];
        let other = format!("other-{i}");
        cluster
            .kubectl_ok_stdin(
                &["create", "-f", "-"],
                &json!({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": other, "namespace": "default"},
                        "spec": {"nodeName": node,
                                 "containers": [{"name": "c", "image": IMAGE}]}})
                .to_string(),
            )
            .await?;
        let out = kubectl
            .ok(&[
                "drain",
                node,
                "--ignore-daemonsets",
                "--force",
                "--timeout=60s",
            ])
            .await?;
        // 1.20 ends with "node/NAME evicted", later ones with "drained".
        ensure!(
            out.contains(&format!("node/{node} drained"))
                || out.contains(&format!("node/{node} evicted")),
            "{out}"
        );
        ensure!(
            pod_api.get_opt(&other).await?.is_none() || {
                until(&mut changes, "the drained pod gone", || {
                    Ok(pods.get(&format!("default/{other}")).is_none())
                })
                .await
                .is_ok()
            }
        );
        ensure!(
            daemon_pods(&pods, "daemon-set").contains_key(node),
            "the daemon pod left the drained node {node}"
        );
        let unschedulable = nodes
            .get(node)
            .and_then(|n| n.spec.as_ref().and_then(|s| s.unschedulable))
            == Some(true);
        ensure!(unschedulable, "{node} not cordoned");
        if i == 0 {
            // Daemon pods tolerate the cordon: one deleted comes back on the node.
            let gone = daemon_pods(&pods, "daemon-set")[node][0]
                .metadata
                .name
                .clone()
                .unwrap_or_default();
            pod_api.delete(&gone, &Default::default()).await?;
            until(
                &mut changes,
                "the daemon pod back on the cordoned node",
                || {
                    Ok(daemon_pods(&pods, "daemon-set")
                        .get(node)
                        .is_some_and(|ps| {
                            ps.len() == 1
                                && ps[0].metadata.name.as_deref() != Some(gone.as_str())
                                && pod_ready(&ps[0])
                        }))
                },
            )
            .await?;
        }
    }

    // kubectl 1.20 reads the same status and revisions.
    let old_kubectl = cluster.kubectl_1_20()?;
    let out = old_kubectl
        .ok(&["rollout", "status", "ds/daemon-set", "--timeout=60s"])
        .await?;
    ensure!(out.contains("successfully rolled out"), "{out}");
    let history = old_kubectl
        .ok(&["rollout", "history", "ds/daemon-set"])
        .await?;
    ensure!(history.contains("REVISION"), "{history}");

    cluster.kubectl_ok(&["delete", "ds", "daemon-set"]).await?;
    until(&mut changes, "the daemon's pods gone", || {
        Ok(daemon_pods(&pods, "daemon-set").is_empty())
    })
    .await?;

    for (stop_nodes, hollow) in [(stop_first, first), (stop_late, late)] {
        stop_nodes.stop();
        tokio::time::timeout(Duration::from_secs(10), hollow.wait())
            .await
            .context("the hollow nodes did not stop within 10 s")??;
    }
    stop.stop();
    scheduler.await??;
    for c in controllers {
        c.stop().await;
    }
    cluster.stop().await
}
