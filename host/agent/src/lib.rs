//! Trellis' node agent (its kubelet): registers its Node and keeps its Lease, runs the
//! pods bound to it through a CRI runtime, and reports their status and events.
//!
//! - [`node`]: the Node object (capacity, addresses, nodeInfo, runtime handlers,
//!   conditions) and the Lease in `kube-node-lease`.
//! - [`pods`]: the pods bound to this node, one worker per pod; a relist of the
//!   runtime's containers wakes the worker of a pod whose container changed (the
//!   kubelet's PLEG).
//! - [`worker`]: one pod's lifecycle as a state machine — sandbox, init containers in
//!   order, containers, restarts with back-off, termination: it carries out what
//!   [`plan`] decides the pod needs at each sync (the kubelet's `computePodActions`).
//! - [`sandbox`], [`container`], [`images`]: the CRI side of a pod — its sandbox's
//!   configuration, its containers' configurations and what the runtime says of them,
//!   image pulls with the pod's pull secrets; [`labels`]: the labels and annotations
//!   they carry.
//! - [`cgroups`]: the pods' cgroups, a tree per QoS class (`kubepods/burstable/pod<uid>`)
//!   limited as the kubelet limits them; [`container`] also gives each container the
//!   kubelet's resources and security context.
//! - [`status`]: the pod status Kubernetes reports, from the runtime's containers.
//! - [`spec`]: what a container gets: its environment, mounts and volumes.
//! - [`probes`]: startup, liveness and readiness probes.
//! - [`pressure`], [`eviction`]: the node's pressure signals and conditions, and the
//!   eviction manager that evicts pods while a threshold is met.
//! - [`routes`]: with the pod network, the routes to the other nodes' pods (host-gw
//!   or VXLAN), IP forwarding and the masquerade of pod traffic leaving the cluster.
//! - [`services`]: the service proxy (`trellis-proxy`) and the node-local cluster DNS
//!   server (`trellis-dns`) on the dummy link `trellis-dns`, which pods'
//!   `resolv.conf` names.
//! - [`storage`]: local-path volumes: the Node's root annotation; deleted volumes'
//!   directories removed.
//! - [`server`]: the HTTPS server the API server calls: container logs (read by
//!   [`logs`] from the files under [`paths`]), and [`exec`] (`kubectl exec` over a
//!   WebSocket).
//!
//! - [`hollow`]: many simulated nodes in one process (Kubernetes' kubemark): this
//!   agent on fake runtimes, sharing one informer of pods.
//!
//! The agent speaks CRI to any runtime: Trellis' own (`trellis-runtime`, with the
//! `wasmtime` and `process` handlers) or containerd's.

pub mod bootstrap;
pub mod cgroups;
pub mod container;
pub mod dns;
pub mod eviction;
pub mod exec;
pub mod gc;
pub mod hollow;
pub mod hosts;
mod http;
pub mod images;
pub mod labels;
pub mod logs;
pub mod node;
pub mod paths;
pub mod plan;
pub mod pods;
pub mod port_forward;
pub mod pressure;
pub mod probes;
pub mod routes;
pub mod sandbox;
pub mod server;
pub mod service_env;
pub mod services;
mod spdy;
pub mod spec;
pub mod stats;
pub mod status;
pub mod storage;
pub mod tokens;
pub mod worker;

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use trellis_api::Shutdown;
use trellis_client::events::EventRecorder;
use trellis_client::informer::SharedInformers;

