//! `trellis bench api`: request throughput and latency of the API server, as a client
//! sees them over HTTPS.
//!
//! Without `--kubeconfig` a server is started in this process on an embedded store in a
//! temporary directory, and the clients authenticate with its admin bearer token. With
//! `--kubeconfig` the server, the cluster CA and the credentials (a token or a client
//! certificate) come from the file's current context, and the objects stay behind.
//!
//! Each of `--clients` tasks holds its own TLS connection, speaking HTTP/1.1 (or HTTP/2
//! with `--http2`), opened before the clock starts; together they send `--ops`
//! requests, one at a time each. The client is hyper's connection API without a pool:
//! about 20 µs of CPU per request, half of what `hey` spends, which matters when the
//! server runs in the same process on a small machine.
//!
//! `create` POSTs objects with unique names to `/api/v1/namespaces/default/{kind}`;
//! `get` first creates up to [`GET_OBJECTS`] objects, then reads them round-robin. A
//! short warm-up, not counted, precedes the measured requests.
//!
//! Every response is checked: any status but 201 (create) or 200 (get), a transport
//! error or a request that takes longer than [`CALL_TIMEOUT`] ends the run with an
//! error carrying the server's `Status` message, so a printed report counts only
//! successes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use base64::Engine as _;
use bytes::Bytes;
use clap::builder::RangedU64ValueParser;
use clap::{Args, ValueEnum};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use trellis_store::{RedbConfig, RedbStore};

use super::{CALL_TIMEOUT, Percentiles, run_id, share};

mod process;
mod watch;

/// Objects a `get` run creates and then reads: enough that reads spread over many
/// keys, few enough that setting them up stays short.
const GET_OBJECTS: usize = 1000;

/// Most requests of the warm-up: enough to settle connections, buffers and the store
/// file, small enough not to dominate short runs.
const MAX_WARMUP: usize = 1000;

/// Where every object of the benchmark lives; the namespace every cluster has.
const NAMESPACE: &str = "default";

#[derive(Debug, Args)]
pub struct ApiArgs {
    /// Measure the cluster of this kubeconfig's current context (its server, CA and
    /// token or client certificate). Without it a server is started in this process on
    /// a temporary data directory.
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,

    /// Concurrent clients, each on its own connection; they share the requests. With
    /// `--verb watch`, the watchers.
    #[arg(long, default_value_t = 50, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    clients: usize,

    /// Measured requests in total, not counting the warm-up and a `get` run's setup.
    /// With `--verb watch`, the creates every watcher must see.
    #[arg(long, default_value_t = 10_000, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    ops: usize,

    /// The resource to create or read.
    #[arg(long, value_enum)]
    kind: Kind,

    /// What each request does.
    #[arg(long, value_enum)]
    verb: Verb,

    /// Bytes of each ConfigMap's one data value (pods carry no payload).
    #[arg(long, default_value_t = 256, value_name = "BYTES")]
    value_size: usize,

    /// With `--verb watch`, creates per second. Paced rather than flat out, so the
    /// figure is delivery latency, not queueing behind a backlog.
    #[arg(long, default_value_t = 100, value_name = "CREATES_PER_SEC", value_parser = RangedU64ValueParser::<u32>::new().range(1..))]
    rate: u32,

    /// Measure as this ServiceAccount rather than as the admin: it is created (with
    /// its namespace), bound to the `edit` ClusterRole in the benchmark's namespace by
    /// a RoleBinding, and given a token by a TokenRequest. Every request then goes
    /// through authentication of a ServiceAccount token and RBAC, as a controller's
    /// would.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    as_serviceaccount: Option<String>,

    /// With `--verb relist`, objects per page (`limit`).
    #[arg(long, default_value_t = 500, value_name = "N", value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    page_size: usize,

    /// Speak HTTP/2 (one stream at a time per connection), as kubectl and client-go
    /// do, instead of HTTP/1.1. HTTP/1.1 is the default because it costs both sides
    /// less CPU, so the figure is the server's rather than the protocol's.
    #[arg(long)]
    http2: bool,

    /// With `--verb watch --http2`, open this many connections and spread the watchers
    /// over them as streams, as one client-go process runs all its informers over one
    /// connection. Default: one connection per watcher.
    #[arg(long, value_name = "N", requires = "http2", value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    connections: Option<usize>,

    /// Start the server as a child process rather than in this one, and report its
    /// memory after the run: its resident set size a second after the last request
    /// and the largest it reached.
    #[arg(long, conflicts_with = "kubeconfig")]
    server_process: bool,

