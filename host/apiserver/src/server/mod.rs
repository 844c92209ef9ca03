//! Starting and stopping the API server: credentials on first start, the HTTPS
//! listener, the watch cache, and a graceful stop.

pub mod connection;
pub mod kubeconfig;
pub mod pki;
pub mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tracing::{info, warn};
use trellis_api::shutdown::{Shutdown, Stop};
use trellis_pki::serve::peer_certificate;
use trellis_store::Store;

use crate::admission::Chains;
use crate::admission::plugins::{
    PluginAdmission, PluginInitializers, PluginManager, PluginsConfig,
};
use crate::authentication::tokens;
use crate::endpoints::dispatch::router;
use crate::observability::audit::AuditConfig;
use crate::state::AppState;
use crate::storage::watch_cache::WatchCache;

/// How long a client may take to finish the TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Settings of the API server.
#[derive(Clone, Debug)]
pub struct Config {
    /// Where credentials, the token file and `admin.kubeconfig` live.
    pub data_dir: PathBuf,
    /// The address to listen on; port 0 picks a free one.
    pub listen: SocketAddr,
    /// Extra names or addresses for the serving certificate.
    pub tls_sans: Vec<String>,
    /// Where pods and other API servers reach this one: the address listed in the
    /// `kubernetes` Service's endpoints (`--advertise-address`). `None`: the listening
    /// address unless it is loopback or unspecified, else the default route's source
    /// address ([`crate::service_reconciler::default_advertise_address`]).
    pub advertise_address: Option<std::net::IpAddr>,
    /// Addresses served besides `listen`, with the same port when theirs is 0
    /// (`trellis up` serves its node's address too, so that its pods reach the API).
    pub also_listen: Vec<SocketAddr>,
    /// The `kube-dns` Service's ClusterIP (`--cluster-dns-service-ip`); `None`: the
    /// server keeps no `kube-dns` Service.
    pub cluster_dns_service_ip: Option<std::net::IpAddr>,
    /// The cluster's DNS domain: the serving certificate names
    /// `kubernetes.default.svc.<domain>`.
    pub cluster_domain: String,
    /// How often the built-in Services and the `kubernetes` endpoints are reconciled,
    /// and how long a server's lease counts.
    pub endpoint_reconciler: crate::service_reconciler::Timing,
    /// Events the watch cache keeps for watches that resume.
    pub watch_cache_events: usize,
    /// Events a client watch may fall behind before it is ended.
    pub watch_buffer: usize,
    /// How long a stop waits for requests in flight.
    pub shutdown_grace: Duration,
    /// The admission and initializer chains.
    pub chains: Chains,
    /// Pod Security admission's defaults and exemptions (`--pod-security-config`); the
    /// `PodSecurity` step joins the chain unless the chain already has one.
    pub pod_security: crate::admission::pod_security::Config,
    /// The audit log; `None` turns it off.
    pub audit: Option<AuditConfig>,
    /// Limits, timeouts and intervals.
    pub settings: crate::state::Settings,
    /// Runs WASM plugins from Plugin objects (and `plugin_dir`).
    pub plugins: bool,
    /// `NAME.yaml` + `NAME.wasm` pairs loaded as plugins, followed while running.
    pub plugin_dir: Option<PathBuf>,
    /// Runs the server's own namespace controller, which empties a namespace marked
    /// for deletion and then removes it (the default). When false, the server only
    /// marks namespaces for deletion, and a controller manager's namespace controller
    /// empties and finalizes them (through `namespaces/finalize`).
    pub namespace_controller: bool,
    /// Plugin objects that stand for the controllers bundled with the binary, so
    /// `kubectl get plugins` lists them: created when missing, and brought up to date
    /// while they keep the `trellis.dev/builtin` label and their `builtin:` module.
    pub builtin_plugins: Vec<serde_json::Value>,
    /// How long the certificates signed for CertificateSigningRequests live.
    pub signing: crate::certificates::Signing,
    /// When CertificateSigningRequests done with are deleted.
    pub csr_cleaning: crate::certificates::Cleaning,
    /// The aggregation layer: how often APIServices' backends are checked.
    pub aggregator: crate::aggregator::Config,
}

