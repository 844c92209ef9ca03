//! The readings: every node's Summary every resolution, and the metrics made from two
//! readings in a row. CPU is the rate of the cumulative CPU time between them (the
//! window), memory the working set of the latest, as metrics-server reports both.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use tracing::{debug, warn};
use trellis_agent::stats::{CpuStats, MemoryStats, Summary};
use trellis_api::Shutdown;

use super::Config;

/// One figure: CPU in billionths of a core over `window`, ending at `timestamp`, and
/// the memory working set then.
#[derive(Clone, Debug, PartialEq)]
pub struct Usage {
    pub timestamp: jiff::Timestamp,
    pub window: Duration,
    pub cpu_nano_cores: u64,
    pub memory_bytes: u64,
}

/// A node's metrics, with its labels (for selectors).
#[derive(Clone, Debug)]
pub struct NodeMetrics {
    pub usage: Usage,
    pub labels: BTreeMap<String, String>,
}

/// A pod's metrics: each container's, and the pod's labels.
#[derive(Clone, Debug)]
pub struct PodMetrics {
    pub timestamp: jiff::Timestamp,
    pub window: Duration,
    pub containers: Vec<(String, Usage)>,
    pub labels: BTreeMap<String, String>,
}

/// The metrics of the last readings.
#[derive(Debug, Default)]
pub struct Store {
    nodes: RwLock<Arc<BTreeMap<String, NodeMetrics>>>,
    /// By `(namespace, name)`.
    pods: RwLock<Arc<BTreeMap<(String, String), PodMetrics>>>,
}

