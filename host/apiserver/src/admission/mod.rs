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
pub mod limit_ranger;
pub mod plugins;
pub mod quota;
pub mod serviceaccount;

use std::sync::Arc;

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
            Arc::new(serviceaccount::ServiceAccountDefault),
            Arc::new(limit_ranger::LimitRanger::default()),
            Arc::new(quota::ResourceQuota::default()),
        ],
        initializers: Vec::new(),
        initializer_sources: Vec::new(),
    }
}
