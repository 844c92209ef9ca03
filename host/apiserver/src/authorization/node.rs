//! The Node authorizer: a node's credentials (user `system:node:NAME` in group
//! `system:nodes`) reach its own Node object, its own Lease, and the pods bound to it
//! — nothing else, whatever RBAC says, as Kubernetes' Node authorizer and
//! NodeRestriction admission together intend.
//!
//! | resource | allowed |
//! |---|---|
//! | nodes, nodes/status | get, create, update, patch, delete of its own Node; list and watch |
//! | leases in kube-node-lease | every verb on the Lease named after the node |
//! | pods | list and watch with `fieldSelector=spec.nodeName=NAME`; get of bound pods |
//! | pods/status | get, update, patch of bound pods |
//! | events | create and patch (kubelet reports events) |

use serde_json::Value;
use trellis_api::user::groups;
use trellis_api::{ApiError, UserInfo};
use trellis_store::Store;

use crate::endpoints::request::ApiRequest;
use crate::storage::watch_cache::decode_stored;

/// The node name of a node's credentials, if the user is one.
pub fn node_name(user: &UserInfo) -> Option<&str> {
    if !user.in_group(groups::NODES) {
        return None;
    }
    user.name
        .strip_prefix("system:node:")
        .filter(|n| !n.is_empty())
}

/// Decides a node's request; `None` for users who are not nodes.
pub async fn authorize(store: &dyn Store, req: &ApiRequest) -> Option<Result<(), ApiError>> {
    let node = node_name(&req.user)?;
    let res = &req.resource;
    let name = req.name.as_deref().unwrap_or("");
    let sub = req.subresource.map(|s| s.name());
    let allowed = match (res.group.as_str(), res.plural.as_str(), sub) {
        ("", "nodes", None | Some("status")) => match req.verb {
            "list" | "watch" => true,
            // A create names its object in the body: see `check_create`.
            "create" => true,
            "get" | "update" | "patch" | "delete" => name == node,
            _ => false,
        },
        ("coordination.k8s.io", "leases", None) => {
            req.namespace.as_deref() == Some("kube-node-lease")
                && (name == node || (req.verb == "create" && name.is_empty()))
        }
        ("", "pods", None) if matches!(req.verb, "list" | "watch") => selects_node(req, node),
        ("", "pods", None | Some("status")) if matches!(req.verb, "get" | "update" | "patch") => {
            (sub.is_some() || req.verb == "get") && bound_to(store, req, node).await
        }
        ("", "events", None) => matches!(req.verb, "create" | "patch" | "update"),
        _ => false,
    };
    Some(if allowed {
        Ok(())
    } else {
        let resource = match sub {
            Some(s) => format!("{}/{s}", res.plural),
            None => res.plural.clone(),
        };
        let mut e = ApiError::forbidden(
            &req.user.name,
            req.verb,
            &res.group,
            &resource,
            req.namespace.as_deref().unwrap_or(""),
            name,
        );
        e.message.push_str(&format!(
            ": node {node:?} may only reach its own Node, Lease and bound pods"
        ));
        Err(e)
    })
}

/// A node may create only its own Node and Lease: the name is in the body.
pub fn check_create(req: &ApiRequest, body: &[u8]) -> Result<(), ApiError> {
    let Some(node) = node_name(&req.user) else {
        return Ok(());
    };
    let res = &req.resource;
    let guarded = (res.group.is_empty() && res.plural == "nodes" && req.subresource.is_none())
        || (res.group == "coordination.k8s.io" && res.plural == "leases");
    if req.verb != "create" || !guarded {
        return Ok(());
    }
    let obj = req.decode_body(body)?;
    let name = crate::object::name(&obj).unwrap_or("");
    if name == node {
        return Ok(());
    }
    let mut e = ApiError::forbidden(
        &req.user.name,
        "create",
        &res.group,
        &res.plural,
        req.namespace.as_deref().unwrap_or(""),
        name,
    );
    e.message.push_str(&format!(
        ": node {node:?} may only create its own {}",
        res.kind
    ));
    Err(e)
}

/// Whether a pod list or watch is limited to this node's pods.
fn selects_node(req: &ApiRequest, node: &str) -> bool {
    let Some(selector) = req.query.field_selector.as_deref() else {
        return false;
    };
    trellis_api::selector::FieldSelector::parse(selector)
        .ok()
        .and_then(|s| s.exact_match("spec.nodeName").map(|n| n == node))
        .unwrap_or(false)
}

async fn bound_to(store: &dyn Store, req: &ApiRequest, node: &str) -> bool {
    let Some(name) = req.name.as_deref() else {
        return false;
    };
    let key = req.resource.key(req.namespace.as_deref(), name);
    match store.get(&key).await {
        Ok(Some(kv)) => decode_stored(&kv.value, kv.mod_revision)
            .and_then(|pod| {
                pod.get("spec")
                    .and_then(|s| s.get("nodeName"))
                    .and_then(Value::as_str)
                    .map(|n| n == node)
            })
            .unwrap_or(false),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_node_credentials_name_a_node() {
        assert_eq!(
            node_name(&UserInfo::new("system:node:n1", [groups::NODES])),
            Some("n1")
        );
        assert_eq!(node_name(&UserInfo::new("system:node:n1", ["other"])), None);
        assert_eq!(node_name(&UserInfo::new("alice", [groups::NODES])), None);
    }
}