    /// With `--server-process`, run this program's `server` instead of this one's:
    /// another build of the server measured by the same client, for an A/B comparison.
    #[arg(long, value_name = "PROGRAM", requires = "server_process")]
    server_exe: Option<PathBuf>,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Kind {
    /// ConfigMaps holding `--value-size` bytes.
    #[value(name = "configmaps")]
    ConfigMaps,
    /// Pods with one container: the object the control plane handles most.
    Pods,
}

impl Kind {
    /// The resource's plural, as in the path.
    fn plural(self) -> &'static str {
        match self {
            Kind::ConfigMaps => "configmaps",
            Kind::Pods => "pods",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Verb {
    /// POST new objects.
    Create,
    /// GET existing objects.
    Get,
    /// Watch the collection from `--clients` connections while one more creates
    /// objects at `--rate`; latency is a create's acknowledgement to its arrival at the
    /// last watcher, and requests/s the creates'.
    Watch,
    /// Create `--ops` objects, then list them all in pages of `--page-size`, following
    /// the continue tokens, as an informer's relist does; requests/s is objects listed
    /// per second, latency a page's.
    Relist,
}

impl Verb {
    fn name(self) -> &'static str {
        match self {
            Verb::Create => "create",
            Verb::Get => "get",
            Verb::Watch => "watch",
            Verb::Relist => "relist",
        }
    }
}

#[derive(Debug, Serialize)]
struct Report {
    kind: &'static str,
    verb: &'static str,
    clients: usize,
    /// Connections the clients share, when fewer than the clients (`--connections`).
    #[serde(skip_serializing_if = "Option::is_none")]
    connections: Option<usize>,
    ops: usize,
    ops_per_sec: f64,
    /// Request latency; for `watch`, an event's acknowledgement → its arrival at the
    /// last watcher.
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    /// `watch` only: every delivery, acknowledgement → arrival at that watcher.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    delivery: Option<Delivery>,
    /// Failed requests. Always 0 in a printed report: the first failure ends the run
    /// with an error instead, so that a figure never hides failures.
    errors: usize,
    /// With `--server-process`: the server's memory after the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    server_memory: Option<process::Memory>,
}

/// Per-delivery latency of a watch run: one sample per watcher and event.
#[derive(Debug, Serialize)]
struct Delivery {
    deliveries: usize,
    delivery_p50_ms: f64,
    delivery_p99_ms: f64,
    delivery_max_ms: f64,
}

/// How long the server settles after the run before its memory is read: long enough
/// for requests' buffers to be freed, short next to a run.
const SETTLE: Duration = Duration::from_secs(1);

pub async fn run(args: ApiArgs) -> anyhow::Result<()> {
    if args.connections.is_some() && args.verb != Verb::Watch {
        bail!("--connections applies to --verb watch only");
    }
    let report = match &args.kubeconfig {
        Some(path) => {
            let target = Target::from_kubeconfig(path, args.http2)?;
            tracing::info!(server = %target.base, "measuring the kubeconfig's cluster");
            measure(&target, &args).await?
        }
        None if args.server_process => {
            let mut server =
                process::ChildServer::start(args.server_exe.as_deref(), args.http2).await?;
            let measured = measure(&server.target, &args).await;
            tokio::time::sleep(SETTLE).await;
            let memory = server.memory();
            let stopped = server.stop().await;
            let mut report = measured?;
            report.server_memory = Some(memory?);
            stopped?;
            report
        }
        None => {
            let cluster = LocalCluster::start().await?;
            let target = Target::new(
                &cluster.server.url,
                &cluster.server.ca_pem,
                Credentials::Token(cluster.server.admin_token.clone()),
                args.http2,
            )?;
            let measured = measure(&target, &args).await;
            // Stop even after a failed run, but report the run's error first.
            let stopped = cluster.stop().await;
            let report = measured?;
            stopped?;
            report
        }
    };

    super::print_report(args.json, &report, || {
        let memory = report.server_memory.map_or(String::new(), |m| {
            format!(
                "; server RSS {:.1} MiB, peak {:.1} MiB",
                m.rss_mib, m.peak_rss_mib
            )
        });
        let (what, delivery) = match &report.delivery {
            Some(d) => (
                " to the last watcher",
                format!(
                    "; per delivery ({}) p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
                    d.deliveries, d.delivery_p50_ms, d.delivery_p99_ms, d.delivery_max_ms
                ),
            ),
            None => ("", String::new()),
        };
        let shared = report
            .connections
            .map_or(String::new(), |n| format!(" on {n} connections"));
        format!(
            "api {} {}: {} clients{shared}, {} requests: {:.0} requests/s, \
             latency{what} p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms{delivery}{memory}",
            report.verb,
            report.kind,
            report.clients,
            report.ops,
            report.ops_per_sec,
            report.p50_ms,
            report.p99_ms,
            report.max_ms,
        )
    })?;
    Ok(())
}

async fn measure(target: &Target, args: &ApiArgs) -> anyhow::Result<Report> {
    let as_account;
    let target = match &args.as_serviceaccount {
        Some(account) => {
            as_account = service_account_target(target, account)
                .await
                .with_context(|| format!("prepare the ServiceAccount {account}"))?;
            &as_account
        }
        None => target,
    };
    match args.verb {
        Verb::Create => measure_requests(target, args, false).await,
        Verb::Get => measure_requests(target, args, true).await,
        Verb::Watch => watch::measure(target, args).await,
        Verb::Relist => measure_relist(target, args).await,
    }
}

/// `target` with the token of ServiceAccount `NAMESPACE/NAME`, which `target`'s own
/// credentials create and bind to `edit` in the benchmark's namespace.
async fn service_account_target(target: &Target, account: &str) -> anyhow::Result<Target> {
    let (namespace, name) = account
        .split_once('/')
        .context("name the ServiceAccount as NAMESPACE/NAME")?;
    if target.authorization.is_none() {
        bail!("--as-serviceaccount needs credentials that are a token, not a client certificate");
    }
    let create = |path: String, body: serde_json::Value| async move {
        let (status, answer) =
            exchange(target, Method::POST, &path, body.to_string().into_bytes()).await?;
        if status != StatusCode::CREATED && status != StatusCode::CONFLICT {
            bail!("POST {path}: {status}: {}", status_message(&answer));
        }
        anyhow::Ok(answer)
    };
    create(
        "/api/v1/namespaces".into(),
        serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}),
    )
    .await?;
    create(
        format!("/api/v1/namespaces/{namespace}/serviceaccounts"),
        serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}),
    )
    .await?;
    create(
        format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/rolebindings"),
        serde_json::json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": format!("bench-{namespace}-{name}")},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]}),
    )
    .await?;
    let answer = create(
        format!("/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"),
        serde_json::json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600}}),
    )
    .await?;
    let answer: serde_json::Value =
        serde_json::from_slice(&answer).context("decode the TokenRequest")?;
    let token = answer["status"]["token"]
        .as_str()
        .context("the TokenRequest has no token")?;
    let authorization = HeaderValue::try_from(format!("Bearer {token}"))
        .context("use the token in an Authorization header")?;
    Ok(Target {
        authorization: Some(authorization),
        ..target.clone()
    })
}

