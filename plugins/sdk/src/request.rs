//! What a plugin is asked, in plain Rust types: the same fields as the WIT records,
//! with objects kept as JSON and decoded on demand.

use std::{cell::OnceCell, fmt};

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::Status;

/// Group, version and kind of an object (`apps`, `v1`, `Deployment`; the core group
/// is `""`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct GroupVersionKind {
    pub group: String,
    pub version: String,
    pub kind: String,
}

impl GroupVersionKind {
    pub fn new(group: &str, version: &str, kind: &str) -> Self {
        Self {
            group: group.into(),
            version: version.into(),
            kind: kind.into(),
        }
    }
}

/// Group, version and resource as in URLs (`apps`, `v1`, `deployments`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct GroupVersionResource {
    pub group: String,
    pub version: String,
    pub resource: String,
}

impl GroupVersionResource {
    pub fn new(group: &str, version: &str, resource: &str) -> Self {
        Self {
            group: group.into(),
            version: version.into(),
            resource: resource.into(),
        }
    }
}

impl fmt::Display for GroupVersionResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.group.is_empty() {
            write!(f, "{}/{}", self.version, self.resource)
        } else {
            write!(f, "{}/{}/{}", self.group, self.version, self.resource)
        }
    }
}

/// Who sent the request, as the API server authenticated them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UserInfo {
    pub username: String,
    pub uid: String,
    pub groups: Vec<String>,
    pub extra: Vec<(String, Vec<String>)>,
}

impl UserInfo {
    pub fn in_group(&self, group: &str) -> bool {
        self.groups.iter().any(|g| g == group)
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Operation {
    #[default]
    Create,
    Update,
    Delete,
    Connect,
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Operation::Create => "CREATE",
            Operation::Update => "UPDATE",
            Operation::Delete => "DELETE",
            Operation::Connect => "CONNECT",
        })
    }
}

/// An object as JSON text, parsed at most once and only when asked.
#[derive(Clone, Debug, Default)]
pub(crate) struct Json {
    text: String,
    parsed: OnceCell<Value>,
}

impl Json {
    pub(crate) fn new(text: String) -> Self {
        Self {
            text,
            parsed: OnceCell::new(),
        }
    }

    pub(crate) fn value(&self) -> &Value {
        // Invalid JSON reads as `null`: the host only sends what it decoded itself.
        self.parsed
            .get_or_init(|| serde_json::from_str(&self.text).unwrap_or(Value::Null))
    }

    pub(crate) fn decode<T: DeserializeOwned>(&self, what: &str) -> Result<T, Status> {
        self.decode_as::<T, T>(what)
    }

    /// Decodes the text as `D`, naming `T` (the type the caller asked for) in the
    /// error.
    fn decode_as<D: DeserializeOwned, T>(&self, what: &str) -> Result<D, Status> {
        serde_json::from_str(&self.text).map_err(|e| {
            Status::bad_request(format!(
                "cannot decode the {what} as {}: {e}",
                short_type_name::<T>()
            ))
        })
    }
}

fn short_type_name<T>() -> &'static str {
    let full = std::any::type_name::<T>();
    let base = full.split('<').next().unwrap_or(full);
    base.rsplit("::").next().unwrap_or(base)
}

/// An admission request, as Kubernetes' AdmissionReview carries it.
#[derive(Clone, Debug, Default)]
pub struct Request {
    /// Unique per request; echo it in logs to correlate.
    pub uid: String,
    pub kind: GroupVersionKind,
    pub resource: GroupVersionResource,
    pub sub_resource: Option<String>,
    /// Empty on a create whose name the server will generate.
    pub name: String,
    pub namespace: Option<String>,
    pub operation: Operation,
    pub user_info: UserInfo,
    pub(crate) object: Option<Json>,
    pub(crate) old_object: Option<Json>,
    /// The request will not be persisted: cause no side effects.
    pub dry_run: bool,
}

impl Request {
    /// The object after the request (create, update); `None` for a delete.
    pub fn object(&self) -> Option<&Value> {
        self.object.as_ref().map(Json::value)
    }

    /// The stored object before the request (update, delete).
    pub fn old_object(&self) -> Option<&Value> {
        self.old_object.as_ref().map(Json::value)
    }

    /// The object's JSON text as the host sent it.
    pub fn object_json(&self) -> Option<&str> {
        self.object.as_ref().map(|j| j.text.as_str())
    }

    /// The object decoded into `T` (e.g. `k8s_openapi::api::core::v1::Pod`); a
    /// `400 BadRequest` when there is none or it does not decode, so `?` denies.
    pub fn object_as<T: DeserializeOwned>(&self) -> Result<T, Status> {
        self.object_or_bad_request()?.decode("object")
    }

    fn object_or_bad_request(&self) -> Result<&Json, Status> {
        self.object.as_ref().ok_or_else(|| {
            Status::bad_request(format!("{} request without an object", self.operation))
        })
    }

