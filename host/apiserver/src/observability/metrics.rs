//! `/metrics` in the Prometheus text format, with kube-apiserver's names and labels:
//! requests by verb, group, version, resource, subresource, scope and code; request
//! latency; open and terminated watches; store call latency.
//!
//! Every label value comes from a closed set — the verbs, the registry's resources, the
//! HTTP codes — never from the raw request, so an unauthenticated client probing random
//! paths adds no series (a request the server cannot resolve to a resource is counted
//! with empty group, version and resource).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Upper bounds of the latency buckets, in seconds (kube-apiserver's range, trimmed).
const BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];

/// The verbs a request is counted under: Kubernetes' API verbs, and the HTTP methods
/// of requests that name no resource. Anything else is `other`.
const VERBS: &[&str] = &[
    "get",
    "list",
    "watch",
    "create",
    "update",
    "patch",
    "delete",
    "deletecollection",
    "connect",
    "head",
    "options",
    "post",
    "put",
];

/// What a request is counted as: kube-apiserver's `apiserver_request_total` labels.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub verb: String,
    pub group: String,
    pub version: String,
    pub resource: String,
    pub subresource: String,
    /// `resource` (one object), `namespace` (a namespace's collection), `cluster` (a
    /// cluster-wide collection), or empty for requests that name no resource.
    pub scope: String,
}

impl RequestLabels {
    /// A request that names no resource (or was refused before it was resolved):
    /// counted by its method alone.
    pub fn non_resource(method: &str) -> Self {
        Self {
            verb: bounded_verb(method),
            ..Self::default()
        }
    }
}

fn bounded_verb(verb: &str) -> String {
    let verb = verb.to_ascii_lowercase();
    if VERBS.contains(&verb.as_str()) {
        verb
    } else {
        "other".to_owned()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    #[prometheus(flatten)]
    request: RequestLabels,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabel {
    operation: String,
}

fn latency_histogram() -> Histogram {
    Histogram::new(BUCKETS.iter().copied())
}

/// The server's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<CodeLabels, Counter>,
    latency: Family<RequestLabels, Histogram, fn() -> Histogram>,
    watchers: Gauge,
    terminated_watchers: Counter,
    rejected: Family<RequestLabels, Counter>,
    /// OpenAPI documents built (once per registry change).
    pub openapi_builds: Counter,
    /// Connections closed because their client stopped reading.
    pub stalled_connections: Counter,
    /// Filled by the store the server's requests go through
    /// ([`crate::storage::metered::MeteredStore`]).
    pub store: Arc<StoreLatency>,
    /// Registry and encoder are not `Sync` in every version: one render at a time.
    render_lock: Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<CodeLabels, Counter>::default();
        registry.register(
            "apiserver_request",
            "Requests by verb, group, version, resource, subresource, scope and HTTP code",
            requests.clone(),
        );
        let latency = Family::<RequestLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            latency_histogram,
        );
        registry.register(
            "apiserver_request_duration_seconds",
            "Request latency (watches excluded: they last as long as the client wants)",
            latency.clone(),
        );
        let watchers = Gauge::default();
        registry.register(
            "apiserver_watch_cache_watchers",
            "Open watches served by the watch cache",
            watchers.clone(),
        );
        let terminated_watchers = Counter::default();
        registry.register(
            "apiserver_terminated_watchers",
            "Watches ended because their client did not read its events in time",
            terminated_watchers.clone(),
        );
        let rejected = Family::<RequestLabels, Counter>::default();
        registry.register(
            "apiserver_flowcontrol_rejected_requests",
            "Requests refused with 429 because too many were in flight",
            rejected.clone(),
        );
        let openapi_builds = Counter::default();
        registry.register(
            "apiserver_openapi_builds",
            "Times the OpenAPI documents were built: once per change of the served resources",
            openapi_builds.clone(),
        );
        let stalled_connections = Counter::default();
        registry.register(
            "apiserver_stalled_connections_closed",
            "Connections closed because their writes stayed blocked: the client stopped reading",
            stalled_connections.clone(),
        );
        let store = Arc::new(StoreLatency::default());
        registry.register(
            "apiserver_storage_request_duration_seconds",
            "Store call latency by operation",
            store.by_operation.clone(),
        );
        Self {
            registry,
            requests,
            latency,
            watchers,
            terminated_watchers,
            rejected,
            openapi_builds,
            stalled_connections,
            store,
            render_lock: Mutex::new(()),
        }
    }
}

