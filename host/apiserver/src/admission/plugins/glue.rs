//! The plugins in the server's chains: admission (mutating, then validating after
//! schema validation), initializers, and cluster reads for plugins granted them.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;
use trellis_api::ApiError;
use trellis_api::registry::ResourceInfo;
use trellis_api::selector::LabelSelector;
use trellis_api::status::Reason;
use trellis_plugin_host::{
    AdmissionRequest, ClusterReader, GroupVersionKind, GroupVersionResource, InitializeRequest,
    Operation, PluginError, PluginErrorKind, PluginKind, UserInfo,
};

use super::Cluster;
use super::{Bound, PluginManager};
use crate::admission::{Admission, Attributes, Initializer, InitializerSource};
use crate::object::{Object, metadata};
use trellis_plugins::spec::FailurePolicy;

/// Most objects one `cluster.list` call returns.
const MAX_LIST: usize = 10_000;

/// The mutating and validating plugins, as one step of the admission chain.
#[derive(Debug)]
pub struct PluginAdmission {
    manager: Arc<PluginManager>,
    /// Weak: the state holds the chains that hold this step.
    state: std::sync::OnceLock<std::sync::Weak<dyn Cluster>>,
}

impl PluginAdmission {
    pub fn new(manager: Arc<PluginManager>) -> Self {
        Self {
            manager,
            state: std::sync::OnceLock::new(),
        }
    }

    /// Whether `bound` judges this request: its rules, then its object and namespace
    /// selectors.
    async fn selects(
        &self,
        bound: &Bound,
        attrs: &Attributes<'_>,
        obj: Option<&Object>,
        old: Option<&Object>,
    ) -> bool {
        let parsed = &bound.parsed;
        if !parsed.matches_request(attrs.resource, attrs.subresource, attrs.operation) {
            return false;
        }
        let as_value = |o: Option<&Object>| o.map(|o| Value::Object(o.clone()));
        if parsed.object_selector.is_some()
            && !parsed.matches_object(as_value(obj).as_ref(), as_value(old).as_ref())
        {
            return false;
        }
        match &parsed.namespace_selector {
            None => true,
            // A deleted namespace is selected by its labels as stored.
            Some(selector) => self.namespace_matches(selector, attrs, obj.or(old)).await,
        }
    }

    async fn namespace_matches(
        &self,
        selector: &LabelSelector,
        attrs: &Attributes<'_>,
        obj: Option<&Object>,
    ) -> bool {
        if attrs.resource.group.is_empty() && attrs.resource.plural == "namespaces" {
            return obj.is_some_and(|o| selector.matches_object(&Value::Object(o.clone())));
        }
        let Some(ns) = attrs.namespace.filter(|_| attrs.resource.namespaced) else {
            // Cluster-scoped objects are not in a namespace to select.
            return true;
        };
        let Some(state) = self.state.get().and_then(std::sync::Weak::upgrade) else {
            return false;
        };
        let Ok(namespaces) = state.resource("", "v1", "namespaces") else {
            return false;
        };
        // Through the namespace lister: the watch cache's decoded object, not a store
        // read per plugin per request.
        match state.namespaces().get(&namespaces.key(None, ns)).await {
            Ok(Some(namespace)) => {
                let labels = namespace
                    .get("metadata")
                    .and_then(|m| m.get("labels"))
                    .and_then(Value::as_object);
                selector.matches(|key| labels.and_then(|l| l.get(key)).and_then(Value::as_str))
            }
            _ => false,
        }
    }

    /// Runs the plugins of `kind` on `obj`; returns the object as the mutating
    /// plugins' patches left it, `None` when none patched it.
    async fn run(
        &self,
        kind: PluginKind,
        attrs: &Attributes<'_>,
        obj: &Object,
        old: Option<&Object>,
    ) -> Result<Option<Object>, ApiError> {
        let active = self.manager.active();
        let chosen: Vec<&Arc<Bound>> = active.plugins.iter().filter(|b| b.kind() == kind).collect();
        if chosen.is_empty() {
            return Ok(None);
        }
        let host = self.manager.host().await.map_err(ApiError::internal)?;
        let deleting = attrs.operation == "DELETE";
        let mut request: Option<AdmissionRequest> = None;
        let mut patched: Option<Object> = None;
        for bound in chosen {
            let current = patched.as_ref().unwrap_or(obj);
            let (object, previous) = if deleting {
                (None, Some(current))
            } else {
                (Some(current), old)
            };
            if !self.selects(bound, attrs, object, previous).await {
                continue;
            }
            let req = request.get_or_insert_with(|| build_request(attrs, object, previous));
            req.configuration
                .clone_from(&bound.parsed.spec.configuration);
            let answer = match bound.plugin.admit(&host, req).await {
                Ok(answer) => answer,
                Err(e) => {
                    on_failure(bound, e)?;
                    continue;
                }
            };
            for w in &answer.warnings {
                crate::warnings::add(w.clone());
            }
            if !answer.allowed {
                return Err(denial(bound, answer.status.as_ref()));
            }
            if let Some(patch) = &answer.patch {
                if deleting {
                    // As Kubernetes: a delete has no object for a patch to change.
                    on_failure(
                        bound,
                        bound.plugin.error(PluginErrorKind::BadAnswer(
                            "a patch for a delete, which has no object to change".into(),
                        )),
                    )?;
                    continue;
                }
                match apply_patch(current, patch) {
                    Ok(next) => {
                        // Later plugins see the patched object.
                        patched = Some(next);
                        request = None;
                    }
                    Err(why) => {
                        on_failure(bound, bound.plugin.error(PluginErrorKind::BadAnswer(why)))?
                    }
                }
            }
        }
        Ok(patched)
    }
}

