//! `trellis bench informer`: a shared informer of `--objects` pods through the remote
//! or the in-process transport.
//!
//! - `sync_s`: from creating the informer to its first list in the store (list + watch
//!   established), as a component's start waits for it.
//! - `bytes_per_object`: the process's resident memory the synced cache added, per pod
//!   (the server runs in the same process: a list of every pod is made and dropped
//!   first, so that its own caches are warm and not counted), beside
//!   `json_bytes_per_object`, the pods' size as JSON.
//! - `fanout_p50_ms` / `fanout_p99_ms`: `--changes` pod updates, one at a time, each
//!   from its write's acknowledgement to its arrival at the last of three subscribers of
//!   the one informer (arrivals before the acknowledgement count as zero).
//! - `get_us`: the mean time of one GET of a pod through the transport.

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
use super::api::LocalCluster;

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
            "informer {:?}: {} pods synced in {:.3} s, {:.0} B per cached pod ({:.0} B as JSON); \
             a change reaches {SUBSCRIBERS} subscribers p50 {:.3} ms, p99 {:.3} ms; a GET {:.0} µs",
            report.transport,
            report.objects,
            report.sync_s,
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

    let client = match args.transport {
        Transport::InProcess => trellis_client::InProcess::new(server.in_process.clone())
            .client(identity::controller_manager()),
        Transport::Remote => trellis_client::remote(&server.kubeconfig).await?,
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

    let before = resident_bytes()?;
    let started = Instant::now();
    let informers = SharedInformers::new();
    let informer = informers.informer::<Pod>(Api::all(client.clone()), watcher::Config::default());
    informer.wait_synced().await;
    let sync = started.elapsed();
    let after = resident_bytes()?;
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
    let target: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
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
        bytes_per_object: (after - before).max(0.0) / objects,
        json_bytes_per_object: json_bytes as f64 / objects,
        fanout_p50_ms: fanout.p50_ms,
        fanout_p99_ms: fanout.p99_ms,
        fanout_max_ms: fanout.max_ms,
        get_us: get.as_secs_f64() * 1e6 / args.gets.max(1) as f64,
    })
}
