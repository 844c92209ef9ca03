//! Hollow nodes: many simulated nodes in one process, as Kubernetes' kubemark runs
//! hollow kubelets. Each is this crate's agent, unchanged in what it does for a pod
//! (registration, Lease, workers, status, events), over a runtime of its own from
//! [`trellis_runtime::hollow`] whose containers start at once and run until stopped.
//!
//! What makes a node cheap (well under 1 MB, no CPU when idle):
//! - its runtime is an in-memory map behind an in-memory HTTP/2 connection;
//! - the nodes share one informer of pods, dispatched by `spec.nodeName`
//!   ([`PodDispatch`]), instead of a watch each;
//! - nothing changes in a hollow runtime unless the agent asks, so the relist that
//!   notices exits runs rarely ([`HollowConfig::relist_period`]);
//! - Lease renewals are spread over the renewal period, and registrations are paced
//!   ([`HollowConfig::registering`]) so thousands of nodes start without a stampede.
//!
//! Hollow nodes serve no logs and no ports.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::{Semaphore, oneshot};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{info, warn};
use trellis_api::Shutdown;
use trellis_client::informer::{Informer, SharedInformers};
use trellis_runtime::hollow::{self, HollowRuntime};

use crate::pods::PodDispatch;
use crate::{AgentConfig, RunOptions};

/// How many hollow nodes and what they report.
#[derive(Clone, Debug)]
pub struct HollowConfig {
    /// Nodes run.
    pub count: usize,
    /// Nodes are named `PREFIX-00000`, `PREFIX-00001`, ….
    pub prefix: String,
    /// How long a container takes to start.
    pub start_delay: Duration,
    /// Each node's CPUs and bytes of memory (kubemark's are its own too: the
    /// machine's would make the scheduler's spreading meaningless).
    pub capacity: (u64, u64),
    /// The runtime handlers each node serves.
    pub handlers: Vec<String>,
    /// Where pods' files would live: a directory per node under it, since each
    /// node's housekeeping removes the files of pods it does not have.
    pub root: PathBuf,
    /// As [`AgentConfig::lease_renew`].
    pub lease_renew: Duration,
    /// As [`AgentConfig::status_report`].
    pub status_report: Duration,
    /// As [`AgentConfig::relist_period`]: a hollow container never changes on its own,
    /// so a relist finds nothing the agent did not do itself.
    pub relist_period: Duration,
    /// Nodes registering at once; the next starts when one is registered.
    pub registering: usize,
}

impl HollowConfig {
    pub fn new(count: usize, root: PathBuf) -> Self {
        Self {
            count,
            prefix: "hollow".into(),
            start_delay: Duration::ZERO,
            capacity: (32, 128 << 30),
            handlers: vec![
                trellis_runtime::WASMTIME.into(),
                trellis_runtime::PROCESS.into(),
            ],
            root,
            lease_renew: Duration::from_secs(10),
            status_report: Duration::from_secs(300),
            relist_period: Duration::from_secs(30),
            registering: 32,
        }
    }

    /// The name of node `i`.
    pub fn node_name(&self, i: usize) -> String {
        format!("{}-{i:05}", self.prefix)
    }
}

/// Node `i`'s address: distinct for each node, on loopback (127.0.0.0/8), where
/// nothing listens for a hollow node.
pub fn node_ip(i: usize) -> IpAddr {
    let n = (i + 1) as u32;
    IpAddr::V4(Ipv4Addr::new(
        127,
        1 + ((n >> 16) & 0xff) as u8,
        ((n >> 8) & 0xff) as u8,
        (n & 0xff) as u8,
    ))
}

/// Runs `config.count` hollow nodes until `stopped`: [`HollowNodes::start`], then
/// [`HollowNodes::wait`].
pub async fn run(
    config: HollowConfig,
    client: impl Fn(&str) -> kube::Client + Send + 'static,
    pods: Arc<Informer<Pod>>,
    informers: SharedInformers,
    stopped: Shutdown,
) -> anyhow::Result<()> {
    HollowNodes::start(config, client, pods, informers, stopped)
        .wait()
        .await
}

