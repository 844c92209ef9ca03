//! `trellis server` and `trellis up`: the control plane.
//!
//! Both open the store (an embedded redb file in the data directory, or etcd with
//! `--store etcd://HOST:PORT`), keep its history window with the compactor, and serve
//! the API over HTTPS until Ctrl-C or SIGTERM, then stop gracefully and close the
//! store. `up` is the embedded default: it also runs the controllers and the
//! scheduler in this process, over the in-process transport and each as its own
//! Kubernetes user (`crate::components`), and a local node (`crate::node`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use trellis_api::Shutdown;

use anyhow::{Context as _, bail};
use clap::Args;
use tracing::info;
use trellis_store::{
    Compactor, CompactorConfig, EtcdConfig, EtcdStore, RedbConfig, RedbStore, Store,
};

use crate::flags::seconds;

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Where Trellis keeps its state: the store file, the cluster CA and credentials,
    /// `admin.kubeconfig`.
    #[arg(long, value_name = "DIR")]
    data_dir: PathBuf,

    /// The address the API server listens on.
    #[arg(long, default_value = "127.0.0.1:6443", value_name = "ADDR:PORT")]
    listen: std::net::SocketAddr,

    /// Extra DNS names or IP addresses for the serving certificate.
    #[arg(long = "tls-san", value_name = "NAME")]
    tls_sans: Vec<String>,

    /// Where pods and other API servers reach this one: the address the `kubernetes`
    /// Service's endpoints list. Default: the listen address, unless it is loopback or
    /// unspecified; then the node's address (`--node-address`, else the default route's
    /// source address). `trellis up` with a local node also serves the API there when
    /// it listens on loopback, so that its pods reach it through the Service.
    #[arg(long, value_name = "IP")]
    advertise_address: Option<std::net::IpAddr>,

    /// The `kube-dns` Service's ClusterIP, kept by the API server in `kube-system`;
    /// empty: no `kube-dns` Service (a cluster that brings its own DNS).
    #[arg(long, default_value = "10.43.0.10", value_name = "IP")]
    cluster_dns_service_ip: String,

    /// `redb` (embedded, in the data directory) or `etcd://HOST:PORT[,HOST:PORT]`.
    #[arg(long, default_value = "redb")]
    store: String,

    /// History kept for watches and lists at a past revision, in seconds.
    #[arg(long, default_value_t = 300)]
    history_window: u64,

    /// Changes the API server keeps in memory for watches to resume from; older
    /// resumes are served by a watch on the store.
    #[arg(long, default_value_t = trellis_apiserver::Config::DEFAULT_WATCH_CACHE_EVENTS, value_name = "EVENTS")]
    watch_cache_events: usize,

    /// MiB of store pages the embedded store keeps in memory; reads past it go to the
    /// file through the operating system's cache.
    #[arg(long, default_value_t = trellis_store::DEFAULT_CACHE_BYTES >> 20, value_name = "MIB")]
    store_cache_mib: usize,

    /// Plugins to run from files: `NAME.yaml` (a Plugin object or its spec) beside
    /// `NAME.wasm`; added, changed and removed files take effect while running.
    /// Defaults to `DATA_DIR/plugins`.
    #[arg(long, value_name = "DIR")]
    plugin_dir: Option<PathBuf>,

    /// Read-only requests served at once before more get 429 (watches and
    /// `system:masters` are not counted); 0 for no limit.
    #[arg(long, default_value_t = 400, value_name = "N")]
    max_requests_inflight: usize,

    /// Writes served at once before more get 429; 0 for no limit.
    #[arg(long, default_value_t = 200, value_name = "N")]
    max_mutating_requests_inflight: usize,

    /// How long a request other than a watch may take before it gets 504, in seconds.
    #[arg(long, default_value_t = 60, value_name = "SECONDS")]
    request_timeout: u64,

    /// How long a new connection may take to send its first request's headers after
    /// its TLS handshake (and an HTTP/1.1 connection each next request's) before it is
    /// closed, in seconds (Go's `ReadHeaderTimeout`, 32 s in kube-apiserver).
    #[arg(long, default_value = "32", value_name = "SECONDS", value_parser = seconds)]
    header_read_timeout: Duration,

    /// How long a connection may stay open with no request in flight, in seconds.
    #[arg(long, default_value = "90", value_name = "SECONDS", value_parser = seconds)]
    idle_timeout: Duration,

    /// The longest ServiceAccount token a TokenRequest is given, in seconds; longer
    /// requests are cut to it. Without it, up to 2^32 s as Kubernetes allows.
    #[arg(long, value_name = "SECONDS")]
    service_account_max_token_expiration: Option<u64>,

    /// How often a watch that allows bookmarks gets one, in seconds.
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    bookmark_interval: u64,

    /// The range Services' ClusterIPs are allocated from (IPv4). Its first addresses
    /// (up to 256) are taken only when asked for or once the rest is full.
    #[arg(long, default_value = "10.43.0.0/16", value_name = "CIDR")]
    service_cluster_ip_range: trellis_apiserver::registry::service::ServiceCidr,

    /// The range NodePorts are allocated from, inclusive.
    #[arg(long, default_value = "30000-32767", value_name = "FIRST-LAST")]
    service_node_port_range: trellis_apiserver::registry::service::PortRange,

    /// Pod Security admission's cluster defaults and exemptions: a Kubernetes
    /// `PodSecurityConfiguration` file (`pod-security.admission.config.k8s.io/v1`).
    /// Without it: enforce `baseline`, warn and audit `restricted`, `kube-system`
    /// exempt.
    #[arg(long, value_name = "FILE")]
    pod_security_config: Option<PathBuf>,

    /// kube-apiserver's `AdmissionConfiguration` file; its `PodSecurity` plugin entry
    /// (inline or by `path`) configures Pod Security as `--pod-security-config` does.
    #[arg(long, value_name = "FILE", conflicts_with = "pod_security_config")]
    admission_control_config_file: Option<PathBuf>,

    /// The longest certificate signed for a CertificateSigningRequest, and what one
    /// that names no duration gets, in seconds (kube-controller-manager's
    /// `--cluster-signing-duration`; one year).
    #[arg(long, default_value_t = 365 * 24 * 3600, value_name = "SECONDS")]
    csr_signing_duration: u64,

    /// The shortest certificate signed for a CertificateSigningRequest, in seconds
    /// (600, as Kubernetes).
    #[arg(long, default_value_t = 600, value_name = "SECONDS")]
    csr_min_duration: u64,

    /// `trellis up` only: where the in-process components' `/metrics` and `/healthz`
    /// are served over plain HTTP (port 0 picks one; empty serves none).
    #[arg(long, default_value = "127.0.0.1:10257", value_name = "ADDR:PORT")]
    metrics_bind_address: String,

    /// `trellis up` only: the built-in controllers to run (`*` for all, `-NAME` to
    /// leave one out, as kube-controller-manager's flag).
    #[arg(long, default_value = "*", value_name = "LIST")]
    controllers: String,

    /// `trellis server` only: whether the server empties and removes deleted
    /// namespaces itself. `false` leaves it to a controller manager's namespace
    /// controller (`trellis up` runs that one, and never the server's).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    namespace_controller: bool,

    /// `trellis up` only: how long a node may go unheard before it is Ready=Unknown.
    #[arg(long, default_value_t = 50, value_name = "SECONDS")]
    node_monitor_grace_period: u64,

    /// `trellis up` only: the node IPAM controller's cluster CIDR and node range size.
    #[command(flatten)]
    node_ipam: crate::setup::NodeIpamFlags,

    /// `trellis up` only: how often each HorizontalPodAutoscaler is synced, in seconds.
    #[arg(long, default_value = "15", value_name = "SECONDS", value_parser = crate::flags::seconds)]
    horizontal_pod_autoscaler_sync_period: Duration,

    /// `trellis up` only: the scheduler's settings.
    #[command(flatten)]
    scheduler: crate::setup::SchedulerFlags,

    /// `trellis up` only: whether a node runs in this process (its agent and the
    /// built-in runtime, with the `process` handler on).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    local_node: bool,

    /// `trellis up` only: the local node's settings.
    #[command(flatten)]
    node: crate::node::NodeFlags,

    /// `trellis up` only: hollow nodes (simulated, on fake runtimes) run in this
    /// process besides the local node.
    #[arg(long, default_value_t = 0, value_name = "N")]
    hollow_nodes: usize,

    /// `trellis up` only: the hollow nodes' settings.
    #[command(flatten)]
    hollow: crate::hollow::HollowFlags,

    /// `trellis up` only: whether a metrics server runs in this process, registered as
    /// the APIService `v1beta1.metrics.k8s.io` (`kubectl top`, autoscalers).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    metrics_server: bool,

    /// `trellis up` only: how often the metrics server reads the nodes' usage, in
    /// seconds.
    #[arg(long, default_value = "15", value_name = "SECONDS", value_parser = seconds)]
    metric_resolution: Duration,

    /// How often the aggregation layer checks every APIService's backend besides on
    /// changes of it, its Service or its Endpoints, in seconds.
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = seconds)]
    apiservice_check_interval: Duration,
}

