//! `trellis bench scheduler`: scheduling throughput and latency in the style of
//! kube-scheduler's scheduler_perf, with the default plugins as the bundled WASM
//! component, against a server on the embedded store in this process. Nodes are API
//! objects (no agents); the pods to measure are created first, then the scheduler
//! starts on optimized code and binds them all.
//!
//! Cases:
//! - `basic`: pods requesting 100m CPU and 100 MiB (SchedulingBasic);
//! - `affinity`: pods with a preferred node affinity to a zone and a preferred pod
//!   affinity to their own app, on nodes in 10 zones;
//! - `spread`: pods spread over zones by a topologySpreadConstraint (maxSkew 1);
//! - `unschedulable`: `--pods` schedulable pods while 2,000 pods no node fits wait
//!   in the queue (they are created first).
//!
//! Reported: `pods_per_sec` (measured pods bound over the time from the scheduler's
//! start to the last bind seen by a watch), `median_window_pods_per_sec` (the median
//! of 1 s windows of binds), `attempt_p50_ms`/`attempt_p99_ms` (one scheduling cycle,
//! from pop to decision), `wasm_share` (the WASM boundary's share of the cycles'
//! time: the same calls, with the same arguments and results of the same size, made
//! on an empty component (`plugins/fixtures/scheduler-empty`), so the calls and the
//! copies in and out without any plugin's work), `guest_share` (the share of all time
//! in calls into the component, the plugins' own work included), and `rss_mb` (this
//! whole process: the API server with its store and watch cache, and the scheduler).

use std::sync::{Arc, Mutex};
use std::time::Duration;
use trellis_api::Shutdown;

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::time::Instant;
use trellis_client::informer::{Change, SharedInformers};
use trellis_plugin_host::{HostConfig, PluginHost, PluginKind, PluginSpec};
use trellis_scheduler::{Component, QueueSettings, SchedulerConfig, SchedulerMetrics};

use super::cluster::LocalCluster;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Case {
    Basic,
    Affinity,
    Spread,
    Unschedulable,
}

#[derive(Debug, Args)]
pub struct SchedulerArgs {
    #[arg(long, value_enum, default_value = "basic")]
    case: Case,

    #[arg(long, default_value_t = 1000)]
    nodes: usize,

    /// Pods measured.
    #[arg(long, default_value_t = 5000)]
    pods: usize,

