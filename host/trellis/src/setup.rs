//! What the components of one process run with, and share: the informers and metrics,
//! the controller manager's setup (its built-ins, plugin host and credentials), the
//! scheduler's, and how a built-in controller starts. A leaf of the crate: the
//! component runtime ([`crate::components`]), the controller Plugins
//! ([`crate::plugin_controllers`]) and the scheduler ([`crate::scheduling`]) all build
//! on it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use trellis_api::Shutdown;

use anyhow::Context as _;
use clap::Args;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, PostParams};
use tracing::{info, warn};
use trellis_client::events::EventRecorder;
use trellis_client::informer::SharedInformers;
use trellis_client::metrics::ComponentMetrics;
use trellis_controllers::bundled::Builtin;
use trellis_controllers::{Manager, Running};
use trellis_plugin_host::PluginHost;

use crate::flags::seconds;

/// This machine's host name, lowercased as Kubernetes names nodes (the kubelet's
/// default node name); events and leases name their source by it too.
pub fn host_name() -> String {
    trellis_pki::hostname()
        .map(|h| h.to_lowercase())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// What the components of one process share: one informer per resource (hence one
/// watch) and one set of metrics; and what the controllers run.
#[derive(Clone, Debug)]
pub struct Shared {
    pub informers: SharedInformers,
    pub metrics: ComponentMetrics,
    pub controllers: Option<ControllerSetup>,
    pub scheduler: Option<SchedulerSetup>,
}

/// The controllers of the controller manager: which built-ins, the plugin host that
/// runs them, and how each gets its own identity.
#[derive(Clone)]
pub struct ControllerSetup {
    pub plugins: Arc<PluginHost>,
    pub credentials: Credentials,
    pub builtins: Vec<&'static Builtin>,
    /// Where modules of controller Plugins are fetched to.
    pub modules_dir: PathBuf,
    /// The plugins running, whose calls `/metrics` shows.
    pub running: trellis_controllers::RunningPlugins,
    /// The cluster CA (PEM), which the root CA publisher puts in every namespace.
    pub root_ca: Option<String>,
    /// `--node-monitor-grace-period`, in seconds.
    pub node_monitor_grace_period: u64,
    /// How often controller Plugins' counters are copied into their status.
    pub plugin_status_interval: Duration,
    /// The cluster CIDRs a built-in that allocates Nodes' ranges takes.
    pub node_ipam: NodeIpamFlags,
}

impl std::fmt::Debug for ControllerSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControllerSetup")
            .field(
                "builtins",
                &self.builtins.iter().map(|b| b.name).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

/// How each controller acts as its own ServiceAccount, `kube-system/NAME`, as
/// kube-controller-manager's `--use-service-account-credentials` does.
#[derive(Clone, Debug)]
pub enum Credentials {
    /// In `trellis up`: the in-process transport, as that user.
    InProcess(trellis_client::InProcess),
    /// Against a server: the controller manager makes the ServiceAccount and asks for
    /// its tokens (TokenRequest), kept in a file the client rereads and renewed
    /// before they expire; `config` says where the server is.
    ServiceAccounts {
        config: Box<kube::Config>,
        dir: PathBuf,
    },
}

/// How long a controller's token lasts; it is renewed at four fifths of that.
const TOKEN_LIFETIME: Duration = Duration::from_secs(3600);

impl Credentials {
    /// A client acting as controller `name`, made with `manager` (the controller
    /// manager's own client) where tokens are needed; renewals stop with `stopped`.
    pub async fn client(
        &self,
        manager: &kube::Client,
        name: &str,
        stopped: Shutdown,
    ) -> anyhow::Result<kube::Client> {
        match self {
            Self::InProcess(in_process) => {
                Ok(in_process.client(trellis_client::identity::controller(name)))
            }
            Self::ServiceAccounts { config, dir } => {
                let accounts: Api<ServiceAccount> = Api::namespaced(manager.clone(), "kube-system");
                let account = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": name, "namespace": "kube-system"}
                }))?;
                match accounts.create(&PostParams::default(), &account).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 409 => {}
                    Err(e) => {
                        return Err(e).with_context(|| {
                            format!("create the ServiceAccount kube-system/{name}")
                        });
                    }
                }
                let file = dir.join(format!("{name}.token"));
                write_token(&accounts, name, &file).await?;
                let mut config = kube::Config::clone(config);
                config.auth_info = kube::config::AuthInfo {
                    token_file: Some(file.display().to_string()),
                    ..kube::config::AuthInfo::default()
                };
                let client = trellis_client::remote_with(config)?;
                let name = name.to_owned();
                tokio::spawn(async move {
                    loop {
                        tokio::select! {
                            () = tokio::time::sleep(TOKEN_LIFETIME * 4 / 5) => {}
                            _ = stopped.wait() => return,
                        }
                        if let Err(e) = write_token(&accounts, &name, &file).await {
                            warn!(controller = %name, error = %format!("{e:#}"), "renew the controller's token");
                        }
                    }
                });
                Ok(client)
            }
        }
    }
}

