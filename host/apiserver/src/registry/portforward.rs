//! `pods/portforward`: `kubectl port-forward`, passed on to the pod's node.
//!
//! The client upgrades its request in one of three ways, as kube-apiserver serves them:
//! - **SPDY/3.1** (`Upgrade: SPDY/3.1`, `X-Stream-Protocol-Version:
//!   portforward.k8s.io`): kubectl up to 1.30, and later ones when the WebSocket
//!   fails. The API server upgrades a connection to the node's
//!   `/portForward/{namespace}/{pod}` the same way and, once the node switched,
//!   switches the client's and copies bytes both ways: the node speaks the protocol
//!   (see `trellis_agent::port_forward`).
//! - **SPDY tunnelled in a WebSocket** (subprotocol `SPDY/3.1+portforward.k8s.io`):
//!   kubectl 1.31+ (`PortForwardWebsockets`). The same SPDY connection to the node;
//!   the client's binary messages are its bytes, the node's bytes go back as binary
//!   messages, as kube-apiserver's stream tunnel does.
//! - **A WebSocket of channels** (`v4.channel.k8s.io`, `channel.k8s.io` or
//!   `portforward.k8s.io`, `?ports=80,8080`): relayed to a WebSocket to the node
//!   message by message, as `pods/exec` is.
//!
//! It is authorized as `create` on `pods/portforward`, whichever the method; the pod
//! must be bound and running. Errors before the upgrade are `Status`es; the node's
//! refusals are passed on as `pods/exec` passes them.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::IntoResponse as _;
use bytes::Bytes;
use futures::{SinkExt as _, StreamExt as _};
use http_body_util::{BodyExt as _, Empty};
use hyper::upgrade::{OnUpgrade, Upgraded};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::{self, ClientRequestBuilder, Message};
use tracing::debug;
use trellis_api::ApiError;

use crate::endpoints::request::ApiRequest;
use crate::endpoints::response::ApiResult;
use crate::registry::exec::wants_websocket;
use crate::registry::read;
use crate::registry::subresources::{MAX_NODE_ERROR, kubelet_endpoint};
use crate::state::AppState;

/// The SPDY subprotocol of port forwarding (`X-Stream-Protocol-Version`).
pub const SPDY_PROTOCOL: &str = "portforward.k8s.io";
/// The WebSocket subprotocol that tunnels it.
pub const TUNNEL_PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";
/// WebSocket subprotocols of channels, relayed to the node as they are.
const CHANNEL_PROTOCOLS: &[&str] = &["v4.channel.k8s.io", "channel.k8s.io", "portforward.k8s.io"];

/// How long the node may take to switch protocols.
const NODE_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes read from one side at a time.
const CHUNK: usize = 32 * 1024;

/// Whether a request asks to switch to SPDY/3.1.
pub fn wants_spdy(headers: &HeaderMap) -> bool {
    headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("SPDY/3.1"))
}

/// How the client speaks.
enum Mode {
    Spdy,
    Tunnel {
        accept: String,
    },
    Channels {
        accept: String,
        offered: Vec<String>,
    },
}

