//! `trellis node` (the node agent with its runtime), `trellis runtime` (the CRI
//! runtime alone), and the local node of `trellis up`.

mod address;

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use trellis_api::Shutdown;

use crate::flags::seconds;
use anyhow::Context as _;
use clap::Args;
use tracing::info;
use trellis_agent::AgentConfig;
use trellis_client::informer::SharedInformers;
use trellis_runtime::{CniConfig, Runtime, RuntimeConfig};

/// Where the built-in runtime finds the pods' CNI network.
#[derive(Clone, Debug, Args)]
pub struct CniFlags {
    /// The CNI network's config dir (default: `cni/net.d` in the runtime's state
    /// directory). Once the node has a pod CIDR, the default network is written there
    /// if it holds none.
    #[arg(long, value_name = "DIR")]
    pub cni_conf_dir: Option<PathBuf>,

    /// Where CNI plugins are looked for, in order (repeated or comma separated;
    /// default: /usr/lib/cni, then /opt/cni/bin).
    #[arg(long, value_name = "DIR", value_delimiter = ',')]
    pub cni_bin_dir: Vec<PathBuf>,
}

/// The plugins of the default network (`bridge` with `host-local`, then `portmap`).
const DEFAULT_NETWORK_PLUGINS: &[&str] = &["bridge", "host-local", "portmap"];

impl CniFlags {
    fn config(&self) -> CniConfig {
        CniConfig {
            conf_dir: self.cni_conf_dir.clone(),
            bin_dirs: self.cni_bin_dir.clone(),
        }
    }

    /// Where plugins are looked for: the flag's directories, else the runtime's.
    fn bin_dirs(&self) -> Vec<PathBuf> {
        if self.cni_bin_dir.is_empty() {
            vec!["/usr/lib/cni".into(), "/opt/cni/bin".into()]
        } else {
            self.cni_bin_dir.clone()
        }
    }

    /// Why pods cannot have a network of their own here, if they cannot: namespaces
    /// and links need root, and the default network its plugins.
    fn missing(&self) -> Option<String> {
        if !rustix::process::geteuid().is_root() {
            return Some("it needs root (network namespaces, links, iptables)".into());
        }
        let dirs = self.bin_dirs();
        let missing: Vec<&str> = DEFAULT_NETWORK_PLUGINS
            .iter()
            .copied()
            .filter(|plugin| !dirs.iter().any(|dir| dir.join(plugin).is_file()))
            .collect();
        (!missing.is_empty()).then(|| {
            let dirs: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
            format!(
                "the CNI plugins {} are not in {} (Debian: containernetworking-plugins)",
                missing.join(", "),
                dirs.join(", ")
            )
        })
    }
}

/// The node's address: the flag's, else the one a kubelet would pick.
fn node_address(flag: Option<IpAddr>) -> IpAddr {
    if let Some(ip) = flag {
        return ip;
    }
    let (ip, source) = address::detect();
    match source {
        address::Source::DefaultRoute(interface) => {
            info!(%ip, %interface, "node address: the default route's interface")
        }
        address::Source::Interface(interface) => {
            info!(%ip, %interface, "node address: no default route, an interface that is up")
        }
        address::Source::Loopback => tracing::warn!(
            %ip,
            "node address: no interface has an IPv4 address; pods on a network of their own \
             cannot reach the node (--node-address sets one)"
        ),
    }
    ip
}

/// The settings `trellis node` and `trellis up` share.
#[derive(Clone, Debug, Args)]
pub struct NodeFlags {
    /// The node's name (default: this machine's host name).
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,

    /// The node's address: its InternalIP, where its agent serves logs and exec and
    /// its hostNetwork pods' ports are served (default: as a kubelet picks it, the
    /// first IPv4 address of the default route's interface, else of an interface that
    /// is up and is not a pod network's bridge or veth, else 127.0.0.1).
    #[arg(long, value_name = "IP")]
    pub node_address: Option<IpAddr>,

    /// A CRI runtime to use instead of the built-in one, e.g.
    /// `unix:///run/containerd/containerd.sock`.
    #[arg(long, value_name = "unix:///PATH")]
    pub container_runtime_endpoint: Option<String>,

    /// The RuntimeClass handler of pods that name no RuntimeClass.
    #[arg(long, default_value = "wasmtime", value_name = "HANDLER")]
    pub default_runtime_handler: String,

