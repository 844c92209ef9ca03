//! The admission requests a test sends: [`create`], [`update`], [`delete`] and the
//! [`RequestBuilder`] they return, filled the way the API server fills them.

use serde_json::Value;

use crate::{GroupVersionKind, GroupVersionResource, Operation, Request, UserInfo, request::Json};

/// A request for creating `object`.
pub fn create(object: Value) -> RequestBuilder {
    RequestBuilder::new(Operation::Create, Some(object), None)
}

/// A request for replacing `old` with `new`.
pub fn update(new: Value, old: Value) -> RequestBuilder {
    RequestBuilder::new(Operation::Update, Some(new), Some(old))
}

/// A request for deleting `old`.
pub fn delete(old: Value) -> RequestBuilder {
    RequestBuilder::new(Operation::Delete, None, Some(old))
}

/// Builds a [`Request`] the way the API server fills it: kind, resource, name and
/// namespace from the object (override them when the guess is wrong), user
/// `tester` in `system:authenticated`.
#[derive(Clone, Debug)]
pub struct RequestBuilder(Request);

impl RequestBuilder {
    fn new(operation: Operation, object: Option<Value>, old: Option<Value>) -> Self {
        let subject = object
            .as_ref()
            .or(old.as_ref())
            .cloned()
            .unwrap_or(Value::Null);
        let (kind, resource) = kind_and_resource(&subject);
        Self(Request {
            uid: "00000000-0000-4000-8000-000000000000".into(),
            kind,
            resource,
            sub_resource: None,
            name: meta(&subject, "name").unwrap_or_default().into(),
            namespace: meta(&subject, "namespace").map(Into::into),
            operation,
            user_info: UserInfo {
                username: "tester".into(),
                uid: String::new(),
                groups: vec!["system:authenticated".into()],
                extra: Vec::new(),
            },
            object: object.map(|o| Json::new(o.to_string())),
            old_object: old.map(|o| Json::new(o.to_string())),
            dry_run: false,
        })
    }

    /// The requesting user and their groups.
    pub fn user(mut self, username: &str, groups: &[&str]) -> Self {
        self.0.user_info.username = username.into();
        self.0.user_info.groups = groups.iter().map(|g| (*g).into()).collect();
        self
    }

    pub fn namespace(mut self, namespace: &str) -> Self {
        self.0.namespace = Some(namespace.into());
        self
    }

    pub fn name(mut self, name: &str) -> Self {
        self.0.name = name.into();
        self
    }

    pub fn resource(mut self, resource: GroupVersionResource) -> Self {
        self.0.resource = resource;
        self
    }

    pub fn sub_resource(mut self, sub_resource: &str) -> Self {
        self.0.sub_resource = Some(sub_resource.into());
        self
    }

    pub fn dry_run(mut self) -> Self {
        self.0.dry_run = true;
        self
    }

    pub fn build(self) -> Request {
        self.0
    }
}

impl From<RequestBuilder> for Request {
    fn from(b: RequestBuilder) -> Self {
        b.0
    }
}

/// GVK from `apiVersion` and `kind`; the resource is the kind's lowercase plural,
/// which holds for the built-in kinds a test is likely to use.
pub(super) fn kind_and_resource(object: &Value) -> (GroupVersionKind, GroupVersionResource) {
    let api_version = object
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or("v1");
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let kind = object
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default();
    (
        GroupVersionKind::new(group, version, kind),
        GroupVersionResource::new(group, version, &plural(kind)),
    )
}

fn plural(kind: &str) -> String {
    let lower = kind.to_lowercase();
    if lower == "endpoints" {
        lower
    } else if lower.ends_with('s')
        || lower.ends_with('x')
        || lower.ends_with("ch")
        || lower.ends_with("sh")
    {
        format!("{lower}es")
    } else if let Some(stem) = lower
        .strip_suffix('y')
        .filter(|s| !s.ends_with(['a', 'e', 'i', 'o', 'u']))
    {
        format!("{stem}ies")
    } else {
        format!("{lower}s")
    }
}

pub(super) fn meta<'a>(object: &'a Value, field: &str) -> Option<&'a str> {
    object.get("metadata")?.get(field)?.as_str()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn request_builder_guesses_like_the_api_server() {
        let r = create(
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}}),
        )
        .build();
        assert_eq!(r.kind, GroupVersionKind::new("apps", "v1", "Deployment"));
        assert_eq!(r.resource.resource, "deployments");
        assert_eq!((r.name.as_str(), r.namespace.as_deref()), ("d", None));
        for (kind, resource) in [
            ("NetworkPolicy", "networkpolicies"),
            ("Ingress", "ingresses"),
            ("Endpoints", "endpoints"),
            ("Gateway", "gateways"),
        ] {
            assert_eq!(plural(kind), resource);
        }
    }
}
