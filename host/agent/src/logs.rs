//! The agent's log server: the kubelet's `GET /containerLogs/{namespace}/{pod}/{container}`
//! over HTTPS, which the API server calls for `kubectl logs`, and the reading of the
//! CRI log files behind it. Start with [`serve`]. The same server answers the
//! kubelet's `/exec/{namespace}/{pod}/{container}` (`kubectl exec`, see
//! [`crate::exec`]), to the same clients as the logs.
//!
//! # Files
//! The runtime writes each container run to
//! `ROOT/logs/NAMESPACE_POD_UID/CONTAINER/ATTEMPT.log`, one record a line:
//! `<RFC 3339 timestamp> <stdout|stderr> <F|P> <content>`, where `P` is a piece of a
//! line the next records of the same stream continue and `F` its last piece. The
//! highest attempt is the current run; the one before it is `previous=true`'s.
//! Namespace and pod names cannot hold `_`, so `NAMESPACE_POD_` names one pod; when
//! several pods of that name left directories (deleted and created again), the newest
//! is read.
//!
//! # Who may read
//! There is no anonymous access: every connection must present a client certificate
//! the cluster CA signed, and without a CA [`serve`] refuses to start. Of those
//! clients, `/containerLogs` is served to a certificate whose subject has
//! `O=system:masters` (administrators, and the API server's own certificate, which
//! carries that group) or `CN=kube-apiserver-kubelet-client` (the API server's name
//! for its node client). The kubelet asks the API server instead (a
//! SubjectAccessReview of `nodes/proxy`); a fixed rule saves that round trip on every
//! request, and it refuses nodes' own certificates (`O=system:nodes`), so that one node
//! cannot read another's logs. `/healthz` answers any client the CA signed.
//!
//! # Serving certificate
//! Self-signed, made at every start for the node's name and IP, as the kubelet makes
//! one when it is given none. The API server does not verify it (as kube-apiserver
//! without `--kubelet-certificate-authority`); the client certificate is what protects
//! the logs.
//!
//! # Following
//! `follow=true` polls the file and sends what it gains. The runtime does not tell when
//! a run ends, so the stream ends once the file has not grown for [`IDLE_BEFORE_END`]
//! and either a newer attempt's file exists, the pod's log directory is gone, or the
//! runtime lists the run as exited (or no longer lists it). Otherwise it lasts until
//! the client goes away or the agent stops. Rotated files are not followed.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Frame, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use jiff::Timestamp;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::AsyncReadExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};

use crate::Context;

/// The common name of the API server's node client certificate (kubeadm's name).
pub const API_SERVER_CLIENT: &str = "kube-apiserver-kubelet-client";
/// The group whose members may read every node's logs.
const MASTERS: &str = "system:masters";

/// How often a followed file is looked at for new records.
const POLL: Duration = Duration::from_millis(100);
/// How long a followed file must stay as it is before the agent asks whether its run
/// ended: a run that is writing is never ended early.
const IDLE_BEFORE_END: Duration = Duration::from_secs(1);
/// How long a client may take to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the runtime may take to list a pod's containers.
const RUNTIME_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; more are closed as they come. Bounds the follows too.
const MAX_CONNECTIONS: usize = 256;
/// Bytes read from a file at a time, and the size output is sent in.
const CHUNK: usize = 64 * 1024;
/// Chunks waiting for a slow client before the reader waits too.
const BUFFERED_CHUNKS: usize = 4;
/// The longest line assembled from partial records; longer ones are sent in pieces of
/// this size, so one endless line cannot use up the agent's memory.
const MAX_LINE: usize = 1 << 20;

pub(crate) type Body = UnsyncBoxBody<Bytes, Infallible>;

/// Serves container logs on `listen` (port 0 picks one) until `stopped` turns true, and
/// returns the port it listens on, which the Node advertises as
/// `status.daemonEndpoints.kubeletEndpoint.Port`.
///
/// `client_ca_pem` is the cluster CA, which every client's certificate must be signed
/// by; without it this fails rather than serve logs to anyone.
pub async fn serve(
    ctx: Arc<Context>,
    listen: SocketAddr,
    client_ca_pem: Option<String>,
    stopped: watch::Receiver<bool>,
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
    tokio::spawn(accept(ctx, listener, TlsAcceptor::from(tls), stopped));
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

async fn accept(
    ctx: Arc<Context>,
    listener: TcpListener,
    acceptor: TlsAcceptor,
    mut stopped: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped.wait_for(|s| *s) => break,
        };
        let (tcp, remote) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                warn!(error = %e, "accept a log client failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            debug!(%remote, "too many log clients, closing");
            continue;
        };
        let (ctx, acceptor, stopped) = (ctx.clone(), acceptor.clone(), stopped.clone());
        tokio::spawn(async move {
            let _slot = slot;
            connection(ctx, acceptor, tcp, remote, stopped).await;
        });
    }
    debug!("log server stopped");
}