impl Config {
    /// [`Config::watch_cache_events`] unless set.
    pub const DEFAULT_WATCH_CACHE_EVENTS: usize = 2_048;

    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 6443)),
            tls_sans: Vec::new(),
            advertise_address: None,
            also_listen: Vec::new(),
            cluster_dns_service_ip: Some(crate::service_reconciler::DEFAULT_CLUSTER_DNS_SERVICE_IP),
            cluster_domain: "cluster.local".to_owned(),
            endpoint_reconciler: crate::service_reconciler::Timing::default(),
            watch_cache_events: Self::DEFAULT_WATCH_CACHE_EVENTS,
            watch_buffer: 1_000,
            shutdown_grace: Duration::from_secs(10),
            chains: crate::admission::builtin(),
            pod_security: crate::admission::pod_security::Config::default(),
            audit: None,
            settings: crate::state::Settings::default(),
            plugins: true,
            plugin_dir: None,
            namespace_controller: true,
            builtin_plugins: Vec::new(),
            signing: crate::certificates::Signing::default(),
            csr_cleaning: crate::certificates::Cleaning::default(),
            aggregator: crate::aggregator::Config::default(),
        }
        .with_audit_in_data_dir()
    }

    /// Audits to `DATA_DIR/audit.log`, rotated at 100 MiB, five files kept.
    fn with_audit_in_data_dir(mut self) -> Self {
        self.audit = Some(AuditConfig {
            path: self.data_dir.join("audit.log"),
            max_bytes: 100 << 20,
            max_files: 5,
        });
        self
    }
}

/// How long the components' certificates (issued at every start) are valid.
const COMPONENT_CERT_DAYS: u32 = 365;

/// A running server.
#[derive(Debug)]
pub struct Server {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// `https://…`, as clients reach it.
    pub url: String,
    /// `DATA_DIR/admin.kubeconfig`.
    pub kubeconfig: PathBuf,
    /// The admin's bearer token (from `DATA_DIR/tokens.csv`).
    pub admin_token: String,
    pub ca_pem: String,
    /// The API as a tower service, for in-process clients (`trellis-client`): a
    /// request goes through authentication, authorization, admission and the watch
    /// cache as a remote one does, with the identity its
    /// [`Peer`](trellis_api::user::Peer) extension carries instead of a certificate.
    pub in_process: axum::Router,
    stop: Stop,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Server {
    /// Stops accepting, lets requests in flight finish (up to the grace period), ends
    /// watches, and returns once the listener is closed.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.stop.stop();
        self.task.await.context("join the server task")?
    }

    /// Waits until the server stops on its own `shutdown` signal.
    pub async fn wait(self) -> anyhow::Result<()> {
        self.task.await.context("join the server task")?
    }
}

/// Creates the data directory, or makes an existing one private: it holds the store,
/// keys, tokens and the audit log, and is its owner's alone (0700).
pub fn private_data_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder
        .create(dir)
        .with_context(|| format!("create the data directory {}", dir.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("make the data directory {} private", dir.display()))?;
    }
    Ok(())
}