impl Metrics {
    /// Counts one finished request.
    pub fn record(&self, labels: &RequestLabels, code: u16, elapsed: Duration) {
        let labels = RequestLabels {
            verb: bounded_verb(&labels.verb),
            ..labels.clone()
        };
        // Watches last as long as the client wants: their duration says nothing.
        if labels.verb != "watch" {
            self.latency
                .get_or_create(&labels)
                .observe(elapsed.as_secs_f64());
        }
        self.requests
            .get_or_create(&CodeLabels {
                request: labels,
                code: code.to_string(),
            })
            .inc();
    }

    /// Counts a request refused because too many were in flight.
    pub fn rejected(&self, labels: &RequestLabels) {
        self.rejected.get_or_create(labels).inc();
    }

    /// The text exposition; `watches` is the number of open watches now, `terminated`
    /// how many the watch cache has ended so far because their client stopped reading.
    pub fn render(&self, watches: usize, terminated: u64) -> String {
        let _one = self.render_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.watchers
            .set(i64::try_from(watches).unwrap_or(i64::MAX));
        let counted = self.terminated_watchers.get();
        self.terminated_watchers
            .inc_by(terminated.saturating_sub(counted));
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode_registry(&mut out, &self.registry)
        {
            tracing::warn!(error = %e, "encoding the metrics failed");
        }
        out
    }
}

/// Latency of the store's calls, by operation.
#[derive(Debug)]
pub struct StoreLatency {
    by_operation: Family<OperationLabel, Histogram, fn() -> Histogram>,
}

impl Default for StoreLatency {
    fn default() -> Self {
        Self {
            by_operation: Family::new_with_constructor(latency_histogram),
        }
    }
}

impl StoreLatency {
    pub fn observe(&self, operation: &'static str, since: std::time::Instant) {
        self.by_operation
            .get_or_create(&OperationLabel {
                operation: operation.to_owned(),
            })
            .observe(since.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(verb: &str, resource: &str) -> RequestLabels {
        RequestLabels {
            verb: verb.into(),
            version: "v1".into(),
            resource: resource.into(),
            scope: "namespace".into(),
            ..RequestLabels::default()
        }
    }

    #[test]
    fn renders_counters_and_cumulative_buckets() {
        let m = Metrics::default();
        m.record(&labels("get", "pods"), 200, Duration::from_micros(700));
        m.record(&labels("get", "pods"), 200, Duration::from_millis(30));
        m.record(
            &labels("create", "configmaps"),
            409,
            Duration::from_millis(2),
        );
        m.record(&labels("watch", "pods"), 200, Duration::from_secs(600));
        let text = m.render(3, 0);
        let get =
            r#"verb="get",group="",version="v1",resource="pods",subresource="",scope="namespace""#;
        assert!(
            text.contains(&format!("apiserver_request_total{{{get},code=\"200\"}} 2")),
            "{text}"
        );
        assert!(text.contains(
            r#"apiserver_request_total{verb="create",group="",version="v1",resource="configmaps",subresource="",scope="namespace",code="409"} 1"#
        ));
        assert!(
            text.contains(&format!(
                "apiserver_request_duration_seconds_bucket{{le=\"0.001\",{get}}} 1"
            )),
            "{text}"
        );
        assert!(text.contains(&format!(
            "apiserver_request_duration_seconds_bucket{{le=\"0.05\",{get}}} 2"
        )));
        assert!(text.contains(&format!(
            "apiserver_request_duration_seconds_count{{{get}}} 2"
        )));
        assert!(
            !text.contains("apiserver_request_duration_seconds_count{verb=\"watch\""),
            "watch durations are not latency"
        );
        assert!(text.contains("apiserver_watch_cache_watchers 3"));
    }

    #[test]
    fn unknown_methods_and_paths_add_no_series() {
        let m = Metrics::default();
        for i in 0..1000 {
            let method = format!("M{i}\"}} 1\n");
            m.record(&RequestLabels::non_resource(&method), 401, Duration::ZERO);
        }
        let text = m.render(0, 0);
        let series = text
            .lines()
            .filter(|l| l.starts_with("apiserver_request_total{"))
            .count();
        assert_eq!(series, 1, "{text}");
        assert!(text.contains(r#"verb="other""#), "{text}");
    }
}
