//! `trellis bench flow`: the seed flow end to end on hollow nodes, as `trellis up
//! --hollow-nodes N` runs it: the API server on the embedded store, every built-in
//! controller and the scheduler (leader-elected, over the in-process transport, each
//! as its own user) and N hollow nodes, all in this process.
//!
//! The control plane idles first, alone, then with the nodes: the difference is the
//! nodes' memory and CPU. Then Deployments are created one after the other, each once
//! the pods of the one before are Running, round robin over namespaces (one per 100
//! nodes by default): Kubernetes' density test creates its pods in batches and
//! namespaces too. Every pod is followed through the shared informer of pods (a
//! watch): when it is first seen (its creation, in milliseconds: `creationTimestamp`
//! has seconds only), bound, and Running as its node reports it. Startup latency is
//! first seen → Running.

use std::collections::HashMap;
use std::time::Duration;
use trellis_api::Shutdown;

use anyhow::{Context as _, bail};
use clap::Args;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;
use trellis_client::identity;
use trellis_client::informer::Change;

use super::Percentiles;
use super::cluster::LocalCluster;
use crate::flags::seconds;

#[derive(Debug, Args)]
pub struct FlowArgs {
    /// Hollow nodes started.
    #[arg(long, default_value_t = 100, value_name = "N")]
    hollow_nodes: usize,

    /// Pods, over all Deployments.
    #[arg(long, default_value_t = 1000, value_name = "M")]
    replicas: usize,

    /// Pods per node instead of `--replicas` (`--replicas` = nodes × this).
    #[arg(long, value_name = "P")]
    pods_per_node: Option<usize>,

    /// Deployments the pods are split among, created one after the other, each once
    /// the pods of the one before are Running.
    #[arg(long, default_value_t = 1, value_name = "K")]
    deployments: usize,

    /// Namespaces the Deployments are spread over, round robin; 0 for one per 100
    /// nodes, as clusterloader2's density test (`NODES_PER_NAMESPACE`).
    #[arg(long, default_value_t = 0, value_name = "NS")]
    namespaces: usize,

    /// How long the nodes idle once Ready, over which their memory and CPU are read.
    #[arg(long, default_value = "10", value_name = "SECONDS", value_parser = seconds)]
    idle: Duration,

    /// Longest the run may take before it is given up.
    #[arg(long, default_value = "1800", value_name = "SECONDS", value_parser = seconds)]
    timeout: Duration,

    /// The API server's read-only requests at once before more get 429, as `trellis
    /// up`'s flag; 0 for no limit.
    #[arg(long, default_value_t = 400, value_name = "N")]
    max_requests_inflight: usize,

    /// The API server's writes at once before more get 429, as `trellis up`'s flag; 0
    /// for no limit.
    #[arg(long, default_value_t = 200, value_name = "N")]
    max_mutating_requests_inflight: usize,

    /// The hollow nodes' settings.
    #[command(flatten)]
    hollow: crate::hollow::HollowFlags,

    /// The scheduler's settings.
    #[command(flatten)]
    scheduler: crate::setup::SchedulerFlags,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    nodes: usize,
    replicas: usize,
    deployments: usize,
    namespaces: usize,
    /// Hollow nodes started → all Ready.
    nodes_ready_s: f64,
    /// First Deployment created → every pod seen (created by the ReplicaSet
    /// controller).
    created_s: f64,
    /// First Deployment created → every pod bound.
    scheduled_s: f64,
    /// First Deployment created → every pod Running.
    running_s: f64,
    /// CPU time of the whole process from the first create to every pod Running, in
    /// core-seconds (the machine has two cores).
    flow_cpu_s: f64,
    /// Pod first seen → Running seen, over every pod.
    startup_p50_ms: f64,
    startup_p99_ms: f64,
    startup_max_ms: f64,
    /// The whole process with every pod Running.
    rss_mb: f64,
    /// The process before the nodes started (control plane, empty cluster).
    rss_before_nodes_mb: f64,
    /// (RSS after the idle spell − RSS before the nodes) / nodes.
    idle_rss_per_node_kb: f64,
    /// CPU of the whole process over the idle spell (lease renewals and what the API
    /// server does for them included) less the control plane's alone, per node, in
    /// millicores.
    idle_cpu_per_node_millicores: f64,
}

pub async fn run(args: FlowArgs) -> anyhow::Result<()> {
    let cluster = LocalCluster::start_with(|config| {
        config.builtin_plugins = crate::plugin_controllers::builtin_entries();
        // The controller manager's namespace controller does it, as in `trellis up`.
        config.namespace_controller = false;
        config.settings.max_requests_inflight = args.max_requests_inflight;
        config.settings.max_mutating_requests_inflight = args.max_mutating_requests_inflight;
        Ok(())
    })
    .await?;
    let measured = tokio::time::timeout(args.timeout, measure(&cluster, &args)).await;
    let stopped = cluster.stop().await;
    let report = measured.context("the run did not finish in time")??;
    stopped?;
    super::print_report(args.json, &report, || {
        format!(
            "flow: {} hollow nodes Ready in {:.2} s; {} pods in {} Deployment(s): all created in {:.2} s, scheduled in {:.2} s, Running in {:.2} s; startup p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; {:.0} MB resident ({:.0} MB before the nodes; {:.0} KB and {:.2} millicores per idle node)",
            report.nodes,
            report.nodes_ready_s,
            report.replicas,
            report.deployments,
            report.created_s,
            report.scheduled_s,
            report.running_s,
            report.startup_p50_ms,
            report.startup_p99_ms,
            report.startup_max_ms,
            report.rss_mb,
            report.rss_before_nodes_mb,
            report.idle_rss_per_node_kb,
            report.idle_cpu_per_node_millicores,
        )
    })
}

