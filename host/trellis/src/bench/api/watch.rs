//! `trellis bench api --verb watch`: how long a create takes to reach every watcher
//! through the API server.
//!
//! `--clients` watchers each open their own TLS connection (or, with `--http2
//! --connections N`, share N connections as HTTP/2 streams, as one client-go process
//! runs its informers) and watch the collection from its current resourceVersion, as
//! informers do after their list. One more connection then creates `--ops` objects,
//! one at a time at `--rate`, and records when each create is acknowledged. Two
//! latencies are reported, both from that acknowledgement: an event's arrival at the
//! *last* watcher (`p50_ms`…, one sample per event), and every delivery, its arrival
//! at each watcher (`delivery_p50_ms`…, one sample per watcher and event). Arrivals
//! before the acknowledgement (the server may publish before it answers) count as zero.
//!
//! A watcher's task polls its own connection as well as the response body, so over
//! HTTP/1.1 the arrival time is taken in the poll that reads the bytes from the socket
//! (hyper's HTTP/2 client reads in a task of its own), and a line is matched to its
//! event by searching for the object's name, not by decoding it.
//!
//! Each watcher checks that it sees this run's objects once each, in creation order;
//! a missing, repeated or reordered event, a non-200 answer or a stream that ends
//! early fails the run and names the watcher.

use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http2;
use hyper::{Method, StatusCode};
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};

use super::{ApiArgs, Delivery, NAMESPACE, ObjectBody, Report};
use crate::bench::{CALL_TIMEOUT, Percentiles, run_id};
use crate::rest::{
    Connection, Driver, Target, build_request, call, connect, exchange, handshake, status_message,
};

/// How long watchers may take to receive everything once the last create is
/// acknowledged. Healthy delivery takes milliseconds; this only keeps a watcher that
/// never catches up from hanging the run.
const DELIVERY_GRACE: Duration = Duration::from_secs(30);