#[async_trait]
impl Admission for PluginAdmission {
    fn name(&self) -> &str {
        "Plugins"
    }

    fn attach(&self, state: &Arc<dyn Cluster>) {
        let _ = self.state.set(Arc::downgrade(state));
    }

    async fn mutate(
        &self,
        attrs: &Attributes<'_>,
        obj: &mut Object,
        old: Option<&Object>,
    ) -> Result<(), ApiError> {
        if let Some(patched) = self.run(PluginKind::Mutating, attrs, obj, old).await? {
            *obj = patched;
        }
        Ok(())
    }

    async fn validate(
        &self,
        attrs: &Attributes<'_>,
        obj: &Object,
        old: Option<&Object>,
    ) -> Result<(), ApiError> {
        // Validating plugins cannot patch (the host refuses their patches).
        self.run(PluginKind::Validating, attrs, obj, old)
            .await
            .map(drop)
    }
}

/// A plugin that failed: refused under `Fail`, recorded and skipped under `Ignore`.
fn on_failure(bound: &Bound, error: PluginError) -> Result<(), ApiError> {
    let message = error.to_string();
    match bound.failure_policy() {
        FailurePolicy::Fail => Err(match error.kind {
            PluginErrorKind::BadAnswer(_) => ApiError::bad_request(message),
            PluginErrorKind::Timeout(_) => ApiError::timeout(message),
            _ => ApiError::internal(message),
        }),
        FailurePolicy::Ignore => {
            tracing::warn!(plugin = %bound.plugin.name(), "{message} (failurePolicy Ignore: request goes on)");
            crate::warnings::add(format!("{message}; ignored (failurePolicy: Ignore)"));
            Ok(())
        }
    }
}

fn denial(bound: &Bound, status: Option<&trellis_plugin_host::Status>) -> ApiError {
    let name = bound.plugin.name();
    let (code, reason, message) = match status {
        Some(s) => (
            if (400..600).contains(&s.code) {
                s.code
            } else {
                403
            },
            reason_of(&s.reason),
            s.message.as_str(),
        ),
        None => (403, Reason::Forbidden, ""),
    };
    let message = if message.is_empty() {
        format!("admission plugin {name:?} denied the request")
    } else {
        format!("admission plugin {name:?} denied the request: {message}")
    };
    ApiError::new(code, reason, message)
}

fn reason_of(reason: &str) -> Reason {
    match reason {
        "BadRequest" => Reason::BadRequest,
        "Unauthorized" => Reason::Unauthorized,
        "NotFound" => Reason::NotFound,
        "AlreadyExists" => Reason::AlreadyExists,
        "Conflict" => Reason::Conflict,
        "Invalid" => Reason::Invalid,
        "TooManyRequests" => Reason::TooManyRequests,
        "InternalError" => Reason::InternalError,
        "Timeout" => Reason::Timeout,
        "ServiceUnavailable" => Reason::ServiceUnavailable,
        _ => Reason::Forbidden,
    }
}

/// Applies an RFC 6902 patch from a mutating plugin. The object's identity (apiVersion,
/// kind, name, namespace, uid) is not the plugin's to change.
fn apply_patch(obj: &Object, patch: &str) -> Result<Object, String> {
    let ops: json_patch::Patch =
        serde_json::from_str(patch).map_err(|e| format!("an invalid JSON Patch: {e}"))?;
    let mut value = Value::Object(obj.clone());
    json_patch::patch(&mut value, &ops).map_err(|e| format!("an invalid JSON Patch: {e}"))?;
    let Value::Object(patched) = value else {
        return Err("an invalid JSON Patch: the result is not an object".into());
    };
    for path in [
        &["apiVersion"][..],
        &["kind"],
        &["metadata", "name"],
        &["metadata", "namespace"],
        &["metadata", "uid"],
    ] {
        if field(obj, path) != field(&patched, path) {
            return Err(format!(
                "a JSON Patch that changes /{}, which plugins may not change",
                path.join("/")
            ));
        }
    }
    Ok(patched)
}

