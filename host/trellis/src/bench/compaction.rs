//! `trellis bench compaction`: how long compaction holds up writes.
//!
//! Fills the store with `--keys` keys (one history entry each), then runs a probe
//! writer that updates one key back to back, durably, and records every write's
//! latency: first for `--baseline` seconds, then from `compact(current revision)` until
//! the purge of the old history has finished (embedded backend) or for `--after`
//! seconds (etcd compacts in the background and does not say when it is done). The
//! longest probe write during compaction is the longest write stall it caused.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use clap::Args;
use serde::Serialize;
use tokio::time::Instant;

use super::{BackendArgs, OpenStore, Percentiles, bounded};

#[derive(Debug, Args)]
pub struct CompactionArgs {
    #[command(flatten)]
    backend: BackendArgs,

    /// Keys written before compacting; each leaves one entry of history.
    #[arg(long, default_value_t = 100_000)]
    keys: usize,

    /// Concurrent writers of the fill.
    #[arg(long, default_value_t = 64)]
    writers: usize,

    /// Bytes of each value.
    #[arg(long, default_value_t = 256, value_name = "BYTES")]
    value_size: usize,

    /// Seconds of probe writes before compacting.
    #[arg(long, default_value_t = 1.0)]
    baseline: f64,

    /// Least seconds of probe writes after compacting.
    #[arg(long, default_value_t = 2.0)]
    after: f64,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    backend: &'static str,
    keys: usize,
    /// Probe writes before compaction.
    baseline_p99_ms: f64,
    baseline_max_ms: f64,
    /// Probe writes from the compact call until the purge finished.
    during_writes: usize,
    during_p99_ms: f64,
    /// The longest write stall compaction caused.
    during_max_ms: f64,
    compact_call_ms: f64,
    /// Embedded backend: time from the compact call until the history was purged.
    purge_s: Option<f64>,
}

pub async fn run(args: CompactionArgs) -> anyhow::Result<()> {
    let open = OpenStore::open(&args.backend).await?;
    let measured = measure(&open, &args).await;
    let closed = open.close().await;
    let report = measured?;
    closed?;
    super::print_report(args.json, &report, || {
        format!(
            "compaction {} of {} keys: probe writes p99 {:.3} ms / max {:.3} ms before, \
             p99 {:.3} ms / max {:.3} ms during ({} writes); compact call {:.3} ms{}",
            report.backend,
            report.keys,
            report.baseline_p99_ms,
            report.baseline_max_ms,
            report.during_p99_ms,
            report.during_max_ms,
            report.during_writes,
            report.compact_call_ms,
            report
                .purge_s
                .map(|s| format!(", purge {s:.3} s"))
                .unwrap_or_default(),
        )
    })?;
    Ok(())
}

async fn measure(open: &OpenStore, args: &CompactionArgs) -> anyhow::Result<Report> {
    let value = Bytes::from(vec![b'x'; args.value_size]);
    let fill = format!("{}fill/", open.key_base);
    super::store::write_all(&open.store, &fill, args.writers.max(1), args.keys, &value)
        .await
        .context("fill the store")?;

    let probe_key = format!("{}probe", open.key_base);
    bounded(open.store.create(&probe_key, value.clone()))
        .await
        .context("create the probe key")?;
    let probe = |until: Instant| {
        let (store, key, value) = (open.store.clone(), probe_key.clone(), value.clone());
        async move {
            let mut latencies = Vec::new();
            while Instant::now() < until {
                let sent = Instant::now();
                bounded(store.update(&key, value.clone(), None))
                    .await
                    .context("probe write")?;
                latencies.push(sent.elapsed());
            }
            anyhow::Ok(latencies)
        }
    };
    let mut baseline = probe(Instant::now() + Duration::from_secs_f64(args.baseline))
        .await
        .context("baseline")?;

    // The probe runs beside the compaction, as any writer would.
    let started = Instant::now();
    let min_end = started + Duration::from_secs_f64(args.after);
    let (store, key, value2) = (open.store.clone(), probe_key.clone(), value.clone());
    let redb = open.redb.clone();
    // Set once compact() returned: the purge (if any) has started by then.
    let compacted = Arc::new(AtomicBool::new(false));
    let compacted2 = compacted.clone();
    let during = tokio::spawn(async move {
        let mut latencies = Vec::new();
        let mut purged_at = None;
        loop {
            let now = Instant::now();
            let purging = redb.as_ref().is_some_and(|r| r.is_purging());
            let called = compacted2.load(Ordering::Acquire);
            if purged_at.is_none() && called && !purging {
                purged_at = Some(now);
            }
            if now >= min_end && called && !purging {
                break;
            }
            let sent = Instant::now();
            bounded(store.update(&key, value2.clone(), None))
                .await
                .context("probe write")?;
            latencies.push(sent.elapsed());
        }
        anyhow::Ok((latencies, purged_at))
    });
    let current = bounded(open.store.current_revision()).await?;
    let call = Instant::now();
    bounded(open.store.compact(current))
        .await
        .context("compact")?;
    let compact_call = call.elapsed();
    compacted.store(true, Ordering::Release);
    let (mut during, purged_at) = during.await.context("join the probe writer")??;

    let before = Percentiles::of(&mut baseline);
    let stall = Percentiles::of(&mut during);
    Ok(Report {
        backend: open.backend.name(),
        keys: args.keys,
        baseline_p99_ms: before.p99_ms,
        baseline_max_ms: before.max_ms,
        during_writes: during.len(),
        during_p99_ms: stall.p99_ms,
        during_max_ms: stall.max_ms,
        compact_call_ms: super::ms(compact_call),
        purge_s: open
            .redb
            .as_ref()
            .and(purged_at)
            .map(|at| (at.duration_since(call).as_secs_f64() * 1e3).round() / 1e3),
    })
}
