//! Controllers: the [`Reconcile`] trait, and the controller world's imports in plain
//! Rust: reads from the host's informer caches ([`cache`]), writes through the API
//! server ([`client`]) and [`events`].
//!
//! ```
//! use serde::Deserialize;
//! use trellis_plugin::controller::{Action, ObjectKey, Reconcile, cache};
//!
//! #[derive(Deserialize)]
//! struct Nothing {}
//!
//! impl Reconcile for Nothing {
//!     fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
//!         match cache::get(&key.resource, key.namespace.as_deref(), &key.name)? {
//!             Some(_) => Ok(Action::Done),
//!             None => Ok(Action::Done), // deleted: nothing to do
//!         }
//!     }
//! }
//!
//! trellis_plugin::controller!(Nothing);
//! ```
//!
//! The calls go through whichever [`ControllerHost`] is installed on the thread: the
//! WIT imports inside a component, a test's own in native tests.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::GroupVersionResource;

/// Which object a reconcile is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectKey {
    pub resource: GroupVersionResource,
    /// `None` for cluster-scoped resources.
    pub namespace: Option<String>,
    pub name: String,
}

/// What the host does with the key after a reconcile that succeeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Nothing until the object, or something it owns, changes.
    Done,
    /// Reconcile again after this long (or sooner on a change).
    RequeueAfter(Duration),
}

/// A controller plugin: brings the world to what one object asks for.
pub trait Reconcile: DeserializeOwned + 'static {
    /// See [`Validate::check_configuration`](crate::Validate::check_configuration).
    fn check_configuration(&self) -> Result<(), String> {
        Ok(())
    }

    /// Reconciles the object at `key` (which may have been deleted: the cache then
    /// has no object for it). `Err` is a failure, retried with back-off.
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String>;
}

/// One cause of a refused write (`details.causes` of a Kubernetes `Status`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cause {
    pub reason: String,
    pub message: String,
    pub field: String,
}

/// A write the API server refused, as its `Status` said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub code: u16,
    pub reason: String,
    pub message: String,
    pub causes: Vec<Cause>,
}

impl ApiError {
    /// 409 Conflict: the object changed since it was read.
    pub fn is_conflict(&self) -> bool {
        self.code == 409 && self.reason == "Conflict"
    }

    pub fn is_already_exists(&self) -> bool {
        self.code == 409 && self.reason == "AlreadyExists"
    }

    pub fn is_not_found(&self) -> bool {
        self.code == 404
    }

    /// A failure on this side of the API server (500 `InternalError`).
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            code: 500,
            reason: "InternalError".into(),
            message: message.into(),
            causes: Vec::new(),
        }
    }

    /// A create refused because its namespace is being deleted (the `Status` cause
    /// `NamespaceTerminating`): nothing to retry, the namespace controller empties it.
    pub fn is_namespace_terminating(&self) -> bool {
        self.code == 403
            && self
                .causes
                .iter()
                .any(|c| c.reason == "NamespaceTerminating")
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl From<ApiError> for String {
    fn from(e: ApiError) -> Self {
        e.to_string()
    }
}

/// How a patch is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatchType {
    Json,
    Merge,
    Strategic,
    /// Server-side apply.
    Apply,
}

/// What a delete does to what the object owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Propagation {
    Background,
    Foreground,
    Orphan,
}

/// One write through the API server.
#[derive(Clone, Debug, PartialEq)]
pub enum Write {
    Create {
        resource: GroupVersionResource,
        namespace: Option<String>,
        object: Value,
    },
    /// The whole object, with the resourceVersion it was read at; `status` writes the
    /// status subresource.
    Update {
        resource: GroupVersionResource,
        namespace: Option<String>,
        object: Value,
        status: bool,
    },
    Patch {
        resource: GroupVersionResource,
        namespace: Option<String>,
        name: String,
        patch_type: PatchType,
        patch: Value,
        status: bool,
        force: bool,
    },
    Delete {
        resource: GroupVersionResource,
        namespace: Option<String>,
        name: String,
        propagation: Option<Propagation>,
        uid: Option<String>,
    },
}

/// A resource as discovery describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServedResource {
    pub resource: GroupVersionResource,
    pub namespaced: bool,
}

/// Event severity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