/// The agent's settings; every delay is one so tests can shorten it.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub node_name: String,
    /// The node's address: its InternalIP, and the IP of its hostNetwork pods (of every
    /// pod without `pod_network`).
    pub node_ip: IpAddr,
    /// Whether pods that are not hostNetwork get a network of their own: the agent
    /// gives its Node's `spec.podCIDR` to the runtime, waits until the runtime's network
    /// is ready (that pod CIDR, or an operator's network), asks for sandboxes
    /// on the pod's network, and reports the IPs the runtime gave them. Off: every pod
    /// is on the node's network and reports the node's IP.
    pub pod_network: bool,
    /// With `pod_network`, how pod traffic reaches other nodes: a route via the other
    /// node's InternalIP (`host-gw`, nodes on a shared link), VXLAN, or each as fits
    /// (`auto`).
    pub pod_network_backend: routes::Backend,
    /// With `pod_network`, how often the runtime is asked whether its network is
    /// ready (`Status`'s `NetworkReady`) when the pod CIDR did not change: an
    /// operator's network (a CNI daemonset writing its conflist) comes at any time
    /// (the kubelet: 5 s).
    pub network_check: Duration,
    /// The cluster's pod CIDRs (the controller manager's `--cluster-cidr`): pod traffic
    /// to elsewhere is masqueraded. Empty: the podCIDRs of the Nodes there are.
    pub cluster_cidrs: Vec<String>,
    /// The cluster's Service CIDRs (the API server's `--service-cluster-ip-range`): the
    /// proxy drops connections to addresses in them that no Service holds, and the DNS
    /// server answers their reverse names. Empty: the proxy drops nothing, the DNS
    /// server takes the default range.
    pub service_cidrs: Vec<String>,
    /// How often the routes are checked against the Nodes when no Node changed (a link
    /// that came up, a route removed by hand).
    pub route_resync: Duration,
    /// Where pods' volumes and logs live (`pods/UID/…`).
    pub root: PathBuf,
    /// Extra labels of the Node.
    pub labels: Vec<(String, String)>,
    /// How often the Lease is renewed (Kubernetes: 10 s).
    pub lease_renew: Duration,
    /// How much later than `lease_renew` the first renewal comes: many nodes of one
    /// process are given different offsets so their renewals do not come together.
    pub lease_offset: Duration,
    /// The Lease's duration.
    pub lease_duration: Duration,
    /// How often the Node's status is written when nothing changed (Kubernetes: 5 min).
    pub status_report: Duration,
    /// How often the runtime's containers are listed to notice exits.
    pub relist_period: Duration,
    /// The first restart back-off of a crashed container, doubled at each crash...
    pub backoff_base: Duration,
    /// ... up to this; reset when a container ran twice this long.
    pub backoff_max: Duration,
    /// The RuntimeClass handler of pods that name no RuntimeClass; "" is the
    /// runtime's own default (containerd's `default_runtime_name`), as in CRI.
    pub default_handler: String,
    /// Handlers this node's runtime serves: empty asks its `Status`, and a runtime
    /// that lists none there serves `default_handler`.
    pub handlers: Vec<String>,
    /// Pods' CPU and memory for the Node's capacity; `None`: the machine's.
    pub capacity: Option<(u64, u64)>,
    /// Where logs are served (HTTPS); port 0 picks one, which the Node's status tells.
    pub port: u16,
    /// The cluster CA, PEM: who may read logs is proven by a certificate it signed.
    /// `None` serves no logs.
    pub client_ca_pem: Option<String>,
    /// The thresholds of the pressure conditions (the kubelet's `--eviction-hard`);
    /// `None` reports no pressure (hollow nodes, whose machine is not theirs).
    pub eviction_hard: Option<pressure::Thresholds>,
    /// How often the pressure signals are read; a change is written at once.
    pub pressure_check: Duration,
    /// Thresholds that evict pods only once they held for their grace period
    /// (`--eviction-soft`); none by default.
    pub eviction_soft: pressure::Thresholds,
    /// The grace period of each soft threshold (`--eviction-soft-grace-period`); a
    /// signal not named has none.
    pub eviction_soft_grace_period: pressure::GracePeriods,
    /// How long a pressure condition holds after its thresholds stop being met, so
    /// that a node does not flap (`--eviction-pressure-transition-period`, 5 min).
    pub eviction_pressure_transition_period: Duration,
    /// The longest grace period of a pod evicted for a soft threshold, in seconds;
    /// negative: the pod's own (`--eviction-max-pod-grace-period`).
    pub eviction_max_pod_grace_period: i64,
    /// How far above its threshold a met signal must come back before it is no
    /// longer met (`--eviction-minimum-reclaim`).
    pub eviction_minimum_reclaim: pressure::MinimumReclaim,
    /// The cluster's DNS servers, the only nameservers of `ClusterFirst` pods (the
    /// kubelet's `--cluster-dns`); empty: those pods get the node's resolvers, with a
    /// `MissingClusterDNS` warning.
    pub cluster_dns: Vec<IpAddr>,
    /// The cluster's domain, of pods' search domains and FQDNs (`--cluster-domain`).
    pub cluster_domain: String,
    /// The node's resolver configuration, which `Default` pods get (`--resolv-conf`);
    /// `None`: lookups go to the node itself.
    pub resolv_conf: Option<PathBuf>,
    /// Whether pods get a cgroup each, in a tree per QoS class under `cgroup_root`
    /// (the kubelet's `--cgroups-per-qos`; the `trellis` binary's default). Off here:
    /// a library user (a test) gives each node a root of its own.
    pub cgroups_per_qos: bool,
    /// The cgroup `kubepods` is made under (`--cgroup-root`).
    pub cgroup_root: String,
    /// What the node keeps for Kubernetes' own daemons and for the system, out of
    /// what pods may have (`--kube-reserved`, `--system-reserved`).
    pub kube_reserved: node::Reserved,
    pub system_reserved: node::Reserved,
    /// Containers whose pod names no seccomp profile get the runtime's default one
    /// (the kubelet's `--seccomp-default`).
    pub seccomp_default: bool,
    /// Whether the node runs the service proxy (kube-proxy's part: ClusterIPs and
    /// NodePorts in the nftables table `trellis-proxy`). Off here, as `cgroups_per_qos`:
    /// a library user asks for it; the `trellis` binary's default when it can (root,
    /// `nft`). Hollow nodes never run it.
    pub service_proxy: bool,
    /// The proxy's full resync period (kube-proxy's `--iptables-sync-period`, 30 s)...
    pub proxy_sync_period: Duration,
    /// ... and the shortest time between two syncs, which batches changes
    /// (`--iptables-min-sync-period`, 1 s).
    pub proxy_min_sync_interval: Duration,
    /// The addresses the node's own cluster DNS server answers on, on the dummy link
    /// [`services::LINK`] (NodeLocal DNSCache's `-localip`): the node-local address,
    /// then the `kube-dns` ClusterIP, which the proxy then leaves to this node. The
    /// first is `ClusterFirst` pods' nameserver when `cluster_dns` names none. Empty
    /// (here, as `service_proxy`): no server.
    pub node_local_dns: Vec<IpAddr>,
    /// With `node_local_dns` empty, whether the link an earlier agent made is removed
    /// (the binary's `--node-local-dns=false`: a cluster that brings its own DNS wants
    /// the kube-dns ClusterIP routed to it). Off here: a library user (a test) on a
    /// machine that runs a node leaves that node's link alone.
    pub remove_node_local_dns_link: bool,
    /// How much of a projected ServiceAccount token's lifetime passes before it is
    /// asked for again and its file rewritten (the kubelet's token manager: 0.8)...
    pub token_refresh_fraction: f64,
    /// ... or how old it may grow at most before that (the kubelet: 24 h)...
    pub token_max_age: Duration,
    /// ... and how long after a failed request it is asked for again.
    pub token_retry: Duration,
}

