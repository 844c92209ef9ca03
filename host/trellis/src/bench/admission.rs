//! `trellis bench admission`: what plugins in the admission chain cost a create.
//!
//! Each round starts a server in this process twice, on a fresh store each time: once
//! without plugins and once with `--plugins` Plugin objects of a validating plugin,
//! and measures pod creates over HTTPS as `trellis bench api --kind pods --verb
//! create` does.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Args;
use clap::builder::RangedU64ValueParser;
use hyper::{Method, StatusCode};
use serde::Serialize;
use tokio::time::Instant;

use super::api::{self, ApiArgs, Report};
use super::cluster::LocalCluster;
use crate::rest::{Credentials, Target, exchange, status_message};

#[derive(Debug, Args)]
pub struct AdmissionArgs {
    /// Copies of the plugin installed, each a Plugin object of its own.
    #[arg(long, default_value_t = 1)]
    plugins: usize,

    /// The validating plugin to install; by default the pod-policy example built by
    /// `plugins/build.sh`.
    #[arg(long, value_name = "FILE.wasm")]
    plugin: Option<PathBuf>,

    /// Its configuration (JSON).
    #[arg(long, default_value = r#"{"allowedRegistries":["registry.k8s.io/"]}"#)]
    config: String,

    /// Concurrent clients, each on its own connection.
    #[arg(long, default_value_t = 50, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    clients: usize,

    /// Measured creates per run (one run without plugins, one with, per round).
    #[arg(long, default_value_t = 10_000, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    ops: usize,

    /// Rounds of one run without plugins and one with, alternated so that a machine
    /// whose speed drifts between runs slows both sides alike. The report is the round
    /// with the median throughput ratio; every round's ratio is listed.
    #[arg(long, default_value_t = 3, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    rounds: usize,

    /// Print one JSON object instead of lines of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct AdmissionReport {
    plugins: usize,
    plugin: String,
    clients: usize,
    ops: usize,
    ops_per_sec: f64,
    p50_ms: f64,
    p99_ms: f64,
    baseline_ops_per_sec: f64,
    baseline_p50_ms: f64,
    baseline_p99_ms: f64,
    /// Creates/s with the plugins as a share of creates/s without (the median round's).
    throughput_ratio: f64,
    /// Every round's ratio, in the order run.
    throughput_ratios: Vec<f64>,
    /// Added p50 and p99 latency per plugin, in microseconds.
    overhead_p50_us_per_plugin: f64,
    overhead_p99_us_per_plugin: f64,
}

/// `--plugin`, else the pod-policy example built by `plugins/build.sh`; absolute.
pub(crate) fn plugin_or_bundled(plugin: Option<&Path>) -> anyhow::Result<PathBuf> {
    let plugin = plugin.map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../plugins/target/dist/pod-policy.wasm"),
        Path::to_path_buf,
    );
    std::fs::canonicalize(&plugin).with_context(|| {
        format!(
            "find the plugin {} (build it with `make plugins`, or pass --plugin)",
            plugin.display()
        )
    })
}