/// `GET|POST pods/{name}/portforward`: see the module's documentation.
pub async fn port_forward(
    state: &AppState,
    req: &ApiRequest,
    headers: &HeaderMap,
    query: Option<&str>,
    upgrade: Option<OnUpgrade>,
) -> ApiResult {
    let name = req.name()?;
    let namespace = req.namespace.as_deref().unwrap_or_default();
    let (pod, _) = read(state, &req.resource, req.namespace.as_deref(), name).await?;
    let Some(node_name) = pod
        .get("spec")
        .and_then(|s| s.get("nodeName"))
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
    else {
        return Err(
            ApiError::bad_request(format!("pod {name} does not have a host assigned")).into(),
        );
    };
    let phase = pod
        .get("status")
        .and_then(|s| s.get("phase"))
        .and_then(Value::as_str)
        .unwrap_or("Pending");
    if phase != "Running" {
        return Err(ApiError::bad_request(format!(
            "unable to forward port because pod is not running. Current status={phase}"
        ))
        .into());
    }
    let offered: Vec<String> = headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .collect();
    let key = headers.get(header::SEC_WEBSOCKET_KEY);
    let mode = match (wants_websocket(headers), key) {
        (true, Some(key)) => {
            let accept = tungstenite::handshake::derive_accept_key(key.as_bytes());
            if offered.iter().any(|p| p == TUNNEL_PROTOCOL) {
                Mode::Tunnel { accept }
            } else if offered
                .iter()
                .any(|p| CHANNEL_PROTOCOLS.contains(&p.as_str()))
            {
                Mode::Channels { accept, offered }
            } else {
                return Err(ApiError::bad_request(format!(
                    "none of the offered subprotocols {offered:?} is served: port forwarding speaks {TUNNEL_PROTOCOL}, {}",
                    CHANNEL_PROTOCOLS.join(", ")
                ))
                .into());
            }
        }
        _ if wants_spdy(headers) => {
            let speaks = headers
                .get_all("x-stream-protocol-version")
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(','))
                .any(|p| p.trim() == SPDY_PROTOCOL);
            if !speaks {
                return Err(ApiError::bad_request(format!(
                    "unable to upgrade: unable to negotiate protocol: the server speaks {SPDY_PROTOCOL}"
                ))
                .into());
            }
            Mode::Spdy
        }
        _ => {
            return Err(ApiError::bad_request(
                "Upgrade request required: port forwarding is served over SPDY/3.1 or a WebSocket",
            )
            .into());
        }
    };
    let Some(upgrade) = upgrade else {
        return Err(ApiError::bad_request("this connection cannot be upgraded").into());
    };

    let nodes = state.resource("", "v1", "nodes")?;
    let (node, _) = read(state, &nodes, None, node_name).await?;
    let Some((host, port)) = kubelet_endpoint(&node) else {
        return Err(ApiError::unavailable(format!(
            "node {node_name} does not serve port forwarding"
        ))
        .into());
    };
    let authority = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let path = match query {
        Some(q) => format!("/portForward/{namespace}/{name}?{q}"),
        None => format!("/portForward/{namespace}/{name}"),
    };
    let failed = |what: String| format!("node {node_name}: https://{authority}{path}: {what}");
    let tls = state
        .kubelet
        .connect(&host, port, &failed)
        .await
        .map_err(ApiError::unavailable)?;
    let target = format!("{namespace}/{name}");

    let mut response = StatusCode::SWITCHING_PROTOCOLS.into_response();
    let out = response.headers_mut();
    out.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    match mode {
        Mode::Spdy | Mode::Tunnel { .. } => {
            let node_io = node_spdy(tls, &authority, &path, node_name, &failed).await?;
            let tunnel = match &mode {
                Mode::Tunnel { accept } => {
                    out.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
                    out.insert(
                        header::SEC_WEBSOCKET_PROTOCOL,
                        HeaderValue::from_static(TUNNEL_PROTOCOL),
                    );
                    if let Ok(accept) = HeaderValue::from_str(accept) {
                        out.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
                    }
                    true
                }
                _ => {
                    out.insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
                    out.insert(
                        "x-stream-protocol-version",
                        HeaderValue::from_static(SPDY_PROTOCOL),
                    );
                    false
                }
            };
            tokio::spawn(async move {
                let client = match upgrade.await {
                    Ok(u) => TokioIo::new(u),
                    Err(e) => {
                        debug!(pod = %target, error = %e, "port-forward: the client's upgrade failed");
                        return;
                    }
                };
                let mut node_io = TokioIo::new(node_io);
                if tunnel {
                    let ws = WebSocketStream::from_raw_socket(client, Role::Server, None).await;
                    unwrap_tunnel(ws, node_io).await;
                } else {
                    let mut client = client;
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut node_io).await;
                }
                debug!(pod = %target, "port-forward ended");
            });
        }
        Mode::Channels { accept, offered } => {
            let url = format!("wss://{authority}{path}");
            let uri: axum::http::Uri = url
                .parse()
                .map_err(|e| ApiError::internal(failed(format!("invalid URL: {e}"))))?;
            let request = offered.iter().fold(ClientRequestBuilder::new(uri), |b, p| {
                b.with_sub_protocol(p)
            });
            let handshake = tokio::time::timeout(
                NODE_HANDSHAKE_TIMEOUT,
                tokio_tungstenite::client_async(request, tls),
            )
            .await
            .map_err(|_| ApiError::unavailable(failed("timeout awaiting the WebSocket".into())))?;
            let (node_ws, accepted) = match handshake {
                Ok(done) => done,
                Err(tungstenite::Error::Http(response)) => {
                    return Err(node_refused(node_name, response.status(), response.body()).into());
                }
                Err(e) => return Err(ApiError::unavailable(failed(e.to_string())).into()),
            };
            out.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
            if let Ok(accept) = HeaderValue::from_str(&accept) {
                out.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
            }
            if let Some(protocol) = accepted.headers().get(header::SEC_WEBSOCKET_PROTOCOL) {
                out.insert(header::SEC_WEBSOCKET_PROTOCOL, protocol.clone());
            }
            tokio::spawn(async move {
                let client = match upgrade.await {
                    Ok(u) => u,
                    Err(e) => {
                        debug!(pod = %target, error = %e, "port-forward: the client's upgrade failed");
                        return;
                    }
                };
                let client =
                    WebSocketStream::from_raw_socket(TokioIo::new(client), Role::Server, None)
                        .await;
                relay(client, node_ws).await;
                debug!(pod = %target, "port-forward ended");
            });
        }
    }
    Ok(response)
}