async fn connection(
    ctx: Arc<Context>,
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    remote: SocketAddr,
    mut stopped: watch::Receiver<bool>,
) {
    let _ = tcp.set_nodelay(true);
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            debug!(%remote, error = %e, "log client's TLS handshake failed");
            return;
        }
        Err(_) => return,
    };
    let client = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .and_then(|cert| Identity::of(cert));
    let client = Arc::new(client);
    let service = hyper::service::service_fn(move |request| {
        let (ctx, client) = (ctx.clone(), client.clone());
        async move { Ok::<_, Infallible>(handle(ctx, client.as_ref().as_ref(), request).await) }
    });
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // With upgrades: `/exec` turns its connection into a WebSocket.
    let served = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
    // On stop the connection is dropped, which ends its follows.
    tokio::select! {
        served = served => if let Err(e) = served {
            debug!(%remote, error = %e, "log connection ended");
        },
        _ = stopped.wait_for(|s| *s) => {}
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

pub(crate) fn text(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    let mut message = message.into();
    if !message.ends_with('\n') {
        message.push('\n');
    }
    let mut response = Response::new(Full::new(Bytes::from(message)).boxed_unsync());
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

async fn handle(
    ctx: Arc<Context>,
    client: Option<&Identity>,
    request: Request<Incoming>,
) -> Response<Body> {
    if let Some(target) = request.uri().path().strip_prefix("/exec/") {
        let target = target.to_owned();
        // POST, or GET for a WebSocket, as the kubelet serves it.
        let verb = if request.method() == Method::POST {
            "create"
        } else {
            "get"
        };
        return match client {
            None => text(StatusCode::UNAUTHORIZED, "Unauthorized"),
            Some(client) if !client.may_read_logs() => forbidden(client, verb),
            Some(_) => crate::exec::handle(ctx, &target, request).await,
        };
    }
    if request.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET is served");
    }
    let path = request.uri().path();
    if path == "/healthz" {
        return text(StatusCode::OK, "ok");
    }
    let Some(target) = path.strip_prefix("/containerLogs/") else {
        return text(StatusCode::NOT_FOUND, "404 page not found");
    };
    let Some(client) = client else {
        return text(StatusCode::UNAUTHORIZED, "Unauthorized");
    };
    if !client.may_read_logs() {
        return forbidden(client, "get");
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

fn forbidden(client: &Identity, verb: &str) -> Response<Body> {
    text(
        StatusCode::FORBIDDEN,
        format!(
            "Forbidden (user={}, verb={verb}, resource=nodes, subresource(s)=[proxy])",
            client.name
        ),
    )
}

/// A DNS label or subdomain (what namespace, pod and container names are): never a
/// path of its own.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
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

/// `PodLogOptions`, as the query carries them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogOptions {
    pub follow: bool,
    pub previous: bool,
    pub timestamps: bool,
    pub tail_lines: Option<u64>,
    /// From `sinceTime`, or `sinceSeconds` before the request.
    pub since: Option<Timestamp>,
    pub limit_bytes: Option<u64>,
}

impl LogOptions {
    /// Parses the query string, with Kubernetes' validation of `PodLogOptions`; the
    /// error is the message for the client.
    pub fn parse(query: &str, now: Timestamp) -> Result<LogOptions, String> {
        let mut options = LogOptions::default();
        let mut since_seconds = None;
        let mut since_time = None;
        for (key, value) in form_urlencoded::parse(query.as_bytes()) {
            let number = |v: &str| {
                v.parse::<i64>()
                    .map_err(|_| format!("invalid {key} {v:?}: not an integer"))
            };
            match key.as_ref() {
                "follow" => options.follow = parse_bool(&key, &value)?,
                "previous" => options.previous = parse_bool(&key, &value)?,
                "timestamps" => options.timestamps = parse_bool(&key, &value)?,
                "tailLines" => {
                    let n = number(&value)?;
                    options.tail_lines =
                        Some(u64::try_from(n).map_err(|_| format!("tailLines {n} must be >= 0"))?);
                }
                "limitBytes" => {
                    let n = number(&value)?;
                    if n < 1 {
                        return Err(format!("limitBytes {n} must be greater than 0"));
                    }
                    options.limit_bytes = u64::try_from(n).ok();
                }
                "sinceSeconds" => {
                    let n = number(&value)?;
                    if n < 1 {
                        return Err(format!("sinceSeconds {n} must be greater than 0"));
                    }
                    since_seconds = Some(n);
                }
                "sinceTime" => {
                    since_time = Some(value.parse::<Timestamp>().map_err(|e| {
                        format!("invalid sinceTime {value:?}: not an RFC 3339 time: {e}")
                    })?);
                }
                _ => {}
            }
        }
        options.since = match (since_seconds, since_time) {
            (Some(_), Some(_)) => {
                return Err("at most one of `sinceTime` or `sinceSeconds` may be specified".into());
            }
            (Some(seconds), None) => Some(
                now.checked_sub(jiff::SignedDuration::from_secs(seconds))
                    .unwrap_or(Timestamp::MIN),
            ),
            (None, time) => time,
        };
        if options.previous {
            // A previous run has ended: there is nothing to wait for.
            options.follow = false;
        }
        Ok(options)
    }
}

/// Go's `strconv.ParseBool`, as Kubernetes parses query booleans.
pub(crate) fn parse_bool(key: &str, value: &str) -> Result<bool, String> {
    match value {
        "" | "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err(format!("invalid {key} {value:?}: not a boolean")),
    }
}

/// The log file a request reads.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Located {
    /// `ROOT/logs/NAMESPACE_POD_UID`.
    pod_dir: PathBuf,
    uid: String,
    container: String,
    /// The run the file belongs to (its restart count).
    attempt: u32,
    path: PathBuf,
}

#[derive(Debug)]
enum LocateError {
    /// The message for the client.
    NotFound(String),
    Io(std::io::Error),
}

impl From<std::io::Error> for LocateError {
    fn from(e: std::io::Error) -> Self {
        LocateError::Io(e)
    }
}

/// Finds the file of the latest run of `container` in `logs` (the agent's
/// `ROOT/logs`), or of the run before it when `previous`.
fn locate(
    logs: &Path,
    namespace: &str,
    pod: &str,
    container: &str,
    previous: bool,
) -> Result<Located, LocateError> {
    let Some((pod_dir, uid)) = pod_log_dir(logs, namespace, pod)? else {
        return Err(LocateError::NotFound(format!(
            "pod {pod:?} in namespace {namespace:?} has no logs on this node"
        )));
    };
    let runs = attempts(&pod_dir.join(container))?;
    let chosen = if previous {
        runs.len().checked_sub(2).and_then(|i| runs.get(i))
    } else {
        runs.last()
    };
    let Some((attempt, path)) = chosen.cloned() else {
        return Err(LocateError::NotFound(if previous {
            format!("previous terminated container {container:?} in pod {pod:?} not found")
        } else {
            format!("container {container:?} in pod {pod:?} is waiting to start")
        }));
    };
    Ok(Located {
        pod_dir,
        uid,
        container: container.to_owned(),
        attempt,
        path,
    })
}

/// The longest file name Linux file systems take (`NAME_MAX`).
const NAME_MAX: usize = 255;

/// The directory of a pod's logs in `logs` (the agent's `ROOT/logs`):
/// `NAMESPACE_NAME_UID`, as the kubelet names it. A pod name may be 253 characters,
/// more than one path component holds with the rest, so a name too long is cut and
/// ends in a hash of the whole name: the directory stays unique to its pod and
/// [`pod_log_dir`] finds it from the name again.
pub fn pod_logs_dir(logs: &Path, namespace: &str, name: &str, uid: &str) -> PathBuf {
    logs.join(format!("{}{uid}", pod_logs_prefix(namespace, name)))
}

/// `NAMESPACE_NAME_`, with the name cut as [`pod_logs_dir`] says.
fn pod_logs_prefix(namespace: &str, name: &str) -> String {
    // A UID is 36 characters; room for it and the two separators.
    let room = NAME_MAX.saturating_sub(namespace.len() + 2 + 36);
    if name.len() <= room {
        return format!("{namespace}_{name}_");
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, name.as_bytes());
    let hash: String = digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    // Names are ASCII (DNS subdomains), so any byte is a character boundary.
    let keep = room.saturating_sub(hash.len() + 1).min(name.len());
    format!("{namespace}_{}-{hash}_", &name[..keep])
}

/// The UID of a pod logs directory's name (`NAMESPACE_NAME_UID`), if it is one.
pub fn uid_of_pod_logs_dir(dir_name: &str) -> Option<&str> {
    let (rest, uid) = dir_name.rsplit_once('_')?;
    (rest.contains('_') && !uid.is_empty()).then_some(uid)
}

/// The newest `NAMESPACE_POD_UID` directory in `logs`, with its UID.
fn pod_log_dir(
    logs: &Path,
    namespace: &str,
    pod: &str,
) -> std::io::Result<Option<(PathBuf, String)>> {
    let prefix = pod_logs_prefix(namespace, pod);
    let entries = match std::fs::read_dir(logs) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut newest: Option<(std::time::SystemTime, PathBuf, String)> = None;
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some(uid) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        if uid.is_empty() || uid.contains('_') {
            continue;
        }
        let Ok(meta) = entry.metadata() else {
            continue;
        };
        if !meta.is_dir() {
            continue;
        }
        let modified = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
        if newest.as_ref().is_none_or(|(m, _, _)| modified > *m) {
            newest = Some((modified, entry.path(), uid.to_owned()));
        }
    }
    Ok(newest.map(|(_, path, uid)| (path, uid)))
}

