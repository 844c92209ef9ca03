//! Every error a client sees: [`ApiError`], rendered as a Kubernetes `Status` at the
//! API server's edge. Constructors follow kube-apiserver's wording so that clients
//! (and people) read the same messages they know.

use serde_json::{Value, json};

/// A `Status` reason, as `metav1.StatusReason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    BadRequest,
    Unauthorized,
    Forbidden,
    NotFound,
    MethodNotAllowed,
    NotAcceptable,
    AlreadyExists,
    Conflict,
    Gone,
    Expired,
    RequestEntityTooLarge,
    UnsupportedMediaType,
    Invalid,
    TooManyRequests,
    InternalError,
    Timeout,
    ServiceUnavailable,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::BadRequest => "BadRequest",
            Reason::Unauthorized => "Unauthorized",
            Reason::Forbidden => "Forbidden",
            Reason::NotFound => "NotFound",
            Reason::MethodNotAllowed => "MethodNotAllowed",
            Reason::NotAcceptable => "NotAcceptable",
            Reason::AlreadyExists => "AlreadyExists",
            Reason::Conflict => "Conflict",
            Reason::Gone => "Gone",
            Reason::Expired => "Expired",
            Reason::RequestEntityTooLarge => "RequestEntityTooLarge",
            Reason::UnsupportedMediaType => "UnsupportedMediaType",
            Reason::Invalid => "Invalid",
            Reason::TooManyRequests => "TooManyRequests",
            Reason::InternalError => "InternalError",
            Reason::Timeout => "Timeout",
            Reason::ServiceUnavailable => "ServiceUnavailable",
        }
    }
}

/// One field-level problem of an `Invalid` error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusCause {
    /// `FieldValueRequired`, `FieldValueInvalid`, `FieldValueNotSupported`,
    /// `FieldValueDuplicate`, `FieldValueTooLong`, `FieldValueForbidden`, or a
    /// reason of the caller's.
    pub reason: String,
    pub message: String,
    /// The JSON path of the field, e.g. `spec.containers[0].image`.
    pub field: String,
}

impl StatusCause {
    pub fn new(reason: &str, field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            reason: reason.to_owned(),
            message: message.into(),
            field: field.into(),
        }
    }

    pub fn with_message(mut self, message: impl Into<String>) -> Self {
        self.message = message.into();
        self
    }

    pub fn required(field: impl Into<String>) -> Self {
        Self::new("FieldValueRequired", field, "Required value")
    }

    pub fn invalid(field: impl Into<String>, value: &str, detail: &str) -> Self {
        Self::new(
            "FieldValueInvalid",
            field,
            format!("Invalid value: {value:?}: {detail}"),
        )
    }

    pub fn forbidden(field: impl Into<String>, detail: &str) -> Self {
        Self::new("FieldValueForbidden", field, format!("Forbidden: {detail}"))
    }

    pub fn unknown_field(field: impl Into<String>) -> Self {
        let field = field.into();
        Self::new(
            "FieldValueInvalid",
            field.clone(),
            format!("unknown field {field:?}"),
        )
    }
}

/// `Status.details`: what the error is about.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StatusDetails {
    pub name: String,
    pub group: String,
    /// The resource (plural) or, for `Invalid`, the kind, as kube-apiserver reports it.
    pub kind: String,
    pub causes: Vec<StatusCause>,
    pub retry_after_seconds: Option<u32>,
}

/// An error a client receives as a `Status` with this code and reason.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub code: u16,
    pub reason: Reason,
    pub message: String,
    /// Boxed: most errors carry none, and results stay small.
    pub details: Option<Box<StatusDetails>>,
}

/// `pods` in the core group, `deployments.apps` elsewhere: how kube-apiserver names a
/// resource in messages.
fn qualified(group: &str, resource: &str) -> String {
    if group.is_empty() {
        resource.to_owned()
    } else {
        format!("{resource}.{group}")
    }
}

