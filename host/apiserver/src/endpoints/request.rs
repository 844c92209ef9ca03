//! What a resource request asks for, parsed once from its path, query and headers:
//! the resource, namespace, name and subresource, the verb, the query options, the
//! body's format and the representation the client accepts.

use std::collections::HashMap;

use axum::http::{HeaderMap, Method, header};
use trellis_api::registry::{ResourceInfo, Subresource};
use trellis_api::{ApiError, UserInfo};

use crate::object::{self, Object};

/// The largest request body accepted: what the store accepts as one object. A larger
/// body could only be refused after its admission, quota and plugins had run; and
/// HTTP/2's many streams per connection multiply whatever is allowed here.
pub const MAX_BODY: usize = trellis_store::DEFAULT_MAX_VALUE_SIZE;

/// Whether a request stays open as long as its client wants (a watch, a followed
/// log): kube-apiserver's long-running requests, which neither the request timeout nor
/// the in-flight limits apply to.
pub fn is_long_running(uri: &axum::http::Uri) -> bool {
    let pairs = uri.query().map(form_pairs).unwrap_or_default();
    let set = |k: &str| pairs.get(k).is_some_and(|v| v == "true" || v == "1");
    set("watch") || set("follow") || uri.path().split('/').any(|s| s == "watch")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatchType {
    Json,
    Merge,
    StrategicMerge,
    Apply,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyFormat {
    Json,
    Yaml,
    Patch(PatchType),
    /// Kubernetes' protobuf envelope, as typed clients (kubectl create …) send it.
    Protobuf,
    Unsupported,
}

/// The query options of resource requests.
#[derive(Clone, Debug, Default)]
pub struct Query {
    pub label_selector: Option<String>,
    pub field_selector: Option<String>,
    pub limit: Option<usize>,
    pub continue_token: Option<String>,
    pub resource_version: Option<String>,
    pub resource_version_match: Option<String>,
    pub watch: bool,
    pub allow_watch_bookmarks: bool,
    pub timeout_seconds: Option<u64>,
    pub dry_run: bool,
    pub field_manager: Option<String>,
    /// `force` of an apply patch: take over fields other managers own.
    pub force: Option<bool>,
    pub field_validation: Option<String>,
    pub include_uninitialized: bool,
    /// `includeObject`, read only when a Table is asked for ([`IncludeObject::parse`]).
    pub include_object: Option<String>,
    pub propagation_policy: Option<String>,
    /// `pods/log`: the container whose log is asked for.
    pub container: Option<String>,
    /// `DeleteOptions.gracePeriodSeconds` given in the query.
    pub grace_period_seconds: Option<i64>,
    /// The rest of `pods/log`'s options (`PodLogOptions`), passed on to the node as
    /// given: `follow`, `previous`, `timestamps`, `tailLines`, `sinceSeconds`,
    /// `sinceTime`, `limitBytes`.
    pub log_options: Vec<(String, String)>,
}

fn truthy(v: &str) -> bool {
    matches!(v, "true" | "1" | "True")
}

impl Query {
    pub fn parse(raw: Option<&str>) -> Result<Self, ApiError> {
        let mut q = Query::default();
        let Some(raw) = raw else { return Ok(q) };
        let pairs: HashMap<String, String> = form_pairs(raw);
        for (k, v) in pairs {
            match k.as_str() {
                "labelSelector" => q.label_selector = Some(v),
                "fieldSelector" => q.field_selector = Some(v),
                "limit" => {
                    q.limit = Some(
                        v.parse()
                            .map_err(|_| ApiError::bad_request(format!("invalid limit {v:?}")))?,
                    )
                }
                "continue" => q.continue_token = Some(v),
                "resourceVersion" => q.resource_version = Some(v),
                "resourceVersionMatch" => q.resource_version_match = Some(v),
                "watch" => q.watch = truthy(&v),
                "allowWatchBookmarks" => q.allow_watch_bookmarks = truthy(&v),
                "timeoutSeconds" => {
                    q.timeout_seconds = Some(v.parse().map_err(|_| {
                        ApiError::bad_request(format!("invalid timeoutSeconds {v:?}"))
                    })?)
                }
                "dryRun" => {
                    if v != "All" {
                        return Err(ApiError::bad_request(format!(
                            "unsupported dryRun value {v:?}: only All"
                        )));
                    }
                    q.dry_run = true;
                }
                "fieldManager" => q.field_manager = Some(v),
                "force" => q.force = Some(truthy(&v)),
                "fieldValidation" => q.field_validation = Some(v),
                "includeUninitialized" => q.include_uninitialized = truthy(&v),
                "includeObject" => q.include_object = Some(v),
                "propagationPolicy" => q.propagation_policy = Some(v),
                "container" => q.container = Some(v),
                "gracePeriodSeconds" => {
                    q.grace_period_seconds = Some(v.parse().map_err(|_| {
                        ApiError::bad_request(format!("invalid gracePeriodSeconds {v:?}"))
                    })?)
                }
                "follow"
                | "previous"
                | "timestamps"
                | "tailLines"
                | "sinceSeconds"
                | "sinceTime"
                | "limitBytes"
                | "insecureSkipTLSVerifyBackend" => q.log_options.push((k.clone(), v)),
                _ => {}
            }
        }
        Ok(q)
    }
}

/// What each row of a Table carries as its `object` (`includeObject`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IncludeObject {
    /// Nothing: the rows' `object` is null.
    None,
    /// The object's metadata as a `PartialObjectMetadata`: Kubernetes' default.
    #[default]
    Metadata,
    /// The whole object: what `kubectl get --sort-by` sorts by.
    Object,
}

impl IncludeObject {
    /// `includeObject` as kube-apiserver reads it for a Table: empty or absent is
    /// `Metadata`, any value it does not know a 400.
    pub fn parse(value: Option<&str>) -> Result<Self, ApiError> {
        match value.unwrap_or_default() {
            "" | "Metadata" => Ok(Self::Metadata),
            "None" => Ok(Self::None),
            "Object" => Ok(Self::Object),
            other => Err(ApiError::bad_request(format!(
                "Unable to convert to Table as requested: includeObject: Invalid value: {other:?}: must be 'Metadata', 'Object', 'None', or empty"
            ))),
        }
    }
}

/// `application/x-www-form-urlencoded` pairs (the query string), percent-decoded.
pub fn form_pairs(raw: &str) -> HashMap<String, String> {
    form_urlencoded::parse(raw.as_bytes())
        .into_owned()
        .collect()
}

/// One segment of a URL's path, percent-decoded (`system%3Anodes`: `system:nodes`,
/// as clients escape names with colons); a `+` stays a `+`.
pub fn path_segment(s: &str) -> std::borrow::Cow<'_, str> {
    percent_encoding::percent_decode_str(s).decode_utf8_lossy()
}

