//! What the caller may do: RBAC, the node authorizer, and the review APIs that ask.
//!
//! # Layout
//! - [`rbac`]: RBAC authorization and the bootstrap roles.
//! - [`node`]: what a node's credentials may reach.
//! - [`reviews`]: self-subject access, rules and identity reviews (`kubectl auth can-i`,
//!   `kubectl auth whoami`).

pub mod node;
pub mod rbac;
pub mod reviews;

use trellis_api::ApiError;

use crate::endpoints::request::ApiRequest;
use crate::state::AppState;

/// Authorization through RBAC; the refusal names user, verb and resource.
pub async fn authorize(state: &AppState, req: &ApiRequest) -> Result<(), ApiError> {
    if let Some(decision) = node::authorize(state.store.as_ref(), req).await {
        return decision;
    }
    let resource = match req.subresource {
        Some(sub) => format!("{}/{}", req.resource.plural, sub.name()),
        None => req.resource.plural.clone(),
    };
    let attributes = rbac::Attributes {
        verb: req.verb,
        group: &req.resource.group,
        resource: &resource,
        namespace: req.namespace.as_deref().unwrap_or(""),
        name: req.name.as_deref().unwrap_or(""),
    };
    rbac::authorize(&state.rbac, &req.user, &attributes).await
}

/// Authorization of a request for a non-resource URL (discovery, OpenAPI, `/metrics`)
/// through RBAC's `nonResourceURLs` rules.
pub async fn authorize_non_resource(
    state: &AppState,
    user: &trellis_api::UserInfo,
    method: &axum::http::Method,
    path: &str,
) -> Result<(), ApiError> {
    let verb = method.as_str().to_ascii_lowercase();
    rbac::authorize_non_resource(&state.rbac, user, &verb, path).await
}
