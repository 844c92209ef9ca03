//! `kubectl port-forward` on the node: the kubelet's `/portForward/{namespace}/{pod}`
//! (and `/portForward/{namespace}/{pod}/{uid}`), which the API server's
//! `pods/portforward` passes on to. Start with [`handle`].
//!
//! # Protocols
//! As the kubelet serves them:
//! - **SPDY/3.1** (`Upgrade: SPDY/3.1`, `X-Stream-Protocol-Version:
//!   portforward.k8s.io`), what kubectl speaks, directly (≤ 1.30) or tunnelled in a
//!   WebSocket the API server unwraps (1.31+). For each local connection the client
//!   opens two streams with headers `streamType` (`error`, `data`), `port` and
//!   `requestID`; once both of a request are there the node connects to the port, and
//!   copies between the connection and the data stream. A failure is written as text
//!   on the error stream; the node closes both streams when the pod's side ends.
//! - **WebSocket** (`v4.channel.k8s.io`, `channel.k8s.io`, `portforward.k8s.io`), the
//!   ports in the query (`?ports=80,8080`): port *i* has channels 2*i* (data) and
//!   2*i*+1 (error), and the first message on each, from the node, is the port
//!   (2 bytes, little-endian). One connection per port for the WebSocket's life.
//!
//! # Where it connects
//! To `127.0.0.1:PORT` as the pod sees it: inside the pod's network namespace (found
//! by its sandbox; see [`trellis_runtime::sandbox_netns`]), or on the node's loopback
//! for a pod on the node's network (hostNetwork, or no pod network).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::{SinkExt as _, StreamExt as _};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::header::{
    CONNECTION, HeaderValue, SEC_WEBSOCKET_ACCEPT, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_PROTOCOL,
    UPGRADE,
};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_cri::v1 as cri;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;
use tracing::debug;

use crate::Context;
use crate::http::{Body, text, valid_name};
use crate::labels::{POD_NAME, POD_NAMESPACE, POD_UID};
use crate::spdy::{self, Frame};

/// The SPDY subprotocol (`X-Stream-Protocol-Version`) of port forwarding.
pub const SPDY_PROTOCOL: &str = "portforward.k8s.io";
/// The WebSocket subprotocols served, best first; all carry binary channels.
pub const WEBSOCKET_PROTOCOLS: &[&str] =
    &["v4.channel.k8s.io", "channel.k8s.io", "portforward.k8s.io"];

/// How long the runtime may take to answer.
const RUNTIME_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection to the pod's port may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes read from the pod's connection at a time (one data frame or message).
const CHUNK: usize = 32 * 1024;
/// Frames or messages waiting for a slow side.
const BUFFERED: usize = 16;

/// Where the pod's ports are.
#[derive(Clone, Debug)]
enum Target {
    /// The node's loopback: the pod is on the node's network.
    Node,
    /// The loopback of the network namespace pinned here.
    Netns(PathBuf),
}

/// The pod's sandbox and where its ports are, or why they cannot be reached.
#[derive(Clone, Debug)]
struct Pod {
    sandbox: String,
    uid: String,
    target: Result<Target, String>,
}

impl Pod {
    /// A connection to `port` as the pod sees it, or the kubelet's words for the
    /// failure, which the client shows.
    async fn connect(&self, port: u16) -> Result<TcpStream, String> {
        let connected = match &self.target {
            Err(why) => Err(why.clone()),
            Ok(Target::Node) => tokio::time::timeout(
                CONNECT_TIMEOUT,
                TcpStream::connect((std::net::Ipv4Addr::LOCALHOST, port)),
            )
            .await
            .map_err(|_| dial_error(port, &std::io::ErrorKind::TimedOut.into()))
            .and_then(|c| c.map_err(|e| dial_error(port, &e))),
            Ok(Target::Netns(pin)) => {
                let pin = pin.clone();
                let inside = tokio::task::spawn_blocking(move || {
                    trellis_runtime::connect_in_netns(&pin, port, CONNECT_TIMEOUT)
                })
                .await
                .map_err(|e| e.to_string())
                .and_then(|c| {
                    c.map_err(|e| {
                        format!(
                            "failed to connect to localhost:{port} inside the pod's network namespace: {}",
                            dial_error(port, &e)
                        )
                    })
                });
                inside.and_then(|std| {
                    std.set_nonblocking(true)
                        .and_then(|()| TcpStream::from_std(std))
                        .map_err(|e| e.to_string())
                })
            }
        };
        connected.map_err(|e| {
            format!(
                "error forwarding port {port} to pod {}, uid {}: {e}",
                self.sandbox, self.uid
            )
        })
    }
}

