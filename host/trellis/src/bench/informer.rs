//! `trellis bench informer`: a shared informer of `--objects` pods through the remote
//! or the in-process transport.
//!
//! - `sync_s`: from creating the informer to its first list in the store (list + watch
//!   established), as a component's start waits for it.
//! - `bytes_per_object`: the resident memory a synced informer of the pods adds to a
//!   process of its own (a child `trellis bench informer-child` over the remote
//!   transport: the cache is the same whatever the transport, and the server's memory
//!   must not be counted), per pod, beside `json_bytes_per_object`, the pods' size as
//!   JSON.
//! - `fanout_p50_ms` / `fanout_p99_ms`: `--changes` pod updates, one at a time, each
//!   from its write's acknowledgement to its arrival at the last of three subscribers of
//!   the one informer (arrivals before the acknowledgement count as zero).
//! - `get_us`: the mean time of one GET of a pod through the transport, one at a time.
//! - `list_s`: a paginated list of every pod through the transport, decoded into typed
//!   Pods, in pages of 500 as kube-runtime's watcher asks: the part of `sync_s` that is
//!   not the informer's own.
//! - `typed_pod_bytes` / `typed_container_bytes`: `size_of` the k8s-openapi `Pod` and
//!   `Container` the cache holds: the floor under `bytes_per_object` before any
//!   string or map.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Args, ValueEnum};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;
use trellis_client::identity;
use trellis_client::informer::{Change, SharedInformers};

use super::Percentiles;
use super::cluster::LocalCluster;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Transport {
    /// HTTPS through the admin kubeconfig, as a component on another machine.
    Remote,
    /// Straight to the router, as the components of `trellis up`.
    InProcess,
}

#[derive(Debug, Args)]
pub struct InformerArgs {
    /// Pods in the cluster, all cached by the informer.
    #[arg(long, default_value_t = 10_000)]
    objects: usize,

    #[arg(long, value_enum, default_value_t = Transport::InProcess)]
    transport: Transport,

    /// Pod updates whose delivery to three subscribers is timed.
    #[arg(long, default_value_t = 500)]
    changes: usize,

    /// GETs timed for `get_us`.
    #[arg(long, default_value_t = 2_000)]
    gets: usize,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    objects: usize,
    transport: Transport,
    sync_s: f64,
    bytes_per_object: f64,
    json_bytes_per_object: f64,
    fanout_p50_ms: f64,
    fanout_p99_ms: f64,
    fanout_max_ms: f64,
    get_us: f64,
    list_s: f64,
    typed_pod_bytes: usize,
    typed_container_bytes: usize,
}

const NAMESPACE: &str = "bench";
const SUBSCRIBERS: usize = 3;

pub async fn run(args: InformerArgs) -> anyhow::Result<()> {
    let cluster = LocalCluster::start().await?;
    let measured = measure(&cluster, &args).await;
    let stopped = cluster.stop().await;
    let report = measured?;
    stopped?;
    super::print_report(args.json, &report, || {
        format!(
            "informer {:?}: {} pods synced in {:.3} s (their list alone {:.3} s), {:.0} B per cached pod ({:.0} B as JSON); \
             a change reaches {SUBSCRIBERS} subscribers p50 {:.3} ms, p99 {:.3} ms; a GET {:.0} µs",
            report.transport,
            report.objects,
            report.sync_s,
            report.list_s,
            report.bytes_per_object,
            report.json_bytes_per_object,
            report.fanout_p50_ms,
            report.fanout_p99_ms,
            report.get_us,
        )
    })
}

fn pod(i: usize) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(json!({
        "metadata": {
            "name": format!("pod-{i:06}"),
            "labels": {"app": "bench", "pod-template-hash": "5d8f7c9b6"},
            "annotations": {"seq": "0"},
        },
        "spec": {
            "nodeName": format!("node-{}", i % 100),
            "containers": [{
                "name": "web",
                "image": "registry.example/web:1.2.3",
                "ports": [{"containerPort": 8080, "protocol": "TCP"}],
                "resources": {"requests": {"cpu": "100m", "memory": "64Mi"},
                              "limits": {"memory": "128Mi"}},
                "env": [{"name": "MODE", "value": "bench"}],
            }],
        },
    }))?)
}