/// Starts the server on `store`; it runs until `shutdown` completes or [`Server::stop`].
pub async fn start(
    config: Config,
    store: Arc<dyn Store>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Server> {
    private_data_dir(&config.data_dir)?;
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listen on {}", config.listen))?;
    let addr = listener
        .local_addr()
        .context("read the listening address")?;
    let mut listeners = vec![listener];
    for also in &config.also_listen {
        let also = if also.port() == 0 {
            SocketAddr::new(also.ip(), addr.port())
        } else {
            *also
        };
        listeners.push(
            TcpListener::bind(also)
                .await
                .with_context(|| format!("listen on {also}"))?,
        );
    }
    let advertise = config
        .advertise_address
        .unwrap_or_else(|| crate::service_reconciler::default_advertise_address(addr.ip()));
    // The service range's first address, as kube-apiserver reserves it.
    let kubernetes_service_ip =
        std::net::IpAddr::V4(config.settings.service_cluster_ip_range.ip(0));
    // What kube-apiserver's serving certificate names: the Service's names and
    // ClusterIP, which in-cluster clients dial, and the advertised address.
    let mut sans = config.tls_sans.clone();
    sans.extend(
        [
            "kubernetes".to_owned(),
            "kubernetes.default".to_owned(),
            "kubernetes.default.svc".to_owned(),
            format!("kubernetes.default.svc.{}", config.cluster_domain),
            kubernetes_service_ip.to_string(),
            advertise.to_string(),
        ]
        .into_iter()
        .filter(|name| !name.ends_with('.')),
    );
    let pki = pki::Pki::load_or_create(&config.data_dir, &sans)
        .context("prepare the cluster CA and certificates")?;
    let tls_config = tls::server_config(&pki).context("build the TLS configuration")?;
    let host = if addr.ip().is_unspecified() {
        "127.0.0.1".to_owned()
    } else {
        addr.ip().to_string()
    };
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host
    };
    let url = format!("https://{host}:{}", addr.port());

    let token_path = config.data_dir.join("tokens.csv");
    let admin_token = tokens::ensure_admin_token(&token_path).context("prepare the token file")?;
    // Bearer tokens are credentials, even in a file someone else wrote.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&token_path, std::fs::Permissions::from_mode(0o600))
            .context("make the token file private")?;
    }
    let token_file = tokens::TokenFile::load(&token_path).context("load the token file")?;
    let kubeconfig_path = config.data_dir.join("admin.kubeconfig");
    let contents = kubeconfig::admin_kubeconfig(
        &url,
        pki.ca_pem(),
        pki.admin_cert_pem(),
        pki.admin_key_pem(),
    );
    trellis_pki::kubeconfig::write_kubeconfig(&kubeconfig_path, &contents)
        .context("write admin.kubeconfig")?;
    // The components' own credentials, as kubeadm writes `controller-manager.conf` and
    // `scheduler.conf`: `trellis controllers|scheduler --kubeconfig` run with them,
    // held to their roles rather than as the admin.
    for (file, user) in [
        (
            "controller-manager.kubeconfig",
            "system:kube-controller-manager",
        ),
        ("scheduler.kubeconfig", "system:kube-scheduler"),
    ] {
        let (cert, key) = pki
            .issue_client_cert(user, &[], COMPONENT_CERT_DAYS)
            .with_context(|| format!("issue the certificate of {user}"))?;
        let contents =
            trellis_pki::kubeconfig::cert_kubeconfig(&url, pki.ca_pem(), user, &cert, &key);
        trellis_pki::kubeconfig::write_kubeconfig(&config.data_dir.join(file), &contents)
            .with_context(|| format!("write {file}"))?;
    }

    let (stop, stopped) = Shutdown::new();
    let stop_signal = stop.clone();
    tokio::spawn(async move {
        shutdown.await;
        stop_signal.stop();
    });
    let cache_stop = {
        let rx = stop.subscribe();
        async move {
            rx.wait().await;
        }
    };
    let cache = WatchCache::start(
        store.clone(),
        config.watch_cache_events,
        config.watch_buffer,
        cache_stop,
    )
    .await
    .context("start the watch cache")?;
    let audit = config
        .audit
        .clone()
        .map(crate::observability::audit::AuditLog::start);
    let mut chains = config.chains.clone();
    if !chains.admission.iter().any(|s| s.name() == "PodSecurity") {
        chains.add(Arc::new(crate::admission::pod_security::PodSecurity::new(
            config.pod_security.clone(),
        )));
    }
    let plugins = config.plugins.then(|| {
        let manager = PluginManager::new(
            PluginsConfig {
                dir: config.plugin_dir.clone(),
                cache_dir: config.data_dir.join("plugin-cache"),
            },
            store.clone(),
        );
        chains.add(Arc::new(PluginAdmission::new(manager.clone())));
        chains
            .initializer_sources
            .push(Arc::new(PluginInitializers(manager.clone())));
        manager
    });
    let state = AppState::new(crate::state::Parts {
        store,
        cache,
        tokens: token_file,
        chains,
        audit,
        signer: crate::authentication::sa_token::TokenSigner::from_pem(pki.sa_key_pem())
            .context("load the ServiceAccount signing key")?,
        server_address: addr.to_string(),
        settings: config.settings.clone(),
        kubelet: {
            let (cert, key) = pki
                .issue_client_cert(
                    crate::kubelet::CLIENT_COMMON_NAME,
                    &[trellis_api::user::groups::MASTERS],
                    crate::kubelet::CLIENT_CERT_DAYS,
                )
                .context("issue the API server's client certificate for nodes")?;
            crate::kubelet::KubeletClient::new(&cert, &key)
                .context("prepare the client for nodes' log endpoints")?
        },
    });
    state
        .bootstrap()
        .await
        .context("create the initial namespaces")?;
    // Before serving: a Service whose allocation key went missing gets it back before
    // a create could hand its ClusterIP or NodePort out again.
    crate::registry::service::start_repair(state.clone(), stop.subscribe())
        .await
        .context("repair the Service allocations")?;
    let cluster: Arc<dyn crate::admission::Cluster> = state.clone();
    state.chains.attach(&cluster);
    if let Some(manager) = plugins {
        state
            .install_plugin_crd()
            .await
            .context("install the Plugin resource")?;
        state
            .publish_builtin_plugins(&config.builtin_plugins)
            .await
            .context("publish the built-in controllers' Plugin objects")?;
        let _ = state.plugins.set(manager.clone());
        manager.start(cluster);
    }
    if config.namespace_controller {
        crate::registry::namespace::start_controller(state.clone(), stop.subscribe());
    }
    let reconciler = crate::service_reconciler::start(
        state.clone(),
        crate::service_reconciler::Config {
            advertise_address: advertise,
            port: addr.port(),
            kubernetes_service_ip,
            cluster_dns_service_ip: config.cluster_dns_service_ip,
            timing: config.endpoint_reconciler.clone(),
        },
        stop.subscribe(),
    );
    let ca_pem = pki.ca_pem().to_owned();
    crate::aggregator::start(
        &state,
        config.aggregator.clone(),
        pki.dir(),
        &ca_pem,
        stop.subscribe(),
    )
    .await
    .context("start the aggregation layer")?;
    crate::certificates::start(
        state.clone(),
        Arc::new(pki),
        config.signing.clone(),
        config.csr_cleaning.clone(),
        stop.subscribe(),
    );
    let stalled = state.metrics.stalled_connections.clone();
    let app = router(state);
    let in_process = app.clone();
    let acceptor = TlsAcceptor::from(tls_config);
    let grace = config.shutdown_grace;
    info!(%url, kubeconfig = %kubeconfig_path.display(), "API server ready");

    let settings = config.settings.clone();
    let task = tokio::spawn(async move {
        let accept = trellis_pki::serve::Config {
            name: "API server",
            handshake_timeout: TLS_HANDSHAKE_TIMEOUT,
            max_connections: None,
        };
        let handler = stopped.clone();
        let serve = move |tls: tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
                          remote: SocketAddr| {
            let peer = peer_certificate(&tls)
                .map(|cert| tls::peer_from_cert(cert))
                .unwrap_or_default();
            let (app, settings, stop, stalled) = (
                app.clone(),
                settings.clone(),
                handler.clone(),
                stalled.clone(),
            );
            async move {
                connection::serve(tls, app, peer, &settings, stop, remote, stalled).await;
            }
        };
        let connections = futures::future::join_all(listeners.into_iter().map(|listener| {
            trellis_pki::serve::serve(
                listener,
                acceptor.clone(),
                accept.clone(),
                stopped.clone(),
                serve.clone(),
            )
        }))
        .await;
        let closed = futures::future::join_all(connections.into_iter().map(|c| c.closed()));
        tokio::select! {
            _ = closed => {}
            () = tokio::time::sleep(grace) => warn!("stopping with requests still in flight"),
        }
        // This server leaves the `kubernetes` endpoints before the store closes.
        if let Err(e) = reconciler.await {
            warn!(error = %e, "the built-in Services' reconciler failed");
        }
        info!("API server stopped");
        anyhow::Ok(())
    });
    Ok(Server {
        addr,
        url,
        kubeconfig: kubeconfig_path,
        admin_token,
        ca_pem,
        in_process,
        stop,
        task,
    })
}
