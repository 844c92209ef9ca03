//! One client connection, after TLS: HTTP/1.1 or HTTP/2 with the timeouts
//! kube-apiserver's Go server has, so that a client that connects and sends nothing,
//! or stops halfway through its headers, cannot hold a file descriptor for ever.
//!
//! - A new connection's first request must have sent its headers within
//!   [`Settings::header_read_timeout`] (both protocols), else the connection is
//!   closed: a client that finishes its TLS handshake and says nothing, or sends only
//!   HTTP/2's preface, does not hold it until the idle timeout. Each later request on
//!   an HTTP/1.1 connection has the same deadline, from the end of the response before
//!   it (hyper's `header_read_timeout`).
//! - A connection with no request in flight for [`Settings::idle_timeout`] is closed
//!   gracefully (both protocols). A request is in flight from its headers until its
//!   response body ends, so a quiet watch is not idle.
//! - HTTP/2 connections are pinged; a peer that stops answering is dropped.
//! - A write that stays blocked for [`Settings::stalled_write_timeout`] (the client
//!   stopped reading: a watch nobody reads) closes the connection.
//! - Bodies are bounded and timed by the request path ([`crate::endpoints::dispatch`]).

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http_body_util::BodyExt as _;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tower::ServiceExt as _;
use tracing::debug;
use trellis_api::Shutdown;

use crate::authentication::Peer;
use crate::state::Settings;

/// Streams one HTTP/2 connection may have open at once: kube-apiserver's default.
const HTTP2_MAX_STREAMS: u32 = 1000;
/// The most header bytes a request may send: Go's `DefaultMaxHeaderBytes` (1 MiB).
/// Past it hyper answers 431 and closes.
const MAX_HEADER_BYTES: usize = 1 << 20;
/// How often an HTTP/2 peer is pinged, and how long its answer may take.
const HTTP2_PING: (Duration, Duration) = (Duration::from_secs(30), Duration::from_secs(20));