/// Hollow nodes running.
#[derive(Debug)]
pub struct HollowNodes {
    runtimes: Arc<Mutex<Vec<Arc<HollowRuntime>>>>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl HollowNodes {
    /// Starts `config.count` hollow nodes, which run until `stopped`. `client` gives
    /// the client of each node by name (a node's own identity, where the server can
    /// tell one), `pods` is an informer of every pod, which the nodes share, and
    /// `informers` the process's others. A node that fails is logged and the others
    /// go on.
    pub fn start(
        config: HollowConfig,
        client: impl Fn(&str) -> kube::Client + Send + 'static,
        pods: Arc<Informer<Pod>>,
        informers: SharedInformers,
        stopped: Shutdown,
    ) -> Self {
        let runtimes = Arc::new(Mutex::new(Vec::with_capacity(config.count)));
        let task = tokio::spawn(run_nodes(
            config,
            client,
            pods,
            informers,
            runtimes.clone(),
            stopped,
        ));
        Self { runtimes, task }
    }

    /// The hollow runtimes of the nodes started so far, in the nodes' order.
    pub fn runtimes(&self) -> Vec<Arc<HollowRuntime>> {
        self.runtimes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Containers of every node's runtime, whatever their state.
    pub fn containers(&self) -> usize {
        self.runtimes().iter().map(|r| r.container_count()).sum()
    }

    /// Waits until every node has stopped: an error names the nodes that failed.
    pub async fn wait(self) -> anyhow::Result<()> {
        self.task
            .await
            .map_err(|e| anyhow::anyhow!("join the hollow nodes: {e}"))?
    }
}

async fn run_nodes(
    config: HollowConfig,
    client: impl Fn(&str) -> kube::Client,
    pods: Arc<Informer<Pod>>,
    informers: SharedInformers,
    runtimes: Arc<Mutex<Vec<Arc<HollowRuntime>>>>,
    stopped: Shutdown,
) -> anyhow::Result<()> {
    let names: Vec<String> = (0..config.count).map(|i| config.node_name(i)).collect();
    let (_dispatch, feeds) = PodDispatch::start(pods, &names);
    let permits = Arc::new(Semaphore::new(config.registering.max(1)));
    let mut nodes = JoinSet::new();
    let mut failed = Vec::new();
    info!(nodes = config.count, prefix = %config.prefix, "hollow nodes starting");
    for (i, (name, feed)) in names.into_iter().zip(feeds).enumerate() {
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => permit?,
            _ = stopped.wait() => break,
        };
        let ip = node_ip(i);
        let runtime = HollowRuntime::new(hollow::HollowConfig {
            handlers: config.handlers.clone(),
            start_delay: config.start_delay,
            node_ip: ip.to_string(),
        });
        runtimes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(runtime.clone());
        let cri = match hollow::connect(runtime).await {
            Ok(cri) => cri,
            Err(e) => {
                warn!(node = %name, error = %e, "cannot connect to the node's hollow runtime");
                failed.push(format!("{name}: connect to its hollow runtime: {e}"));
                continue;
            }
        };
        let mut agent = AgentConfig::new(&name, ip, config.root.join(&name));
        agent.lease_renew = config.lease_renew;
        // Node i renews i/N of a period later than node 0.
        agent.lease_offset = config.lease_renew.mul_f64(i as f64 / config.count as f64);
        agent.status_report = config.status_report;
        agent.relist_period = config.relist_period;
        agent.handlers = config.handlers.clone();
        agent.capacity = Some(config.capacity);
        agent.eviction_hard = None;
        agent.port = 0;
        agent.client_ca_pem = None;
        agent
            .labels
            .push(("node.trellis.dev/hollow".into(), "true".into()));
        let (registered, told) = oneshot::channel();
        let options = RunOptions {
            pods: Some(feed),
            registered: Some(registered),
        };
        let node_client = client(&name);
        let informers = informers.clone();
        let stopped = stopped.clone();
        nodes.spawn(async move {
            let run = crate::run_with(agent, node_client, cri, informers, options, stopped);
            tokio::pin!(run);
            // The permit goes with the registration (or the failure to register).
            let result = tokio::select! {
                result = &mut run => result,
                _ = told => {
                    drop(permit);
                    run.await
                }
            };
            result.map_err(|e| {
                warn!(node = %name, error = %format!("{e:#}"), "failed to run a hollow node");
                format!("{name}: {e:#}")
            })
        });
    }
    while let Some(ended) = nodes.join_next().await {
        match ended {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failed.push(e),
            Err(e) => failed.push(format!("a node's task: {e}")),
        }
    }
    if failed.is_empty() {
        return Ok(());
    }
    let count = failed.len();
    failed.truncate(3);
    anyhow::bail!("{count} hollow node(s) failed: {}", failed.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hollow_nodes_get_distinct_loopback_addresses_and_sortable_names() {
        let config = HollowConfig::new(3, PathBuf::from("/tmp"));
        assert_eq!(config.node_name(7), "hollow-00007");
        assert_eq!(node_ip(0).to_string(), "127.1.0.1");
        assert_eq!(node_ip(255).to_string(), "127.1.1.0");
        assert_eq!(node_ip(70_000).to_string(), "127.2.17.113");
        assert!(node_ip(4_999).is_loopback());
    }
}
