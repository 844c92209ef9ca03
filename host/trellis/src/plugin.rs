//! `trellis plugin`: running a plugin offline, measuring it, and managing Plugin
//! objects.
//!
//! - `run FILE.wasm --kind KIND --input FILE [--config FILE]` calls the plugin once, in
//!   this process, with the same host, limits and failures as the API server, and
//!   prints its answer: an `AdmissionReview` response for admission plugins, the
//!   initialized object for initializers. The input is an `AdmissionReview` (as a
//!   Kubernetes webhook receives it), its `request`, or a bare object (read as a
//!   create by `admin`).
//! - `bench FILE.wasm …` calls it repeatedly and prints per-call p50/p99.
//! - `list`, `describe NAME`, `install NAME FILE.wasm …`, `uninstall NAME` manage
//!   Plugin objects through the API server of a kubeconfig.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand, ValueEnum};
use hyper::{Method, StatusCode};
use serde::Serialize;
use serde_json::{Value, json};
use trellis_plugin_host::review::{request_from_review, review_from_response};
use trellis_plugin_host::{
    Compilers, GroupVersionKind, GroupVersionResource, HostConfig, InitializeRequest, PluginHost,
    PluginKind, PluginSpec,
};

use crate::bench::Percentiles;
use crate::rest::{Target, exchange};

#[derive(Debug, Args)]
pub struct PluginArgs {
    #[command(subcommand)]
    command: PluginCommand,
}

