//! A bare HTTPS client of the API server, as client-go's `rest` package is
//! kubectl's: a [`Target`] (server, CA, credentials, from a kubeconfig or given), a
//! [`Connection`] that sends one request at a time, and [`exchange`] for a single
//! request on a connection of its own.
//!
//! It is hyper's connection API without a pool or kube's layers: the `plugin` command
//! needs no more, and the benchmarks measure the server rather than the client (about
//! 20 µs of CPU per request, half of what `hey` spends).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::rt::{TokioExecutor, TokioIo};
use kube::config::{AuthInfo, Cluster, Kubeconfig};
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use secrecy::ExposeSecret as _;
use serde::Deserialize;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// Longest a request may take, from sending it to its body's last byte. Far above any
/// healthy latency; it only exists so that a wedged server ends a command or a
/// benchmark with an error instead of hanging it.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// How a client proves who it is.
#[derive(Debug)]
pub(crate) enum Credentials {
    /// `Authorization: Bearer`.
    Token(String),
    /// A client certificate chain and its key, PEM.
    ClientCert { cert_pem: Vec<u8>, key_pem: Vec<u8> },
}

/// An API server: where to connect and how, and the credentials to present.
#[derive(Clone, Debug)]
pub(crate) struct Target {
    /// `https://host:port`, without a path.
    pub(crate) base: Uri,
    /// `host:port` to dial.
    pub(crate) addr: String,
    pub(crate) server_name: ServerName<'static>,
    pub(crate) tls: Arc<rustls::ClientConfig>,
    /// `Bearer …`, when the credentials are a token.
    pub(crate) authorization: Option<HeaderValue>,
    pub(crate) http2: bool,
}

impl Target {
    pub(crate) fn new(
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
        // kube reads the file as kubectl does, files it names made absolute.
        let config = Kubeconfig::read_from(path)
            .with_context(|| format!("read the kubeconfig {}", path.display()))?;
        let (cluster, user) =
            current(&config).with_context(|| format!("read the kubeconfig {}", path.display()))?;
        let server = cluster
            .server
            .as_deref()
            .context("check the cluster: it names no server")?;
        let ca_pem = pem(
            "certificate-authority",
            cluster.certificate_authority_data.as_deref(),
            cluster.certificate_authority.as_deref(),
        )?
        .context("check the cluster: it names no certificate-authority(-data)")?;
        let ca_pem = String::from_utf8(ca_pem).context("read the cluster CA as PEM text")?;
        let credentials = if let Some(token) = &user.token {
            Credentials::Token(token.expose_secret().to_owned())
        } else {
            let cert_pem = pem(
                "client-certificate",
                user.client_certificate_data.as_deref(),
                user.client_certificate.as_deref(),
            )?;
            let key_pem = pem(
                "client-key",
                user.client_key_data.as_ref().map(|key| key.expose_secret()),
                user.client_key.as_deref(),
            )?;
            match (cert_pem, key_pem) {
                (Some(cert_pem), Some(key_pem)) => Credentials::ClientCert { cert_pem, key_pem },
                _ => {
                    bail!("check the user: it has neither a token nor a client certificate and key")
                }
            }
        };
        Self::new(server, &ca_pem, credentials, http2)
    }
}

/// The cluster and user of `config`'s current context.
fn current(config: &Kubeconfig) -> anyhow::Result<(&Cluster, &AuthInfo)> {
    let current = config
        .current_context
        .as_deref()
        .filter(|c| !c.is_empty())
        .context("check current-context: it is not set")?;
    let context = config
        .contexts
        .iter()
        .find(|c| c.name == current)
        .and_then(|c| c.context.as_ref())
        .with_context(|| format!("find the context {current:?}"))?;
    let cluster = config
        .clusters
        .iter()
        .find(|c| c.name == context.cluster)
        .and_then(|c| c.cluster.as_ref())
        .with_context(|| format!("find the cluster {:?}", context.cluster))?;
    let user_name = context.user.as_deref().unwrap_or_default();
    let user = config
        .auth_infos
        .iter()
        .find(|u| u.name == user_name)
        .and_then(|u| u.auth_info.as_ref())
        .with_context(|| format!("find the user {user_name:?}"))?;
    Ok((cluster, user))
}

/// PEM from a kubeconfig's `{field}-data` (base64) or `{field}` (a file).
fn pem(field: &str, data: Option<&str>, file: Option<&str>) -> anyhow::Result<Option<Vec<u8>>> {
    if let Some(data) = data {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .with_context(|| format!("decode {field}-data as base64"))?;
        return Ok(Some(decoded));
    }
    match file {
        Some(file) => {
            let contents = std::fs::read(file).with_context(|| format!("read {field} {file}"))?;
            Ok(Some(contents))
        }
        None => Ok(None),
    }
}

/// One client's connection: it sends one request at a time.
#[derive(Debug)]
pub(crate) enum Connection {
    Http1(http1::SendRequest<Full<Bytes>>),
    Http2(http2::SendRequest<Full<Bytes>>),
}

impl Connection {
    pub(crate) async fn send(
        &mut self,
        request: Request<Full<Bytes>>,
    ) -> hyper::Result<Response<Incoming>> {
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

/// Opens a connection whose reads and writes a task of its own does.
pub(crate) async fn connect(
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
pub(crate) type Driver = std::pin::Pin<Box<dyn Future<Output = hyper::Result<()>> + Send>>;

/// Opens a connection and hands back its [`Driver`] unspawned, so that a caller can
/// poll it in the same task that reads the responses: a response's bytes are then
/// seen in the poll that reads them from the socket, not after another task's wake-up.
pub(crate) async fn handshake(
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

/// A request to `target`'s server: JSON in and out, with the credentials' token.
pub(crate) fn build_request(
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

/// One request on a connection of its own: the status
/// and the whole body, within [`REQUEST_TIMEOUT`].
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

/// Sends `request` and reads the whole response within [`REQUEST_TIMEOUT`].
pub(crate) async fn send_and_read(
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
    tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| bail!("no answer within {REQUEST_TIMEOUT:?}"))
}

/// Sends `request` and reads the whole response within [`REQUEST_TIMEOUT`]; fails with
/// the server's message unless the status is `expected`.
pub(crate) async fn call(
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
pub(crate) fn status_message(body: &[u8]) -> String {
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
        let config = Kubeconfig::from_yaml(&yaml).unwrap();
        let (cluster, user) = current(&config).unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://127.0.0.1:6443"));
        assert_eq!(
            pem(
                "certificate-authority",
                cluster.certificate_authority_data.as_deref(),
                None
            )
            .unwrap()
            .unwrap(),
            CA.as_bytes()
        );
        assert_eq!(user.token.as_ref().map(|t| t.expose_secret()), Some("abc"));
    }

    #[test]
    fn kubeconfig_without_current_context_is_refused() {
        let config = Kubeconfig::from_yaml("apiVersion: v1\nkind: Config\n").unwrap();
        let message = format!("{:#}", current(&config).unwrap_err());
        assert!(message.contains("current-context"), "{message}");
    }
}
