//! `trellis bench watch`: how long a write takes to reach every watcher.
//!
//! `--watchers` streams watch one prefix from the revision after the current one, so
//! none can miss a write. One writer then creates `--events` keys under it, one at a
//! time at `--rate`, and records when each is acknowledged. An event's latency is the
//! time from its acknowledgement to its arrival at the *last* watcher: that is when
//! every informer of the control plane has seen it. The embedded backend publishes
//! before it acknowledges, so arrivals before the acknowledgement count as zero.
//!
//! The run fails, naming the watcher, if any watcher misses an event, sees one twice
//! or out of order, or its stream ends early or with an error (e.g. it lagged).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use trellis_api::Shutdown;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use clap::Args;
use clap::builder::RangedU64ValueParser;
use futures::StreamExt as _;
use serde::Serialize;
use tokio::sync::Barrier;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};
use trellis_store::{Revision, Store, WatchStream};

use super::{BackendArgs, OpenStore, Percentiles, bounded};

/// How long watchers may take to receive everything once the last write is
/// acknowledged. Healthy delivery takes milliseconds; this only keeps a watcher that
/// will never catch up from hanging the run.
const DELIVERY_GRACE: Duration = Duration::from_secs(30);

/// How many failing watchers the error message names; the rest are counted.
const NAMED_FAILURES: usize = 5;

#[derive(Debug, Args)]
pub struct WatchArgs {
    #[command(flatten)]
    backend: BackendArgs,

    /// Concurrent watchers of the same prefix.
    #[arg(long, default_value_t = 100, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    watchers: usize,

    /// Writes, hence events per watcher.
    #[arg(long, default_value_t = 1000, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    events: usize,

    /// Writes per second. Paced rather than flat out, so the figure is delivery
    /// latency, not queueing behind a backlog.
    #[arg(long, default_value_t = 200, value_name = "EVENTS_PER_SEC", value_parser = RangedU64ValueParser::<u32>::new().range(1..))]
    rate: u32,

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
    watchers: usize,
    events: usize,
    rate: u32,
    /// Acknowledgement → arrival at the last watcher, clamped at zero.
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    /// Start of the write call → arrival at the last watcher: commit plus delivery.
    write_p50_ms: f64,
    write_p99_ms: f64,
    write_max_ms: f64,
}

/// One write of the benchmark: its revision, when it was sent and when acknowledged.
#[derive(Clone, Copy, Debug)]
struct Write {
    revision: Revision,
    sent: Instant,
    acked: Instant,
}

/// How a watcher's run ended.
#[derive(Debug)]
enum End {
    /// It received as many events as were written.
    Complete,
    /// Its stream ended without an error before it had everything.
    StreamEnded,
    Failed(trellis_store::Error),
    /// It was still waiting [`DELIVERY_GRACE`] after the last write.
    TimedOut,
}

/// What one watcher saw: each event's revision and when it arrived, in arrival order.
#[derive(Debug)]
struct Received {
    events: Vec<(Revision, Instant)>,
    end: End,
}

pub async fn run(args: WatchArgs) -> anyhow::Result<()> {
    let open = OpenStore::open(&args.backend).await?;
    let measured = measure(&open, &args).await;
    // Close even after a failed run, but report the run's error first.
    let closed = open.close().await;
    let report = measured?;
    closed?;

    super::print_report(args.json, &report, || {
        format!(
            "watch {}: {} watchers, {} events at {}/s: delivery to every watcher \
             p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
            report.backend,
            report.watchers,
            report.events,
            report.rate,
            report.p50_ms,
            report.p99_ms,
            report.max_ms,
        )
    })?;
    Ok(())
}

async fn measure(open: &OpenStore, args: &WatchArgs) -> anyhow::Result<Report> {
    let store = &open.store;
    let prefix = format!("{}watch/", open.key_base);
    // Watching from the next revision rather than from "now" (0) leaves no window in
    // which a write could slip past a watcher that is still starting.
    let from = bounded(store.current_revision())
        .await
        .context("read the current revision")?
        + 1;

    let (stop, stopped) = Shutdown::new();
    // Every watcher is polling before the first write, so none starts out behind.
    let ready = Arc::new(Barrier::new(args.watchers + 1));
    // Dropping the set (on any early return) aborts the watchers.
    let mut watchers = JoinSet::new();
    for id in 0..args.watchers {
        let stream = bounded(store.watch(&prefix, from))
            .await
            .with_context(|| format!("start watcher {id}"))?;
        watchers.spawn(receive(
            id,
            stream,
            args.events,
            ready.clone(),
            stopped.clone(),
        ));
    }
    ready.wait().await;

    let value = Bytes::from(vec![b'x'; args.value_size]);
    let started = Instant::now();
    let acks = write(store.as_ref(), &prefix, args.events, args.rate, &value)
        .await
        .context("write")?;
    let achieved = args.events as f64 / started.elapsed().as_secs_f64();
    if achieved < 0.9 * f64::from(args.rate) {
        tracing::warn!(
            requested = args.rate,
            achieved = achieved.round(),
            "writes could not keep up with --rate"
        );
    }

    let mut received: Vec<Option<Received>> = (0..args.watchers).map(|_| None).collect();
    let deadline = Instant::now() + DELIVERY_GRACE;
    match tokio::time::timeout_at(deadline, collect(&mut watchers, &mut received)).await {
        Ok(collected) => collected?,
        Err(_) => {
            // Stragglers return what they have, and are reported as timed out.
            stop.stop();
            collect(&mut watchers, &mut received).await?;
        }
    }
    let received: Vec<Received> = received
        .into_iter()
        .enumerate()
        .map(|(id, r)| r.with_context(|| format!("collect watcher {id}: it returned nothing")))
        .collect::<anyhow::Result<_>>()?;

    let (mut latencies, mut from_send) = delivery_latencies(&acks, &received)?;
    let percentiles = Percentiles::of(&mut latencies);
    let write = Percentiles::of(&mut from_send);
    Ok(Report {
        backend: open.backend.name(),
        watchers: args.watchers,
        events: args.events,
        rate: args.rate,
        p50_ms: percentiles.p50_ms,
        p99_ms: percentiles.p99_ms,
        max_ms: percentiles.max_ms,
        write_p50_ms: write.p50_ms,
        write_p99_ms: write.p99_ms,
        write_max_ms: write.max_ms,
    })
}