pub(super) async fn measure(target: &Target, args: &ApiArgs) -> anyhow::Result<Report> {
    let events = args.ops;
    let collection = format!("/api/v1/namespaces/{NAMESPACE}/{}", args.kind.plural());
    let prefix = format!("bench-{}-", run_id());
    let revision = current_revision(target, &collection).await?;
    let path = format!("{collection}?watch=1&resourceVersion={revision}");

    // With `--connections`, the watchers' streams share that many HTTP/2 connections,
    // each driven by a task of its own (as in client-go); else each watcher has its own
    // connection and polls it itself.
    let shared = match args.connections {
        Some(n) if n < args.clients => Some(open_shared(target, n).await?),
        _ => None,
    };

    let start = Instant::now();
    let (ready_tx, mut ready_rx) = mpsc::channel::<()>(args.clients);
    let mut watchers = JoinSet::new();
    for watcher in 0..args.clients {
        let watch = Watch {
            watcher,
            path: path.clone(),
            prefix: Bytes::from(prefix.clone().into_bytes()),
            events,
            start,
        };
        let (addr, name, tls, http2) = (
            target.addr.clone(),
            target.server_name.clone(),
            target.tls.clone(),
            target.http2,
        );
        let (base, authorization) = (target.base.clone(), target.authorization.clone());
        let ready = ready_tx.clone();
        let stream_of = shared
            .as_ref()
            .map(|senders| senders[watcher % senders.len()].clone());
        watchers.spawn(async move {
            let (mut connection, mut driver) = match stream_of {
                Some(sender) => (Connection::Http2(sender), None),
                None => {
                    let (connection, driver) =
                        tokio::time::timeout(CALL_TIMEOUT, handshake(&addr, name, tls, http2))
                            .await
                            .unwrap_or_else(|_| bail!("no connection within {CALL_TIMEOUT:?}"))
                            .with_context(|| format!("connect watcher {watcher} to {addr}"))?;
                    (connection, Some(driver))
                }
            };
            let request = build_request(
                &base,
                http2,
                authorization.as_ref(),
                &Method::GET,
                &watch.path,
                Bytes::new(),
            )?;
            let sent = driven(&mut driver, connection.send(request));
            let response = match tokio::time::timeout(CALL_TIMEOUT, sent).await {
                Ok(sent) => sent
                    .and_then(|sent| Ok(sent?))
                    .with_context(|| format!("start watcher {watcher}"))?,
                Err(_) => bail!("watcher {watcher}: no answer within {CALL_TIMEOUT:?}"),
            };
            if response.status() != StatusCode::OK {
                let status = response.status();
                let body = driven(&mut driver, response.into_body().collect())
                    .await??
                    .to_bytes();
                bail!(
                    "watcher {watcher}: the server answered {status}: {}",
                    status_message(&body)
                );
            }
            // The server subscribes before it answers, so from here on no event is lost.
            let _ = ready.send(()).await;
            watch.follow(response.into_body(), driver).await
        });
    }
    drop(ready_tx);
    for opened in 0..args.clients {
        tokio::select! {
            ready = ready_rx.recv() => {
                if ready.is_none() {
                    bail!("only {opened} of {} watchers started", args.clients);
                }
            }
            Some(joined) = watchers.join_next() => {
                joined.context("join a watcher")??;
                bail!("a watcher ended before the first create");
            }
        }
    }
    tracing::debug!(watchers = args.clients, "all watchers started");

    let writing = Instant::now();
    let acks = create_paced(target, &collection, &prefix, args, start).await?;
    let writes = writing.elapsed();

    let mut arrivals = Vec::with_capacity(args.clients);
    let delivered = tokio::time::timeout(DELIVERY_GRACE, async {
        while let Some(joined) = watchers.join_next().await {
            arrivals.push(joined.context("join a watcher")??);
        }
        anyhow::Ok(())
    })
    .await;
    match delivered {
        Ok(result) => result?,
        Err(_) => bail!(
            "{} of {} watchers had not seen all {events} events {DELIVERY_GRACE:?} after the last create",
            watchers.len(),
            args.clients
        ),
    }

    let (mut last, mut deliveries) = latencies(&acks, &arrivals);
    let percentiles = Percentiles::of(&mut last);
    let delivery = Percentiles::of(&mut deliveries);
    Ok(Report {
        kind: args.kind.plural(),
        verb: "watch",
        clients: args.clients,
        connections: shared.as_ref().map(Vec::len),
        ops: events,
        ops_per_sec: (events as f64 / writes.as_secs_f64()).round(),
        p50_ms: percentiles.p50_ms,
        p99_ms: percentiles.p99_ms,
        max_ms: percentiles.max_ms,
        delivery: Some(Delivery {
            deliveries: deliveries.len(),
            delivery_p50_ms: delivery.p50_ms,
            delivery_p99_ms: delivery.p99_ms,
            delivery_max_ms: delivery.max_ms,
        }),
        errors: 0,
        server_memory: None,
    })
}

/// From each event's acknowledgement (`acks`, after the run's start) and its arrival
/// at each watcher (`arrivals[watcher][event]`, after the same start): each event's
/// latency to its last watcher, and every delivery's latency.
fn latencies(acks: &[Duration], arrivals: &[Vec<Duration>]) -> (Vec<Duration>, Vec<Duration>) {
    let mut last = vec![Duration::ZERO; acks.len()];
    let mut deliveries = Vec::with_capacity(acks.len() * arrivals.len());
    for watcher in arrivals {
        for ((ack, at), last) in acks.iter().zip(watcher).zip(&mut last) {
            let latency = at.saturating_sub(*ack);
            *last = (*last).max(latency);
            deliveries.push(latency);
        }
    }
    (last, deliveries)
}