fn about(group: &str, resource: &str, name: &str) -> Option<Box<StatusDetails>> {
    Some(Box::new(StatusDetails {
        name: name.to_owned(),
        group: group.to_owned(),
        kind: resource.to_owned(),
        ..StatusDetails::default()
    }))
}

impl ApiError {
    pub fn new(code: u16, reason: Reason, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    pub fn not_found(group: &str, resource: &str, name: &str) -> Self {
        Self {
            details: about(group, resource, name),
            ..Self::new(
                404,
                Reason::NotFound,
                format!("{} {name:?} not found", qualified(group, resource)),
            )
        }
    }

    pub fn already_exists(group: &str, resource: &str, name: &str) -> Self {
        Self {
            details: about(group, resource, name),
            ..Self::new(
                409,
                Reason::AlreadyExists,
                format!("{} {name:?} already exists", qualified(group, resource)),
            )
        }
    }

    /// A write based on a stale resourceVersion (or another conflict, in `detail`).
    pub fn conflict(group: &str, resource: &str, name: &str, detail: &str) -> Self {
        Self {
            details: about(group, resource, name),
            ..Self::new(
                409,
                Reason::Conflict,
                format!(
                    "Operation cannot be fulfilled on {} {name:?}: {detail}",
                    qualified(group, resource)
                ),
            )
        }
    }

    /// The message kube-apiserver gives for a stale resourceVersion.
    pub const MODIFIED: &'static str = "the object has been modified; please apply your changes to the latest version and try again";

    pub fn invalid(group: &str, kind: &str, name: &str, causes: Vec<StatusCause>) -> Self {
        let summary: Vec<String> = causes
            .iter()
            .map(|c| {
                if c.field.is_empty() {
                    c.message.clone()
                } else {
                    format!("{}: {}", c.field, c.message)
                }
            })
            .collect();
        // kube-apiserver names the kind with its group: `Deployment.apps "web"`.
        let qualified_kind = if group.is_empty() {
            kind.to_owned()
        } else {
            format!("{kind}.{group}")
        };
        let message = match summary.as_slice() {
            [one] => format!("{qualified_kind} {name:?} is invalid: {one}"),
            many => format!(
                "{qualified_kind} {name:?} is invalid: [{}]",
                many.join(", ")
            ),
        };
        Self {
            code: 422,
            reason: Reason::Invalid,
            message,
            details: Some(Box::new(StatusDetails {
                name: name.to_owned(),
                group: group.to_owned(),
                kind: kind.to_owned(),
                causes,
                retry_after_seconds: None,
            })),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, Reason::BadRequest, message)
    }

    /// A resourceVersion older than the history the server keeps.
    pub fn gone(message: impl Into<String>) -> Self {
        Self::new(410, Reason::Expired, message)
    }

    pub fn unauthorized() -> Self {
        Self::new(401, Reason::Unauthorized, "Unauthorized")
    }

    /// kube-apiserver's RBAC denial wording, naming user, verb and resource.
    pub fn forbidden(
        user: &str,
        verb: &str,
        group: &str,
        resource: &str,
        namespace: &str,
        name: &str,
    ) -> Self {
        let what = qualified(group, resource);
        let target = if name.is_empty() {
            String::new()
        } else {
            format!(" {name:?}")
        };
        let scope = if namespace.is_empty() {
            "at the cluster scope".to_owned()
        } else {
            format!("in the namespace {namespace:?}")
        };
        Self {
            details: about(group, resource, name),
            ..Self::new(
                403,
                Reason::Forbidden,
                format!(
                    "{what}{target} is forbidden: User {user:?} cannot {verb} resource {resource:?} in API group {group:?} {scope}"
                ),
            )
        }
    }

    /// An admission step's refusal: `pods "web" is forbidden: REASON`.
    pub fn admission_forbidden(group: &str, resource: &str, name: &str, reason: &str) -> Self {
        Self {
            details: about(group, resource, name),
            ..Self::new(
                403,
                Reason::Forbidden,
                format!(
                    "{} {name:?} is forbidden: {reason}",
                    qualified(group, resource)
                ),
            )
        }
    }

    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(405, Reason::MethodNotAllowed, message)
    }

