//! Reads of cluster state (the WIT `cluster` import), served from the API server's
//! watch cache.
//!
//! A plugin gets answers only when its Plugin object grants
//! `spec.capabilities.clusterRead`; otherwise every call returns `Err`. In tests,
//! [`testing::Harness::with_cluster_object`](crate::testing::Harness::with_cluster_object)
//! supplies the objects.

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::GroupVersionResource;

/// One object, or `None` when it does not exist. `namespace` is `None` for
/// cluster-scoped resources.
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
    match crate::imports::current().get(resource, namespace, name)? {
        None => Ok(None),
        Some(json) => serde_json::from_str(&json)
            .map(Some)
            .map_err(|e| format!("decode {resource} {name}: {e}")),
    }
}

/// The objects of a resource in one namespace (or all, with `None`) matching a
/// label selector in Kubernetes syntax (`""` selects everything).
pub fn list(
    resource: &GroupVersionResource,
    namespace: Option<&str>,
    label_selector: &str,
) -> Result<Vec<Value>, String> {
    list_as(resource, namespace, label_selector)
}

/// Like [`list`], each item decoded into `T`.
pub fn list_as<T: DeserializeOwned>(
    resource: &GroupVersionResource,
    namespace: Option<&str>,
    label_selector: &str,
) -> Result<Vec<T>, String> {
    crate::imports::current()
        .list(resource, namespace, label_selector)?
        .iter()
        .map(|json| serde_json::from_str(json).map_err(|e| format!("decode {resource} item: {e}")))
        .collect()
}

/// Typed reads where the resource comes from the `k8s-openapi` type:
/// `cluster::typed::get::<Namespace>(None, "default")`.
#[cfg(feature = "k8s-openapi")]
pub mod typed {
    use k8s_openapi::Resource;
    use serde::de::DeserializeOwned;

    use crate::GroupVersionResource;

    fn resource_of<T: Resource>() -> GroupVersionResource {
        GroupVersionResource::new(T::GROUP, T::VERSION, T::URL_PATH_SEGMENT)
    }

    pub fn get<T: Resource + DeserializeOwned>(
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<T>, String> {
        super::get_as(&resource_of::<T>(), namespace, name)
    }

    pub fn list<T: Resource + DeserializeOwned>(
        namespace: Option<&str>,
        label_selector: &str,
    ) -> Result<Vec<T>, String> {
        super::list_as(&resource_of::<T>(), namespace, label_selector)
    }
}
