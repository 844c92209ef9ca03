//! `trellis bench controllers --case hpa`: `--hpas` Deployments of one pod (100m of
//! CPU asked) each with a HorizontalPodAutoscaler (1 to 4 replicas, 50 % CPU),
//! synced every second, on a server with the embedded store in this process. No node
//! runs the pods: a fake kubelet marks them Running and Ready, and a metrics server
//! registered through the aggregation layer serves made-up usage, every pod at twice
//! its request. `scaled_s`: from the first autoscaler's create until every Deployment
//! asks for 4 replicas, which each autoscaler reaches in one step (Kubernetes'
//! default scale-up allows 4 pods at once); the autoscaler reads each target's scale
//! and its pods' metrics through the API server and the metrics server.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;
use trellis_api::Shutdown;
use trellis_client::informer::{Change, SharedInformers};
use trellis_plugin_host::{HostConfig, PluginHost};

use super::cluster::LocalCluster;
use crate::metrics_server::scrape::{PodMetrics, Store, Usage};
use crate::setup::{ControllerSetup, Credentials, Shared, start_controllers};

/// How often each autoscaler is synced.
const SYNC_PERIOD: Duration = Duration::from_secs(1);
/// The replicas every autoscaler ends at.
const MAX_REPLICAS: i32 = 4;

#[derive(Debug, Serialize)]
struct Report {
    hpas: usize,
    sync_period_s: f64,
    scaled_s: f64,
}

/// `--case hpa` with `count` autoscalers.
pub(super) async fn run(count: usize, json: bool) -> anyhow::Result<()> {
    let cluster = LocalCluster::start().await?;
    let (stop, stopped) = Shutdown::new();
    let measured = measure(&cluster, count, stopped).await;
    stop.stop();
    let closed = cluster.stop().await;
    let report = measured?;
    closed?;
    super::print_report(json, &report, || {
        format!(
            "hpa: {} autoscalers synced every {} s scaled their Deployments in {:.3} s",
            report.hpas, report.sync_period_s, report.scaled_s
        )
    })
}

async fn measure(
    cluster: &LocalCluster,
    count: usize,
    stopped: Shutdown,
) -> anyhow::Result<Report> {
    let in_process = trellis_client::InProcess::new(cluster.server.in_process.clone());
    let admin = in_process.client(trellis_api::UserInfo::new("admin", ["system:masters"]));
    // Held to the end: the controllers run as long as these live.
    let _controllers = start(&in_process, &stopped).await?;
    let informers = SharedInformers::new();
    let pods = informers.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let deployments =
        informers.informer::<Deployment>(Api::all(admin.clone()), watcher::Config::default());
    fake_kubelet(pods.subscribe(), admin.clone(), stopped.clone());
    let store = Arc::new(Store::default());
    made_up_usage(pods.clone(), store.clone(), stopped.clone());
    let config = crate::metrics_server::Config {
        listen: "127.0.0.1:0".parse()?,
        ..Default::default()
    };
    crate::metrics_server::start_in_process_with(&in_process, config, Some(store), stopped.clone())
        .await
        .context("start the metrics server")?;

    let api: Api<Deployment> = Api::namespaced(admin.clone(), "default");
    for i in 0..count {
        let name = format!("hpa-{i}");
        let deployment = json!({
            "metadata": {"name": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [{"name": "main", "image": "busy",
                                      "resources": {"requests": {"cpu": "100m"}}}]}}},
        });
        api.create(&PostParams::default(), &serde_json::from_value(deployment)?)
            .await
            .with_context(|| format!("create Deployment {name}"))?;
    }
    let mut pod_changes = pods.subscribe();
    until(&mut pod_changes, "every first pod running", || {
        pods.list()
            .iter()
            .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .count()
            >= count
    })
    .await?;

    let hpas: Api<DynamicObject> = Api::namespaced_with(
        admin.clone(),
        "default",
        &kube::api::ApiResource {
            group: "autoscaling".into(),
            version: "v2".into(),
            api_version: "autoscaling/v2".into(),
            kind: "HorizontalPodAutoscaler".into(),
            plural: "horizontalpodautoscalers".into(),
        },
    );
    let mut deployment_changes = deployments.subscribe();
    let started = Instant::now();
    for i in 0..count {
        let name = format!("hpa-{i}");
        let hpa = json!({
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": name},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                     "minReplicas": 1, "maxReplicas": MAX_REPLICAS,
                     "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                         "target": {"type": "Utilization", "averageUtilization": 50}}}]},
        });
        hpas.create(&PostParams::default(), &serde_json::from_value(hpa)?)
            .await
            .with_context(|| format!("create HorizontalPodAutoscaler {name}"))?;
    }
    until(&mut deployment_changes, "every Deployment scaled", || {
        deployments
            .list()
            .iter()
            .filter(|d| d.spec.as_ref().and_then(|s| s.replicas) == Some(MAX_REPLICAS))
            .count()
            >= count
    })
    .await?;
    Ok(Report {
        hpas: count,
        sync_period_s: SYNC_PERIOD.as_secs_f64(),
        scaled_s: started.elapsed().as_secs_f64(),
    })
}