/// A failed connection in Go's words (`dial tcp 127.0.0.1:80: connect: connection
/// refused`), which is what the kubelet's clients show and people search for.
fn dial_error(port: u16, e: &std::io::Error) -> String {
    let words = match e.kind() {
        std::io::ErrorKind::ConnectionRefused => "connect: connection refused".to_owned(),
        std::io::ErrorKind::TimedOut => "i/o timeout".to_owned(),
        _ => format!("connect: {e}"),
    };
    format!("dial tcp 127.0.0.1:{port}: {words}")
}

/// Serves `/portForward/{target}`: finds the pod's sandbox, answers 101 in the
/// protocol the client asked for and forwards on the upgraded connection. The client
/// was authorized already.
pub async fn handle(
    ctx: Arc<Context>,
    target: &str,
    mut request: Request<Incoming>,
) -> Response<Body> {
    let parts: Vec<&str> = target.split('/').collect();
    let (namespace, name, uid) = match parts[..] {
        [namespace, name] => (namespace, name, None),
        [namespace, name, uid] => (namespace, name, Some(uid)),
        _ => {
            return text(
                StatusCode::NOT_FOUND,
                "expected /portForward/{namespace}/{pod}[/{uid}]",
            );
        }
    };
    if let Some(bad) = [namespace, name].into_iter().find(|n| !valid_name(n)) {
        return text(StatusCode::BAD_REQUEST, format!("invalid name {bad:?}"));
    }
    let headers = request.headers();
    let upgrade = headers
        .get(UPGRADE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let protocol = match upgrade.as_str() {
        "spdy/3.1" => {
            let offered = headers
                .get_all("x-stream-protocol-version")
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(','))
                .any(|p| p.trim() == SPDY_PROTOCOL);
            if !offered {
                return text(
                    StatusCode::FORBIDDEN,
                    format!(
                        "unable to upgrade: unable to negotiate protocol: client supports [], server supports [{SPDY_PROTOCOL}]"
                    ),
                );
            }
            Protocol::Spdy
        }
        "websocket" => {
            let Some(key) = headers.get(SEC_WEBSOCKET_KEY) else {
                return text(StatusCode::BAD_REQUEST, "no Sec-WebSocket-Key");
            };
            let offered: Vec<&str> = headers
                .get_all(SEC_WEBSOCKET_PROTOCOL)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(','))
                .map(str::trim)
                .collect();
            let Some(chosen) = offered
                .iter()
                .find_map(|p| WEBSOCKET_PROTOCOLS.iter().find(|s| *s == p))
            else {
                return text(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "none of the offered subprotocols is served: port forwarding speaks {}",
                        WEBSOCKET_PROTOCOLS.join(", ")
                    ),
                );
            };
            let ports = match ports(request.uri().query().unwrap_or("")) {
                Ok(p) => p,
                Err(message) => return text(StatusCode::BAD_REQUEST, message),
            };
            Protocol::WebSocket {
                accept: tokio_tungstenite::tungstenite::handshake::derive_accept_key(
                    key.as_bytes(),
                ),
                chosen,
                ports,
            }
        }
        _ => {
            return text(
                StatusCode::BAD_REQUEST,
                "Upgrade request required: port forwarding is served over SPDY/3.1 or a WebSocket",
            );
        }
    };
    let pod = match find(&ctx, namespace, name, uid).await {
        Ok(pod) => pod,
        Err((status, message)) => return text(status, message),
    };
    let upgrade = hyper::upgrade::on(&mut request);
    let (namespace, name) = (namespace.to_owned(), name.to_owned());
    let mut response = Response::new(Full::new(Bytes::new()).boxed_unsync());
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let out = response.headers_mut();
    out.insert(CONNECTION, HeaderValue::from_static("Upgrade"));
    match protocol {
        Protocol::Spdy => {
            out.insert(UPGRADE, HeaderValue::from_static("SPDY/3.1"));
            out.insert(
                "x-stream-protocol-version",
                HeaderValue::from_static(SPDY_PROTOCOL),
            );
            tokio::spawn(async move {
                match upgrade.await {
                    Ok(io) => spdy_session(TokioIo::new(io), pod).await,
                    Err(e) => {
                        debug!(%namespace, pod = %name, error = %e, "port-forward: the upgrade failed")
                    }
                }
                debug!(%namespace, pod = %name, "port-forward ended");
            });
        }
        Protocol::WebSocket {
            accept,
            chosen,
            ports,
        } => {
            out.insert(UPGRADE, HeaderValue::from_static("websocket"));
            out.insert(SEC_WEBSOCKET_PROTOCOL, HeaderValue::from_static(chosen));
            if let Ok(accept) = HeaderValue::from_str(&accept) {
                out.insert(SEC_WEBSOCKET_ACCEPT, accept);
            }
            tokio::spawn(async move {
                match upgrade.await {
                    Ok(io) => {
                        let ws =
                            WebSocketStream::from_raw_socket(TokioIo::new(io), Role::Server, None)
                                .await;
                        websocket_session(ws, pod, ports).await;
                    }
                    Err(e) => {
                        debug!(%namespace, pod = %name, error = %e, "port-forward: the upgrade failed")
                    }
                }
                debug!(%namespace, pod = %name, "port-forward ended");
            });
        }
    }
    response
}