/// Serves one connection until the client closes it, it idles out, or `stop` is set (a
/// graceful close: requests in flight finish).
pub async fn serve<I>(
    io: I,
    app: Router,
    peer: Peer,
    settings: &Settings,
    stop: Shutdown,
    remote: std::net::SocketAddr,
    stalled: Counter,
) where
    I: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (active, mut idle) = watch::channel(0_usize);
    // Set once a request's headers are in: the first request's deadline is met.
    let (requested, mut first_request) = watch::channel(false);
    let service = tower::service_fn(move |request: axum::http::Request<hyper::body::Incoming>| {
        requested.send_replace(true);
        let app = app.clone();
        let guard = InFlight::new(active.clone());
        let mut request = request.map(Body::new);
        request.extensions_mut().insert(peer.clone());
        async move {
            let response = app.oneshot(request).await?;
            // In flight until the body is done: the guard lives as long as the body.
            Ok::<_, std::convert::Infallible>(response.map(move |body| {
                Body::new(body.map_frame(move |frame| {
                    let _ = &guard;
                    frame
                }))
            }))
        }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(settings.header_read_timeout)
        .max_buf_size(MAX_HEADER_BYTES);
    // Watches are streams that stay open: a client-go process runs all its informers
    // over one connection, so allow as many streams on one as kube-apiserver does
    // (--http2-max-streams-per-connection), not hyper's 200.
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(HTTP2_MAX_STREAMS)
        .max_header_list_size(MAX_HEADER_BYTES as u32)
        .keep_alive_interval(HTTP2_PING.0)
        .keep_alive_timeout(HTTP2_PING.1);
    // With upgrades: `pods/exec` switches its connection to a WebSocket.
    let connection = builder.serve_connection_with_upgrades(
        TokioIo::new(ConnIo::new(io, settings.stalled_write_timeout, stalled)),
        hyper_util::service::TowerToHyperService::new(service),
    );
    tokio::pin!(connection);
    let idle_timeout = settings.idle_timeout;
    let closing = tokio::select! {
        result = connection.as_mut() => {
            if let Err(e) = result {
                debug!(%remote, error = %e, "connection ended with an error");
            }
            return;
        }
        () = no_request_within(&mut first_request, settings.header_read_timeout) => {
            // Dropped rather than shut down gracefully: there is no request to
            // finish, and HTTP/2's graceful goodbye waits for the client to answer.
            debug!(%remote, "no request headers in time: closing the connection");
            return;
        }
        () = idled_for(&mut idle, idle_timeout) => "idle",
        _ = stop.wait() => "server stopping",
    };
    debug!(%remote, reason = closing, "closing the connection");
    connection.as_mut().graceful_shutdown();
    if let Err(e) = connection.await {
        debug!(%remote, error = %e, "connection ended with an error");
    }
}

/// Completes if no request has sent its headers within `timeout` (Go's
/// `ReadHeaderTimeout` for a new connection). hyper's own deadline does not cover this:
/// its HTTP/1.1 timer starts only once the first bytes have told HTTP/1.1 from HTTP/2,
/// and HTTP/2 has none.
async fn no_request_within(requested: &mut watch::Receiver<bool>, timeout: Duration) {
    let in_time = tokio::time::timeout(timeout, requested.wait_for(|r| *r))
        .await
        .is_ok();
    // In time, or the connection is over (its service, and the sender, dropped).
    if in_time {
        std::future::pending::<()>().await;
    }
}

/// Completes once no request has been in flight for `timeout`.
async fn idled_for(active: &mut watch::Receiver<usize>, timeout: Duration) {
    loop {
        if active.wait_for(|n| *n == 0).await.is_err() {
            return std::future::pending().await;
        }
        tokio::select! {
            () = tokio::time::sleep(timeout) => {
                if *active.borrow() == 0 {
                    return;
                }
            }
            changed = active.changed() => {
                if changed.is_err() {
                    return std::future::pending().await;
                }
            }
        }
    }
}

/// The connection's I/O, as the server writes it:
/// - writes fail with `TimedOut` once they have been blocked for longer than a deadline,
///   so a peer that stops reading cannot hold the connection and the buffers behind it
///   for ever;
/// - the bodiless error responses hyper writes itself when it cannot parse a request
///   (400 for a malformed request line, 414 for a URI too long, 431 for headers too
///   large) are written as Kubernetes `Status` responses instead, as every other error
///   a client sees. Only those are rewritten: every response of the server's own has a
///   body.
struct ConnIo<I> {
    io: I,
    limit: Duration,
    /// Set while writes are blocked: when they started to be.
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// A rewritten response not yet written whole, and how much of it is.
    pending: Option<(Vec<u8>, usize)>,
    /// Connections closed because their writes stalled (`/metrics`); counted once.
    stalled_closes: Counter,
    closed_for_stall: bool,
}

type Poll<T> = std::task::Poll<T>;

impl<I: AsyncWrite + Unpin> ConnIo<I> {
    fn new(io: I, limit: Duration, stalled_closes: Counter) -> Self {
        Self {
            io,
            limit,
            stalled: None,
            pending: None,
            stalled_closes,
            closed_for_stall: false,
        }
    }

    /// After a write returned `Pending`: `Ready(Err)` once the deadline has passed.
    fn check_stall(&mut self, cx: &mut std::task::Context<'_>) -> Poll<std::io::Error> {
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                if !std::mem::replace(&mut self.closed_for_stall, true) {
                    self.stalled_closes.inc();
                }
                Poll::Ready(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the client stopped reading",
                ))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// Maps a write's outcome through the stall deadline.
    fn timed<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        polled: Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        match polled {
            Poll::Pending => self.check_stall(cx).map(Err),
            done => {
                self.stalled = None;
                done
            }
        }
    }

    /// Writes what is left of a rewritten response; `Ready(Ok)` once it is all out.
    fn drain(&mut self, cx: &mut std::task::Context<'_>) -> Poll<std::io::Result<()>> {
        while let Some((bytes, written)) = &mut self.pending {
            if *written >= bytes.len() {
                self.pending = None;
                break;
            }
            let polled = std::pin::Pin::new(&mut self.io).poll_write(cx, &bytes[*written..]);
            match polled {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
                }
                Poll::Ready(Ok(n)) => {
                    self.stalled = None;
                    if let Some((_, written)) = &mut self.pending {
                        *written += n;
                    }
                }
                other => return self.timed(cx, other.map(|r| r.map(|_| ()))),
            }
        }
        Poll::Ready(Ok(()))
    }
}