/// The Deployment, ReplicaSet and autoscaler controllers, the autoscaler synced every
/// [`SYNC_PERIOD`].
async fn start(
    in_process: &trellis_client::InProcess,
    stopped: &Shutdown,
) -> anyhow::Result<Vec<trellis_controllers::Running>> {
    let builtins = crate::setup::with_hpa_sync_period(
        trellis_controllers::bundled::select("deployment,replicaset,horizontalpodautoscaling")?,
        SYNC_PERIOD,
    );
    let setup = ControllerSetup {
        plugins: PluginHost::new(HostConfig::default())?,
        credentials: Credentials::InProcess(in_process.clone()),
        builtins,
        modules_dir: crate::plugins::modules_dir(None),
        running: Default::default(),
        root_ca: None,
        node_monitor_grace_period: 50,
        plugin_status_interval: Duration::from_secs(10),
        node_ipam: Default::default(),
    };
    let mut shared = Shared::new();
    shared.controllers = Some(setup.clone());
    let manager_client = in_process.client(trellis_client::identity::controller_manager());
    let manager = crate::setup::manager(&setup, &manager_client, &shared);
    let running = start_controllers(&setup, &manager, &manager_client, stopped).await;
    if running.len() != setup.builtins.len() {
        bail!("not every selected controller started (see the log)");
    }
    for r in &running {
        r.plugin.optimized().await;
    }
    Ok(running)
}

/// Marks each new pod Running and Ready since long enough ago that the autoscaler
/// counts its usage (past Kubernetes' CPU initialization period).
fn fake_kubelet(
    mut changes: tokio::sync::mpsc::UnboundedReceiver<Change<Pod>>,
    admin: kube::Client,
    stopped: Shutdown,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(64));
    tokio::spawn(async move {
        loop {
            let change = tokio::select! {
                change = changes.recv() => change,
                () = stopped.wait() => return,
            };
            let Some(Change::Added(pod)) = change else {
                if change.is_none() {
                    return;
                }
                continue;
            };
            let Ok(permit) = slots.clone().acquire_owned().await else {
                return;
            };
            let api: Api<Pod> = Api::namespaced(
                admin.clone(),
                pod.metadata.namespace.as_deref().unwrap_or("default"),
            );
            let name = pod.metadata.name.clone().unwrap_or_default();
            tokio::spawn(async move {
                let since = (jiff::Timestamp::now() - jiff::SignedDuration::from_hours(1))
                    .strftime("%Y-%m-%dT%H:%M:%SZ")
                    .to_string();
                let status = json!({"status": {"phase": "Running", "startTime": since,
                    "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": since}]}});
                let _ = api
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                    .await;
                drop(permit);
            });
        }
    });
}

/// Keeps `store` at every running pod using twice the CPU it asks for, read now over
/// a second, as each pod change comes.
fn made_up_usage(
    pods: Arc<trellis_client::informer::Informer<Pod>>,
    store: Arc<Store>,
    stopped: Shutdown,
) {
    let mut changes = pods.subscribe();
    tokio::spawn(async move {
        loop {
            let now = jiff::Timestamp::now();
            let mut metrics = BTreeMap::new();
            for pod in pods.list() {
                if pod.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running") {
                    continue;
                }
                let containers = pod
                    .spec
                    .iter()
                    .flat_map(|s| &s.containers)
                    .map(|c| {
                        let asked = c
                            .resources
                            .as_ref()
                            .and_then(|r| r.requests.as_ref())
                            .and_then(|r| r.get("cpu"))
                            .and_then(|q| q.0.strip_suffix('m'))
                            .and_then(|m| m.parse::<u64>().ok())
                            .unwrap_or(0);
                        let usage = Usage {
                            timestamp: now,
                            window: Duration::from_secs(1),
                            cpu_nano_cores: asked * 2 * 1_000_000,
                            memory_bytes: 1 << 20,
                        };
                        (c.name.clone(), usage)
                    })
                    .collect();
                metrics.insert(
                    (
                        pod.metadata.namespace.clone().unwrap_or_default(),
                        pod.metadata.name.clone().unwrap_or_default(),
                    ),
                    PodMetrics {
                        timestamp: now,
                        window: Duration::from_secs(1),
                        containers,
                        labels: pod.metadata.labels.clone().unwrap_or_default(),
                    },
                );
            }
            store.set(BTreeMap::new(), metrics);
            tokio::select! {
                change = changes.recv() => if change.is_none() { return },
                () = stopped.wait() => return,
            }
        }
    });
}

/// Waits until `done` holds, looking again at each change.
async fn until<T>(
    changes: &mut tokio::sync::mpsc::UnboundedReceiver<T>,
    what: &str,
    mut done: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let deadline = Duration::from_secs(600);
    tokio::time::timeout(deadline, async {
        while !done() {
            if changes.recv().await.is_none() {
                bail!("the informer stopped");
            }
        }
        anyhow::Ok(())
    })
    .await
    .with_context(|| format!("{what} within {deadline:?}"))?
}

#[cfg(test)]
mod tests {
    /// The benchmark at a small size: run with `cargo test -p trellis --bin trellis
    /// hpa -- --ignored`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a benchmark: starts a server and the controllers"]
    async fn ten_autoscalers_scale_their_deployments() {
        super::run(10, true).await.unwrap();
    }
}
