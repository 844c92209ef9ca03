//! The node's HTTPS server, the kubelet's (`pkg/kubelet/server`): the routes the API
//! server calls — `GET /containerLogs/{namespace}/{pod}/{container}` for `kubectl logs`
//! (read by [`crate::logs`]), `/exec/{namespace}/{pod}/{container}` for `kubectl exec`
//! (see [`crate::exec`]), `/portForward/{namespace}/{pod}` for `kubectl port-forward`
//! (see [`crate::port_forward`]), `/stats/summary` and `/metrics/resource` (the node's
//! resource usage, see [`crate::stats`]), `/metrics/dns` (the node's cluster DNS server, see
//! [`crate::services`]) and `/healthz` — and who may call them.
//! Start with [`serve`].
//!
//! # Who may call
//! There is no anonymous access: every connection must present a client certificate
//! the cluster CA signed, and without a CA [`serve`] refuses to start. Of those
//! clients, `/containerLogs`, `/exec`, `/portForward`, `/stats` and `/metrics` are
//! served to a certificate whose subject has `O=system:masters` (administrators, and
//! the API server's own certificate, which carries that group) or
//! `CN=kube-apiserver-kubelet-client` (the API server's name for its node client). The
//! kubelet asks the API server instead (a SubjectAccessReview of `nodes/proxy`,
//! `nodes/stats` or `nodes/metrics`); a fixed rule saves that round trip on every
//! request, and it refuses nodes' own certificates (`O=system:nodes`), so that one node
//! cannot read another's logs. `/healthz` answers any client the CA signed.
//!
//! # Serving certificate
//! Self-signed, made at every start for the node's name and IP, as the kubelet makes
//! one when it is given none. The API server does not verify it (as kube-apiserver
//! without `--kubelet-certificate-authority`); the client certificate is what protects
//! the logs.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::{Frame, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use jiff::Timestamp;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tracing::{debug, info, warn};
use trellis_api::Shutdown;
use trellis_pki::serve::peer_certificate;

use crate::Context;
use crate::http::{Body, text, valid_name};
use crate::logs::{LocateError, LogOptions, locate, stream};

/// The common name of the API server's node client certificate (kubeadm's name).
pub const API_SERVER_CLIENT: &str = "kube-apiserver-kubelet-client";
/// The group whose members may read every node's logs.
const MASTERS: &str = "system:masters";

/// How long a client may take to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more are closed as they come. Bounds the follows too.
const MAX_CONNECTIONS: usize = 256;
/// Chunks waiting for a slow client before the reader waits too.
const BUFFERED_CHUNKS: usize = 4;

/// Serves the node's routes (container logs, exec) on `listen` (port 0 picks one) until
/// `stopped` is given, and returns the port it listens on, which the Node advertises
/// as `status.daemonEndpoints.kubeletEndpoint.Port`.
///
/// `client_ca_pem` is the cluster CA, which every client's certificate must be signed
/// by; without it this fails rather than serve logs to anyone.
pub async fn serve(
    ctx: Arc<Context>,
    listen: SocketAddr,
    client_ca_pem: Option<String>,
    stopped: Shutdown,
) -> anyhow::Result<u16> {
    let Some(ca_pem) = client_ca_pem else {
        bail!(
            "no cluster CA to verify clients with: refusing to serve container logs unauthenticated"
        );
    };
    let tls = server_config(&ctx.config.node_name, ctx.config.node_ip, &ca_pem)?;
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("listen on {listen} for container logs"))?;
    let port = listener
        .local_addr()
        .context("read the log server's address")?
        .port();
    info!(node = %ctx.config.node_name, port, "serving container logs");
    let config = trellis_pki::serve::Config {
        name: "log server",
        handshake_timeout: HANDSHAKE_TIMEOUT,
        max_connections: Some(MAX_CONNECTIONS),
    };
    let acceptor = TlsAcceptor::from(tls);
    tokio::spawn(async move {
        let handler = stopped.clone();
        trellis_pki::serve::serve(listener, acceptor, config, stopped, move |tls, remote| {
            connection(ctx.clone(), tls, remote, handler.clone())
        })
        .await;
        debug!("log server stopped");
    });
    Ok(port)
}

