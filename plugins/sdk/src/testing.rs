//! Run a plugin's logic natively, in ordinary `#[test]`s.
//!
//! The [`Harness`] holds what the host would provide: the configuration, the
//! objects the `cluster` import serves, and a log that records what the plugin
//! writes. Each call goes through the same code as a component's export (decode
//! and check the configuration, run the trait method, encode the answer).
//!
//! ```
//! use serde::Deserialize;
//! use trellis_plugin::{Mutate, Patch, Request, Status, json, testing};
//!
//! #[derive(Deserialize)]
//! struct Owner { owner: String }
//!
//! impl Mutate for Owner {
//!     fn mutate(&self, req: &Request) -> Result<Option<Patch>, Status> {
//!         let object = req.object().ok_or_else(|| Status::bad_request("no object"))?;
//!         Ok(Some(Patch::new().set_label(object, "owner", &self.owner)))
//!     }
//! }
//!
//! let harness = testing::Harness::new().with_configuration(json!({"owner": "ana"}));
//! let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "a"}});
//! let admission = harness.mutate::<Owner>(testing::create(pod).user("bob", &["dev"]));
//! assert!(admission.is_allowed());
//! assert_eq!(admission.patched_object()["metadata"]["labels"]["owner"], "ana");
//! ```

use std::{cell::RefCell, collections::BTreeSet, rc::Rc};

use serde_json::Value;

use crate::{
    GroupVersionKind, GroupVersionResource, Initialize, InitializeRequest, Mutate, Operation,
    Request, Status, UserInfo, Validate,
    imports::{Host, Level, format_record, with_host},
    plugin::{self, AdmissionResponse},
    request::Json,
};

/// One record the plugin logged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogRecord {
    pub level: Level,
    pub message: String,
    pub fields: Vec<(String, String)>,
}

/// The host, played natively: configuration, cluster objects, captured logs.
#[derive(Clone)]
pub struct Harness {
    configuration: String,
    cluster: Rc<Cluster>,
    logs: Rc<RefCell<Vec<LogRecord>>>,
}

#[derive(Clone, Default)]
struct Cluster {
    granted: bool,
    objects: Vec<(GroupVersionResource, Value)>,
}

impl Default for Harness {
    fn default() -> Self {
        Self::new()
    }
}

impl Harness {
    /// Configuration `{}`, an empty cluster that the plugin may read.
    pub fn new() -> Self {
        Self {
            configuration: "{}".into(),
            cluster: Rc::new(Cluster {
                granted: true,
                objects: Vec::new(),
            }),
            logs: Rc::default(),
        }
    }

    /// The plugin's configuration (`spec.configuration` of its Plugin object).
    pub fn with_configuration(mut self, configuration: Value) -> Self {
        self.configuration = configuration.to_string();
        self
    }

    /// An object the `cluster` import serves under `resource`; its namespace and
    /// name come from its metadata.
    pub fn with_cluster_object(mut self, resource: GroupVersionResource, object: Value) -> Self {
        Rc::make_mut(&mut self.cluster)
            .objects
            .push((resource, object));
        self
    }

    /// Every `cluster` call fails, as without `spec.capabilities.clusterRead`.
    pub fn without_cluster_read(mut self) -> Self {
        Rc::make_mut(&mut self.cluster).granted = false;
        self
    }

    /// What the plugin logged so far (each record is also printed to stderr, which
    /// the test runner shows for failing tests).
    pub fn logs(&self) -> Vec<LogRecord> {
        self.logs.borrow().clone()
    }

    /// `validate-configuration` of a validating plugin.
    pub fn validate_configuration<T: Validate>(&self) -> Result<(), String> {
        self.run(|| plugin::configure::<T>(&self.configuration, T::check_configuration).map(drop))
    }

    /// `validate-configuration` of a mutating plugin.
    pub fn mutate_configuration<T: Mutate>(&self) -> Result<(), String> {
        self.run(|| plugin::configure::<T>(&self.configuration, T::check_configuration).map(drop))
    }

    /// `validate-configuration` of an initializer.
    pub fn initializer_configuration<T: Initialize>(&self) -> Result<(), String> {
        self.run(|| plugin::configure::<T>(&self.configuration, T::check_configuration).map(drop))
    }

