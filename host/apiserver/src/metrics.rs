//! `/metrics` in the Prometheus text format: requests by verb, resource and code,
//! request latency histograms by verb, open watches, and store request latency.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use trellis_store::{
    Deleted, KeyValue, ListRequest, ListResponse, Result, Revision, Store, WatchStream,
};

/// Upper bounds of the latency buckets, in seconds (kube-apiserver's range, trimmed).
const BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    total: u64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS.len()];
        }
        if let Some(i) = BUCKETS.iter().position(|b| seconds <= *b) {
            self.counts[i] += 1;
        }
        self.sum += seconds;
        self.total += 1;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, bound) in BUCKETS.iter().enumerate() {
            cumulative += self.counts.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.total);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.total);
    }
}

#[derive(Debug, Default)]
struct Inner {
    requests: BTreeMap<(String, String, u16), u64>,
    latency: BTreeMap<String, Histogram>,
}

/// The server's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
    /// Filled by the [`MeteredStore`] the server's requests go through.
    pub store: Arc<StoreLatency>,
}

/// Latency of the store's calls, by operation.
#[derive(Debug, Default)]
pub struct StoreLatency {
    by_operation: Mutex<BTreeMap<&'static str, Histogram>>,
}

impl StoreLatency {
    fn observe(&self, operation: &'static str, since: Instant) {
        let seconds = since.elapsed().as_secs_f64();
        self.by_operation
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(operation)
            .or_default()
            .observe(seconds);
    }

    fn render(&self, out: &mut String) {
        out.push_str(
            "# HELP apiserver_storage_request_duration_seconds Store call latency by operation.\n",
        );
        out.push_str("# TYPE apiserver_storage_request_duration_seconds histogram\n");
        let by_operation = self.by_operation.lock().unwrap_or_else(|e| e.into_inner());
        for (operation, h) in by_operation.iter() {
            h.render(
                out,
                "apiserver_storage_request_duration_seconds",
                &format!("operation=\"{operation}\""),
            );
        }
    }
}

/// A store that times every call into [`StoreLatency`] (a watch: until it is open).
#[derive(Debug)]
pub struct MeteredStore {
    inner: Arc<dyn Store>,
    latency: Arc<StoreLatency>,
}

impl MeteredStore {
    pub fn new(inner: Arc<dyn Store>, latency: Arc<StoreLatency>) -> Self {
        Self { inner, latency }
    }
}

#[async_trait]
impl Store for MeteredStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        let start = Instant::now();
        let result = self.inner.get(key).await;
        self.latency.observe("get", start);
        result
    }

    async fn list(&self, request: ListRequest) -> Result<ListResponse> {
        let start = Instant::now();
        let result = self.inner.list(request).await;
        self.latency.observe("list", start);
        result
    }

    async fn create(&self, key: &str, value: Bytes) -> Result<KeyValue> {
        let start = Instant::now();
        let result = self.inner.create(key, value).await;
        self.latency.observe("create", start);
        result
    }

    async fn update(
        &self,
        key: &str,
        value: Bytes,
        expected: Option<Revision>,
    ) -> Result<KeyValue> {
        let start = Instant::now();
        let result = self.inner.update(key, value, expected).await;
        self.latency.observe("update", start);
        result
    }

    async fn delete(&self, key: &str, expected: Option<Revision>) -> Result<Deleted> {
        let start = Instant::now();
        let result = self.inner.delete(key, expected).await;
        self.latency.observe("delete", start);
        result
    }

    async fn watch(&self, prefix: &str, start_at: Revision) -> Result<WatchStream> {
        let start = Instant::now();
        let result = self.inner.watch(prefix, start_at).await;
        self.latency.observe("watch", start);
        result
    }

    async fn current_revision(&self) -> Result<Revision> {
        let start = Instant::now();
        let result = self.inner.current_revision().await;
        self.latency.observe("current_revision", start);
        result
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        let start = Instant::now();
        let result = self.inner.compact(revision).await;
        self.latency.observe("compact", start);
        result
    }
}

impl Metrics {
    pub fn record(&self, verb: &str, resource: &str, code: u16, elapsed: Duration) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        *inner
            .requests
            .entry((verb.to_owned(), resource.to_owned(), code))
            .or_default() += 1;
        // Watches last as long as the client wants: their duration says nothing.
        if verb != "watch" {
            inner
                .latency
                .entry(verb.to_owned())
                .or_default()
                .observe(elapsed.as_secs_f64());
        }
    }

    /// The text exposition; `watches` is the number of open watches now.
    pub fn render(&self, watches: usize) -> String {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        out.push_str("# HELP apiserver_request_total Requests by verb, resource and HTTP code.\n");
        out.push_str("# TYPE apiserver_request_total counter\n");
        for ((verb, resource, code), n) in &inner.requests {
            let _ = writeln!(
                out,
                "apiserver_request_total{{verb=\"{verb}\",resource=\"{resource}\",code=\"{code}\"}} {n}"
            );
        }
        out.push_str("# HELP apiserver_request_duration_seconds Request latency by verb.\n");
        out.push_str("# TYPE apiserver_request_duration_seconds histogram\n");
        for (verb, h) in &inner.latency {
            h.render(
                &mut out,
                "apiserver_request_duration_seconds",
                &format!("verb=\"{verb}\""),
            );
        }
        out.push_str(
            "# HELP apiserver_watch_cache_watchers Open watches served by the watch cache.\n",
        );
        out.push_str("# TYPE apiserver_watch_cache_watchers gauge\n");
        let _ = writeln!(out, "apiserver_watch_cache_watchers {watches}");
        self.store.render(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_cumulative_buckets() {
        let m = Metrics::default();
        m.record("get", "pods", 200, Duration::from_micros(700));
        m.record("get", "pods", 200, Duration::from_millis(30));
        m.record("create", "configmaps", 409, Duration::from_millis(2));
        m.record("watch", "pods", 200, Duration::from_secs(600));
        let text = m.render(3);
        assert!(
            text.contains("apiserver_request_total{verb=\"get\",resource=\"pods\",code=\"200\"} 2"),
            "{text}"
        );
        assert!(text.contains(
            "apiserver_request_total{verb=\"create\",resource=\"configmaps\",code=\"409\"} 1"
        ));
        assert!(
            text.contains("apiserver_request_duration_seconds_bucket{verb=\"get\",le=\"0.001\"} 1")
        );
        assert!(
            text.contains("apiserver_request_duration_seconds_bucket{verb=\"get\",le=\"0.05\"} 2")
        );
        assert!(text.contains("apiserver_request_duration_seconds_count{verb=\"get\"} 2"));
        assert!(
            !text.contains("verb=\"watch\",le="),
            "watch durations are not latency"
        );
        assert!(text.contains("apiserver_watch_cache_watchers 3"));
    }
}