    /// The port the agent serves logs on (HTTPS, for the API server and admins); 0
    /// picks a free one. The Node's status tells it.
    #[arg(long, default_value_t = 10250, value_name = "PORT")]
    pub node_port: u16,

    /// How often the node's Lease is renewed.
    #[arg(long, default_value = "10", value_name = "SECONDS", value_parser = seconds)]
    pub node_lease_renew: Duration,

    /// How often the node's status is written when nothing changed.
    #[arg(long, default_value = "300", value_name = "SECONDS", value_parser = seconds)]
    pub node_status_report: Duration,

    /// The hard eviction thresholds, as the kubelet's: while one is met the node
    /// evicts pods at once, one at a time, and reports MemoryPressure, DiskPressure
    /// or PIDPressure. `SIGNAL<QUANTITY` or `SIGNAL<PERCENT%`, comma separated, for
    /// memory.available, nodefs.available (the data directory's filesystem),
    /// nodefs.inodesFree, imagefs.available (the runtime's image filesystem) and
    /// pid.available; signals not named keep these defaults.
    #[arg(
        long,
        env = "TRELLIS_EVICTION_HARD",
        default_value = "memory.available<100Mi,nodefs.available<10%,nodefs.inodesFree<5%",
        value_name = "THRESHOLDS"
    )]
    pub eviction_hard: trellis_agent::pressure::Thresholds,

    /// Thresholds that evict pods only once met for their grace period (the kubelet's
    /// `--eviction-soft`), in `--eviction-hard`'s form, also for imagefs.available;
    /// none by default. The pressure conditions hold while any threshold is met.
    #[arg(long, default_value = "", value_name = "THRESHOLDS", value_parser = trellis_agent::pressure::Thresholds::parse_soft)]
    pub eviction_soft: trellis_agent::pressure::Thresholds,

    /// The grace period of each soft threshold: `SIGNAL=DURATION`, comma separated
    /// (`memory.available=1m30s`).
    #[arg(long, default_value = "", value_name = "GRACE_PERIODS")]
    pub eviction_soft_grace_period: trellis_agent::pressure::GracePeriods,

    /// How long a pressure condition holds after its thresholds stop being met.
    #[arg(long, default_value = "5m", value_name = "DURATION", value_parser = trellis_agent::pressure::parse_duration)]
    pub eviction_pressure_transition_period: Duration,

    /// The longest grace period, in seconds, of a pod evicted for a soft threshold;
    /// negative: the pod's own.
    #[arg(
        long,
        default_value_t = 0,
        value_name = "SECONDS",
        allow_negative_numbers = true
    )]
    pub eviction_max_pod_grace_period: i64,

    /// How far above its threshold a met signal must come back before it is no longer
    /// met: `SIGNAL=QUANTITY` or `SIGNAL=PERCENT%`, comma separated.
    #[arg(long, default_value = "", value_name = "RECLAIM")]
    pub eviction_minimum_reclaim: trellis_agent::pressure::MinimumReclaim,

    /// How often the runtime's containers are listed to notice exits.
    #[arg(long, default_value = "1", value_name = "SECONDS", value_parser = seconds)]
    pub relist_period: Duration,

    /// The first restart back-off of a crashed container, doubled at each crash...
    #[arg(long, default_value = "10", value_name = "SECONDS", value_parser = seconds)]
    pub restart_backoff: Duration,

    /// ... up to this.
    #[arg(long, default_value = "300", value_name = "SECONDS", value_parser = seconds)]
    pub restart_backoff_max: Duration,

    /// Puts pods that are not hostNetwork on a network of their own (a namespace
    /// joined by CNI, an IP of the Node's pod CIDR, which they wait for). Default: on
    /// when this process is root and the default network's CNI plugins (bridge,
    /// host-local, portmap) are in the CNI bin dirs, else off (the log says why);
    /// `--pod-network=false` keeps every pod on the node's network.
    #[arg(
        long,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_name = "BOOL"
    )]
    pub pod_network: Option<bool>,

    /// How pod traffic reaches other nodes: `host-gw` (a route via the other node's
    /// InternalIP, on a link both share), `vxlan` (the overlay device `trellis.1`, UDP
    /// 8472), or `auto`: host-gw where the nodes share a link, vxlan elsewhere.
    #[arg(long, default_value = "auto", value_name = "BACKEND")]
    pub pod_network_backend: trellis_agent::routes::Backend,

    /// The cluster's pod CIDRs: pod traffic to elsewhere is masqueraded. Default: the
    /// podCIDRs of the Nodes there are (`trellis up`: its `--cluster-cidr`).
    #[arg(long, value_delimiter = ',', value_name = "CIDR")]
    pub pod_network_cluster_cidr: Vec<String>,

    /// The cluster's DNS servers, the nameservers of `ClusterFirst` pods (comma
    /// separated). None: those pods get the node's resolvers, with a warning event.
    #[arg(long, value_delimiter = ',', value_name = "IP")]
    pub cluster_dns: Vec<IpAddr>,

    /// The cluster's domain, of pods' search domains and FQDNs.
    #[arg(long, default_value = "cluster.local", value_name = "DOMAIN")]
    pub cluster_domain: String,

    /// The resolver configuration `dnsPolicy: Default` pods get; empty: none.
    #[arg(long, default_value = "/etc/resolv.conf", value_name = "FILE")]
    pub resolv_conf: PathBuf,

    /// Gives every pod a cgroup of its own, in a tree per QoS class
    /// (`kubepods/{burstable,besteffort}/pod<UID>`) under `--cgroup-root`, limited to
    /// the pod's resources, all pods together to the node's allocatable. Where cgroups
    /// cannot be written pods get none (the log says why).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub cgroups_per_qos: bool,

    /// The cgroup the pods' `kubepods` cgroup is made under.
    #[arg(
        long,
        env = "TRELLIS_CGROUP_ROOT",
        default_value = "/",
        value_name = "CGROUP"
    )]
    pub cgroup_root: String,

    /// What the node keeps for Trellis' own daemons, out of what pods may have:
    /// `cpu=100m,memory=256Mi,pid=1000,ephemeral-storage=1Gi` (any of them).
    #[arg(long, default_value = "", value_name = "RESOURCES")]
    pub kube_reserved: trellis_agent::node::Reserved,

    /// What the node keeps for the system, as `--kube-reserved`.
    #[arg(long, default_value = "", value_name = "RESOURCES")]
    pub system_reserved: trellis_agent::node::Reserved,

    /// Containers whose pod names no seccomp profile get the runtime's default
    /// (`RuntimeDefault`) rather than none (`Unconfined`).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub seccomp_default: bool,

    /// Runs the service proxy on this node: Services' ClusterIPs and NodePorts reach
    /// their endpoints through the nftables table `trellis-proxy` (kube-proxy's part).
    /// Default: on when this process is root and `nft` is found (Debian: nftables),
    /// else off (the log says why); `--service-proxy=false` for a cluster that brings
    /// its own proxy (k3s' `--disable-kube-proxy`). Its table stays when the node stops.
    #[arg(
        long,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_name = "BOOL"
    )]
    pub service_proxy: Option<bool>,

    /// How often the proxy rewrites its table in full and repairs what was changed
    /// behind its back (kube-proxy's `--iptables-sync-period`).
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = seconds)]
    pub proxy_sync_period: Duration,

    /// The shortest time between two of the proxy's syncs, which batches changes
    /// (kube-proxy's `--iptables-min-sync-period`).
    #[arg(long, default_value = "1", value_name = "SECONDS", value_parser = seconds)]
    pub proxy_min_sync_period: Duration,

    /// Serves cluster DNS on this node (as NodeLocal DNSCache): on the dummy link
    /// `trellis-dns` holding `--node-local-dns-address`, UDP and TCP port 53, names of
    /// the cluster answered from Services and EndpointSlices, others forwarded to the
    /// resolvers of `--resolv-conf`; `ClusterFirst` pods' nameserver when
    /// `--cluster-dns` names none. Default: on when this process is root, else off;
    /// `--node-local-dns=false` for a cluster that brings its own DNS (k3s'
    /// `--disable=coredns`), which also removes the link an earlier run left.
    #[arg(
        long,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_name = "BOOL"
    )]
    pub node_local_dns: Option<bool>,

    /// The addresses the node's DNS server answers on (comma separated): the
    /// node-local address pods are given, then the `kube-dns` Service's ClusterIP,
    /// which the proxy then delivers to this node's server.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "169.254.20.10,10.43.0.10",
        value_name = "IP"
    )]
    pub node_local_dns_address: Vec<IpAddr>,

    #[command(flatten)]
    pub cni: CniFlags,

    /// The cluster's Service CIDRs: `trellis up` gives its `--service-cluster-ip-range`,
    /// `trellis node` its flag of that name.
    #[arg(skip)]
    pub service_cidrs: Vec<String>,
}