/// The TLS configuration: a fresh self-signed serving certificate, and client
/// certificates required and verified against `ca_pem`.
fn server_config(
    node_name: &str,
    node_ip: IpAddr,
    ca_pem: &str,
) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots
            .add(cert.context("parse the cluster CA")?)
            .context("trust the cluster CA")?;
    }
    if roots.is_empty() {
        bail!("the cluster CA holds no certificate");
    }
    // No `allow_unauthenticated`: a client without a certificate fails the handshake.
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .context("build the client certificate verifier")?;

    let mut names = vec![node_ip.to_string()];
    if node_name.parse::<IpAddr>().is_err() {
        names.push(node_name.to_owned());
    }
    let mut params =
        rcgen::CertificateParams::new(names).context("describe the serving certificate")?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, node_name);
    let key = rcgen::KeyPair::generate().context("generate the serving key")?;
    let cert = params
        .self_signed(&key)
        .context("sign the serving certificate")?;
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));

    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("select TLS protocol versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![cert.der().clone()], key)
        .context("use the serving certificate")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Serves one client: who its certificate names, then its requests until it closes
/// or the server stops.
async fn connection(
    ctx: Arc<Context>,
    tls: TlsStream<TcpStream>,
    remote: SocketAddr,
    stopped: Shutdown,
) {
    let client = peer_certificate(&tls).and_then(|cert| Identity::of(cert));
    let client = Arc::new(client);
    let service = hyper::service::service_fn(move |request| {
        let (ctx, client) = (ctx.clone(), client.clone());
        async move { Ok::<_, Infallible>(handle(ctx, client.as_ref().as_ref(), request).await) }
    });
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // With upgrades: `/exec` turns its connection into a WebSocket, `/portForward`
    // into SPDY or a WebSocket.
    let served = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
    // On stop the connection is dropped, which ends its follows.
    tokio::select! {
        served = served => if let Err(e) = served {
            debug!(%remote, error = %e, "log connection ended");
        },
        _ = stopped.wait() => {}
    }
}

/// Who a verified client certificate names, as Kubernetes' x509 authenticator reads
/// it: the (last) common name, and the organizations as groups.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Identity {
    name: String,
    groups: Vec<String>,
}

impl Identity {
    fn of(der: &[u8]) -> Option<Identity> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let subject = cert.subject();
        let name = subject
            .iter_common_name()
            .filter_map(|a| a.as_str().ok())
            .last()?
            .to_owned();
        let groups = subject
            .iter_organization()
            .filter_map(|a| a.as_str().ok().map(str::to_owned))
            .collect();
        Some(Identity { name, groups })
    }

    /// The rule in the module's documentation.
    fn may_read_logs(&self) -> bool {
        self.name == API_SERVER_CLIENT || self.groups.iter().any(|g| g == MASTERS)
    }
}