/// A container directory's `ATTEMPT.log` files, oldest run first; none when the
/// directory does not exist.
fn attempts(dir: &Path) -> std::io::Result<Vec<(u32, PathBuf)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut runs = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some(attempt) = name
            .to_str()
            .and_then(|n| n.strip_suffix(".log"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        runs.push((attempt, entry.path()));
    }
    runs.sort();
    Ok(runs)
}

/// One record of a CRI log file.
#[derive(Debug, PartialEq, Eq)]
struct Record<'a> {
    timestamp: &'a str,
    stderr: bool,
    partial: bool,
    content: &'a [u8],
}

impl<'a> Record<'a> {
    /// Parses one line, without its newline; `None` if it is not a record.
    fn parse(line: &'a [u8]) -> Option<Record<'a>> {
        let mut fields = line.splitn(4, |b| *b == b' ');
        let timestamp = std::str::from_utf8(fields.next()?).ok()?;
        let stderr = match fields.next()? {
            b"stdout" => false,
            b"stderr" => true,
            _ => return None,
        };
        let partial = match fields.next()? {
            b"F" => false,
            b"P" => true,
            _ => return None,
        };
        if timestamp.is_empty() {
            return None;
        }
        Some(Record {
            timestamp,
            stderr,
            partial,
            content: fields.next().unwrap_or_default(),
        })
    }
}

/// One line of output: a record, or the partial records of a stream joined. A line
/// longer than [`MAX_LINE`] comes in pieces: the first, then continuations.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Line {
    /// The first piece's timestamp, as the file has it.
    timestamp: String,
    at: Option<Timestamp>,
    content: Vec<u8>,
    /// Ended by an `F` record; a line the run never finished is shown without a newline.
    complete: bool,
    /// Which stream it is of: a long line's pieces may be interleaved with the other
    /// stream's lines.
    stderr: bool,
    /// A later piece of a line longer than [`MAX_LINE`]: it carries on the one before
    /// of its stream, without a timestamp of its own, and is not a line of its own
    /// for `tailLines`.
    continuation: bool,
}

