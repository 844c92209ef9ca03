//! Benchmarks of the store backends, the API server, plugins, the controllers, the
//! scheduler and nodes: `trellis bench`, whose figures `docs/benchmarks.md` keeps.
//!
//! Each store benchmark opens a backend with [`OpenStore::open`], drives it through the
//! [`Store`] trait only (so both backends run the same code), and reports percentiles
//! computed by [`Percentiles::of`]. The API benchmark drives the server over HTTPS, as
//! clients do, and reports the same percentiles.
//!
//! # Layout
//! - [`store`]: durable write throughput and latency.
//! - [`watch`]: write-to-watcher delivery latency.
//! - [`compaction`]: the longest write stall compaction causes.
//! - [`api`]: API request throughput and latency over HTTPS.
//! - [`admission`]: what WASM plugins in the admission chain cost a create.
//! - [`reload`]: how soon a changed plugin serves.
//! - [`informer`]: a shared informer's sync, memory and fan-out, remote and in-process.
//! - [`controller`]: a controller plugin's writes, batched against one host call each.
//! - [`controllers`]: the built-in controllers: a Deployment's pods, a rollout, one
//!   reconcile at the WASM boundary; `--case daemonset` a DaemonSet over many nodes
//!   and its rollout, `--case jobs` many Jobs run to completion, `--case hpa` many
//!   autoscalers scaling their Deployments on the resource metrics API.
//! - [`scheduler`]: scheduling throughput and latency with the default WASM plugins.
//! - [`pod_start`]: how soon a bound pod runs, per runtime handler.
//! - [`up`]: how soon `trellis up` is ready on an empty store.
//! - [`flow`]: a Deployment's pods created → Running on hollow nodes, in one process.
//! - [`dns`]: cluster DNS queries per second and a new Service's time to resolve.
//! - [`cluster`]: [`cluster::LocalCluster`], the server in this process that the
//!   benchmarks of a cluster start.

mod admission;
mod api;
mod cluster;
mod compaction;
mod controller;
mod controllers;
mod dns;
mod flow;
mod hpa;
mod informer;
mod pod_start;
mod proxy;
mod reload;
mod scheduler;
mod store;
mod up;
mod watch;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand, ValueEnum};
use trellis_store::local_etcd::LocalEtcd;
use trellis_store::{EtcdConfig, EtcdStore, RedbConfig, RedbStore, Store};

/// Longest a single store call or API request may take before the benchmark fails: the
/// client's bound on a request, for store calls too. Far above any healthy latency; it
/// only exists so that a wedged backend ends the run with an error instead of hanging
/// it.
pub(crate) const CALL_TIMEOUT: Duration = crate::rest::REQUEST_TIMEOUT;

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Durable write throughput and per-write latency of concurrent writers.
    Store(store::StoreArgs),
    /// Latency from a write's acknowledgement to its delivery to every watcher.
    Watch(watch::WatchArgs),
    /// The longest write stall while compaction purges history.
    Compaction(compaction::CompactionArgs),
    /// API request throughput and latency of concurrent clients over HTTPS.
    Api(api::ApiArgs),
    /// Pod creates with WASM validating plugins in the admission chain, against none.
    Admission(admission::AdmissionArgs),
    /// Time from a plugin change to the first request the new version judges.
    PluginReload(reload::PluginReloadArgs),
    /// A shared informer of many pods: sync time, memory per object, change fan-out.
    Informer(informer::InformerArgs),
    /// A controller plugin creating many objects: batched writes against one host
    /// call per write.
    Controller(controller::ControllerArgs),
    /// The built-in controllers: a Deployment's pods created, a rollout, and the cost
    /// of one reconcile at the WASM boundary (`--case`: a DaemonSet on many nodes,
    /// many Jobs, many autoscalers).
    Controllers(controllers::ControllersArgs),
    /// The scheduler with the default plugins (WASM): pods bound per second, the
    /// attempt latency and the share of it in WASM, in scheduler_perf's cases.
    Scheduler(scheduler::SchedulerArgs),
    /// Pod start on a node: bound → Running observed through the API, per handler.
    PodStart(pod_start::PodStartArgs),
    /// `trellis up` on an empty store: until the API answers and the local node is
    /// Ready.
    Up(up::UpArgs),
    /// The seed flow on hollow nodes: Deployments created → every pod Running, pod
    /// startup latency, and the memory and CPU of idle hollow nodes.
    Flow(flow::FlowArgs),
    /// The service proxy: a full sync of many Services to the kernel and single endpoint
    /// changes, in a network namespace of its own.
    Proxy(proxy::ProxyArgs),
    /// Cluster DNS: queries per second and latency for cluster names, and how soon a
    /// new Service resolves.
    Dns(dns::DnsArgs),
    /// The memory half of `informer`, in a process of its own.
    #[command(hide = true)]
    InformerChild(informer::InformerChildArgs),
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.command {
        BenchCommand::Store(args) => store::run(args).await.context("run the store benchmark"),
        BenchCommand::Watch(args) => watch::run(args).await.context("run the watch benchmark"),
        BenchCommand::Compaction(args) => compaction::run(args)
            .await
            .context("run the compaction benchmark"),
        BenchCommand::Api(args) => api::run(args).await.context("run the API benchmark"),
        BenchCommand::Admission(args) => admission::run(args)
            .await
            .context("run the admission benchmark"),
        BenchCommand::PluginReload(args) => reload::run(args)
            .await
            .context("run the plugin reload benchmark"),
        BenchCommand::Informer(args) => informer::run(args)
            .await
            .context("run the informer benchmark"),
        BenchCommand::Controller(args) => controller::run(args)
            .await
            .context("run the controller benchmark"),
        BenchCommand::Controllers(args) => controllers::run(args)
            .await
            .context("run the controllers benchmark"),
        BenchCommand::Scheduler(args) => scheduler::run(args)
            .await
            .context("run the scheduler benchmark"),
        BenchCommand::PodStart(args) => pod_start::run(args)
            .await
            .context("run the pod start benchmark"),
        BenchCommand::Up(args) => up::run(args).await.context("run the up benchmark"),
        BenchCommand::Flow(args) => flow::run(args).await.context("run the flow benchmark"),
        BenchCommand::Proxy(args) => proxy::run(args).await.context("run the proxy benchmark"),
        BenchCommand::Dns(args) => dns::run(args).await.context("run the DNS benchmark"),
        BenchCommand::InformerChild(args) => informer::run_child(args)
            .await
            .context("measure an informer's memory"),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// The embedded store: one redb file.
    Redb,
    /// etcd v3.
    Etcd,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Redb => "redb",
            Backend::Etcd => "etcd",
        }
    }
}

