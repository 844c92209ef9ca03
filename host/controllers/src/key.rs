//! The crate's names for objects: a work queue's [`Key`], a resource's lookup key
//! ([`gvr_key`]) and an object's key in an informer's cache ([`object_key`]).

use std::sync::Arc;

use kube::api::DynamicObject;
use trellis_plugin_host::GroupVersionResource;

/// A key: an object of one of the controller's resources (its primary resource,
/// or any resource for a controller of every resource).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    /// The resource, as [`gvr_key`] writes it.
    pub resource: Arc<str>,
    pub namespace: Option<String>,
    pub name: String,
}

impl Key {
    /// The object's key in its informer's cache.
    pub fn cache_key(&self) -> String {
        object_key(self.namespace.as_deref(), &self.name)
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.resource, self.cache_key())
    }
}

/// The key of `obj`, an object of `resource`.
pub(crate) fn key_of(resource: &Arc<str>, obj: &DynamicObject) -> Key {
    Key {
        resource: resource.clone(),
        namespace: obj.metadata.namespace.clone().filter(|n| !n.is_empty()),
        name: obj.metadata.name.clone().unwrap_or_default(),
    }
}

/// `group/version/resource`, as resources are looked up.
pub fn gvr_key(r: &GroupVersionResource) -> String {
    format!("{}/{}/{}", r.group, r.version, r.resource)
}

/// An object's key in an informer's cache.
pub(crate) fn object_key(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(ns) if !ns.is_empty() => format!("{ns}/{name}"),
        _ => name.to_owned(),
    }
}