impl Line {
    fn render(&self, timestamps: bool, out: &mut Vec<u8>) {
        if timestamps && !self.continuation {
            out.extend_from_slice(self.timestamp.as_bytes());
            out.push(b' ');
        }
        out.extend_from_slice(&self.content);
        if self.complete {
            out.push(b'\n');
        }
    }
}

/// Turns a CRI log's bytes, as they are read, into lines: a record is taken once its
/// newline is read, and partial records are joined per stream until their `F`.
#[derive(Debug, Default)]
struct Decoder {
    /// Bytes of a record whose newline is not read yet.
    carry: Vec<u8>,
    /// The unfinished line of stdout, and of stderr.
    partial: [Option<Line>; 2],
    /// Per stream, the first piece's timestamp while a line longer than [`MAX_LINE`]
    /// is being sent in pieces.
    pieces: [Option<(String, Option<Timestamp>)>; 2],
}

impl Decoder {
    fn feed(&mut self, bytes: &[u8], out: &mut Vec<Line>) {
        let mut rest = bytes;
        while let Some(end) = rest.iter().position(|b| *b == b'\n') {
            if self.carry.is_empty() {
                self.record(&rest[..end], out);
            } else {
                let mut line = std::mem::take(&mut self.carry);
                line.extend_from_slice(&rest[..end]);
                self.record(&line, out);
            }
            rest = &rest[end + 1..];
        }
        self.carry.extend_from_slice(rest);
    }

    fn record(&mut self, line: &[u8], out: &mut Vec<Line>) {
        let Some(record) = Record::parse(line) else {
            debug!(
                line = %String::from_utf8_lossy(&line[..line.len().min(80)]),
                "skipping a log line that is not a CRI record"
            );
            return;
        };
        let stream = usize::from(record.stderr);
        let slot = &mut self.partial[stream];
        let line = match slot {
            Some(pending) => {
                pending.content.extend_from_slice(record.content);
                pending
            }
            None => {
                let (timestamp, at, continuation) = match &self.pieces[stream] {
                    Some((timestamp, at)) => (timestamp.clone(), *at, true),
                    None => (
                        record.timestamp.to_owned(),
                        record.timestamp.parse().ok(),
                        false,
                    ),
                };
                slot.insert(Line {
                    timestamp,
                    at,
                    content: record.content.to_vec(),
                    complete: false,
                    stderr: record.stderr,
                    continuation,
                })
            }
        };
        if !record.partial {
            line.complete = true;
        }
        if line.complete {
            self.pieces[stream] = None;
            out.extend(slot.take());
        } else if line.content.len() >= MAX_LINE {
            self.pieces[stream] = Some((line.timestamp.clone(), line.at));
            out.extend(slot.take());
        }
    }