/// Which backend to measure and where it lives; shared by every benchmark.
#[derive(Debug, Args)]
pub struct BackendArgs {
    /// The store backend to measure.
    #[arg(long, value_enum)]
    backend: Backend,

    /// etcd client URLs, comma-separated. Without them a throwaway etcd is started on
    /// loopback (needs the `etcd` binary on PATH, or TRELLIS_ETCD_BIN).
    #[arg(long, value_delimiter = ',', value_name = "URL[,URL]")]
    etcd_endpoints: Vec<String>,

    /// Directory of the redb file (`store.redb`). Without it a temporary directory is
    /// used and removed afterwards.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
}

/// A backend opened for one benchmark run, with whatever must outlive it.
pub struct OpenStore {
    pub store: Arc<dyn Store>,
    pub backend: Backend,
    /// Every key of this run starts with it. It holds a per-run id, so runs against a
    /// reused `--data-dir` or a shared etcd never collide with earlier ones.
    pub key_base: String,
    /// Kept to close the embedded store cleanly (finish queued writes, join the
    /// committer thread) before its directory goes away.
    pub redb: Option<Arc<RedbStore>>,
    // Declared after `store` so they drop after it: the etcd process and the temporary
    // directory must outlive every handle on them.
    _local_etcd: Option<LocalEtcd>,
    _temp_dir: Option<tempfile::TempDir>,
}

impl std::fmt::Debug for OpenStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenStore")
            .field("backend", &self.backend)
            .field("key_base", &self.key_base)
            .finish_non_exhaustive()
    }
}

impl OpenStore {
    pub async fn open(args: &BackendArgs) -> anyhow::Result<Self> {
        let run_id = run_id();
        let key_base = format!("/bench/{run_id}/");
        match args.backend {
            Backend::Redb => {
                if !args.etcd_endpoints.is_empty() {
                    bail!("check arguments: --etcd-endpoints only applies to --backend etcd");
                }
                let (dir, temp_dir) = match &args.data_dir {
                    Some(dir) => (dir.clone(), None),
                    None => {
                        let temp = tempfile::Builder::new()
                            .prefix("trellis-bench-")
                            .tempdir()
                            .context("create a temporary data directory")?;
                        (temp.path().to_owned(), Some(temp))
                    }
                };
                let path = dir.join("store.redb");
                let redb = Arc::new(
                    RedbStore::open(RedbConfig::new(&path))
                        .with_context(|| format!("open the redb store {}", path.display()))?,
                );
                tracing::info!(path = %path.display(), "opened redb store");
                Ok(Self {
                    store: redb.clone(),
                    backend: Backend::Redb,
                    key_base,
                    redb: Some(redb),
                    _local_etcd: None,
                    _temp_dir: temp_dir,
                })
            }
            Backend::Etcd => {
                if args.data_dir.is_some() {
                    bail!("check arguments: --data-dir only applies to --backend redb");
                }
                let (mut config, local_etcd) = if args.etcd_endpoints.is_empty() {
                    let etcd = LocalEtcd::start()
                        .await
                        .context("start a local etcd (install etcd or pass --etcd-endpoints)")?;
                    tracing::info!(endpoint = etcd.endpoint(), "started local etcd");
                    (etcd.config(), Some(etcd))
                } else {
                    (EtcdConfig::new(args.etcd_endpoints.iter().cloned()), None)
                };
                config.prefix = format!("/trellis-bench/{run_id}");
                let endpoints = config.endpoints.join(",");
                let prefix = config.prefix.clone();
                let etcd = EtcdStore::connect(config)
                    .await
                    .with_context(|| format!("connect to etcd at {endpoints}"))?;
                // The keys stay behind on a shared etcd; say where, so they can be removed.
                tracing::info!(%endpoints, %prefix, "connected to etcd");
                Ok(Self {
                    store: Arc::new(etcd),
                    backend: Backend::Etcd,
                    key_base,
                    redb: None,
                    _local_etcd: local_etcd,
                    _temp_dir: None,
                })
            }
        }
    }

