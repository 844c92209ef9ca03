//! `trellis metrics-server`: the resource metrics API (`metrics.k8s.io/v1beta1`
//! `NodeMetrics` and `PodMetrics`) that `kubectl top` and autoscalers read, as
//! Kubernetes' metrics-server serves it behind the aggregation layer.
//!
//! Every `--metric-resolution` it reads each node's Summary (`/stats/summary`, CPU and
//! memory only) through the API server's node proxy, and turns the cumulative CPU time
//! of two readings into a rate over the window between them (a pod, container or node
//! seen once has no figure yet, as metrics-server's). Requests come from the API
//! server's front proxy: the client certificate must chain to the request header CA
//! and carry an allowed name (both from the `extension-apiserver-authentication`
//! ConfigMap), and the user is read from its `X-Remote-*` headers; a certificate of
//! the cluster CA names its user itself. Each request is authorized by a
//! SubjectAccessReview, as metrics-server delegates authorization.
//!
//! `trellis up` runs it in its process and registers it: the Service and Endpoints
//! `kube-system/metrics-server` and the APIService `v1beta1.metrics.k8s.io`, whose
//! `caBundle` is the CA of the serving certificate made at start. Replacing that
//! APIService (and Service) hands the API to a real metrics-server.
//!
//! # Layout
//! - this file: settings, the command, starting, registering, the rights it needs.
//! - [`scrape`]: the readings and the metrics made from them.
//! - [`serve`]: HTTPS, authentication, authorization and the API's paths.

pub mod scrape;
pub mod serve;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use serde_json::json;
use tokio::task::JoinHandle;
use trellis_api::Shutdown;

use crate::flags::seconds;

/// Where the metrics server registers, as metrics-server's manifests name it.
pub const NAMESPACE: &str = "kube-system";
pub const SERVICE: &str = "metrics-server";
pub const APISERVICE: &str = "v1beta1.metrics.k8s.io";
/// The ClusterRole and ClusterRoleBinding [`grant`] applies, named as
/// metrics-server's manifests name them.
const ROLE: &str = "system:metrics-server";
/// The field manager of what [`register`] and [`grant`] apply.
const MANAGER: &str = "metrics-server";

/// Settings of the metrics server.
#[derive(Clone, Debug)]
pub struct Config {
    /// How often nodes are read (`--metric-resolution`, 15 s).
    pub metric_resolution: Duration,
    /// How long one node's reading may take.
    pub scrape_timeout: Duration,
    /// Where it serves HTTPS; port 0 picks one.
    pub listen: SocketAddr,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            metric_resolution: Duration::from_secs(15),
            scrape_timeout: Duration::from_secs(10),
            listen: SocketAddr::from(([0, 0, 0, 0], 4443)),
        }
    }
}

/// A metrics server running.
#[derive(Debug)]
pub struct MetricsServer {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// The CA of its serving certificate (PEM): an APIService's `caBundle`.
    pub ca_pem: String,
    task: JoinHandle<()>,
}

impl MetricsServer {
    /// Returns once it has stopped (its `stopped` signal came).
    pub async fn wait(self) -> anyhow::Result<()> {
        self.task.await.context("join the metrics server")
    }
}

/// Starts serving with `client`'s rights (nodes' stats through the API, pods,
/// SubjectAccessReviews, the authentication ConfigMap) until `stopped`.
pub async fn start(
    client: kube::Client,
    config: Config,
    stopped: Shutdown,
) -> anyhow::Result<MetricsServer> {
    let store = Arc::new(scrape::Store::default());
    tokio::spawn(scrape::run(
        client.clone(),
        store.clone(),
        config.clone(),
        stopped.clone(),
    ));
    serve_store(client, config, store, stopped).await
}

/// Serves what `store` holds, filled by someone else (a benchmark's made-up usage),
/// until `stopped`.
pub async fn serve_store(
    client: kube::Client,
    config: Config,
    store: Arc<scrape::Store>,
    stopped: Shutdown,
) -> anyhow::Result<MetricsServer> {
    let authentication = serve::Authentication::read(&client)
        .await
        .context("read the extension-apiserver-authentication ConfigMap")?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listen on {}", config.listen))?;
    let addr = listener
        .local_addr()
        .context("read the listening address")?;
    let identity =
        serve::ServingIdentity::generate(addr.ip()).context("make the serving certificate")?;
    let ca_pem = identity.ca_pem.clone();
    let server = serve::Server {
        client,
        store,
        authentication,
        warned_unreviewed: Default::default(),
    };
    let task = tokio::spawn(async move {
        if let Err(e) = serve::serve(Arc::new(server), listener, identity, stopped).await {
            tracing::warn!(error = %format!("{e:#}"), "the metrics server stopped");
        }
    });
    tracing::info!(%addr, "metrics server ready");
    Ok(MetricsServer { addr, ca_pem, task })
}

