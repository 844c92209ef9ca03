//! Hollow nodes from the command line: `trellis node --hollow N --kubeconfig FILE` and
//! `trellis up --hollow-nodes N` run N simulated nodes in this process
//! (`trellis_agent::hollow`: the real agent on fake runtimes whose containers start
//! at once and run until stopped).

use std::path::PathBuf;
use std::time::Duration;
use trellis_api::Shutdown;

use crate::flags::seconds;
use anyhow::Context as _;
use clap::Args;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher;
use trellis_agent::hollow::{HollowConfig, HollowNodes};
use trellis_client::identity;
use trellis_client::informer::SharedInformers;

/// The settings of hollow nodes.
#[derive(Clone, Debug, Args)]
pub struct HollowFlags {
    /// Hollow nodes are named PREFIX-00000, PREFIX-00001, ….
    #[arg(long, default_value = "hollow", value_name = "PREFIX")]
    pub hollow_prefix: String,

    /// How long a hollow node's container takes to start.
    #[arg(long, default_value = "0", value_name = "SECONDS", value_parser = seconds)]
    pub hollow_start_delay: Duration,

    /// CPUs each hollow node reports.
    #[arg(long, default_value_t = 32, value_name = "CPUS")]
    pub hollow_cpus: u64,

    /// GiB of memory each hollow node reports.
    #[arg(long, default_value_t = 128, value_name = "GIB")]
    pub hollow_memory_gib: u64,

    /// How often a hollow node lists its runtime's containers: a fake container never
    /// changes on its own, so this only cleans up after pods deleted while it was
    /// down.
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = seconds)]
    pub hollow_relist_period: Duration,
}

impl HollowFlags {
    /// The configuration of `count` nodes keeping pods' files under `root`.
    pub fn config(&self, count: usize, root: PathBuf) -> HollowConfig {
        let mut config = HollowConfig::new(count, root);
        config.prefix = self.hollow_prefix.clone();
        config.start_delay = self.hollow_start_delay;
        config.capacity = (self.hollow_cpus, self.hollow_memory_gib << 30);
        config.relist_period = self.hollow_relist_period;
        config
    }
}

/// Starts hollow nodes inside the API server's process: each node acts as itself
/// (`system:node:NAME`, held to the Node authorizer); their shared informer of pods is
/// `informers`' (the scheduler's, when it runs here), listed as the scheduler.
pub fn start_in_process(
    in_process: &trellis_client::InProcess,
    informers: &SharedInformers,
    config: HollowConfig,
    stopped: Shutdown,
) -> HollowNodes {
    let pods = informers.informer::<Pod>(
        Api::all(in_process.client(identity::scheduler())),
        watcher::Config::default(),
    );
    let clients = in_process.clone();
    HollowNodes::start(
        config,
        move |name| clients.client(identity::node(name)),
        pods,
        informers.clone(),
        stopped,
    )
}

/// `trellis node --hollow N`: every node with the kubeconfig's client, which must be
/// allowed to act for all of them and to list every pod (an admin's).
pub async fn run_remote(
    kubeconfig: &std::path::Path,
    config: HollowConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let client = trellis_client::transport::remote(kubeconfig).await?;
    std::fs::create_dir_all(&config.root)
        .with_context(|| format!("create {}", config.root.display()))?;
    let (stop, stopped) = Shutdown::new();
    let informers = SharedInformers::new();
    let pods = informers.informer::<Pod>(Api::all(client.clone()), watcher::Config::default());
    println!(
        "Running {} hollow nodes ({}-00000 …) until Ctrl-C",
        config.count, config.prefix
    );
    let nodes = HollowNodes::start(config, move |_| client.clone(), pods, informers, stopped);
    shutdown.await;
    stop.stop();
    nodes.wait().await.context("stop the hollow nodes")
}
