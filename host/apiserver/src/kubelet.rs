//! The API server's client for nodes' agents, which serve `pods/log` (the kubelet's
//! `/containerLogs`) and `pods/exec` (`/exec`): HTTPS with the API server's own client certificate, issued from
//! the cluster CA at every start (CN `kube-apiserver-kubelet-client`, O
//! `system:masters`, as kubeadm's `apiserver-kubelet-client.crt`), which is what the
//! agents require.
//!
//! The agents' serving certificates are self-signed and are NOT verified, as
//! kube-apiserver does not verify kubelets' without `--kubelet-certificate-authority`:
//! the TLS handshake still encrypts the logs and proves the agent holds the key of
//! the certificate it shows, but not which node it is.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::Empty;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use trellis_pki::AcceptAnyServerCert;

/// The common name of the API server's client certificate for nodes.
pub const CLIENT_COMMON_NAME: &str = "kube-apiserver-kubelet-client";
/// How long the certificate issued at start is valid.
pub const CLIENT_CERT_DAYS: u32 = 365;
/// Time to open a connection to a node and finish the TLS handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for a node to answer with its headers; a followed log's body then streams for
/// as long as the client reads it.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

/// HTTPS to nodes' agents.
pub struct KubeletClient {
    tls: Arc<rustls::ClientConfig>,
}

// Written by hand: the configuration holds the client key.
impl std::fmt::Debug for KubeletClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeletClient").finish_non_exhaustive()
    }
}

impl KubeletClient {
    /// A client presenting the certificate `cert_pem` with key `key_pem`.
    pub fn new(cert_pem: &str, key_pem: &str) -> anyhow::Result<Self> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .context("parse the node client certificate")?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .context("parse the node client key")?;
        let verifier = Arc::new(AcceptAnyServerCert(
            provider.signature_verification_algorithms,
        ));
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("select TLS protocol versions")?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(chain, key)
            .context("use the node client certificate")?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            tls: Arc::new(config),
        })
    }

    /// GETs `https://HOST:PORT{path_and_query}` and returns the response once its
    /// headers came; the body streams from the node as it is read. The error reads as
    /// Go's (`Get "URL": dial tcp …: connection refused`), for the client.
    pub async fn get(
        &self,
        host: &str,
        port: u16,
        path_and_query: &str,
    ) -> Result<hyper::Response<hyper::body::Incoming>, String> {
        let authority = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let url = format!("https://{authority}{path_and_query}");
        let failed = |what: String| format!("Get {url:?}: {what}");
        let tls = self.connect(host, port, &failed).await?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
                .await
                .map_err(|e| failed(e.to_string()))?;
        // Runs as long as the body is read; dropping the body (the client went away)
        // closes the connection, which ends a follow on the node.
        tokio::spawn(connection);
        let request = hyper::Request::get(path_and_query)
            .header(hyper::header::HOST, &authority)
            .body(Empty::<Bytes>::new())
            .map_err(|e| failed(e.to_string()))?;
        tokio::time::timeout(RESPONSE_TIMEOUT, sender.send_request(request))
            .await
            .map_err(|_| failed("timeout awaiting response headers".into()))?
            .map_err(|e| failed(e.to_string()))
    }

    /// A TLS connection to the agent at `host:port`, presenting the client certificate,
    /// for the caller to speak HTTP/1.1 on (`pods/exec` upgrades it to a WebSocket).
    /// `failed` words an error for the client.
    pub async fn connect(
        &self,
        host: &str,
        port: u16,
        failed: &(dyn Fn(String) -> String + Sync),
    ) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
        let authority = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let tcp = tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio::net::TcpStream::connect((host, port)),
        )
        .await
        .map_err(|_| failed(format!("dial tcp {authority}: i/o timeout")))?
        .map_err(|e| failed(format!("dial tcp {authority}: connect: {}", io_error(&e))))?;
        let _ = tcp.set_nodelay(true);
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| failed(format!("invalid host {host:?}: {e}")))?;
        let tls = tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio_rustls::TlsConnector::from(self.tls.clone()).connect(name, tcp),
        )
        .await
        .map_err(|_| failed("net/http: TLS handshake timeout".into()))?
        .map_err(|e| failed(format!("remote error: tls: {e}")))?;
        Ok(tls)
    }
}

/// An I/O error as Go words the common ones, which is what people search for.
fn io_error(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::ConnectionRefused => "connection refused".into(),
        std::io::ErrorKind::TimedOut => "i/o timeout".into(),
        std::io::ErrorKind::HostUnreachable => "no route to host".into(),
        std::io::ErrorKind::NetworkUnreachable => "network is unreachable".into(),
        _ => e.to_string(),
    }
}
