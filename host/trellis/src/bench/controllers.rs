//! `trellis bench controllers`: the built-in controllers at work, as `trellis up` runs
//! them (bundled WASM plugins over the in-process transport, each as its own user),
//! on a server with the embedded store in this process, with no scheduler.
//!
//! - `pods_created_s`: from the create of a Deployment of `--replicas` pods to the
//!   last of its pods seen by a watch (Deployment → ReplicaSet → Pods).
//! - `rollout_s`: a new image, from the update until the Deployment reports every
//!   replica updated and available, while a fake kubelet marks each new pod Running
//!   and Ready as soon as it appears (the old ones are deleted as the rollout goes).
//! - `reconcile_p50_us`, `reconcile_p99_us`: one reconcile of the ReplicaSet
//!   controller for a key whose object does not exist: the WASM boundary (the call,
//!   an instance, one cache read) and nothing else, called back to back on optimized
//!   code before the Deployment exists; `reconcile_in_guest_mean_us`, the mean of
//!   the same calls on the plugin host's call threads, without the two thread
//!   wake-ups that hand a call to those threads and its answer back.

use std::time::Duration;
use trellis_api::Shutdown;

use anyhow::{Context as _, bail};
use clap::Args;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;
use trellis_client::informer::{BY_LABEL, Change, SharedInformers};
use trellis_plugin_host::{GroupVersionResource, HostConfig, ObjectKey, PluginHost};

use super::cluster::LocalCluster;
use crate::setup::{ControllerSetup, Credentials, Shared, start_controllers};

#[derive(Debug, Args)]
pub struct ControllersArgs {
    /// Pods of the Deployment.
    #[arg(long, default_value_t = 1000)]
    replicas: usize,

    /// Reconciles timed for the boundary's percentiles.
    #[arg(long, default_value_t = 5000)]
    calls: usize,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    replicas: usize,
    pods_created_s: f64,
    rollout_s: f64,
    reconcile_p50_us: f64,
    reconcile_p99_us: f64,
    /// The mean of the same calls on the plugin host's call threads alone.
    reconcile_in_guest_mean_us: f64,
}

pub async fn run(args: ControllersArgs) -> anyhow::Result<()> {
    let cluster = LocalCluster::start().await?;
    let measured = measure(&cluster, &args).await;
    let stopped = cluster.stop().await;
    let report = measured?;
    stopped?;
    super::print_report(args.json, &report, || {
        format!(
            "controllers: {} pods created in {:.3} s, rolled out in {:.3} s; a reconcile at the WASM boundary p50 {:.1} µs, p99 {:.1} µs ({:.1} µs on the call threads)",
            report.replicas,
            report.pods_created_s,
            report.rollout_s,
            report.reconcile_p50_us,
            report.reconcile_p99_us,
            report.reconcile_in_guest_mean_us,
        )
    })
}

/// Marks each pod Running and Ready once it appears, as a kubelet would once its
/// containers run; ends when `stop` is dropped or sent.
fn fake_kubelet(
    informers: &SharedInformers,
    admin: kube::Client,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let pods = informers.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let mut changes = pods.subscribe();
    // Status writes in flight at once, as many kubelets would make them.
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
    tokio::spawn(async move {
        loop {
            let change = tokio::select! {
                change = changes.recv() => change,
                _ = &mut stop => return,
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
                let now = k8s_openapi::jiff::Timestamp::now().to_string();
                let status = json!({"status": {"phase": "Running", "conditions": [
                    {"type": "Ready", "status": "True", "lastTransitionTime": now}]}});
                // A pod deleted meanwhile needs no status.
                let _ = api
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                    .await;
                drop(permit);
            });
        }
    });
}