    /// The object's `spec` alone, decoded into `T` (e.g.
    /// `k8s_openapi::api::core::v1::PodSpec`); `Ok(None)` when the object has none.
    /// The rest of the object (metadata with its managedFields, status) is skipped
    /// over instead of decoded: a policy that reads only the spec saves that work on
    /// every call (a tenth of pod-policy's cost in the server). Errors as
    /// [`object_as`](Self::object_as).
    pub fn spec_as<T: DeserializeOwned>(&self) -> Result<Option<T>, Status> {
        #[derive(serde::Deserialize)]
        #[serde(bound = "T: DeserializeOwned")]
        struct Spec<T> {
            spec: Option<T>,
        }
        let object = self.object_or_bad_request()?;
        Ok(object.decode_as::<Spec<T>, T>("object's spec")?.spec)
    }

    /// The old object decoded into `T`; see [`object_as`](Self::object_as).
    pub fn old_object_as<T: DeserializeOwned>(&self) -> Result<T, Status> {
        self.old_object
            .as_ref()
            .ok_or_else(|| {
                Status::bad_request(format!("{} request without an old object", self.operation))
            })?
            .decode("old object")
    }

    /// A label of the object (or of the old object on a delete).
    pub fn label(&self, key: &str) -> Option<&str> {
        self.object()
            .or_else(|| self.old_object())
            .and_then(|o| o.pointer("/metadata/labels"))
            .and_then(|labels| labels.get(key))
            .and_then(Value::as_str)
    }

    /// `namespace/name` (or `name`) for messages, using the object's
    /// `generateName` when the server has not named it yet.
    pub fn display_name(&self) -> String {
        let name = if self.name.is_empty() {
            self.object()
                .and_then(|o| o.pointer("/metadata/generateName"))
                .and_then(Value::as_str)
                .map(|g| format!("{g}*"))
                .unwrap_or_default()
        } else {
            self.name.clone()
        };
        match &self.namespace {
            Some(ns) if !ns.is_empty() => format!("{ns}/{name}"),
            _ => name,
        }
    }
}

/// An object to initialize: stored, still pending this initializer.
#[derive(Clone, Debug, Default)]
pub struct InitializeRequest {
    pub kind: GroupVersionKind,
    pub resource: GroupVersionResource,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(object: &str) -> Request {
        Request {
            name: "web".into(),
            namespace: Some("prod".into()),
            object: Some(Json::new(object.into())),
            ..Request::default()
        }
    }

    #[derive(serde::Deserialize, Debug)]
    struct Meta {
        metadata: serde_json::Map<String, Value>,
    }

    #[test]
    fn spec_as_decodes_the_spec_alone() {
        #[derive(Debug, serde::Deserialize)]
        struct Spec {
            replicas: u32,
        }
        // A metadata that would not decode as anything is never looked at.
        let ok = request(r#"{"metadata":{"name":7,"x":[{}]},"spec":{"replicas":3}}"#);
        assert_eq!(ok.spec_as::<Spec>().unwrap().map(|s| s.replicas), Some(3));
        assert!(
            request(r#"{"metadata":{}}"#)
                .spec_as::<Spec>()
                .unwrap()
                .is_none()
        );

        let status = request(r#"{"spec":{"replicas":"three"}}"#)
            .spec_as::<Spec>()
            .unwrap_err();
        assert_eq!((status.code, status.reason.as_str()), (400, "BadRequest"));
        assert!(
            status
                .message
                .contains("cannot decode the object's spec as Spec: invalid type"),
            "{}",
            status.message
        );
    }

    #[test]
    fn object_as_decodes_or_answers_bad_request() {
        let ok = request(r#"{"metadata":{"name":"web"}}"#);
        assert_eq!(ok.object_as::<Meta>().unwrap().metadata["name"], "web");

        let bad = request(r#"{"spec":{}}"#);
        let status = bad.object_as::<Meta>().unwrap_err();
        assert_eq!((status.code, status.reason.as_str()), (400, "BadRequest"));
        assert!(
            status.message.contains("as Meta: missing field `metadata`"),
            "{}",
            status.message
        );

        let deletion = Request {
            operation: Operation::Delete,
            ..Request::default()
        };
        assert!(
            deletion
                .object_as::<Meta>()
                .unwrap_err()
                .message
                .contains("DELETE request without an object")
        );
    }

    #[test]
    fn labels_and_names_read_from_the_object() {
        let r = request(r#"{"metadata":{"labels":{"team":"storage"}}}"#);
        assert_eq!(r.label("team"), Some("storage"));
        assert_eq!(r.label("app"), None);
        assert_eq!(r.display_name(), "prod/web");

        let generated = Request {
            object: Some(Json::new(r#"{"metadata":{"generateName":"web-"}}"#.into())),
            ..Request::default()
        };
        assert_eq!(generated.display_name(), "web-*");
    }
}