enum Protocol {
    Spdy,
    WebSocket {
        accept: String,
        chosen: &'static str,
        ports: Vec<u16>,
    },
}

/// The `ports` of a WebSocket request's query (`ports=80,8080` or repeated), as the
/// kubelet reads them.
fn ports(query: &str) -> Result<Vec<u16>, String> {
    let mut ports = Vec::new();
    for (key, value) in form_urlencoded::parse(query.as_bytes()) {
        if key != "ports" {
            continue;
        }
        for port in value.split(',').map(str::trim) {
            match port.parse::<u16>() {
                Ok(p) if p > 0 => ports.push(p),
                _ => return Err(format!("unable to parse {port:?} as a port")),
            }
        }
    }
    if ports.is_empty() {
        return Err("at least 1 port must be specified".into());
    }
    Ok(ports)
}

/// The pod's ready sandbox (of pod `uid` when given) and where its ports are; the
/// error is an HTTP status and message, before the upgrade.
async fn find(
    ctx: &Context,
    namespace: &str,
    name: &str,
    uid: Option<&str>,
) -> Result<Pod, (StatusCode, String)> {
    let mut runtime = ctx.cri.runtime.clone();
    let mut labels: HashMap<String, String> = [(POD_NAMESPACE, namespace), (POD_NAME, name)]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    if let Some(uid) = uid {
        labels.insert(POD_UID.to_owned(), uid.to_owned());
    }
    let runtime_error = |e: String| {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("ask the container runtime for pod {name:?}'s sandbox: {e}"),
        )
    };
    let listed = tokio::time::timeout(
        RUNTIME_TIMEOUT,
        runtime.list_pod_sandbox(cri::ListPodSandboxRequest {
            filter: Some(cri::PodSandboxFilter {
                state: Some(cri::PodSandboxStateValue {
                    state: cri::PodSandboxState::SandboxReady as i32,
                }),
                label_selector: labels,
                ..Default::default()
            }),
        }),
    )
    .await
    .map_err(|_| runtime_error("timed out".into()))?
    .map_err(|e| runtime_error(e.message().to_owned()))?
    .into_inner();
    let Some(sandbox) = listed.items.into_iter().max_by_key(|s| s.created_at) else {
        return Err((
            StatusCode::NOT_FOUND,
            format!("pod {name:?} in namespace {namespace:?} has no running sandbox on this node"),
        ));
    };
    let status = tokio::time::timeout(
        RUNTIME_TIMEOUT,
        runtime.pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: sandbox.id.clone(),
            verbose: true,
        }),
    )
    .await
    .map_err(|_| runtime_error("timed out".into()))?
    .map_err(|e| runtime_error(e.message().to_owned()))?
    .into_inner();
    let on_node = status
        .status
        .as_ref()
        .and_then(|s| s.linux.as_ref())
        .and_then(|l| l.namespaces.as_ref())
        .and_then(|n| n.options.as_ref())
        .is_some_and(|o| o.network == cri::NamespaceMode::Node as i32);
    let target = if on_node {
        Ok(Target::Node)
    } else {
        netns_of(&status.info)
            .or_else(|| trellis_runtime::sandbox_netns(&sandbox.id))
            .map(Target::Netns)
            .ok_or_else(|| {
                format!(
                    "the network namespace of sandbox {} is not on this node's mount table",
                    sandbox.id
                )
            })
    };
    Ok(Pod {
        uid: sandbox.labels.get(POD_UID).cloned().unwrap_or_default(),
        sandbox: sandbox.id,
        target,
    })
}