/// Opens `n` HTTP/2 connections, each driven by a task of its own (a failed one fails
/// its streams); their senders open streams on them from any task.
async fn open_shared(
    target: &Target,
    n: usize,
) -> anyhow::Result<Vec<http2::SendRequest<Full<Bytes>>>> {
    let mut senders = Vec::with_capacity(n);
    for shared in 0..n {
        let opened = tokio::time::timeout(
            CALL_TIMEOUT,
            connect(
                &target.addr,
                target.server_name.clone(),
                target.tls.clone(),
                true,
            ),
        )
        .await
        .unwrap_or_else(|_| bail!("no connection within {CALL_TIMEOUT:?}"))
        .with_context(|| format!("open shared connection {shared} to {}", target.addr))?;
        let Connection::Http2(sender) = opened else {
            bail!("shared connection {shared} is not HTTP/2");
        };
        senders.push(sender);
    }
    Ok(senders)
}

/// Runs `work` while polling the connection's `driver` (when the caller drives its
/// own), which is polled first so that what it reads is ready for `work` in the same
/// poll. A connection that ends first is an error.
async fn driven<T>(
    driver: &mut Option<Driver>,
    work: impl Future<Output = T>,
) -> anyhow::Result<T> {
    let Some(driver) = driver else {
        return Ok(work.await);
    };
    tokio::select! {
        biased;
        ended = driver => match ended {
            Ok(()) => bail!("the server closed the connection"),
            Err(e) => Err(e).context("the connection failed"),
        },
        done = work => Ok(done),
    }
}

/// The collection's resourceVersion: watches start after it, so they see every create
/// of the run and nothing from a list.
async fn current_revision(target: &Target, collection: &str) -> anyhow::Result<String> {
    #[derive(Deserialize)]
    struct List {
        metadata: ListMeta,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct ListMeta {
        resource_version: String,
    }
    let path = format!("{collection}?limit=1");
    let (status, body) = exchange(target, Method::GET, &path, Vec::new()).await?;
    if status != StatusCode::OK {
        bail!(
            "GET {path}: the server answered {status}: {}",
            status_message(&body)
        );
    }
    let list: List = serde_json::from_slice(&body).with_context(|| format!("decode GET {path}"))?;
    Ok(list.metadata.resource_version)
}

/// Creates `{prefix}{i}` for each event at `--rate` per second on one connection;
/// returns when each create was acknowledged, after `start` (the instant watchers'
/// arrivals are measured from).
async fn create_paced(
    target: &Target,
    collection: &str,
    prefix: &str,
    args: &ApiArgs,
    start: Instant,
) -> anyhow::Result<Vec<Duration>> {
    let mut connection = connect(
        &target.addr,
        target.server_name.clone(),
        target.tls.clone(),
        target.http2,
    )
    .await
    .context("connect the writer")?;
    let body = ObjectBody::new(args.kind, args.value_size);
    let first = Instant::now();
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(args.rate)));
    // Paced, never bursting to catch up: the figure is delivery, not a backlog.
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut acks = Vec::with_capacity(args.ops);
    for event in 0..args.ops {
        ticks.tick().await;
        let name = format!("{prefix}{event}");
        let request = build_request(
            &target.base,
            target.http2,
            target.authorization.as_ref(),
            &Method::POST,
            collection,
            body.with_name(&name),
        )?;
        call(&mut connection, request, StatusCode::CREATED)
            .await
            .with_context(|| format!("create {name}"))?;
        acks.push(start.elapsed());
    }
    tracing::debug!(elapsed = ?first.elapsed(), "all creates acknowledged");
    Ok(acks)
}

/// One watcher's stream and what it expects to see on it.
struct Watch {
    watcher: usize,
    path: String,
    /// This run's name prefix; lines without it are other objects' events.
    prefix: Bytes,
    events: usize,
    start: Instant,
}