    /// Run the scheduler as a process of its own (`trellis scheduler` against this
    /// process's API server over HTTPS), to measure its memory alone; the attempt
    /// latencies and the WASM shares are then not measured.
    #[arg(long)]
    scheduler_process: bool,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

/// What `--scheduler-process` measures.
#[derive(Debug, Serialize)]
struct ProcessReport {
    case: Case,
    nodes: usize,
    pods: usize,
    /// Pods bound over the time from the first bind to the last.
    pods_per_sec: f64,
    /// From the process's start to the first bind: its informers' lists, the
    /// component's compilation and the view sent into it.
    first_bind_s: f64,
    /// The scheduler process's resident memory after the last bind, and its peak.
    scheduler_rss_mb: f64,
    scheduler_peak_rss_mb: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    case: Case,
    nodes: usize,
    pods: usize,
    pods_per_sec: f64,
    median_window_pods_per_sec: f64,
    attempt_p50_ms: f64,
    attempt_p99_ms: f64,
    /// The WASM boundary's share of the scheduling time: the calls and the copies
    /// in and out, measured on an empty component with the same calls.
    wasm_share: f64,
    /// All the time in calls into the component, the plugins' own work included.
    guest_share: f64,
    /// One cycle's calls on the empty component (update, cycle, filter, score).
    boundary_us_per_cycle: f64,
    rss_mb: f64,
    /// What the process grew by from the scheduler's start to the last bind: the
    /// scheduler (its informers, cache, and the component's view) and what the API
    /// server keeps of the binds and their events, so an upper bound of the
    /// scheduler's own memory.
    scheduler_rss_mb: f64,
    /// The default plugins' linear memory at its peak: the component's view of the
    /// cluster (part of `scheduler_rss_mb`).
    guest_memory_mb: f64,
}

/// Unschedulable pods waiting in the `unschedulable` case.
const WAITING: usize = 2000;
/// Zones the nodes are spread over.
const ZONES: usize = 10;
/// Creates in flight at once while setting up.
const CREATES_IN_FLIGHT: usize = 64;

pub async fn run(args: SchedulerArgs) -> anyhow::Result<()> {
    let cluster = LocalCluster::start().await?;
    if args.scheduler_process {
        let measured = measure_process(&cluster, &args).await;
        let stopped = cluster.stop().await;
        let report = measured?;
        stopped?;
        return super::print_report(args.json, &report, || {
            format!(
                "scheduler process {:?}: {} pods on {} nodes at {:.0} pods/s, the first bound {:.1} s after its start; {:.0} MB resident after the last bind, {:.0} MB at the peak",
                report.case,
                report.pods,
                report.nodes,
                report.pods_per_sec,
                report.first_bind_s,
                report.scheduler_rss_mb,
                report.scheduler_peak_rss_mb,
            )
        });
    }
    let measured = measure(&cluster, &args).await;
    let stopped = cluster.stop().await;
    let report = measured?;
    stopped?;
    super::print_report(args.json, &report, || {
        format!(
            "scheduler {:?}: {} pods on {} nodes at {:.0} pods/s (median 1 s window {:.0}); an attempt p50 {:.3} ms, p99 {:.3} ms; the WASM boundary {:.1} % of it ({:.1} µs a cycle), in the component {:.1} %; {:.0} MB resident, {:.0} MB of it since the scheduler started",
            report.case,
            report.pods,
            report.nodes,
            report.pods_per_sec,
            report.median_window_pods_per_sec,
            report.attempt_p50_ms,
            report.attempt_p99_ms,
            report.wasm_share * 100.0,
            report.boundary_us_per_cycle,
            report.guest_share * 100.0,
            report.rss_mb,
            report.scheduler_rss_mb,
        )
    })
}

fn node(i: usize) -> Value {
    let name = format!("node-{i}");
    json!({
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name,
            "topology.kubernetes.io/zone": format!("zone-{}", i % ZONES),
        }},
        "status": {
            "allocatable": {"cpu": "32", "memory": "64Gi", "pods": "110"},
            "capacity": {"cpu": "32", "memory": "64Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    })
}

fn pod(case: Case, i: usize) -> Value {
    let mut pod = json!({
        "metadata": {"name": format!("pod-{i}"), "labels": {"app": format!("app-{}", i % 50)}},
        "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
            "resources": {"requests": {"cpu": "100m", "memory": "100Mi"}}}]},
    });
    match case {
        Case::Basic | Case::Unschedulable => {}
        Case::Affinity => {
            pod["spec"]["affinity"] = json!({
                "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                    "weight": 10,
                    "preference": {"matchExpressions": [{"key": "topology.kubernetes.io/zone",
                        "operator": "In", "values": [format!("zone-{}", i % ZONES)]}]},
                }]},
                "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                    "weight": 5,
                    "podAffinityTerm": {"topologyKey": "topology.kubernetes.io/zone",
                        "labelSelector": {"matchLabels": {"app": format!("app-{}", i % 50)}}},
                }]},
            });
        }
        Case::Spread => {
            pod["spec"]["topologySpreadConstraints"] = json!([{
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"app": format!("app-{}", i % 50)}},
            }]);
        }
    }
    pod
}

/// Creates the objects, `CREATES_IN_FLIGHT` at a time.
async fn create_all<K>(api: &Api<K>, objects: Vec<Value>) -> anyhow::Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + Serialize + std::fmt::Debug,
{
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(objects)
        .map(|value| async move {
            let obj: K = serde_json::from_value(value)?;
            api.create(&PostParams::default(), &obj).await?;
            Ok(())
        })
        .buffer_unordered(CREATES_IN_FLIGHT)
        .collect()
        .await;
    results.into_iter().collect()
}