/// The network namespace a runtime's verbose sandbox status names: containerd's
/// `info` is the sandbox's OCI spec, whose network namespace has the path.
fn netns_of(info: &HashMap<String, String>) -> Option<PathBuf> {
    let info: serde_json::Value = serde_json::from_str(info.get("info")?).ok()?;
    info.pointer("/runtimeSpec/linux/namespaces")?
        .as_array()?
        .iter()
        .find(|n| n["type"] == "network")?
        .get("path")?
        .as_str()
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// What the session's reader tells a data stream's forwarder.
#[derive(Debug)]
enum Inbound {
    Data(Bytes),
    /// The client sends no more (FIN).
    Fin,
}

/// A request's two streams, as they arrive.
#[derive(Default)]
struct Pair {
    port: u16,
    data: Option<u32>,
    error: Option<u32>,
}

/// Serves one SPDY session until the client goes away or says GOAWAY.
async fn spdy_session<S>(io: S, pod: Pod)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut read, mut write) = tokio::io::split(io);
    let (out, mut outgoing) = mpsc::channel::<Frame>(BUFFERED);
    let writer = tokio::spawn(async move {
        let mut encoder = spdy::Encoder::default();
        let mut buf = BytesMut::new();
        while let Some(frame) = outgoing.recv().await {
            buf.clear();
            if let Err(e) = encoder.encode(&frame, &mut buf) {
                debug!(error = %e, "port-forward: cannot write a frame");
                continue;
            }
            if write.write_all(&buf).await.is_err() {
                return;
            }
        }
        let _ = write.shutdown().await;
    });
    let mut decoder = spdy::Decoder::default();
    let mut buf = BytesMut::with_capacity(CHUNK);
    let mut pairs: HashMap<String, Pair> = HashMap::new();
    let mut inbound: HashMap<u32, mpsc::Sender<Inbound>> = HashMap::new();
    let mut forwards = tokio::task::JoinSet::new();
    'session: loop {
        let frame = loop {
            match decoder.decode(&mut buf) {
                Ok(Some(frame)) => break frame,
                Ok(None) => {}
                Err(e) => {
                    debug!(error = %e, "port-forward: a bad SPDY frame");
                    let _ = out
                        .send(Frame::GoAway {
                            last_good: 0,
                            status: 1,
                        })
                        .await;
                    break 'session;
                }
            }
            match read.read_buf(&mut buf).await {
                Ok(0) | Err(_) => break 'session,
                Ok(_) => {}
            }
        };
        match frame {
            Frame::SynStream {
                stream,
                fin,
                headers,
            } => {
                let kind = spdy::header(&headers, "streamtype").unwrap_or("");
                let port = spdy::header(&headers, "port").and_then(|p| p.parse::<u16>().ok());
                let (Some(port), "data" | "error") = (port.filter(|p| *p > 0), kind) else {
                    debug!(
                        stream,
                        ?headers,
                        "port-forward: a stream without a valid port or type"
                    );
                    let _ = out
                        .send(Frame::RstStream {
                            stream,
                            status: spdy::PROTOCOL_ERROR,
                        })
                        .await;
                    continue;
                };
                let request = spdy::header(&headers, "requestid").unwrap_or("").to_owned();
                let _ = out
                    .send(Frame::SynReply {
                        stream,
                        fin: false,
                        headers: Vec::new(),
                    })
                    .await;
                let pair = pairs.entry(request.clone()).or_default();
                pair.port = port;
                if kind == "data" {
                    pair.data = Some(stream);
                } else {
                    pair.error = Some(stream);
                }
                if let (Some(data), Some(error)) = (pair.data, pair.error) {
                    let port = pair.port;
                    pairs.remove(&request);
                    let (tx, rx) = mpsc::channel(BUFFERED);
                    if !(fin && stream == data) {
                        inbound.insert(data, tx);
                    }
                    forwards.spawn(spdy_forward(
                        pod.clone(),
                        port,
                        data,
                        error,
                        rx,
                        out.clone(),
                    ));
                }
            }
            Frame::Data { stream, fin, data } => {
                if let Some(tx) = inbound.get(&stream) {
                    if !data.is_empty() && tx.send(Inbound::Data(data)).await.is_err() {
                        inbound.remove(&stream);
                    } else if fin {
                        let _ = tx.send(Inbound::Fin).await;
                        inbound.remove(&stream);
                    }
                }
            }
            Frame::RstStream { stream, .. } => {
                // Dropping its sender ends the forward without a FIN.
                inbound.remove(&stream);
            }
            // The client's pings (odd IDs) come back as they came.
            Frame::Ping(id) => {
                let _ = out.send(Frame::Ping(id)).await;
            }
            Frame::GoAway { .. } => break 'session,
            Frame::SynReply { .. }
            | Frame::Headers { .. }
            | Frame::WindowUpdate { .. }
            | Frame::Other { .. } => {}
        }
    }
    // The client is gone or done: what is still forwarding ends.
    drop(inbound);
    forwards.abort_all();
    while forwards.join_next().await.is_some() {}
    drop(out);
    let _ = writer.await;
}

