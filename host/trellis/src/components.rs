//! `trellis controllers` and `trellis scheduler`: the component runtime against any
//! API server, and the same runtime inside `trellis up` over the in-process
//! transport.
//!
//! Each component competes for its Lease in `kube-system` (`kube-controller-manager`,
//! `kube-scheduler`, as Kubernetes names them), so that of several processes exactly
//! one runs the loops; the leader starts the shared informers and the loops
//! registered for the component. A component that loses its lease exits with an
//! error (its loops must not run beside the new leader's), as Kubernetes' do; on
//! Ctrl-C or SIGTERM it hands the lease back so a standby takes over at once.
//!
//! Each process serves its components' metrics (informers, work queues, whether it
//! leads) on `/metrics`, as kube-controller-manager (port 10257) and kube-scheduler
//! (10259) do, over plain HTTP on loopback by default.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use trellis_api::Shutdown;

use anyhow::{Context as _, bail};
use clap::Args;
use tracing::{info, warn};
use trellis_client::informer::SharedInformers;
use trellis_client::leader::{LeaderConfig, LeaderElector, Outcome};
use trellis_client::metrics::ComponentMetrics;
use trellis_controllers::bundled;
use trellis_plugin_host::{HostConfig, PluginHost};

use crate::flags::seconds;
use crate::setup::{ControllerSetup, Credentials, Shared, host_name, manager, start_controllers};

/// Which component.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Component {
    Controllers,
    Scheduler,
}

impl Component {
    fn name(self) -> &'static str {
        match self {
            Self::Controllers => "controllers",
            Self::Scheduler => "scheduler",
        }
    }

    /// The Lease Kubernetes' own component of this kind takes.
    fn lease(self) -> &'static str {
        match self {
            Self::Controllers => "kube-controller-manager",
            Self::Scheduler => "kube-scheduler",
        }
    }

    /// Where Kubernetes' component of this kind serves its metrics.
    fn default_metrics_address(self) -> SocketAddr {
        let port = match self {
            Self::Controllers => 10257,
            Self::Scheduler => 10259,
        };
        SocketAddr::from(([127, 0, 0, 1], port))
    }
}

/// `--metrics-bind-address`: an address, or empty to serve no metrics.
pub fn metrics_address(s: &str) -> Result<Option<SocketAddr>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    s.parse()
        .map(Some)
        .map_err(|e| format!("{s:?}: {e} (expected ADDR:PORT, or empty for none)"))
}

#[derive(Debug, Args)]
pub struct ComponentArgs {
    /// The cluster and credentials (`DATA_DIR/controller-manager.kubeconfig` or
    /// `DATA_DIR/scheduler.kubeconfig` of a `trellis server`).
    #[arg(long, value_name = "FILE")]
    kubeconfig: PathBuf,

    /// Run the loops only while holding the component's Lease.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    leader_elect: bool,

    /// How long a leader's lease lasts without renewal.
    #[arg(long, default_value = "15", value_name = "SECONDS", value_parser = seconds)]
    leader_elect_lease_duration: Duration,

    /// How long a leader keeps trying to renew before it gives up leading.
    #[arg(long, default_value = "10", value_name = "SECONDS", value_parser = seconds)]
    leader_elect_renew_deadline: Duration,

    /// How often candidates try to acquire and leaders renew.
    #[arg(long, default_value = "2", value_name = "SECONDS", value_parser = seconds)]
    leader_elect_retry_period: Duration,

    /// Where `/metrics` and `/healthz` are served over plain HTTP (port 0 picks one;
    /// empty serves none). Default: 127.0.0.1:10257 for the controllers,
    /// 127.0.0.1:10259 for the scheduler.
    #[arg(long, value_name = "ADDR:PORT")]
    metrics_bind_address: Option<String>,
}

/// `trellis controllers`: the component's flags and which controllers run.
#[derive(Debug, Args)]
pub struct ControllerArgs {
    #[command(flatten)]
    pub component: ComponentArgs,

    /// The controllers to run, as kube-controller-manager reads the flag: `*` for all
    /// built-ins, `-NAME` to leave one out (`*,-deployment`).
    #[arg(long, default_value = "*", value_name = "LIST")]
    pub controllers: String,

    /// Where compiled plugins are kept between runs (none: compiled at each start).
    #[arg(long, value_name = "DIR")]
    pub plugin_cache_dir: Option<PathBuf>,

