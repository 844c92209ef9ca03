//! What a request asks for, parsed once from its path, query and headers: the path
//! as a [`RequestInfo`] (a resource's group, version, namespace, name and subresource,
//! or one of the non-resource paths), the verb, the query options, the body's format
//! and the representation the client accepts.

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

/// What a request's path names, read before anything else of the request: Kubernetes'
/// `RequestInfo` (`RequestInfoFactory.NewRequestInfo`). A path with a group-version and
/// at least one segment after it (`/api/v1/…`, `/apis/{group}/{version}/…`) is a
/// resource request, authorized by what it does to which resource; every other path is
/// a non-resource path (discovery, OpenAPI, `/metrics`), authorized by its URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestInfo {
    /// A request on a resource; `None` when its path has more segments than
    /// `namespaces/{namespace}/{resource}/{name}/{subresource}`, where nothing is served.
    Resource(Option<ResourcePath>),
    NonResource(NonResourcePath),
}

/// The non-resource paths served besides health and `/version`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NonResourcePath {
    /// `/metrics`, in Prometheus' text format.
    Metrics,
    /// `/api`: the core group's versions (`APIVersions`).
    ApiVersions,
    /// `/apis`: the named groups (`APIGroupList`).
    ApiGroupList,
    /// `/apis/{group}` (`APIGroup`).
    ApiGroup(String),
    /// `/api/v1`, `/apis/{group}/{version}`: a group-version's resources
    /// (`APIResourceList`).
    ApiResourceList { group: String, version: String },
    /// `/openapi/…`: the segments after `openapi` (`v2`, `v3`, `v3/apis/apps/v1`).
    OpenApi(Vec<String>),
    /// `/swagger-2.0.0.pb-v1`: the OpenAPI v2 document in protobuf under its old name.
    SwaggerProtobuf,
    /// Anything else: 404.
    Unknown,
}

/// Where a resource request points: `[namespaces/{namespace}/]{resource}[/{name}[/{subresource}]]`
/// of a group-version, each segment percent-decoded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResourcePath {
    /// `""` for the core group.
    pub group: String,
    pub version: String,
    pub namespace: Option<String>,
    /// The resource's plural (`pods`).
    pub resource: String,
    pub name: Option<String>,
    pub subresource: Option<String>,
}

impl RequestInfo {
    /// Reads a request's path. Which segment is a name and which a resource depends on
    /// the registry, which grows with custom resources: `namespaces/x/pods` is a
    /// namespaced collection while `namespaces/x/status` is a subresource of namespace
    /// `x`. `namespaced(group, version, resource)` says which: whether the group-version
    /// serves `resource` and it is namespaced.
    pub fn parse(path: &str, namespaced: impl Fn(&str, &str, &str) -> bool) -> Self {
        // Exactly this path: `/metrics/` is not it.
        if path == "/metrics" {
            return Self::NonResource(NonResourcePath::Metrics);
        }
        let decoded: Vec<std::borrow::Cow<'_, str>> = path
            .trim_end_matches('/')
            .split('/')
            .skip(1)
            .map(path_segment)
            .collect();
        let segments: Vec<&str> = decoded.iter().map(AsRef::as_ref).collect();
        let (group, version, rest) = match segments.as_slice() {
            ["api", "v1", rest @ ..] if !rest.is_empty() => ("", "v1", rest),
            ["apis", group, version, rest @ ..] if !rest.is_empty() => (*group, *version, rest),
            other => return Self::NonResource(NonResourcePath::parse(other)),
        };
        // `nodes/{name}/proxy/…` carries the node's own path after `proxy`.
        let proxied = matches!(rest, [_, _, "proxy", ..]);
        if rest.len() > 5 && !proxied {
            return Self::Resource(None);
        }
        let (namespace, resource, tail) = match rest {
            ["namespaces", ns, plural, tail @ ..] if namespaced(group, version, plural) => {
                (Some(*ns), *plural, tail)
            }
            [plural, tail @ ..] => (None, *plural, tail),
            [] => return Self::Resource(None),
        };
        // Segments past the subresource of a cluster-scoped path are not read.
        Self::Resource(Some(ResourcePath {
            group: group.to_owned(),
            version: version.to_owned(),
            namespace: namespace.map(str::to_owned),
            resource: resource.to_owned(),
            name: tail.first().map(|s| (*s).to_owned()),
            subresource: tail.get(1).map(|s| (*s).to_owned()),
        }))
    }

    /// Whether the request is authorized by resource (RBAC's `resources`) rather than
    /// by URL (`nonResourceURLs`).
    pub fn is_resource_request(&self) -> bool {
        matches!(self, Self::Resource(_))
    }
}

