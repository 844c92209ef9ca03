//! Questions a client asks about itself, answered and never stored:
//! - `authorization.k8s.io/v1` SelfSubjectAccessReview (`kubectl auth can-i VERB
//!   RESOURCE`): may I do this? Answered by RBAC as a real request would be.
//! - `authorization.k8s.io/v1` SelfSubjectRulesReview (`kubectl auth can-i --list`):
//!   what may I do in this namespace? The rules of every role bound to the user.
//! - `authentication.k8s.io/v1` SelfSubjectReview (`kubectl auth whoami`): who am I?
//!
//! Every authenticated user may create them (the bootstrap `system:basic-user` role).
//! One is about someone else: `authorization.k8s.io/v1` SubjectAccessReview, may the
//! user the spec names do this? What extension API servers (a metrics server) ask of
//! each request they serve; it takes `create` on `subjectaccessreviews` (Kubernetes'
//! `system:auth-delegator`).

use axum::http::StatusCode;
use serde_json::{Value, json};
use trellis_api::registry::ResourceInfo;
use trellis_api::status::StatusCause;
use trellis_api::{ApiError, UserInfo};

use crate::authorization::rbac;
use crate::endpoints::request::ApiRequest;
use crate::endpoints::response::ApiResult;
use crate::endpoints::response::json_response;
use crate::object::Object;
use crate::state::AppState;

/// Whether `res` is one of the review resources this module answers.
pub fn answers(res: &ResourceInfo) -> bool {
    matches!(
        (res.group.as_str(), res.plural.as_str()),
        (
            "authorization.k8s.io",
            "selfsubjectaccessreviews" | "selfsubjectrulesreviews" | "subjectaccessreviews"
        ) | ("authentication.k8s.io", "selfsubjectreviews")
    )
}

/// `POST` of a review: the review back with its `status` filled in (201).
pub async fn create(state: &AppState, req: &ApiRequest, body: bytes::Bytes) -> ApiResult {
    let review = if body.is_empty() {
        Object::new()
    } else {
        req.decode_body(&body)?
    };
    let spec = review.get("spec").cloned().unwrap_or_else(|| json!({}));
    let status = match req.resource.plural.as_str() {
        "selfsubjectaccessreviews" => access(state, &req.user, &spec).await?,
        "subjectaccessreviews" => access(state, &subject(&spec), &spec).await?,
        "selfsubjectrulesreviews" => rules(state, &req.user, &spec).await?,
        _ => json!({"userInfo": user_info(&req.user)}),
    };
    let mut out = json!({
        "kind": req.resource.kind,
        "apiVersion": req.resource.api_version(),
        "metadata": {"creationTimestamp": null},
        "status": status,
    });
    if req.resource.plural != "selfsubjectreviews" {
        out["spec"] = spec;
    }
    Ok(json_response(StatusCode::CREATED, &out))
}

/// The user a SubjectAccessReview's spec names: `user`, `groups`, `uid`, `extra`.
fn subject(spec: &Value) -> UserInfo {
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    let mut user = UserInfo::new(field(spec, "user"), strings(&spec["groups"]));
    user.uid = field(spec, "uid").to_owned();
    if let Some(extra) = spec["extra"].as_object() {
        for (key, values) in extra {
            user.extra.insert(key.clone(), strings(values));
        }
    }
    user
}

fn user_info(user: &UserInfo) -> Value {
    let mut info = json!({"username": user.name, "groups": user.groups});
    if !user.uid.is_empty() {
        info["uid"] = user.uid.clone().into();
    }
    if !user.extra.is_empty() {
        info["extra"] = json!(user.extra);
    }
    info
}

fn field<'a>(v: &'a Value, name: &str) -> &'a str {
    v.get(name).and_then(Value::as_str).unwrap_or("")
}