    /// How long a node may go unheard (its Lease not renewed) before it is
    /// Ready=Unknown and tainted unreachable.
    #[arg(long, default_value_t = 50, value_name = "SECONDS")]
    pub node_monitor_grace_period: u64,

    /// The node IPAM controller's cluster CIDR and node range size.
    #[command(flatten)]
    pub node_ipam: crate::setup::NodeIpamFlags,

    /// How often each HorizontalPodAutoscaler is synced, in seconds.
    #[arg(long, default_value = "15", value_name = "SECONDS", value_parser = crate::flags::seconds)]
    pub horizontal_pod_autoscaler_sync_period: Duration,

    /// How often the counters of controller Plugins (calls, failed reconciles,
    /// failures) are copied into their status.
    #[arg(long, default_value = "10", value_name = "SECONDS", value_parser = seconds)]
    pub plugin_status_interval: Duration,
}

/// The holder identity of this process: host name and a unique suffix, as Kubernetes'
/// components use.
fn holder_identity() -> String {
    let host = host_name();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{host}_{}_{nanos:08x}", std::process::id())
}

/// Sets `leader_election_master_status` while alive: the work of a leader ends by
/// being dropped when its lease is lost.
struct Leading {
    metrics: ComponentMetrics,
    lease: &'static str,
}

impl Leading {
    fn new(metrics: ComponentMetrics, lease: &'static str) -> Self {
        metrics.set_leading(lease, true);
        Self { metrics, lease }
    }
}

impl Drop for Leading {
    fn drop(&mut self) {
        self.metrics.set_leading(self.lease, false);
    }
}

/// DER certificates as PEM.
fn pem(certs: &[Vec<u8>]) -> String {
    use base64::Engine as _;
    let mut out = String::new();
    for der in certs {
        let text = base64::engine::general_purpose::STANDARD.encode(der);
        out.push_str("-----BEGIN CERTIFICATE-----\n");
        for line in text.as_bytes().chunks(64) {
            out.push_str(&String::from_utf8_lossy(line));
            out.push('\n');
        }
        out.push_str("-----END CERTIFICATE-----\n");
    }
    out
}

/// `trellis controllers --kubeconfig FILE`.
pub async fn run_controllers(
    args: ControllerArgs,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let builtins = crate::setup::with_hpa_sync_period(
        args.node_ipam.select(bundled::select(&args.controllers)?),
        args.horizontal_pod_autoscaler_sync_period,
    );
    let plugins = PluginHost::new(HostConfig {
        cache_dir: args.plugin_cache_dir.clone(),
        ..HostConfig::default()
    })?;
    let tokens = tempfile::Builder::new()
        .prefix("trellis-controller-tokens")
        .tempdir()
        .context("make a directory for the controllers' tokens")?;
    let config = trellis_client::remote_config(&args.component.kubeconfig).await?;
    let root_ca = config.root_cert.as_ref().map(|certs| pem(certs));
    let setup = ControllerSetup {
        plugins,
        modules_dir: crate::plugins::modules_dir(args.plugin_cache_dir.as_deref()),
        running: Default::default(),
        root_ca,
        node_monitor_grace_period: args.node_monitor_grace_period,
        plugin_status_interval: args.plugin_status_interval,
        node_ipam: args.node_ipam.clone(),
        credentials: Credentials::ServiceAccounts {
            config: Box::new(config),
            dir: tokens.path().to_owned(),
        },
        builtins,
    };
    run_remote(
        Component::Controllers,
        args.component,
        Some(setup),
        None,
        shutdown,
    )
    .await
}

/// `trellis controllers|scheduler --kubeconfig FILE`.
pub async fn run_remote(
    component: Component,
    args: ComponentArgs,
    controllers: Option<ControllerSetup>,
    scheduler: Option<crate::setup::SchedulerSetup>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let client = trellis_client::remote(&args.kubeconfig).await?;
    let config = LeaderConfig {
        lease_duration: args.leader_elect_lease_duration,
        renew_deadline: args.leader_elect_renew_deadline,
        retry_period: args.leader_elect_retry_period,
    };
    let metrics = ComponentMetrics::default();
    let (stop_metrics, metrics_stopped) = tokio::sync::oneshot::channel::<()>();
    let addr = match &args.metrics_bind_address {
        Some(s) => {
            metrics_address(s).map_err(|e| anyhow::anyhow!("parse --metrics-bind-address {e}"))?
        }
        None => Some(component.default_metrics_address()),
    };
    if let Some(addr) = addr {
        metrics
            .serve(addr, async move {
                let _ = metrics_stopped.await;
            })
            .await?;
    }
    let informers = SharedInformers::with_metrics(metrics.informers.clone());
    let result = run(
        component,
        client,
        Shared {
            informers,
            metrics,
            controllers,
            scheduler,
        },
        args.leader_elect.then_some(config),
        shutdown,
    )
    .await;
    let _ = stop_metrics.send(());
    result
}

