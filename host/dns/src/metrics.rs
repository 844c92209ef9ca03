//! The server's metrics, named as CoreDNS' (`coredns_dns_requests_total`, …), so that
//! dashboards made for kube-dns read them.

use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RequestLabels {
    /// `cluster` (answered from the cluster's records) or `forward`.
    pub zone: &'static str,
    pub proto: &'static str,
    /// The query type (`A`, `AAAA`, `SRV`, …).
    pub r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ResponseLabels {
    pub zone: &'static str,
    pub rcode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ZoneLabel {
    pub zone: &'static str,
}

/// What `metrics_text` shows.
#[derive(Clone)]
pub(crate) struct Metrics {
    /// `coredns_dns_requests_total{zone, proto, type}`.
    pub requests: Family<RequestLabels, Counter>,
    /// `coredns_dns_responses_total{zone, rcode}`.
    pub responses: Family<ResponseLabels, Counter>,
    /// `coredns_dns_request_duration_seconds{zone}`: from the query read to the answer
    /// sent.
    pub duration: Family<ZoneLabel, Histogram>,
    /// `coredns_cache_hits_total` / `coredns_cache_misses_total`: forwarded names.
    pub cache_hits: Counter,
    pub cache_misses: Counter,
    /// `coredns_forward_requests_total`: queries sent upstream.
    pub forwarded: Counter,
    registry: Arc<Mutex<Registry>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let requests = Family::<RequestLabels, Counter>::default();
        let responses = Family::<ResponseLabels, Counter>::default();
        // 10 µs to ~5 s: cluster answers take microseconds, forwarded ones milliseconds.
        let duration = Family::<ZoneLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.000_01, 2.0, 20))
        });
        let cache_hits = Counter::default();
        let cache_misses = Counter::default();
        let forwarded = Counter::default();
        let mut registry = Registry::with_prefix("coredns");
        registry.register(
            "dns_requests",
            "DNS queries by zone, transport and type",
            requests.clone(),
        );
        registry.register(
            "dns_responses",
            "DNS answers by zone and response code",
            responses.clone(),
        );
        registry.register(
            "dns_request_duration_seconds",
            "Time to answer a query",
            duration.clone(),
        );
        registry.register(
            "cache_hits",
            "Forwarded names answered from the cache",
            cache_hits.clone(),
        );
        registry.register(
            "cache_misses",
            "Forwarded names not in the cache",
            cache_misses.clone(),
        );
        registry.register(
            "forward_requests",
            "Queries sent to the upstream resolvers",
            forwarded.clone(),
        );
        Self {
            requests,
            responses,
            duration,
            cache_hits,
            cache_misses,
            forwarded,
            registry: Arc::new(Mutex::new(registry)),
        }
    }
}

/// A response code as CoreDNS labels it (`NOERROR`, `NXDOMAIN`, …).
pub(crate) fn rcode_label(code: hickory_proto::op::ResponseCode) -> &'static str {
    use hickory_proto::op::ResponseCode;
    match code {
        ResponseCode::NoError => "NOERROR",
        ResponseCode::FormErr => "FORMERR",
        ResponseCode::ServFail => "SERVFAIL",
        ResponseCode::NXDomain => "NXDOMAIN",
        ResponseCode::NotImp => "NOTIMP",
        ResponseCode::Refused => "REFUSED",
        _ => "OTHER",
    }
}

impl Metrics {
    /// The text exposition, with `# EOF`.
    pub(crate) fn text(&self) -> String {
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        let mut text = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
        text
    }
}
