//! Shared informers: one list+watch per (resource, namespace, selectors) per process,
//! whatever the number of components reading it, as client-go's
//! `SharedInformerFactory`. kube-runtime's [`watcher`] does the listing and watching
//! (relists with backoff after 410 Gone and watch errors, bookmarks on); this module
//! keeps the indexed store and hands each change to every subscriber.
//!
//! - [`SharedInformers::informer`] returns the process's informer for an
//!   [`Api`] and a [`watcher::Config`], starting it on first use.
//! - [`Informer::get`], [`Informer::list`] and [`Informer::by_index`] read its store;
//!   indexes by namespace, label (`key=value`) and owner UID are built in, others
//!   (a pod's `spec.nodeName`, see [`pod_node_name`]) are added with
//!   [`Informer::add_index`].
//! - [`Informer::subscribe`] gives a stream of [`Change`]s: first an `Added` for each
//!   object already cached, then every change in order. A relist turns into the
//!   adds, updates and deletes that bring the store to the new list.
//! - [`Informer::has_synced`] / [`Informer::wait_synced`]: the first list is in.
//!
//! - [`InformerMetrics`]: `informer_*` metrics of every informer of a
//!   [`SharedInformers`], labelled by what it watches.
//!
//! Cached objects carry no `managedFields`: as kube-scheduler and
//! kube-controller-manager trim them from their informers, since no loop reads them and
//! they are often the larger part of an object.

use std::any::{Any, TypeId};
use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource, ResourceExt};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;
use tracing::warn;

/// A change of one object, as an informer's subscribers see it.
#[derive(Debug)]
pub enum Change<K> {
    Added(Arc<K>),
    Updated { old: Arc<K>, new: Arc<K> },
    Deleted(Arc<K>),
}

impl<K> Clone for Change<K> {
    fn clone(&self) -> Self {
        match self {
            Self::Added(k) => Self::Added(k.clone()),
            Self::Updated { old, new } => Self::Updated {
                old: old.clone(),
                new: new.clone(),
            },
            Self::Deleted(k) => Self::Deleted(k.clone()),
        }
    }
}

impl<K> Change<K> {
    /// The object as it is now (as it last was, for a delete).
    pub fn object(&self) -> &Arc<K> {
        match self {
            Self::Added(k) | Self::Deleted(k) | Self::Updated { new: k, .. } => k,
        }
    }
}

/// Index values of an object (the label index: `key=value` for each label).
pub type IndexFn<K> = Arc<dyn Fn(&K) -> Vec<String> + Send + Sync>;

/// The built-in index of namespaces.
pub const BY_NAMESPACE: &str = "namespace";
/// The built-in index of labels, by `key=value`.
pub const BY_LABEL: &str = "label";
/// The built-in index of owners, by the UIDs in `ownerReferences`.
pub const BY_OWNER: &str = "owner";
/// The index [`pod_node_name`] builds.
pub const BY_NODE_NAME: &str = "spec.nodeName";

/// An index of pods by `spec.nodeName` (unscheduled pods under `""`).
pub fn pod_node_name() -> IndexFn<Pod> {
    Arc::new(|pod: &Pod| {
        vec![
            pod.spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default(),
        ]
    })
}

/// Drops what no loop reads from a cached object.
fn trim<K: Resource>(mut obj: K) -> K {
    obj.meta_mut().managed_fields = None;
    obj
}

/// The key of an object in a store: `namespace/name`, or `name` when cluster-scoped.
pub fn key_of<K: Resource>(obj: &K) -> String {
    match obj.meta().namespace.as_deref() {
        Some(ns) if !ns.is_empty() => format!("{ns}/{}", obj.name_any()),
        _ => obj.name_any(),
    }
}

/// The informers' metrics, shared by every informer of a [`SharedInformers`] and
/// labelled by what each watches (`informer="/api/v1/pods labels=app=web"`).
#[derive(Clone, Debug, Default)]
pub struct InformerMetrics {
    objects: Family<InformerLabel, Gauge>,
    synced: Family<InformerLabel, Gauge>,
    lists: Family<InformerLabel, Counter>,
    errors: Family<InformerLabel, Counter>,
    events: Family<EventLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InformerLabel {
    informer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    informer: String,
    /// `added`, `updated` or `deleted`.
    r#type: &'static str,
}

impl InformerMetrics {
    /// Adds the metrics to `registry` as `informer_objects`, `informer_synced`,
    /// `informer_lists_total`, `informer_watch_errors_total` and
    /// `informer_events_total`.
    pub fn register(&self, registry: &mut Registry) {
        let sub = registry.sub_registry_with_prefix("informer");
        sub.register("objects", "Objects in the store", self.objects.clone());
        sub.register(
            "synced",
            "1 once the first list is in the store",
            self.synced.clone(),
        );
        sub.register(
            "lists",
            "Lists made: the first and every relist",
            self.lists.clone(),
        );
        sub.register(
            "watch_errors",
            "List and watch errors recovered from (each followed by a relist or a resumed watch)",
            self.errors.clone(),
        );
        sub.register(
            "events",
            "Changes handed to subscribers, by type",
            self.events.clone(),
        );
    }