/// Resident memory of this process, from /proc.
fn resident_bytes() -> anyhow::Result<f64> {
    let statm = std::fs::read_to_string("/proc/self/statm").context("read /proc/self/statm")?;
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .context("parse /proc/self/statm")?
        .parse()?;
    Ok(pages * 4096.0)
}

async fn measure(cluster: &LocalCluster, args: &InformerArgs) -> anyhow::Result<Report> {
    let server = &cluster.server;
    let admin = trellis_client::InProcess::new(server.in_process.clone())
        .client(trellis_api::UserInfo::new("admin", ["system:masters"]));
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(admin.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?,
        )
        .await
        .context("create the namespace")?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NAMESPACE);
    let created = futures::stream::iter(0..args.objects)
        .map(|i| {
            let pods = pods.clone();
            async move {
                pods.create(&PostParams::default(), &pod(i)?)
                    .await
                    .map_err(anyhow::Error::from)
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
    for result in created {
        result.context("create the pods")?;
    }

    // The informer lists and watches as the controller manager; GETs are the admin's
    // (the controller manager may only list and watch). Both over the transport
    // measured.
    let (client, getter) = match args.transport {
        Transport::InProcess => (
            trellis_client::InProcess::new(server.in_process.clone())
                .client(identity::controller_manager()),
            admin.clone(),
        ),
        Transport::Remote => (
            trellis_client::remote(&cluster.dir.path().join("controller-manager.kubeconfig"))
                .await?,
            trellis_client::remote(&server.kubeconfig).await?,
        ),
    };
    // Warm the server's caches, and measure the pods' JSON size.
    let listed = Api::<Pod>::all(client.clone())
        .list(&ListParams::default())
        .await
        .context("list the pods")?;
    let json_bytes: usize = listed
        .items
        .iter()
        .map(|p| serde_json::to_vec(p).map(|v| v.len()).unwrap_or_default())
        .sum();
    drop(listed);

    // What the watcher's initial list costs alone: the same pages, decoded the same way.
    let started = Instant::now();
    let all = Api::<Pod>::all(client.clone());
    let mut params = ListParams::default().limit(500);
    let mut listed_pods = 0;
    loop {
        let page = all.list(&params).await.context("list a page of pods")?;
        listed_pods += page.items.len();
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => break,
        }
    }
    let list = started.elapsed();
    if listed_pods != args.objects {
        bail!("listed {listed_pods} pods, not {}", args.objects);
    }

    let started = Instant::now();
    let informers = SharedInformers::new();
    let informer = informers.informer::<Pod>(Api::all(client.clone()), watcher::Config::default());
    informer.wait_synced().await;
    let sync = started.elapsed();
    let cached_bytes = child_cache_bytes(&cluster.dir.path().join("controller-manager.kubeconfig"))
        .await
        .context("measure the cache's memory in a child process")?;
    if informer.len() != args.objects {
        bail!(
            "the informer holds {} pods, not {}",
            informer.len(),
            args.objects
        );
    }

    // Fan-out: three subscribers, arrival times by the `seq` annotation.
    let arrivals: Arc<Mutex<HashMap<usize, Vec<Instant>>>> = Arc::default();
    let mut tasks = Vec::new();
    for _ in 0..SUBSCRIBERS {
        let mut rx = informer.subscribe();
        let arrivals = arrivals.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(change) = rx.recv().await {
                let Change::Updated { new, .. } = change else {
                    continue;
                };
                let seq = new
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get("seq"))
                    .and_then(|s| s.parse::<usize>().ok())
                    .unwrap_or(0);
                if seq > 0 {
                    arrivals
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(seq)
                        .or_default()
                        .push(Instant::now());
                }
            }
        }));
    }
    // The changes are the admin's writes (the controller manager may not update pods);
    // the reads below go through the transport measured.
    let writer: Api<Pod> = Api::namespaced(admin.clone(), NAMESPACE);
    let target: Api<Pod> = Api::namespaced(getter, NAMESPACE);
    let mut acked = Vec::with_capacity(args.changes);
    for seq in 1..=args.changes {
        writer
            .patch(
                "pod-000000",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {"seq": seq.to_string()}}})),
            )
            .await
            .context("update the pod")?;
        acked.push(Instant::now());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut samples = loop {
        let done = {
            let arrivals = arrivals.lock().unwrap_or_else(|e| e.into_inner());
            (1..=args.changes)
                .map(|seq| {
                    arrivals
                        .get(&seq)
                        .filter(|a| a.len() == SUBSCRIBERS)
                        .and_then(|a| a.iter().max())
                        .map(|last| last.saturating_duration_since(acked[seq - 1]))
                })
                .collect::<Option<Vec<Duration>>>()
        };
        if let Some(samples) = done {
            break samples;
        }
        if Instant::now() > deadline {
            bail!("not every change reached the {SUBSCRIBERS} subscribers within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    for task in tasks {
        task.abort();
    }
    let fanout = Percentiles::of(&mut samples);

    let started = Instant::now();
    for _ in 0..args.gets {
        target.get("pod-000001").await.context("get a pod")?;
    }
    let get = started.elapsed();

    let objects = args.objects.max(1) as f64;
    Ok(Report {
        objects: args.objects,
        transport: args.transport,
        sync_s: sync.as_secs_f64(),
        bytes_per_object: cached_bytes / objects,
        json_bytes_per_object: json_bytes as f64 / objects,
        fanout_p50_ms: fanout.p50_ms,
        fanout_p99_ms: fanout.p99_ms,
        fanout_max_ms: fanout.max_ms,
        get_us: get.as_secs_f64() * 1e6 / args.gets.max(1) as f64,
        list_s: list.as_secs_f64(),
        typed_pod_bytes: std::mem::size_of::<Pod>(),
        typed_container_bytes: std::mem::size_of::<k8s_openapi::api::core::v1::Container>(),
    })
}

/// Runs `trellis bench informer-child` against `kubeconfig` and returns the bytes its
/// synced informer added.
async fn child_cache_bytes(kubeconfig: &std::path::Path) -> anyhow::Result<f64> {
    let exe = std::env::current_exe().context("find this executable")?;
    let output = tokio::process::Command::new(exe)
        .args(["bench", "informer-child", "--kubeconfig"])
        .arg(kubeconfig)
        .env("RUST_LOG", "error")
        // mimalloc returns freed pages to the system at once, so that the resident
        // memory read is what the cache holds, not what decoding the list pages left.
        .env("MIMALLOC_PURGE_DELAY", "0")
        .output()
        .await
        .context("run the child")?;
    if !output.status.success() {
        bail!(
            "the child failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text = String::from_utf8_lossy(&output.stdout);
    text.trim()
        .parse::<f64>()
        .with_context(|| format!("parse the child's answer {text:?}"))
}

#[derive(Debug, Args)]
pub struct InformerChildArgs {
    #[arg(long, value_name = "FILE")]
    kubeconfig: std::path::PathBuf,
}

/// `trellis bench informer-child`: prints the resident bytes a synced informer of
/// every pod adds to this process.
pub async fn run_child(args: InformerChildArgs) -> anyhow::Result<()> {
    let client = trellis_client::remote(&args.kubeconfig).await?;
    // The client and the runtime's own first allocations are not the cache's.
    Api::<Pod>::all(client.clone())
        .list(&ListParams::default().limit(1))
        .await
        .context("list a pod")?;
    let before = resident_bytes()?;
    let informers = SharedInformers::new();
    let informer = informers.informer::<Pod>(Api::all(client), watcher::Config::default());
    informer.wait_synced().await;
    // Let the list pages' buffers go before reading.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = resident_bytes()?;
    println!("{}", (after - before).max(0.0));
    drop(informer);
    Ok(())
}