    /// `admit` of a validating plugin.
    pub fn validate<T: Validate>(&self, req: impl Into<Request>) -> Admission {
        let req = req.into();
        let response = self.run(|| plugin::admit_validating::<T>(&req, &self.configuration));
        Admission::new(req, response, false)
    }

    /// `admit` of a mutating plugin.
    pub fn mutate<T: Mutate>(&self, req: impl Into<Request>) -> Admission {
        let req = req.into();
        let response = self.run(|| plugin::admit_mutating::<T>(&req, &self.configuration));
        Admission::new(req, response, true)
    }

    /// `initialize` of an initializer: the object it would store.
    pub fn initialize<T: Initialize>(&self, object: Value) -> Result<Value, String> {
        let (kind, resource) = kind_and_resource(&object);
        let req = InitializeRequest { kind, resource };
        let out =
            self.run(|| plugin::initialize::<T>(&req, &object.to_string(), &self.configuration))?;
        serde_json::from_str(&out).map_err(|e| format!("the plugin returned invalid JSON: {e}"))
    }

    fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        with_host(Rc::new(self.clone()), f)
    }
}

impl Host for Harness {
    fn log(&self, level: Level, message: &str, fields: &[(&str, &str)]) {
        eprintln!("{}", format_record(level, message, fields));
        self.logs.borrow_mut().push(LogRecord {
            level,
            message: message.into(),
            fields: fields
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
        });
    }

    fn get(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<String>, String> {
        if !self.cluster.granted {
            return Err(NOT_GRANTED.into());
        }
        Ok(self
            .cluster
            .objects
            .iter()
            .find(|(r, o)| {
                r == resource && meta(o, "namespace") == namespace && meta(o, "name") == Some(name)
            })
            .map(|(_, o)| o.to_string()))
    }

    fn list(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        label_selector: &str,
    ) -> Result<Vec<String>, String> {
        if !self.cluster.granted {
            return Err(NOT_GRANTED.into());
        }
        let selector = Selector::parse(label_selector)?;
        Ok(self
            .cluster
            .objects
            .iter()
            .filter(|(r, o)| {
                r == resource
                    && (namespace.is_none() || meta(o, "namespace") == namespace)
                    && selector.matches(o.pointer("/metadata/labels"))
            })
            .map(|(_, o)| o.to_string())
            .collect())
    }
}

const NOT_GRANTED: &str =
    "cluster reads are not granted to this plugin (spec.capabilities.clusterRead)";

fn meta<'a>(object: &'a Value, field: &str) -> Option<&'a str> {
    object.get("metadata")?.get(field)?.as_str()
}

/// A label selector in Kubernetes syntax: `a=b`, `a==b`, `a!=b`, `a`, `!a`,
/// `a in (x,y)`, `a notin (x,y)`, joined by commas.
struct Selector(Vec<Requirement>);

enum Requirement {
    Exists(String),
    Absent(String),
    In(String, BTreeSet<String>),
    NotIn(String, BTreeSet<String>),
}

impl Selector {
    fn parse(text: &str) -> Result<Self, String> {
        let mut terms = Vec::new();
        let (mut depth, mut start) = (0, 0);
        for (i, c) in text.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    terms.push(&text[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        terms.push(&text[start..]);
        let bad = |t: &str| format!("invalid label selector term {t:?}");
        let mut out = Vec::new();
        for term in terms.into_iter().map(str::trim).filter(|t| !t.is_empty()) {
            let set = |rest: &str| -> Result<BTreeSet<String>, String> {
                let inner = rest
                    .trim()
                    .strip_prefix('(')
                    .and_then(|r| r.strip_suffix(')'))
                    .ok_or_else(|| bad(term))?;
                Ok(inner.split(',').map(|v| v.trim().to_owned()).collect())
            };
            let one = |v: &str| BTreeSet::from([v.trim().to_owned()]);
            let req = if let Some((k, v)) = term.split_once("!=") {
                Requirement::NotIn(k.trim().into(), one(v))
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                Requirement::In(k.trim().into(), one(v))
            } else if let Some((k, rest)) = term.split_once(" notin ") {
                Requirement::NotIn(k.trim().into(), set(rest)?)
            } else if let Some((k, rest)) = term.split_once(" in ") {
                Requirement::In(k.trim().into(), set(rest)?)
            } else if let Some(k) = term.strip_prefix('!') {
                Requirement::Absent(k.trim().into())
            } else if !term.contains([' ', '(', ')']) {
                Requirement::Exists(term.into())
            } else {
                return Err(bad(term));
            };
            out.push(req);
        }
        Ok(Self(out))
    }

    fn matches(&self, labels: Option<&Value>) -> bool {
        let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Exists(k) => label(k).is_some(),
            Requirement::Absent(k) => label(k).is_none(),
            Requirement::In(k, vs) => label(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => label(k).is_none_or(|v| !vs.contains(v)),
        })
    }
}

/// What an admission plugin answered, with helpers to assert on it.
#[derive(Debug)]
pub struct Admission {
    request: Request,
    /// The answer exactly as the host would receive it.
    pub response: AdmissionResponse,
}

impl Admission {
    fn new(request: Request, response: AdmissionResponse, mutating: bool) -> Self {
        assert!(
            mutating || response.patch.is_none(),
            "a validating plugin returned a patch; the host fails such requests"
        );
        Self { request, response }
    }