impl AgentConfig {
    pub fn new(node_name: &str, node_ip: IpAddr, root: PathBuf) -> Self {
        Self {
            node_name: node_name.to_owned(),
            node_ip,
            pod_network: false,
            pod_network_backend: routes::Backend::Auto,
            cluster_cidrs: Vec::new(),
            service_cidrs: Vec::new(),
            network_check: Duration::from_secs(5),
            route_resync: Duration::from_secs(60),
            root,
            labels: Vec::new(),
            lease_renew: Duration::from_secs(10),
            lease_offset: Duration::ZERO,
            lease_duration: Duration::from_secs(40),
            status_report: Duration::from_secs(300),
            relist_period: Duration::from_secs(1),
            backoff_base: Duration::from_secs(10),
            backoff_max: Duration::from_secs(300),
            default_handler: "wasmtime".into(),
            handlers: Vec::new(),
            capacity: None,
            port: 10250,
            client_ca_pem: None,
            eviction_hard: Some(pressure::Thresholds::default()),
            pressure_check: Duration::from_secs(10),
            eviction_soft: pressure::Thresholds::none(),
            eviction_soft_grace_period: Default::default(),
            eviction_pressure_transition_period: Duration::from_secs(300),
            eviction_max_pod_grace_period: 0,
            eviction_minimum_reclaim: Default::default(),
            cluster_dns: Vec::new(),
            cluster_domain: "cluster.local".into(),
            resolv_conf: Some(PathBuf::from("/etc/resolv.conf")),
            cgroups_per_qos: false,
            cgroup_root: "/".into(),
            kube_reserved: node::Reserved::default(),
            system_reserved: node::Reserved::default(),
            seccomp_default: true,
            service_proxy: false,
            proxy_sync_period: Duration::from_secs(30),
            proxy_min_sync_interval: Duration::from_secs(1),
            node_local_dns: Vec::new(),
            remove_node_local_dns_link: false,
            token_refresh_fraction: 0.8,
            token_max_age: Duration::from_secs(24 * 3600),
            token_retry: Duration::from_secs(10),
        }
    }
}

