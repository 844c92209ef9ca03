//! `trellis bench up`: how soon `trellis up` is ready on an empty store, as a
//! newcomer meets it: this binary's `up` started as a child process on a fresh data
//! directory, timed from the spawn to the API answering (`/readyz` 200 with the
//! admin's credentials) and to the local Node reporting `Ready` (seen by a watch).
//! The process's resident memory is read once the node is Ready.

use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Args;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::watcher;
use serde::Serialize;
use tokio::time::Instant;
use trellis_client::informer::SharedInformers;

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Starts measured, each on a fresh data directory.
    #[arg(long, default_value_t = 5)]
    runs: usize,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    runs: usize,
    /// Spawn → the API answers, per run.
    api_ready_ms: Vec<f64>,
    /// Spawn → the local Node is Ready, per run.
    node_ready_ms: Vec<f64>,
    /// The median of `node_ready_ms`.
    median_node_ready_ms: f64,
    /// The process once its node is Ready, per run.
    rss_mb: Vec<f64>,
}

/// Longest a start may take before the benchmark gives up on it.
const START_LIMIT: Duration = Duration::from_secs(60);

pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let mut report = Report {
        runs: args.runs,
        api_ready_ms: Vec::new(),
        node_ready_ms: Vec::new(),
        median_node_ready_ms: 0.0,
        rss_mb: Vec::new(),
    };
    for _ in 0..args.runs {
        let (api, node, rss) = once().await?;
        report.api_ready_ms.push(super::ms(api));
        report.node_ready_ms.push(super::ms(node));
        report.rss_mb.push(rss);
    }
    let mut sorted = report.node_ready_ms.clone();
    sorted.sort_by(f64::total_cmp);
    report.median_node_ready_ms = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
    super::print_report(args.json, &report, || {
        format!(
            "trellis up: the API answers after {:?} ms, the local node is Ready after {:?} ms (median {:.0} ms); {:?} MB resident",
            report.api_ready_ms, report.node_ready_ms, report.median_node_ready_ms, report.rss_mb
        )
    })
}

/// One start: the times to the API and to the node, and the memory then.
async fn once() -> anyhow::Result<(Duration, Duration, f64)> {
    let dir = tempfile::Builder::new()
        .prefix("trellis-bench-up-")
        .tempdir()
        .context("create a temporary data directory")?;
    let exe = std::env::current_exe().context("find this binary")?;
    let started = Instant::now();
    let mut child = tokio::process::Command::new(exe)
        .arg("up")
        .arg("--data-dir")
        .arg(dir.path())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--node-port",
            "0",
            "--node-name",
            "bench-local",
        ])
        .args(["--metrics-bind-address", ""])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("start `trellis up`")?;
    let measured = async {
        let kubeconfig = dir.path().join("admin.kubeconfig");
        let client = loop {
            if started.elapsed() > START_LIMIT {
                bail!("`trellis up` wrote no admin.kubeconfig within {START_LIMIT:?}");
            }
            if kubeconfig.is_file()
                && let Ok(client) = trellis_client::transport::remote(&kubeconfig).await
                && client
                    .request_text(hyper::Request::get("/readyz").body(Vec::new())?)
                    .await
                    .is_ok_and(|body| body.trim() == "ok")
            {
                break client;
            }
            // The file appears within milliseconds; the server's listener then too.
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        let api = started.elapsed();
        let informers = SharedInformers::new();
        let nodes = informers.informer::<Node>(Api::all(client), watcher::Config::default());
        let mut changes = nodes.subscribe();
        let ready = async {
            while !nodes.get("bench-local").is_some_and(|n| {
                n.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            }) {
                changes.recv().await.context("the node informer ended")?;
            }
            Ok::<_, anyhow::Error>(())
        };
        tokio::time::timeout(START_LIMIT, ready)
            .await
            .context("the local node was not Ready in time")??;
        let node = started.elapsed();
        let rss = child.id().map_or(0.0, super::pod_start::rss_of);
        Ok((api, node, rss))
    }
    .await;
    let _ = child.start_kill();
    let _ = child.wait().await;
    measured
}