fn apply() -> PatchParams {
    PatchParams::apply(MANAGER).force()
}

/// Makes `server` the backend of `metrics.k8s.io/v1beta1`: a Service without a
/// selector, its Endpoints at `ip` and the server's port, and the APIService.
pub async fn register(
    client: &kube::Client,
    server: &MetricsServer,
    ip: IpAddr,
) -> anyhow::Result<()> {
    use base64::Engine as _;
    let port = server.addr.port();
    let services: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NAMESPACE,
        &ApiResource::erase::<k8s_openapi::api::core::v1::Service>(&()),
    );
    services
        .patch(
            SERVICE,
            &apply(),
            &Patch::Apply(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": SERVICE, "namespace": NAMESPACE,
                             "labels": {"k8s-app": "metrics-server"}},
                "spec": {"ports": [{"name": "https", "port": 443, "protocol": "TCP",
                                    "targetPort": port}]},
            })),
        )
        .await
        .context("apply the metrics-server Service")?;
    let endpoints: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NAMESPACE,
        &ApiResource::erase::<k8s_openapi::api::core::v1::Endpoints>(&()),
    );
    endpoints
        .patch(
            SERVICE,
            &apply(),
            &Patch::Apply(json!({
                "apiVersion": "v1", "kind": "Endpoints",
                "metadata": {"name": SERVICE, "namespace": NAMESPACE,
                             "labels": {"k8s-app": "metrics-server"}},
                "subsets": [{"addresses": [{"ip": ip.to_string()}],
                             "ports": [{"name": "https", "port": port, "protocol": "TCP"}]}],
            })),
        )
        .await
        .context("apply the metrics-server Endpoints")?;
    let apiservices: Api<DynamicObject> = Api::all_with(client.clone(), &apiservice_resource());
    apiservices
        .patch(
            APISERVICE,
            &apply(),
            &Patch::Apply(json!({
                "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
                "metadata": {"name": APISERVICE, "labels": {"k8s-app": "metrics-server"}},
                "spec": {
                    "service": {"name": SERVICE, "namespace": NAMESPACE, "port": 443},
                    "group": "metrics.k8s.io", "version": "v1beta1",
                    "caBundle": base64::engine::general_purpose::STANDARD.encode(&server.ca_pem),
                    "groupPriorityMinimum": 100, "versionPriority": 100,
                },
            })),
        )
        .await
        .context("apply the APIService v1beta1.metrics.k8s.io")?;
    Ok(())
}

/// `apiregistration.k8s.io/v1` APIServices.
pub fn apiservice_resource() -> ApiResource {
    ApiResource {
        group: "apiregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: "apiregistration.k8s.io/v1".into(),
        kind: "APIService".into(),
        plural: "apiservices".into(),
    }
}

/// The ServiceAccount user the metrics server of `trellis up` runs as.
pub fn identity() -> trellis_api::UserInfo {
    trellis_client::identity::controller(SERVICE)
}

/// Grants `user` what the metrics server does, as metrics-server's manifests do
/// (its ClusterRole, the auth delegator's reviews, the authentication
/// ConfigMap), plus `nodes/proxy`, since it reads nodes through the API server.
pub async fn grant(client: &kube::Client, user: &str) -> anyhow::Result<()> {
    let roles: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::erase::<k8s_openapi::api::rbac::v1::ClusterRole>(&()),
    );
    roles
        .patch(
            ROLE,
            &apply(),
            &Patch::Apply(json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": ROLE,
                             "labels": {"k8s-app": "metrics-server"}},
                "rules": [
                    {"apiGroups": [""], "resources": ["nodes/metrics", "nodes/stats", "nodes/proxy"],
                     "verbs": ["get"]},
                    {"apiGroups": [""], "resources": ["pods", "nodes"],
                     "verbs": ["get", "list", "watch"]},
                    {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"],
                     "verbs": ["create"]},
                    {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                     "verbs": ["create"]},
                    {"apiGroups": [""], "resources": ["configmaps"],
                     "resourceNames": ["extension-apiserver-authentication"],
                     "verbs": ["get", "list", "watch"]},
                ],
            })),
        )
        .await
        .context("apply the metrics server's ClusterRole")?;
    let bindings: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::erase::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>(&()),
    );
    bindings
        .patch(
            ROLE,
            &apply(),
            &Patch::Apply(json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": ROLE,
                             "labels": {"k8s-app": "metrics-server"}},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": ROLE},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
            })),
        )
        .await
        .context("apply the metrics server's ClusterRoleBinding")?;
    Ok(())
}