/// `trellis node`: joins a cluster and runs its pods.
#[derive(Debug, Args)]
pub struct NodeArgs {
    /// The cluster and the node's credentials; without it, the node joins with
    /// `--server`, `--token` and `--discovery-token-ca-cert-hash` (or the credentials
    /// an earlier join left in the data directory).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,

    #[command(flatten)]
    pub join: crate::join::JoinFlags,

    /// Where the node keeps its runtime's state, pods' volumes and logs.
    #[arg(long, value_name = "DIR")]
    pub data_dir: PathBuf,

    /// Whether the `process` handler runs native processes on this node.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub process_handler: bool,

    /// Runs this many hollow nodes (simulated, on fake runtimes) instead of this
    /// machine's: the kubeconfig's user must be allowed to act for all of them and to
    /// list every pod (an admin's).
    #[arg(long, value_name = "N")]
    pub hollow: Option<usize>,

    #[command(flatten)]
    pub hollow_flags: crate::hollow::HollowFlags,

    /// The cluster's Service CIDRs (the API server's `--service-cluster-ip-range`,
    /// comma separated): the proxy drops connections to addresses in them that no
    /// Service holds, and the node's DNS server answers their reverse names. Default:
    /// none for the proxy, `10.43.0.0/16` for DNS.
    #[arg(long, value_delimiter = ',', value_name = "CIDR")]
    pub service_cluster_ip_range: Vec<String>,

