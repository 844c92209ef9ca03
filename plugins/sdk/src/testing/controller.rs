//! The host of controllers, played natively: [`ControllerHarness`].

use std::{cell::RefCell, rc::Rc};

use serde_json::Value;

use crate::GroupVersionResource;

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
