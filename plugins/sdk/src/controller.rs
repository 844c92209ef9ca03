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
//!
//! # Layout
//! - [`cache`]: reads from the informer caches.
//! - [`client`]: writes through the API server.
//! - [`events`]: recording events about objects.
//! - [`owned`]: ownerReferences and label selectors.
//! - [`time`]: times as the API server writes them.
//! - [`imports`]: the [`ControllerHost`] trait, [`with_controller_host`], and the types
//!   the calls speak ([`Write`], [`ApiError`], [`ServedResource`], [`EventType`]).

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::GroupVersionResource;

pub mod cache;
pub mod client;
pub mod events;
pub mod imports;
pub mod owned;
pub mod time;

pub use imports::{
    ApiError, Cause, ControllerHost, EventType, PatchType, Propagation, ServedResource, Write,
    with_controller_host,
};

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

/// Whether a namespace (as the cache holds it) is active: not being deleted. What
/// controllers that put objects in every namespace ask first.
pub fn namespace_is_active(namespace: &Value) -> bool {
    namespace["metadata"]["deletionTimestamp"].is_null()
        && namespace["status"]["phase"] != "Terminating"
}