    fn of(&self, what: &str) -> Counters {
        let label = InformerLabel {
            informer: what.to_owned(),
        };
        let event = |r#type| {
            self.events
                .get_or_create(&EventLabels {
                    informer: what.to_owned(),
                    r#type,
                })
                .clone()
        };
        Counters {
            objects: self.objects.get_or_create(&label).clone(),
            synced: self.synced.get_or_create(&label).clone(),
            lists: self.lists.get_or_create(&label).clone(),
            errors: self.errors.get_or_create(&label).clone(),
            added: event("added"),
            updated: event("updated"),
            deleted: event("deleted"),
        }
    }
}

/// One informer's handles on its metrics.
#[derive(Debug)]
struct Counters {
    objects: Gauge,
    synced: Gauge,
    lists: Counter,
    errors: Counter,
    added: Counter,
    updated: Counter,
    deleted: Counter,
}

impl Counters {
    fn count<K>(&self, changes: &[Change<K>], objects: usize) {
        for change in changes {
            match change {
                Change::Added(_) => self.added.inc(),
                Change::Updated { .. } => self.updated.inc(),
                Change::Deleted(_) => self.deleted.inc(),
            };
        }
        self.objects.set(i64::try_from(objects).unwrap_or(i64::MAX));
    }
}

struct Store<K> {
    /// Keys are shared with the indexes: one allocation per key, however many index
    /// values point at it.
    items: HashMap<Arc<str>, Arc<K>>,
    indexers: HashMap<String, IndexFn<K>>,
    /// Per index: value → keys.
    indices: HashMap<String, HashMap<String, HashSet<Arc<str>>>>,
}

impl<K: Resource> Store<K> {
    fn new() -> Self {
        let mut indexers: HashMap<String, IndexFn<K>> = HashMap::new();
        indexers.insert(
            BY_NAMESPACE.into(),
            Arc::new(|o: &K| o.meta().namespace.clone().into_iter().collect()),
        );
        indexers.insert(
            BY_LABEL.into(),
            Arc::new(|o: &K| o.labels().iter().map(|(k, v)| format!("{k}={v}")).collect()),
        );
        indexers.insert(
            BY_OWNER.into(),
            Arc::new(|o: &K| o.owner_references().iter().map(|r| r.uid.clone()).collect()),
        );
        Self {
            items: HashMap::new(),
            indices: indexers
                .keys()
                .map(|k| (k.clone(), HashMap::new()))
                .collect(),
            indexers,
        }
    }

    fn index(&mut self, key: &Arc<str>, obj: &K) {
        for (name, indexer) in &self.indexers {
            let index = self.indices.entry(name.clone()).or_default();
            for value in indexer(obj) {
                index.entry(value).or_default().insert(key.clone());
            }
        }
    }

    fn unindex(&mut self, key: &str, obj: &K) {
        for (name, indexer) in &self.indexers {
            let Some(index) = self.indices.get_mut(name) else {
                continue;
            };
            for value in indexer(obj) {
                if let Some(keys) = index.get_mut(&value) {
                    keys.remove(key);
                    if keys.is_empty() {
                        index.remove(&value);
                    }
                }
            }
        }
    }

    /// Stores `obj`; returns the object it replaced.
    fn put(&mut self, obj: Arc<K>) -> Option<Arc<K>> {
        self.put_at(key_of(obj.as_ref()).into(), obj)
    }

    /// Stores `obj` under `key` (its [`key_of`]); returns the object it replaced.
    fn put_at(&mut self, key: Arc<str>, obj: Arc<K>) -> Option<Arc<K>> {
        let old = self.items.insert(key.clone(), obj.clone());
        if let Some(old) = &old {
            self.unindex(&key, old);
        }
        self.index(&key, &obj);
        old
    }

    fn remove(&mut self, key: &str) -> Option<Arc<K>> {
        let old = self.items.remove(key)?;
        self.unindex(key, &old);
        Some(old)
    }
}

/// One shared informer: the store of a resource's objects, kept current by one
/// list+watch.
pub struct Informer<K> {
    /// What it watches, for logs.
    what: String,
    store: RwLock<Store<K>>,
    subscribers: Mutex<Vec<mpsc::UnboundedSender<Change<K>>>>,
    synced: watch::Sender<bool>,
    counters: Counters,
    task: Mutex<Option<AbortHandle>>,
    /// The highest resourceVersion the store reflects (see [`Informer::seen_revision`]).
    seen: AtomicU64,
}