    pub fn is_allowed(&self) -> bool {
        self.response.allowed
    }

    /// The denial, when denied.
    pub fn status(&self) -> Option<&Status> {
        self.response.status.as_ref()
    }

    /// The denial's message (what `kubectl` prints after `admission webhook ... denied`).
    pub fn message(&self) -> Option<&str> {
        self.status().map(|s| s.message.as_str())
    }

    pub fn warnings(&self) -> &[String] {
        &self.response.warnings
    }

    /// The patch as JSON, when there is one.
    pub fn patch(&self) -> Option<Value> {
        self.response.patch.as_deref().map(|p| {
            serde_json::from_str(p)
                .unwrap_or_else(|e| panic!("the plugin's patch is not JSON: {e}: {p}"))
        })
    }

    /// The request's object with the patch applied (unchanged without a patch).
    /// Panics, naming the failure, when the patch does not apply.
    pub fn patched_object(&self) -> Value {
        let object = self.request.object().cloned().unwrap_or(Value::Null);
        let Some(patch) = self.patch() else {
            return object;
        };
        let patch: json_patch::Patch = serde_json::from_value(patch.clone())
            .unwrap_or_else(|e| panic!("not an RFC 6902 patch: {e}: {patch}"));
        let mut out = object;
        json_patch::patch(&mut out, &patch)
            .unwrap_or_else(|e| panic!("the patch does not apply: {e}: {patch:#}"));
        out
    }
}

/// A JSON file, read relative to the package (where `cargo test` runs tests), e.g.
/// `fixture("testdata/pod.json")`. Panics with the path when it cannot.
pub fn fixture(path: &str) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read fixture {path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("fixture {path} is not JSON: {e}"))
}

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
fn kind_and_resource(object: &Value) -> (GroupVersionKind, GroupVersionResource) {
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

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::json;

    use super::*;
    use crate::{Patch, Verdict, cluster, log};

    fn pod(labels: Value) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web", "namespace": "prod", "labels": labels},
            "spec": {"containers": [{"name": "app", "image": "nginx:1.27"}]}
        })
    }

    #[derive(Deserialize)]
    struct NamespaceMustExist {
        #[serde(default)]
        team_label: Option<String>,
    }

    impl Validate for NamespaceMustExist {
        fn check_configuration(&self) -> Result<(), String> {
            match self.team_label.as_deref() {
                Some("") => Err("team_label must not be empty".into()),
                _ => Ok(()),
            }
        }

        fn validate(&self, req: &Request) -> Result<Verdict, Status> {
            let ns = req.namespace.as_deref().unwrap_or_default();
            let namespaces = GroupVersionResource::new("", "v1", "namespaces");
            let found = cluster::get(&namespaces, None, ns).map_err(Status::internal)?;
            log::with_fields(
                log::Level::Info,
                "looked up",
                &[("namespace", ns), ("user", &req.user_info.username)],
            );
            Ok(match found {
                Some(_) => Verdict::allow()
                    .warn(format!("{} by {}", req.operation, req.user_info.username)),
                None => Verdict::deny(format!("namespace {ns} does not exist")),
            })
        }
    }

    #[test]
    fn validates_with_cluster_fixtures_and_captures_logs() {
        let namespaces = GroupVersionResource::new("", "v1", "namespaces");
        let h =
            Harness::new().with_cluster_object(namespaces, json!({"metadata": {"name": "prod"}}));

        let ok = h.validate::<NamespaceMustExist>(create(pod(json!({}))).user("ana", &["dev"]));
        assert!(ok.is_allowed());
        assert_eq!(ok.warnings(), ["CREATE by ana"]);

        let missing = h.validate::<NamespaceMustExist>(create(pod(json!({}))).namespace("qa"));
        assert!(!missing.is_allowed());
        assert_eq!(missing.message(), Some("namespace qa does not exist"));
        assert_eq!(missing.status().unwrap().code, 403);

        let logs = h.logs();
        assert_eq!(logs.len(), 2);
        assert_eq!(
            logs[0].fields,
            [
                ("namespace".to_owned(), "prod".to_owned()),
                ("user".into(), "ana".into())
            ]
        );
        assert_eq!(logs[1].level, Level::Info);
    }

    #[test]
    fn cluster_errors_surface_without_the_grant() {
        let h = Harness::new().without_cluster_read();
        let denied = h.validate::<NamespaceMustExist>(create(pod(json!({}))));
        assert_eq!(denied.status().map(|s| s.code), Some(500));
        assert!(denied.message().unwrap().contains("clusterRead"));
    }

    #[test]
    fn configuration_is_checked() {
        let bad = Harness::new().with_configuration(json!({"team_label": ""}));
        assert_eq!(
            bad.validate_configuration::<NamespaceMustExist>(),
            Err("configuration: team_label must not be empty".into())
        );
        let wrong_type = Harness::new().with_configuration(json!({"team_label": 7}));
        assert!(
            wrong_type
                .validate_configuration::<NamespaceMustExist>()
                .unwrap_err()
                .contains("invalid type")
        );
        assert!(
            Harness::new()
                .validate_configuration::<NamespaceMustExist>()
                .is_ok()
        );
    }

    #[test]
    fn lists_filter_by_namespace_and_selector() {
        let pods = GroupVersionResource::new("", "v1", "pods");
        let h = Harness::new()
            .with_cluster_object(pods.clone(), pod(json!({"app": "web", "tier": "front"})))
            .with_cluster_object(
                pods.clone(),
                json!({"metadata": {"name": "db", "namespace": "prod", "labels": {"app": "db"}}}),
            )
            .with_cluster_object(
                pods.clone(),
                json!({"metadata": {"name": "x", "namespace": "qa", "labels": {"app": "web"}}}),
            );
        let names = |ns: Option<&str>, sel: &str| -> Vec<String> {
            h.run(|| cluster::list(&pods, ns, sel))
                .unwrap()
                .iter()
                .map(|o| o["metadata"]["name"].as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(names(None, ""), ["web", "db", "x"]);
        assert_eq!(names(Some("prod"), ""), ["web", "db"]);
        assert_eq!(names(None, "app=web"), ["web", "x"]);
        assert_eq!(names(None, "app==web,tier"), ["web"]);
        assert_eq!(names(None, "app!=web"), ["db"]);
        assert_eq!(names(None, "!tier"), ["db", "x"]);
        assert_eq!(
            names(None, "app in (db, web),tier notin (back)"),
            ["web", "db", "x"]
        );
        assert_eq!(names(None, "app notin (web)"), ["db"]);
        assert!(h.run(|| cluster::list(&pods, None, "app in web")).is_err());
    }

    #[cfg(feature = "k8s-openapi")]
    #[test]
    fn typed_cluster_reads_take_the_resource_from_the_type() {
        use crate::k8s::api::core::v1::{ConfigMap, Namespace};

        let h = Harness::new()
            .with_cluster_object(
                GroupVersionResource::new("", "v1", "namespaces"),
                json!({"metadata": {"name": "prod", "labels": {"tier": "1"}}}),
            )
            .with_cluster_object(
                GroupVersionResource::new("", "v1", "configmaps"),
                json!({"metadata": {"name": "c", "namespace": "prod"}, "data": {"k": "v"}}),
            );
        let ns = h
            .run(|| cluster::typed::get::<Namespace>(None, "prod"))
            .unwrap()
            .unwrap();
        assert_eq!(ns.metadata.labels.unwrap()["tier"], "1");
        let cms = h
            .run(|| cluster::typed::list::<ConfigMap>(Some("prod"), ""))
            .unwrap();
        assert_eq!(cms[0].data.as_ref().unwrap()["k"], "v");
        assert!(
            h.run(|| cluster::typed::get::<ConfigMap>(Some("qa"), "c"))
                .unwrap()
                .is_none()
        );
    }

    #[derive(Deserialize)]
    struct Label {
        key: String,
    }

    impl Mutate for Label {
        fn mutate(&self, req: &Request) -> Result<Option<Patch>, Status> {
            if req.operation == Operation::Delete {
                return Ok(None);
            }
            let object = req
                .object()
                .ok_or_else(|| Status::bad_request("no object"))?;
            Ok(Some(Patch::new().set_label(object, &self.key, "yes")))
        }
    }

    #[test]
    fn mutations_apply_to_the_object() {
        let h = Harness::new().with_configuration(json!({"key": "example.com/seen"}));
        let a = h.mutate::<Label>(update(pod(json!({"app": "web"})), pod(json!({}))));
        assert!(a.is_allowed());
        assert_eq!(
            a.patch().unwrap()[0]["path"],
            "/metadata/labels/example.com~1seen"
        );
        assert_eq!(
            a.patched_object()["metadata"]["labels"],
            json!({"app": "web", "example.com/seen": "yes"})
        );

        let none = h.mutate::<Label>(delete(pod(json!({}))));
        assert_eq!(none.patch(), None);
        assert_eq!(none.patched_object(), Value::Null);

        let already = h.mutate::<Label>(create(pod(json!({"example.com/seen": "yes"}))));
        assert_eq!(
            already.response.patch, None,
            "an empty patch is sent as none"
        );
    }

    #[derive(Deserialize)]
    struct Stamp {}

    impl Initialize for Stamp {
        fn initialize(&self, object: Value, req: &InitializeRequest) -> Result<Value, String> {
            let patch = Patch::new().set_annotation(&object, "kind", &req.kind.kind);
            patch.apply(&object)
        }
    }

    #[test]
    fn initializers_return_the_object() {
        let out = Harness::new().initialize::<Stamp>(pod(json!({}))).unwrap();
        assert_eq!(out["metadata"]["annotations"]["kind"], "Pod");
        assert_eq!(out["spec"], pod(json!({}))["spec"]);
    }

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

/// A controller's host, played natively: an in-memory cache the reconcile reads, the
/// writes it makes (applied to that cache, so a second reconcile sees the first's),
/// and the events it records.
///
/// ```
/// use serde::Deserialize;
/// use trellis_plugin::controller::{Action, ObjectKey, Reconcile, Write, cache, client};
/// use trellis_plugin::testing::ControllerHarness;
/// use trellis_plugin::{GroupVersionResource, json};
///
/// #[derive(Deserialize)]
/// struct Touch {}
///
/// impl Reconcile for Touch {
///     fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
///         if cache::get(&key.resource, key.namespace.as_deref(), &key.name)?.is_some() {
///             client::create(&key.resource, key.namespace.as_deref(),
///                 json!({"metadata": {"name": format!("{}-touched", key.name)}}))?;
///         }
///         Ok(Action::Done)
///     }
/// }
///
/// let maps = GroupVersionResource { group: "".into(), version: "v1".into(), resource: "configmaps".into() };
/// let harness = ControllerHarness::new()
///     .with_object(maps.clone(), json!({"metadata": {"name": "a", "namespace": "ns"}}));
/// assert_eq!(harness.reconcile::<Touch>(&maps, Some("ns"), "a"), Ok(Action::Done));
/// assert!(matches!(&harness.writes()[0], Write::Create { .. }));
/// assert!(harness.object(&maps, Some("ns"), "a-touched").is_some());
/// ```
#[derive(Clone, Default)]
pub struct ControllerHarness {
    configuration: Option<String>,
    state: Rc<RefCell<ControllerState>>,
}

#[derive(Default)]
struct ControllerState {
    /// What serves each kind: `(apiVersion, kind)`.
    kinds: Vec<(String, String, crate::controller::ServedResource)>,
    /// By `group/version/resource`, then `namespace/name`.
    objects: std::collections::BTreeMap<String, std::collections::BTreeMap<String, Value>>,
    writes: Vec<crate::controller::Write>,
    events: Vec<(String, String)>,
    uids: u64,
}

fn gvr_key(r: &GroupVersionResource) -> String {
    format!("{}/{}/{}", r.group, r.version, r.resource)
}

fn object_key(namespace: Option<&str>, name: &str) -> String {
    format!("{}/{name}", namespace.unwrap_or_default())
}

fn labels_match(selector: &str, labels: &Value) -> bool {
    selector
        .split(',')
        .filter(|s| !s.is_empty())
        .all(|req| match req.split_once('=') {
            Some((k, v)) => labels[k.trim()] == v.trim(),
            None => labels.get(req.trim()).is_some(),
        })
}

impl ControllerHarness {
    /// Configuration `{}`, an empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The controller's configuration.
    pub fn with_configuration(mut self, configuration: Value) -> Self {
        self.configuration = Some(configuration.to_string());
        self
    }

    /// Says which resource serves `kind` of `api_version` (what `cache::resource_of`
    /// and `cache::resources` answer).
    pub fn with_kind(
        self,
        api_version: &str,
        kind: &str,
        resource: GroupVersionResource,
        namespaced: bool,
    ) -> Self {
        self.state.borrow_mut().kinds.push((
            api_version.to_owned(),
            kind.to_owned(),
            crate::controller::ServedResource {
                resource,
                namespaced,
            },
        ));
        self
    }

    /// An object in the cache (its namespace and name from its metadata).
    pub fn with_object(self, resource: GroupVersionResource, object: Value) -> Self {
        self.put(&resource, object);
        self
    }

    fn put(&self, resource: &GroupVersionResource, mut object: Value) -> Value {
        let mut state = self.state.borrow_mut();
        if object["metadata"]["uid"].is_null() {
            state.uids += 1;
            object["metadata"]["uid"] = Value::String(format!("uid-{}", state.uids));
        }
        let key = object_key(
            object["metadata"]["namespace"].as_str(),
            object["metadata"]["name"].as_str().unwrap_or_default(),
        );
        state
            .objects
            .entry(gvr_key(resource))
            .or_default()
            .insert(key, object.clone());
        object
    }

    /// Calls `reconcile` for one key, as the host does (configuration checked first).
    pub fn reconcile<T: crate::controller::Reconcile>(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<crate::controller::Action, String> {
        let key = crate::controller::ObjectKey {
            resource: resource.clone(),
            namespace: namespace.map(str::to_owned),
            name: name.to_owned(),
        };
        let configuration = self.configuration.clone().unwrap_or_else(|| "{}".into());
        crate::controller::with_controller_host(Rc::new(self.clone()), || {
            crate::__private::reconcile::<T>(&key, &configuration)
        })
    }

    /// The object as the cache now holds it.
    pub fn object(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<Value> {
        self.state
            .borrow()
            .objects
            .get(&gvr_key(resource))?
            .get(&object_key(namespace, name))
            .cloned()
    }

    /// Every write so far, in order.
    pub fn writes(&self) -> Vec<crate::controller::Write> {
        self.state.borrow().writes.clone()
    }

    /// Every event so far: `(reason, message)`.
    pub fn events(&self) -> Vec<(String, String)> {
        self.state.borrow().events.clone()
    }

    /// Applies one write to the cache: creates and updates store the object, merge
    /// and apply patches merge into it (RFC 7386), deletes remove it.
    fn apply(
        &self,
        write: &crate::controller::Write,
    ) -> Result<Value, crate::controller::ApiError> {
        use crate::controller::{ApiError, PatchType, Write};
        let not_found = |name: &str| ApiError {
            code: 404,
            reason: "NotFound".into(),
            message: format!("{name:?} not found"),
            causes: Vec::new(),
        };
        match write {
            Write::Create {
                resource,
                namespace,
                object,
            }
            | Write::Update {
                resource,
                namespace,
                object,
                ..
            } => {
                let mut object = object.clone();
                if let Some(ns) = namespace {
                    object["metadata"]["namespace"] = Value::String(ns.clone());
                }
                Ok(self.put(resource, object))
            }
            Write::Patch {
                resource,
                namespace,
                name,
                patch_type,
                patch,
                ..
            } => {
                let existing = self.object(resource, namespace.as_deref(), name);
                let mut object = match (existing, patch_type) {
                    (Some(o), _) => o,
                    (None, PatchType::Apply) => serde_json::json!({"metadata": {"name": name}}),
                    (None, _) => return Err(not_found(name)),
                };
                match patch_type {
                    // RFC 6902, applied as the API server applies it.
                    PatchType::Json => {
                        let ops: json_patch::Patch = serde_json::from_value(patch.clone())
                            .map_err(|e| ApiError {
                                code: 400,
                                reason: "BadRequest".into(),
                                message: format!("not a JSON patch: {e}"),
                                causes: Vec::new(),
                            })?;
                        json_patch::patch(&mut object, &ops).map_err(|e| ApiError {
                            code: 422,
                            reason: "Invalid".into(),
                            message: e.to_string(),
                            causes: Vec::new(),
                        })?;
                    }
                    // Strategic merge and apply patches are merged as JSON merge
                    // patches here: list merge keys and directives are not followed.
                    _ => json_patch::merge(&mut object, patch),
                }
                object["metadata"]["name"] = Value::String(name.clone());
                if let Some(ns) = namespace {
                    object["metadata"]["namespace"] = Value::String(ns.clone());
                }
                Ok(self.put(resource, object))
            }
            Write::Delete {
                resource,
                namespace,
                name,
                ..
            } => self
                .state
                .borrow_mut()
                .objects
                .get_mut(&gvr_key(resource))
                .and_then(|m| m.remove(&object_key(namespace.as_deref(), name)))
                .ok_or_else(|| not_found(name)),
        }
    }
}

impl crate::controller::ControllerHost for ControllerHarness {
    fn resource_of(
        &self,
        api_version: &str,
        kind: &str,
    ) -> Option<crate::controller::ServedResource> {
        self.state
            .borrow()
            .kinds
            .iter()
            .find(|(v, k, _)| v == api_version && k == kind)
            .map(|(_, _, r)| r.clone())
    }

    fn resources(&self) -> Vec<crate::controller::ServedResource> {
        self.state
            .borrow()
            .kinds
            .iter()
            .map(|(_, _, r)| r.clone())
            .collect()
    }

    fn dependents(&self, owner_uid: &str) -> Result<Vec<String>, String> {
        let state = self.state.borrow();
        let kind_of = |resource: &str| {
            state
                .kinds
                .iter()
                .find(|(_, _, r)| gvr_key(&r.resource) == resource)
                .map(|(v, k, _)| (v.clone(), k.clone()))
        };
        Ok(state
            .objects
            .iter()
            .flat_map(|(resource, objects)| {
                let kind = kind_of(resource);
                objects.values().filter_map(move |o| {
                    let owned = o["metadata"]["ownerReferences"]
                        .as_array()
                        .is_some_and(|refs| refs.iter().any(|r| r["uid"] == owner_uid));
                    let (api_version, kind) = kind.clone()?;
                    owned.then(|| {
                        let mut o = o.clone();
                        o["apiVersion"] = Value::String(api_version);
                        o["kind"] = Value::String(kind);
                        o.to_string()
                    })
                })
            })
            .collect())
    }

    fn get(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<String>, String> {
        Ok(self
            .object(resource, namespace, name)
            .map(|o| o.to_string()))
    }

    fn list(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        label_selector: &str,
    ) -> Result<Vec<String>, String> {
        let state = self.state.borrow();
        Ok(state
            .objects
            .get(&gvr_key(resource))
            .into_iter()
            .flat_map(|m| m.values())
            .filter(|o| namespace.is_none_or(|ns| o["metadata"]["namespace"] == ns))
            .filter(|o| labels_match(label_selector, &o["metadata"]["labels"]))
            .map(Value::to_string)
            .collect())
    }

    fn owned_by(
        &self,
        resource: &GroupVersionResource,
        owner_uid: &str,
    ) -> Result<Vec<String>, String> {
        let state = self.state.borrow();
        Ok(state
            .objects
            .get(&gvr_key(resource))
            .into_iter()
            .flat_map(|m| m.values())
            .filter(|o| {
                o["metadata"]["ownerReferences"]
                    .as_array()
                    .is_some_and(|refs| refs.iter().any(|r| r["uid"] == owner_uid))
            })
            .map(Value::to_string)
            .collect())
    }

    fn batch(
        &self,
        writes: Vec<crate::controller::Write>,
    ) -> Vec<Result<String, crate::controller::ApiError>> {
        writes
            .into_iter()
            .map(|w| {
                let result = self.apply(&w).map(|o| o.to_string());
                self.state.borrow_mut().writes.push(w);
                result
            })
            .collect()
    }

    fn record(
        &self,
        _object: &str,
        _event_type: crate::controller::EventType,
        reason: &str,
        message: &str,
    ) {
        self.state
            .borrow_mut()
            .events
            .push((reason.to_owned(), message.to_owned()));
    }
}
