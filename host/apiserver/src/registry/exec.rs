//! `pods/exec`: `kubectl exec`, relayed to the pod's node.
//!
//! The client upgrades its request (`GET`, or `POST`, with `Upgrade: websocket`) and
//! offers the remotecommand subprotocols it speaks (kubectl ≥ 1.30:
//! `v5.channel.k8s.io`). The API server checks the pod (it exists, is bound and not
//! completed, the container is one of its own or its only one), opens a WebSocket to the
//! node's agent (`wss://IP:PORT/exec/{namespace}/{pod}/{container}?…`, the same query,
//! the client's subprotocols offered, the API server's node client certificate), and
//! only once the agent accepted does it accept the client's upgrade, with the
//! subprotocol the agent chose. Then it relays messages both ways, as they are, until
//! either side closes; the agent speaks the protocol (see `trellis_agent::exec`).
//!
//! Errors before the upgrade are `Status`es as for any request (the agent's own
//! answers as `pods/log` passes them on). SPDY, kubectl's fallback when the WebSocket
//! fails, is refused: `400 Upgrade request required`.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::IntoResponse as _;
use futures::{SinkExt as _, StreamExt as _};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::{self, ClientRequestBuilder, Message};
use tracing::debug;
use trellis_api::ApiError;

use crate::endpoints::request::ApiRequest;
use crate::endpoints::response::ApiResult;
use crate::registry::read;
use crate::registry::subresources::{MAX_NODE_ERROR, container_of, kubelet_endpoint};
use crate::state::AppState;

/// How long the agent may take to accept the WebSocket.
const NODE_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the other side may take to close once one side closed.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether a request asks to switch to a WebSocket (`Upgrade: websocket`).
pub fn wants_websocket(headers: &HeaderMap) -> bool {
    headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
}

/// `GET|POST pods/{name}/exec`: see the module's documentation. `query` is the
/// request's own, passed on to the node as it came; `upgrade` is the client's
/// connection once the 101 is sent.
pub async fn exec(
    state: &AppState,
    req: &ApiRequest,
    headers: &HeaderMap,
    query: Option<&str>,
    upgrade: Option<OnUpgrade>,
) -> ApiResult {
    let name = req.name()?;
    let namespace = req.namespace.as_deref().unwrap_or_default();
    let (pod, _) = read(state, &req.resource, req.namespace.as_deref(), name).await?;
    let container = container_of(&pod, name, req.query.container.as_deref())?;
    check_options(query.unwrap_or(""))?;
    let spec = pod.get("spec");
    let Some(node_name) = spec
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
        .unwrap_or("");
    if matches!(phase, "Succeeded" | "Failed") {
        return Err(ApiError::bad_request(format!(
            "cannot exec into a container in a completed pod; current phase is {phase}"
        ))
        .into());
    }
    let key = headers.get(header::SEC_WEBSOCKET_KEY);
    let (true, Some(key), Some(upgrade)) = (wants_websocket(headers), key, upgrade) else {
        return Err(ApiError::bad_request(
            "Upgrade request required: exec is served over a WebSocket (v5.channel.k8s.io), not SPDY",
        )
        .into());
    };
    let accept = tungstenite::handshake::derive_accept_key(key.as_bytes());
    let offered: Vec<String> = headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .collect();

    let nodes = state.resource("", "v1", "nodes")?;
    let (node, _) = read(state, &nodes, None, node_name).await?;
    let Some((host, port)) = kubelet_endpoint(&node) else {
        return Err(ApiError::unavailable(format!("node {node_name} does not serve exec")).into());
    };
    let authority = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let path = match query {
        Some(q) => format!("/exec/{namespace}/{name}/{container}?{q}"),
        None => format!("/exec/{namespace}/{name}/{container}"),
    };
    let url = format!("wss://{authority}{path}");
    let failed = |what: String| format!("node {node_name}: {url:?}: {what}");
    let tls = state
        .kubelet
        .connect(&host, port, &failed)
        .await
        .map_err(ApiError::unavailable)?;
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
    let protocol = accepted
        .headers()
        .get(header::SEC_WEBSOCKET_PROTOCOL)
        .cloned();

    let target = format!("{namespace}/{name}/{container}");
    tokio::spawn(async move {
        let upgraded = match upgrade.await {
            Ok(u) => u,
            Err(e) => {
                debug!(pod = %target, error = %e, "exec: the client's upgrade failed");
                return;
            }
        };
        let client_ws =
            WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await;
        relay(client_ws, node_ws).await;
        debug!(pod = %target, "exec ended");
    });
    let mut response = StatusCode::SWITCHING_PROTOCOLS.into_response();
    let out = response.headers_mut();
    out.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    out.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    if let Ok(accept) = HeaderValue::from_str(&accept) {
        out.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
    }
    if let Some(protocol) = protocol {
        out.insert(header::SEC_WEBSOCKET_PROTOCOL, protocol);
    }
    Ok(response)
}