/// hyper's own bodiless answer to a request it could not parse, as a `Status`
/// response: the head and what followed it in `buf`, or `None` for anything else.
fn status_for_protocol_error(buf: &[u8]) -> Option<Vec<u8>> {
    let code = [b"HTTP/1.1 ", b"HTTP/1.0 "]
        .iter()
        .find_map(|p| buf.strip_prefix(*p))?
        .get(..3)?;
    let (code, reason, message) = match code {
        b"400" => (
            400,
            trellis_api::status::Reason::BadRequest,
            "the request could not be parsed as HTTP",
        ),
        b"414" => (
            414,
            trellis_api::status::Reason::BadRequest,
            "the request URI is too long",
        ),
        b"431" => (
            431,
            trellis_api::status::Reason::BadRequest,
            "the request's header fields are too large",
        ),
        _ => return None,
    };
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&buf[..end]).ok()?.to_ascii_lowercase();
    if !head.contains("\r\ncontent-length: 0\r\n") {
        return None;
    }
    let status = trellis_api::ApiError::new(code, reason, message).to_status();
    let body = serde_json::to_vec(&status).ok()?;
    let reason_phrase = axum::http::StatusCode::from_u16(code)
        .ok()
        .and_then(|c| c.canonical_reason())
        .unwrap_or("");
    let mut out = format!(
        "HTTP/1.1 {code} {reason_phrase}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out.extend_from_slice(&buf[end..]);
    Some(out)
}

impl<I: AsyncRead + Unpin> AsyncRead for ConnIo<I> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for ConnIo<I> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        if let Poll::Ready(Err(e)) = this.drain(cx) {
            return Poll::Ready(Err(e));
        }
        if this.pending.is_some() {
            return Poll::Pending;
        }
        if let Some(rewritten) = status_for_protocol_error(buf) {
            this.pending = Some((rewritten, 0));
            // Taken whole: what is left is written by the next calls (and flush).
            return match this.drain(cx) {
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                _ => Poll::Ready(Ok(buf.len())),
            };
        }
        let polled = std::pin::Pin::new(&mut this.io).poll_write(cx, buf);
        this.timed(cx, polled)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        match this.drain(cx) {
            Poll::Ready(Ok(())) => {}
            other => return other,
        }
        let polled = std::pin::Pin::new(&mut this.io).poll_flush(cx);
        this.timed(cx, polled)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        match this.drain(cx) {
            Poll::Ready(Ok(())) => {}
            other => return other,
        }
        std::pin::Pin::new(&mut this.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        // A response hyper writes itself is one slice; take it through `poll_write`.
        if self.pending.is_some()
            || bufs
                .iter()
                .find(|b| !b.is_empty())
                .is_some_and(|b| status_for_protocol_error(b).is_some())
        {
            let first = bufs
                .iter()
                .find(|b| !b.is_empty())
                .map_or(&[][..], |b| &**b);
            return self.poll_write(cx, first);
        }
        let this = &mut *self;
        let polled = std::pin::Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.timed(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// One request in flight on a connection, until dropped.
#[derive(Debug)]
struct InFlight(watch::Sender<usize>);

impl InFlight {
    fn new(active: watch::Sender<usize>) -> Self {
        active.send_modify(|n| *n += 1);
        Self(active)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}