/// What every part of the agent shares.
pub struct Context {
    pub config: AgentConfig,
    pub client: kube::Client,
    pub cri: trellis_runtime::Client,
    pub events: EventRecorder,
    pub informers: SharedInformers,
    /// The runtime's name, which prefixes container IDs (`trellis://ID`).
    pub runtime_name: String,
    /// The port logs are served on (0 when they are not).
    pub port: std::sync::atomic::AtomicU16,
    /// Whether the runtime can give pods a network of their own, as its `Status`
    /// last said (with `pod_network`): until then pods that need one wait.
    pub network_ready: tokio::sync::watch::Sender<bool>,
    /// The pods' cgroups per QoS class (disabled without `cgroups_per_qos`).
    pub cgroups: cgroups::PodCgroups,
    /// The evictions asked of the pods' workers, and the pressure conditions.
    pub eviction: eviction::Evictions,
    /// The node's cluster DNS server once it serves (its metrics are served at
    /// `/metrics/dns`).
    pub dns: std::sync::OnceLock<trellis_dns::DnsServer>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("node", &self.config.node_name)
            .field("runtime", &self.runtime_name)
            .finish_non_exhaustive()
    }
}

/// What an agent run with [`run_with`] gets besides its configuration: what the
/// agents of hollow nodes change. The default is a real node's.
#[derive(Debug, Default)]
pub struct RunOptions {
    /// The node's pods from an informer shared by the process's nodes
    /// ([`pods::PodDispatch`]); `None`: a watch of the node's own.
    pub pods: Option<pods::NodePods>,
    /// Told once the Node and its Lease are written.
    pub registered: Option<tokio::sync::oneshot::Sender<()>>,
}

/// Runs the agent until `stopped` is given: the Node first (so the scheduler sees
/// it), then its pods.
pub async fn run(
    config: AgentConfig,
    client: kube::Client,
    cri: trellis_runtime::Client,
    informers: SharedInformers,
    stopped: Shutdown,
) -> anyhow::Result<()> {
    run_with(
        config,
        client,
        cri,
        informers,
        RunOptions::default(),
        stopped,
    )
    .await
}

