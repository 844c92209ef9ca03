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
//!
//! `--case daemonset`: a DaemonSet over `--nodes` Node objects (no agents: the fake
//! kubelet marks each pod Running and Ready, the pods stay unbound, pinned to their
//! node by the controller's node affinity, which is how it counts them), or with
//! `--hollow` over hollow nodes with the scheduler binding the pods and the nodes'
//! agents running them: `created_s` from the create until the status says every
//! pod available, then `rollout_s` for a new image rolled out with
//! `maxUnavailable: 10%`.
//!
//! `--case jobs`: `--jobs` Jobs of one completion, created at once; the fake kubelet
//! marks each pod Succeeded: `complete_s` from the first create until every Job has
//! its `Complete` condition.

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

/// What `trellis bench controllers` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Case {
    /// A Deployment's pods created and rolled out, and the WASM boundary.
    Deployment,
    /// A DaemonSet over many nodes created and rolled out.
    Daemonset,
    /// Many Jobs of one completion run to completion.
    Jobs,
    /// Many HorizontalPodAutoscalers scaling their Deployments.
    Hpa,
}

#[derive(Debug, Args)]
pub struct ControllersArgs {
    /// What to measure.
    #[arg(long, value_enum, default_value_t = Case::Deployment)]
    case: Case,

    /// Nodes of the DaemonSet case.
    #[arg(long, default_value_t = 1000)]
    nodes: usize,

    /// The DaemonSet case on hollow nodes with the scheduler, rather than on Node
    /// objects with a fake kubelet.
    #[arg(long)]
    hollow: bool,

    /// The hollow nodes' settings.
    #[command(flatten)]
    hollow_flags: crate::hollow::HollowFlags,

    /// The scheduler's settings (hollow nodes).
    #[command(flatten)]
    scheduler: crate::setup::SchedulerFlags,

    /// Jobs of the jobs case.
    #[arg(long, default_value_t = 1000)]
    jobs: usize,

    /// Autoscalers (each with its Deployment) of the hpa case.
    #[arg(long, default_value_t = 1000)]
    hpas: usize,

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
    match args.case {
        Case::Deployment => {}
        Case::Daemonset => return daemonset(&args).await,
        Case::Jobs => return jobs(args.jobs, args.json).await,
        Case::Hpa => return super::hpa::run(args.hpas, args.json).await,
    }
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

/// The built-in controllers `selection` names, started as `trellis up` starts them.
async fn start_selected(
    cluster: &LocalCluster,
    selection: &str,
) -> anyhow::Result<(Vec<trellis_controllers::Running>, trellis_api::Stop)> {
    let in_process = trellis_client::InProcess::new(cluster.server.in_process.clone());
    let mut shared = Shared::new();
    let setup = ControllerSetup {
        plugins: PluginHost::new(HostConfig::default())?,
        credentials: Credentials::InProcess(in_process.clone()),
        builtins: trellis_controllers::bundled::select(selection)?,
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
    if running.len() != setup.builtins.len() {
        bail!("not every selected controller started (see the log)");
    }
    for r in &running {
        r.plugin.optimized().await;
    }
    Ok((running, stop))
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

#[derive(Debug, Serialize)]
struct DaemonSetReport {
    nodes: usize,
    /// On hollow nodes (the scheduler binds the pods, the nodes' agents run them),
    /// else on Node objects alone with a fake kubelet.
    hollow: bool,
    created_s: f64,
    rollout_s: f64,
}

/// `--case daemonset`.
async fn daemonset(args: &ControllersArgs) -> anyhow::Result<()> {
    let cluster = LocalCluster::start().await?;
    let measured = if args.hollow {
        daemonset_on_hollow_nodes(&cluster, args).await
    } else {
        daemonset_on_node_objects(&cluster, args.nodes).await
    };
    let stopped = cluster.stop().await;
    let report = measured?;
    stopped?;
    super::print_report(args.json, &report, || {
        format!(
            "controllers: a DaemonSet on {} {} available in {:.3} s, a new image rolled out (maxUnavailable 10%) in {:.3} s",
            report.nodes,
            if report.hollow {
                "hollow nodes"
            } else {
                "nodes"
            },
            report.created_s,
            report.rollout_s,
        )
    })
}

/// Creates the DaemonSet, waits until its pod on each of `nodes` nodes is available,
/// then rolls a new image out: `(created_s, rollout_s)`.
async fn roll_daemonset(admin: &kube::Client, nodes: usize) -> anyhow::Result<(f64, f64)> {
    use k8s_openapi::api::apps::v1::DaemonSet;

    let watching = SharedInformers::new();
    let dss = watching.informer::<DaemonSet>(Api::all(admin.clone()), watcher::Config::default());
    dss.wait_synced().await;
    let mut changes = dss.subscribe();
    let complete = |generation: i64| {
        dss.get("default/bench").is_some_and(|d| {
            let s = d.status.clone().unwrap_or_default();
            let n = i32::try_from(nodes).unwrap_or(i32::MAX);
            s.observed_generation >= Some(generation)
                && s.desired_number_scheduled == n
                && s.updated_number_scheduled == Some(n)
                && s.number_available == Some(n)
        })
    };
    let api: Api<DaemonSet> = Api::namespaced(admin.clone(), "default");
    let started = Instant::now();
    api.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": "bench"},
            "spec": {"selector": {"matchLabels": {"app": "bench"}},
                "updateStrategy": {"type": "RollingUpdate",
                                   "rollingUpdate": {"maxUnavailable": "10%"}},
                "template": {"metadata": {"labels": {"app": "bench"}},
                    "spec": {"containers": [{"name": "c", "image": "bench:1"}]}}}}))?,
    )
    .await
    .context("create the DaemonSet")?;
    until(&mut changes, "every daemon pod available", || complete(1)).await?;
    let created_s = started.elapsed().as_secs_f64();

    let started = Instant::now();
    let updated = api
        .patch(
            "bench",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"template": {"spec": {"containers": [
                {"name": "c", "image": "bench:2"}]}}}})),
        )
        .await
        .context("update the image")?;
    let generation = updated.metadata.generation.unwrap_or(2);
    until(&mut changes, "the rollout", || complete(generation)).await?;
    Ok((created_s, started.elapsed().as_secs_f64()))
}

