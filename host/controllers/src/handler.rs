//! What feeds a controller's work queue: the event handlers of controller-runtime's
//! `handler` package. A primary object's change adds its own key, an owned object's
//! its controlling owner's, a watched object's the keys its [`Mapping`] names; a
//! controller of every resource is fed as the garbage collector needs; a resync adds
//! every primary key now and then.

use std::sync::Arc;
use std::time::Duration;

use kube::api::DynamicObject;
use tokio::sync::mpsc::UnboundedReceiver;
use trellis_api::selector::LabelSelector;
use trellis_client::informer::{BY_NAMESPACE, Change, Informer};
use trellis_client::workqueue::WorkQueue;

use crate::cache::{Caches, SharedCaches};
use crate::config::Mapping;
use crate::key::{Key, key_of};

/// Feeds the key of every changed object of the primary resource.
pub(crate) async fn feed_primary(
    resource: Arc<str>,
    mut changes: UnboundedReceiver<Change<DynamicObject>>,
    queue: WorkQueue<Key>,
) {
    while let Some(change) = changes.recv().await {
        queue.add(key_of(&resource, change.object()));
    }
}

/// Feeds the key of an owned object's controlling owner (the old owner's and the
/// new one's for an update), when of the primary resource.
pub(crate) async fn feed_owned(
    mut changes: UnboundedReceiver<Change<DynamicObject>>,
    caches: Arc<Caches>,
    primary: Arc<str>,
    queue: WorkQueue<Key>,
) {
    while let Some(change) = changes.recv().await {
        let objects = match &change {
            Change::Updated { old, new } => vec![old.clone(), new.clone()],
            other => vec![other.object().clone()],
        };
        for obj in objects {
            if let Some(key) = caches.controller_of(&obj)
                && key.resource == primary
            {
                queue.add(key);
            }
        }
    }
}

/// Feeds every primary key in `informer` each `every`, changed or not.
pub(crate) async fn resync(
    informer: Arc<Informer<DynamicObject>>,
    primary: Arc<str>,
    every: Duration,
    queue: WorkQueue<Key>,
) {
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tick.tick().await;
        for obj in informer.list() {
            queue.add(key_of(&primary, &obj));
        }
    }
}

/// The selector of a primary object's `spec.selector`: a label map (a Service's) or
/// a `metav1.LabelSelector`. `None` selects nothing (a Service without a selector).
fn selector_of(obj: &DynamicObject) -> Option<LabelSelector> {
    let selector = obj.data.get("spec")?.get("selector")?;
    let selector =
        if selector.get("matchLabels").is_some() || selector.get("matchExpressions").is_some() {
            let typed: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector =
                serde_json::from_value(selector.clone()).ok()?;
            LabelSelector::from_k8s(&typed).ok()?
        } else {
            let pairs: Vec<String> = selector
                .as_object()?
                .iter()
                .filter_map(|(k, v)| Some(format!("{k}={}", v.as_str()?)))
                .collect();
            LabelSelector::parse(&pairs.join(",")).ok()?
        };
    (!selector.is_empty()).then_some(selector)
}

/// The keys of the primary resource a watched object maps to.
fn mapped_keys(
    map: Mapping,
    obj: &DynamicObject,
    primary: &Arc<str>,
    primary_namespaced: bool,
    primary_kind: (&str, &str),
    primary_cache: Option<&Informer<DynamicObject>>,
) -> Vec<Key> {
    let namespace = obj.metadata.namespace.clone().filter(|n| !n.is_empty());
    match map {
        Mapping::Selector => {
            let (Some(cache), Some(ns)) = (primary_cache, namespace) else {
                return Vec::new();
            };
            let none = std::collections::BTreeMap::new();
            let labels = obj.metadata.labels.as_ref().unwrap_or(&none);
            cache
                .by_index(BY_NAMESPACE, &ns)
                .iter()
                .filter(|p| selector_of(p).is_some_and(|s| s.matches_map(labels)))
                .map(|p| key_of(primary, p))
                .collect()
        }
        Mapping::Namespaced => {
            let (Some(cache), Some(ns)) = (primary_cache, namespace) else {
                return Vec::new();
            };
            cache
                .by_index(BY_NAMESPACE, &ns)
                .iter()
                .map(|p| key_of(primary, p))
                .collect()
        }
        Mapping::All => primary_cache
            .map(|cache| cache.list().iter().map(|p| key_of(primary, p)).collect())
            .unwrap_or_default(),
        Mapping::Owner => obj
            .metadata
            .owner_references
            .iter()
            .flatten()
            .filter(|r| r.api_version == primary_kind.0 && r.kind == primary_kind.1)
            .map(|r| Key {
                resource: primary.clone(),
                namespace: if primary_namespaced {
                    namespace.clone()
                } else {
                    None
                },
                name: r.name.clone(),
            })
            .collect(),
        Mapping::Namespace => namespace
            .map(|ns| Key {
                resource: primary.clone(),
                namespace: None,
                name: ns,
            })
            .into_iter()
            .collect(),
        Mapping::Cache => Vec::new(),
        Mapping::Name => vec![Key {
            resource: primary.clone(),
            namespace: if primary_namespaced { namespace } else { None },
            name: obj.metadata.name.clone().unwrap_or_default(),
        }],
    }
}