/// Asks for a token of ServiceAccount `kube-system/NAME` and writes it to `file`.
async fn write_token(
    accounts: &Api<ServiceAccount>,
    name: &str,
    file: &std::path::Path,
) -> anyhow::Result<()> {
    let request: TokenRequest = serde_json::from_value(serde_json::json!({
        "spec": {"audiences": [], "expirationSeconds": TOKEN_LIFETIME.as_secs()}
    }))?;
    let answer = accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .with_context(|| format!("request a token for kube-system/{name}"))?;
    let token = answer
        .status
        .context("a TokenRequest with no status")?
        .token;
    // Written aside and renamed: the client never reads half a token.
    let partial = file.with_extension("partial");
    std::fs::write(&partial, token).with_context(|| format!("write {}", partial.display()))?;
    std::fs::rename(&partial, file).with_context(|| format!("write {}", file.display()))?;
    Ok(())
}

/// The controller manager of this process: its plugin host, the shared informers
/// (listing as `client`) and the queues' metrics.
pub fn manager(setup: &ControllerSetup, client: &kube::Client, shared: &Shared) -> Manager {
    Manager {
        plugins: setup.plugins.clone(),
        informers: shared.informers.clone(),
        lister: client.clone(),
        queues: shared.metrics.queues.clone(),
        running: setup.running.clone(),
    }
}

/// A built-in's configuration in this controller manager: the cluster CA or the grace
/// period it takes from flags. `None` when it needs the CA and none is known.
pub fn builtin_configuration(setup: &ControllerSetup, builtin: &Builtin) -> Option<String> {
    if builtin.needs_root_ca {
        let ca = setup.root_ca.as_ref()?;
        return Some(serde_json::json!({"caCrt": ca}).to_string());
    }
    Some(configured(
        builtin.configuration,
        setup.node_monitor_grace_period,
        &setup.node_ipam,
    ))
}

/// A built-in's `configuration` with what it declares filled from the flags: a grace
/// period (the node lifecycle controller's) from --node-monitor-grace-period, cluster
/// CIDRs (the node IPAM controller's) from --cluster-cidr and the mask sizes.
fn configured(configuration: &str, grace_period: u64, node_ipam: &NodeIpamFlags) -> String {
    let Ok(mut value) = serde_json::from_str::<serde_json::Value>(configuration) else {
        return configuration.to_owned();
    };
    let Some(object) = value.as_object_mut() else {
        return configuration.to_owned();
    };
    if let Some(grace) = object.get_mut("gracePeriodSeconds") {
        *grace = grace_period.into();
    }
    if object.contains_key("clusterCIDRs") {
        node_ipam.fill(object);
    }
    value.to_string()
}

/// `builtins` with the autoscaler (`horizontalpodautoscaling`) configured to sync
/// every `period` (`--horizontal-pod-autoscaler-sync-period`). The built-ins are
/// static: a period other than the one bundled makes one copy, kept for the life of
/// the process.
pub fn with_hpa_sync_period(
    builtins: Vec<&'static Builtin>,
    period: Duration,
) -> Vec<&'static Builtin> {
    builtins
        .into_iter()
        .map(|b| {
            let Ok(mut configuration) = serde_json::from_str::<serde_json::Value>(b.configuration)
            else {
                return b;
            };
            let Some(bundled) = configuration.get_mut("syncPeriodSeconds") else {
                return b;
            };
            let seconds = serde_json::Value::from(period.as_secs_f64());
            if bundled.as_f64() == seconds.as_f64() {
                return b;
            }
            *bundled = seconds;
            let configuration: &'static str = Box::leak(configuration.to_string().into_boxed_str());
            &*Box::leak(Box::new(Builtin {
                configuration,
                ..*b
            }))
        })
        .collect()
}