/// One forwarded connection of a SPDY session: connects, then copies both ways until
/// the pod's side ends (or the client resets the stream); a failure goes on the error
/// stream. Both streams are closed at the end, as the kubelet closes them.
async fn spdy_forward(
    pod: Pod,
    port: u16,
    data: u32,
    error: u32,
    mut inbound: mpsc::Receiver<Inbound>,
    out: mpsc::Sender<Frame>,
) {
    match pod.connect(port).await {
        Err(message) => {
            debug!(port, %message, "port-forward: cannot connect");
            let _ = out
                .send(Frame::Data {
                    stream: error,
                    fin: false,
                    data: Bytes::from(message),
                })
                .await;
        }
        Ok(tcp) => {
            let (mut from_pod, mut to_pod) = tcp.into_split();
            let up = async {
                while let Some(message) = inbound.recv().await {
                    match message {
                        Inbound::Data(bytes) => {
                            if to_pod.write_all(&bytes).await.is_err() {
                                return false;
                            }
                        }
                        Inbound::Fin => {
                            let _ = to_pod.shutdown().await;
                            return true;
                        }
                    }
                }
                // Reset, or the session ended.
                false
            };
            let down = async {
                let mut chunk = vec![0u8; CHUNK];
                loop {
                    match from_pod.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            let frame = Frame::Data {
                                stream: data,
                                fin: false,
                                data: Bytes::copy_from_slice(&chunk[..n]),
                            };
                            if out.send(frame).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            };
            tokio::pin!(up, down);
            // The pod's side ending ends the forward; the client's FIN only closes
            // the pod's input, and its reset ends it all.
            tokio::select! {
                () = &mut down => {}
                finished = &mut up => if finished { down.await },
            }
        }
    }
    for stream in [data, error] {
        let _ = out
            .send(Frame::Data {
                stream,
                fin: true,
                data: Bytes::new(),
            })
            .await;
    }
}

type Ws<S> = WebSocketStream<S>;

/// Serves one WebSocket: a connection per port, until the client closes or every
/// port's connection ended.
async fn websocket_session<S>(ws: Ws<S>, pod: Pod, ports: Vec<u16>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sink, mut incoming) = ws.split();
    let (out, mut outgoing) = mpsc::channel::<Message>(BUFFERED);
    let writer = tokio::spawn(async move {
        while let Some(message) = outgoing.recv().await {
            let close = matches!(message, Message::Close(_));
            if sink.send(message).await.is_err() || close {
                return;
            }
        }
        let _ = sink.close().await;
    });
    let mut to_pods = Vec::new();
    let mut forwards = tokio::task::JoinSet::new();
    for (i, &port) in ports.iter().enumerate() {
        let (data, error) = ((2 * i) as u8, (2 * i + 1) as u8);
        let prefix = port.to_le_bytes();
        for channel in [data, error] {
            let _ = out
                .send(Message::Binary(Bytes::from(vec![
                    channel, prefix[0], prefix[1],
                ])))
                .await;
        }
        let (tx, rx) = mpsc::channel::<Inbound>(BUFFERED);
        to_pods.push(tx);
        forwards.spawn(websocket_forward(
            pod.clone(),
            port,
            data,
            error,
            rx,
            out.clone(),
        ));
    }
    let reading = async {
        while let Some(Ok(message)) = incoming.next().await {
            match message {
                Message::Binary(bytes) => {
                    let Some((&channel, rest)) = bytes.split_first() else {
                        continue;
                    };
                    // Only data channels (even) are the client's to write.
                    let index = usize::from(channel / 2);
                    if channel % 2 == 0
                        && !rest.is_empty()
                        && let Some(tx) = to_pods.get(index)
                    {
                        let _ = tx.send(Inbound::Data(bytes.slice(1..))).await;
                    }
                }
                Message::Close(_) => return,
                _ => {}
            }
        }
    };
    tokio::select! {
        () = reading => {}
        () = async { while forwards.join_next().await.is_some() {} } => {}
    }
    forwards.abort_all();
    let _ = out.send(Message::Close(None)).await;
    drop(out);
    let _ = writer.await;
}