/// What a controller can ask of the host beyond [`Host`](crate::imports::Host): the
/// controller world's imports, in plain Rust types.
pub trait ControllerHost {
    fn get(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<String>, String>;

    fn list(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        label_selector: &str,
    ) -> Result<Vec<String>, String>;

    fn owned_by(
        &self,
        resource: &GroupVersionResource,
        owner_uid: &str,
    ) -> Result<Vec<String>, String>;

    /// Objects of every cached resource whose ownerReferences name `owner_uid`.
    fn dependents(&self, owner_uid: &str) -> Result<Vec<String>, String> {
        let _ = owner_uid;
        Err("this host serves no dependents".into())
    }

    /// What serves `kind` of `api_version`.
    fn resource_of(&self, api_version: &str, kind: &str) -> Option<ServedResource> {
        let _ = (api_version, kind);
        None
    }

    /// Every resource cached for the controller.
    fn resources(&self) -> Vec<ServedResource> {
        Vec::new()
    }

    /// Replaces `subresource` of the object with the whole object.
    fn update_subresource(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        object: &Value,
        subresource: &str,
    ) -> Result<String, ApiError> {
        let _ = (resource, namespace, object);
        Err(ApiError {
            code: 405,
            reason: "MethodNotAllowed".into(),
            message: format!("this host writes no {subresource} subresource"),
            causes: Vec::new(),
        })
    }

    /// One object as the API server has it now.
    fn read(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<String>, ApiError> {
        self.get(resource, namespace, name)
            .map_err(ApiError::internal)
    }

    /// Runs the writes (concurrently, in the host) and returns their results in order.
    fn batch(&self, writes: Vec<Write>) -> Vec<Result<String, ApiError>>;

    fn record(&self, object: &str, event_type: EventType, reason: &str, message: &str);
}

thread_local! {
    static CURRENT: RefCell<Option<Rc<dyn ControllerHost>>> = const { RefCell::new(None) };
}

/// Runs `f` with `host` installed, restoring the previous one afterwards.
pub fn with_controller_host<R>(host: Rc<dyn ControllerHost>, f: impl FnOnce() -> R) -> R {
    crate::imports::with_installed(&CURRENT, host, f)
}

fn current() -> Result<Rc<dyn ControllerHost>, String> {
    CURRENT
        .with(|c| c.borrow().clone())
        .ok_or_else(|| "no controller host: run inside a component or a test harness".into())
}

fn decode<T: DeserializeOwned>(json: &str) -> Result<T, String> {
    serde_json::from_str(json).map_err(|e| format!("decode an object: {e}"))
}

/// Reads from the host's informer caches.
pub mod cache {
    use super::*;

    /// One object, or `None` when the cache does not hold it.
    pub fn get(
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Value>, String> {
        get_as(resource, namespace, name)
    }

    /// Like [`get`], decoded into `T`.
    pub fn get_as<T: DeserializeOwned>(
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<T>, String> {
        current()?
            .get(resource, namespace, name)?
            .map(|json| decode(&json))
            .transpose()
    }

    /// Objects in `namespace` (or all) matching a label selector (`""`: all).
    pub fn list_as<T: DeserializeOwned>(
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        label_selector: &str,
    ) -> Result<Vec<T>, String> {
        current()?
            .list(resource, namespace, label_selector)?
            .iter()
            .map(|json| decode(json))
            .collect()
    }

    /// Objects of every cached resource whose ownerReferences name `owner_uid`.
    pub fn dependents(owner_uid: &str) -> Result<Vec<Value>, String> {
        current()?
            .dependents(owner_uid)?
            .iter()
            .map(|json| decode(json))
            .collect()
    }

    /// The resource that serves `kind` in `api_version` (`apps/v1`, `Deployment`).
    pub fn resource_of(api_version: &str, kind: &str) -> Option<ServedResource> {
        current().ok()?.resource_of(api_version, kind)
    }

    /// Every resource cached for the controller (with a watch of `*`, every resource
    /// the API server serves that can be listed, watched and deleted).
    pub fn resources() -> Vec<ServedResource> {
        current().map(|h| h.resources()).unwrap_or_default()
    }

    /// Objects whose ownerReferences name the owner with `owner_uid`.
    pub fn owned_by_as<T: DeserializeOwned>(
        resource: &GroupVersionResource,
        owner_uid: &str,
    ) -> Result<Vec<T>, String> {
        current()?
            .owned_by(resource, owner_uid)?
            .iter()
            .map(|json| decode(json))
            .collect()
    }
}

/// Writes through the API server under the controller's identity.
pub mod client {
    use super::*;

    /// One object read from the API server itself, not the cache: for decisions a
    /// lagging cache must not make. `None` when it does not exist.
    pub fn read(
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Value>, ApiError> {
        let host = current().map_err(ApiError::internal)?;
        host.read(resource, namespace, name)?
            .map(|json| {
                serde_json::from_str(&json)
                    .map_err(|e| ApiError::internal(format!("decode the object read: {e}")))
            })
            .transpose()
    }

    /// Replaces a subresource other than `status` (`namespaces/NAME/finalize`) with
    /// the whole object.
    pub fn update_subresource(
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        object: &Value,
        subresource: &str,
    ) -> Result<Value, ApiError> {
        let host = current().map_err(ApiError::internal)?;
        let json = host.update_subresource(resource, namespace, object, subresource)?;
        serde_json::from_str(&json)
            .map_err(|e| ApiError::internal(format!("decode the stored object: {e}")))
    }

    /// Runs `writes` concurrently in the host; results in the order given.
    pub fn batch(writes: Vec<Write>) -> Result<Vec<Result<Value, ApiError>>, String> {
        let results = current()?.batch(writes);
        Ok(results
            .into_iter()
            .map(|r| {
                r.and_then(|json| {
                    serde_json::from_str(&json)
                        .map_err(|e| ApiError::internal(format!("decode the stored object: {e}")))
                })
            })
            .collect())
    }

    /// One write.
    pub fn write(write: Write) -> Result<Value, ApiError> {
        let mut results = batch(vec![write]).map_err(ApiError::internal)?;
        results
            .pop()
            .unwrap_or_else(|| Err(ApiError::internal("the host answered no write")))
    }

    pub fn create(
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        object: Value,
    ) -> Result<Value, ApiError> {
        write(Write::Create {
            resource: resource.clone(),
            namespace: namespace.map(str::to_owned),
            object,
        })
    }

    /// Writes the object's status through the status subresource.
    pub fn update_status(
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        object: Value,
    ) -> Result<Value, ApiError> {
        write(Write::Update {
            resource: resource.clone(),
            namespace: namespace.map(str::to_owned),
            object,
            status: true,
        })
    }

    /// Patches the object (`status`: its status subresource).
    pub fn patch(
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
        patch_type: PatchType,
        patch: Value,
        status: bool,
    ) -> Result<Value, ApiError> {
        write(Write::Patch {
            resource: resource.clone(),
            namespace: namespace.map(str::to_owned),
            name: name.to_owned(),
            patch_type,
            patch,
            status,
            force: false,
        })
    }

    /// Merge-patches the object's status with `status`; `Ok(None)` when the object is
    /// gone (deleted while it was reconciled: nothing left to report on).
    pub fn patch_status(
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
        status: Value,
    ) -> Result<Option<Value>, ApiError> {
        let written = patch(
            resource,
            namespace,
            name,
            PatchType::Merge,
            serde_json::json!({ "status": status }),
            true,
        );
        match written {
            Ok(object) => Ok(Some(object)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub fn delete(
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
        propagation: Option<Propagation>,
    ) -> Result<Value, ApiError> {
        write(Write::Delete {
            resource: resource.clone(),
            namespace: namespace.map(str::to_owned),
            name: name.to_owned(),
            propagation,
            uid: None,
        })
    }
}

/// Events about objects.
pub mod events {
    use super::*;

    /// Records an event about `object` (its kind, name, namespace and uid are what
    /// the event refers to). Never fails: the host drops what its limits refuse.
    pub fn record(object: &Value, event_type: EventType, reason: &str, message: &str) {
        if let Ok(host) = current() {
            host.record(&object.to_string(), event_type, reason, message);
        }
    }
}

/// Whether a namespace (as the cache holds it) is active: not being deleted. What
/// controllers that put objects in every namespace ask first.
pub fn namespace_is_active(namespace: &Value) -> bool {
    namespace["metadata"]["deletionTimestamp"].is_null()
        && namespace["status"]["phase"] != "Terminating"
}

/// Owned objects: ownerReferences and label selectors, as controllers read them.
pub mod owned {
    use serde_json::{Value, json};

    /// The ownerReference a controller puts on what it creates: `controller` and
    /// `blockOwnerDeletion` set, so the owner's changes reach it and a foreground
    /// deletion of the owner waits for it.
    pub fn controller_reference(api_version: &str, kind: &str, owner: &Value) -> Value {
        json!({
            "apiVersion": api_version,
            "kind": kind,
            "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"],
            "controller": true,
            "blockOwnerDeletion": true,
        })
    }

    /// The patch that adopts `object` (of `resource` in `namespace`): `reference`
    /// becomes its controller. The object's uid in the patch makes it fail rather
    /// than adopt another object of the same name.
    pub fn adopt(
        resource: &crate::GroupVersionResource,
        namespace: Option<&str>,
        object: &Value,
        reference: Value,
    ) -> super::Write {
        claim_patch(resource, namespace, object, reference)
    }

    /// The patch that releases `object` from the owner with `owner_uid`.
    pub fn release(
        resource: &crate::GroupVersionResource,
        namespace: Option<&str>,
        object: &Value,
        owner_uid: &str,
    ) -> super::Write {
        claim_patch(
            resource,
            namespace,
            object,
            json!({"$patch": "delete", "uid": owner_uid}),
        )
    }

    fn claim_patch(
        resource: &crate::GroupVersionResource,
        namespace: Option<&str>,
        object: &Value,
        reference: Value,
    ) -> super::Write {
        super::Write::Patch {
            resource: resource.clone(),
            namespace: namespace.map(str::to_owned),
            name: object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            patch_type: super::PatchType::Strategic,
            patch: json!({"metadata": {
                "ownerReferences": [reference],
                "uid": object["metadata"]["uid"],
            }}),
            status: false,
            force: false,
        }
    }

    /// The ownerReference of `object` that has `controller: true`.
    pub fn controller_of(object: &Value) -> Option<&Value> {
        object["metadata"]["ownerReferences"]
            .as_array()?
            .iter()
            .find(|r| r["controller"] == true)
    }

    /// Whether `object`'s controller is the owner with `uid`.
    pub fn is_controlled_by(object: &Value, uid: &str) -> bool {
        controller_of(object).is_some_and(|r| r["uid"] == uid)
    }

    /// A `metav1.LabelSelector` (`matchLabels`, `matchExpressions`) as the string
    /// form a list takes (`a=b,c in (d,e),!f`). An empty selector is `""`, which
    /// selects everything: callers that must select nothing check
    /// [`selector_is_empty`] first, as Kubernetes' controllers do.
    pub fn selector_string(selector: &Value) -> Result<String, String> {
        let mut parts = Vec::new();
        if let Some(labels) = selector["matchLabels"].as_object() {
            for (k, v) in labels {
                let v = v
                    .as_str()
                    .ok_or_else(|| format!("matchLabels.{k}: not a string"))?;
                parts.push(format!("{k}={v}"));
            }
        }
        for (i, e) in selector["matchExpressions"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let key = e["key"]
                .as_str()
                .ok_or_else(|| format!("matchExpressions[{i}].key: required"))?;
            let values: Vec<&str> = e["values"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            let op = e["operator"].as_str().unwrap_or_default();
            parts.push(match op {
                "In" | "NotIn" if values.is_empty() => {
                    return Err(format!(
                        "matchExpressions[{i}].values: {op} needs at least one value"
                    ));
                }
                "In" => format!("{key} in ({})", values.join(",")),
                "NotIn" => format!("{key} notin ({})", values.join(",")),
                "Exists" => key.to_owned(),
                "DoesNotExist" => format!("!{key}"),
                other => {
                    return Err(format!(
                        "matchExpressions[{i}].operator: {other:?} is not In, NotIn, Exists or DoesNotExist"
                    ));
                }
            });
        }
        Ok(parts.join(","))
    }

    /// Whether the selector has no requirement (it would select every object).
    pub fn selector_is_empty(selector: &Value) -> bool {
        selector["matchLabels"]
            .as_object()
            .is_none_or(|m| m.is_empty())
            && selector["matchExpressions"]
                .as_array()
                .is_none_or(|e| e.is_empty())
    }

    /// Whether `labels` (a JSON map, or null) satisfy the selector.
    pub fn selector_matches(selector: &Value, labels: &Value) -> bool {
        let label = |k: &str| labels.get(k).and_then(Value::as_str);
        let labels_ok = selector["matchLabels"]
            .as_object()
            .into_iter()
            .flatten()
            .all(|(k, v)| label(k).is_some_and(|have| Some(have) == v.as_str()));
        labels_ok
            && selector["matchExpressions"]
                .as_array()
                .into_iter()
                .flatten()
                .all(|e| {
                    let key = e["key"].as_str().unwrap_or_default();
                    let mut values = e["values"].as_array().into_iter().flatten();
                    match e["operator"].as_str() {
                        Some("In") => label(key).is_some_and(|h| values.any(|v| v == h)),
                        Some("NotIn") => label(key).is_none_or(|h| !values.any(|v| v == h)),
                        Some("Exists") => label(key).is_some(),
                        Some("DoesNotExist") => label(key).is_none(),
                        _ => false,
                    }
                })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn selectors_become_list_strings_and_match_as_the_api_server_does() {
            let selector = json!({
                "matchLabels": {"app": "web"},
                "matchExpressions": [
                    {"key": "tier", "operator": "In", "values": ["a", "b"]},
                    {"key": "canary", "operator": "DoesNotExist"},
                ],
            });
            assert_eq!(
                selector_string(&selector).unwrap(),
                "app=web,tier in (a,b),!canary"
            );
            assert!(selector_matches(
                &selector,
                &json!({"app": "web", "tier": "b"})
            ));
            assert!(!selector_matches(
                &selector,
                &json!({"app": "web", "tier": "c"})
            ));
            assert!(!selector_matches(
                &selector,
                &json!({"app": "web", "tier": "a", "canary": "1"})
            ));
            assert!(!selector_matches(&selector, &Value::Null));
            assert!(selector_is_empty(&json!({})));
            let bad = json!({"matchExpressions": [{"key": "k", "operator": "In"}]});
            assert!(
                selector_string(&bad)
                    .unwrap_err()
                    .contains("at least one value")
            );
        }

        #[test]
        fn the_controller_reference_is_the_one_with_controller_set() {
            let owner = json!({"metadata": {"name": "rs", "uid": "u1"}});
            let pod = json!({"metadata": {"ownerReferences": [
                {"kind": "Other", "uid": "u0", "name": "x"},
                controller_reference("apps/v1", "ReplicaSet", &owner),
            ]}});
            assert!(is_controlled_by(&pod, "u1"));
            assert!(!is_controlled_by(&pod, "u0"));
            assert_eq!(controller_of(&pod).unwrap()["blockOwnerDeletion"], true);
        }
    }
}

/// Times as the API server writes them (RFC 3339 in UTC, whole seconds), as seconds
/// since the epoch: what conditions and `minReadySeconds` are computed with.
pub mod time {
    /// Now, in seconds since the epoch (the host's wall clock).
    pub fn now() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(0))
    }

    /// Seconds since the epoch of `2026-01-02T03:04:05Z` (a fraction is ignored).
    pub fn parse(t: &str) -> Option<i64> {
        let b = t.as_bytes();
        if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' {
            return None;
        }
        let num = |r: std::ops::Range<usize>| t.get(r)?.parse::<i64>().ok();
        let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
        let (hh, mm, ss) = (num(11..13)?, num(14..16)?, num(17..19)?);
        // Days from the civil date, by eras of 400 years (Howard Hinnant's method).
        let y = if m <= 2 { y - 1 } else { y };
        let era = y.div_euclid(400);
        let yoe = y - era * 400;
        let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        Some((era * 146_097 + doe - 719_468) * 86_400 + hh * 3600 + mm * 60 + ss)
    }

    /// The RFC 3339 form of seconds since the epoch.
    pub fn format(secs: i64) -> String {
        let rem = secs.rem_euclid(86_400);
        let z = secs.div_euclid(86_400) + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let d = doy - (153 * mp + 2) / 5 + 1;
        let m = if mp < 10 { mp + 3 } else { mp - 9 };
        let y = yoe + era * 400 + i64::from(m <= 2);
        format!(
            "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
            rem / 3600,
            rem % 3600 / 60,
            rem % 60
        )
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn times_round_trip_through_seconds() {
            let t = "2026-11-26T09:30:05Z";
            assert_eq!(super::format(super::parse(t).unwrap()), t);
            assert_eq!(super::parse("1970-01-01T00:00:00Z"), Some(0));
            assert_eq!(super::parse("2000-03-01T00:00:00.5Z"), Some(951_868_800));
            assert_eq!(super::parse("yesterday"), None);
        }
    }
}
