//! The scheduler's metrics, named as kube-scheduler's.

use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ResultLabels {
    pub result: &'static str,
    pub profile: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct QueueLabel {
    pub queue: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct PointLabels {
    pub plugin: String,
    pub extension_point: &'static str,
}

/// What `/metrics` shows of the scheduler.
#[derive(Clone)]
pub struct SchedulerMetrics {
    /// `scheduler_schedule_attempts_total{result=scheduled|unschedulable|error}`.
    pub(crate) attempts: Family<ResultLabels, Counter>,
    /// `scheduler_scheduling_attempt_duration_seconds`: one cycle, from pop to the
    /// decision (binding not included).
    pub(crate) attempt_duration: Family<ResultLabels, Histogram>,
    /// `scheduler_pod_scheduling_sli_duration_seconds`: from the pod's first queueing
    /// to its bind.
    pub(crate) e2e: Histogram,
    /// `scheduler_pending_pods{queue=active|backoff|unschedulable}`.
    pub(crate) pending: Family<QueueLabel, Gauge>,
    /// `scheduler_plugin_execution_duration_seconds{plugin, extension_point}`: one
    /// call into a component (its plugins together) per extension point.
    pub(crate) plugin_duration: Family<PointLabels, Histogram>,
    /// Every attempt's duration, exactly, when a benchmark asks for them.
    pub attempt_samples: Option<Arc<Mutex<Vec<std::time::Duration>>>>,
    /// With `attempt_samples`: the time in each component's calls by extension point.
    pub point_totals:
        Arc<Mutex<std::collections::BTreeMap<(String, &'static str), std::time::Duration>>>,
    registry: Arc<Mutex<Registry>>,
}

impl std::fmt::Debug for SchedulerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulerMetrics").finish_non_exhaustive()
    }
}

impl Default for SchedulerMetrics {
    fn default() -> Self {
        let attempts = Family::<ResultLabels, Counter>::default();
        let attempt_duration = Family::<ResultLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.000_1, 2.0, 16))
        });
        let e2e = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        let pending = Family::<QueueLabel, Gauge>::default();
        let plugin_duration = Family::<PointLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.000_01, 2.0, 16))
        });
        let mut registry = Registry::with_prefix("scheduler");
        registry.register(
            "schedule_attempts",
            "Scheduling attempts by result",
            attempts.clone(),
        );
        registry.register(
            "scheduling_attempt_duration_seconds",
            "Scheduling attempt latency (the cycle, without binding)",
            attempt_duration.clone(),
        );
        registry.register(
            "pod_scheduling_sli_duration_seconds",
            "From a pod's first queueing to its bind",
            e2e.clone(),
        );
        registry.register(
            "pending_pods",
            "Pods waiting to be scheduled, by queue",
            pending.clone(),
        );
        registry.register(
            "plugin_execution_duration_seconds",
            "One call into a plugin component, by extension point",
            plugin_duration.clone(),
        );
        Self {
            attempts,
            attempt_duration,
            e2e,
            pending,
            plugin_duration,
            attempt_samples: None,
            point_totals: Arc::default(),
            registry: Arc::new(Mutex::new(registry)),
        }
    }
}

impl SchedulerMetrics {
    /// Appends the text exposition (without `# EOF`).
    pub fn render_into(&self, out: &mut String) {
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        let mut text = String::new();
        if prometheus_client::encoding::text::encode_registry(&mut text, &registry).is_ok() {
            out.push_str(&text);
        }
    }
}