/// The value at `path` (field names from the root) of `obj`.
fn field<'a>(obj: &'a Object, path: &[&str]) -> Option<&'a Value> {
    let (first, rest) = path.split_first()?;
    rest.iter().try_fold(obj.get(*first)?, |v, k| v.get(*k))
}

fn build_request(
    attrs: &Attributes<'_>,
    obj: Option<&Object>,
    old: Option<&Object>,
) -> AdmissionRequest {
    let res = attrs.resource;
    let json = |o: Option<&Object>| o.and_then(|o| serde_json::to_string(o).ok());
    AdmissionRequest {
        uid: uuid::Uuid::new_v4().to_string(),
        kind: GroupVersionKind {
            group: res.group.clone(),
            version: res.version.clone(),
            kind: res.kind.clone(),
        },
        resource: GroupVersionResource {
            group: res.group.clone(),
            version: res.version.clone(),
            resource: res.plural.clone(),
        },
        sub_resource: attrs.subresource.map(str::to_owned),
        name: attrs.name.to_owned(),
        namespace: attrs.namespace.map(str::to_owned),
        operation: match attrs.operation {
            "UPDATE" => Operation::Update,
            "DELETE" => Operation::Delete,
            "CONNECT" => Operation::Connect,
            _ => Operation::Create,
        },
        user_info: UserInfo {
            username: attrs.user.name.clone(),
            uid: attrs.user.uid.clone(),
            groups: attrs.user.groups.clone(),
            extra: Vec::new(),
        },
        object: json(obj),
        old_object: json(old),
        dry_run: attrs.dry_run,
        configuration: String::new(),
    }
}

/// The initializer plugins, offered to the initializer chain as they come and go.
#[derive(Debug)]
pub struct PluginInitializers(pub Arc<PluginManager>);

impl InitializerSource for PluginInitializers {
    fn initializers(&self) -> Vec<Arc<dyn Initializer>> {
        self.0
            .active()
            .plugins
            .iter()
            .filter(|b| b.kind() == PluginKind::Initializer)
            .map(|b| {
                Arc::new(PluginInitializer {
                    bound: b.clone(),
                    manager: self.0.clone(),
                }) as Arc<dyn Initializer>
            })
            .collect()
    }
}

#[derive(Debug)]
struct PluginInitializer {
    bound: Arc<Bound>,
    manager: Arc<PluginManager>,
}

#[async_trait]
impl Initializer for PluginInitializer {
    fn name(&self) -> &str {
        self.bound.plugin.name()
    }

    fn applies_to(&self, resource: &ResourceInfo) -> bool {
        self.bound.parsed.initializes(resource)
    }

    async fn initialize(&self, resource: &ResourceInfo, obj: Object) -> Result<Object, String> {
        let host = self.manager.host().await?;
        let request = InitializeRequest {
            kind: GroupVersionKind {
                group: resource.group.clone(),
                version: resource.version.clone(),
                kind: resource.kind.clone(),
            },
            resource: GroupVersionResource {
                group: resource.group.clone(),
                version: resource.version.clone(),
                resource: resource.plural.clone(),
            },
            object: serde_json::to_string(&obj).map_err(|e| e.to_string())?,
            configuration: self.bound.parsed.spec.configuration.clone(),
        };
        let outcome = match self.bound.plugin.initialize(&host, &request).await {
            Ok(Ok(text)) => check_initialized(&obj, &text)
                .map_err(|why| self.bound.plugin.error(PluginErrorKind::BadAnswer(why))),
            Ok(Err(reason)) => {
                return Err(format!("{}: {reason}", self.bound.plugin.label()));
            }
            Err(e) => Err(e),
        };
        match outcome {
            Ok(initialized) => Ok(initialized),
            Err(e) => match self.bound.failure_policy() {
                FailurePolicy::Fail => Err(e.to_string()),
                FailurePolicy::Ignore => {
                    tracing::warn!(plugin = %self.bound.plugin.name(), "{e} (failurePolicy Ignore: object left as it was)");
                    Ok(obj)
                }
            },
        }
    }
}