/// One watcher: records when each event arrives until it has `events` of them, its
/// stream ends, or `stop` turns true.
async fn receive(
    id: usize,
    mut stream: WatchStream,
    events: usize,
    ready: Arc<Barrier>,
    stop: Shutdown,
) -> (usize, Received) {
    ready.wait().await;
    // Touch the memory now: page faults on first use would land inside the measured
    // deliveries of a thousand watchers at once.
    let mut arrivals = vec![(0, Instant::now()); events];
    arrivals.clear();
    let end = loop {
        if arrivals.len() >= events {
            break End::Complete;
        }
        tokio::select! {
            // Events first: a batch that is ready when the stop comes still counts.
            biased;
            item = stream.next() => match item {
                Some(Ok(batch)) => {
                    let at = Instant::now();
                    arrivals.extend(batch.iter().map(|event| (event.revision(), at)));
                }
                Some(Err(e)) => break End::Failed(e),
                None => break End::StreamEnded,
            },
            () = stop.wait() => break End::TimedOut,
        }
    };
    (
        id,
        Received {
            events: arrivals,
            end,
        },
    )
}

/// Joins every watcher still running into `received`, by watcher id. Cancel-safe: a
/// watcher joined before a cancellation keeps its slot.
async fn collect(
    watchers: &mut JoinSet<(usize, Received)>,
    received: &mut [Option<Received>],
) -> anyhow::Result<()> {
    while let Some(joined) = watchers.join_next().await {
        let (id, r) = joined.context("join a watcher task")?;
        received[id] = Some(r);
    }
    Ok(())
}

/// Creates `events` keys under `prefix`, one at a time at `rate` per second, and
/// returns each write's revision and when it was sent and acknowledged.
async fn write(
    store: &dyn Store,
    prefix: &str,
    events: usize,
    rate: u32,
    value: &Bytes,
) -> anyhow::Result<Vec<Write>> {
    // A zero period would panic; rates that high just mean "flat out".
    let period = Duration::from_secs_f64(1.0 / f64::from(rate)).max(Duration::from_nanos(1));
    let mut ticks = tokio::time::interval(period);
    // After a slow write, keep the spacing instead of bursting to catch up.
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut acks = Vec::with_capacity(events);
    for seq in 0..events {
        ticks.tick().await;
        let key = format!("{prefix}{seq}");
        let sent = Instant::now();
        let result = bounded(store.create(&key, value.clone())).await;
        let acked = Instant::now();
        let kv = result.with_context(|| format!("create {key}"))?;
        acks.push(Write {
            revision: kv.mod_revision,
            sent,
            acked,
        });
    }
    Ok(acks)
}