async fn handle(
    ctx: Arc<Context>,
    client: Option<&Identity>,
    request: Request<Incoming>,
) -> Response<Body> {
    let streaming = [
        ("/exec/", Streaming::Exec),
        ("/portForward/", Streaming::PortForward),
    ]
    .into_iter()
    .find_map(|(prefix, kind)| Some((request.uri().path().strip_prefix(prefix)?, kind)));
    if let Some((target, kind)) = streaming {
        let target = target.to_owned();
        // POST, or GET for a WebSocket, as the kubelet serves it.
        let verb = if request.method() == Method::POST {
            "create"
        } else {
            "get"
        };
        return match client {
            None => text(StatusCode::UNAUTHORIZED, "Unauthorized"),
            Some(client) if !client.may_read_logs() => forbidden(client, verb, "proxy"),
            Some(_) => match kind {
                Streaming::Exec => crate::exec::handle(ctx, &target, request).await,
                Streaming::PortForward => crate::port_forward::handle(ctx, &target, request).await,
            },
        };
    }
    if request.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET is served");
    }
    let path = request.uri().path();
    if path == "/healthz" {
        return text(StatusCode::OK, "ok");
    }
    // The kubelet's `nodes/stats` and `nodes/metrics`, served to the same clients.
    if let Some(subresource) = [("/stats/", "stats"), ("/metrics/", "metrics")]
        .into_iter()
        .find_map(|(prefix, sub)| path.starts_with(prefix).then_some(sub))
    {
        return match client {
            None => text(StatusCode::UNAUTHORIZED, "Unauthorized"),
            Some(client) if !client.may_read_logs() => forbidden(client, "get", subresource),
            Some(_) => stats(&ctx, path, request.uri().query().unwrap_or("")).await,
        };
    }
    let Some(target) = path.strip_prefix("/containerLogs/") else {
        return text(StatusCode::NOT_FOUND, "404 page not found");
    };
    let Some(client) = client else {
        return text(StatusCode::UNAUTHORIZED, "Unauthorized");
    };
    if !client.may_read_logs() {
        return forbidden(client, "get", "proxy");
    }
    let parts: Vec<&str> = target.split('/').collect();
    let [namespace, pod, container] = parts[..] else {
        return text(
            StatusCode::NOT_FOUND,
            "expected /containerLogs/{namespace}/{pod}/{container}",
        );
    };
    if let Some(bad) = [namespace, pod, container]
        .into_iter()
        .find(|n| !valid_name(n))
    {
        return text(StatusCode::BAD_REQUEST, format!("invalid name {bad:?}"));
    }
    let options = match LogOptions::parse(request.uri().query().unwrap_or(""), Timestamp::now()) {
        Ok(o) => o,
        Err(message) => return text(StatusCode::BAD_REQUEST, message),
    };
    let root = ctx.config.root.join("logs");
    let located = {
        let (namespace, pod, container) =
            (namespace.to_owned(), pod.to_owned(), container.to_owned());
        let previous = options.previous;
        tokio::task::spawn_blocking(move || locate(&root, &namespace, &pod, &container, previous))
            .await
    };
    let located = match located {
        Ok(Ok(l)) => l,
        Ok(Err(LocateError::NotFound(message))) => return text(StatusCode::NOT_FOUND, message),
        Ok(Err(LocateError::Io(e))) => {
            warn!(%namespace, %pod, %container, error = %e, "read the container's log directory failed");
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("read the logs of container {container:?} in pod {pod:?}: {e}"),
            );
        }
        Err(e) => return text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let file = match tokio::fs::File::open(&located.path).await {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return text(
                StatusCode::NOT_FOUND,
                format!("container {container:?} in pod {pod:?} has no log"),
            );
        }
        Err(e) => {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("open {}: {e}", located.path.display()),
            );
        }
    };
    let (tx, rx) = mpsc::channel(BUFFERED_CHUNKS);
    tokio::spawn(async move {
        let path = located.path.clone();
        if let Err(e) = stream(&ctx, file, &located, &options, tx).await {
            debug!(file = %path.display(), error = %e, "log stream ended early");
        }
    });
    let mut response = Response::new(ChannelBody(rx).boxed_unsync());
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}

/// The routes whose connection is upgraded, served to the same clients.
#[derive(Clone, Copy)]
enum Streaming {
    Exec,
    PortForward,
}

fn forbidden(client: &Identity, verb: &str, subresource: &str) -> Response<Body> {
    text(
        StatusCode::FORBIDDEN,
        format!(
            "Forbidden (user={}, verb={verb}, resource=nodes, subresource(s)=[{subresource}])",
            client.name
        ),
    )
}

/// `/stats/summary` (JSON; `only_cpu_and_memory=true` keeps CPU and memory alone) and
/// `/metrics/resource` (Prometheus text), read from the runtime and the node now.
async fn stats(ctx: &Context, path: &str, query: &str) -> Response<Body> {
    match path.trim_end_matches('/') {
        "/stats/summary" => {
            let only_cpu_and_memory = form_urlencoded::parse(query.as_bytes())
                .any(|(k, v)| k == "only_cpu_and_memory" && v == "true");
            match crate::stats::summary(ctx).await {
                Ok(summary) => {
                    let summary = if only_cpu_and_memory {
                        summary.only_cpu_and_memory()
                    } else {
                        summary
                    };
                    match serde_json::to_vec(&summary) {
                        Ok(body) => with_type(body, "application/json"),
                        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
                    }
                }
                Err(e) => {
                    warn!(error = %format!("{e:#}"), "read the node's stats failed");
                    text(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("failed to get node info: {e:#}"),
                    )
                }
            }
        }
        "/metrics/resource" => {
            // A failed reading is a scrape error in the metrics, not a failed scrape.
            let summary = crate::stats::summary(ctx)
                .await
                .inspect_err(|e| warn!(error = %format!("{e:#}"), "read the node's stats failed"))
                .ok();
            with_type(
                crate::stats::resource_metrics(summary.as_ref()).into_bytes(),
                crate::stats::METRICS_CONTENT_TYPE,
            )
        }
        // The node's cluster DNS server: queries by type and rcode, latency, cache.
        "/metrics/dns" => match ctx.dns.get() {
            Some(dns) => with_type(
                dns.metrics_text().into_bytes(),
                crate::stats::METRICS_CONTENT_TYPE,
            ),
            None => text(StatusCode::NOT_FOUND, "this node serves no cluster DNS"),
        },
        _ => text(StatusCode::NOT_FOUND, "404 page not found"),
    }
}