/// [`run`], with `options`.
pub async fn run_with(
    config: AgentConfig,
    client: kube::Client,
    cri: trellis_runtime::Client,
    informers: SharedInformers,
    options: RunOptions,
    stopped: Shutdown,
) -> anyhow::Result<()> {
    let mut config = config;
    // The runtime writes logs and mounts volumes by these paths, from its own working
    // directory (containerd's is `/`).
    config.root = std::path::absolute(&config.root)
        .map_err(|e| anyhow::anyhow!("resolve {}: {e}", config.root.display()))?;
    let mut runtime = cri.runtime.clone();
    let status = runtime
        .status(k8s_cri::v1::StatusRequest { verbose: false })
        .await
        .map_err(|e| anyhow::anyhow!("ask the container runtime for its status: {}", e.message()))?
        .into_inner();
    if config.handlers.is_empty() {
        // "" is a runtime's default handler (containerd 2 lists it so).
        config.handlers = status
            .runtime_handlers
            .iter()
            .map(|h| h.name.clone())
            .collect();
    }
    if config.handlers.is_empty() {
        // Runtimes older than the field (containerd 1.6) list none: they serve at
        // least their default.
        config.handlers.push(config.default_handler.clone());
    }
    // Hollow nodes (a shared pod feed) serve neither Services nor DNS: their machine
    // is not theirs, and their pods have no network to reach them from.
    if options.pods.is_some() {
        config.service_proxy = false;
        config.node_local_dns.clear();
    }
    // The node serves DNS: its pods ask it, unless told to ask another server.
    if config.cluster_dns.is_empty()
        && let Some(local) = config.node_local_dns.first()
    {
        config.cluster_dns = vec![*local];
    }
    let runtime_name = runtime
        .version(k8s_cri::v1::VersionRequest::default())
        .await
        .map(|v| v.into_inner().runtime_name)
        .unwrap_or_else(|_| "cri".into());
    let events = EventRecorder::new(client.clone(), "kubelet", &config.node_name);
    let cgroups = if config.cgroups_per_qos {
        cgroups::PodCgroups::start(&config.cgroup_root, node::pods_allocatable(&config))
    } else {
        cgroups::PodCgroups::disabled()
    };
    let ctx = Arc::new(Context {
        config,
        client,
        cri,
        events,
        informers,
        runtime_name,
        port: Default::default(),
        network_ready: tokio::sync::watch::Sender::new(false),
        cgroups,
        eviction: Default::default(),
        dns: Default::default(),
    });
    std::fs::create_dir_all(ctx.config.root.join("pods"))
        .map_err(|e| anyhow::anyhow!("create {}: {e}", ctx.config.root.display()))?;
    if ctx.config.client_ca_pem.is_some() {
        let listen = std::net::SocketAddr::new(ctx.config.node_ip, ctx.config.port);
        let port = server::serve(
            ctx.clone(),
            listen,
            ctx.config.client_ca_pem.clone(),
            stopped.clone(),
        )
        .await
        .map_err(|e| anyhow::anyhow!("serve logs on {listen}: {e:#}"))?;
        ctx.port.store(port, std::sync::atomic::Ordering::Relaxed);
    } else if options.pods.is_none() {
        // Hollow nodes (a shared pod feed) serve none by design.
        tracing::warn!("no cluster CA given: the node serves no logs");
    }
    // Before the pods: they find their DNS server serving when they start.
    let services = if options.pods.is_none() {
        services::start(&ctx, stopped.clone()).await?
    } else {
        services::Services::default()
    };
    node::register(&ctx).await?;
    if let Some(registered) = options.registered {
        let _ = registered.send(());
    }
    let heartbeat = tokio::spawn(node::heartbeat(ctx.clone(), stopped.clone()));
    let pod_network = ctx
        .config
        .pod_network
        .then(|| tokio::spawn(node::pod_network(ctx.clone(), stopped.clone())));
    // Hollow nodes (a shared pod feed) have no network of their own to route.
    let routes = (ctx.config.pod_network && options.pods.is_none())
        .then(|| tokio::spawn(routes::run(ctx.clone(), stopped.clone())));
    // Hollow nodes (no thresholds) evict nothing: their machine is not theirs.
    let eviction = ctx
        .config
        .eviction_hard
        .is_some()
        .then(|| tokio::spawn(eviction::run(ctx.clone(), stopped.clone())));
    let tokens = tokio::spawn(tokens::run(ctx.clone(), stopped.clone()));
    // Hollow nodes keep no volumes on the machine.
    let storage = options
        .pods
        .is_none()
        .then(|| tokio::spawn(storage::run(ctx.clone(), stopped.clone())));
    let pods = tokio::spawn(pods::run(ctx.clone(), options.pods, stopped.clone()));
    stopped.wait().await;
    if let Some(storage) = storage {
        storage.abort();
    }
    if let Some(eviction) = eviction {
        eviction.abort();
    }
    let _ = pods.await;
    let _ = tokens.await;
    heartbeat.abort();
    if let Some(pod_network) = pod_network {
        pod_network.abort();
    }
    if let Some(routes) = routes {
        routes.abort();
    }
    services.stopped().await;
    ctx.events.flush().await;
    Ok(())
}