/// Upgrades a connection to the node's `path` to SPDY/3.1; the node's refusal is the
/// client's error.
async fn node_spdy<S>(
    tls: S,
    authority: &str,
    path: &str,
    node_name: &str,
    failed: &(dyn Fn(String) -> String + Sync),
) -> Result<Upgraded, ApiError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| ApiError::unavailable(failed(e.to_string())))?;
    tokio::spawn(connection.with_upgrades());
    let request = hyper::Request::post(path)
        .header(header::HOST, authority)
        .header(header::CONNECTION, "Upgrade")
        .header(header::UPGRADE, "SPDY/3.1")
        .header("X-Stream-Protocol-Version", SPDY_PROTOCOL)
        .body(Empty::<Bytes>::new())
        .map_err(|e| ApiError::internal(failed(e.to_string())))?;
    let response = tokio::time::timeout(NODE_HANDSHAKE_TIMEOUT, sender.send_request(request))
        .await
        .map_err(|_| ApiError::unavailable(failed("timeout awaiting the upgrade".into())))?
        .map_err(|e| ApiError::unavailable(failed(e.to_string())))?;
    if response.status() != StatusCode::SWITCHING_PROTOCOLS {
        let status = response.status();
        let body = tokio::time::timeout(NODE_HANDSHAKE_TIMEOUT, response.into_body().collect())
            .await
            .ok()
            .and_then(Result::ok)
            .map(|b| b.to_bytes().to_vec());
        return Err(node_refused(node_name, status, &body));
    }
    hyper::upgrade::on(response)
        .await
        .map_err(|e| ApiError::unavailable(failed(e.to_string())))
}

/// The node's refusal: its "not found"s are about a pod that exists, a bad request.
fn node_refused(node_name: &str, status: StatusCode, body: &Option<Vec<u8>>) -> ApiError {
    let body = body.as_deref().unwrap_or_default();
    let body = &body[..body.len().min(MAX_NODE_ERROR)];
    let message = String::from_utf8_lossy(body).trim().to_owned();
    let message = if message.is_empty() {
        format!("node {node_name} answered {status}")
    } else {
        message
    };
    match status {
        StatusCode::BAD_REQUEST | StatusCode::NOT_FOUND => ApiError::bad_request(message),
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => ApiError::internal(format!(
            "node {node_name} refused the API server: {message}"
        )),
        _ => ApiError::internal(format!("node {node_name} answered {status}: {message}")),
    }
}