/// A SelfSubjectAccessReview's status: `allowed`, and a reason when refused.
async fn access(state: &AppState, user: &UserInfo, spec: &Value) -> Result<Value, ApiError> {
    if let Some(attrs) = spec.get("resourceAttributes") {
        let resource = match field(attrs, "subresource") {
            "" => field(attrs, "resource").to_owned(),
            sub => format!("{}/{sub}", field(attrs, "resource")),
        };
        let attributes = rbac::Attributes {
            verb: field(attrs, "verb"),
            group: field(attrs, "group"),
            resource: &resource,
            namespace: field(attrs, "namespace"),
            name: field(attrs, "name"),
        };
        return Ok(
            match rbac::authorize(&state.rbac, user, &attributes).await {
                Ok(()) => json!({"allowed": true, "reason": "allowed by RBAC"}),
                Err(e) if e.code == 403 => json!({"allowed": false}),
                Err(e) => return Err(e),
            },
        );
    }
    if let Some(attrs) = spec.get("nonResourceAttributes") {
        let (verb, path) = (field(attrs, "verb"), field(attrs, "path"));
        let allowed = user.in_group(trellis_api::user::groups::MASTERS)
            || rbac::rules_for(&state.rbac, user, "")
                .await?
                .iter()
                .any(|rule| rbac::non_resource_rule_allows(rule, verb, path));
        return Ok(json!({"allowed": allowed}));
    }
    Err(ApiError::invalid(
        "authorization.k8s.io",
        "SelfSubjectAccessReview",
        "",
        vec![StatusCause::invalid(
            "spec.resourceAttributes",
            "null",
            "exactly one of nonResourceAttributes or resourceAttributes must be specified",
        )],
    ))
}

/// A SelfSubjectRulesReview's status: the resource and non-resource rules that apply
/// in `spec.namespace`.
async fn rules(state: &AppState, user: &UserInfo, spec: &Value) -> Result<Value, ApiError> {
    let namespace = field(spec, "namespace");
    let granted = rbac::rules_for(&state.rbac, user, namespace).await?;
    let list = |rule: &Value, key: &str| rule.get(key).cloned().unwrap_or_else(|| json!([]));
    let mut resource_rules = Vec::new();
    let mut non_resource_rules = Vec::new();
    for rule in &granted {
        if rule.get("nonResourceURLs").is_some() {
            non_resource_rules.push(json!({
                "verbs": list(rule, "verbs"),
                "nonResourceURLs": list(rule, "nonResourceURLs"),
            }));
        } else {
            let mut r = json!({
                "verbs": list(rule, "verbs"),
                "apiGroups": list(rule, "apiGroups"),
                "resources": list(rule, "resources"),
            });
            if let Some(names) = rule.get("resourceNames") {
                r["resourceNames"] = names.clone();
            }
            resource_rules.push(r);
        }
    }
    Ok(json!({
        "resourceRules": resource_rules,
        "nonResourceRules": non_resource_rules,
        "incomplete": false,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_the_reviews_and_only_them() {
        let all = trellis_api::registry::builtins();
        let answered: Vec<String> = all
            .iter()
            .filter(|r| answers(r))
            .map(ResourceInfo::qualified)
            .collect();
        assert_eq!(
            answered,
            [
                "selfsubjectreviews.authentication.k8s.io",
                "selfsubjectaccessreviews.authorization.k8s.io",
                "selfsubjectrulesreviews.authorization.k8s.io",
                "subjectaccessreviews.authorization.k8s.io",
            ]
        );
        assert!(
            all.iter()
                .filter(|r| answers(r))
                .all(|r| r.verbs == ["create"])
        );
    }

    #[test]
    fn non_resource_rules_match_paths_and_prefixes() {
        let rule = json!({"nonResourceURLs": ["/healthz", "/api/*"], "verbs": ["get"]});
        assert!(rbac::non_resource_rule_allows(&rule, "get", "/healthz"));
        assert!(rbac::non_resource_rule_allows(&rule, "get", "/api/v1"));
        assert!(!rbac::non_resource_rule_allows(&rule, "post", "/healthz"));
        assert!(!rbac::non_resource_rule_allows(&rule, "get", "/metrics"));
    }
}