    /// The end of a log that will not grow: its unfinished lines, as they are.
    fn finish(&mut self, out: &mut Vec<Line>) {
        if !self.carry.is_empty() {
            let carry = std::mem::take(&mut self.carry);
            self.record(&carry, out);
        }
        let mut rest: Vec<Line> = self.partial.iter_mut().filter_map(Option::take).collect();
        rest.sort_by(|a, b| a.timestamp.cmp(&b.timestamp));
        out.extend(rest);
    }
}

/// Applies `sinceTime`, `tailLines`, `timestamps` and `limitBytes` to lines, into the
/// bytes to send.
#[derive(Debug)]
struct Selector {
    since: Option<Timestamp>,
    timestamps: bool,
    /// While the file's existing lines are read with `tailLines`: the last ones.
    tail: Option<Tail>,
    /// Bytes still allowed by `limitBytes`.
    remaining: Option<u64>,
    out: Vec<u8>,
}

impl Selector {
    fn new(options: &LogOptions) -> Self {
        Self {
            since: options.since,
            timestamps: options.timestamps,
            tail: options
                .tail_lines
                .map(|n| Tail::new(usize::try_from(n).unwrap_or(usize::MAX))),
            remaining: options.limit_bytes,
            out: Vec::new(),
        }
    }

    /// Whether `limitBytes` is used up: nothing more will be sent.
    fn done(&self) -> bool {
        self.remaining == Some(0)
    }

    fn push(&mut self, line: Line) {
        if let (Some(since), Some(at)) = (self.since, line.at)
            && at < since
        {
            return;
        }
        if let Some(tail) = &mut self.tail {
            tail.push(line);
            return;
        }
        self.emit(&line);
    }

    /// The existing lines are read: the kept tail goes out, and later lines (a
    /// follow's) are sent as they come.
    fn end_of_existing(&mut self) {
        if let Some(tail) = self.tail.take() {
            for line in tail.kept {
                self.emit(&line);
            }
        }
    }

    fn emit(&mut self, line: &Line) {
        if self.done() {
            return;
        }
        let start = self.out.len();
        line.render(self.timestamps, &mut self.out);
        if let Some(remaining) = &mut self.remaining {
            let added = (self.out.len() - start) as u64;
            if added > *remaining {
                self.out
                    .truncate(start + usize::try_from(*remaining).unwrap_or(usize::MAX));
                *remaining = 0;
            } else {
                *remaining -= added;
            }
        }
    }

    fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out)
    }
}

/// The last `n` lines, a line longer than [`MAX_LINE`] with all its pieces.
#[derive(Debug)]
struct Tail {
    n: usize,
    kept: VecDeque<Line>,
    /// Lines begun in `kept` (first pieces), which is what `n` counts.
    lines: usize,
    /// Per stream: a line was dropped from the front before its last piece, so its
    /// remaining pieces go too.
    dropping: [bool; 2],
}

impl Tail {
    fn new(n: usize) -> Self {
        Self {
            n,
            kept: VecDeque::new(),
            lines: 0,
            dropping: [false; 2],
        }
    }

    fn push(&mut self, line: Line) {
        let stream = usize::from(line.stderr);
        if line.continuation && self.dropping[stream] {
            self.dropping[stream] = !line.complete;
            return;
        }
        if !line.continuation {
            self.lines += 1;
        }
        self.kept.push_back(line);
        while self.lines > self.n {
            self.pop_front();
        }
        // Pieces whose first piece is gone, now at the front.
        while self
            .kept
            .front()
            .is_some_and(|l| l.continuation && self.dropping[usize::from(l.stderr)])
        {
            self.pop_front();
        }
    }

    fn pop_front(&mut self) {
        let Some(line) = self.kept.pop_front() else {
            return;
        };
        if !line.continuation {
            self.lines -= 1;
        }
        self.dropping[usize::from(line.stderr)] = !line.complete;
    }
}

