//! The node's client: the cluster CA as the only root, and a client certificate that
//! rotation replaces under it, closing the connections that presented the old one, as
//! the kubelet's certificate transport does.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use rustls::client::ResolvesClientCert;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, SignatureScheme};
use tokio::sync::watch;

use super::{Credentials, provider};

/// The node's client certificate, replaced in place when it rotates: connections
/// opened after a rotation present the new one, and those opened before are closed.
#[derive(Debug)]
pub struct Identity {
    current: RwLock<Arc<CertifiedKey>>,
    /// Counts rotations; a connection ends when it changes.
    generation: watch::Sender<u64>,
}

impl Identity {
    pub(super) fn new(creds: &Credentials) -> anyhow::Result<Self> {
        Ok(Self {
            current: RwLock::new(Arc::new(certified_key(creds)?)),
            generation: watch::Sender::new(0),
        })
    }

    pub(super) fn replace(&self, creds: &Credentials) -> anyhow::Result<()> {
        let key = Arc::new(certified_key(creds)?);
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = key;
        self.generation.send_modify(|g| *g += 1);
        Ok(())
    }
}

fn certified_key(creds: &Credentials) -> anyhow::Result<CertifiedKey> {
    let chain = CertificateDer::pem_slice_iter(creds.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .context("parse the node's certificate")?;
    let key =
        PrivateKeyDer::from_pem_slice(creds.key_pem.as_bytes()).context("parse the node's key")?;
    let signing =
        rustls::crypto::ring::sign::any_supported_type(&key).context("load the node's key")?;
    Ok(CertifiedKey::new(chain, signing))
}

impl ResolvesClientCert for Identity {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        )
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// A client for the node: the cluster CA as the only root, the node's certificate
/// from `identity`.
pub fn client(creds: &Credentials, identity: Arc<Identity>) -> anyhow::Result<kube::Client> {
    use hyper_util::rt::TokioExecutor;
    use kube::client::ConfigExt as _;
    use tower::{BoxError, ServiceBuilder};
    let mut roots = RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(creds.ca_pem.as_bytes()) {
        roots
            .add(ca.context("parse the cluster CA")?)
            .context("trust the cluster CA")?;
    }
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("select TLS protocol versions")?
        .with_root_certificates(roots)
        .with_client_cert_resolver(identity.clone());
    // A resumed session keeps the certificate of the handshake it resumes: after a
    // rotation that would be the old one again.
    tls.resumption = rustls::client::Resumption::disabled();
    let url: hyper::Uri = creds
        .server
        .parse()
        .with_context(|| format!("parse the server URL {:?}", creds.server))?;
    let config = kube::Config::new(url);
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(10)));
    let generation = identity.generation.subscribe();
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_all_versions()
        .wrap_connector(http);
    let https = ClosedOnRotation {
        inner: https,
        generation,
    };
    let hyper: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .http2_keep_alive_interval(Duration::from_secs(30))
            .http2_keep_alive_timeout(Duration::from_secs(10))
            .build(https);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .map_err(BoxError::from)
        .service(hyper);
    Ok(kube::Client::new(service, config.default_namespace))
}

/// A connector whose connections end when the node's certificate rotates.
#[derive(Clone)]
struct ClosedOnRotation<C> {
    inner: C,
    generation: watch::Receiver<u64>,
}

impl<C> tower::Service<hyper::Uri> for ClosedOnRotation<C>
where
    C: tower::Service<hyper::Uri>,
    C::Future: Send + 'static,
    C::Response: Send + 'static,
{
    type Response = ClosedOnRotationIo<C::Response>;
    type Error = C::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, C::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), C::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: hyper::Uri) -> Self::Future {
        // The generation before the handshake: a rotation during it closes the
        // connection, whichever certificate it presented.
        let mut generation = self.generation.clone();
        generation.mark_unchanged();
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            let io = connecting.await?;
            let rotated = Box::pin(async move {
                if generation.changed().await.is_err() {
                    // The identity is gone, and with it any rotation.
                    std::future::pending::<()>().await;
                }
            });
            Ok(ClosedOnRotationIo {
                io,
                rotated,
                closed: false,
            })
        })
    }
}

/// A connection that fails its reads and writes once the certificate has rotated, so
/// that the client's pool drops it and opens a new one with the new certificate.
struct ClosedOnRotationIo<T> {
    io: T,
    rotated: Pin<Box<dyn Future<Output = ()> + Send>>,
    closed: bool,
}

impl<T> ClosedOnRotationIo<T> {
    /// Polled on every read, so an idle connection (whose task waits in a read) is
    /// woken and ended by a rotation too.
    fn check(&mut self, cx: &mut Context<'_>) -> std::io::Result<()> {
        if !self.closed && self.rotated.as_mut().poll(cx).is_ready() {
            self.closed = true;
        }
        if self.closed {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "closed: the node's certificate rotated",
            ));
        }
        Ok(())
    }
}

impl<T: hyper::rt::Read + Unpin> hyper::rt::Read for ClosedOnRotationIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write + Unpin> hyper::rt::Write for ClosedOnRotationIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl<T: hyper_util::client::legacy::connect::Connection>
    hyper_util::client::legacy::connect::Connection for ClosedOnRotationIo<T>
{
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        self.io.connected()
    }
}
