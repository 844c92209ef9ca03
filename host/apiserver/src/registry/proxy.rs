//! `nodes/{name}/proxy/{path}`: a GET passed on to the node's agent (its `/{path}`,
//! with the query as given) over the API server's node client, and the node's answer
//! streamed back as it comes — status, content type and body — as kube-apiserver's
//! node proxy does. What `kubectl get --raw /api/v1/nodes/N/proxy/stats/summary` and
//! a metrics server reach the node's `/stats` and `/metrics` by.
//!
//! Authorized as `get` on `nodes/proxy` (in the request chain); the node trusts the
//! API server's client certificate, so holding `nodes/proxy` is holding every route
//! of the node's agent, as in Kubernetes.

use axum::http::{HeaderValue, StatusCode, Uri, header};
use axum::response::IntoResponse as _;
use trellis_api::ApiError;

use crate::endpoints::request::ApiRequest;
use crate::endpoints::response::ApiResult;
use crate::registry::read;
use crate::registry::subresources::kubelet_endpoint;
use crate::state::AppState;

/// Passes `GET uri` on to the node `req` names; 503 when the node serves nothing
/// (no address or port yet) or cannot be reached.
pub async fn node(state: &AppState, req: &ApiRequest, uri: &Uri) -> ApiResult {
    let name = req.name()?;
    let path = node_path(uri.path(), name)
        .ok_or_else(|| ApiError::bad_request(format!("no proxy path in {:?}", uri.path())))?;
    let path_and_query = match uri.query() {
        Some(query) => format!("{path}?{query}"),
        None => path.to_owned(),
    };
    let (node, _) = read(state, &req.resource, None, name).await?;
    let Some((host, port)) = kubelet_endpoint(&node) else {
        return Err(ApiError::unavailable(format!(
            "node {name} has no address and port of its agent in its status"
        ))
        .into());
    };
    let response = state
        .kubelet
        .get(&host, port, &path_and_query)
        .await
        .map_err(|e| ApiError::unavailable(format!("error trying to reach service: {e}")))?;
    let status = StatusCode::from_u16(response.status().as_u16())
        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok());
    let mut answer = (status, axum::body::Body::new(response.into_body())).into_response();
    if let Some(content_type) = content_type {
        answer
            .headers_mut()
            .insert(header::CONTENT_TYPE, content_type);
    }
    Ok(answer)
}

/// The node's path in a proxy request's path: what follows `nodes/{name}/proxy`, as
/// the client wrote it (still percent-encoded), `/` when nothing does.
fn node_path<'a>(path: &'a str, name: &str) -> Option<&'a str> {
    let marker = format!("/nodes/{name}/proxy");
    let at = path.find(&marker)? + marker.len();
    match &path[at..] {
        "" => Some("/"),
        rest if rest.starts_with('/') => Some(rest),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_path_follows_proxy() {
        let path = "/api/v1/nodes/n1/proxy/stats/summary";
        assert_eq!(node_path(path, "n1"), Some("/stats/summary"));
        assert_eq!(node_path("/api/v1/nodes/n1/proxy", "n1"), Some("/"));
        assert_eq!(
            node_path("/api/v1/nodes/n1/proxy/containerLogs/a%2Fb/p/c", "n1"),
            Some("/containerLogs/a%2Fb/p/c")
        );
        assert_eq!(node_path("/api/v1/nodes/n1/proxyx", "n1"), None);
    }
}