/// An initializer's answer must be the same object (name, namespace, uid).
fn check_initialized(before: &Object, text: &str) -> Result<Object, String> {
    let after: Object =
        serde_json::from_str(text).map_err(|e| format!("an object that is not JSON: {e}"))?;
    for field in ["name", "namespace", "uid"] {
        let a = metadata(before).and_then(|m| m.get(field));
        let b = metadata(&after).and_then(|m| m.get(field));
        if a != b {
            return Err(format!("an object whose metadata.{field} changed"));
        }
    }
    Ok(after)
}

/// Cluster reads for plugins granted them: one object or a filtered list, from the
/// watch cache's current state (uninitialized objects included). Reads cost no store
/// access and may lag a write by the time its event takes to reach the cache.
#[derive(Debug)]
pub struct StoreReader {
    /// Weak: loaded plugins hold their reader, and the state holds the plugins.
    state: std::sync::Weak<dyn Cluster>,
}

impl StoreReader {
    pub fn new(state: &Arc<dyn Cluster>) -> Self {
        Self {
            state: Arc::downgrade(state),
        }
    }

    fn state(&self) -> Result<Arc<dyn Cluster>, String> {
        self.state
            .upgrade()
            .ok_or_else(|| "the server is stopping".to_owned())
    }
}

#[async_trait]
impl ClusterReader for StoreReader {
    async fn get(
        &self,
        gvr: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<String>, String> {
        let state = self.state()?;
        let res = resource(&*state, gvr)?;
        Ok(state
            .cache()
            .get(&res.key(namespace, name))
            .map(|o| to_json(&o)))
    }

    async fn list(
        &self,
        gvr: &GroupVersionResource,
        namespace: Option<&str>,
        label_selector: &str,
    ) -> Result<Vec<String>, String> {
        let state = self.state()?;
        let res = resource(&*state, gvr)?;
        let selector = LabelSelector::parse(label_selector).map_err(|e| e.to_string())?;
        Ok(state
            .cache()
            .list(&res.namespace_prefix(namespace))
            .objects
            .iter()
            .filter(|o| {
                let labels = o
                    .get("metadata")
                    .and_then(|m| m.get("labels"))
                    .and_then(Value::as_object);
                selector.matches(|key| labels.and_then(|l| l.get(key)).and_then(Value::as_str))
            })
            .take(MAX_LIST)
            .map(|o| to_json(o))
            .collect())
    }
}

fn resource(state: &dyn Cluster, gvr: &GroupVersionResource) -> Result<ResourceInfo, String> {
    state
        .resource(&gvr.group, &gvr.version, &gvr.resource)
        .map_err(|e| e.message)
}

/// An object as the JSON text a plugin receives.
fn to_json(obj: &Object) -> String {
    serde_json::to_string(obj).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod() -> Object {
        let Value::Object(obj) = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web", "namespace": "prod", "uid": "u-1"},
            "spec": {"containers": [{"name": "app", "image": "nginx"}]},
        }) else {
            unreachable!()
        };
        obj
    }

    #[test]
    fn a_patch_changes_the_object_it_is_given() {
        let before = pod();
        let after = apply_patch(
            &before,
            r#"[{"op":"add","path":"/metadata/labels","value":{"team":"a"}}]"#,
        )
        .unwrap();
        assert_eq!(after["metadata"]["labels"], json!({"team": "a"}));
        assert!(
            before["metadata"].get("labels").is_none(),
            "input untouched"
        );
    }

    #[test]
    fn a_patch_may_not_change_identity() {
        for (path, value) in [
            ("/kind", json!("Secret")),
            ("/metadata/name", json!("other")),
            ("/metadata/namespace", json!("dev")),
            ("/metadata/uid", json!("u-2")),
        ] {
            let patch = json!([{"op": "replace", "path": path, "value": value}]).to_string();
            let err = apply_patch(&pod(), &patch).unwrap_err();
            assert_eq!(
                err,
                format!("a JSON Patch that changes {path}, which plugins may not change")
            );
        }
        let err = apply_patch(&pod(), r#"[{"op":"remove","path":"/apiVersion"}]"#).unwrap_err();
        assert!(err.contains("/apiVersion"), "{err}");
    }

    #[test]
    fn bad_patches_are_named() {
        let err = apply_patch(&pod(), "not json").unwrap_err();
        assert!(err.starts_with("an invalid JSON Patch: "), "{err}");
        let err = apply_patch(&pod(), r#"[{"op":"remove","path":"/nope"}]"#).unwrap_err();
        assert!(err.starts_with("an invalid JSON Patch: "), "{err}");
        let err = apply_patch(&pod(), r#"[{"op":"replace","path":"","value":[1]}]"#).unwrap_err();
        assert_eq!(err, "an invalid JSON Patch: the result is not an object");
    }
}