#[derive(Debug, Subcommand)]
enum PluginCommand {
    /// Call a plugin once, offline, and print its answer.
    Run(RunArgs),
    /// Call a plugin repeatedly, offline, and print per-call latency.
    Bench(BenchArgs),
    /// List the Plugin objects of a cluster.
    List(ClusterArgs),
    /// Show one Plugin: its spec, whether it is loaded, the digest serving, counters.
    Describe(DescribeArgs),
    /// Create or update a Plugin object for a module file.
    Install(InstallArgs),
    /// Delete a Plugin object.
    Uninstall(DescribeArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Kind {
    Mutating,
    Validating,
    Initializer,
}

impl From<Kind> for PluginKind {
    fn from(kind: Kind) -> Self {
        match kind {
            Kind::Mutating => PluginKind::Mutating,
            Kind::Validating => PluginKind::Validating,
            Kind::Initializer => PluginKind::Initializer,
        }
    }
}

#[derive(Debug, Args)]
struct Offline {
    /// The component.
    #[arg(value_name = "FILE.wasm")]
    module: PathBuf,

    /// What the plugin is.
    #[arg(long, value_enum)]
    kind: Kind,

    /// An AdmissionReview, its request, or an object (JSON or YAML).
    #[arg(long, value_name = "FILE")]
    input: PathBuf,

    /// The plugin's configuration (JSON or YAML); `{}` without it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,

    /// The call's deadline.
    #[arg(long, default_value_t = 100, value_name = "MS")]
    timeout_ms: u64,

    /// The instance's memory cap.
    #[arg(long, default_value_t = 64, value_name = "MIB")]
    memory_limit_mib: usize,

    /// The compiler: `baseline` (Winch: compiles in a fraction of a second, the code
    /// the server runs while `optimized` compiles) or `optimized` (Cranelift: what the
    /// server serves once ready). `run` defaults to baseline, `bench` to optimized.
    #[arg(long, value_enum)]
    tier: Option<TierArg>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum TierArg {
    Baseline,
    Optimized,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    offline: Offline,
}

#[derive(Debug, Args)]
struct BenchArgs {
    #[command(flatten)]
    offline: Offline,

    /// Measured calls.
    #[arg(long, default_value_t = 10_000)]
    calls: usize,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct ClusterArgs {
    /// The cluster's kubeconfig (its current context).
    #[arg(long, env = "KUBECONFIG", value_name = "FILE")]
    kubeconfig: PathBuf,
}

#[derive(Debug, Args)]
struct DescribeArgs {
    name: String,
    #[command(flatten)]
    cluster: ClusterArgs,
}

#[derive(Debug, Args)]
struct InstallArgs {
    /// The Plugin object's name.
    name: String,

    /// The component, read by the server from this path.
    #[arg(value_name = "FILE.wasm")]
    module: PathBuf,

    #[arg(long, value_enum)]
    kind: Kind,

    /// Resources the plugin judges (`pods`, `deployments.apps`, `*`); admission
    /// plugins need at least one.
    #[arg(long = "resource", value_name = "RESOURCE[.GROUP]")]
    resources: Vec<String>,

    /// Operations it judges.
    #[arg(long = "operation", default_values_t = ["CREATE".to_owned(), "UPDATE".to_owned()])]
    operations: Vec<String>,

    /// `Fail` refuses requests when the plugin fails; `Ignore` lets them through.
    #[arg(long, default_value = "Fail")]
    failure_policy: String,

    /// The plugin's configuration (JSON or YAML).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,

    #[arg(long, default_value_t = 0)]
    order: i32,

    #[arg(long, default_value_t = 100, value_name = "MS")]
    timeout_ms: u64,

    #[arg(long, default_value_t = 64, value_name = "MIB")]
    memory_limit_mib: u64,

    #[command(flatten)]
    cluster: ClusterArgs,
}

pub async fn run(args: PluginArgs) -> anyhow::Result<()> {
    match args.command {
        PluginCommand::Run(args) => run_once(args.offline).await,
        PluginCommand::Bench(args) => bench(args).await,
        PluginCommand::List(args) => list(args).await,
        PluginCommand::Describe(args) => describe(args).await,
        PluginCommand::Install(args) => install(args).await,
        PluginCommand::Uninstall(args) => uninstall(args).await,
    }
}

fn read_document(path: &Path) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    serde_saphyr::from_str(&text)
        .with_context(|| format!("parse {} as JSON or YAML", path.display()))
}

/// A loaded plugin and what to call it with.
struct Prepared {
    host: Arc<PluginHost>,
    plugin: Arc<trellis_plugin_host::Plugin>,
    call: Call,
    /// Compiling, linking and starting the plugin (no compiled-code cache offline).
    load: Duration,
}

enum Call {
    Admit(Box<trellis_plugin_host::AdmissionRequest>),
    Initialize(Box<InitializeRequest>),
}

async fn prepare(args: &Offline, default_tier: TierArg) -> anyhow::Result<Prepared> {
    let configuration = match &args.config {
        Some(path) => read_document(path)?.to_string(),
        None => "{}".to_owned(),
    };
    let input = read_document(&args.input)?;
    let bytes =
        std::fs::read(&args.module).with_context(|| format!("read {}", args.module.display()))?;
    let name = args
        .module
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("plugin")
        .to_owned();
    let kind = PluginKind::from(args.kind);
    let mut spec = PluginSpec::new(name, kind);
    spec.configuration.clone_from(&configuration);
    spec.timeout = Duration::from_millis(args.timeout_ms);
    spec.memory_limit = args.memory_limit_mib << 20;
    let compilers = match args.tier.unwrap_or(default_tier) {
        TierArg::Baseline => Compilers::Baseline,
        TierArg::Optimized => Compilers::Optimized,
    };
    let host = PluginHost::new(HostConfig {
        max_instances: 16,
        compilers,
        ..HostConfig::default()
    })
    .context("start the plugin engine")?;
    let started = Instant::now();
    let plugin = host
        .load(spec, Arc::new(bytes), None)
        .await
        .map_err(|e| anyhow::anyhow!("{} ({})", e.message, e.reason.as_str()))
        .with_context(|| format!("load {}", args.module.display()))?;
    let load = started.elapsed();
    let review = as_review(input);
    let call = match kind {
        PluginKind::Mutating | PluginKind::Validating => Call::Admit(Box::new(
            request_from_review(&review, &configuration)
                .map_err(|e| anyhow::anyhow!(e))
                .context("read the input")?,
        )),
        PluginKind::Controller => {
            anyhow::bail!("controller plugins reconcile objects: `trellis controllers` runs them")
        }
        PluginKind::Scheduler => {
            anyhow::bail!("scheduler plugins place pods: `trellis scheduler` runs them")
        }
        PluginKind::Initializer => {
            let req = &review["request"];
            let object = req["object"].clone();
            Call::Initialize(Box::new(InitializeRequest {
                kind: GroupVersionKind {
                    group: req["kind"]["group"].as_str().unwrap_or_default().into(),
                    version: req["kind"]["version"].as_str().unwrap_or_default().into(),
                    kind: req["kind"]["kind"].as_str().unwrap_or_default().into(),
                },
                resource: GroupVersionResource {
                    group: req["resource"]["group"].as_str().unwrap_or_default().into(),
                    version: req["resource"]["version"]
                        .as_str()
                        .unwrap_or_default()
                        .into(),
                    resource: req["resource"]["resource"]
                        .as_str()
                        .unwrap_or_default()
                        .into(),
                },
                object: object.to_string(),
                configuration,
            }))
        }
    };
    Ok(Prepared {
        host,
        plugin,
        call,
        load,
    })
}

/// An AdmissionReview for any input: a review stays one, a bare request is wrapped,
/// a bare object becomes a create of it.
fn as_review(input: Value) -> Value {
    if input.get("request").is_some() {
        return input;
    }
    if input.get("operation").is_some() {
        return json!({"request": input});
    }
    let api_version = input["apiVersion"].as_str().unwrap_or("v1").to_owned();
    let (group, version) = match api_version.split_once('/') {
        Some((g, v)) => (g.to_owned(), v.to_owned()),
        None => (String::new(), api_version),
    };
    let kind = input["kind"].as_str().unwrap_or_default().to_owned();
    // The usual plural; exact for the built-in kinds people try this with.
    let resource = match kind.to_ascii_lowercase() {
        k if k.ends_with('s') => format!("{k}es"),
        k if k.ends_with('y') => format!("{}ies", &k[..k.len() - 1]),
        k => format!("{k}s"),
    };
    json!({"request": {
        "uid": "trellis-plugin-run",
        "kind": {"group": group, "version": version, "kind": kind},
        "resource": {"group": group, "version": version, "resource": resource},
        "name": input["metadata"]["name"],
        "namespace": input["metadata"]["namespace"],
        "operation": "CREATE",
        "userInfo": {"username": "admin", "groups": ["system:masters", "system:authenticated"]},
        "object": input,
    }})
}

async fn call_once(p: &Prepared) -> anyhow::Result<Value> {
    match &p.call {
        Call::Admit(req) => {
            let answer = p.plugin.admit(&p.host, req).await?;
            Ok(review_from_response(&req.uid, &answer))
        }
        Call::Initialize(req) => match p.plugin.initialize(&p.host, req).await? {
            Ok(object) => serde_json::from_str(&object).with_context(|| {
                format!("{} returned an object that is not JSON", p.plugin.label())
            }),
            Err(reason) => bail!("{} refused to initialize: {reason}", p.plugin.label()),
        },
    }
}

async fn run_once(args: Offline) -> anyhow::Result<()> {
    let prepared = prepare(&args, TierArg::Baseline).await?;
    let answer = call_once(&prepared).await.context("call the plugin")?;
    println!("{}", serde_json::to_string_pretty(&answer)?);
    Ok(())
}

#[derive(Debug, Serialize)]
struct BenchReport {
    plugin: String,
    digest: String,
    /// `baseline` (Winch) or `optimized` (Cranelift).
    tier: &'static str,
    /// Compiling (on all cores), linking and starting the plugin, in milliseconds.
    load_ms: f64,
    calls: usize,
    calls_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
}

async fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let prepared = prepare(&args.offline, TierArg::Optimized).await?;
    // Warm the instance pool and the caches.
    for _ in 0..(args.calls / 10).clamp(1, 1000) {
        call_once(&prepared).await.context("warm up")?;
    }
    let mut latencies = Vec::with_capacity(args.calls);
    let started = Instant::now();
    for _ in 0..args.calls {
        let t = Instant::now();
        call_once(&prepared).await.context("call the plugin")?;
        latencies.push(t.elapsed());
    }
    let elapsed = started.elapsed();
    let p = Percentiles::of(&mut latencies);
    let report = BenchReport {
        plugin: prepared.plugin.name().to_owned(),
        digest: prepared.plugin.digest().to_owned(),
        tier: prepared.plugin.tier().as_str(),
        load_ms: (prepared.load.as_secs_f64() * 1000.0 * 10.0).round() / 10.0,
        calls: args.calls,
        calls_per_sec: (args.calls as f64 / elapsed.as_secs_f64()).round(),
        p50_us: (p.p50_ms * 1000.0 * 10.0).round() / 10.0,
        p99_us: (p.p99_ms * 1000.0 * 10.0).round() / 10.0,
        max_us: (p.max_ms * 1000.0 * 10.0).round() / 10.0,
    };
    crate::bench::print_report(args.json, &report, || {
        format!(
            "plugin {} ({}, {} code, loaded in {:.1} ms): {} calls: {:.0} calls/s, per call p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
            report.plugin,
            report.digest,
            report.tier,
            report.load_ms,
            report.calls,
            report.calls_per_sec,
            report.p50_us,
            report.p99_us,
            report.max_us
        )
    })
}

const PLUGINS_PATH: &str = "/apis/trellis.dev/v1/plugins";

async fn api(
    cluster: &ClusterArgs,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> anyhow::Result<(StatusCode, Value)> {
    let target = Target::from_kubeconfig(&cluster.kubeconfig, false)?;
    let body = body.map(Value::to_string).unwrap_or_default();
    let (status, bytes) = exchange(&target, method, path, body.into_bytes()).await?;
    let value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Ok((status, value))
}

fn server_error(status: StatusCode, body: &Value) -> anyhow::Error {
    anyhow::anyhow!(
        "the server answered {status}: {}",
        body["message"].as_str().unwrap_or("(no message)")
    )
}

fn loaded_condition(obj: &Value) -> (String, String, String) {
    let cond = obj["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Loaded"))
        .cloned()
        .unwrap_or_default();
    let text = |v: &Value| v.as_str().unwrap_or("").to_owned();
    (
        text(&cond["status"]),
        text(&cond["reason"]),
        text(&cond["message"]),
    )
}

async fn list(args: ClusterArgs) -> anyhow::Result<()> {
    let (status, body) = api(&args, Method::GET, PLUGINS_PATH, None).await?;
    if status != StatusCode::OK {
        return Err(server_error(status, &body)).context("list Plugins");
    }
    println!(
        "{:<24} {:<12} {:<8} {:<7} {:<20} {:>8} {:>8} {:>7}",
        "NAME", "KIND", "POLICY", "LOADED", "DIGEST", "CALLS", "DENIALS", "ERRORS"
    );
    for item in body["items"].as_array().into_iter().flatten() {
        let (loaded, _, _) = loaded_condition(item);
        let digest = item["status"]["digest"].as_str().unwrap_or("");
        println!(
            "{:<24} {:<12} {:<8} {:<7} {:<20} {:>8} {:>8} {:>7}",
            item["metadata"]["name"].as_str().unwrap_or(""),
            item["spec"]["kind"].as_str().unwrap_or(""),
            item["spec"]["failurePolicy"].as_str().unwrap_or("Fail"),
            if loaded.is_empty() {
                "Unknown"
            } else {
                &loaded
            },
            digest.get(..19).unwrap_or(digest),
            item["status"]["calls"].as_u64().unwrap_or(0),
            item["status"]["denials"].as_u64().unwrap_or(0),
            item["status"]["errors"].as_u64().unwrap_or(0),
        );
    }
    Ok(())
}

async fn describe(args: DescribeArgs) -> anyhow::Result<()> {
    let path = format!("{PLUGINS_PATH}/{}", args.name);
    let (status, obj) = api(&args.cluster, Method::GET, &path, None).await?;
    if status != StatusCode::OK {
        return Err(server_error(status, &obj))
            .with_context(|| format!("get Plugin {}", args.name));
    }
    let spec = &obj["spec"];
    let (loaded, reason, message) = loaded_condition(&obj);
    println!("Name:            {}", args.name);
    println!("Kind:            {}", spec["kind"].as_str().unwrap_or(""));
    println!(
        "Module:          {}",
        spec["module"]["url"].as_str().unwrap_or("")
    );
    println!(
        "Failure policy:  {}",
        spec["failurePolicy"].as_str().unwrap_or("Fail")
    );
    println!("Order:           {}", spec["order"].as_i64().unwrap_or(0));
    println!(
        "Timeout:         {}ms",
        spec["timeoutMs"].as_u64().unwrap_or(100)
    );
    println!(
        "Memory limit:    {}MiB",
        spec["memoryLimitMiB"].as_u64().unwrap_or(64)
    );
    println!("Rules:           {}", spec["rules"]);
    if let Some(config) = spec.get("configuration") {
        println!("Configuration:   {config}");
    }
    println!("Loaded:          {loaded} ({reason}) {message}");
    println!(
        "Digest serving:  {}",
        obj["status"]["digest"].as_str().unwrap_or("none")
    );
    println!(
        "Calls:           {} ({} denied, {} errors, {} timeouts)",
        obj["status"]["calls"].as_u64().unwrap_or(0),
        obj["status"]["denials"].as_u64().unwrap_or(0),
        obj["status"]["errors"].as_u64().unwrap_or(0),
        obj["status"]["timeouts"].as_u64().unwrap_or(0),
    );
    Ok(())
}

async fn install(args: InstallArgs) -> anyhow::Result<()> {
    let module = std::fs::canonicalize(&args.module)
        .with_context(|| format!("find {}", args.module.display()))?;
    let bytes = std::fs::read(&module).with_context(|| format!("read {}", module.display()))?;
    let digest = trellis_plugin_host::digest_of(&bytes);
    let rules: Vec<Value> = args
        .resources
        .iter()
        .map(|r| {
            let (resource, group) = r.split_once('.').unwrap_or((r.as_str(), ""));
            json!({
                "operations": args.operations,
                "apiGroups": [if resource == "*" { "*" } else { group }],
                "apiVersions": ["*"],
                "resources": [resource],
            })
        })
        .collect();
    let mut spec = json!({
        "kind": format!("{:?}", args.kind).to_ascii_lowercase(),
        "module": {"url": format!("file://{}", module.display()),
                   "sha256": digest.trim_start_matches("sha256:")},
        "rules": rules,
        "failurePolicy": args.failure_policy,
        "order": args.order,
        "timeoutMs": args.timeout_ms,
        "memoryLimitMiB": args.memory_limit_mib,
    });
    if let Some(path) = &args.config {
        spec["configuration"] = read_document(path)?;
    }
    let path = format!("{PLUGINS_PATH}/{}", args.name);
    let (status, existing) = api(&args.cluster, Method::GET, &path, None).await?;
    let (status, body) = if status == StatusCode::NOT_FOUND {
        let obj = json!({"apiVersion": "trellis.dev/v1", "kind": "Plugin",
                         "metadata": {"name": args.name}, "spec": spec});
        api(&args.cluster, Method::POST, PLUGINS_PATH, Some(&obj)).await?
    } else if status == StatusCode::OK {
        let mut obj = existing;
        obj["spec"] = spec;
        api(&args.cluster, Method::PUT, &path, Some(&obj)).await?
    } else {
        return Err(server_error(status, &existing)).context("read the Plugin");
    };
    if !status.is_success() {
        return Err(server_error(status, &body))
            .with_context(|| format!("install Plugin {}", args.name));
    }
    let generation = body["metadata"]["generation"].as_i64().unwrap_or(0);
    // Report the load's outcome, as the server records it.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, obj) = api(&args.cluster, Method::GET, &path, None).await?;
        let (loaded, reason, message) = loaded_condition(&obj);
        let observed = obj["status"]["observedGeneration"].as_i64().unwrap_or(0);
        if observed >= generation && !loaded.is_empty() {
            if loaded == "True" {
                println!("plugin {} serving {digest}", args.name);
                return Ok(());
            }
            bail!("load plugin {}: {reason}: {message}", args.name);
        }
        if Instant::now() > deadline {
            bail!(
                "load plugin {}: the server did not report a result within 30 s",
                args.name
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn uninstall(args: DescribeArgs) -> anyhow::Result<()> {
    let path = format!("{PLUGINS_PATH}/{}", args.name);
    let (status, body) = api(&args.cluster, Method::DELETE, &path, None).await?;
    if !status.is_success() {
        return Err(server_error(status, &body))
            .with_context(|| format!("delete Plugin {}", args.name));
    }
    println!("plugin {} uninstalled", args.name);
    Ok(())
}
