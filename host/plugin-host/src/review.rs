//! Kubernetes `AdmissionReview` JSON to and from the contract's records: what
//! `trellis plugin run` reads and prints, so fixtures captured from a Kubernetes
//! cluster (or written for Kubewarden's `kwctl`) work as they are.

use base64::Engine as _;
use serde_json::{Value, json};

use crate::bindings::types::{GroupVersionKind, GroupVersionResource, Operation, UserInfo};
use crate::{AdmissionRequest, AdmissionResponse};

/// Reads an `AdmissionReview` (or its bare `request`) into a request carrying
/// `configuration`.
pub fn request_from_review(
    review: &Value,
    configuration: &str,
) -> Result<AdmissionRequest, String> {
    let req = review.get("request").unwrap_or(review);
    if !req.is_object() {
        return Err("expected an AdmissionReview or its request object".into());
    }
    let text = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).unwrap_or("").to_owned();
    let kind = req.get("kind").cloned().unwrap_or_default();
    let resource = req.get("resource").cloned().unwrap_or_default();
    let operation = match req.get("operation").and_then(Value::as_str) {
        Some("CREATE") | None => Operation::Create,
        Some("UPDATE") => Operation::Update,
        Some("DELETE") => Operation::Delete,
        Some("CONNECT") => Operation::Connect,
        Some(other) => return Err(format!("unknown operation {other:?}")),
    };
    let user = req.get("userInfo").cloned().unwrap_or_default();
    let strings = |v: Option<&Value>| -> Vec<String> {
        v.and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let extra = user
        .get("extra")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), strings(Some(v))))
                .collect()
        })
        .unwrap_or_default();
    let object_json = |key: &str| req.get(key).filter(|v| !v.is_null()).map(Value::to_string);
    let namespace = text(req, "namespace");
    let sub = text(req, "subResource");
    Ok(AdmissionRequest {
        uid: text(req, "uid"),
        kind: GroupVersionKind {
            group: text(&kind, "group"),
            version: text(&kind, "version"),
            kind: text(&kind, "kind"),
        },
        resource: GroupVersionResource {
            group: text(&resource, "group"),
            version: text(&resource, "version"),
            resource: text(&resource, "resource"),
        },
        sub_resource: (!sub.is_empty()).then_some(sub),
        name: text(req, "name"),
        namespace: (!namespace.is_empty()).then_some(namespace),
        operation,
        user_info: UserInfo {
            username: text(&user, "username"),
            uid: text(&user, "uid"),
            groups: strings(user.get("groups")),
            extra,
        },
        object: object_json("object"),
        old_object: object_json("oldObject"),
        dry_run: req.get("dryRun").and_then(Value::as_bool).unwrap_or(false),
        configuration: configuration.to_owned(),
    })
}

/// The `AdmissionReview` a webhook would answer with.
pub fn review_from_response(uid: &str, response: &AdmissionResponse) -> Value {
    let mut out = json!({
        "uid": uid,
        "allowed": response.allowed,
    });
    if let Some(status) = &response.status {
        out["status"] = json!({
            "code": status.code,
            "reason": status.reason,
            "message": status.message,
        });
    }
    if !response.warnings.is_empty() {
        out["warnings"] = json!(response.warnings);
    }
    if let Some(patch) = &response.patch {
        out["patchType"] = json!("JSONPatch");
        out["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(patch));
    }
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_kubernetes_review() {
        let review = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "name": "web",
                "namespace": "default",
                "operation": "UPDATE",
                "userInfo": {"username": "alice", "groups": ["dev"], "extra": {"scopes": ["a", "b"]}},
                "object": {"metadata": {"name": "web"}},
                "oldObject": null,
                "dryRun": true
            }
        });
        let req = request_from_review(&review, "{}").unwrap();
        assert_eq!(req.uid, "705ab4f5");
        assert_eq!(req.resource.resource, "pods");
        assert!(matches!(req.operation, Operation::Update));
        assert_eq!(req.namespace.as_deref(), Some("default"));
        assert_eq!(
            req.user_info.extra,
            vec![("scopes".to_owned(), vec!["a".to_owned(), "b".to_owned()])]
        );
        assert_eq!(
            req.object.as_deref(),
            Some(r#"{"metadata":{"name":"web"}}"#)
        );
        assert!(req.old_object.is_none() && req.dry_run && req.sub_resource.is_none());
        assert!(request_from_review(&json!({"request": {"operation": "PUT"}}), "{}").is_err());
    }

    #[test]
    fn answers_as_a_webhook_would() {
        let response = AdmissionResponse {
            allowed: true,
            status: None,
            warnings: vec!["careful".into()],
            patch: Some("[]".into()),
        };
        let review = review_from_response("u1", &response);
        assert_eq!(review["response"]["patch"], "W10=");
        assert_eq!(review["response"]["patchType"], "JSONPatch");
        assert_eq!(review["response"]["warnings"][0], "careful");
    }
}