pub(crate) fn rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The nodes, and in the `unschedulable` case the pods that wait; returns the
/// admin's client.
async fn populate(cluster: &LocalCluster, args: &SchedulerArgs) -> anyhow::Result<kube::Client> {
    let in_process = trellis_client::InProcess::new(cluster.server.in_process.clone());
    let admin = in_process.client(trellis_api::UserInfo::new("admin", ["system:masters"]));
    let nodes: Api<Node> = Api::all(admin.clone());
    create_all(&nodes, (0..args.nodes).map(node).collect())
        .await
        .context("create the nodes")?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    if args.case == Case::Unschedulable {
        let waiting = (0..WAITING)
            .map(|i| {
                let mut p = pod(Case::Basic, i);
                p["metadata"]["name"] = json!(format!("waiting-{i}"));
                p["spec"]["containers"][0]["resources"]["requests"]["cpu"] = json!("1000");
                p
            })
            .collect();
        create_all(&pods, waiting)
            .await
            .context("create the unschedulable pods")?;
    }
    Ok(admin)
}

/// A process's resident memory and its peak, in MB, from `/proc/PID/status`.
fn process_rss_mb(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// `--scheduler-process`: the pods are created, then `trellis scheduler` starts as a
/// child process with the scheduler's kubeconfig and binds them all.
async fn measure_process(
    cluster: &LocalCluster,
    args: &SchedulerArgs,
) -> anyhow::Result<ProcessReport> {
    let admin = populate(cluster, args).await?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let watching = SharedInformers::new();
    let informer = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    informer.wait_synced().await;
    let mut changes = informer.subscribe();
    create_all(&pods, (0..args.pods).map(|i| pod(args.case, i)).collect())
        .await
        .context("create the pods")?;
    let kubeconfig = cluster.dir.path().join("scheduler.kubeconfig");
    let exe = std::env::current_exe().context("find this binary")?;
    let started = Instant::now();
    let mut child = tokio::process::Command::new(exe)
        .arg("scheduler")
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["--metrics-bind-address", ""])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("start trellis scheduler")?;
    let pid = child.id().context("the scheduler's pid")?;
    let mut bound = std::collections::HashSet::new();
    let mut first = None;
    let deadline = started + Duration::from_secs(600);
    while bound.len() < args.pods {
        let change = tokio::select! {
            change = tokio::time::timeout_at(deadline, changes.recv()) => change
                .context("every pod bound within 600 s")?
                .context("the pod watch ended")?,
            status = child.wait() => anyhow::bail!("trellis scheduler exited early: {:?}", status?),
        };
        let pod = match &change {
            Change::Added(p) | Change::Updated { new: p, .. } => p,
            Change::Deleted(_) => continue,
        };
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        if name.starts_with("pod-")
            && pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_some()
            && bound.insert(name.to_owned())
        {
            first.get_or_insert_with(|| started.elapsed());
        }
    }
    let elapsed = started.elapsed();
    let (rss, peak) = process_rss_mb(pid);
    child.start_kill().context("stop trellis scheduler")?;
    let _ = child.wait().await;
    let first = first.unwrap_or(elapsed);
    Ok(ProcessReport {
        case: args.case,
        nodes: args.nodes,
        pods: args.pods,
        pods_per_sec: args.pods as f64 / (elapsed - first).as_secs_f64().max(f64::MIN_POSITIVE),
        first_bind_s: first.as_secs_f64(),
        scheduler_rss_mb: rss,
        scheduler_peak_rss_mb: peak,
    })
}

