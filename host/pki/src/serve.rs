//! The TLS accept loop the API server and the node agent both run: accept until
//! shutdown, a handshake under a deadline in a task per connection, then the caller's
//! handler with the TLS stream. What each server does with a connection, and how long
//! it waits for them at the end, stays its own.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tracing::{debug, warn};
use trellis_api::Shutdown;

/// How long to wait after a failed accept (out of file descriptors and the like)
/// before the next, instead of spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// How a server accepts its connections.
#[derive(Clone, Debug)]
pub struct Config {
    /// Names the server in its logs.
    pub name: &'static str,
    /// How long a client may take to finish the TLS handshake; one that takes longer
    /// is dropped, so a silent client does not hold a task.
    pub handshake_timeout: Duration,
    /// Connections served at once; more are closed as they come. `None`: no bound.
    pub max_connections: Option<usize>,
}

/// The connections [`serve`] started, for a server that waits for them when it stops.
#[derive(Debug)]
pub struct Connections(mpsc::Receiver<()>);

impl Connections {
    /// Returns once every connection has ended, its handshake included.
    pub async fn closed(mut self) {
        // Nothing is sent: each connection's task holds a sender, and `recv` returns
        // `None` once all are dropped.
        let _ = self.0.recv().await;
    }
}

/// Accepts connections on `listener` until `shutdown`, then closes it. Each connection
/// is set to send without delay, shakes hands with `acceptor` within
/// [`Config::handshake_timeout`] in a task of its own, and is then given to `handle`
/// with the client's address.
pub async fn serve<H, F>(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    config: Config,
    shutdown: Shutdown,
    handle: H,
) -> Connections
where
    H: Fn(TlsStream<TcpStream>, SocketAddr) -> F + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let Config {
        name,
        handshake_timeout,
        max_connections,
    } = config;
    let handle = Arc::new(handle);
    let slots = max_connections.map(|n| Arc::new(Semaphore::new(n)));
    let (live, connections) = mpsc::channel::<()>(1);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutdown.wait() => break,
        };
        let (tcp, remote) = match accepted {
            Ok(a) => a,
            Err(e) => {
                warn!(server = name, error = %e, "accept failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let slot = match &slots {
            Some(slots) => match slots.clone().try_acquire_owned() {
                Ok(slot) => Some(slot),
                Err(_) => {
                    debug!(server = name, %remote, "too many clients, closing");
                    continue;
                }
            },
            None => None,
        };
        let _ = tcp.set_nodelay(true);
        let (acceptor, handle, live) = (acceptor.clone(), handle.clone(), live.clone());
        tokio::spawn(async move {
            let (_slot, _live) = (slot, live);
            let tls = match tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    debug!(server = name, %remote, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => return,
            };
            handle(tls, remote).await;
        });
    }
    Connections(connections)
}

/// The first certificate the client presented, if any: the one that names it.
pub fn peer_certificate(tls: &TlsStream<TcpStream>) -> Option<&CertificateDer<'static>> {
    tls.get_ref().1.peer_certificates()?.first()
}

#[cfg(test)]
mod tests {
    use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
    use tokio::io::AsyncReadExt as _;

    use super::*;

    fn acceptor() -> TlsAcceptor {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], key)
        .unwrap();
        TlsAcceptor::from(Arc::new(config))
    }

    fn config(max_connections: Option<usize>) -> Config {
        Config {
            name: "test",
            handshake_timeout: Duration::from_millis(200),
            max_connections,
        }
    }

    #[tokio::test]
    async fn shutdown_closes_the_listener_and_a_silent_client_times_out() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, shutdown) = Shutdown::new();
        let serving = tokio::spawn(serve(
            listener,
            acceptor(),
            config(None),
            shutdown,
            |_, _| async {},
        ));
        // Says nothing: its handshake's deadline drops it.
        let mut silent = TcpStream::connect(addr).await.unwrap();
        // Accepted before the stop: its handshake is what `closed` waits for.
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop.stop();
        let connections = serving.await.unwrap();
        assert!(TcpStream::connect(addr).await.is_err());
        connections.closed().await;
        assert_eq!(silent.read(&mut [0; 1]).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn connections_past_the_bound_are_closed() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (_stop, shutdown) = Shutdown::new();
        tokio::spawn(serve(
            listener,
            acceptor(),
            config(Some(1)),
            shutdown,
            |_, _| async {},
        ));
        let _first = TcpStream::connect(addr).await.unwrap();
        let mut second = TcpStream::connect(addr).await.unwrap();
        // Closed at once, long before the first one's handshake deadline.
        let mut byte = [0; 1];
        let read = tokio::time::timeout(Duration::from_millis(100), second.read(&mut byte));
        assert_eq!(read.await.unwrap().unwrap(), 0);
    }
}