/// Creates `--ops` objects, then lists them in pages, timing the whole relist and each
/// page. The pages after the first must cost what the first does: a server that
/// counts what remains on every page makes a relist quadratic.
async fn measure_relist(target: &Target, args: &ApiArgs) -> anyhow::Result<Report> {
    let connections = connect_all(target, args.clients)
        .await
        .context("connect the clients")?;
    // A namespace of the run's own, so the list holds exactly this run's objects.
    let namespace = format!("relist-{}", run_id());
    let mut admin = connect(
        &target.addr,
        target.server_name.clone(),
        target.tls.clone(),
        target.http2,
    )
    .await
    .context("connect the lister")?;
    let ns = serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}});
    let request = build_request(
        &target.base,
        target.http2,
        target.authorization.as_ref(),
        &Method::POST,
        "/api/v1/namespaces",
        Bytes::from(ns.to_string()),
    )?;
    call(&mut admin, request, StatusCode::CREATED)
        .await
        .context("create the run's namespace")?;
    let collection = format!("/api/v1/namespaces/{namespace}/{}", args.kind.plural());
    let setup = Plan::Create {
        collection: collection.clone(),
        prefix: "o".into(),
        body: ObjectBody::new(args.kind, args.value_size),
    };
    drive(target, connections, &setup, args.ops)
        .await
        .context("create the objects to list")?;

    let started = Instant::now();
    let mut latencies = Vec::new();
    let mut listed = 0;
    let mut token = String::new();
    loop {
        let path = format!(
            "{collection}?limit={}{}",
            args.page_size,
            if token.is_empty() {
                String::new()
            } else {
                format!("&continue={token}")
            }
        );
        let request = build_request(
            &target.base,
            target.http2,
            target.authorization.as_ref(),
            &Method::GET,
            &path,
            Bytes::new(),
        )?;
        let page_started = Instant::now();
        let (status, body) = send_and_read(&mut admin, request).await?;
        latencies.push(page_started.elapsed());
        if status != StatusCode::OK {
            bail!("list page: {status}: {}", status_message(&body));
        }
        let page: serde_json::Value = serde_json::from_slice(&body).context("decode a page")?;
        listed += page["items"].as_array().map_or(0, Vec::len);
        match page["metadata"]["continue"].as_str() {
            Some(next) if !next.is_empty() => token = next.to_owned(),
            _ => break,
        }
    }
    let elapsed = started.elapsed();
    if listed != args.ops {
        bail!("the relist returned {listed} objects, not {}", args.ops);
    }
    let percentiles = Percentiles::of(&mut latencies);
    Ok(Report {
        kind: args.kind.plural(),
        verb: args.verb.name(),
        clients: 1,
        connections: None,
        ops: listed,
        ops_per_sec: (listed as f64 / elapsed.as_secs_f64()).round(),
        p50_ms: percentiles.p50_ms,
        p99_ms: percentiles.p99_ms,
        max_ms: percentiles.max_ms,
        delivery: None,
        errors: 0,
        server_memory: None,
    })
}

/// Creates (or with `reads`, GETs) over `--clients` connections.
async fn measure_requests(target: &Target, args: &ApiArgs, reads: bool) -> anyhow::Result<Report> {
    let mut connections = connect_all(target, args.clients)
        .await
        .context("connect the clients")?;
    let prefix = format!("bench-{}", run_id());
    let body = ObjectBody::new(args.kind, args.value_size);
    let collection = format!("/api/v1/namespaces/{NAMESPACE}/{}", args.kind.plural());
    if args.kubeconfig.is_some() {
        tracing::info!(namespace = NAMESPACE, %prefix, "objects of this run stay behind, named after the prefix");
    }
    let create = |phase: &str| Plan::Create {
        collection: collection.clone(),
        prefix: format!("{prefix}-{phase}"),
        body: body.clone(),
    };
    let warmup = (args.ops / 10).min(MAX_WARMUP);

    let (warmup_plan, measured_plan) = if reads {
        let objects = args.ops.min(GET_OBJECTS);
        let setup = create("g");
        connections = drive(target, connections, &setup, objects)
            .await
            .context("create the objects to read")?
            .0;
        let names: Arc<[String]> = (0..objects).map(|i| setup.name(i)).collect();
        let get = Plan::Get {
            collection: collection.clone(),
            names,
        };
        (get.clone(), get)
    } else {
        (create("w"), create("m"))
    };
    connections = drive(target, connections, &warmup_plan, warmup)
        .await
        .context("warm up")?
        .0;
    tracing::debug!(requests = warmup, "warm-up done");

    let started = Instant::now();
    let (connections, mut latencies) =
        drive(target, connections, &measured_plan, args.ops)
            .await
            .with_context(|| format!("{} {}", args.verb.name(), args.kind.plural()))?;
    let elapsed = started.elapsed();
    drop(connections);

    let percentiles = Percentiles::of(&mut latencies);
    Ok(Report {
        kind: args.kind.plural(),
        verb: args.verb.name(),
        clients: args.clients,
        connections: None,
        ops: args.ops,
        ops_per_sec: (args.ops as f64 / elapsed.as_secs_f64()).round(),
        p50_ms: percentiles.p50_ms,
        p99_ms: percentiles.p99_ms,
        max_ms: percentiles.max_ms,
        delivery: None,
        errors: 0,
        server_memory: None,
    })
}

/// A server started in this process on an embedded store in a temporary directory.
#[derive(Debug)]
pub(crate) struct LocalCluster {
    pub(crate) server: trellis_apiserver::Server,
    redb: Arc<RedbStore>,
    /// The data directory. Dropped last: the store and the server's credentials live in
    /// it.
    pub(crate) dir: tempfile::TempDir,
}

impl LocalCluster {
    pub(crate) async fn start() -> anyhow::Result<Self> {
        Self::start_with(|_| Ok(())).await
    }