/// Starts the setup's built-in controllers; each that cannot start is named and left
/// out.
pub async fn start_controllers(
    setup: &ControllerSetup,
    manager: &Manager,
    client: &kube::Client,
    stopped: &Shutdown,
) -> Vec<Running> {
    let mut running = Vec::new();
    for builtin in &setup.builtins {
        if builtin_configuration(setup, builtin).is_none() {
            info!(
                controller = builtin.name,
                "no cluster CA known: not started"
            );
            continue;
        }
        match start_builtin(setup, manager, client, builtin, stopped).await {
            Ok(r) => running.push(r),
            Err(e) => {
                warn!(controller = builtin.name, error = %format!("{e:#}"), "the controller cannot start; the others run");
            }
        }
    }
    running
}

/// Starts one built-in controller, as its own ServiceAccount.
pub async fn start_builtin(
    setup: &ControllerSetup,
    manager: &Manager,
    client: &kube::Client,
    builtin: &Builtin,
    stopped: &Shutdown,
) -> anyhow::Result<Running> {
    let mut config = builtin.config();
    config.spec.configuration =
        builtin_configuration(setup, builtin).context("find the cluster CA it needs")?;
    let writer = setup
        .credentials
        .client(client, builtin.account(), stopped.clone())
        .await?;
    let events = EventRecorder::new(writer.clone(), builtin.identity, &host_name());
    manager.start(config, writer, events, stopped.clone()).await
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
            controllers: None,
            scheduler: None,
        }
    }
}

/// The settings `trellis up` shares with `trellis scheduler`.
#[derive(Clone, Debug, Args)]
pub struct SchedulerFlags {
    /// The share of nodes a cycle looks for feasible ones among, as kube-scheduler's
    /// `percentageOfNodesToScore`: 0 for its adaptive default (50 − nodes/125 %,
    /// at least 5 %, at least 100 nodes).
    #[arg(long, default_value_t = 0, value_name = "PERCENT")]
    pub percentage_of_nodes_to_score: u32,

    /// The back-off of a pod that failed to schedule, doubled at each failure...
    #[arg(long, default_value = "1", value_name = "SECONDS", value_parser = seconds)]
    pub pod_initial_backoff: Duration,

    /// ... up to this.
    #[arg(long, default_value = "10", value_name = "SECONDS", value_parser = seconds)]
    pub pod_max_backoff: Duration,

    /// How long an unschedulable pod waits for a cluster event before it is tried
    /// again anyway.
    #[arg(long, default_value = "300", value_name = "SECONDS", value_parser = seconds)]
    pub pod_unschedulable_timeout: Duration,
}

/// The node IPAM controller's settings, as kube-controller-manager's flags (and k3s'
/// defaults).
#[derive(Clone, Debug, Args)]
pub struct NodeIpamFlags {
    /// Whether Nodes get a range of the cluster CIDR for their pods (`spec.podCIDR`):
    /// `false` leaves the `nodeipam` controller out.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub allocate_node_cidrs: bool,

    /// The ranges pods' addresses come from: one, or one per family (comma-separated)
    /// in a dual-stack cluster.
    #[arg(
        long,
        default_value = "10.42.0.0/16",
        value_delimiter = ',',
        value_name = "CIDR"
    )]
    pub cluster_cidr: Vec<String>,

    /// The prefix length of each Node's range: 24 for IPv4 and 64 for IPv6 when not
    /// given.
    #[arg(long, value_name = "BITS")]
    pub node_cidr_mask_size: Option<u8>,

    /// In a dual-stack cluster, the prefix length of each Node's IPv6 range (64 when
    /// not given).
    #[arg(long, value_name = "BITS")]
    pub node_cidr_mask_size_ipv6: Option<u8>,
}