fn with_type(body: Vec<u8>, content_type: &'static str) -> Response<Body> {
    let mut response = Response::new(http_body_util::Full::new(Bytes::from(body)).boxed_unsync());
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// A response body fed chunk by chunk from the task reading the log: it ends when that
/// task is done, and dropping it (the client went away) ends that task.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.get_mut()
            .0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_api_server_and_masters_may_read() {
        let id = |name: &str, groups: &[&str]| Identity {
            name: name.into(),
            groups: groups.iter().map(|g| (*g).to_owned()).collect(),
        };
        assert!(id(API_SERVER_CLIENT, &[]).may_read_logs());
        assert!(id("admin", &["system:masters"]).may_read_logs());
        assert!(!id("system:node:n2", &["system:nodes"]).may_read_logs());
        assert!(!id("jane", &["dev"]).may_read_logs());
    }

    #[test]
    fn serving_config_needs_a_ca() {
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        assert!(server_config("n1", ip, "not a pem").is_err());
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = params.self_signed(&key).unwrap();
        let config = server_config("n1", ip, &ca.pem()).unwrap();
        assert_eq!(config.alpn_protocols[0], b"h2");
    }

    /// A CA and a client certificate it signed for `cn`, PEM.
    fn ca_and_client(cn: &str) -> (String, String, String) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "test-ca");
        let ca = params.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(params, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &issuer).unwrap();
        (ca.pem(), cert.pem(), key.serialize_pem())
    }

    /// The identity the server sees when a client presents `identity` (cert, key PEM),
    /// or the handshake's error.
    async fn handshake(
        ca_pem: &str,
        identity: Option<(&str, &str)>,
    ) -> std::io::Result<Option<Identity>> {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let server = server_config("n1", "127.0.0.1".parse().unwrap(), ca_pem).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let algorithms = provider.signature_verification_algorithms;
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .dangerous()
            // The node's self-signed certificate is not checked, as the API server
            // does not check it.
            .with_custom_certificate_verifier(Arc::new(trellis_pki::AcceptAnyServerCert(
                algorithms,
            )));
        let client = match identity {
            Some((cert, key)) => builder
                .with_client_auth_cert(
                    vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
                    PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let server = async move {
            let mut tls = TlsAcceptor::from(server).accept(server_io).await?;
            let who = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .and_then(|c| Identity::of(c));
            tls.write_all(b"!").await?;
            tls.flush().await?;
            Ok(who)
        };
        let client = async move {
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
            let mut tls = tokio_rustls::TlsConnector::from(Arc::new(client))
                .connect(name, client_io)
                .await?;
            let mut byte = [0u8; 1];
            tls.read_exact(&mut byte).await?;
            Ok::<_, std::io::Error>(())
        };
        let (server, _) = tokio::join!(server, client);
        server
    }

    #[tokio::test]
    async fn serves_only_clients_the_ca_signed() {
        let (ca, cert, key) = ca_and_client(API_SERVER_CLIENT);
        let who = handshake(&ca, Some((&cert, &key))).await.unwrap().unwrap();
        assert_eq!(who.name, API_SERVER_CLIENT);
        assert!(who.may_read_logs());
        // No certificate, or one another CA signed: no connection at all.
        assert!(handshake(&ca, None).await.is_err());
        let (_, other_cert, other_key) = ca_and_client(API_SERVER_CLIENT);
        assert!(
            handshake(&ca, Some((&other_cert, &other_key)))
                .await
                .is_err()
        );
    }
}