impl NonResourcePath {
    fn parse(segments: &[&str]) -> Self {
        match segments {
            ["api"] => Self::ApiVersions,
            ["apis"] => Self::ApiGroupList,
            ["apis", group] => Self::ApiGroup((*group).to_owned()),
            ["api", "v1"] => Self::ApiResourceList {
                group: String::new(),
                version: "v1".to_owned(),
            },
            ["apis", group, version] => Self::ApiResourceList {
                group: (*group).to_owned(),
                version: (*version).to_owned(),
            },
            ["openapi", rest @ ..] => Self::OpenApi(rest.iter().map(|s| (*s).to_owned()).collect()),
            ["swagger-2.0.0.pb-v1"] => Self::SwaggerProtobuf,
            _ => Self::Unknown,
        }
    }
}

impl ResourcePath {
    /// The subresource asked for, once the path is known to fit `resource`, the
    /// resource it names: a namespaced resource in a namespace (or listed across all
    /// of them, without a name), a cluster-scoped one outside any, and a subresource
    /// `resource` has. `None` when it does not fit: a 404.
    pub fn subresource_of(&self, resource: &ResourceInfo) -> Option<Option<Subresource>> {
        let namespaced = self.namespace.is_some();
        if resource.namespaced != namespaced
            && !(resource.namespaced && !namespaced && self.name.is_none())
        {
            return None;
        }
        match &self.subresource {
            None => Some(None),
            Some(s) => Subresource::parse(s).filter(|r| resource.has(*r)).map(Some),
        }
    }
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

    /// Reads `path` against the built-in resources.
    fn info(path: &str) -> RequestInfo {
        let builtins = trellis_api::registry::builtins();
        RequestInfo::parse(path, |group, version, plural| {
            builtins.iter().any(|r| {
                r.group == group && r.version == version && r.plural == plural && r.namespaced
            })
        })
    }

    fn resource(
        group: &str,
        namespace: Option<&str>,
        plural: &str,
        name: Option<&str>,
        subresource: Option<&str>,
    ) -> RequestInfo {
        RequestInfo::Resource(Some(ResourcePath {
            group: group.to_owned(),
            version: "v1".to_owned(),
            namespace: namespace.map(str::to_owned),
            resource: plural.to_owned(),
            name: name.map(str::to_owned),
            subresource: subresource.map(str::to_owned),
        }))
    }

    #[test]
    fn reads_core_and_named_group_resource_paths() {
        assert_eq!(
            info("/api/v1/namespaces/default/pods/web"),
            resource("", Some("default"), "pods", Some("web"), None)
        );
        assert_eq!(
            info("/apis/apps/v1/namespaces/default/deployments"),
            resource("apps", Some("default"), "deployments", None, None)
        );
        assert_eq!(
            info("/api/v1/pods/"),
            resource("", None, "pods", None, None),
            "a trailing slash changes nothing"
        );
        assert_eq!(
            info("/apis/rbac.authorization.k8s.io/v1/clusterroles/system%3Anodes"),
            RequestInfo::Resource(Some(ResourcePath {
                group: "rbac.authorization.k8s.io".to_owned(),
                version: "v1".to_owned(),
                resource: "clusterroles".to_owned(),
                name: Some("system:nodes".to_owned()),
                ..ResourcePath::default()
            }))
        );
    }

    #[test]
    fn namespaces_segment_is_a_scope_only_before_a_namespaced_resource() {
        assert_eq!(
            info("/api/v1/namespaces/x"),
            resource("", None, "namespaces", Some("x"), None)
        );
        assert_eq!(
            info("/api/v1/namespaces/x/status"),
            resource("", None, "namespaces", Some("x"), Some("status"))
        );
        assert_eq!(
            info("/api/v1/namespaces/x/finalize"),
            resource("", None, "namespaces", Some("x"), Some("finalize"))
        );
        assert_eq!(
            info("/api/v1/nodes/n1/status"),
            resource("", None, "nodes", Some("n1"), Some("status"))
        );
    }

    #[test]
    fn reads_subresources() {
        assert_eq!(
            info("/apis/apps/v1/namespaces/x/deployments/web/scale"),
            resource("apps", Some("x"), "deployments", Some("web"), Some("scale"))
        );
        assert_eq!(
            info("/api/v1/namespaces/x/pods/web/log"),
            resource("", Some("x"), "pods", Some("web"), Some("log"))
        );
        assert_eq!(
            info("/api/v1/namespaces/x/pods/web/status/more"),
            RequestInfo::Resource(None),
            "nothing is deeper than a subresource"
        );
    }