/// Reads `file` into `tx` as `options` ask; follows it until its run ends.
async fn stream(
    ctx: &Context,
    mut file: tokio::fs::File,
    located: &Located,
    options: &LogOptions,
    tx: mpsc::Sender<Bytes>,
) -> anyhow::Result<()> {
    let mut decoder = Decoder::default();
    let mut selector = Selector::new(options);
    let mut lines = Vec::new();
    let mut chunk = vec![0u8; CHUNK];
    // What the file holds now.
    loop {
        let n = file.read(&mut chunk).await.context("read the log")?;
        if n == 0 {
            break;
        }
        decoder.feed(&chunk[..n], &mut lines);
        for line in lines.drain(..) {
            selector.push(line);
        }
        if selector.tail.is_none() && selector.out.len() >= CHUNK {
            send(&tx, selector.take()).await?;
        }
        if selector.done() {
            break;
        }
    }
    if !options.follow {
        decoder.finish(&mut lines);
        for line in lines.drain(..) {
            selector.push(line);
        }
        selector.end_of_existing();
        return send(&tx, selector.take()).await;
    }
    selector.end_of_existing();
    send(&tx, selector.take()).await?;
    // What it gains.
    let mut grew = Instant::now();
    let mut asked = Instant::now();
    while !selector.done() {
        let n = file.read(&mut chunk).await.context("read the log")?;
        if n > 0 {
            decoder.feed(&chunk[..n], &mut lines);
            for line in lines.drain(..) {
                selector.push(line);
            }
            if selector.out.len() >= CHUNK {
                send(&tx, selector.take()).await?;
            }
            grew = Instant::now();
            continue;
        }
        send(&tx, selector.take()).await?;
        if grew.elapsed() >= IDLE_BEFORE_END && asked.elapsed() >= IDLE_BEFORE_END {
            asked = Instant::now();
            if run_ended(ctx, located).await {
                // Whatever it wrote last, then its unfinished lines.
                loop {
                    let n = file.read(&mut chunk).await.context("read the log")?;
                    if n == 0 {
                        break;
                    }
                    decoder.feed(&chunk[..n], &mut lines);
                }
                decoder.finish(&mut lines);
                for line in lines.drain(..) {
                    selector.push(line);
                }
                break;
            }
        }
        tokio::select! {
            () = tx.closed() => return Ok(()),
            () = tokio::time::sleep(POLL) => {}
        }
    }
    send(&tx, selector.take()).await
}

async fn send(tx: &mpsc::Sender<Bytes>, bytes: Vec<u8>) -> anyhow::Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    tx.send(Bytes::from(bytes))
        .await
        .map_err(|_| anyhow::anyhow!("the client went away"))
}

/// Whether the run a followed file belongs to is over (see the module's
/// documentation).
async fn run_ended(ctx: &Context, located: &Located) -> bool {
    let (pod_dir, container, attempt) = (
        located.pod_dir.clone(),
        located.container.clone(),
        located.attempt,
    );
    let on_disk = tokio::task::spawn_blocking(move || {
        if !pod_dir.is_dir() {
            return true;
        }
        attempts(&pod_dir.join(container)).is_ok_and(|runs| runs.iter().any(|(a, _)| *a > attempt))
    })
    .await
    .unwrap_or(false);
    on_disk || runtime_says_ended(ctx, located).await
}