pub async fn run(args: AdmissionArgs) -> anyhow::Result<()> {
    let plugin = plugin_or_bundled(args.plugin.as_deref())?;
    let api_args = |ops| ApiArgs::pod_creates(args.clients, ops);
    let mut rounds = Vec::with_capacity(args.rounds);
    for round in 1..=args.rounds {
        let baseline = measure_local(&api_args(args.ops), None, 0)
            .await
            .with_context(|| format!("round {round}: measure without plugins"))?;
        let with = measure_local(
            &api_args(args.ops),
            Some((&plugin, &args.config)),
            args.plugins,
        )
        .await
        .with_context(|| format!("round {round}: measure with {} plugins", args.plugins))?;
        let ratio = ((with.ops_per_sec / baseline.ops_per_sec) * 1000.0).round() / 1000.0;
        tracing::info!(round, ratio, "admission round measured");
        rounds.push((ratio, baseline, with));
    }
    let throughput_ratios: Vec<f64> = rounds.iter().map(|(ratio, ..)| *ratio).collect();
    rounds.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (throughput_ratio, baseline, with) = rounds.swap_remove(rounds.len() / 2);
    let per_plugin = |with: f64, without: f64| {
        if args.plugins == 0 {
            0.0
        } else {
            ((with - without) * 1000.0 / args.plugins as f64 * 10.0).round() / 10.0
        }
    };
    let report = AdmissionReport {
        plugins: args.plugins,
        plugin: plugin.display().to_string(),
        clients: args.clients,
        ops: args.ops,
        ops_per_sec: with.ops_per_sec,
        p50_ms: with.p50_ms,
        p99_ms: with.p99_ms,
        baseline_ops_per_sec: baseline.ops_per_sec,
        baseline_p50_ms: baseline.p50_ms,
        baseline_p99_ms: baseline.p99_ms,
        throughput_ratio,
        throughput_ratios,
        overhead_p50_us_per_plugin: per_plugin(with.p50_ms, baseline.p50_ms),
        overhead_p99_us_per_plugin: per_plugin(with.p99_ms, baseline.p99_ms),
    };
    super::print_report(args.json, &report, || {
        format!(
            "admission, pod creates with {} plugin(s), {} clients, {} requests: {:.0}/s \
             (without: {:.0}/s, {:.0} %; rounds {:?}), p50 {:.3} ms, p99 {:.3} ms \
             (without: {:.3} / {:.3} ms); per plugin +{:.1} µs p50, +{:.1} µs p99",
            report.plugins,
            report.clients,
            report.ops,
            report.ops_per_sec,
            report.baseline_ops_per_sec,
            report.throughput_ratio * 100.0,
            report.throughput_ratios,
            report.p50_ms,
            report.p99_ms,
            report.baseline_p50_ms,
            report.baseline_p99_ms,
            report.overhead_p50_us_per_plugin,
            report.overhead_p99_us_per_plugin,
        )
    })
}

/// Starts a server in this process, installs `copies` Plugin objects of `plugin`
/// (waiting until each serves), and measures creates.
async fn measure_local(
    args: &ApiArgs,
    plugin: Option<(&Path, &str)>,
    copies: usize,
) -> anyhow::Result<Report> {
    let cluster = LocalCluster::start().await?;
    let target = Target::new(
        &cluster.server.url,
        &cluster.server.ca_pem,
        Credentials::Token(cluster.server.admin_token.clone()),
        false,
    )?;
    let measured = async {
        if let Some((path, config)) = plugin {
            let config: serde_json::Value =
                serde_json::from_str(config).context("parse --config as JSON")?;
            for i in 0..copies {
                install_plugin(&target, &format!("bench-{i}"), path, &config).await?;
            }
        }
        api::measure(&target, args).await
    }
    .await;
    let stopped = cluster.stop().await;
    let report = measured?;
    stopped?;
    Ok(report)
}

async fn install_plugin(
    target: &Target,
    name: &str,
    path: &Path,
    config: &serde_json::Value,
) -> anyhow::Result<()> {
    let obj = serde_json::json!({
        "apiVersion": "trellis.dev/v1",
        "kind": "Plugin",
        "metadata": {"name": name},
        "spec": {
            "kind": "validating",
            "module": {"url": format!("file://{}", path.display())},
            "configuration": config,
            "rules": [{"operations": ["CREATE", "UPDATE"], "apiGroups": [""],
                       "apiVersions": ["v1"], "resources": ["pods"]}],
        },
    });
    let (status, body) = exchange(
        target,
        Method::POST,
        "/apis/trellis.dev/v1/plugins",
        obj.to_string().into_bytes(),
    )
    .await?;
    if status != StatusCode::CREATED {
        bail!("install plugin {name}: {status}: {}", status_message(&body));
    }
    // Measured on the code a plugin serves for good: a module's first load serves
    // Winch's code until Cranelift's is ready (the status's `tier`, refreshed every
    // 10 s).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (_, body) = exchange(
            target,
            Method::GET,
            &format!("/apis/trellis.dev/v1/plugins/{name}"),
            Vec::new(),
        )
        .await?;
        let obj: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let cond = &obj["status"]["conditions"][0];
        match cond["status"].as_str() {
            Some("True") if obj["status"]["tier"] == "optimized" => return Ok(()),
            Some("False") => bail!("load plugin {name}: {}", cond["message"]),
            _ if Instant::now() > deadline => {
                bail!("load plugin {name}: not serving optimized code within 120 s")
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}