    /// Starts a server whose configuration `configure` may change first.
    pub(crate) async fn start_with(
        configure: impl FnOnce(&mut trellis_apiserver::Config) -> anyhow::Result<()>,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("trellis-bench-")
            .tempdir()
            .context("create a temporary data directory")?;
        let path = dir.path().join("store.redb");
        let redb = Arc::new(
            RedbStore::open(RedbConfig::new(&path))
                .with_context(|| format!("open the redb store {}", path.display()))?,
        );
        let mut config = trellis_apiserver::Config {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            ..trellis_apiserver::Config::new(dir.path())
        };
        configure(&mut config)?;
        // Stopped through `Server::stop`, never by this signal.
        let started =
            trellis_apiserver::start(config, redb.clone(), std::future::pending::<()>()).await;
        let server = match started {
            Ok(server) => server,
            Err(e) => {
                if let Err(close) = redb.close().await {
                    tracing::warn!(error = %format!("{close:#}"), "failed to close the redb store");
                }
                return Err(e.context("start the API server"));
            }
        };
        tracing::info!(url = %server.url, "started an API server in this process");
        Ok(Self { server, redb, dir })
    }

    /// Stops the server, then closes the store under it.
    pub(crate) async fn stop(self) -> anyhow::Result<()> {
        let stopped = self.server.stop().await.context("stop the API server");
        self.redb.close().await.context("close the redb store")?;
        stopped
    }
}

/// How the clients prove who they are.
#[derive(Debug)]
enum Credentials {
    /// `Authorization: Bearer`.
    Token(String),
    /// A client certificate chain and its key, PEM.
    ClientCert { cert_pem: Vec<u8>, key_pem: Vec<u8> },
}

/// Where the clients connect and how.
#[derive(Clone, Debug)]
pub(crate) struct Target {
    /// `https://host:port`, without a path.
    base: Uri,
    /// `host:port` to dial.
    addr: String,
    server_name: ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
    /// `Bearer …`, when the credentials are a token.
    authorization: Option<HeaderValue>,
    http2: bool,
}

impl Target {
    fn new(
        server: &str,
        ca_pem: &str,
        credentials: Credentials,
        http2: bool,
    ) -> anyhow::Result<Self> {
        let base: Uri = server
            .parse()
            .with_context(|| format!("parse the server URL {server:?}"))?;
        if base.scheme_str() != Some("https") {
            bail!("check the server URL {server:?}: only https is supported");
        }
        let host = base
            .host()
            .with_context(|| format!("check the server URL {server:?}: it has no host"))?;
        let port = base.port_u16().unwrap_or(443);
        let addr = format!("{host}:{port}");
        // The URI keeps an IPv6 address in brackets; a server name has none.
        let server_name = ServerName::try_from(host.trim_start_matches('[').trim_end_matches(']'))
            .with_context(|| format!("use {host:?} as the TLS server name"))?
            .to_owned();

        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots
                .add(cert.context("parse the cluster CA certificate")?)
                .context("trust the cluster CA certificate")?;
        }
        if roots.is_empty() {
            bail!("check the cluster CA: it holds no certificate");
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("select TLS protocol versions")?
            .with_root_certificates(roots);
        let (mut tls, authorization) = match credentials {
            Credentials::Token(token) => {
                let value = HeaderValue::try_from(format!("Bearer {token}"))
                    .context("use the token in an Authorization header")?;
                (builder.with_no_client_auth(), Some(value))
            }
            Credentials::ClientCert { cert_pem, key_pem } => {
                let chain = CertificateDer::pem_slice_iter(&cert_pem)
                    .collect::<Result<Vec<_>, _>>()
                    .context("parse the client certificate")?;
                let key =
                    PrivateKeyDer::from_pem_slice(&key_pem).context("parse the client key")?;
                let config = builder
                    .with_client_auth_cert(chain, key)
                    .context("use the client certificate")?;
                (config, None)
            }
        };
        tls.alpn_protocols = vec![if http2 {
            b"h2".to_vec()
        } else {
            b"http/1.1".to_vec()
        }];
        Ok(Self {
            base,
            addr,
            server_name,
            tls: Arc::new(tls),
            authorization,
            http2,
        })
    }

    /// The server, CA and credentials of `path`'s current context. Files it names are
    /// relative to its directory, as kubectl reads them.
    pub(crate) fn from_kubeconfig(path: &Path, http2: bool) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("read the kubeconfig {}", path.display()))?;
        let config: Kubeconfig = serde_saphyr::from_str(&text)
            .with_context(|| format!("parse the kubeconfig {}", path.display()))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let (cluster, user) = config
            .current()
            .with_context(|| format!("read the kubeconfig {}", path.display()))?;
        let ca_pem = pem(
            dir,
            "certificate-authority",
            cluster.certificate_authority_data.as_deref(),
            cluster.certificate_authority.as_deref(),
        )?
        .context("check the cluster: it names no certificate-authority(-data)")?;
        let ca_pem = String::from_utf8(ca_pem).context("read the cluster CA as PEM text")?;
        let credentials = if let Some(token) = &user.token {
            Credentials::Token(token.clone())
        } else {
            let cert_pem = pem(
                dir,
                "client-certificate",
                user.client_certificate_data.as_deref(),
                user.client_certificate.as_deref(),
            )?;
            let key_pem = pem(
                dir,
                "client-key",
                user.client_key_data.as_deref(),
                user.client_key.as_deref(),
            )?;
            match (cert_pem, key_pem) {
                (Some(cert_pem), Some(key_pem)) => Credentials::ClientCert { cert_pem, key_pem },
                _ => {
                    bail!("check the user: it has neither a token nor a client certificate and key")
                }
            }
        };
        Self::new(&cluster.server, &ca_pem, credentials, http2)
    }
}

/// PEM from a kubeconfig's `{field}-data` (base64) or `{field}` (a file).
fn pem(
    dir: &Path,
    field: &str,
    data: Option<&str>,
    file: Option<&Path>,
) -> anyhow::Result<Option<Vec<u8>>> {
    if let Some(data) = data {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .with_context(|| format!("decode {field}-data as base64"))?;
        return Ok(Some(decoded));
    }
    match file {
        Some(file) => {
            let path = dir.join(file);
            let contents =
                std::fs::read(&path).with_context(|| format!("read {field} {}", path.display()))?;
            Ok(Some(contents))
        }
        None => Ok(None),
    }
}

