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
//! | pods | delete of bound pods (the final delete after a graceful termination) |
//! | configmaps, secrets | get of those a bound pod uses (volumes, env, envFrom) |
//! | persistentvolumeclaims | get of those a bound pod mounts (also its ephemeral ones) |
//! | persistentvolumes | get of those bound to such a claim; list, watch (local-path directories of deleted volumes) |
//! | serviceaccounts/token | create, for the ServiceAccount of a bound pod |
//! | runtimeclasses | get, list, watch |
//! | events | create and patch (kubelet reports events) |
//! | certificatesigningrequests | create, get, list, watch (certificate rotation) |
//!
//! Kubernetes keeps a graph of pods and what they use; this authorizer reads the
//! namespace's pods bound to the node at each such request instead (a node reads them
//! when it starts a container, not per request of its workloads).

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
        // The agent deletes a pod it terminated gracefully, for good.
        ("", "pods", None) if req.verb == "delete" => bound_to(store, req, node).await,
        ("", "configmaps" | "secrets", None) if req.verb == "get" => {
            let kind = if res.plural == "secrets" {
                Reference::Secret
            } else {
                Reference::ConfigMap
            };
            used_by_bound_pod(store, req, node, kind).await
        }
        ("", "persistentvolumeclaims", None) if req.verb == "get" => {
            used_by_bound_pod(store, req, node, Reference::Claim).await
        }
        // The node removes the directories of its local-path volumes once they are
        // deleted, which only a list and watch of volumes tells it (Kubernetes leaves
        // that to a helper pod of the provisioner; volumes carry no secrets).
        ("", "persistentvolumes", None) if matches!(req.verb, "list" | "watch") => true,
        ("", "persistentvolumes", None) if req.verb == "get" => {
            bound_to_used_claim(store, req, node).await
        }
        ("", "serviceaccounts", Some("token")) if req.verb == "create" => {
            used_by_bound_pod(store, req, node, Reference::ServiceAccount).await
        }
        ("node.k8s.io", "runtimeclasses", None) => matches!(req.verb, "get" | "list" | "watch"),
        // Every Service, for pods' service environment variables (the kubelet's
        // `system:node` role), and their EndpointSlices for the node's service proxy
        // and DNS (kube-proxy's `system:node-proxier`).
        ("", "services", None) | ("discovery.k8s.io", "endpointslices", None) => {
            matches!(req.verb, "get" | "list" | "watch")
        }
        ("", "events", None) => matches!(req.verb, "create" | "patch" | "update"),
        // A node renews its own certificate; the approver checks whose it is.
        ("certificates.k8s.io", "certificatesigningrequests", None) => {
            matches!(req.verb, "create" | "get" | "list" | "watch")
        }
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
            ": node {node:?} may only reach its own Node, Lease, bound pods and what they use"
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

#[derive(Clone, Copy)]
enum Reference {
    ConfigMap,
    Secret,
    ServiceAccount,
    Claim,
}

/// Whether a pod of the request's namespace bound to `node` uses the object the
/// request names.
async fn used_by_bound_pod(
    store: &dyn Store,
    req: &ApiRequest,
    node: &str,
    kind: Reference,
) -> bool {
    let (Some(name), Some(namespace)) = (req.name.as_deref(), req.namespace.as_deref()) else {
        return false;
    };
    let prefix = format!("/registry/core/pods/{namespace}/");
    let Ok(list) = store.list(trellis_store::ListRequest::prefix(prefix)).await else {
        return false;
    };
    list.kvs.iter().any(|kv| {
        let Some(pod) = decode_stored(&kv.value, kv.mod_revision) else {
            return false;
        };
        let spec = &pod["spec"];
        if spec["nodeName"].as_str() != Some(node) {
            return false;
        }
        match kind {
            Reference::ServiceAccount => {
                spec["serviceAccountName"].as_str().unwrap_or("default") == name
            }
            Reference::Claim => claims_of(&pod).iter().any(|c| c == name),
            Reference::ConfigMap | Reference::Secret => pod_uses(spec, kind, name),
        }
    })
}