/// Runs `component` with `client` until `shutdown`, leader-elected unless `election`
/// is `None`.
pub async fn run(
    component: Component,
    client: kube::Client,
    shared: Shared,
    election: Option<LeaderConfig>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let (stop, stopped) = Shutdown::new();
    if let Some(setup) = &shared.controllers {
        let running = setup.running.clone();
        shared
            .metrics
            .add_source(Box::new(move |out| running.render(out)));
    }
    if let Some(setup) = &shared.scheduler
        && component == Component::Scheduler
    {
        let metrics = setup.metrics.clone();
        shared
            .metrics
            .add_source(Box::new(move |out| metrics.render_into(out)));
    }
    let work = || {
        let stopped = stopped.clone();
        let shared = shared.clone();
        let client = client.clone();
        async move {
            let _leading = Leading::new(shared.metrics.clone(), component.lease());
            if let (Some(setup), Component::Scheduler) = (&shared.scheduler, component) {
                let setup = setup.clone();
                if let Err(e) =
                    crate::scheduling::work(setup, client, shared.clone(), stopped.clone()).await
                {
                    warn!(error = %format!("{e:#}"), "the scheduler stopped");
                    stopped.wait().await;
                }
                return;
            }
            let setup = match (&shared.controllers, component) {
                (Some(setup), Component::Controllers) => Some(setup.clone()),
                _ => None,
            };
            let Some(setup) = setup else {
                info!(component = component.name(), "running; 0 loops");
                stopped.wait().await;
                return;
            };
            let manager = manager(&setup, &client, &shared);
            let running = start_controllers(&setup, &manager, &client, &stopped).await;
            info!(
                component = component.name(),
                loops = ?running.iter().map(|r| r.plugin.name().to_owned()).collect::<Vec<_>>(),
                "running; {} loops",
                running.len()
            );
            // Plugin objects of kind controller join them (and may replace them) until
            // the work ends.
            crate::plugin_controllers::follow(setup, manager, client, shared, running, stopped)
                .await;
        }
    };
    let Some(config) = election else {
        let running = work();
        tokio::pin!(running);
        tokio::select! {
            () = &mut running => {}
            () = shutdown => {}
        }
        return Ok(());
    };
    let identity = holder_identity();
    info!(
        component = component.name(),
        lease = component.lease(),
        %identity,
        "waiting to lead"
    );
    let elector = LeaderElector::new(
        client.clone(),
        "kube-system",
        component.lease(),
        &identity,
        config,
    );
    let elected = elector.run(work);
    tokio::pin!(elected);
    tokio::pin!(shutdown);
    let outcome = tokio::select! {
        outcome = &mut elected => outcome,
        () = &mut shutdown => {
            // Ends the work if leading: the lease is handed back.
            stop.stop();
            match tokio::time::timeout(config.renew_deadline, &mut elected).await {
                Ok(outcome) => outcome,
                Err(_) => return Ok(()),
            }
        }
    };
    match outcome {
        Outcome::Finished => Ok(()),
        Outcome::Lost => bail!(
            "keep the {} lease: it was lost; stopping so that only the new leader runs the loops",
            component.lease()
        ),
    }
}

/// The components of `trellis up`, in this process over the in-process transport,
/// each as its own Kubernetes user.
pub fn start_in_process(
    in_process: &trellis_client::InProcess,
    shared: &Shared,
    shutdown: Shutdown,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<()>>> {
    [
        (
            Component::Controllers,
            trellis_client::identity::controller_manager(),
        ),
        (Component::Scheduler, trellis_client::identity::scheduler()),
    ]
    .into_iter()
    .map(|(component, user)| {
        let client = in_process.client(user);
        let shutdown = shutdown.clone();
        let shared = shared.clone();
        tokio::spawn(async move {
            run(
                component,
                client,
                shared,
                Some(LeaderConfig::default()),
                async move {
                    shutdown.wait().await;
                },
            )
            .await
            .with_context(|| format!("run the {}", component.name()))
        })
    })
    .collect()
}
