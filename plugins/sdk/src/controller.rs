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

/// Event severity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

/// What a controller can ask of the host beyond [`Host`](crate::host::Host): the
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

    /// Runs the writes (concurrently, in the host) and returns their results in order.
    fn batch(&self, writes: Vec<Write>) -> Vec<Result<String, ApiError>>;

    fn record(&self, object: &str, event_type: EventType, reason: &str, message: &str);
}

thread_local! {
    static CURRENT: RefCell<Option<Rc<dyn ControllerHost>>> = const { RefCell::new(None) };
}

/// Runs `f` with `host` installed, restoring the previous one afterwards.
pub fn with_controller_host<R>(host: Rc<dyn ControllerHost>, f: impl FnOnce() -> R) -> R {
    crate::host::with_installed(&CURRENT, host, f)
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

    /// Runs `writes` concurrently in the host; results in the order given.
    pub fn batch(writes: Vec<Write>) -> Result<Vec<Result<Value, ApiError>>, String> {
        let results = current()?.batch(writes);
        Ok(results
            .into_iter()
            .map(|r| {
                r.and_then(|json| {
                    serde_json::from_str(&json).map_err(|e| ApiError {
                        code: 500,
                        reason: "InternalError".into(),
                        message: format!("decode the stored object: {e}"),
                        causes: Vec::new(),
                    })
                })
            })
            .collect())
    }

    /// One write.
    pub fn write(write: Write) -> Result<Value, ApiError> {
        let mut results = batch(vec![write]).map_err(|message| ApiError {
            code: 500,
            reason: "InternalError".into(),
            message,
            causes: Vec::new(),
        })?;
        results.pop().unwrap_or_else(|| {
            Err(ApiError {
                code: 500,
                reason: "InternalError".into(),
                message: "the host answered no write".into(),
                causes: Vec::new(),
            })
        })
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