    pub fn not_acceptable(message: impl Into<String>) -> Self {
        Self::new(406, Reason::NotAcceptable, message)
    }

    pub fn unsupported_media_type(content_type: &str) -> Self {
        Self::new(
            415,
            Reason::UnsupportedMediaType,
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml, application/vnd.kubernetes.protobuf; got {content_type:?}"
            ),
        )
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            413,
            Reason::RequestEntityTooLarge,
            format!("the request body is larger than the limit of {limit} bytes"),
        )
    }

    /// An object larger than the store takes.
    pub fn too_large_object(size: usize, limit: usize) -> Self {
        Self::new(
            413,
            Reason::RequestEntityTooLarge,
            format!("the object is {size} bytes, larger than the store's limit of {limit} bytes"),
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            500,
            Reason::InternalError,
            format!("Internal error occurred: {}", message.into()),
        )
    }

    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(504, Reason::Timeout, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(503, Reason::ServiceUnavailable, message)
    }

    /// The `Status` object clients receive.
    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason.as_str(),
            "code": self.code,
        });
        if let Some(d) = &self.details {
            let mut details = serde_json::Map::new();
            if !d.name.is_empty() {
                details.insert("name".into(), d.name.clone().into());
            }
            if !d.group.is_empty() {
                details.insert("group".into(), d.group.clone().into());
            }
            if !d.kind.is_empty() {
                details.insert("kind".into(), d.kind.clone().into());
            }
            if !d.causes.is_empty() {
                let causes: Vec<Value> = d
                    .causes
                    .iter()
                    .map(|c| json!({"reason": c.reason, "message": c.message, "field": c.field}))
                    .collect();
                details.insert("causes".into(), causes.into());
            }
            if let Some(s) = d.retry_after_seconds {
                details.insert("retryAfterSeconds".into(), s.into());
            }
            status["details"] = Value::Object(details);
        }
        status
    }
}

/// The `Status` a successful delete of a whole object returns when the object itself is
/// not returned.
pub fn success(group: &str, resource: &str, name: &str, uid: &str) -> Value {
    let mut details = json!({"name": name, "kind": resource, "uid": uid});
    if !group.is_empty() {
        details["group"] = group.into();
    }
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_found_matches_kube_apiserver() {
        let s = ApiError::not_found("apps", "deployments", "nope").to_status();
        assert_eq!(
            s,
            json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "deployments.apps \"nope\" not found", "reason": "NotFound",
                "details": {"name": "nope", "group": "apps", "kind": "deployments"}, "code": 404
            })
        );
        assert_eq!(
            ApiError::not_found("", "pods", "p").message,
            "pods \"p\" not found"
        );
    }

    #[test]
    fn invalid_lists_every_cause() {
        let e = ApiError::invalid(
            "",
            "Pod",
            "web",
            vec![
                StatusCause::required("spec.containers"),
                StatusCause::invalid("metadata.name", "Web", "must be lowercase"),
            ],
        );
        assert_eq!(e.code, 422);
        assert_eq!(
            e.message,
            "Pod \"web\" is invalid: [spec.containers: Required value, metadata.name: Invalid value: \"Web\": must be lowercase]"
        );
        let causes = &e.to_status()["details"]["causes"];
        assert_eq!(causes[0]["field"], "spec.containers");
        assert_eq!(causes[1]["reason"], "FieldValueInvalid");
    }

    #[test]
    fn forbidden_names_user_verb_and_resource() {
        let e = ApiError::forbidden("alice", "list", "", "secrets", "default", "");
        assert_eq!(
            e.message,
            "secrets is forbidden: User \"alice\" cannot list resource \"secrets\" in API group \"\" in the namespace \"default\""
        );
        assert_eq!(e.to_status()["code"], 403);
    }
}