    /// Closes the store; a local etcd and a temporary directory are removed on drop.
    pub async fn close(self) -> anyhow::Result<()> {
        if let Some(redb) = &self.redb {
            redb.close().await.context("close the redb store")?;
        }
        Ok(())
    }
}

/// Unique enough across runs and processes: the process id and the wall clock.
fn run_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{nanos:x}", std::process::id())
}

/// Prints a benchmark's report: one JSON object with `--json`, else `line()`.
pub(crate) fn print_report(
    json: bool,
    report: &impl serde::Serialize,
    line: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    if json {
        println!(
            "{}",
            serde_json::to_string(report).context("encode the report as JSON")?
        );
    } else {
        println!("{}", line());
    }
    Ok(())
}

/// Runs one store call with [`CALL_TIMEOUT`].
pub(crate) async fn bounded<T>(
    call: impl Future<Output = trellis_store::Result<T>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(result) => Ok(result?),
        Err(_) => bail!("no answer from the store within {CALL_TIMEOUT:?}"),
    }
}

/// Nearest-rank percentiles of a set of latencies, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Percentiles {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Percentiles {
    /// Sorts `samples` in place. All zero when there are no samples.
    pub fn of(samples: &mut [Duration]) -> Self {
        samples.sort_unstable();
        Self {
            p50_ms: ms(nearest_rank(samples, 50.0)),
            p99_ms: ms(nearest_rank(samples, 99.0)),
            max_ms: ms(samples.last().copied().unwrap_or_default()),
        }
    }
}

/// The smallest sample such that at least `p` percent of the samples are at or below
/// it. `sorted` must be in ascending order.
fn nearest_rank(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let n = sorted.len();
    // Sample counts are far below 2^52, so the float round trip is exact.
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    sorted[rank.clamp(1, n) - 1]
}

/// Milliseconds, rounded to the microsecond: finer digits are noise.
pub fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// How many of `total` items the `index`-th of `parts` workers takes, so that the
/// shares differ by at most one and add up to `total`.
pub fn share(total: usize, parts: usize, index: usize) -> usize {
    total / parts + usize::from(index < total % parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn millis(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|m| Duration::from_millis(*m)).collect()
    }

    #[test]
    fn nearest_rank_picks_the_covering_sample() {
        let sorted = millis(&(1..=100).collect::<Vec<_>>());
        assert_eq!(nearest_rank(&sorted, 50.0), Duration::from_millis(50));
        assert_eq!(nearest_rank(&sorted, 99.0), Duration::from_millis(99));
        assert_eq!(nearest_rank(&sorted, 100.0), Duration::from_millis(100));
        assert_eq!(nearest_rank(&millis(&[7]), 99.0), Duration::from_millis(7));
        assert_eq!(
            nearest_rank(&millis(&[1, 2, 3]), 50.0),
            Duration::from_millis(2)
        );
    }

    #[test]
    fn percentiles_sort_their_samples() {
        let mut samples = millis(&[5, 1, 3, 2, 4]);
        let p = Percentiles::of(&mut samples);
        assert_eq!((p.p50_ms, p.p99_ms, p.max_ms), (3.0, 5.0, 5.0));
        assert_eq!(Percentiles::of(&mut []).max_ms, 0.0);
    }

    #[test]
    fn shares_add_up_and_differ_by_at_most_one() {
        let shares: Vec<usize> = (0..16).map(|i| share(5000, 16, i)).collect();
        assert_eq!(shares.iter().sum::<usize>(), 5000);
        assert!(shares.iter().all(|s| *s == 312 || *s == 313));
        assert_eq!(share(3, 16, 15), 0);
    }
}