/// A request on a resource, ready for its handler.
#[derive(Clone, Debug)]
pub struct ApiRequest {
    pub resource: ResourceInfo,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub subresource: Option<Subresource>,
    pub verb: &'static str,
    pub query: Query,
    pub user: UserInfo,
    pub content_type: Option<String>,
    /// The client's User-Agent: a write's field manager when it names none.
    pub user_agent: Option<String>,
    pub body_format: BodyFormat,
    /// Set when the client accepts a `meta.k8s.io` Table (kubectl get): what the
    /// Table's rows carry.
    pub table: Option<IncludeObject>,
    pub dry_run: bool,
    pub include_uninitialized: bool,
}

impl ApiRequest {
    pub fn name(&self) -> Result<&str, ApiError> {
        self.name
            .as_deref()
            .ok_or_else(|| ApiError::bad_request("a name is required"))
    }

    /// `fieldValidation=Strict`: unknown fields are refused instead of dropped.
    pub fn strict_fields(&self) -> bool {
        self.query.field_validation.as_deref() == Some("Strict")
    }

    /// `fieldValidation=Warn`, Kubernetes' default: dropped fields are reported.
    pub fn warn_fields(&self) -> bool {
        matches!(self.query.field_validation.as_deref(), None | Some("Warn"))
    }

    /// The body as an object; JSON or YAML per its content type.
    pub fn decode_body(&self, body: &[u8]) -> Result<Object, ApiError> {
        match self.body_format {
            BodyFormat::Json => object::decode(body, false),
            BodyFormat::Yaml => object::decode(body, true),
            BodyFormat::Protobuf => crate::endpoints::protobuf::decode(body),
            BodyFormat::Patch(_) | BodyFormat::Unsupported => Err(
                ApiError::unsupported_media_type(self.content_type.as_deref().unwrap_or("")),
            ),
        }
    }
}

