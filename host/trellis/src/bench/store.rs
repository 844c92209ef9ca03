//! `trellis bench store`: durable write throughput and per-write latency.
//!
//! `--writers` tasks share `--ops` creates of distinct keys. Both backends acknowledge
//! a write only once it is on disk (redb fsyncs a group commit, etcd its WAL), so this
//! measures durable writes: the figure that bounds how fast the control plane can
//! persist objects. A short warm-up, not counted, opens connections and grows the
//! store file first.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use clap::Args;
use clap::builder::RangedU64ValueParser;
use serde::Serialize;
use tokio::task::JoinSet;
use tokio::time::Instant;
use trellis_store::Store;

use super::{BackendArgs, OpenStore, Percentiles, bounded, share};

/// Most writes of the warm-up: enough to settle connections and file growth, small
/// enough not to dominate short runs.
const MAX_WARMUP: usize = 1000;

#[derive(Debug, Args)]
pub struct StoreArgs {
    #[command(flatten)]
    backend: BackendArgs,

    /// Concurrent writer tasks; they share the writes.
    #[arg(long, default_value_t = 16, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    writers: usize,

    /// Measured writes in total, not counting the warm-up.
    #[arg(long, default_value_t = 10_000, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    ops: usize,

    /// Bytes of each value.
    #[arg(long, default_value_t = 256, value_name = "BYTES")]
    value_size: usize,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    backend: &'static str,
    writers: usize,
    ops: usize,
    value_size: usize,
    writes_per_sec: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    elapsed_s: f64,
    /// Embedded backend: one 4 KiB write plus fdatasync of a file beside the store,
    /// the floor under a durable write's latency on this disk.
    fsync_p50_ms: Option<f64>,
    fsync_p99_ms: Option<f64>,
}

/// Samples of the raw fsync cost.
const FSYNC_SAMPLES: usize = 300;

/// Times a 4 KiB write plus `sync_data` in `dir`, as a durable commit does at least.
fn fsync_cost(dir: &std::path::Path) -> anyhow::Result<Percentiles> {
    use std::io::{Seek, SeekFrom, Write};
    let path = dir.join("fsync-probe");
    let mut file = std::fs::File::create(&path).context("create the fsync probe file")?;
    let block = [0x5au8; 4096];
    let mut samples = Vec::with_capacity(FSYNC_SAMPLES);
    for i in 0..FSYNC_SAMPLES {
        let started = std::time::Instant::now();
        file.seek(SeekFrom::Start((i % 16) as u64 * 4096))?;
        file.write_all(&block)?;
        file.sync_data().context("fsync the probe file")?;
        samples.push(started.elapsed());
    }
    drop(file);
    std::fs::remove_file(&path).context("remove the fsync probe file")?;
    Ok(Percentiles::of(&mut samples))
}

pub async fn run(args: StoreArgs) -> anyhow::Result<()> {
    let open = OpenStore::open(&args.backend).await?;
    let measured = measure(&open, &args).await;
    // Close even after a failed run, but report the run's error first.
    let closed = open.close().await;
    let report = measured?;
    closed?;

    super::print_report(args.json, &report, || {
        format!(
            "store {}: {} writers, {} writes of {} B in {:.3} s: {:.0} writes/s, \
             latency p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms{}",
            report.backend,
            report.writers,
            report.ops,
            report.value_size,
            report.elapsed_s,
            report.writes_per_sec,
            report.p50_ms,
            report.p99_ms,
            report.max_ms,
            report
                .fsync_p99_ms
                .map(|f| format!(" (fsync alone: p99 {f:.3} ms)"))
                .unwrap_or_default(),
        )
    })?;
    Ok(())
}

async fn measure(open: &OpenStore, args: &StoreArgs) -> anyhow::Result<Report> {
    // The content does not matter: neither backend compresses values.
    let value = Bytes::from(vec![b'x'; args.value_size]);
    let warmup = (args.ops / 10).min(MAX_WARMUP);
    let warmup_prefix = format!("{}warmup/", open.key_base);
    write_all(&open.store, &warmup_prefix, args.writers, warmup, &value)
        .await
        .context("warm up")?;
    tracing::debug!(writes = warmup, "warm-up done");

    let prefix = format!("{}run/", open.key_base);
    let started = Instant::now();
    let mut latencies = write_all(&open.store, &prefix, args.writers, args.ops, &value)
        .await
        .context("write")?;
    let elapsed = started.elapsed();

    let percentiles = Percentiles::of(&mut latencies);
    let elapsed_s = elapsed.as_secs_f64();
    let fsync = match open
        .redb
        .as_ref()
        .and_then(|r| r.path().parent().map(ToOwned::to_owned))
    {
        Some(dir) => Some(tokio::task::spawn_blocking(move || fsync_cost(&dir)).await??),
        None => None,
    };
    let writes_per_sec = args.ops as f64 / elapsed_s;
    Ok(Report {
        backend: open.backend.name(),
        writers: args.writers,
        ops: args.ops,
        value_size: args.value_size,
        writes_per_sec: writes_per_sec.round(),
        p50_ms: percentiles.p50_ms,
        p99_ms: percentiles.p99_ms,
        max_ms: percentiles.max_ms,
        elapsed_s: (elapsed_s * 1e3).round() / 1e3,
        fsync_p50_ms: fsync.map(|f| f.p50_ms),
        fsync_p99_ms: fsync.map(|f| f.p99_ms),
    })
}

/// Creates `total` keys under `prefix` from `writers` concurrent tasks and returns the
/// latency of each create, from the call to its acknowledgement.
pub(super) async fn write_all(
    store: &Arc<dyn Store>,
    prefix: &str,
    writers: usize,
    total: usize,
    value: &Bytes,
) -> anyhow::Result<Vec<Duration>> {
    let mut tasks = JoinSet::new();
    for writer in 0..writers {
        let n = share(total, writers, writer);
        if n == 0 {
            continue;
        }
        let (store, value) = (store.clone(), value.clone());
        let prefix = format!("{prefix}w{writer}/");
        tasks.spawn(async move {
            let mut latencies = Vec::with_capacity(n);
            for seq in 0..n {
                let key = format!("{prefix}{seq}");
                let sent = Instant::now();
                bounded(store.create(&key, value.clone()))
                    .await
                    .with_context(|| format!("create {key}"))?;
                latencies.push(sent.elapsed());
            }
            anyhow::Ok(latencies)
        });
    }
    let mut latencies = Vec::with_capacity(total);
    // Returning early drops `tasks`, which aborts the other writers.
    while let Some(joined) = tasks.join_next().await {
        latencies.extend(joined.context("join a writer task")??);
    }
    Ok(latencies)
}