/// One port of a WebSocket session.
async fn websocket_forward(
    pod: Pod,
    port: u16,
    data: u8,
    error: u8,
    mut inbound: mpsc::Receiver<Inbound>,
    out: mpsc::Sender<Message>,
) {
    let tcp = match pod.connect(port).await {
        Ok(tcp) => tcp,
        Err(message) => {
            let mut bytes = vec![error];
            bytes.extend_from_slice(message.as_bytes());
            let _ = out.send(Message::Binary(Bytes::from(bytes))).await;
            return;
        }
    };
    let (mut from_pod, mut to_pod) = tcp.into_split();
    let up = async {
        while let Some(Inbound::Data(bytes)) = inbound.recv().await {
            if to_pod.write_all(&bytes).await.is_err() {
                return;
            }
        }
    };
    let down = async {
        let mut chunk = vec![0u8; CHUNK + 1];
        chunk[0] = data;
        loop {
            match from_pod.read(&mut chunk[1..]).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let message = Message::Binary(Bytes::copy_from_slice(&chunk[..n + 1]));
                    if out.send(message).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_ports_of_a_websocket_request() {
        assert_eq!(ports("ports=80,8080").unwrap(), [80, 8080]);
        assert_eq!(ports("ports=80&ports=81").unwrap(), [80, 81]);
        assert!(ports("").is_err());
        assert!(ports("ports=0").is_err());
        assert!(ports("ports=http").is_err());
    }

    #[test]
    fn finds_containerds_network_namespace() {
        let info = serde_json::json!({"runtimeSpec": {"linux": {"namespaces": [
            {"type": "pid"}, {"type": "network", "path": "/var/run/netns/cni-1"}]}}});
        let info = HashMap::from([("info".to_owned(), info.to_string())]);
        assert_eq!(netns_of(&info), Some(PathBuf::from("/var/run/netns/cni-1")));
        assert_eq!(netns_of(&HashMap::new()), None);
    }

    /// The WebSocket of channels: the port first on each of a port's two channels,
    /// then the pod's bytes on its data channel; a refused port's error on its error
    /// channel.
    #[tokio::test]
    async fn forwards_ports_over_websocket_channels() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut got = [0u8; 4];
            tcp.read_exact(&mut got).await.unwrap();
            tcp.write_all(&[b"echo:".as_slice(), &got].concat())
                .await
                .unwrap();
        });
        let pod = Pod {
            sandbox: "s1".into(),
            uid: "u1".into(),
            target: Ok(Target::Node),
        };
        let (near, far) = tokio::io::duplex(64 * 1024);
        let session = tokio::spawn(async move {
            let ws = WebSocketStream::from_raw_socket(far, Role::Server, None).await;
            websocket_session(ws, pod, vec![port, 1]).await;
        });
        let mut client = WebSocketStream::from_raw_socket(near, Role::Client, None).await;
        let [lo, hi] = port.to_le_bytes();
        let mut firsts = Vec::new();
        for _ in 0..4 {
            firsts.push(client.next().await.unwrap().unwrap().into_data().to_vec());
        }
        assert_eq!(
            firsts,
            [
                vec![0, lo, hi],
                vec![1, lo, hi],
                vec![2, 1, 0],
                vec![3, 1, 0]
            ]
        );
        client
            .send(Message::Binary(Bytes::from_static(b"\0ping")))
            .await
            .unwrap();
        let (mut echoed, mut refused) = (Vec::new(), String::new());
        while echoed.len() < 9 || refused.is_empty() {
            let message = client.next().await.unwrap().unwrap().into_data();
            match message.split_first() {
                Some((0, rest)) => echoed.extend_from_slice(rest),
                Some((3, rest)) => refused = String::from_utf8_lossy(rest).into_owned(),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(echoed, b"echo:ping");
        assert!(
            refused.starts_with("error forwarding port 1 to pod s1, uid u1: dial tcp 127.0.0.1:1"),
            "{refused}"
        );
        drop(client);
        tokio::time::timeout(Duration::from_secs(5), session)
            .await
            .unwrap()
            .unwrap();
    }

    /// A session over an in-memory pipe, as kubectl drives it: two streams for one
    /// request to the node's loopback, bytes both ways, the client's FIN, then the
    /// pod's close ends both streams; a port nobody listens on gets the kubelet's
    /// message on the error stream.
    #[tokio::test]
    async fn forwards_a_connection_over_spdy() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            tcp.read_to_end(&mut got).await.unwrap();
            tcp.write_all(&[b"echo:".as_slice(), &got].concat())
                .await
                .unwrap();
        });
        let pod = Pod {
            sandbox: "s1".into(),
            uid: String::new(),
            target: Ok(Target::Node),
        };
        let (near, far) = tokio::io::duplex(64 * 1024);
        let session = tokio::spawn(spdy_session(far, pod));
        let (mut read, mut write) = tokio::io::split(near);
        let (mut encoder, mut decoder) = (spdy::Encoder::default(), spdy::Decoder::default());
        let mut wire = BytesMut::new();
        let stream = |id: u32, kind: &str, port: u16, request: &str| Frame::SynStream {
            stream: id,
            fin: false,
            headers: vec![
                ("streamtype".into(), kind.into()),
                ("port".into(), port.to_string()),
                ("requestid".into(), request.into()),
            ],
        };
        for frame in [
            stream(1, "error", port, "0"),
            Frame::Data {
                stream: 1,
                fin: true,
                data: Bytes::new(),
            },
            stream(3, "data", port, "0"),
            Frame::Data {
                stream: 3,
                fin: true,
                data: Bytes::from_static(b"hello"),
            },
            stream(5, "error", 1, "1"),
            stream(7, "data", 1, "1"),
        ] {
            encoder.encode(&frame, &mut wire).unwrap();
        }
        write.write_all(&wire).await.unwrap();
        let mut buf = BytesMut::new();
        let mut data = HashMap::<u32, Vec<u8>>::new();
        let mut finished = Vec::new();
        while finished.len() < 4 {
            let frame = loop {
                if let Some(f) = decoder.decode(&mut buf).unwrap() {
                    break f;
                }
                assert_ne!(read.read_buf(&mut buf).await.unwrap(), 0, "ended early");
            };
            match frame {
                Frame::SynReply { .. } => {}
                Frame::Data {
                    stream,
                    fin,
                    data: bytes,
                } => {
                    data.entry(stream).or_default().extend_from_slice(&bytes);
                    if fin {
                        finished.push(stream);
                    }
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(data.get(&3).map(Vec::as_slice), Some(&b"echo:hello"[..]));
        assert_eq!(data.get(&1).map(Vec::as_slice), Some(&b""[..]));
        let refused = String::from_utf8(data.remove(&5).unwrap_or_default()).unwrap();
        assert!(
            refused.starts_with("error forwarding port 1 to pod s1, uid : dial tcp 127.0.0.1:1"),
            "{refused}"
        );
        server.await.unwrap();
        drop(write);
        drop(read);
        tokio::time::timeout(Duration::from_secs(5), session)
            .await
            .unwrap()
            .unwrap();
    }
}