/// The DaemonSet case on Node objects with no agent behind them.
async fn daemonset_on_node_objects(
    cluster: &LocalCluster,
    nodes: usize,
) -> anyhow::Result<DaemonSetReport> {
    use futures::StreamExt as _;
    use k8s_openapi::api::core::v1::Node;

    let in_process = trellis_client::InProcess::new(cluster.server.in_process.clone());
    let admin = in_process.client(trellis_api::UserInfo::new("admin", ["system:masters"]));
    // No node lifecycle: nodes without agents would be tainted unreachable.
    let (running, stop) = start_selected(cluster, "daemonset,garbage-collector").await?;
    let node_api: Api<Node> = Api::all(admin.clone());
    let made: Vec<anyhow::Result<Node>> = futures::stream::iter(0..nodes)
        .map(|i| {
            let node_api = node_api.clone();
            async move {
                let node =
                    serde_json::from_value(json!({"metadata": {"name": format!("bench-{i:05}")}}))?;
                Ok(node_api.create(&PostParams::default(), &node).await?)
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    made.into_iter()
        .collect::<anyhow::Result<Vec<_>>>()
        .context("create the nodes")?;
    let watching = SharedInformers::new();
    let (kubelet_stop, kubelet_stopped) = tokio::sync::oneshot::channel();
    fake_kubelet(&watching, admin.clone(), kubelet_stopped);
    let (created_s, rollout_s) = roll_daemonset(&admin, nodes).await?;
    let _ = kubelet_stop.send(());
    stop.stop();
    for r in running {
        r.stop().await;
    }
    Ok(DaemonSetReport {
        nodes,
        hollow: false,
        created_s,
        rollout_s,
    })
}

/// The DaemonSet case on hollow nodes, with the scheduler, as `trellis up
/// --hollow-nodes` runs them.
async fn daemonset_on_hollow_nodes(
    cluster: &LocalCluster,
    args: &ControllersArgs,
) -> anyhow::Result<DaemonSetReport> {
    use k8s_openapi::api::core::v1::Node;

    let in_process = trellis_client::InProcess::new(cluster.server.in_process.clone());
    let admin = in_process.client(trellis_api::UserInfo::new("admin", ["system:masters"]));
    let mut shared = Shared::new();
    let plugins = PluginHost::new(HostConfig {
        cache_dir: Some(cluster.dir.path().join("plugin-cache")),
        ..HostConfig::default()
    })?;
    shared.controllers = Some(ControllerSetup {
        plugins: plugins.clone(),
        credentials: Credentials::InProcess(in_process.clone()),
        builtins: trellis_controllers::bundled::select("daemonset,garbage-collector")?,
        modules_dir: cluster.dir.path().join("plugin-cache").join("modules"),
        running: Default::default(),
        root_ca: None,
        node_monitor_grace_period: 50,
        plugin_status_interval: Duration::from_secs(10),
        node_ipam: Default::default(),
    });
    shared.scheduler = Some(crate::setup::SchedulerSetup {
        plugins,
        flags: args.scheduler.clone(),
        metrics: Default::default(),
    });
    let (stop, stopped) = Shutdown::new();
    let components = crate::components::start_in_process(&in_process, &shared, stopped.clone());
    let reader = in_process.client(trellis_client::identity::scheduler());
    let node_informer = shared
        .informers
        .informer::<Node>(Api::all(reader), watcher::Config::default());
    let mut node_changes = node_informer.subscribe();
    let config = args
        .hollow_flags
        .config(args.nodes, cluster.dir.path().join("hollow"));
    let hollow =
        crate::hollow::start_in_process(&in_process, &shared.informers, config, stopped.clone());
    let ready = |n: &Node| {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    };
    until(&mut node_changes, "every hollow node Ready", || {
        node_informer.list().iter().filter(|n| ready(n)).count() >= args.nodes
    })
    .await?;
    let (created_s, rollout_s) = roll_daemonset(&admin, args.nodes).await?;
    stop.stop();
    let _ = tokio::time::timeout(Duration::from_secs(30), hollow.wait()).await;
    for component in components {
        let _ = tokio::time::timeout(Duration::from_secs(30), component).await;
    }
    Ok(DaemonSetReport {
        nodes: args.nodes,
        hollow: true,
        created_s,
        rollout_s,
    })
}

/// Marks each pod Succeeded once it appears, as a kubelet would once its one
/// container exited 0.
fn fake_kubelet_succeeding(
    informers: &SharedInformers,
    admin: kube::Client,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let pods = informers.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let mut changes = pods.subscribe();
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
            let container = pod
                .spec
                .as_ref()
                .and_then(|s| s.containers.first())
                .map(|c| c.name.clone())
                .unwrap_or_default();
            tokio::spawn(async move {
                let now = k8s_openapi::jiff::Timestamp::now().to_string();
                let status = json!({"status": {"phase": "Succeeded", "containerStatuses": [
                    {"name": container, "image": "bench:1", "imageID": "", "ready": false,
                     "restartCount": 0, "state": {"terminated": {"exitCode": 0,
                        "reason": "Completed", "startedAt": now, "finishedAt": now}}}]}});
                let _ = api
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                    .await;
                drop(permit);
            });
        }
    });
}