impl Watch {
    /// Reads event lines until this run's last object has been seen; returns when
    /// each event arrived, after the run's start.
    async fn follow(
        self,
        mut body: hyper::body::Incoming,
        mut driver: Option<Driver>,
    ) -> anyhow::Result<Vec<Duration>> {
        let watcher = self.watcher;
        let mut arrivals = Vec::with_capacity(self.events);
        let mut pending: Vec<u8> = Vec::new();
        let mut next = 0;
        while next < self.events {
            let frame = driven(&mut driver, body.frame())
                .await
                .with_context(|| format!("watcher {watcher}: read the stream"))?;
            let Some(frame) = frame else {
                bail!(
                    "watcher {watcher}: the stream ended after {next} of {} events",
                    self.events
                );
            };
            let frame = frame.with_context(|| format!("watcher {watcher}: read the stream"))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let at = self.start.elapsed();
            pending.extend_from_slice(&data);
            let mut consumed = 0;
            while let Some(end) = memchr::memchr(b'\n', &pending[consumed..]) {
                let line = &pending[consumed..consumed + end];
                consumed += end + 1;
                let Some(event) = self.event_of(line)? else {
                    continue;
                };
                if event != next {
                    bail!("watcher {watcher}: saw event {event} when {next} was due");
                }
                arrivals.push(at);
                next += 1;
            }
            pending.drain(..consumed);
        }
        Ok(arrivals)
    }

    /// The number in this run's object name on `line`, if the line is about one.
    fn event_of(&self, line: &[u8]) -> anyhow::Result<Option<usize>> {
        let Some(at) = memchr::memmem::find(line, &self.prefix) else {
            return Ok(None);
        };
        let digits: &[u8] = &line[at + self.prefix.len()..];
        let len = digits.iter().take_while(|b| b.is_ascii_digit()).count();
        let event = std::str::from_utf8(&digits[..len])
            .ok()
            .and_then(|d| d.parse().ok())
            .with_context(|| {
                format!(
                    "watcher {}: no event number after the prefix in {}",
                    self.watcher,
                    String::from_utf8_lossy(line)
                )
            })?;
        const ADDED: &[u8] = br#""type":"ADDED""#;
        if memchr::memmem::find(line, ADDED).is_none() {
            bail!(
                "watcher {}: event {event} is not ADDED: {}",
                self.watcher,
                String::from_utf8_lossy(line)
            );
        }
        Ok(Some(event))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(events: usize) -> Watch {
        Watch {
            watcher: 7,
            path: String::new(),
            prefix: Bytes::from_static(b"bench-1-"),
            events,
            start: Instant::now(),
        }
    }

    #[test]
    fn lines_name_their_event_and_others_are_skipped() {
        let w = watch(20);
        let line = br#"{"type":"ADDED","object":{"metadata":{"name":"bench-1-12","namespace":"default"}}}"#;
        assert_eq!(w.event_of(line).unwrap(), Some(12));
        let other = br#"{"type":"ADDED","object":{"metadata":{"name":"web-0"}}}"#;
        assert_eq!(w.event_of(other).unwrap(), None);
        let modified = br#"{"type":"MODIFIED","object":{"metadata":{"name":"bench-1-3"}}}"#;
        let err = w.event_of(modified).unwrap_err().to_string();
        assert!(
            err.contains("watcher 7") && err.contains("not ADDED"),
            "{err}"
        );
    }

    #[test]
    fn each_event_counts_its_last_watcher_and_every_delivery() {
        let ms = Duration::from_millis;
        let acks = [ms(10), ms(20)];
        // Watcher 1 saw event 0 before its acknowledgement: that delivery counts as 0.
        let arrivals = vec![vec![ms(12), ms(29)], vec![ms(9), ms(23)]];
        let (last, deliveries) = latencies(&acks, &arrivals);
        assert_eq!(last, [ms(2), ms(9)]);
        assert_eq!(deliveries, [ms(2), ms(9), ms(0), ms(3)]);
    }
}