impl<K> Debug for Informer<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Informer")
            .field("what", &self.what)
            .finish_non_exhaustive()
    }
}

impl<K> Drop for Informer<K> {
    fn drop(&mut self) {
        if let Some(task) = self.task.lock().unwrap_or_else(|e| e.into_inner()).take() {
            task.abort();
        }
    }
}

impl<K> Informer<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    fn new(what: String, metrics: &InformerMetrics) -> Self {
        Self {
            counters: metrics.of(&what),
            what,
            store: RwLock::new(Store::new()),
            subscribers: Mutex::new(Vec::new()),
            synced: watch::channel(false).0,
            task: Mutex::new(None),
            seen: AtomicU64::new(0),
        }
    }

    /// The highest resourceVersion among the changes the store has taken in: a write
    /// answered with resourceVersion `r` is reflected (or superseded) once this is at
    /// least `r`, since a watch delivers a resource's changes in revision order.
    /// Revisions are numbers on both of Trellis' stores; another value counts as 0.
    pub fn seen_revision(&self) -> u64 {
        self.seen.load(Ordering::Acquire)
    }

    fn saw(&self, obj: &K) {
        if let Some(rv) = obj
            .meta()
            .resource_version
            .as_deref()
            .and_then(|v| v.parse::<u64>().ok())
        {
            self.seen.fetch_max(rv, Ordering::AcqRel);
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Store<K>> {
        self.store.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the first list is in the store.
    pub fn has_synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// Waits until the first list is in the store.
    pub async fn wait_synced(&self) {
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// The object at `key` (`namespace/name`, or `name`).
    pub fn get(&self, key: &str) -> Option<Arc<K>> {
        self.read().items.get(key).cloned()
    }

    /// Every object cached.
    pub fn list(&self) -> Vec<Arc<K>> {
        self.read().items.values().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.read().items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The objects whose index `index` has `value`.
    pub fn by_index(&self, index: &str, value: &str) -> Vec<Arc<K>> {
        let store = self.read();
        store
            .indices
            .get(index)
            .and_then(|i| i.get(value))
            .map(|keys| {
                keys.iter()
                    .filter_map(|k| store.items.get(k).cloned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Adds (or replaces) index `name`, computed over what is cached now.
    pub fn add_index(&self, name: &str, indexer: IndexFn<K>) {
        let mut store = self.store.write().unwrap_or_else(|e| e.into_inner());
        let mut index: HashMap<String, HashSet<Arc<str>>> = HashMap::new();
        for (key, obj) in &store.items {
            for value in indexer(obj) {
                index.entry(value).or_default().insert(key.clone());
            }
        }
        store.indices.insert(name.to_owned(), index);
        store.indexers.insert(name.to_owned(), indexer);
    }

    /// Every change from now on, after an `Added` for each object already cached.
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<Change<K>> {
        let (tx, rx) = mpsc::unbounded_channel();
        // Under the store's lock: no change can slip between the replay and the
        // subscription.
        let store = self.read();
        for obj in store.items.values() {
            let _ = tx.send(Change::Added(obj.clone()));
        }
        self.subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(tx);
        drop(store);
        rx
    }

    /// How many lists (the first and every relist) the informer has made.
    pub fn lists(&self) -> u64 {
        self.counters.lists.get()
    }

    /// How many watch or list errors it has recovered from.
    pub fn errors(&self) -> u64 {
        self.counters.errors.get()
    }

    /// Hands `changes` to every subscriber; called under the store's write lock, so
    /// that subscribers see changes in the store's order.
    fn publish(&self, store: &Store<K>, changes: Vec<Change<K>>) {
        self.counters.count(&changes, store.items.len());
        if changes.is_empty() {
            return;
        }
        let mut subscribers = self.subscribers.lock().unwrap_or_else(|e| e.into_inner());
        subscribers.retain(|tx| changes.iter().all(|c| tx.send(c.clone()).is_ok()));
    }

    fn apply(&self, obj: K) {
        let obj = Arc::new(trim(obj));
        let mut store = self.store.write().unwrap_or_else(|e| e.into_inner());
        self.saw(&obj);
        let change = match store.put(obj.clone()) {
            Some(old) => Change::Updated { old, new: obj },
            None => Change::Added(obj),
        };
        self.publish(&store, vec![change]);
    }

    fn delete(&self, obj: K) {
        let key = key_of(&obj);
        let mut store = self.store.write().unwrap_or_else(|e| e.into_inner());
        self.saw(&obj);
        let last = store.remove(&key).unwrap_or_else(|| Arc::new(trim(obj)));
        self.publish(&store, vec![Change::Deleted(last)]);
    }

    /// Replaces the store by a complete list: what is gone is deleted, what changed
    /// (by resourceVersion) updated, what is new added.
    fn replace(&self, listed: Vec<Arc<K>>) {
        let mut store = self.store.write().unwrap_or_else(|e| e.into_inner());
        let mut changes = Vec::new();
        let mut seen: HashSet<Arc<str>> = HashSet::with_capacity(listed.len());
        for obj in listed {
            self.saw(&obj);
            let key: Arc<str> = key_of(obj.as_ref()).into();
            let unchanged = store.items.get(&key).is_some_and(|old| {
                old.meta().resource_version.is_some()
                    && old.meta().resource_version == obj.meta().resource_version
            });
            seen.insert(key.clone());
            if unchanged {
                continue;
            }
            changes.push(match store.put_at(key, obj.clone()) {
                Some(old) => Change::Updated { old, new: obj },
                None => Change::Added(obj),
            });
        }
        let gone: Vec<Arc<str>> = store
            .items
            .keys()
            .filter(|k| !seen.contains(*k))
            .cloned()
            .collect();
        for key in gone {
            if let Some(old) = store.remove(&key) {
                changes.push(Change::Deleted(old));
            }
        }
        self.publish(&store, changes);
        drop(store);
        self.counters.lists.inc();
        self.counters.synced.set(1);
        self.synced.send_replace(true);
    }

    fn start(self: &Arc<Self>, api: Api<K>, config: watcher::Config) {
        let weak = Arc::downgrade(self);
        let task = tokio::spawn(async move {
            let mut stream = watcher(api, config).default_backoff().boxed();
            // Listed objects wait in their final allocation (an `Arc`), not in a
            // vector of whole objects that would double the peak memory of a sync.
            let mut listing: Option<Vec<Arc<K>>> = None;
            while let Some(event) = stream.next().await {
                let Some(informer) = weak.upgrade() else {
                    return;
                };
                match event {
                    Ok(watcher::Event::Init) => listing = Some(Vec::new()),
                    Ok(watcher::Event::InitApply(obj)) => match &mut listing {
                        Some(list) => list.push(Arc::new(trim(obj))),
                        None => informer.apply(obj),
                    },
                    Ok(watcher::Event::InitDone) => {
                        informer.replace(listing.take().unwrap_or_default());
                    }
                    Ok(watcher::Event::Apply(obj)) => informer.apply(obj),
                    Ok(watcher::Event::Delete(obj)) => informer.delete(obj),
                    Err(e) => {
                        informer.counters.errors.inc();
                        warn!(informer = %informer.what, error = %e, "watch failed; retrying with backoff");
                    }
                }
            }
        });
        *self.task.lock().unwrap_or_else(|e| e.into_inner()) = Some(task.abort_handle());
    }
}

/// The informers of one process, shared by every component in it.
#[derive(Clone, Debug, Default)]
pub struct SharedInformers {
    informers: Arc<Mutex<HashMap<InformerKey, Arc<dyn Any + Send + Sync>>>>,
    metrics: InformerMetrics,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct InformerKey {
    kind: TypeId,
    url: String,
    labels: Option<String>,
    fields: Option<String>,
}

impl SharedInformers {
    pub fn new() -> Self {
        Self::default()
    }

    /// Informers whose metrics go to `metrics`.
    pub fn with_metrics(metrics: InformerMetrics) -> Self {
        Self {
            informers: Arc::default(),
            metrics,
        }
    }

    /// The metrics of this process's informers.
    pub fn metrics(&self) -> &InformerMetrics {
        &self.metrics
    }

    /// The informer of `api`'s resource (all namespaces, or the one `api` is for) with
    /// `config`'s selectors: the one already running in this process, or a new one,
    /// started now. The client `api` was made with is the one a new informer lists
    /// and watches with.
    pub fn informer<K>(&self, api: Api<K>, config: watcher::Config) -> Arc<Informer<K>>
    where
        K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    {
        let key = InformerKey {
            kind: TypeId::of::<K>(),
            url: api.resource_url().to_owned(),
            labels: config.label_selector.clone(),
            fields: config.field_selector.clone(),
        };
        let mut informers = self.informers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = informers
            .get(&key)
            .and_then(|i| i.clone().downcast::<Informer<K>>().ok())
        {
            return existing;
        }
        let informer = Arc::new(Informer::new(
            format!(
                "{}{}{}",
                key.url,
                key.labels
                    .as_deref()
                    .map(|l| format!(" labels={l}"))
                    .unwrap_or_default(),
                key.fields
                    .as_deref()
                    .map(|f| format!(" fields={f}"))
                    .unwrap_or_default(),
            ),
            &self.metrics,
        ));
        informer.start(api, config);
        informers.insert(key, informer.clone());
        informer
    }

    /// How many informers (hence watches) the process runs.
    pub fn len(&self) -> usize {
        self.informers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
