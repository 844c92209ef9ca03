//! The controller world's imports in plain Rust: the [`ControllerHost`] trait, the types
//! it speaks (writes, refused writes, served resources, event types), and the host
//! installed on the thread: the WIT imports inside a component, a test's own in native
//! tests.

use std::cell::RefCell;
use std::rc::Rc;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::GroupVersionResource;

/// A resource as discovery describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServedResource {
    pub resource: GroupVersionResource,
    pub namespaced: bool,
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

pub(super) fn current() -> Result<Rc<dyn ControllerHost>, String> {
    CURRENT
        .with(|c| c.borrow().clone())
        .ok_or_else(|| "no controller host: run inside a component or a test harness".into())
}

pub(super) fn decode<T: DeserializeOwned>(json: &str) -> Result<T, String> {
    serde_json::from_str(json).map_err(|e| format!("decode an object: {e}"))
}