/// Whether the runtime lists the run as exited, or no longer lists it. An unanswered
/// question keeps the follow going.
async fn runtime_says_ended(ctx: &Context, located: &Located) -> bool {
    use k8s_cri::v1 as cri;
    let mut runtime = ctx.cri.runtime.clone();
    let request = cri::ListContainersRequest {
        filter: Some(cri::ContainerFilter {
            label_selector: [
                (crate::worker::POD_UID.to_owned(), located.uid.clone()),
                (
                    crate::worker::CONTAINER_NAME.to_owned(),
                    located.container.clone(),
                ),
            ]
            .into(),
            ..Default::default()
        }),
    };
    let listed = match tokio::time::timeout(RUNTIME_TIMEOUT, runtime.list_containers(request)).await
    {
        Ok(Ok(listed)) => listed.into_inner().containers,
        Ok(Err(e)) => {
            debug!(error = %e.message(), "list a pod's containers for a followed log failed");
            return false;
        }
        Err(_) => return false,
    };
    let run = listed.iter().find(|c| {
        c.labels.get(crate::worker::POD_UID) == Some(&located.uid)
            && c.metadata
                .as_ref()
                .is_some_and(|m| m.name == located.container && m.attempt == located.attempt)
    });
    run.is_none_or(|c| c.state == cri::ContainerState::ContainerExited as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(query: &str) -> LogOptions {
        LogOptions::parse(query, "2024-05-01T12:00:00Z".parse().unwrap()).unwrap()
    }

    /// What a request with `query` shows of `log`, as a non-followed read does it.
    fn read(log: &str, query: &str) -> String {
        let options = options(query);
        let mut decoder = Decoder::default();
        let mut selector = Selector::new(&options);
        let mut lines = Vec::new();
        // Fed in small pieces, as reads of a growing file return them.
        for piece in log.as_bytes().chunks(7) {
            decoder.feed(piece, &mut lines);
        }
        decoder.finish(&mut lines);
        for line in lines {
            selector.push(line);
        }
        selector.end_of_existing();
        String::from_utf8(selector.take()).unwrap()
    }

    const LOG: &str = "\
2024-05-01T11:59:00.000000001Z stdout F one
2024-05-01T11:59:10Z stderr F two
2024-05-01T11:59:20Z stdout P th
2024-05-01T11:59:21Z stderr F four
2024-05-01T11:59:22Z stdout P re
2024-05-01T11:59:23Z stdout F e
2024-05-01T11:59:30Z stdout F 
2024-05-01T11:59:40Z stdout F five with spaces  
";

    #[test]
    fn joins_partial_records_and_interleaves_streams() {
        assert_eq!(
            read(LOG, ""),
            "one\ntwo\nfour\nthree\n\nfive with spaces  \n"
        );
    }

    #[test]
    fn timestamps_prefix_each_line_with_its_first_piece() {
        let out = read(LOG, "timestamps=true");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "2024-05-01T11:59:00.000000001Z one");
        assert_eq!(lines[3], "2024-05-01T11:59:20Z three");
        assert_eq!(lines[4], "2024-05-01T11:59:30Z ");
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        assert_eq!(read(LOG, "tailLines=2"), "\nfive with spaces  \n");
        assert_eq!(read(LOG, "tailLines=0"), "");
        assert_eq!(read(LOG, "tailLines=100"), read(LOG, ""));
    }

    #[test]
    fn since_keeps_lines_at_or_after() {
        assert_eq!(
            read(LOG, "sinceTime=2024-05-01T11%3A59%3A21Z"),
            "four\n\nfive with spaces  \n"
        );
        // 12:00:00 - 30 s: 11:59:30 and later.
        assert_eq!(read(LOG, "sinceSeconds=30"), "\nfive with spaces  \n");
        assert_eq!(
            read(
                LOG,
                "sinceTime=2024-05-01T13%3A59%3A21%2B02%3A00&tailLines=1"
            ),
            "five with spaces  \n"
        );
    }

    #[test]
    fn limit_bytes_cuts_the_output() {
        assert_eq!(read(LOG, "limitBytes=6"), "one\ntw");
        assert_eq!(read(LOG, "limitBytes=4&tailLines=1"), "five");
    }

    #[test]
    fn unfinished_last_line_is_shown_without_newline() {
        let log = "2024-05-01T11:59:00Z stdout F a\n2024-05-01T11:59:01Z stdout P b\n2024-05-01T11:59:02Z stdout F c";
        // The last record lacks its newline and the partial one its `F`: both shown.
        assert_eq!(read(log, ""), "a\nbc\n");
        let log = "2024-05-01T11:59:00Z stdout F a\n2024-05-01T11:59:01Z stdout P b\n";
        assert_eq!(read(log, ""), "a\nb");
    }

    #[test]
    fn skips_lines_that_are_not_records() {
        let log = "garbage\n2024-05-01T11:59:00Z stdout F a\n2024-05-01T11:59:00Z other F x\n\n";
        assert_eq!(read(log, ""), "a\n");
    }

    #[test]
    fn record_without_content_is_an_empty_line() {
        assert_eq!(
            Record::parse(b"2024-05-01T11:59:00Z stderr F"),
            Some(Record {
                timestamp: "2024-05-01T11:59:00Z",
                stderr: true,
                partial: false,
                content: b"",
            })
        );
    }

    #[test]
    fn endless_line_is_sent_in_pieces() {
        let mut decoder = Decoder::default();
        let mut lines = Vec::new();
        let piece = "x".repeat(16 * 1024);
        for _ in 0..(MAX_LINE / piece.len()) + 1 {
            decoder.feed(
                format!("2024-05-01T11:59:00Z stdout P {piece}\n").as_bytes(),
                &mut lines,
            );
        }
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0].content.len(), MAX_LINE);
        assert!(!lines[0].complete);
    }

    /// A log with a line of `len` bytes between two short ones, written as the runtime
    /// writes one: 16 KiB partial records, then the rest in a full one (an empty one
    /// with `empty_end`); a stderr line comes in between its pieces.
    fn log_with_long_line(len: usize, empty_end: bool) -> (String, String) {
        let long: String = (0..len)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        let mut log = String::from("2024-05-01T11:59:00Z stdout F before\n");
        let mut pieces = long.as_bytes().chunks(16 * 1024).peekable();
        let mut i = 0;
        while let Some(piece) = pieces.next() {
            let tag = if pieces.peek().is_some() || empty_end {
                "P"
            } else {
                "F"
            };
            let piece = std::str::from_utf8(piece).unwrap();
            log.push_str(&format!("2024-05-01T11:59:01Z stdout {tag} {piece}\n"));
            if i == 3 {
                log.push_str("2024-05-01T11:59:01Z stderr F between\n");
            }
            i += 1;
        }
        if empty_end {
            log.push_str("2024-05-01T11:59:01Z stdout F \n");
        }
        log.push_str("2024-05-01T11:59:02Z stdout F after\n");
        (log, long)
    }

    #[test]
    fn tail_counts_a_line_longer_than_the_cap_once() {
        // More than the cap, and exactly the cap with an empty `F` record after it.
        for (len, empty_end) in [(MAX_LINE + MAX_LINE / 2, false), (MAX_LINE, true)] {
            let (log, long) = log_with_long_line(len, empty_end);
            assert_eq!(
                read(&log, "tailLines=2"),
                format!("{long}\nafter\n"),
                "{len}"
            );
            assert_eq!(
                read(&log, "tailLines=3"),
                format!("between\n{long}\nafter\n"),
                "{len}"
            );
            assert_eq!(
                read(&log, "tailLines=4"),
                format!("before\nbetween\n{long}\nafter\n")
            );
            assert_eq!(read(&log, "tailLines=1"), "after\n");
            assert_eq!(read(&log, ""), read(&log, "tailLines=4"));
            let stamped = read(&log, "timestamps=true&tailLines=2");
            assert_eq!(
                stamped,
                format!("2024-05-01T11:59:01Z {long}\n2024-05-01T11:59:02Z after\n")
            );
        }
    }

    #[test]
    fn options_follow_kubernetes_validation() {
        let now: Timestamp = "2024-05-01T12:00:00Z".parse().unwrap();
        let o = options("follow=true&timestamps=1&tailLines=10&limitBytes=5&previous=false");
        assert!(o.follow && o.timestamps && !o.previous);
        assert_eq!((o.tail_lines, o.limit_bytes), (Some(10), Some(5)));
        // A previous run is read, never followed.
        assert!(!options("follow=true&previous=true").follow);
        assert_eq!(
            options("sinceSeconds=60").since,
            Some("2024-05-01T11:59:00Z".parse().unwrap())
        );
        for bad in [
            "tailLines=-1",
            "limitBytes=0",
            "sinceSeconds=0",
            "sinceSeconds=1&sinceTime=2024-05-01T11%3A59%3A00Z",
            "sinceTime=yesterday",
            "follow=maybe",
            "tailLines=ten",
        ] {
            assert!(LogOptions::parse(bad, now).is_err(), "{bad}");
        }
    }

    fn write(path: &Path, contents: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, contents).unwrap();
    }

    #[test]
    fn locates_latest_and_previous_runs() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path();
        let pod = logs.join("default_web_uid-1");
        write(&pod.join("app/0.log"), "");
        write(&pod.join("app/1.log"), "");
        write(&pod.join("app/10.log"), "");
        write(&pod.join("app/notes.txt"), "");
        // Another pod whose name starts the same.
        write(&logs.join("default_web-2_uid-2/app/5.log"), "");

        let latest = locate(logs, "default", "web", "app", false).unwrap();
        assert_eq!((latest.attempt, latest.uid.as_str()), (10, "uid-1"));
        assert_eq!(latest.path, pod.join("app/10.log"));
        let previous = locate(logs, "default", "web", "app", true).unwrap();
        assert_eq!(previous.attempt, 1);

        write(&logs.join("default_single_uid-3/app/0.log"), "");
        let Err(LocateError::NotFound(message)) = locate(logs, "default", "single", "app", true)
        else {
            panic!("a first run has no previous one");
        };
        assert_eq!(
            message,
            r#"previous terminated container "app" in pod "single" not found"#
        );
        assert!(matches!(
            locate(logs, "default", "web", "sidecar", false),
            Err(LocateError::NotFound(_))
        ));
        assert!(matches!(
            locate(logs, "default", "gone", "app", false),
            Err(LocateError::NotFound(_))
        ));
        assert!(matches!(
            locate(&logs.join("missing"), "default", "web", "app", false),
            Err(LocateError::NotFound(_))
        ));
    }

    #[test]
    fn locates_the_newest_of_several_pods_of_one_name() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path();
        write(&logs.join("ns_p_old/c/0.log"), "");
        let past = std::time::SystemTime::now() - Duration::from_secs(3600);
        std::fs::File::open(logs.join("ns_p_old"))
            .unwrap()
            .set_modified(past)
            .unwrap();
        write(&logs.join("ns_p_new/c/0.log"), "");
        assert_eq!(locate(logs, "ns", "p", "c", false).unwrap().uid, "new");
    }

    #[test]
    fn names_cannot_escape_the_log_directory() {
        for bad in ["", ".", "..", "a/b", "a_b", "a%2F"] {
            assert!(!valid_name(bad), "{bad}");
        }
        assert!(valid_name("web-1.example"));
    }

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
            .with_custom_certificate_verifier(Arc::new(crate::probes::AnyServerCert(algorithms)));
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