    #[command(flatten)]
    pub node: NodeFlags,
}

/// `trellis runtime`: the CRI runtime alone, on a Unix socket.
#[derive(Debug, Args)]
pub struct RuntimeArgs {
    /// Where CRI is served.
    #[arg(long, value_name = "unix:///PATH")]
    pub listen: String,

    /// Where the runtime keeps images, containers' state and compiled components.
    #[arg(long, value_name = "DIR")]
    pub root: PathBuf,

    /// Whether the `process` handler runs native processes.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub process_handler: bool,

    /// The node's address: the IP of sandboxes on the node's network, where their
    /// `wasi:http` components listen (default: as `trellis node` picks it).
    #[arg(long, value_name = "IP")]
    pub node_address: Option<IpAddr>,

    #[command(flatten)]
    pub cni: CniFlags,
}

fn socket_path(endpoint: &str) -> anyhow::Result<PathBuf> {
    endpoint
        .strip_prefix("unix://")
        .map(PathBuf::from)
        .with_context(|| format!("parse the endpoint {endpoint:?}: expected unix:///PATH"))
}

pub async fn run_runtime(
    args: RuntimeArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let socket = socket_path(&args.listen)?;
    let runtime = Runtime::with_cni(
        with_init(RuntimeConfig {
            cache_dir: Some(args.root.join("compiled")),
            root: args.root,
            process_handler: args.process_handler,
            node_ip: node_address(args.node_address),
            ..Default::default()
        }),
        args.cni.config(),
    )
    .context("start the runtime")?;
    println!("Trellis' runtime serves CRI at unix://{}", socket.display());
    trellis_runtime::serve(runtime, &socket, shutdown).await
}