#[derive(Debug, Serialize)]
struct JobsReport {
    jobs: usize,
    complete_s: f64,
}

/// `--case jobs`.
async fn jobs(count: usize, json: bool) -> anyhow::Result<()> {
    use futures::StreamExt as _;
    use k8s_openapi::api::batch::v1::Job;

    let cluster = LocalCluster::start().await?;
    let measured = async {
        let in_process = trellis_client::InProcess::new(cluster.server.in_process.clone());
        let admin = in_process.client(trellis_api::UserInfo::new("admin", ["system:masters"]));
        let (running, stop) = start_selected(&cluster, "job,garbage-collector").await?;
        let watching = SharedInformers::new();
        let (kubelet_stop, kubelet_stopped) = tokio::sync::oneshot::channel();
        fake_kubelet_succeeding(&watching, admin.clone(), kubelet_stopped);
        let jobs = watching.informer::<Job>(Api::all(admin.clone()), watcher::Config::default());
        jobs.wait_synced().await;
        let mut changes = jobs.subscribe();
        let api: Api<Job> = Api::namespaced(admin.clone(), "default");
        let started = Instant::now();
        let made: Vec<anyhow::Result<Job>> = futures::stream::iter(0..count)
            .map(|i| {
                let api = api.clone();
                async move {
                    let job = serde_json::from_value(json!({
                        "metadata": {"name": format!("bench-{i:05}")},
                        "spec": {"template": {"spec": {"restartPolicy": "Never",
                            "containers": [{"name": "c", "image": "bench:1"}]}}}}))?;
                    Ok(api.create(&PostParams::default(), &job).await?)
                }
            })
            .buffer_unordered(64)
            .collect()
            .await;
        made.into_iter()
            .collect::<anyhow::Result<Vec<_>>>()
            .context("create the Jobs")?;
        let complete = |j: &Job| {
            j.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| {
                    c.iter()
                        .any(|c| c.type_ == "Complete" && c.status == "True")
                })
        };
        until(&mut changes, "every Job complete", || {
            jobs.list().iter().filter(|j| complete(j)).count() >= count
        })
        .await?;
        let complete_s = started.elapsed().as_secs_f64();
        let _ = kubelet_stop.send(());
        stop.stop();
        for r in running {
            r.stop().await;
        }
        anyhow::Ok(JobsReport {
            jobs: count,
            complete_s,
        })
    }
    .await;
    let stopped = cluster.stop().await;
    let report = measured?;
    stopped?;
    super::print_report(json, &report, || {
        format!(
            "controllers: {} Jobs of one completion complete in {:.3} s",
            report.jobs, report.complete_s,
        )
    })
}