/// For each write, the time from its acknowledgement (and from its start) to its
/// arrival at the last watcher. Fails, naming the watchers, unless every watcher
/// received every write exactly once and in revision order.
fn delivery_latencies(
    acks: &[Write],
    received: &[Received],
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    // By revision, not by `revision - first`: on a shared etcd, other clients' writes
    // interleave with ours, so our revisions need not be consecutive.
    let index: HashMap<Revision, usize> = acks
        .iter()
        .enumerate()
        .map(|(i, w)| (w.revision, i))
        .collect();
    let mut last_arrival: Vec<Option<Instant>> = vec![None; acks.len()];
    let mut failures = Vec::new();
    for (id, watcher) in received.iter().enumerate() {
        let mut seen = vec![false; acks.len()];
        let (mut duplicates, mut unexpected, mut out_of_order) = (0, 0, false);
        let mut previous = None;
        for &(revision, at) in &watcher.events {
            out_of_order |= previous.is_some_and(|p| revision <= p);
            previous = Some(revision);
            let Some(&i) = index.get(&revision) else {
                unexpected += 1;
                continue;
            };
            if std::mem::replace(&mut seen[i], true) {
                duplicates += 1;
                continue;
            }
            last_arrival[i] = Some(last_arrival[i].map_or(at, |t| t.max(at)));
        }

        let mut problems = Vec::new();
        let missing = seen.iter().filter(|s| !**s).count();
        if let Some(first) = seen.iter().position(|s| !*s) {
            problems.push(format!(
                "missed {missing} of {} events (first missing revision {})",
                acks.len(),
                acks[first].revision
            ));
        }
        if duplicates > 0 {
            problems.push(format!("received {duplicates} events twice"));
        }
        if unexpected > 0 {
            problems.push(format!(
                "received {unexpected} events that were never written"
            ));
        }
        if out_of_order {
            problems.push("received events out of revision order".to_owned());
        }
        match &watcher.end {
            End::Complete => {}
            End::StreamEnded => problems.push("its stream ended early".to_owned()),
            End::Failed(e) => problems.push(format!("ended with an error: {}", error_chain(e))),
            End::TimedOut => problems.push(format!(
                "was still waiting {DELIVERY_GRACE:?} after the last write"
            )),
        }
        if !problems.is_empty() {
            failures.push(format!("watcher {id} {}", problems.join(", ")));
        }
    }

    if !failures.is_empty() {
        let total = failures.len();
        let mut message = failures
            .into_iter()
            .take(NAMED_FAILURES)
            .collect::<Vec<_>>()
            .join("; ");
        if total > NAMED_FAILURES {
            message.push_str(&format!("; and {} more", total - NAMED_FAILURES));
        }
        bail!(
            "check delivery: {total} of {} watchers did not receive every event once, in order: {message}",
            received.len()
        );
    }

    let mut early = 0;
    let (mut from_ack, mut from_send) = (Vec::new(), Vec::new());
    for (w, arrived) in acks.iter().zip(&last_arrival) {
        // Every watcher received every event, so every slot is filled.
        let arrived = arrived.unwrap_or(w.acked);
        early += usize::from(arrived < w.acked);
        from_ack.push(arrived.saturating_duration_since(w.acked));
        from_send.push(arrived.saturating_duration_since(w.sent));
    }
    tracing::debug!(
        early,
        "events that reached every watcher before their acknowledgement"
    );
    Ok((from_ack, from_send))
}

/// An error and its sources, `: `-separated, as anyhow's `{:#}` prints them.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    message
}

#[cfg(test)]
// A panic is how a test reports failure.
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Writes sent 1 ms before their acknowledgement at `revision` ms.
    fn acks(base: Instant, revisions: &[Revision]) -> Vec<Write> {
        revisions
            .iter()
            .map(|r| Write {
                revision: *r,
                sent: base + Duration::from_millis(*r - 1),
                acked: base + Duration::from_millis(*r),
            })
            .collect()
    }

    fn arrivals(writes: &[Write]) -> Vec<(Revision, Instant)> {
        writes.iter().map(|w| (w.revision, w.acked)).collect()
    }

    fn complete(events: Vec<(Revision, Instant)>) -> Received {
        Received {
            events,
            end: End::Complete,
        }
    }

    #[test]
    fn latency_is_the_last_arrival_after_the_ack_clamped_at_zero() {
        let base = Instant::now();
        let acks = acks(base, &[10, 12]);
        let at = |ms| base + Duration::from_millis(ms);
        let received = [
            complete(vec![(10, at(11)), (12, at(11))]),
            complete(vec![(10, at(13)), (12, at(11))]),
        ];
        let (latencies, from_send) = delivery_latencies(&acks, &received).unwrap();
        // Revision 10: last watcher at 13 ms, acked at 10 ms. Revision 12 arrived
        // everywhere before its ack.
        assert_eq!(latencies, [Duration::from_millis(3), Duration::ZERO]);
        // From the start of each write (1 ms before its ack): 13 - 9 and 11 - 11.
        assert_eq!(from_send, [Duration::from_millis(4), Duration::ZERO]);
    }

    #[test]
    fn names_the_watchers_that_missed_events_or_failed() {
        let base = Instant::now();
        let acks = acks(base, &[2, 3, 4]);
        let received = [
            complete(arrivals(&acks)),
            Received {
                events: arrivals(&acks[..1]),
                end: End::Failed(trellis_store::Error::WatcherLagged { resume_from: 3 }),
            },
            complete(arrivals(&[acks[0], acks[2], acks[1]])),
        ];
        let message = format!("{:#}", delivery_latencies(&acks, &received).unwrap_err());
        assert!(message.contains("2 of 3 watchers"), "{message}");
        assert!(
            message.contains("watcher 1 missed 2 of 3 events (first missing revision 3)"),
            "{message}"
        );
        assert!(message.contains("fell behind"), "{message}");
        assert!(
            message.contains("watcher 2 received events out of revision order"),
            "{message}"
        );
        assert!(!message.contains("watcher 0"), "{message}");
    }
}