/// A node in this process: the built-in runtime on a socket in `data_dir` (unless
/// the flags name another runtime) and the agent, until `stopped`.
pub async fn run_local(
    client: kube::Client,
    informers: SharedInformers,
    data_dir: &Path,
    process_handler: bool,
    client_ca_pem: Option<String>,
    flags: &NodeFlags,
    stopped: Shutdown,
) -> anyhow::Result<()> {
    let node_ip = node_address(flags.node_address);
    let (socket, server) = match &flags.container_runtime_endpoint {
        Some(endpoint) => (socket_path(endpoint)?, None),
        None => {
            let root = data_dir.join("runtime");
            let runtime = Runtime::with_cni(
                with_init(RuntimeConfig {
                    cache_dir: Some(root.join("compiled")),
                    root,
                    process_handler,
                    node_ip,
                    ..Default::default()
                }),
                flags.cni.config(),
            )
            .context("start the runtime")?;
            let socket = data_dir.join("runtime.sock");
            // Listening before the agent connects: no wait for the socket.
            let listener = trellis_runtime::listen(&socket)?;
            let stop = stopped.clone();
            let server = tokio::spawn(async move {
                trellis_runtime::serve_on(runtime, listener, async move {
                    stop.wait().await;
                })
                .await
            });
            (socket, Some(server))
        }
    };
    let cri = match server {
        Some(_) => trellis_runtime::connect(&socket)
            .await
            .with_context(|| format!("connect to the runtime at {}", socket.display()))?,
        None => connect_when_up(&socket).await?,
    };
    let mut config = AgentConfig::new(
        &flags
            .node_name
            .clone()
            .unwrap_or_else(crate::setup::host_name),
        node_ip,
        data_dir.join("node"),
    );
    config.lease_renew = flags.node_lease_renew;
    config.status_report = flags.node_status_report;
    config.eviction_hard = Some(flags.eviction_hard.clone());
    config.eviction_soft = flags.eviction_soft.clone();
    config.eviction_soft_grace_period = flags.eviction_soft_grace_period.clone();
    config.eviction_pressure_transition_period = flags.eviction_pressure_transition_period;
    config.eviction_max_pod_grace_period = flags.eviction_max_pod_grace_period;
    config.eviction_minimum_reclaim = flags.eviction_minimum_reclaim.clone();
    config.relist_period = flags.relist_period;
    config.backoff_base = flags.restart_backoff;
    config.backoff_max = flags.restart_backoff_max;
    config.default_handler = flags.default_runtime_handler.clone();
    config.port = flags.node_port;
    config.client_ca_pem = client_ca_pem;
    config.pod_network = pod_network(flags);
    config.pod_network_backend = flags.pod_network_backend;
    config.cluster_cidrs = flags.pod_network_cluster_cidr.clone();
    config.service_cidrs = flags.service_cidrs.clone();
    config.cluster_dns = flags.cluster_dns.clone();
    config.cluster_domain = flags.cluster_domain.clone();
    config.resolv_conf =
        (!flags.resolv_conf.as_os_str().is_empty()).then(|| flags.resolv_conf.clone());
    config.cgroups_per_qos = flags.cgroups_per_qos;
    config.cgroup_root = flags.cgroup_root.clone();
    config.kube_reserved = flags.kube_reserved;
    config.system_reserved = flags.system_reserved;
    config.seccomp_default = flags.seccomp_default;
    config.service_proxy = service_proxy(flags);
    config.proxy_sync_period = flags.proxy_sync_period;
    config.proxy_min_sync_interval = flags.proxy_min_sync_period;
    if node_local_dns(flags) {
        config.node_local_dns = flags.node_local_dns_address.clone();
    }
    // Turned off by hand: the link of an earlier run goes too.
    config.remove_node_local_dns_link = flags.node_local_dns == Some(false);
    info!(node = %config.node_name, runtime = %socket.display(), "node agent starting");
    let result = trellis_agent::run(config, client, cri, informers, stopped).await;
    if let Some(server) = server {
        server.await.context("join the runtime")??;
    }
    result
}

/// Whether pods get a network of their own: the flag's word, else whether they can.
fn pod_network(flags: &NodeFlags) -> bool {
    if let Some(on) = flags.pod_network {
        return on;
    }
    match flags.cni.missing() {
        None => {
            info!("pods get a network of their own (--pod-network=false keeps them on the node's)");
            true
        }
        Some(why) => {
            info!("pods stay on the node's network: {why}");
            false
        }
    }
}

/// Whether the node runs the service proxy: the flag's word, else whether it can
/// (nftables needs root and `nft`).
fn service_proxy(flags: &NodeFlags) -> bool {
    if let Some(on) = flags.service_proxy {
        return on;
    }
    let missing = if !rustix::process::geteuid().is_root() {
        Some("it needs root (nftables)")
    } else if !program_found("nft") {
        Some("nft is not found (Debian: nftables)")
    } else {
        None
    };
    match missing {
        None => {
            info!(
                "the node runs the service proxy (--service-proxy=false leaves Services to another)"
            );
            true
        }
        Some(why) => {
            info!("the node runs no service proxy: {why}");
            false
        }
    }
}