/// The keys a change brings for a controller of every resource, as the garbage
/// collector needs them: the object itself when its owners or its finalizers may
/// call for work (it was added, its ownerReferences changed, or it is being
/// deleted), its owners when it goes or its references change (an owner deleted in
/// the foreground waits for it), and its dependents when it is deleted.
pub(crate) async fn feed_every(
    resource: Arc<str>,
    mut changes: UnboundedReceiver<Change<DynamicObject>>,
    shared: SharedCaches,
    queue: WorkQueue<Key>,
) {
    let has_refs = |o: &DynamicObject| {
        o.metadata
            .owner_references
            .as_ref()
            .is_some_and(|r| !r.is_empty())
    };
    while let Some(change) = changes.recv().await {
        let caches = shared.current();
        match &change {
            Change::Added(obj) => {
                if obj.metadata.deletion_timestamp.is_some()
                    || (has_refs(obj) && !caches.owners_present(obj))
                {
                    queue.add(key_of(&resource, obj));
                }
            }
            Change::Updated { old, new } => {
                let refs_changed = old.metadata.owner_references != new.metadata.owner_references;
                let deleting = new.metadata.deletion_timestamp.is_some()
                    && (old.metadata.deletion_timestamp.is_none()
                        || old.metadata.finalizers != new.metadata.finalizers);
                if deleting || (refs_changed && !caches.owners_present(new)) {
                    queue.add(key_of(&resource, new));
                }
                if refs_changed || new.metadata.deletion_timestamp.is_some() {
                    for key in caches
                        .owners_of(old)
                        .into_iter()
                        .chain(caches.owners_of(new))
                    {
                        queue.add(key);
                    }
                }
            }
            Change::Deleted(obj) => {
                for key in caches.owners_of(obj) {
                    queue.add(key);
                }
                if let Some(uid) = obj.metadata.uid.as_deref() {
                    for key in caches.dependents_of(uid) {
                        queue.add(key);
                    }
                }
            }
        }
    }
}

/// The primary resource a watch maps to.
#[derive(Clone, Debug)]
pub(crate) struct MapTarget {
    pub(crate) primary: Arc<str>,
    /// The primary resource's cache, for the `selector` and `namespaced` mappings.
    pub(crate) cache: Arc<Informer<DynamicObject>>,
    pub(crate) namespaced: bool,
    pub(crate) api_version: String,
    pub(crate) kind: String,
}

/// Feeds the keys a watched resource's changes map to. With `removals`, only the
/// changes that remove something count: a delete, a deletion started, finalizers
/// changed on an object being deleted (what a namespace being emptied waits for).
pub(crate) async fn feed_mapped(
    mut changes: UnboundedReceiver<Change<DynamicObject>>,
    map: Mapping,
    removals: bool,
    target: MapTarget,
    queue: WorkQueue<Key>,
) {
    while let Some(change) = changes.recv().await {
        let objects = match &change {
            Change::Updated { old, new } => {
                let removing = new.metadata.deletion_timestamp.is_some()
                    && (old.metadata.deletion_timestamp.is_none()
                        || old.metadata.finalizers != new.metadata.finalizers);
                if removals && !removing {
                    continue;
                }
                vec![old.clone(), new.clone()]
            }
            Change::Added(obj) if removals && obj.metadata.deletion_timestamp.is_none() => {
                continue;
            }
            other => vec![other.object().clone()],
        };
        for obj in objects {
            for key in mapped_keys(
                map,
                &obj,
                &target.primary,
                target.namespaced,
                (&target.api_version, &target.kind),
                Some(&target.cache),
            ) {
                queue.add(key);
            }
        }
    }
}