/// Kubernetes' checks of `PodExecOptions` that need no node.
fn check_options(query: &str) -> Result<(), ApiError> {
    // Keys and booleans need no decoding; `command` may repeat, so no map.
    let pairs: Vec<(&str, &str)> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| p.split_once('=').unwrap_or((p, "")))
        .collect();
    let set = |key: &str| {
        pairs.iter().any(|(k, v)| {
            *k == key && matches!(*v, "" | "1" | "t" | "T" | "true" | "TRUE" | "True")
        })
    };
    if !pairs.iter().any(|(k, _)| *k == "command") {
        return Err(ApiError::bad_request(
            "you must specify at least one command for the container",
        ));
    }
    if !(set("stdin") || set("stdout") || set("stderr")) {
        return Err(ApiError::bad_request(
            "you must specify at least 1 of stdin, stdout, stderr",
        ));
    }
    Ok(())
}

/// The node's refusal, as `pods/log` passes it on: its "not found"s are about a
/// container of a pod that exists, a bad request.
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

/// Passes messages between the client and the node until one side closes, then gives
/// the other [`CLOSE_TIMEOUT`] to close too. Pings are answered by each side's
/// WebSocket, not relayed.
async fn relay<C, N>(client: WebSocketStream<C>, node: WebSocketStream<N>)
where
    C: AsyncRead + AsyncWrite + Unpin,
    N: AsyncRead + AsyncWrite + Unpin,
{
    let (mut to_client, mut from_client) = client.split();
    let (mut to_node, mut from_node) = node.split();
    let down = async {
        forward(&mut from_node, &mut to_client).await;
    };
    let up = async {
        forward(&mut from_client, &mut to_node).await;
    };
    tokio::pin!(down, up);
    tokio::select! {
        () = &mut down => {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, up).await;
        }
        () = &mut up => {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, down).await;
        }
    }
}

/// Sends on what `from` reads, until it closed (the close is sent on too) or ended.
async fn forward<S, T>(from: &mut S, to: &mut T)
where
    S: futures::Stream<Item = Result<Message, tungstenite::Error>> + Unpin,
    T: futures::Sink<Message, Error = tungstenite::Error> + Unpin,
{
    while let Some(message) = from.next().await {
        let message = match message {
            Ok(m) => m,
            Err(e) => {
                debug!(error = %e, "exec: reading a WebSocket failed");
                break;
            }
        };
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
    // Ended without a close: close the other side.
    let _ = to.close().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_the_options_as_kubernetes() {
        assert!(check_options("command=ls&stdout=true").is_ok());
        assert!(check_options("stdout=true").is_err());
        assert!(check_options("command=ls&stdout=false").is_err());
    }

    #[test]
    fn a_websocket_request_says_so() {
        let mut headers = HeaderMap::new();
        assert!(!wants_websocket(&headers));
        headers.insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
        assert!(!wants_websocket(&headers));
        headers.insert(header::UPGRADE, HeaderValue::from_static("WebSocket"));
        assert!(wants_websocket(&headers));
    }

    /// Messages pass both ways, and a close from the node reaches the client.
    #[tokio::test]
    async fn relays_messages_and_the_close() {
        let (client_near, client_far) = tokio::io::duplex(64 * 1024);
        let (node_near, node_far) = tokio::io::duplex(64 * 1024);
        let client = WebSocketStream::from_raw_socket(client_near, Role::Server, None).await;
        let node = WebSocketStream::from_raw_socket(node_near, Role::Client, None).await;
        let relayed = tokio::spawn(relay(client, node));
        let mut kubectl = WebSocketStream::from_raw_socket(client_far, Role::Client, None).await;
        let mut agent = WebSocketStream::from_raw_socket(node_far, Role::Server, None).await;
        kubectl
            .send(Message::Binary(vec![0, b'h', b'i'].into()))
            .await
            .unwrap();
        assert_eq!(
            agent.next().await.unwrap().unwrap(),
            Message::Binary(vec![0, b'h', b'i'].into())
        );
        agent
            .send(Message::Binary(vec![1, b'o'].into()))
            .await
            .unwrap();
        agent.close(None).await.unwrap();
        assert_eq!(
            kubectl.next().await.unwrap().unwrap(),
            Message::Binary(vec![1, b'o'].into())
        );
        assert!(matches!(
            kubectl.next().await.unwrap().unwrap(),
            Message::Close(_)
        ));
        // kubectl goes: the relay ends without waiting out its close timeout.
        drop(kubectl);
        tokio::time::timeout(Duration::from_secs(10), relayed)
            .await
            .unwrap()
            .unwrap();
    }
}