async fn measure(cluster: &LocalCluster, args: &SchedulerArgs) -> anyhow::Result<Report> {
    let admin = populate(cluster, args).await?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");

    // The scheduler, on optimized code before it starts.
    let host = PluginHost::new(HostConfig::default())?;
    let mut spec = PluginSpec::new("default-plugins", PluginKind::Scheduler);
    spec.timeout = Duration::from_secs(5);
    spec.memory_limit = 1 << 30;
    let plugin = host
        .load(
            spec,
            Arc::new(trellis_scheduler::DEFAULT_PLUGINS.to_vec()),
            None,
        )
        .await
        .map_err(|e| anyhow::anyhow!("load the default plugins: {e}"))?;
    plugin.optimized().await;
    let samples = Arc::new(Mutex::new(Vec::with_capacity(args.pods)));
    let mut metrics = SchedulerMetrics::default();
    metrics.attempt_samples = Some(samples.clone());
    let point_totals = metrics.point_totals.clone();
    let config = SchedulerConfig {
        profiles: vec![(
            trellis_scheduler::DEFAULT_SCHEDULER.to_owned(),
            vec![Component {
                plugin: plugin.clone(),
                configuration: "{}".into(),
                weights: Default::default(),
                ignore_failures: false,
            }],
        )],
        defaults: Vec::new(),
        percentage_of_nodes_to_score: 0,
        queue: QueueSettings::default(),
    };

    // The waiting pods are queued and tried once before the measured ones exist.
    let watching = SharedInformers::new();
    let informer = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    informer.wait_synced().await;
    let mut changes = informer.subscribe();
    create_all(&pods, (0..args.pods).map(|i| pod(args.case, i)).collect())
        .await
        .context("create the pods")?;
    let client = trellis_client::InProcess::new(cluster.server.in_process.clone())
        .client(trellis_client::identity::scheduler());
    let events = trellis_client::events::EventRecorder::new(
        client.clone(),
        trellis_scheduler::DEFAULT_SCHEDULER,
        "bench",
    );
    let (stop, stopped) = Shutdown::new();
    let (_, guest_before) = plugin.metrics.latency();
    let rss_before = rss_mb();
    let started = Instant::now();
    let scheduler = tokio::spawn(trellis_scheduler::run(
        config,
        trellis_scheduler::Parts {
            host: host.clone(),
            client,
            informers: SharedInformers::new(),
            events,
            metrics,
        },
        tokio::sync::mpsc::unbounded_channel().1,
        stopped,
    ));

    let mut bound = std::collections::HashSet::new();
    let mut binds_at: Vec<Duration> = Vec::with_capacity(args.pods);
    let deadline = started + Duration::from_secs(600);
    while bound.len() < args.pods {
        let change = tokio::time::timeout_at(deadline, changes.recv())
            .await
            .context("every pod bound within 600 s")?
            .context("the pod watch ended")?;
        let pod = match &change {
            Change::Added(p) | Change::Updated { new: p, .. } => p,
            Change::Deleted(_) => continue,
        };
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        if !name.starts_with("pod-") {
            continue;
        }
        if pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_some()
            && bound.insert(name.to_owned())
        {
            binds_at.push(started.elapsed());
        }
    }
    let elapsed = started.elapsed();
    let rss = rss_mb();
    stop.stop();
    scheduler.await??;
    let (_, guest_after) = plugin.metrics.latency();

    for ((plugin, point), took) in point_totals
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
    {
        tracing::info!(
            plugin,
            point,
            per_pod_us = took.as_secs_f64() * 1e6 / args.pods as f64,
            "time in calls"
        );
    }
    let mut attempts = samples.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let attempt_total: Duration = attempts.iter().sum();
    let attempt_mean = attempt_total / attempts.len().max(1) as u32;
    let boundary = boundary_per_cycle(&host, &plugin, &admin, args.nodes).await?;
    let percentiles = super::Percentiles::of(&mut attempts);
    // Binds per 1 s window, from the first bind to the last full window.
    let mut windows = vec![0usize; elapsed.as_secs() as usize + 1];
    for t in &binds_at {
        windows[t.as_secs() as usize] += 1;
    }
    let full = windows.len().saturating_sub(1).max(1);
    let mut counted: Vec<usize> = windows[..full].to_vec();
    counted.sort_unstable();
    let median_window = counted.get(counted.len() / 2).copied().unwrap_or(0) as f64;
    Ok(Report {
        case: args.case,
        nodes: args.nodes,
        pods: args.pods,
        pods_per_sec: args.pods as f64 / elapsed.as_secs_f64(),
        median_window_pods_per_sec: median_window,
        attempt_p50_ms: percentiles.p50_ms,
        attempt_p99_ms: percentiles.p99_ms,
        wasm_share: boundary.as_secs_f64() / attempt_mean.as_secs_f64().max(f64::MIN_POSITIVE),
        guest_share: (guest_after - guest_before).as_secs_f64()
            / attempt_total.as_secs_f64().max(f64::MIN_POSITIVE),
        boundary_us_per_cycle: boundary.as_secs_f64() * 1e6,
        rss_mb: rss,
        scheduler_rss_mb: rss - rss_before,
        guest_memory_mb: plugin
            .metrics
            .memory_peak
            .load(std::sync::atomic::Ordering::Relaxed) as f64
            / (1024.0 * 1024.0),
    })
}

