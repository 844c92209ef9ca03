//! Per-plugin counters and a latency histogram, rendered in Prometheus' text format
//! by the API server's `/metrics`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds: plugin calls are expected in
/// tens of microseconds, deadlines are tens to hundreds of milliseconds.
const BUCKETS: [f64; 14] = [
    0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 1.0,
];

#[derive(Debug, Default)]
pub struct PluginMetrics {
    pub calls: AtomicU64,
    pub denials: AtomicU64,
    pub errors: AtomicU64,
    pub timeouts: AtomicU64,
    /// Calls that found every instance slot of the host in use and had to wait for
    /// one: a sign that `max_instances` is too small for the load.
    pub slot_waits: AtomicU64,
    /// Largest linear memory any instance of the plugin grew to, in bytes.
    pub memory_peak: AtomicU64,
    /// Calls that hold an instance now.
    pub in_flight: AtomicU64,
    completed: AtomicU64,
    buckets: [AtomicU64; BUCKETS.len()],
    latency_sum_nanos: AtomicU64,
}

impl PluginMetrics {
    /// Records one call that returned (whatever its answer).
    pub fn observe(&self, elapsed: Duration) {
        self.completed.fetch_add(1, Ordering::Relaxed);
        let secs = elapsed.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|b| secs <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.latency_sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Calls completed and the time they took in all, on the call threads (from
    /// taking an instance to the answer): what a call costs without the hand-off to
    /// and from those threads.
    pub fn latency(&self) -> (u64, Duration) {
        (
            self.completed.load(Ordering::Relaxed),
            Duration::from_nanos(self.latency_sum_nanos.load(Ordering::Relaxed)),
        )
    }

    pub fn memory(&self, bytes: usize) {
        self.memory_peak.fetch_max(bytes as u64, Ordering::Relaxed);
    }
}

/// One plugin's series: its labels and counters.
pub(crate) struct Series<'a> {
    pub(crate) plugin: &'a str,
    pub(crate) kind: &'a str,
    pub(crate) metrics: &'a PluginMetrics,
}

/// Appends the series of `plugins` to a Prometheus text exposition.
pub(crate) fn render(out: &mut String, plugins: &[Series<'_>]) {
    let counters = [
        ("trellis_plugin_calls_total", "Calls into each plugin.", 0),
        (
            "trellis_plugin_denials_total",
            "Requests each plugin refused.",
            1,
        ),
        (
            "trellis_plugin_errors_total",
            "Calls that failed (trap, timeout, memory, bad answer).",
            2,
        ),
        (
            "trellis_plugin_timeouts_total",
            "Calls stopped at their deadline.",
            3,
        ),
        (
            "trellis_plugin_slot_waits_total",
            "Calls that waited for a free instance slot (every slot of the host in use).",
            4,
        ),
    ];
    for (name, help, which) in counters {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for p in plugins {
            let m = p.metrics;
            let v = match which {
                0 => &m.calls,
                1 => &m.denials,
                2 => &m.errors,
                3 => &m.timeouts,
                _ => &m.slot_waits,
            };
            let _ = writeln!(out, "{name}{} {}", labels(p), v.load(Ordering::Relaxed));
        }
    }
    let name = "trellis_plugin_calls_in_flight";
    let _ = writeln!(
        out,
        "# HELP {name} Calls running in an instance of the plugin now.\n# TYPE {name} gauge"
    );
    for p in plugins {
        let _ = writeln!(
            out,
            "{name}{} {}",
            labels(p),
            p.metrics.in_flight.load(Ordering::Relaxed)
        );
    }
    let name = "trellis_plugin_memory_peak_bytes";
    let _ = writeln!(
        out,
        "# HELP {name} Largest linear memory of any instance of the plugin.\n# TYPE {name} gauge"
    );
    for p in plugins {
        let _ = writeln!(
            out,
            "{name}{} {}",
            labels(p),
            p.metrics.memory_peak.load(Ordering::Relaxed)
        );
    }
    let name = "trellis_plugin_call_duration_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} Latency of completed plugin calls.\n# TYPE {name} histogram"
    );
    for p in plugins {
        let m = p.metrics;
        let base = format!("plugin=\"{}\",kind=\"{}\"", p.plugin, p.kind);
        let mut cumulative = 0;
        for (bound, count) in BUCKETS.iter().zip(&m.buckets) {
            cumulative += count.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{base},le=\"{bound}\"}} {cumulative}");
        }
        let completed = m.completed.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{base},le=\"+Inf\"}} {completed}");
        let sum = m.latency_sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum{{{base}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{base}}} {completed}");
    }
}

fn labels(p: &Series<'_>) -> String {
    format!("{{plugin=\"{}\",kind=\"{}\"}}", p.plugin, p.kind)
}
