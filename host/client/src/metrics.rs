//! A component's metrics: its informers', its work queues' and its leader election's,
//! in one Prometheus registry, and the small HTTP endpoint that serves them
//! (`/metrics`, `/healthz`) as kube-controller-manager and kube-scheduler serve theirs.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tracing::info;

use crate::informer::InformerMetrics;
use crate::workqueue::QueueMetrics;

/// The metrics of the components of one process. Clones share them.
#[derive(Clone)]
pub struct ComponentMetrics {
    pub informers: InformerMetrics,
    pub queues: QueueMetrics,
    /// `leader_election_master_status{name=LEASE}`: 1 while this process leads.
    leading: Family<LeaseLabel, Gauge>,
    /// The encoder is not `Sync` in every version: one render at a time.
    registry: Arc<Mutex<Registry>>,
    /// Text expositions rendered by others (the controller plugins' call counters),
    /// appended after the registry's.
    sources: Arc<Mutex<Vec<Source>>>,
}

/// Appends its metrics' text exposition to the string.
pub type Source = Box<dyn Fn(&mut String) + Send + Sync>;

impl std::fmt::Debug for ComponentMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComponentMetrics").finish_non_exhaustive()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaseLabel {
    name: String,
}

impl Default for ComponentMetrics {
    fn default() -> Self {
        let informers = InformerMetrics::default();
        let queues = QueueMetrics::default();
        let leading = Family::<LeaseLabel, Gauge>::default();
        let mut registry = Registry::default();
        informers.register(&mut registry);
        queues.register(&mut registry);
        registry.register(
            "leader_election_master_status",
            "1 while this process holds the lease named, else 0",
            leading.clone(),
        );
        Self {
            informers,
            queues,
            leading,
            registry: Arc::new(Mutex::new(registry)),
            sources: Arc::default(),
        }
    }
}

impl ComponentMetrics {
    /// Records whether this process holds lease `name`.
    pub fn set_leading(&self, name: &str, leading: bool) {
        self.leading
            .get_or_create(&LeaseLabel { name: name.into() })
            .set(i64::from(leading));
    }

    /// Adds metrics rendered elsewhere to every render.
    pub fn add_source(&self, source: Source) {
        self.sources
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(source);
    }

    /// Appends the text exposition (without `# EOF`) to `out`.
    pub fn render_into(&self, out: &mut String) {
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = prometheus_client::encoding::text::encode_registry(out, &registry) {
            tracing::warn!(error = %e, "encoding the component metrics failed");
        }
        drop(registry);
        for source in self
            .sources
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            source(out);
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        self.render_into(&mut out);
        out
    }

    /// Serves `/metrics` and `/healthz` over plain HTTP on `addr` until `shutdown`;
    /// returns the address bound (port 0 picks one) once listening. Plain HTTP, so
    /// `addr` belongs on loopback or a private network.
    pub async fn serve(
        &self,
        addr: SocketAddr,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<SocketAddr> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listen for metrics on {addr}"))?;
        let bound = listener.local_addr().context("read the metrics address")?;
        let metrics = self.clone();
        let app = axum::Router::new()
            .route(
                "/metrics",
                axum::routing::get(move || {
                    let text = metrics.render();
                    async move {
                        (
                            StatusCode::OK,
                            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                            text,
                        )
                            .into_response()
                    }
                }),
            )
            .route("/healthz", axum::routing::get(|| async { "ok" }));
        info!(address = %bound, "serving metrics");
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
            {
                tracing::warn!(error = %e, "the metrics endpoint failed");
            }
        });
        Ok(bound)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_queue_informer_and_leader_metrics() {
        let metrics = ComponentMetrics::default();
        metrics.set_leading("kube-scheduler", true);
        let queue = crate::workqueue::WorkQueue::<String>::new("pods", &metrics.queues);
        queue.add("default/web".into());
        metrics.set_leading("kube-controller-manager", false);
        let text = metrics.render();
        for line in [
            "leader_election_master_status{name=\"kube-scheduler\"} 1",
            "leader_election_master_status{name=\"kube-controller-manager\"} 0",
            "workqueue_adds_total{name=\"pods\"} 1",
            "workqueue_depth{name=\"pods\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        assert!(!text.contains("# EOF"), "{text}");
    }
}