/// The verb of a resource request, as RBAC names it.
pub fn verb(method: &Method, has_name: bool, watch: bool) -> Option<&'static str> {
    Some(match (method.as_str(), has_name) {
        ("GET", _) if watch => "watch",
        ("GET", true) => "get",
        ("GET", false) => "list",
        ("POST", false) => "create",
        ("POST", true) => "create",
        ("PUT", true) => "update",
        ("PATCH", true) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => return None,
    })
}

/// The body format named by a Content-Type header; no header means JSON, as the
/// Python client sends bodies without one.
pub fn body_format(headers: &HeaderMap) -> (Option<String>, BodyFormat) {
    let Some(ct) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return (None, BodyFormat::Json);
    };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let format = match essence.as_str() {
        "" | "application/json" | "*/*" => BodyFormat::Json,
        "application/yaml" | "application/x-yaml" | "text/yaml" => BodyFormat::Yaml,
        "application/json-patch+json" => BodyFormat::Patch(PatchType::Json),
        "application/merge-patch+json" => BodyFormat::Patch(PatchType::Merge),
        "application/strategic-merge-patch+json" => BodyFormat::Patch(PatchType::StrategicMerge),
        "application/apply-patch+yaml" | "application/apply-patch+json" => {
            BodyFormat::Patch(PatchType::Apply)
        }
        crate::endpoints::protobuf::CONTENT_TYPE => BodyFormat::Protobuf,
        _ => BodyFormat::Unsupported,
    };
    (Some(ct.to_owned()), format)
}

/// Whether the Accept header asks for a Table (`as=Table;g=meta.k8s.io`).
pub fn wants_table(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|accept| {
            accept
                .split(',')
                .next()
                .is_some_and(|first| first.contains("as=Table"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_are_percent_decoded_but_keep_plus() {
        assert_eq!(
            path_segment("system%3Acontroller%3Ax"),
            "system:controller:x"
        );
        assert_eq!(path_segment("a+b"), "a+b");
        assert_eq!(path_segment("plain"), "plain");
        assert_eq!(form_pairs("q=a+b")["q"], "a b");
    }

    #[test]
    fn parses_query_options() {
        let q = Query::parse(Some(
            "labelSelector=app%3Dweb%2Ctier+in+(a)&limit=5&watch=1&dryRun=All",
        ))
        .unwrap();
        assert_eq!(q.label_selector.as_deref(), Some("app=web,tier in (a)"));
        assert_eq!(q.limit, Some(5));
        assert!(q.watch && q.dry_run);
        assert!(
            Query::parse(Some("limit=x"))
                .unwrap_err()
                .message
                .contains("limit")
        );
        assert!(Query::parse(Some("dryRun=Some")).is_err());
    }

    #[test]
    fn include_object_takes_kubernetes_values_and_defaults_to_metadata() {
        assert_eq!(IncludeObject::parse(None).unwrap(), IncludeObject::Metadata);
        assert_eq!(
            IncludeObject::parse(Some("")).unwrap(),
            IncludeObject::Metadata
        );
        assert_eq!(
            IncludeObject::parse(Some("Object")).unwrap(),
            IncludeObject::Object
        );
        assert_eq!(
            IncludeObject::parse(Some("None")).unwrap(),
            IncludeObject::None
        );
        let refused = IncludeObject::parse(Some("object")).unwrap_err();
        assert_eq!(refused.code, 400);
        assert!(refused.message.contains("includeObject"), "{refused:?}");
    }

    #[test]
    fn maps_methods_to_verbs() {
        assert_eq!(verb(&Method::GET, false, true), Some("watch"));
        assert_eq!(verb(&Method::GET, true, false), Some("get"));
        assert_eq!(
            verb(&Method::DELETE, false, false),
            Some("deletecollection")
        );
        assert_eq!(verb(&Method::PUT, false, false), None);
    }

    #[test]
    fn content_types_pick_the_format() {
        let mut h = HeaderMap::new();
        assert_eq!(body_format(&h).1, BodyFormat::Json);
        h.insert(
            header::CONTENT_TYPE,
            "application/merge-patch+json".parse().unwrap(),
        );
        assert_eq!(body_format(&h).1, BodyFormat::Patch(PatchType::Merge));
        h.insert(
            header::CONTENT_TYPE,
            "application/vnd.kubernetes.protobuf".parse().unwrap(),
        );
        assert_eq!(body_format(&h).1, BodyFormat::Protobuf);
        h.insert(header::CONTENT_TYPE, "text/csv".parse().unwrap());
        assert_eq!(body_format(&h).1, BodyFormat::Unsupported);
    }
}
