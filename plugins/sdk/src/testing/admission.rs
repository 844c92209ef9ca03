//! The host of admission plugins and initializers, played natively: [`Harness`]
//! and the [`Admission`] it answers with.

use std::{cell::RefCell, collections::BTreeSet, rc::Rc};

use serde_json::Value;

use super::request::{kind_and_resource, meta};
use crate::{
    GroupVersionResource, Initialize, InitializeRequest, Mutate, Request, Status, Validate,
    imports::{Host, Level, format_record, with_host},
    plugin::{self, AdmissionResponse},
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

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::json;

    use super::*;
    use crate::testing::{create, delete, update};
    use crate::{Operation, Patch, Verdict, cluster, log};

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
}
