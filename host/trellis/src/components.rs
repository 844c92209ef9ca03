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

use anyhow::{Context as _, bail};
use clap::Args;
use tracing::info;
use trellis_client::informer::SharedInformers;
use trellis_client::leader::{LeaderConfig, LeaderElector, Outcome};
use trellis_client::metrics::ComponentMetrics;

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

    /// The loops registered for this component.
    fn loops(self) -> &'static [&'static str] {
        &[]
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

fn seconds(s: &str) -> Result<Duration, String> {
    let value: f64 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    Duration::try_from_secs_f64(value).map_err(|e| format!("{s:?}: {e}"))
}

/// The holder identity of this process: host name and a unique suffix, as Kubernetes'
/// components use.
fn holder_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "localhost".to_owned());
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

/// `trellis controllers|scheduler --kubeconfig FILE`.
pub async fn run_remote(
    component: Component,
    args: ComponentArgs,
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
        Shared { informers, metrics },
        args.leader_elect.then_some(config),
        shutdown,
    )
    .await;
    let _ = stop_metrics.send(());
    result
}

/// What the components of one process share: one informer per resource (hence one
/// watch) and one set of metrics.
#[derive(Clone, Debug)]
pub struct Shared {
    pub informers: SharedInformers,
    pub metrics: ComponentMetrics,
}

impl Default for Shared {
    fn default() -> Self {
        Self::new()
    }
}

impl Shared {
    /// Informers whose metrics are among the components' metrics.
    pub fn new() -> Self {
        let metrics = ComponentMetrics::default();
        Self {
            informers: SharedInformers::with_metrics(metrics.informers.clone()),
            metrics,
        }
    }
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
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let work = || {
        let mut stopped = stopped.clone();
        // What the registered loops read through: one watch per resource.
        let Shared { informers, metrics } = shared.clone();
        async move {
            let _informers = informers;
            let _leading = Leading::new(metrics, component.lease());
            info!(
                component = component.name(),
                loops = ?component.loops(),
                "running; {} loops registered",
                component.loops().len()
            );
            let _ = stopped.wait_for(|s| *s).await;
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
            let _ = stop.send(true);
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
    shutdown: tokio::sync::watch::Receiver<bool>,
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
        let mut shutdown = shutdown.clone();
        let shared = shared.clone();
        tokio::spawn(async move {
            run(
                component,
                client,
                shared,
                Some(LeaderConfig::default()),
                async move {
                    let _ = shutdown.wait_for(|s| *s).await;
                },
            )
            .await
            .with_context(|| format!("run the {}", component.name()))
        })
    })
    .collect()
}