/// CPU time of this process so far (user + system).
fn cpu_time() -> Duration {
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            let fields: Vec<u64> = stat
                .get(stat.rfind(')')? + 1..)?
                .split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|f| f.parse().ok())
                .collect();
            Some(fields.iter().sum::<u64>())
        })
        .unwrap_or(0);
    // USER_HZ is 100 on Linux.
    Duration::from_millis(ticks * 10)
}

fn rss_mb() -> f64 {
    super::pod_start::rss_of(std::process::id())
}

/// Creates namespace `name` and waits for its `default` ServiceAccount, which pods
/// need before they are admitted.
async fn create_namespace(admin: &kube::Client, name: &str) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    namespaces
        .create(&PostParams::default(), &namespace)
        .await
        .with_context(|| format!("create namespace {name}"))?;
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), name);
    let deadline = Instant::now() + Duration::from_secs(30);
    while accounts
        .get_opt("default")
        .await
        .with_context(|| format!("read the default ServiceAccount of {name}"))?
        .is_none()
    {
        if Instant::now() > deadline {
            bail!("namespace {name} has no default ServiceAccount after 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

fn ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// When each pod of the run was first seen, bound and Running.
#[derive(Default)]
struct Seen {
    created: Option<Instant>,
    bound: Option<Instant>,
    running: Option<Instant>,
}

const APP_LABEL: &str = "bench-flow";

async fn measure(cluster: &LocalCluster, args: &FlowArgs) -> anyhow::Result<Report> {
    let replicas = match args.pods_per_node {
        Some(p) => p * args.hollow_nodes,
        None => args.replicas,
    };
    let deployments = args.deployments.clamp(1, replicas.max(1));
    let in_process = trellis_client::InProcess::new(cluster.server.in_process.clone());
    let mut shared = crate::setup::Shared::new();
    let plugins = trellis_plugin_host::PluginHost::new(trellis_plugin_host::HostConfig {
        cache_dir: Some(cluster.dir.path().join("plugin-cache")),
        ..trellis_plugin_host::HostConfig::default()
    })?;
    shared.controllers = Some(crate::setup::ControllerSetup {
        plugins: plugins.clone(),
        credentials: crate::setup::Credentials::InProcess(in_process.clone()),
        modules_dir: cluster.dir.path().join("plugin-cache").join("modules"),
        running: Default::default(),
        root_ca: Some(cluster.server.ca_pem.clone()),
        node_monitor_grace_period: 50,
        plugin_status_interval: Duration::from_secs(10),
        node_ipam: Default::default(),
        builtins: trellis_controllers::bundled::select("*")?,
    });
    shared.scheduler = Some(crate::setup::SchedulerSetup {
        plugins,
        flags: args.scheduler.clone(),
        metrics: Default::default(),
    });
    let (stop, stopped) = Shutdown::new();
    let components = crate::components::start_in_process(&in_process, &shared, stopped.clone());

    // The process's informers, which the scheduler, the controllers and the nodes
    // share: reading them costs no watch of its own.
    let reader = in_process.client(identity::scheduler());
    let nodes = shared
        .informers
        .informer::<Node>(Api::all(reader.clone()), watcher::Config::default());
    let pods = shared
        .informers
        .informer::<Pod>(Api::all(reader), watcher::Config::default());
    let mut node_changes = nodes.subscribe();
    let mut pod_changes = pods.subscribe();
    nodes.wait_synced().await;
    pods.wait_synced().await;

    // The control plane settles first (plugins move to optimized code in the
    // background): its own idle memory and CPU are the baseline the nodes' are read
    // against.
    tokio::time::sleep(args.idle).await;
    let cpu_before = cpu_time();
    let idle_from = Instant::now();
    tokio::time::sleep(args.idle).await;
    let baseline_cpu =
        cpu_time().saturating_sub(cpu_before).as_secs_f64() / idle_from.elapsed().as_secs_f64();
    let rss_before = rss_mb();
    let started = Instant::now();
    let config = args
        .hollow
        .config(args.hollow_nodes, cluster.dir.path().join("hollow"));
    let prefix = config.prefix.clone();
    let hollow =
        crate::hollow::start_in_process(&in_process, &shared.informers, config, stopped.clone());
    let ready_count = || {
        nodes
            .list()
            .iter()
            .filter(|n| {
                n.metadata
                    .name
                    .as_deref()
                    .is_some_and(|name| name.starts_with(&prefix))
                    && ready(n)
            })
            .count()
    };
    while ready_count() < args.hollow_nodes {
        if node_changes.recv().await.is_none() {
            bail!("the node informer ended");
        }
    }
    let nodes_ready = started.elapsed();
    tracing::info!(
        nodes = args.hollow_nodes,
        seconds = nodes_ready.as_secs_f64(),
        "hollow nodes Ready"
    );

    let cpu_before = cpu_time();
    let idle_from = Instant::now();
    tokio::time::sleep(args.idle).await;
    let idle_cpu =
        cpu_time().saturating_sub(cpu_before).as_secs_f64() / idle_from.elapsed().as_secs_f64();
    let rss_idle = rss_mb();
    // Node changes queued meanwhile (lease-driven status) are of no interest.
    while node_changes.try_recv().is_ok() {}

    let admin = in_process.client(trellis_api::UserInfo::new("admin", ["system:masters"]));
    let namespaces = match args.namespaces {
        0 => args.hollow_nodes.div_ceil(100).max(1),
        n => n,
    };
    for i in 0..namespaces {
        create_namespace(&admin, &format!("flow-{i}")).await?;
    }
    let mut seen: HashMap<String, Seen> = HashMap::with_capacity(replicas);
    let (mut bound, mut running) = (0usize, 0usize);
    let t0 = Instant::now();
    let flow_cpu = cpu_time();
    let mut last_created = t0;
    let mut last_bound = t0;
    let mut last_running = t0;
    for k in 0..deployments {
        let size = replicas / deployments + usize::from(k < replicas % deployments);
        let name = format!("flow-{k}");
        let api: Api<Deployment> =
            Api::namespaced(admin.clone(), &format!("flow-{}", k % namespaces));
        let deployment: Deployment = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "replicas": size,
                "selector": {"matchLabels": {"app": APP_LABEL, "deployment": name}},
                "template": {
                    "metadata": {"labels": {"app": APP_LABEL, "deployment": name}},
                    "spec": {
                        "terminationGracePeriodSeconds": 0,
                        "containers": [{"name": "c", "image": "registry.example/pause:3.9",
                            "resources": {"requests": {"cpu": "10m", "memory": "10Mi"}}}]
                    }
                }
            }
        }))?;
        api.create(&PostParams::default(), &deployment)
            .await
            .with_context(|| format!("create Deployment {name}"))?;
        let target = running + size;
        while running < target {
            let Some(change) = pod_changes.recv().await else {
                bail!("the pod informer ended");
            };
            let now = Instant::now();
            let pod = match &change {
                Change::Added(p) | Change::Updated { new: p, .. } => p,
                Change::Deleted(_) => continue,
            };
            let ours = pod
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("app"))
                .is_some_and(|a| a == APP_LABEL);
            let Some(uid) = pod.metadata.uid.clone().filter(|_| ours) else {
                continue;
            };
            let entry = seen.entry(uid).or_default();
            if entry.created.is_none() {
                entry.created = Some(now);
                last_created = now;
            }
            if entry.bound.is_none()
                && pod
                    .spec
                    .as_ref()
                    .is_some_and(|s| s.node_name.as_deref().is_some_and(|n| !n.is_empty()))
            {
                entry.bound = Some(now);
                bound += 1;
                last_bound = now;
            }
            if entry.running.is_none()
                && pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            {
                entry.running = Some(now);
                running += 1;
                last_running = now;
            }
        }
        tracing::info!(deployment = %name, pods = size, bound, running, "Deployment Running");
    }
    let flow_cpu = cpu_time().saturating_sub(flow_cpu);
    let rss = rss_mb();
    let mut startups: Vec<Duration> = seen
        .values()
        .filter_map(|s| Some(s.running? - s.created?))
        .collect();
    let startup = Percentiles::of(&mut startups);

    stop.stop();
    // 150,000 pods are not cleaned up in a timely way; the process's end frees them.
    let _ = tokio::time::timeout(Duration::from_secs(30), hollow.wait()).await;
    for component in components {
        let _ = tokio::time::timeout(Duration::from_secs(30), component).await;
    }
    let n = args.hollow_nodes.max(1) as f64;
    Ok(Report {
        nodes: args.hollow_nodes,
        replicas,
        deployments,
        namespaces,
        nodes_ready_s: nodes_ready.as_secs_f64(),
        created_s: last_created.duration_since(t0).as_secs_f64(),
        scheduled_s: last_bound.duration_since(t0).as_secs_f64(),
        running_s: last_running.duration_since(t0).as_secs_f64(),
        flow_cpu_s: flow_cpu.as_secs_f64(),
        startup_p50_ms: startup.p50_ms,
        startup_p99_ms: startup.p99_ms,
        startup_max_ms: startup.max_ms,
        rss_mb: rss,
        rss_before_nodes_mb: rss_before,
        idle_rss_per_node_kb: (rss_idle - rss_before) * 1024.0 / n,
        idle_cpu_per_node_millicores: (idle_cpu - baseline_cpu).max(0.0) * 1000.0 / n,
    })
}