/// A metrics server in the API server's process, as `trellis up` runs one: as its
/// own user ([`identity`], granted what it needs by [`grant`]), served on
/// `config.listen` (loopback when that address cannot be bound) and registered as the
/// backend of `metrics.k8s.io` ([`register`]).
pub async fn start_in_process(
    in_process: &trellis_client::InProcess,
    config: Config,
    stopped: Shutdown,
) -> anyhow::Result<MetricsServer> {
    start_in_process_with(in_process, config, None, stopped).await
}

/// [`start_in_process`], serving `store` as it is filled elsewhere when given rather
/// than reading nodes.
pub async fn start_in_process_with(
    in_process: &trellis_client::InProcess,
    mut config: Config,
    store: Option<Arc<scrape::Store>>,
    stopped: Shutdown,
) -> anyhow::Result<MetricsServer> {
    let admin = in_process.client(trellis_api::UserInfo::new(
        "system:apiserver",
        [trellis_api::user::groups::MASTERS],
    ));
    let user = identity();
    grant(&admin, &user.name).await?;
    let ip = config.listen.ip();
    if ip.is_unspecified() || std::net::TcpListener::bind((ip, 0)).is_err() {
        config.listen = SocketAddr::from(([127, 0, 0, 1], config.listen.port()));
    }
    let client = in_process.client(user);
    let server = match store {
        Some(store) => serve_store(client, config, store, stopped).await?,
        None => start(client, config, stopped).await?,
    };
    register(&admin, &server, server.addr.ip()).await?;
    Ok(server)
}

/// `trellis metrics-server`'s flags.
#[derive(Debug, Args)]
pub struct MetricsServerArgs {
    /// The cluster and credentials the metrics server reads nodes and reviews access
    /// with.
    #[arg(long, value_name = "FILE")]
    kubeconfig: std::path::PathBuf,

    /// How often nodes' usage is read, in seconds.
    #[arg(long, default_value = "15", value_name = "SECONDS", value_parser = seconds)]
    metric_resolution: Duration,

    /// The address to serve HTTPS on.
    #[arg(long, default_value = "0.0.0.0", value_name = "IP")]
    bind_address: IpAddr,

    /// The port to serve HTTPS on (0 picks one).
    #[arg(long, default_value_t = 4443, value_name = "PORT")]
    secure_port: u16,

    /// Register as the APIService `v1beta1.metrics.k8s.io` at this address (the
    /// Service `kube-system/metrics-server` and its Endpoints), which the API server
    /// must reach; without it nothing is registered.
    #[arg(long, value_name = "IP")]
    advertise_address: Option<IpAddr>,
}

/// Runs `trellis metrics-server` until `shutdown`.
pub async fn run(
    args: MetricsServerArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let client = trellis_client::remote(&args.kubeconfig)
        .await
        .with_context(|| format!("connect with {}", args.kubeconfig.display()))?;
    let (stop, stopped) = trellis_api::shutdown::Shutdown::new();
    tokio::spawn(async move {
        shutdown.await;
        stop.stop();
    });
    let config = Config {
        metric_resolution: args.metric_resolution,
        listen: SocketAddr::new(args.bind_address, args.secure_port),
        ..Config::default()
    };
    let server = start(client.clone(), config, stopped).await?;
    if let Some(ip) = args.advertise_address {
        register(&client, &server, ip).await?;
        println!(
            "serving metrics.k8s.io/v1beta1 at https://{ip}:{}",
            server.addr.port()
        );
    }
    server.wait().await
}