/// kube-apiserver's stream tunnel: the WebSocket's binary messages are the bytes of a
/// SPDY connection, passed to the node as they are; the node's bytes go back as binary
/// messages. Ends when either side ends.
async fn unwrap_tunnel<C, N>(ws: WebSocketStream<C>, node: N)
where
    C: AsyncRead + AsyncWrite + Unpin,
    N: AsyncRead + AsyncWrite + Unpin,
{
    let (mut to_client, mut from_client) = ws.split();
    let (mut from_node, mut to_node) = tokio::io::split(node);
    let up = async {
        while let Some(Ok(message)) = from_client.next().await {
            let written = match message {
                Message::Binary(bytes) => to_node.write_all(&bytes).await.is_ok(),
                Message::Close(_) => false,
                _ => true,
            };
            if !written {
                break;
            }
        }
        let _ = to_node.shutdown().await;
    };
    let down = async {
        let mut chunk = vec![0u8; CHUNK];
        loop {
            match from_node.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let message = Message::Binary(Bytes::copy_from_slice(&chunk[..n]));
                    if to_client.send(message).await.is_err() {
                        return;
                    }
                }
            }
        }
        let _ = to_client.close().await;
    };
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}

/// Passes messages between the client and the node until one side closes or ends.
async fn relay<C, N>(client: WebSocketStream<C>, node: WebSocketStream<N>)
where
    C: AsyncRead + AsyncWrite + Unpin,
    N: AsyncRead + AsyncWrite + Unpin,
{
    let (mut to_client, mut from_client) = client.split();
    let (mut to_node, mut from_node) = node.split();
    async fn pass<S, T>(from: &mut S, to: &mut T)
    where
        S: futures::Stream<Item = Result<Message, tungstenite::Error>> + Unpin,
        T: futures::Sink<Message, Error = tungstenite::Error> + Unpin,
    {
        while let Some(Ok(message)) = from.next().await {
            match message {
                Message::Binary(_) | Message::Text(_) => {
                    if to.send(message).await.is_err() {
                        return;
                    }
                }
                Message::Close(frame) => {
                    let _ = to.send(Message::Close(frame)).await;
                    return;
                }
                Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => {}
            }
        }
        let _ = to.close().await;
    }
    tokio::select! {
        () = pass(&mut from_node, &mut to_client) => {}
        () = pass(&mut from_client, &mut to_node) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spdy_request_says_so() {
        let mut headers = HeaderMap::new();
        assert!(!wants_spdy(&headers));
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(!wants_spdy(&headers));
        headers.insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
        assert!(wants_spdy(&headers));
    }

    /// The tunnel's messages are the node's bytes and back, however they are cut.
    #[tokio::test]
    async fn unwraps_the_tunnel_both_ways() {
        let (client_near, client_far) = tokio::io::duplex(64 * 1024);
        let (node_near, mut node_far) = tokio::io::duplex(64 * 1024);
        let client = WebSocketStream::from_raw_socket(client_near, Role::Server, None).await;
        let relayed = tokio::spawn(unwrap_tunnel(client, node_near));
        let mut kubectl = WebSocketStream::from_raw_socket(client_far, Role::Client, None).await;
        for part in [&b"\x80\x03"[..], &b"\x00\x01"[..]] {
            kubectl
                .send(Message::Binary(Bytes::copy_from_slice(part)))
                .await
                .unwrap();
        }
        let mut got = [0u8; 4];
        node_far.read_exact(&mut got).await.unwrap();
        assert_eq!(got, [0x80, 3, 0, 1]);
        node_far.write_all(b"reply").await.unwrap();
        assert_eq!(
            kubectl.next().await.unwrap().unwrap(),
            Message::Binary(Bytes::from_static(b"reply"))
        );
        // The node goes: the client gets a close.
        drop(node_far);
        assert!(matches!(
            kubectl.next().await.unwrap().unwrap(),
            Message::Close(_)
        ));
        tokio::time::timeout(Duration::from_secs(5), relayed)
            .await
            .unwrap()
            .unwrap();
    }
}