async fn measure(cluster: &LocalCluster, args: &ControllersArgs) -> anyhow::Result<Report> {
    let in_process = trellis_client::InProcess::new(cluster.server.in_process.clone());
    let admin = in_process.client(trellis_api::UserInfo::new("admin", ["system:masters"]));
    let mut shared = Shared::new();
    let setup = ControllerSetup {
        plugins: PluginHost::new(HostConfig::default())?,
        credentials: Credentials::InProcess(in_process.clone()),
        builtins: trellis_controllers::bundled::select("*")?,
        modules_dir: crate::plugins::modules_dir(None),
        running: Default::default(),
        root_ca: None,
        node_monitor_grace_period: 50,
        plugin_status_interval: Duration::from_secs(10),
        node_ipam: Default::default(),
    };
    shared.controllers = Some(setup.clone());
    let (stop, stopped) = Shutdown::new();
    let manager_client = in_process.client(trellis_client::identity::controller_manager());
    let manager = crate::setup::manager(&setup, &manager_client, &shared);
    let running = start_controllers(&setup, &manager, &manager_client, &stopped).await;
    let expected = setup.builtins.iter().filter(|b| !b.needs_root_ca).count();
    if running.len() != expected {
        bail!("not every built-in controller started (see the log)");
    }

    let watching = SharedInformers::new();
    let (kubelet_stop, kubelet_stopped) = tokio::sync::oneshot::channel();
    fake_kubelet(&watching, admin.clone(), kubelet_stopped);
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let deployments =
        watching.informer::<Deployment>(Api::all(admin.clone()), watcher::Config::default());
    pods.wait_synced().await;
    deployments.wait_synced().await;
    let mut pod_changes = pods.subscribe();
    let mut deployment_changes = deployments.subscribe();
    // The boundary alone, on optimized code (every plugin's: Cranelift compiling one
    // in the background takes a core) and before any other work (after a rollout it
    // would time the rollout's tail of event and status writes sharing the cores):
    // a key with no object behind it.
    let replicaset = running
        .iter()
        .find(|r| r.plugin.name() == "replicaset-controller")
        .context("no ReplicaSet controller")?;
    for r in &running {
        r.plugin.optimized().await;
    }
    let key = ObjectKey {
        resource: GroupVersionResource {
            group: "apps".into(),
            version: "v1".into(),
            resource: "replicasets".into(),
        },
        namespace: Some("default".into()),
        name: "absent".into(),
    };
    let (calls_before, time_before) = replicaset.plugin.metrics.latency();
    let mut samples = Vec::with_capacity(args.calls);
    for _ in 0..args.calls {
        let call = Instant::now();
        replicaset
            .plugin
            .reconcile(&setup.plugins, &key)
            .await?
            .map_err(|e| anyhow::anyhow!("reconcile: {e}"))?;
        samples.push(call.elapsed());
    }
    let percentiles = super::Percentiles::of(&mut samples);
    let (calls_after, time_after) = replicaset.plugin.metrics.latency();
    let in_guest_us =
        (time_after - time_before).as_secs_f64() * 1e6 / (calls_after - calls_before).max(1) as f64;
    let api: Api<Deployment> = Api::namespaced(admin.clone(), "default");
    let deadline = Duration::from_secs(600);

    let started = Instant::now();
    api.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": "bench"},
            "spec": {"replicas": args.replicas,
                "selector": {"matchLabels": {"app": "bench"}},
                "template": {"metadata": {"labels": {"app": "bench"}},
                    "spec": {"containers": [{"name": "c", "image": "bench:1"}]}}}}))?,
    )
    .await
    .context("create the Deployment")?;
    tokio::time::timeout(deadline, async {
        while pods.by_index(BY_LABEL, "app=bench").len() < args.replicas {
            if pod_changes.recv().await.is_none() {
                bail!("the informer stopped");
            }
        }
        anyhow::Ok(())
    })
    .await
    .with_context(|| format!("{} pods within {deadline:?}", args.replicas))??;
    let pods_created_s = started.elapsed().as_secs_f64();

    let replicas = i32::try_from(args.replicas)?;
    let complete = |generation: i64| {
        deployments.get("default/bench").is_some_and(|d| {
            let s = d.status.clone().unwrap_or_default();
            s.observed_generation >= Some(generation)
                && s.updated_replicas == Some(replicas)
                && s.available_replicas == Some(replicas)
                && s.replicas == Some(replicas)
        })
    };
    tokio::time::timeout(deadline, async {
        while !complete(1) {
            if deployment_changes.recv().await.is_none() {
                bail!("the informer stopped");
            }
        }
        anyhow::Ok(())
    })
    .await
    .with_context(|| format!("the Deployment available within {deadline:?}"))??;

    let started = Instant::now();
    let updated = api
        .patch(
            "bench",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "bench:2"}]}}}})),
        )
        .await
        .context("update the image")?;
    let generation = updated.metadata.generation.unwrap_or(2);
    tokio::time::timeout(deadline, async {
        while !complete(generation) {
            if deployment_changes.recv().await.is_none() {
                bail!("the informer stopped");
            }
        }
        anyhow::Ok(())
    })
    .await
    .with_context(|| format!("the rollout within {deadline:?}"))??;
    let rollout_s = started.elapsed().as_secs_f64();

    let _ = kubelet_stop.send(());
    stop.stop();
    for r in running {
        r.stop().await;
    }
    Ok(Report {
        replicas: args.replicas,
        pods_created_s,
        rollout_s,
        reconcile_p50_us: percentiles.p50_ms * 1e3,
        reconcile_p99_us: percentiles.p99_ms * 1e3,
        reconcile_in_guest_mean_us: (in_guest_us * 10.0).round() / 10.0,
    })
}