/// What `--store` names.
#[derive(Debug, PartialEq, Eq)]
pub enum StoreSpec {
    Redb,
    Etcd(Vec<String>),
}

impl std::str::FromStr for StoreSpec {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        if s == "redb" {
            return Ok(StoreSpec::Redb);
        }
        let Some(hosts) = s.strip_prefix("etcd://") else {
            bail!("parse --store {s:?}: expected `redb` or `etcd://HOST:PORT[,HOST:PORT]`");
        };
        let endpoints: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("http://{h}"))
            .collect();
        if endpoints.is_empty() {
            bail!("parse --store {s:?}: no etcd endpoint given");
        }
        Ok(StoreSpec::Etcd(endpoints))
    }
}

pub async fn run(
    args: UpArgs,
    components: bool,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let spec: StoreSpec = args.store.parse()?;
    // Zero would close every connection before its first request.
    if args.header_read_timeout.is_zero() || args.idle_timeout.is_zero() {
        bail!("--header-read-timeout and --idle-timeout must be above 0");
    }
    trellis_apiserver::server::private_data_dir(&args.data_dir)?;
    let (store, redb): (Arc<dyn Store>, Option<Arc<RedbStore>>) = match spec {
        StoreSpec::Redb => {
            let path = args.data_dir.join("store.redb");
            let redb = Arc::new(
                RedbStore::open(RedbConfig {
                    cache_bytes: args.store_cache_mib << 20,
                    ..RedbConfig::new(&path)
                })
                .with_context(|| format!("open the store {}", path.display()))?,
            );
            (redb.clone(), Some(redb))
        }
        StoreSpec::Etcd(endpoints) => {
            let joined = endpoints.join(",");
            let etcd = EtcdStore::connect(EtcdConfig::new(endpoints))
                .await
                .with_context(|| format!("connect to etcd at {joined}"))?;
            (Arc::new(etcd), None)
        }
    };
    let revision = store
        .current_revision()
        .await
        .context("read the store revision")?;
    info!(data_dir = %args.data_dir.display(), store = %args.store, revision, "store ready");

    let (stop, stopped) = Shutdown::new();
    let stopped_signal = |rx: Shutdown| async move {
        rx.wait().await;
    };
    let builtins = crate::setup::with_hpa_sync_period(
        args.node_ipam
            .select(trellis_controllers::bundled::select(&args.controllers)?),
        args.horizontal_pod_autoscaler_sync_period,
    );
    let mut server_config = trellis_apiserver::Config::new(&args.data_dir);
    server_config.listen = args.listen;
    // In `trellis up` the controller manager's namespace controller does it, if run.
    server_config.namespace_controller = if components {
        !builtins.iter().any(|b| b.name == "namespace")
    } else {
        args.namespace_controller
    };
    server_config.builtin_plugins = crate::plugin_controllers::builtin_entries();
    server_config.signing = trellis_apiserver::certificates::Signing {
        max_duration: Duration::from_secs(args.csr_signing_duration),
        min_duration: Duration::from_secs(args.csr_min_duration.min(args.csr_signing_duration)),
    };
    server_config.tls_sans = args.tls_sans.clone();
    server_config.cluster_dns_service_ip = match args.cluster_dns_service_ip.trim() {
        "" => None,
        ip => Some(ip.parse().with_context(|| {
            format!("parse --cluster-dns-service-ip {ip:?}: not an IP address")
        })?),
    };
    server_config.cluster_domain = args.node.cluster_domain.clone();
    let advertise = args.advertise_address.unwrap_or_else(|| {
        let listen = args.listen.ip();
        match args.node.node_address {
            Some(node) if listen.is_loopback() || listen.is_unspecified() => node,
            _ => trellis_apiserver::service_reconciler::default_advertise_address(listen),
        }
    });
    server_config.advertise_address = Some(advertise);
    // Pods on a network of their own cannot reach the node's loopback (nor can a
    // Service's DNAT send them there): the local node's address is served too. The
    // pod bridge's gateway address would do as well, but the bridge only exists once
    // the first pod has started, and hostNetwork pods and other nodes reach the node's
    // address alike.
    if components
        && args.local_node
        && args.listen.ip().is_loopback()
        && !advertise.is_loopback()
        && !advertise.is_unspecified()
    {
        server_config.also_listen = vec![std::net::SocketAddr::new(advertise, 0)];
    }
    server_config.watch_cache_events = args.watch_cache_events;
    server_config.settings = trellis_apiserver::state::Settings {
        max_requests_inflight: args.max_requests_inflight,
        max_mutating_requests_inflight: args.max_mutating_requests_inflight,
        request_timeout: Duration::from_secs(args.request_timeout),
        header_read_timeout: args.header_read_timeout,
        idle_timeout: args.idle_timeout,
        max_token_expiration: args
            .service_account_max_token_expiration
            .map(Duration::from_secs),
        bookmark_interval: Duration::from_secs(args.bookmark_interval.max(1)),
        service_cluster_ip_range: args.service_cluster_ip_range,
        service_node_port_range: args.service_node_port_range,
        ..server_config.settings
    };
    if let Some(path) = args
        .pod_security_config
        .as_ref()
        .or(args.admission_control_config_file.as_ref())
    {
        server_config.pod_security = trellis_apiserver::admission::pod_security::Config::load(path)
            .map_err(anyhow::Error::msg)
            .context("read the Pod Security configuration")?;
    }
    let plugin_dir = args
        .plugin_dir
        .clone()
        .unwrap_or_else(|| args.data_dir.join("plugins"));
    std::fs::create_dir_all(&plugin_dir)
        .with_context(|| format!("create the plugins directory {}", plugin_dir.display()))?;
    info!(plugin_dir = %plugin_dir.display(), "following the plugins directory");
    server_config.plugin_dir = Some(plugin_dir);
    server_config.aggregator.check_interval = args.apiservice_check_interval;
    let server = trellis_apiserver::start(
        server_config,
        store.clone(),
        stopped_signal(stopped.clone()),
    )
    .await
    .context("start the API server")?;
    // The first thing to look at: the node `up` runs, or a bare server's namespaces.
    let first = if components && args.local_node {
        "get nodes"
    } else {
        "get namespaces"
    };
    println!(
        "Trellis is serving at {}\n  kubectl --kubeconfig {} {first}",
        server.url,
        server.kubeconfig.display()
    );

    let config = CompactorConfig {
        window: Duration::from_secs(args.history_window),
        ..CompactorConfig::default()
    };
    let compactor =
        tokio::spawn(Compactor::new(config).run(store, stopped_signal(stopped.clone())));
    let running = if components {
        let in_process = trellis_client::InProcess::new(server.in_process.clone());
        let mut shared = crate::setup::Shared::new();
        shared.controllers = Some(crate::setup::ControllerSetup {
            plugins: trellis_plugin_host::PluginHost::new(trellis_plugin_host::HostConfig {
                cache_dir: Some(args.data_dir.join("plugin-cache")),
                ..trellis_plugin_host::HostConfig::default()
            })?,
            credentials: crate::setup::Credentials::InProcess(in_process.clone()),
            modules_dir: args.data_dir.join("plugin-cache").join("modules"),
            running: Default::default(),
            root_ca: std::fs::read_to_string(args.data_dir.join("pki").join("ca.crt")).ok(),
            node_monitor_grace_period: args.node_monitor_grace_period,
            plugin_status_interval: Duration::from_secs(10),
            node_ipam: args.node_ipam.clone(),
            builtins,
        });
        shared.scheduler = Some(crate::setup::SchedulerSetup {
            plugins: shared
                .controllers
                .as_ref()
                .map(|c| c.plugins.clone())
                .context("the controllers' plugin host")?,
            flags: args.scheduler.clone(),
            metrics: Default::default(),
        });
        if let Some(addr) = crate::components::metrics_address(&args.metrics_bind_address)
            .map_err(|e| anyhow::anyhow!("parse --metrics-bind-address {e}"))?
        {
            let stopped = stopped.clone();
            shared
                .metrics
                .serve(addr, async move {
                    stopped.wait().await;
                })
                .await?;
        }
        let mut running =
            crate::components::start_in_process(&in_process, &shared, stopped.clone());
        if args.hollow_nodes > 0 {
            let config = args
                .hollow
                .config(args.hollow_nodes, args.data_dir.join("hollow"));
            let nodes = crate::hollow::start_in_process(
                &in_process,
                &shared.informers,
                config,
                stopped.clone(),
            );
            running.push(tokio::spawn(async move {
                nodes.wait().await.context("run the hollow nodes")
            }));
        }
        if args.metrics_server {
            let config = crate::metrics_server::Config {
                metric_resolution: args.metric_resolution,
                listen: std::net::SocketAddr::new(advertise, 0),
                ..Default::default()
            };
            let in_process = in_process.clone();
            let stopped = stopped.clone();
            running.push(tokio::spawn(async move {
                crate::metrics_server::start_in_process(&in_process, config, stopped)
                    .await
                    .context("start the metrics server")?
                    .wait()
                    .await
            }));
        }
        if args.local_node {
            let name = args
                .node
                .node_name
                .clone()
                .unwrap_or_else(crate::setup::host_name);
            let client = in_process.client(trellis_client::identity::node(&name));
            let informers = shared.informers.clone();
            let data_dir = args.data_dir.clone();
            let mut flags = args.node.clone();
            // Pod traffic within the CIDR the node IPAM controller hands out is not
            // masqueraded.
            if flags.pod_network_cluster_cidr.is_empty() && args.node_ipam.allocate_node_cidrs {
                flags.pod_network_cluster_cidr = args.node_ipam.cluster_cidr.clone();
            }
            // The node's DNS server answers on the kube-dns ClusterIP this server keeps
            // (none without one), beside the node-local address.
            flags
                .node_local_dns_address
                .retain(|ip| *ip != trellis_agent::services::KUBE_DNS_IP);
            if let Ok(ip) = args.cluster_dns_service_ip.trim().parse()
                && !flags.node_local_dns_address.contains(&ip)
            {
                flags.node_local_dns_address.push(ip);
            }
            flags.service_cidrs = vec![args.service_cluster_ip_range.to_string()];
            let stopped = stopped.clone();
            running.push(tokio::spawn(async move {
                let ca = std::fs::read_to_string(data_dir.join("pki").join("ca.crt")).ok();
                crate::node::run_local(client, informers, &data_dir, true, ca, &flags, stopped)
                    .await
                    .context("run the local node")
            }));
        }
        running
    } else {
        Vec::new()
    };
    shutdown.await;
    info!("shutting down");
    stop.stop();
    for component in running {
        match component.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %format!("{e:#}"), "a component failed"),
            Err(e) => tracing::warn!(error = %e, "a component's task failed"),
        }
    }
    server.stop().await.context("stop the API server")?;
    compactor.await.context("join the compactor")?;
    if let Some(redb) = redb {
        redb.close().await.context("close the store")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_store_specs() {
        assert_eq!("redb".parse::<StoreSpec>().unwrap(), StoreSpec::Redb);
        assert_eq!(
            "etcd://127.0.0.1:2379,10.0.0.2:2379"
                .parse::<StoreSpec>()
                .unwrap(),
            StoreSpec::Etcd(vec![
                "http://127.0.0.1:2379".into(),
                "http://10.0.0.2:2379".into()
            ])
        );
        let err = "sqlite".parse::<StoreSpec>().unwrap_err().to_string();
        assert!(err.contains("expected `redb` or `etcd://"), "{err}");
        assert!("etcd://".parse::<StoreSpec>().is_err());
    }
}