/// Whether a pod spec names the ConfigMap or Secret in a volume (also projected), an
/// env `valueFrom`, an `envFrom` or an image pull secret.
fn pod_uses(spec: &Value, kind: Reference, name: &str) -> bool {
    let (volume, volume_name, key_ref, from_ref, projected) = match kind {
        Reference::ConfigMap => (
            "configMap",
            "name",
            "configMapKeyRef",
            "configMapRef",
            "configMap",
        ),
        _ => (
            "secret",
            "secretName",
            "secretKeyRef",
            "secretRef",
            "secret",
        ),
    };
    let names = |v: &Value, field: &str| v.get(field).and_then(Value::as_str) == Some(name);
    let list = |v: &Value, field: &str| {
        v.get(field)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    for vol in list(spec, "volumes") {
        if vol.get(volume).is_some_and(|v| names(v, volume_name)) {
            return true;
        }
        if let Some(p) = vol.get("projected")
            && list(p, "sources")
                .iter()
                .any(|s| s.get(projected).is_some_and(|v| names(v, "name")))
        {
            return true;
        }
    }
    if matches!(kind, Reference::Secret)
        && list(spec, "imagePullSecrets")
            .iter()
            .any(|s| names(s, "name"))
    {
        return true;
    }
    let containers = list(spec, "containers")
        .into_iter()
        .chain(list(spec, "initContainers"))
        .chain(list(spec, "ephemeralContainers"));
    for c in containers {
        if list(&c, "env").iter().any(|e| {
            e.get("valueFrom")
                .and_then(|f| f.get(key_ref))
                .is_some_and(|r| names(r, "name"))
        }) {
            return true;
        }
        if list(&c, "envFrom")
            .iter()
            .any(|e| e.get(from_ref).is_some_and(|r| names(r, "name")))
        {
            return true;
        }
    }
    false
}

/// The claims a pod mounts: those its volumes name, and `<pod>-<volume>` of its
/// generic ephemeral volumes.
fn claims_of(pod: &serde_json::Map<String, Value>) -> Vec<String> {
    let pod_name = pod["metadata"]["name"].as_str().unwrap_or("");
    let volumes = pod["spec"]["volumes"].as_array();
    volumes
        .into_iter()
        .flatten()
        .filter_map(|v| {
            if let Some(claim) = v["persistentVolumeClaim"]["claimName"].as_str() {
                Some(claim.to_owned())
            } else if v.get("ephemeral").is_some_and(|e| !e.is_null()) {
                Some(format!("{pod_name}-{}", v["name"].as_str().unwrap_or("")))
            } else {
                None
            }
        })
        .collect()
}

/// Whether the PersistentVolume the request names is bound to a claim a pod bound
/// to `node` mounts (the node reads the volume's source to mount it).
async fn bound_to_used_claim(store: &dyn Store, req: &ApiRequest, node: &str) -> bool {
    let Some(volume) = req.name.as_deref() else {
        return false;
    };
    let Ok(pods) = store
        .list(trellis_store::ListRequest::prefix("/registry/core/pods/"))
        .await
    else {
        return false;
    };
    for kv in &pods.kvs {
        let Some(pod) = decode_stored(&kv.value, kv.mod_revision) else {
            continue;
        };
        if pod["spec"]["nodeName"].as_str() != Some(node) {
            continue;
        }
        let namespace = pod["metadata"]["namespace"].as_str().unwrap_or("");
        for claim in claims_of(&pod) {
            let key = format!("/registry/core/persistentvolumeclaims/{namespace}/{claim}");
            let Ok(Some(kv)) = store.get(&key).await else {
                continue;
            };
            let bound = decode_stored(&kv.value, kv.mod_revision)
                .is_some_and(|c| c["spec"]["volumeName"].as_str() == Some(volume));
            if bound {
                return true;
            }
        }
    }
    false
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
    fn what_a_pod_uses() {
        let spec = serde_json::json!({
            "volumes": [{"name": "a", "configMap": {"name": "cm1"}},
                        {"name": "b", "projected": {"sources": [{"secret": {"name": "s2"}}]}}],
            "imagePullSecrets": [{"name": "pull"}],
            "containers": [{"name": "c",
                "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s1", "key": "k"}}}],
                "envFrom": [{"configMapRef": {"name": "cm2"}}]}]
        });
        for cm in ["cm1", "cm2"] {
            assert!(pod_uses(&spec, Reference::ConfigMap, cm), "{cm}");
        }
        for secret in ["s1", "s2", "pull"] {
            assert!(pod_uses(&spec, Reference::Secret, secret), "{secret}");
        }
        assert!(!pod_uses(&spec, Reference::ConfigMap, "s1"));
        assert!(!pod_uses(&spec, Reference::Secret, "cm1"));
        assert!(!pod_uses(&spec, Reference::Secret, "other"));
    }

    #[test]
    fn a_pod_mounts_its_claims_and_its_ephemeral_ones() {
        let pod = serde_json::json!({"metadata": {"name": "web-0"}, "spec": {"volumes": [
            {"name": "data", "persistentVolumeClaim": {"claimName": "data-web-0"}},
            {"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
            {"name": "cfg", "configMap": {"name": "cfg"}}]}});
        assert_eq!(
            claims_of(pod.as_object().unwrap()),
            ["data-web-0", "web-0-scratch"]
        );
    }

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
