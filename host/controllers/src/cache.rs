//! What a controller reads: the resources it declared, each resolved through
//! discovery with its shared informer ([`Caches`]), and the owner index over them
//! (an object's owners, its controller, the dependents of a uid).

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::DynamicObject;
use kube::discovery::{ApiCapabilities, ApiResource, Scope};
use trellis_client::informer::{BY_OWNER, Informer};
use trellis_plugin_host::GroupVersionResource;

use crate::key::{Key, gvr_key, key_of};

/// A resource a controller reads or writes, resolved through discovery.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub resource: ApiResource,
    pub namespaced: bool,
}

impl Resolved {
    pub fn new(resource: ApiResource, capabilities: &ApiCapabilities) -> Self {
        Self {
            resource,
            namespaced: capabilities.scope == Scope::Namespaced,
        }
    }
}

/// A resource a controller reads, and its informer.
#[derive(Clone, Debug)]
pub(crate) struct Cached {
    pub gvr: GroupVersionResource,
    pub resolved: Resolved,
    pub informer: Arc<Informer<DynamicObject>>,
}

/// The resources a controller reads, by [`gvr_key`], and what serves each kind.
#[derive(Clone, Debug, Default)]
pub(crate) struct Caches {
    pub by_resource: HashMap<String, Cached>,
    /// `(apiVersion, kind)` to [`gvr_key`].
    pub by_kind: HashMap<(String, String), String>,
}

impl Caches {
    pub(crate) fn insert(
        &mut self,
        gvr: GroupVersionResource,
        resolved: Resolved,
        informer: Arc<Informer<DynamicObject>>,
    ) {
        let key = gvr_key(&gvr);
        self.by_kind.insert(
            (
                resolved.resource.api_version.clone(),
                resolved.resource.kind.clone(),
            ),
            key.clone(),
        );
        self.by_resource.insert(
            key,
            Cached {
                gvr,
                resolved,
                informer,
            },
        );
    }

    /// The key of the owner `reference` of `obj` names, if of a cached kind.
    fn owner_key(&self, obj: &DynamicObject, reference: &OwnerReference) -> Option<Key> {
        let resource = self
            .by_kind
            .get(&(reference.api_version.clone(), reference.kind.clone()))?;
        let cached = &self.by_resource[resource];
        Some(Key {
            resource: resource.as_str().into(),
            namespace: if cached.resolved.namespaced {
                obj.metadata.namespace.clone().filter(|n| !n.is_empty())
            } else {
                None
            },
            name: reference.name.clone(),
        })
    }

    /// The keys of the owners `obj`'s ownerReferences name (of cached kinds).
    pub(crate) fn owners_of(&self, obj: &DynamicObject) -> Vec<Key> {
        obj.metadata
            .owner_references
            .iter()
            .flatten()
            .filter_map(|r| self.owner_key(obj, r))
            .collect()
    }

    /// Whether every owner `obj` names is in the cache with the uid named: then a
    /// controller of every resource has nothing to do for it (most objects, most of
    /// the time), and is not called.
    pub(crate) fn owners_present(&self, obj: &DynamicObject) -> bool {
        obj.metadata.owner_references.iter().flatten().all(|r| {
            self.owner_key(obj, r).is_some_and(|key| {
                self.by_resource[&*key.resource]
                    .informer
                    .get(&key.cache_key())
                    .is_some_and(|o| o.metadata.uid.as_deref() == Some(r.uid.as_str()))
            })
        })
    }

    /// The key of `obj`'s controller (the reference with `controller: true`).
    pub(crate) fn controller_of(&self, obj: &DynamicObject) -> Option<Key> {
        let reference = obj
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|r| r.controller == Some(true))?;
        self.owner_key(obj, reference)
    }

    /// The keys of every cached object whose ownerReferences name `uid`.
    pub(crate) fn dependents_of(&self, uid: &str) -> Vec<Key> {
        self.by_resource
            .iter()
            .flat_map(|(resource, cached)| {
                let resource: Arc<str> = resource.as_str().into();
                cached
                    .informer
                    .by_index(BY_OWNER, uid)
                    .iter()
                    .map(|o| key_of(&resource, o))
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

/// The caches of a controller, replaced whole when resources appear (a controller
/// of every resource follows new CustomResourceDefinitions).
#[derive(Clone, Debug, Default)]
pub(crate) struct SharedCaches(Arc<std::sync::RwLock<Arc<Caches>>>);

impl SharedCaches {
    pub(crate) fn new(caches: Caches) -> Self {
        Self(Arc::new(std::sync::RwLock::new(Arc::new(caches))))
    }

    /// The caches now.
    pub fn current(&self) -> Arc<Caches> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn replace(&self, caches: Caches) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(caches);
    }
}