/// The parts of a kubeconfig the benchmark reads.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Kubeconfig {
    #[serde(default)]
    current_context: String,
    #[serde(default)]
    clusters: Vec<NamedCluster>,
    #[serde(default)]
    users: Vec<NamedUser>,
    #[serde(default)]
    contexts: Vec<NamedContext>,
}

#[derive(Debug, Deserialize)]
struct NamedCluster {
    name: String,
    cluster: Cluster,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Cluster {
    server: String,
    certificate_authority_data: Option<String>,
    certificate_authority: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
struct NamedUser {
    name: String,
    user: User,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct User {
    token: Option<String>,
    client_certificate_data: Option<String>,
    client_key_data: Option<String>,
    client_certificate: Option<PathBuf>,
    client_key: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
struct NamedContext {
    name: String,
    context: Context,
}

#[derive(Debug, Deserialize)]
struct Context {
    cluster: String,
    user: String,
}

impl Kubeconfig {
    /// The cluster and user of the current context.
    fn current(&self) -> anyhow::Result<(&Cluster, &User)> {
        if self.current_context.is_empty() {
            bail!("check current-context: it is not set");
        }
        let context = self
            .contexts
            .iter()
            .find(|c| c.name == self.current_context)
            .with_context(|| format!("find the context {:?}", self.current_context))?;
        let cluster = self
            .clusters
            .iter()
            .find(|c| c.name == context.context.cluster)
            .with_context(|| format!("find the cluster {:?}", context.context.cluster))?;
        let user = self
            .users
            .iter()
            .find(|u| u.name == context.context.user)
            .with_context(|| format!("find the user {:?}", context.context.user))?;
        Ok((&cluster.cluster, &user.user))
    }
}

/// One client's connection: it sends one request at a time.
#[derive(Debug)]
enum Connection {
    Http1(http1::SendRequest<Full<Bytes>>),
    Http2(http2::SendRequest<Full<Bytes>>),
}

impl Connection {
    async fn send(&mut self, request: Request<Full<Bytes>>) -> hyper::Result<Response<Incoming>> {
        match self {
            Connection::Http1(sender) => {
                sender.ready().await?;
                sender.send_request(request).await
            }
            Connection::Http2(sender) => {
                sender.ready().await?;
                sender.send_request(request).await
            }
        }
    }
}

/// Opens `clients` connections concurrently, each within [`CALL_TIMEOUT`].
async fn connect_all(target: &Target, clients: usize) -> anyhow::Result<Vec<Connection>> {
    let mut tasks = JoinSet::new();
    for client in 0..clients {
        let (addr, name, tls, http2) = (
            target.addr.clone(),
            target.server_name.clone(),
            target.tls.clone(),
            target.http2,
        );
        tasks.spawn(async move {
            let connection = tokio::time::timeout(CALL_TIMEOUT, connect(&addr, name, tls, http2))
                .await
                .unwrap_or_else(|_| bail!("no connection within {CALL_TIMEOUT:?}"))
                .with_context(|| format!("connect client {client} to {addr}"))?;
            anyhow::Ok((client, connection))
        });
    }
    let mut connections: Vec<Option<Connection>> = (0..clients).map(|_| None).collect();
    // Returning early drops `tasks`, which aborts the other connects.
    while let Some(joined) = tasks.join_next().await {
        let (client, connection) = joined.context("join a connecting task")??;
        connections[client] = Some(connection);
    }
    connections
        .into_iter()
        .enumerate()
        .map(|(client, c)| c.with_context(|| format!("connect client {client}: no connection")))
        .collect()
}

async fn connect(
    addr: &str,
    name: ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
    http2: bool,
) -> anyhow::Result<Connection> {
    let (connection, driver) = handshake(addr, name, tls, http2).await?;
    // The connection task ends when its sender is dropped or the server closes it.
    tokio::spawn(async move {
        if let Err(e) = driver.await {
            tracing::debug!(error = %e, "connection ended with an error");
        }
    });
    Ok(connection)
}

/// The future that does a connection's reads and writes; it must be polled for any
/// request on the connection to make progress.
type Driver = std::pin::Pin<Box<dyn Future<Output = hyper::Result<()>> + Send>>;

/// Opens a connection and hands back its [`Driver`] unspawned, so that a caller can
/// poll it in the same task that reads the responses: a response's bytes are then
/// seen in the poll that reads them from the socket, not after another task's wake-up.
async fn handshake(
    addr: &str,
    name: ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
    http2: bool,
) -> anyhow::Result<(Connection, Driver)> {
    let tcp = TcpStream::connect(addr)
        .await
        .context("open a TCP connection")?;
    tcp.set_nodelay(true).context("disable Nagle's algorithm")?;
    let stream = TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .context("complete the TLS handshake")?;
    let io = TokioIo::new(stream);
    if http2 {
        let (sender, connection) = http2::handshake(TokioExecutor::new(), io)
            .await
            .context("start HTTP/2")?;
        Ok((Connection::Http2(sender), Box::pin(connection)))
    } else {
        let (sender, connection) = http1::handshake(io).await.context("start HTTP/1.1")?;
        Ok((Connection::Http1(sender), Box::pin(connection)))
    }
}

/// A JSON object with a unique name spliced in: the bytes before and after the name.
#[derive(Clone, Debug)]
struct ObjectBody {
    before_name: Arc<str>,
    after_name: Arc<str>,
}

impl ObjectBody {
    fn new(kind: Kind, value_size: usize) -> Self {
        let (before_name, after_name) = match kind {
            Kind::ConfigMaps => (
                r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":""#.to_owned(),
                format!(r#""}},"data":{{"value":"{}"}}}}"#, "x".repeat(value_size)),
            ),
            Kind::Pods => (
                r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":""#.to_owned(),
                r#"","labels":{"team":"bench"}},"spec":{"containers":[{"name":"main","image":"registry.k8s.io/pause:3.10"}]}}"#
                    .to_owned(),
            ),
        };
        Self {
            before_name: before_name.into(),
            after_name: after_name.into(),
        }
    }

    fn with_name(&self, name: &str) -> Bytes {
        let mut body =
            String::with_capacity(self.before_name.len() + name.len() + self.after_name.len());
        body.push_str(&self.before_name);
        body.push_str(name);
        body.push_str(&self.after_name);
        Bytes::from(body)
    }
}

/// The requests of one phase: request `i` of a phase is the same whichever client
/// sends it.
#[derive(Clone, Debug)]
enum Plan {
    /// POST `{prefix}-{i}` to the collection.
    Create {
        collection: String,
        prefix: String,
        body: ObjectBody,
    },
    /// GET `names[i % names.len()]`.
    Get {
        collection: String,
        names: Arc<[String]>,
    },
}

impl Plan {
    fn name(&self, i: usize) -> String {
        match self {
            Plan::Create { prefix, .. } => format!("{prefix}-{i}"),
            Plan::Get { names, .. } => names[i % names.len()].clone(),
        }
    }

    fn expected(&self) -> StatusCode {
        match self {
            Plan::Create { .. } => StatusCode::CREATED,
            Plan::Get { .. } => StatusCode::OK,
        }
    }

    /// Request `i`: its method, its path and query, and its body.
    fn request(&self, i: usize) -> (Method, String, Bytes) {
        let name = self.name(i);
        match self {
            Plan::Create {
                collection, body, ..
            } => (Method::POST, collection.clone(), body.with_name(&name)),
            Plan::Get { collection, .. } => {
                (Method::GET, format!("{collection}/{name}"), Bytes::new())
            }
        }
    }
}

/// Sends `total` requests of `plan` over `connections`, one client task per connection
/// with an even share each, and returns the connections and every request's latency.
/// Client `c` sends requests `c`, `c + clients`, `c + 2 * clients`, …, so that `get`
/// reads go round-robin over the objects.
async fn drive(
    target: &Target,
    connections: Vec<Connection>,
    plan: &Plan,
    total: usize,
) -> anyhow::Result<(Vec<Connection>, Vec<Duration>)> {
    let clients = connections.len();
    let mut tasks = JoinSet::new();
    for (client, mut connection) in connections.into_iter().enumerate() {
        let n = share(total, clients, client);
        let plan = plan.clone();
        let (base, authorization, http2) = (
            target.base.clone(),
            target.authorization.clone(),
            target.http2,
        );
        tasks.spawn(async move {
            let mut latencies = Vec::with_capacity(n);
            for seq in 0..n {
                let (method, path, body) = plan.request(client + seq * clients);
                let request =
                    build_request(&base, http2, authorization.as_ref(), &method, &path, body)?;
                let sent = Instant::now();
                call(&mut connection, request, plan.expected())
                    .await
                    .with_context(|| format!("{method} {path}"))?;
                latencies.push(sent.elapsed());
            }
            anyhow::Ok((client, connection, latencies))
        });
    }
    let mut returned: Vec<Option<Connection>> = (0..clients).map(|_| None).collect();
    let mut latencies = Vec::with_capacity(total);
    // Returning early drops `tasks`, which aborts the other clients.
    while let Some(joined) = tasks.join_next().await {
        let (client, connection, l) = joined.context("join a client task")??;
        returned[client] = Some(connection);
        latencies.extend(l);
    }
    let connections = returned.into_iter().flatten().collect::<Vec<_>>();
    Ok((connections, latencies))
}

fn build_request(
    base: &Uri,
    http2: bool,
    authorization: Option<&HeaderValue>,
    method: &Method,
    path: &str,
    body: Bytes,
) -> anyhow::Result<Request<Full<Bytes>>> {
    let authority = base.authority().map(|a| a.as_str()).unwrap_or_default();
    // HTTP/2 takes the authority from the URI; HTTP/1.1 sends the path and a Host.
    let mut builder = if http2 {
        Request::builder().uri(format!("https://{authority}{path}"))
    } else {
        Request::builder().uri(path).header(header::HOST, authority)
    };
    builder = builder
        .method(method.clone())
        .header(header::ACCEPT, "application/json");
    if !body.is_empty() {
        builder = builder.header(header::CONTENT_TYPE, "application/json");
    }
    if let Some(authorization) = authorization {
        builder = builder.header(header::AUTHORIZATION, authorization.clone());
    }
    builder
        .body(Full::new(body))
        .with_context(|| format!("build the request {method} {path}"))
}

/// One request on a connection of its own, for the command-line client: the status
/// and the whole body, within [`CALL_TIMEOUT`].
pub(crate) async fn exchange(
    target: &Target,
    method: Method,
    path: &str,
    body: Vec<u8>,
) -> anyhow::Result<(StatusCode, Bytes)> {
    let mut connection = connect(
        &target.addr,
        target.server_name.clone(),
        target.tls.clone(),
        target.http2,
    )
    .await
    .with_context(|| format!("connect to {}", target.base))?;
    let request = build_request(
        &target.base,
        target.http2,
        target.authorization.as_ref(),
        &method,
        path,
        Bytes::from(body),
    )?;
    send_and_read(&mut connection, request).await
}

/// Sends `request` and reads the whole response within [`CALL_TIMEOUT`].
async fn send_and_read(
    connection: &mut Connection,
    request: Request<Full<Bytes>>,
) -> anyhow::Result<(StatusCode, Bytes)> {
    let exchange = async {
        let response = connection.send(request).await.context("send the request")?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .context("read the response")?
            .to_bytes();
        anyhow::Ok((status, body))
    };
    tokio::time::timeout(CALL_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| bail!("no answer within {CALL_TIMEOUT:?}"))
}

/// Sends `request` and reads the whole response within [`CALL_TIMEOUT`]; fails with
/// the server's message unless the status is `expected`.
async fn call(
    connection: &mut Connection,
    request: Request<Full<Bytes>>,
    expected: StatusCode,
) -> anyhow::Result<()> {
    let (status, body) = send_and_read(connection, request).await?;
    if status != expected {
        bail!(
            "the server answered {status} (expected {expected}): {}",
            status_message(&body)
        );
    }
    Ok(())
}

/// The message of a Kubernetes `Status` body, or the body itself, shortened.
fn status_message(body: &[u8]) -> String {
    /// Enough of a body that is not a `Status` to recognize it.
    const MAX_CHARS: usize = 200;
    #[derive(Deserialize)]
    struct Status {
        message: String,
    }
    match serde_json::from_slice::<Status>(body) {
        Ok(status) => status.message,
        Err(_) => String::from_utf8_lossy(body)
            .chars()
            .take(MAX_CHARS)
            .collect(),
    }
}

#[cfg(test)]
// A panic is how a test reports failure.
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_json_with_the_name_and_the_value() {
        let body = ObjectBody::new(Kind::ConfigMaps, 3).with_name("a-1");
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["metadata"]["name"], "a-1");
        assert_eq!(value["data"]["value"], "xxx");
        let body = ObjectBody::new(Kind::Pods, 3).with_name("p-1");
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["kind"], "Pod");
        assert_eq!(value["spec"]["containers"][0]["name"], "main");
    }

    #[test]
    fn gets_go_round_robin_over_the_names() {
        let plan = Plan::Get {
            collection: "/api/v1/namespaces/default/pods".into(),
            names: ["a".to_owned(), "b".to_owned()].into(),
        };
        let paths: Vec<String> = (0..3).map(|i| plan.request(i).1).collect();
        assert_eq!(
            paths,
            [
                "/api/v1/namespaces/default/pods/a",
                "/api/v1/namespaces/default/pods/b",
                "/api/v1/namespaces/default/pods/a"
            ]
        );
    }

    #[test]
    fn status_message_prefers_the_status_message() {
        let status = br#"{"kind":"Status","message":"configmaps \"a\" already exists"}"#;
        assert_eq!(status_message(status), r#"configmaps "a" already exists"#);
        assert_eq!(status_message(b"plain text"), "plain text");
    }

    const CA: &str = "-----BEGIN CERTIFICATE-----\nQ0E=\n-----END CERTIFICATE-----\n";

    fn b64(text: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(text)
    }

    #[test]
    fn kubeconfig_current_context_picks_cluster_and_user() {
        let yaml = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n\
             - name: other\n  cluster:\n    server: https://10.0.0.1:6443\n\
             - name: trellis\n  cluster:\n    server: \"https://127.0.0.1:6443\"\n    certificate-authority-data: {}\n\
             users:\n- name: jane\n  user:\n    token: \"abc\"\n\
             contexts:\n- name: trellis\n  context:\n    cluster: trellis\n    user: jane\n\
             current-context: trellis\npreferences: {{}}\n",
            b64(CA)
        );
        let config: Kubeconfig = serde_saphyr::from_str(&yaml).unwrap();
        let (cluster, user) = config.current().unwrap();
        assert_eq!(cluster.server, "https://127.0.0.1:6443");
        assert_eq!(
            pem(
                Path::new("."),
                "certificate-authority",
                cluster.certificate_authority_data.as_deref(),
                None
            )
            .unwrap()
            .unwrap(),
            CA.as_bytes()
        );
        assert_eq!(user.token.as_deref(), Some("abc"));
    }

    #[test]
    fn kubeconfig_without_current_context_is_refused() {
        let config: Kubeconfig = serde_saphyr::from_str("apiVersion: v1\nkind: Config\n").unwrap();
        let message = format!("{:#}", config.current().unwrap_err());
        assert!(message.contains("current-context"), "{message}");
    }
}

/// `trellis bench admission`: what plugins in the admission chain cost a create.
#[derive(Debug, Args)]
pub struct AdmissionArgs {
    /// Copies of the plugin installed, each a Plugin object of its own.
    #[arg(long, default_value_t = 1)]
    plugins: usize,

    /// The validating plugin to install; by default the pod-policy example built by
    /// `plugins/build.sh`.
    #[arg(long, value_name = "FILE.wasm")]
    plugin: Option<PathBuf>,

    /// Its configuration (JSON).
    #[arg(long, default_value = r#"{"allowedRegistries":["registry.k8s.io/"]}"#)]
    config: String,

    /// Concurrent clients, each on its own connection.
    #[arg(long, default_value_t = 50, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    clients: usize,

    /// Measured creates per run (one run without plugins, one with, per round).
    #[arg(long, default_value_t = 10_000, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    ops: usize,

    /// Rounds of one run without plugins and one with, alternated so that a machine
    /// whose speed drifts between runs slows both sides alike. The report is the round
    /// with the median throughput ratio; every round's ratio is listed.
    #[arg(long, default_value_t = 3, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    rounds: usize,

    /// Print one JSON object instead of lines of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct AdmissionReport {
    plugins: usize,
    plugin: String,
    clients: usize,
    ops: usize,
    ops_per_sec: f64,
    p50_ms: f64,
    p99_ms: f64,
    baseline_ops_per_sec: f64,
    baseline_p50_ms: f64,
    baseline_p99_ms: f64,
    /// Creates/s with the plugins as a share of creates/s without (the median round's).
    throughput_ratio: f64,
    /// Every round's ratio, in the order run.
    throughput_ratios: Vec<f64>,
    /// Added p50 and p99 latency per plugin, in microseconds.
    overhead_p50_us_per_plugin: f64,
    overhead_p99_us_per_plugin: f64,
}

/// `--plugin`, else the pod-policy example built by `plugins/build.sh`; absolute.
pub(crate) fn plugin_or_bundled(plugin: Option<&Path>) -> anyhow::Result<PathBuf> {
    let plugin = plugin.map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../plugins/target/dist/pod-policy.wasm"),
        Path::to_path_buf,
    );
    std::fs::canonicalize(&plugin).with_context(|| {
        format!(
            "find the plugin {} (build it with `make plugins`, or pass --plugin)",
            plugin.display()
        )
    })
}

pub async fn run_admission(args: AdmissionArgs) -> anyhow::Result<()> {
    let plugin = plugin_or_bundled(args.plugin.as_deref())?;
    let api_args = |ops| ApiArgs {
        kubeconfig: None,
        clients: args.clients,
        ops,
        kind: Kind::Pods,
        verb: Verb::Create,
        value_size: 0,
        rate: 1,
        page_size: 500,
        as_serviceaccount: None,
        server_process: false,
        server_exe: None,
        http2: false,
        connections: None,
        json: false,
    };
    let mut rounds = Vec::with_capacity(args.rounds);
    for round in 1..=args.rounds {
        let baseline = measure_local(&api_args(args.ops), None, 0)
            .await
            .with_context(|| format!("round {round}: measure without plugins"))?;
        let with = measure_local(
            &api_args(args.ops),
            Some((&plugin, &args.config)),
            args.plugins,
        )
        .await
        .with_context(|| format!("round {round}: measure with {} plugins", args.plugins))?;
        let ratio = ((with.ops_per_sec / baseline.ops_per_sec) * 1000.0).round() / 1000.0;
        tracing::info!(round, ratio, "admission round measured");
        rounds.push((ratio, baseline, with));
    }
    let throughput_ratios: Vec<f64> = rounds.iter().map(|(ratio, ..)| *ratio).collect();
    rounds.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (throughput_ratio, baseline, with) = rounds.swap_remove(rounds.len() / 2);
    let per_plugin = |with: f64, without: f64| {
        if args.plugins == 0 {
            0.0
        } else {
            ((with - without) * 1000.0 / args.plugins as f64 * 10.0).round() / 10.0
        }
    };
    let report = AdmissionReport {
        plugins: args.plugins,
        plugin: plugin.display().to_string(),
        clients: args.clients,
        ops: args.ops,
        ops_per_sec: with.ops_per_sec,
        p50_ms: with.p50_ms,
        p99_ms: with.p99_ms,
        baseline_ops_per_sec: baseline.ops_per_sec,
        baseline_p50_ms: baseline.p50_ms,
        baseline_p99_ms: baseline.p99_ms,
        throughput_ratio,
        throughput_ratios,
        overhead_p50_us_per_plugin: per_plugin(with.p50_ms, baseline.p50_ms),
        overhead_p99_us_per_plugin: per_plugin(with.p99_ms, baseline.p99_ms),
    };
    super::print_report(args.json, &report, || {
        format!(
            "admission, pod creates with {} plugin(s), {} clients, {} requests: {:.0}/s \
             (without: {:.0}/s, {:.0} %; rounds {:?}), p50 {:.3} ms, p99 {:.3} ms \
             (without: {:.3} / {:.3} ms); per plugin +{:.1} µs p50, +{:.1} µs p99",
            report.plugins,
            report.clients,
            report.ops,
            report.ops_per_sec,
            report.baseline_ops_per_sec,
            report.throughput_ratio * 100.0,
            report.throughput_ratios,
            report.p50_ms,
            report.p99_ms,
            report.baseline_p50_ms,
            report.baseline_p99_ms,
            report.overhead_p50_us_per_plugin,
            report.overhead_p99_us_per_plugin,
        )
    })
}

/// Starts a server in this process, installs `copies` Plugin objects of `plugin`
/// (waiting until each serves), and measures creates.
async fn measure_local(
    args: &ApiArgs,
    plugin: Option<(&Path, &str)>,
    copies: usize,
) -> anyhow::Result<Report> {
    let cluster = LocalCluster::start().await?;
    let target = Target::new(
        &cluster.server.url,
        &cluster.server.ca_pem,
        Credentials::Token(cluster.server.admin_token.clone()),
        false,
    )?;
    let measured = async {
        if let Some((path, config)) = plugin {
            let config: serde_json::Value =
                serde_json::from_str(config).context("parse --config as JSON")?;
            for i in 0..copies {
                install_plugin(&target, &format!("bench-{i}"), path, &config).await?;
            }
        }
        measure(&target, args).await
    }
    .await;
    let stopped = cluster.stop().await;
    let report = measured?;
    stopped?;
    Ok(report)
}

async fn install_plugin(
    target: &Target,
    name: &str,
    path: &Path,
    config: &serde_json::Value,
) -> anyhow::Result<()> {
    let obj = serde_json::json!({
        "apiVersion": "trellis.dev/v1",
        "kind": "Plugin",
        "metadata": {"name": name},
        "spec": {
            "kind": "validating",
            "module": {"url": format!("file://{}", path.display())},
            "configuration": config,
            "rules": [{"operations": ["CREATE", "UPDATE"], "apiGroups": [""],
                       "apiVersions": ["v1"], "resources": ["pods"]}],
        },
    });
    let (status, body) = exchange(
        target,
        Method::POST,
        "/apis/trellis.dev/v1/plugins",
        obj.to_string().into_bytes(),
    )
    .await?;
    if status != StatusCode::CREATED {
        bail!("install plugin {name}: {status}: {}", status_message(&body));
    }
    // Measured on the code a plugin serves for good: a module's first load serves
    // Winch's code until Cranelift's is ready (the status's `tier`, refreshed every
    // 10 s).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (_, body) = exchange(
            target,
            Method::GET,
            &format!("/apis/trellis.dev/v1/plugins/{name}"),
            Vec::new(),
        )
        .await?;
        let obj: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let cond = &obj["status"]["conditions"][0];
        match cond["status"].as_str() {
            Some("True") if obj["status"]["tier"] == "optimized" => return Ok(()),
            Some("False") => bail!("load plugin {name}: {}", cond["message"]),
            _ if Instant::now() > deadline => {
                bail!("load plugin {name}: not serving optimized code within 120 s")
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}