    #[test]
    fn watches_are_asked_by_query_and_paths_under_watch_are_no_resource_of_theirs() {
        let uri: axum::http::Uri = "/api/v1/namespaces/x/pods?watch=true".parse().unwrap();
        assert_eq!(
            info(uri.path()),
            resource("", Some("x"), "pods", None, None)
        );
        let query = Query::parse(uri.query()).unwrap();
        assert_eq!(verb(&Method::GET, false, query.watch), Some("watch"));
        assert!(is_long_running(&uri));
        // The deprecated `/watch/` prefix runs long, but is read as a resource called
        // `watch`, which no group serves: a 404.
        let uri: axum::http::Uri = "/api/v1/watch/namespaces/x/pods".parse().unwrap();
        assert!(is_long_running(&uri));
        assert_eq!(
            info(uri.path()),
            resource("", None, "watch", Some("namespaces"), Some("x"))
        );
        assert!(!is_long_running(&"/api/v1/pods".parse().unwrap()));
    }

    #[test]
    fn reads_discovery_and_non_resource_paths() {
        let non = RequestInfo::NonResource;
        assert_eq!(info("/api"), non(NonResourcePath::ApiVersions));
        assert_eq!(info("/apis/"), non(NonResourcePath::ApiGroupList));
        assert_eq!(
            info("/apis/apps"),
            non(NonResourcePath::ApiGroup("apps".to_owned()))
        );
        assert_eq!(
            info("/api/v1"),
            non(NonResourcePath::ApiResourceList {
                group: String::new(),
                version: "v1".to_owned()
            })
        );
        assert_eq!(
            info("/apis/apps/v1"),
            non(NonResourcePath::ApiResourceList {
                group: "apps".to_owned(),
                version: "v1".to_owned()
            })
        );
        assert_eq!(
            info("/openapi/v3/apis/apps/v1"),
            non(NonResourcePath::OpenApi(
                ["v3", "apis", "apps", "v1"].map(str::to_owned).to_vec()
            ))
        );
        assert_eq!(
            info("/swagger-2.0.0.pb-v1"),
            non(NonResourcePath::SwaggerProtobuf)
        );
        assert_eq!(info("/metrics"), non(NonResourcePath::Metrics));
        assert_eq!(info("/metrics/"), non(NonResourcePath::Unknown));
        assert_eq!(info("/api/v2/pods"), non(NonResourcePath::Unknown));
        assert_eq!(info("/"), non(NonResourcePath::Unknown));
        assert!(!info("/apis/apps/v1").is_resource_request());
        assert!(info("/apis/apps/v1/deployments").is_resource_request());
        assert!(info("/apis/apps/v1/a/b/c/d/e/f").is_resource_request());
    }

    #[test]
    fn a_path_fits_its_resource_by_scope_and_subresource() {
        let builtins = trellis_api::registry::builtins();
        let find = |plural: &str| {
            builtins
                .iter()
                .find(|r| r.group.is_empty() && r.plural == plural)
                .unwrap()
                .clone()
        };
        let (pods, nodes) = (find("pods"), find("nodes"));
        let path = |info: RequestInfo| match info {
            RequestInfo::Resource(Some(path)) => path,
            other => panic!("not a resource path: {other:?}"),
        };
        let fits = |p: &str, r: &ResourceInfo| path(info(p)).subresource_of(r);
        assert_eq!(fits("/api/v1/namespaces/x/pods/a", &pods), Some(None));
        assert_eq!(
            fits("/api/v1/pods", &pods),
            Some(None),
            "listed across namespaces"
        );
        assert_eq!(
            fits("/api/v1/pods/a", &pods),
            None,
            "a name needs a namespace"
        );
        assert_eq!(
            fits("/api/v1/namespaces/x/pods/a/binding", &pods),
            Some(Some(Subresource::Binding))
        );
        assert_eq!(fits("/api/v1/namespaces/x/pods/a/scale", &pods), None);
        assert_eq!(fits("/api/v1/namespaces/x/pods/a/nothing", &pods), None);
        assert_eq!(
            fits("/api/v1/nodes/a/status", &nodes),
            Some(Some(Subresource::Status))
        );
        // A node proxy's path goes on past the subresource, however long.
        assert_eq!(
            fits("/api/v1/nodes/a/proxy/containerLogs/x/p/c", &nodes),
            Some(Some(Subresource::Proxy))
        );
        assert_eq!(fits("/api/v1/namespaces/x/pods/a/proxy", &pods), None);
        let mut in_namespace = path(info("/api/v1/nodes/a"));
        in_namespace.namespace = Some("x".to_owned());
        assert_eq!(in_namespace.subresource_of(&nodes), None);
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
