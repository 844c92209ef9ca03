//! The admission and initializer chains: host-side traits, ordered and configurable,
//! that the WASM plugins fill later through the same interfaces.
//!
//! - Mutating admission runs before validation and may change the object; validating
//!   admission runs after it and may only refuse. Both see creates, updates and
//!   deletes (a delete shows the stored object).
//! - Initializers run after a create is stored. The object is created with
//!   `metadata.initializers.pending` listing the initializers that apply, and stays
//!   invisible to get, list and watch (unless `includeUninitialized=true`) until the
//!   list is empty. Only the first pending initializer may act, and it removes its own
//!   name; a failure records `metadata.initializers.result`, deletes the object and
//!   fails the create. The creating request waits, bounded, until the object is
//!   initialized.
//!
//! Built in, in this order: `NamespaceLifecycle` (in the create path itself, see
//! [`crate::registry::prepare_create`]), `ServiceAccount` (pods get the namespace's `default`
//! service account), `LimitRanger` ([`crate::admission::limit_ranger`]) and `ResourceQuota`
//! ([`crate::admission::quota`]).

pub mod chain;
pub mod default_storage_class;
pub mod limit_ranger;
pub mod plugins;
pub mod pod_security;
pub mod priority;
pub mod quota;
mod runtime_class;
pub mod serviceaccount;
pub mod tolerations;

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::{Map, Value};
use trellis_api::ApiError;

use crate::object::Object;

pub use chain::{
    Admission, Attributes, Chains, Initializer, InitializerSource, check_pending_update, pending,
    set_pending,
};

/// The built-in chain, in Kubernetes' order: ResourceQuota last, so that nothing after
/// it can refuse a write it has charged (WASM plugins are inserted before it, see
/// [`Chains::add`]).
pub fn builtin() -> Chains {
    Chains {
        admission: vec![
            Arc::new(serviceaccount::ServiceAccountDefault::default()),
            Arc::new(tolerations::DefaultTolerationSeconds),
            Arc::new(priority::Priority::default()),
            Arc::new(runtime_class::RuntimeClass::default()),
            Arc::new(default_storage_class::DefaultStorageClass::default()),
            Arc::new(limit_ranger::LimitRanger::default()),
            Arc::new(quota::ResourceQuota::default()),
        ],
        initializers: Vec::new(),
        initializer_sources: Vec::new(),
    }
}

/// What admission steps need of the server beyond the store: its watch cache, its
/// resources, its namespaces, and a way to write the status of the objects they keep
/// (quota usage, Plugin conditions). The server's state implements it; the steps
/// depend on this rather than on the state, which holds them.
#[async_trait]
pub trait Cluster: Send + Sync + std::fmt::Debug {
    fn cache(&self) -> &Arc<crate::storage::watch_cache::WatchCache>;
    fn resource(
        &self,
        group: &str,
        version: &str,
        plural: &str,
    ) -> Result<trellis_api::registry::ResourceInfo, ApiError>;
    fn namespaces(&self) -> &crate::storage::lister::Lister;
    /// Writes the status `change` makes to `target` through the registry (see
    /// `crate::registry::status`). `None`: the object is gone, or nothing changed.
    async fn write_status(
        &self,
        target: &StatusTarget,
        change: &mut StatusChange<'_>,
    ) -> Result<Option<Object>, ApiError>;
}

/// The object whose status a server-internal writer changes.
#[derive(Clone, Debug)]
pub struct StatusTarget {
    pub group: String,
    pub version: String,
    pub plural: String,
    pub namespace: Option<String>,
    pub name: String,
    /// When set, an object of another uid (deleted and re-created) is left alone.
    pub uid: Option<String>,
    /// The field manager its managedFields entry is recorded under.
    pub manager: &'static str,
}

/// Turns the stored object (first argument) into the status to write (second); an
/// error stops the write and is returned.
pub type StatusChange<'a> =
    dyn FnMut(&Object, &mut Map<String, Value>) -> Result<(), ApiError> + Send + 'a;