/// Cycles timed on the empty component.
const CALIBRATION_CYCLES: u32 = 2000;

/// The WASM boundary of one cycle of the basic case: an empty component (on
/// optimized code, with the whole cluster sent first) is given what a cycle gives
/// the default plugins: one pod placed (`update`), the pod (`cycle`), the nodes a
/// cycle filters (`filter`, as many as kube-scheduler's sampling keeps), and the
/// same nodes to score, answered with as many score lists as the default plugins
/// have Score plugins.
async fn boundary_per_cycle(
    host: &Arc<PluginHost>,
    defaults: &Arc<trellis_plugin_host::Plugin>,
    admin: &kube::Client,
    nodes: usize,
) -> anyhow::Result<Duration> {
    use trellis_plugin_host::scheduler::{Change, ExtensionPoints, NodeUpsert, PodUpsert};

    let scorers = {
        let mut session = defaults.scheduler_session(host).await?;
        session
            .plugins("{}")
            .await?
            .map_err(|e| anyhow::anyhow!("the default plugins' configuration: {e}"))?
            .iter()
            .filter(|p| p.points.contains(ExtensionPoints::SCORE))
            .count()
    };
    let mut spec = PluginSpec::new("scheduler-empty", PluginKind::Scheduler);
    spec.timeout = Duration::from_secs(5);
    spec.memory_limit = 1 << 30;
    let empty = host
        .load(
            spec,
            Arc::new(trellis_scheduler::EMPTY_PLUGIN.to_vec()),
            None,
        )
        .await
        .map_err(|e| anyhow::anyhow!("load the empty component: {e}"))?;
    empty.optimized().await;
    let mut session = empty.scheduler_session(host).await?;
    session
        .plugins(&format!("{{\"scores\": {scorers}}}"))
        .await?
        .map_err(|e| anyhow::anyhow!("the empty component: {e}"))?;
    let listed = Api::<Node>::all(admin.clone())
        .list(&Default::default())
        .await?;
    let snapshot: Vec<Change> = listed
        .items
        .iter()
        .enumerate()
        .map(|(i, n)| {
            Change::NodeUpsert(NodeUpsert {
                node: i as u32,
                object: serde_json::to_string(n).unwrap_or_default(),
            })
        })
        .collect();
    session.update(&snapshot).await?;
    let pod = Api::<Pod>::namespaced(admin.clone(), "default")
        .get("pod-0")
        .await?;
    let pod_json = trellis_scheduler::cache::pod_json(&pod);
    let sampled = trellis_scheduler::cycle::feasible_nodes_to_find(nodes, 0);
    let ids: Vec<u32> = (0..sampled as u32).collect();
    let placed = [Change::PodUpsert(PodUpsert {
        uid: "calibration".into(),
        node: 0,
        object: pod_json.clone(),
    })];
    let started = Instant::now();
    for _ in 0..CALIBRATION_CYCLES {
        session.update(&placed).await?;
        session.cycle(&pod_json).await?;
        session.filter(&ids).await?;
        session
            .score(&ids)
            .await?
            .map_err(|e| anyhow::anyhow!("the empty component's score: {e}"))?;
    }
    Ok(started.elapsed() / CALIBRATION_CYCLES)
}