/// Whether the node serves cluster DNS: the flag's word, else whether it can (a link
/// of its own and port 53 need root).
fn node_local_dns(flags: &NodeFlags) -> bool {
    if let Some(on) = flags.node_local_dns {
        return on;
    }
    if rustix::process::geteuid().is_root() {
        info!("the node serves cluster DNS (--node-local-dns=false leaves it to another)");
        true
    } else {
        info!("the node serves no cluster DNS: it needs root (a link, port 53)");
        false
    }
}

/// Whether `program` is in one of `PATH`'s directories.
fn program_found(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// Another runtime's client once its socket answers: it may be starting beside the
/// node (a `trellis runtime` launched with it, containerd).
async fn connect_when_up(socket: &Path) -> anyhow::Result<trellis_runtime::Client> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match trellis_runtime::connect(socket).await {
            Ok(client) => return Ok(client),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(e)
                    .with_context(|| format!("connect to the runtime at {}", socket.display()));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// The cluster CA of a kubeconfig's current cluster, PEM: inline data or a file.
fn cluster_ca(kubeconfig: &Path) -> anyhow::Result<Option<String>> {
    use base64::Engine as _;
    let config = kube::config::Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("read {}", kubeconfig.display()))?;
    let context = config.current_context.clone().unwrap_or_default();
    let cluster_name = config
        .contexts
        .iter()
        .find(|c| c.name == context)
        .and_then(|c| c.context.as_ref())
        .map(|c| c.cluster.clone());
    let cluster = config
        .clusters
        .iter()
        .find(|c| Some(&c.name) == cluster_name.as_ref())
        .or(config.clusters.first())
        .and_then(|c| c.cluster.as_ref());
    let Some(cluster) = cluster else {
        return Ok(None);
    };
    if let Some(data) = &cluster.certificate_authority_data {
        let pem = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .context("decode certificate-authority-data")?;
        return Ok(Some(String::from_utf8_lossy(&pem).into_owned()));
    }
    match &cluster.certificate_authority {
        Some(file) => Ok(Some(
            std::fs::read_to_string(file).with_context(|| format!("read the cluster CA {file}"))?,
        )),
        None => Ok(None),
    }
}

/// `trellis node --kubeconfig FILE`.
pub async fn run_node(args: NodeArgs, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    if let Some(count) = args.hollow {
        let config = args
            .hollow_flags
            .config(count, args.data_dir.join("hollow"));
        let kubeconfig = args
            .kubeconfig
            .as_deref()
            .context("run hollow nodes: --kubeconfig is required")?;
        return crate::hollow::run_remote(kubeconfig, config, shutdown).await;
    }
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("create {}", args.data_dir.display()))?;
    let (stop, stopped) = Shutdown::new();
    let (client, ca) = match &args.kubeconfig {
        Some(kubeconfig) => (
            trellis_client::transport::remote(kubeconfig).await?,
            cluster_ca(kubeconfig)?,
        ),
        None => {
            let node_name = args
                .node
                .node_name
                .clone()
                .unwrap_or_else(crate::setup::host_name);
            let (client, ca) =
                crate::join::joined_client(&args.join, &args.data_dir, &node_name, stopped.clone())
                    .await?;
            (client, Some(ca))
        }
    };
    let informers = SharedInformers::new();
    let data_dir = args.data_dir.clone();
    let mut args = args;
    args.node.service_cidrs = args.service_cluster_ip_range.clone();
    let node = tokio::spawn(async move {
        run_local(
            client,
            informers,
            &data_dir,
            args.process_handler,
            ca,
            &args.node,
            stopped,
        )
        .await
    });
    let mut node = node;
    tokio::pin!(shutdown);
    tokio::select! {
        _ = &mut shutdown => {
            stop.stop();
            (&mut node).await.context("join the node agent")?
        }
        result = &mut node => result.context("join the node agent")?,
    }
}

/// `config` with this binary as the init of sandboxed `process` containers
/// (`trellis __init`).
fn with_init(config: RuntimeConfig) -> RuntimeConfig {
    let init_program = match std::env::current_exe() {
        Ok(exe) => Some(exe),
        Err(e) => {
            tracing::warn!(error = %e, "cannot find this binary: only privileged process containers can run");
            None
        }
    };
    RuntimeConfig {
        init_program,
        ..config
    }
}