impl Store {
    pub fn nodes(&self) -> Arc<BTreeMap<String, NodeMetrics>> {
        self.nodes.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn pods(&self) -> Arc<BTreeMap<(String, String), PodMetrics>> {
        self.pods.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces what is served.
    pub fn set(
        &self,
        nodes: BTreeMap<String, NodeMetrics>,
        pods: BTreeMap<(String, String), PodMetrics>,
    ) {
        *self.nodes.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(nodes);
        *self.pods.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(pods);
    }
}

/// A cumulative CPU reading: when, and the nanoseconds used since the start.
type Cumulative = (jiff::Timestamp, u64);

/// Reads every node each resolution until `stopped`.
pub async fn run(client: kube::Client, store: Arc<Store>, config: Config, stopped: Shutdown) {
    let mut previous: HashMap<String, Cumulative> = HashMap::new();
    loop {
        let started = tokio::time::Instant::now();
        if let Err(e) = scrape(&client, &store, &config, &mut previous).await {
            warn!(error = %format!("{e:#}"), "reading the nodes' usage failed");
        }
        tokio::select! {
            () = tokio::time::sleep_until(started + config.metric_resolution) => {}
            () = stopped.wait() => return,
        }
    }
}

async fn scrape(
    client: &kube::Client,
    store: &Store,
    config: &Config,
    previous: &mut HashMap<String, Cumulative>,
) -> anyhow::Result<()> {
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let pod_labels: HashMap<(String, String), BTreeMap<String, String>> = pods
        .items
        .into_iter()
        .map(|p| {
            (
                (
                    p.metadata.namespace.unwrap_or_default(),
                    p.metadata.name.unwrap_or_default(),
                ),
                p.metadata.labels.unwrap_or_default(),
            )
        })
        .collect();
    let readings = futures::future::join_all(nodes.items.iter().map(|node| {
        let name = node.metadata.name.clone().unwrap_or_default();
        async move {
            let read = tokio::time::timeout(config.scrape_timeout, summary(client, &name)).await;
            (name, read)
        }
    }))
    .await;
    let mut node_metrics = BTreeMap::new();
    let mut pod_metrics = BTreeMap::new();
    let mut seen = HashMap::new();
    for (node, read) in readings {
        let summary = match read {
            Ok(Ok(summary)) => summary,
            Ok(Err(e)) => {
                debug!(%node, error = %format!("{e:#}"), "reading the node failed");
                continue;
            }
            Err(_) => {
                debug!(%node, "reading the node timed out");
                continue;
            }
        };
        let labels = nodes
            .items
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(node.as_str()))
            .and_then(|n| n.metadata.labels.clone())
            .unwrap_or_default();
        let key = format!("node/{node}");
        if let Some(usage) = usage(
            &key,
            summary.node.cpu.as_ref(),
            summary.node.memory.as_ref(),
            previous,
            &mut seen,
        ) {
            node_metrics.insert(node.clone(), NodeMetrics { usage, labels });
        }
        for pod in &summary.pods {
            let reference = &pod.pod_ref;
            let mut containers = Vec::new();
            let mut complete = !pod.containers.is_empty();
            for container in &pod.containers {
                let key = format!(
                    "container/{}/{}/{}/{}",
                    reference.namespace, reference.name, reference.uid, container.name
                );
                match usage(
                    &key,
                    container.cpu.as_ref(),
                    container.memory.as_ref(),
                    previous,
                    &mut seen,
                ) {
                    Some(u) => containers.push((container.name.clone(), u)),
                    None => complete = false,
                }
            }
            // A pod with a container not yet read twice has no figure, as
            // metrics-server leaves such pods out.
            if !complete {
                continue;
            }
            let id = (reference.namespace.clone(), reference.name.clone());
            let (timestamp, window) = containers
                .iter()
                .map(|(_, u)| (u.timestamp, u.window))
                .max_by_key(|(t, _)| *t)
                .unwrap_or((jiff::Timestamp::now(), Duration::ZERO));
            pod_metrics.insert(
                id.clone(),
                PodMetrics {
                    timestamp,
                    window,
                    containers,
                    labels: pod_labels.get(&id).cloned().unwrap_or_default(),
                },
            );
        }
    }
    // What was not read this time is forgotten: gone, or to be read twice again.
    *previous = seen;
    store.set(node_metrics, pod_metrics);
    Ok(())
}

/// The figure of `key` from this reading and the one before it, if both have a
/// cumulative CPU time and time passed between them; the reading is kept in `seen`
/// for the next.
fn usage(
    key: &str,
    cpu: Option<&CpuStats>,
    memory: Option<&MemoryStats>,
    previous: &HashMap<String, Cumulative>,
    seen: &mut HashMap<String, Cumulative>,
) -> Option<Usage> {
    let cpu = cpu?;
    let time: jiff::Timestamp = cpu.time.parse().ok()?;
    let total = cpu.usage_core_nano_seconds?;
    seen.insert(key.to_owned(), (time, total));
    let (before, before_total) = previous.get(key)?;
    let window = time.duration_since(*before).unsigned_abs();
    // A counter that went back is a restarted container: no rate across it.
    if window.is_zero() || total < *before_total {
        return None;
    }
    let nanos = u128::from(total - before_total) * 1_000_000_000 / window.as_nanos().max(1);
    Some(Usage {
        timestamp: time,
        window,
        cpu_nano_cores: u64::try_from(nanos).unwrap_or(u64::MAX),
        memory_bytes: memory.and_then(|m| m.working_set_bytes).unwrap_or(0),
    })
}

/// One node's Summary, CPU and memory only, through the API server's node proxy.
async fn summary(client: &kube::Client, node: &str) -> anyhow::Result<Summary> {
    let request = hyper::Request::get(format!(
        "/api/v1/nodes/{node}/proxy/stats/summary?only_cpu_and_memory=true"
    ))
    .body(Vec::new())?;
    let text = client.request_text(request).await?;
    Ok(serde_json::from_str(&text)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu(time: &str, total: u64) -> CpuStats {
        CpuStats {
            time: time.into(),
            usage_nano_cores: None,
            usage_core_nano_seconds: Some(total),
        }
    }

    #[test]
    fn cpu_is_the_rate_between_two_readings() {
        let mut previous = HashMap::new();
        let mut seen = HashMap::new();
        let first = cpu("2026-01-01T00:00:00Z", 1_000_000_000);
        assert_eq!(usage("c", Some(&first), None, &previous, &mut seen), None);
        previous = std::mem::take(&mut seen);
        // Half a core over two seconds.
        let second = cpu("2026-01-01T00:00:02Z", 2_000_000_000);
        let memory = MemoryStats {
            working_set_bytes: Some(4096),
            ..MemoryStats::default()
        };
        let u = usage("c", Some(&second), Some(&memory), &previous, &mut seen).unwrap();
        assert_eq!(u.cpu_nano_cores, 500_000_000);
        assert_eq!(u.window, Duration::from_secs(2));
        assert_eq!(u.memory_bytes, 4096);
        // A counter that went back (a restart) gives nothing.
        previous = std::mem::take(&mut seen);
        let restarted = cpu("2026-01-01T00:00:03Z", 10);
        assert_eq!(
            usage("c", Some(&restarted), None, &previous, &mut seen),
            None
        );
    }
}
