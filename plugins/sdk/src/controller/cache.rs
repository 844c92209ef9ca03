//! Reads from the host's informer caches.

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::imports::{ServedResource, current, decode};
use crate::GroupVersionResource;

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