impl NodeIpamFlags {
    /// `builtins` without those that allocate Nodes' ranges (their configuration
    /// declares `clusterCIDRs`) when `--allocate-node-cidrs=false`.
    pub fn select(&self, builtins: Vec<&'static Builtin>) -> Vec<&'static Builtin> {
        builtins
            .into_iter()
            .filter(|b| self.allocate_node_cidrs || !allocates_node_cidrs(b))
            .collect()
    }

    /// Puts the flags' ranges and mask sizes in a configuration that declares
    /// `clusterCIDRs`; an unset mask size leaves the controller's default for the family.
    fn fill(&self, object: &mut serde_json::Map<String, serde_json::Value>) {
        object.insert("clusterCIDRs".into(), self.cluster_cidr.clone().into());
        for (key, value) in [
            ("nodeCIDRMaskSize", self.node_cidr_mask_size),
            ("nodeCIDRMaskSizeIPv6", self.node_cidr_mask_size_ipv6),
        ] {
            match value {
                Some(bits) => object.insert(key.into(), bits.into()),
                None => object.remove(key),
            };
        }
    }
}

impl Default for NodeIpamFlags {
    /// As the flags' defaults.
    fn default() -> Self {
        Self {
            allocate_node_cidrs: true,
            cluster_cidr: vec!["10.42.0.0/16".into()],
            node_cidr_mask_size: None,
            node_cidr_mask_size_ipv6: None,
        }
    }
}

/// Whether a built-in allocates Nodes' ranges: its configuration declares `clusterCIDRs`.
fn allocates_node_cidrs(builtin: &Builtin) -> bool {
    serde_json::from_str::<serde_json::Value>(builtin.configuration)
        .is_ok_and(|c| c.get("clusterCIDRs").is_some())
}

/// What the scheduler runs with.
#[derive(Clone)]
pub struct SchedulerSetup {
    pub plugins: Arc<PluginHost>,
    pub flags: SchedulerFlags,
    pub metrics: trellis_scheduler::SchedulerMetrics,
}

impl std::fmt::Debug for SchedulerSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulerSetup")
            .field("flags", &self.flags)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        node_ipam: NodeIpamFlags,
    }

    fn flags(args: &[&str]) -> NodeIpamFlags {
        Flags::parse_from(std::iter::once("trellis").chain(args.iter().copied())).node_ipam
    }

    fn apply(args: &[&str]) -> Vec<&'static Builtin> {
        flags(args).select(trellis_controllers::bundled::select("*").unwrap())
    }

    /// The configuration each built-in runs with under `args`, by name.
    fn configurations(args: &[&str]) -> Vec<(&'static str, serde_json::Value)> {
        let flags = flags(args);
        apply(args)
            .into_iter()
            .map(|b| {
                let c = configured(b.configuration, 50, &flags);
                (b.name, serde_json::from_str(&c).unwrap())
            })
            .collect()
    }

    fn node_ipam(
        configurations: &[(&'static str, serde_json::Value)],
    ) -> Option<serde_json::Value> {
        configurations
            .iter()
            .find(|(name, _)| *name == "nodeipam")
            .map(|(_, c)| c.clone())
    }

    #[test]
    fn the_node_ipam_controller_takes_the_cluster_cidr_flags() {
        assert_eq!(
            node_ipam(&configurations(&[])),
            Some(serde_json::json!({"clusterCIDRs": ["10.42.0.0/16"]}))
        );
        assert_eq!(
            node_ipam(&configurations(&[
                "--cluster-cidr",
                "10.50.0.0/16,fd00:50::/56",
                "--node-cidr-mask-size",
                "25",
                "--node-cidr-mask-size-ipv6",
                "64"
            ])),
            Some(
                serde_json::json!({"clusterCIDRs": ["10.50.0.0/16", "fd00:50::/56"],
                "nodeCIDRMaskSize": 25, "nodeCIDRMaskSizeIPv6": 64})
            )
        );
        // The others keep theirs.
        let all = configurations(&["--cluster-cidr", "10.50.0.0/16"]);
        let lifecycle = all
            .iter()
            .find(|(name, _)| *name == "nodelifecycle")
            .unwrap();
        assert_eq!(lifecycle.1, serde_json::json!({"gracePeriodSeconds": 50}));
    }

    #[test]
    fn allocate_node_cidrs_false_leaves_the_node_ipam_controller_out() {
        let builtins = apply(&["--allocate-node-cidrs", "false"]);
        assert!(!builtins.iter().any(|b| b.name == "nodeipam"));
        assert!(builtins.iter().any(|b| b.name == "nodelifecycle"));
    }

    #[test]
    fn the_autoscaler_syncs_as_often_as_its_flag_says() {
        let period = |builtins: &[&'static Builtin]| {
            let hpa = builtins
                .iter()
                .find(|b| b.name == "horizontalpodautoscaling")
                .unwrap();
            serde_json::from_str::<serde_json::Value>(hpa.configuration).unwrap()
                ["syncPeriodSeconds"]
                .clone()
        };
        let all = || trellis_controllers::bundled::select("*").unwrap();
        let bundled = with_hpa_sync_period(all(), Duration::from_secs(15));
        assert_eq!(period(&bundled), 15);
        let fast = with_hpa_sync_period(all(), Duration::from_millis(500));
        assert_eq!(period(&fast), 0.5);
        // The others are the bundled ones themselves.
        assert!(
            fast.iter()
                .zip(all())
                .filter(|(a, _)| a.name != "horizontalpodautoscaling")
                .all(|(a, b)| std::ptr::eq(*a, b))
        );
    }
}
