//! One controller plugin at work: its resources resolved through discovery, their
//! shared informers, the changes mapped to keys of its primary resource (an owned
//! object's change to its controlling owner's key), a work queue, and workers that
//! call `reconcile` (never two at once for one key) and act on the answer.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DynamicObject};
use kube::core::GroupVersion;
use kube::discovery::verbs;
use kube::runtime::watcher;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};
use trellis_api::selector::LabelSelector;
use trellis_client::events::EventRecorder;
use trellis_client::informer::{BY_NAMESPACE, BY_OWNER, Change, Informer, SharedInformers};
use trellis_client::workqueue::{QueueMetrics, RateLimits, WorkQueue};
use trellis_plugin_host::{
    Action, GroupVersionResource, ObjectKey, Plugin, PluginHost, PluginKind, PluginSpec,
};

use crate::expectations::Expectations;
use crate::host::{KubeHost, Primary, Resolved, gvr_key};

/// How often a key waiting for its writes to reach the caches is looked at again
/// when no change brings it back sooner.
const EXPECTATIONS_RECHECK: Duration = Duration::from_secs(10);

/// A controller to run.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// Its name (its identity is `system:serviceaccount:kube-system:NAME`), its
    /// configuration, deadline and memory cap; the kind is `controller`.
    pub spec: PluginSpec,
    /// The component.
    pub wasm: Arc<Vec<u8>>,
    /// The resource whose objects it reconciles.
    pub primary: GroupVersionResource,
    /// Resources whose objects it owns: a change of one reconciles its controlling
    /// owner (the ownerReference with `controller: true` of the primary's kind).
    pub owns: Vec<GroupVersionResource>,
    /// Other resources it reads, each with how a change of one maps to keys of the
    /// primary resource.
    pub watches: Vec<Watch>,
    /// Keys reconciled at once.
    pub workers: usize,
    /// Every primary object is reconciled again this often, changed or not.
    pub resync: Option<Duration>,
    /// The queue's back-off after failures.
    pub rate_limits: RateLimits,
    /// How long a key waits at most for the caches to show its last writes.
    pub expectations_timeout: Duration,
}

impl ControllerConfig {
    pub fn new(name: &str, wasm: Arc<Vec<u8>>, primary: GroupVersionResource) -> Self {
        let mut spec = PluginSpec::new(name, PluginKind::Controller);
        // A reconcile waits on writes through the API server, unlike an admission
        // call: seconds, not milliseconds.
        spec.timeout = Duration::from_secs(10);
        Self {
            spec,
            wasm,
            primary,
            owns: Vec::new(),
            watches: Vec::new(),
            workers: 2,
            resync: None,
            rate_limits: RateLimits::default(),
            expectations_timeout: Duration::from_secs(300),
        }
    }
}

/// A resource a controller watches beside its primary and owned ones.
#[derive(Clone, Debug)]
pub struct Watch {
    pub resource: GroupVersionResource,
    pub map: Mapping,
}

/// How a change of a watched object becomes keys of the primary resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapping {
    /// Every owner of the primary's kind its ownerReferences name (controller or not).
    Owner,
    /// The primary object named as the object's namespace: a change inside a
    /// namespace reconciles the Namespace.
    Namespace,
    /// The primary object of the same name (in the same namespace when the primary
    /// is namespaced): a node's Lease reconciles the Node.
    Name,
    /// None: the resource is only read (cached for the controller's reads).
    Cache,
    /// The primary objects in the object's namespace whose `spec.selector` (a label
    /// map, as a Service's, or `matchLabels`/`matchExpressions`) selects its labels:
    /// a pod reconciles the Services that route to it.
    Selector,
    /// Every primary object in the object's namespace: a pod's change reconciles its
    /// namespace's quotas.
    Namespaced,
}

impl Mapping {
    /// Its name in a Plugin's `spec.controller.watches[].map`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Owner => "owner",
            Self::Namespace => "namespace",
            Self::Name => "name",
            Self::Cache => "cache",
            Self::Selector => "selector",
            Self::Namespaced => "namespaced",
        }
    }
}

impl std::str::FromStr for Mapping {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "owner" => Ok(Self::Owner),
            "namespace" => Ok(Self::Namespace),
            "name" => Ok(Self::Name),
            "cache" => Ok(Self::Cache),
            "selector" => Ok(Self::Selector),
            "namespaced" => Ok(Self::Namespaced),
            other => Err(format!(
                "Unsupported value: {other:?}: supported values: \"owner\", \"namespace\", \"name\", \"cache\", \"selector\", \"namespaced\""
            )),
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
        crate::host::object_key(self.namespace.as_deref(), &self.name)
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.resource, self.cache_key())
    }
}

fn key_of(resource: &Arc<str>, obj: &DynamicObject) -> Key {
    Key {
        resource: resource.clone(),
        namespace: obj.metadata.namespace.clone().filter(|n| !n.is_empty()),
        name: obj.metadata.name.clone().unwrap_or_default(),
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
    fn insert(
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
    fn owners_of(&self, obj: &DynamicObject) -> Vec<Key> {
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
    fn owners_present(&self, obj: &DynamicObject) -> bool {
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
    fn controller_of(&self, obj: &DynamicObject) -> Option<Key> {
        let reference = obj
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|r| r.controller == Some(true))?;
        self.owner_key(obj, reference)
    }

    /// The keys of every cached object whose ownerReferences name `uid`.
    fn dependents_of(&self, uid: &str) -> Vec<Key> {
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
    fn new(caches: Caches) -> Self {
        Self(Arc::new(std::sync::RwLock::new(Arc::new(caches))))
    }

    /// The caches now.
    pub fn current(&self) -> Arc<Caches> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn replace(&self, caches: Caches) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(caches);
    }
}

/// Whether a resource is the wildcard of a controller of every resource (`*`).
pub fn is_every(gvr: &GroupVersionResource) -> bool {
    gvr.resource == "*"
}

/// The mapping of the controller's watch of `*` (every resource: each change that
/// removes something mapped), if it has one.
fn watch_of_every(config: &ControllerConfig) -> Option<Mapping> {
    config
        .watches
        .iter()
        .find(|w| is_every(&w.resource))
        .map(|w| w.map)
}

/// The process's controller manager: the plugin host, the shared informers (listing
/// and watching as the controller manager), and the queues' metrics.
#[derive(Clone)]
pub struct Manager {
    pub plugins: Arc<PluginHost>,
    pub informers: SharedInformers,
    /// Lists and watches for the informers, and resolves resources.
    pub lister: kube::Client,
    pub queues: QueueMetrics,
    /// The plugins of the controllers it runs, for their call metrics.
    pub running: RunningPlugins,
}

/// The plugins of the running controllers (those stopped drop out).
#[derive(Clone, Debug, Default)]
pub struct RunningPlugins(Arc<std::sync::Mutex<Vec<std::sync::Weak<Plugin>>>>);

impl RunningPlugins {
    fn add(&self, plugin: &Arc<Plugin>) {
        let mut list = self.0.lock().unwrap_or_else(|e| e.into_inner());
        list.retain(|p| p.strong_count() > 0);
        list.push(Arc::downgrade(plugin));
    }

    /// The plugins still running.
    pub fn list(&self) -> Vec<Arc<Plugin>> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect()
    }

    /// Their calls, denials, errors, timeouts and latencies, as the API server
    /// exposes its admission plugins' (`trellis_plugin_*`, by plugin).
    pub fn render(&self, out: &mut String) {
        trellis_plugin_host::render_metrics(out, &self.list());
    }
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager").finish_non_exhaustive()
    }
}

/// A running controller.
#[derive(Debug)]
pub struct Running {
    pub plugin: Arc<Plugin>,
    pub queue: WorkQueue<Key>,
    /// The workers: they end once the queue is shut down and drained.
    workers: JoinSet<()>,
    /// What feeds the queue (change handlers, resync): they run until aborted.
    feeders: JoinSet<()>,
}

impl Running {
    /// Stops taking keys, lets the reconciles in flight finish, and ends the tasks.
    pub async fn stop(mut self) {
        self.feeders.abort_all();
        self.queue.shut_down();
        while self.workers.join_next().await.is_some() {}
    }
}

impl Manager {
    /// The resource `gvr` names, as discovery describes it.
    async fn resolve(&self, gvr: &GroupVersionResource) -> anyhow::Result<Resolved> {
        let group = kube::discovery::pinned_group(
            &self.lister,
            &GroupVersion::gv(&gvr.group, &gvr.version),
        )
        .await
        .with_context(|| format!("discover {}", gvr_key(gvr)))?;
        group
            .versioned_resources(&gvr.version)
            .into_iter()
            .find(|(r, _)| r.plural == gvr.resource)
            .map(|(r, caps)| Resolved::new(r, &caps))
            .with_context(|| format!("the API server serves no {}", gvr_key(gvr)))
    }

    /// Every resource the API server serves that can be listed, watched and deleted,
    /// events excepted: what a controller of every resource (the garbage collector)
    /// reads.
    async fn resolve_every(&self) -> anyhow::Result<Vec<(GroupVersionResource, Resolved)>> {
        let discovery = kube::Discovery::new(self.lister.clone())
            .run()
            .await
            .context("discover the API server's resources")?;
        let mut resources = Vec::new();
        for group in discovery.groups() {
            for (resource, caps) in group.recommended_resources() {
                let usable = [verbs::LIST, verbs::WATCH, verbs::DELETE]
                    .iter()
                    .all(|v| caps.supports_operation(v));
                if !usable || resource.plural == "events" {
                    continue;
                }
                let gvr = GroupVersionResource {
                    group: resource.group.clone(),
                    version: resource.version.clone(),
                    resource: resource.plural.clone(),
                };
                resources.push((gvr, Resolved::new(resource, &caps)));
            }
        }
        Ok(resources)
    }

    /// Loads the controller's plugin and runs it until `shutdown` (or
    /// [`Running::stop`]): writes through `writer` (the controller's own identity),
    /// events through `events`. [`Manager::load`] then [`Loaded::run`].
    pub async fn start(
        &self,
        config: ControllerConfig,
        writer: kube::Client,
        events: EventRecorder,
        shutdown: watch::Receiver<bool>,
    ) -> anyhow::Result<Running> {
        Ok(self.load(config, writer, events, shutdown).await?.run())
    }

    /// Loads the controller's plugin and waits until its caches have synced, but
    /// reconciles nothing yet: what replaces a running controller is loaded first,
    /// so that a version that cannot load leaves the running one alone, and the
    /// running one is stopped only before the new one runs, never two at once.
    pub async fn load(
        &self,
        config: ControllerConfig,
        writer: kube::Client,
        events: EventRecorder,
        shutdown: watch::Receiver<bool>,
    ) -> anyhow::Result<Loaded> {
        check(&config)?;
        let name = config.spec.name.clone();
        let every = is_every(&config.primary);
        let watch_every = watch_of_every(&config);
        let resources = if every {
            self.resolve_every().await?
        } else {
            let mut resources = Vec::new();
            let watched = config
                .watches
                .iter()
                .map(|w| &w.resource)
                .filter(|r| !is_every(r));
            for gvr in std::iter::once(&config.primary)
                .chain(&config.owns)
                .chain(watched)
            {
                if !resources.iter().any(|(r, _)| gvr_key(r) == gvr_key(gvr)) {
                    resources.push((gvr.clone(), self.resolve(gvr).await?));
                }
            }
            if watch_every.is_some() {
                for (gvr, resolved) in self.resolve_every().await? {
                    if !resources.iter().any(|(r, _)| gvr_key(r) == gvr_key(&gvr)) {
                        resources.push((gvr, resolved));
                    }
                }
            }
            resources
        };
        let mut caches = Caches::default();
        for (gvr, resolved) in resources {
            let informer = self.informers.informer::<DynamicObject>(
                Api::all_with(self.lister.clone(), &resolved.resource),
                watcher::Config::default(),
            );
            caches.insert(gvr, resolved, informer);
        }
        let caches = Arc::new(caches);
        let shared = SharedCaches::new(Caches::clone(&caches));
        let expectations = Arc::new(Expectations::new(config.expectations_timeout));
        let primary = if every {
            None
        } else {
            let cached = &caches.by_resource[&gvr_key(&config.primary)];
            Some(Primary {
                gvr: gvr_key(&config.primary),
                api_version: cached.resolved.resource.api_version.clone(),
                kind: cached.resolved.resource.kind.clone(),
            })
        };
        let host = KubeHost {
            name: name.clone(),
            client: writer,
            caches: shared.clone(),
            events,
            primary,
            expectations: expectations.clone(),
            runtime: tokio::runtime::Handle::current(),
        };
        let plugin = self
            .plugins
            .load_controller(
                config.spec.clone(),
                config.wasm.clone(),
                Arc::new(host),
                None,
            )
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "load controller {name}: {} ({})",
                    e.message,
                    e.reason.as_str()
                )
            })?;
        self.running.add(&plugin);
        // Reconciling from half a cache would delete what is merely not listed yet.
        for cached in caches.by_resource.values() {
            cached.informer.wait_synced().await;
        }
        Ok(Loaded {
            manager: self.clone(),
            config,
            plugin,
            caches,
            shared,
            expectations,
            shutdown,
        })
    }
}

/// A controller loaded, its caches synced, that reconciles nothing until
/// [`Loaded::run`]; dropped, it never runs.
pub struct Loaded {
    manager: Manager,
    config: ControllerConfig,
    plugin: Arc<Plugin>,
    caches: Arc<Caches>,
    shared: SharedCaches,
    expectations: Arc<Expectations>,
    shutdown: watch::Receiver<bool>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("plugin", &self.plugin.name())
            .finish_non_exhaustive()
    }
}

impl Loaded {
    /// The plugin loaded.
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.plugin
    }

    /// Feeds the work queue from the caches (a subscription replays every cached
    /// object, so nothing changed while loading is missed) and starts the workers.
    pub fn run(self) -> Running {
        let Loaded {
            manager,
            config,
            plugin,
            caches,
            shared,
            expectations,
            shutdown,
        } = self;
        let name = config.spec.name.clone();
        let every = is_every(&config.primary);
        let watch_every = watch_of_every(&config);
        let queue = WorkQueue::with_limits(&name, &manager.queues, config.rate_limits);
        let mut tasks = JoinSet::new();
        let mut workers = JoinSet::new();
        if every {
            for (resource, cached) in &caches.by_resource {
                let changes = cached.informer.subscribe();
                tasks.spawn(feed_every(
                    resource.as_str().into(),
                    changes,
                    shared.clone(),
                    queue.clone(),
                ));
            }
            tasks.spawn(follow_resources(
                manager.clone(),
                shared.clone(),
                queue.clone(),
                Feed::Every,
            ));
        } else {
            let primary_key: Arc<str> = gvr_key(&config.primary).into();
            let mut changes = caches.by_resource[&*primary_key].informer.subscribe();
            let q = queue.clone();
            let resource = primary_key.clone();
            tasks.spawn(async move {
                while let Some(change) = changes.recv().await {
                    q.add(key_of(&resource, change.object()));
                }
            });
            for owned in &config.owns {
                if gvr_key(owned) == *primary_key {
                    continue;
                }
                let mut changes = caches.by_resource[&gvr_key(owned)].informer.subscribe();
                let q = queue.clone();
                let caches = caches.clone();
                let primary_key = primary_key.clone();
                tasks.spawn(async move {
                    while let Some(change) = changes.recv().await {
                        let objects = match &change {
                            Change::Updated { old, new } => vec![old.clone(), new.clone()],
                            other => vec![other.object().clone()],
                        };
                        for obj in objects {
                            if let Some(key) = caches.controller_of(&obj)
                                && key.resource == primary_key
                            {
                                q.add(key);
                            }
                        }
                    }
                });
            }
            let primary_cached = caches.by_resource[&*primary_key].clone();
            let target = MapTarget {
                primary: primary_key.clone(),
                cache: primary_cached.informer.clone(),
                namespaced: primary_cached.resolved.namespaced,
                api_version: primary_cached.resolved.resource.api_version.clone(),
                kind: primary_cached.resolved.resource.kind.clone(),
            };
            for watch in config
                .watches
                .iter()
                .filter(|w| w.map != Mapping::Cache && !is_every(&w.resource))
            {
                let changes = caches.by_resource[&gvr_key(&watch.resource)]
                    .informer
                    .subscribe();
                tasks.spawn(feed_mapped(
                    changes,
                    watch.map,
                    false,
                    target.clone(),
                    queue.clone(),
                ));
            }
            if let Some(map) = watch_every.filter(|m| *m != Mapping::Cache) {
                for (resource, cached) in &caches.by_resource {
                    if *resource == *primary_key {
                        continue;
                    }
                    let changes = cached.informer.subscribe();
                    tasks.spawn(feed_mapped(
                        changes,
                        map,
                        true,
                        target.clone(),
                        queue.clone(),
                    ));
                }
                tasks.spawn(follow_resources(
                    manager.clone(),
                    shared.clone(),
                    queue.clone(),
                    Feed::Mapped(map, target.clone()),
                ));
            }
            if let Some(every) = config.resync {
                let q = queue.clone();
                let informer = caches.by_resource[&*primary_key].informer.clone();
                tasks.spawn(async move {
                    let mut tick = tokio::time::interval(every);
                    tick.tick().await;
                    loop {
                        tick.tick().await;
                        for obj in informer.list() {
                            q.add(key_of(&primary_key, &obj));
                        }
                    }
                });
            }
        }
        for _ in 0..config.workers.max(1) {
            workers.spawn(work(
                queue.clone(),
                plugin.clone(),
                manager.plugins.clone(),
                shared.clone(),
                expectations.clone(),
            ));
        }
        let q = queue.clone();
        let mut shutdown = shutdown;
        tasks.spawn(async move {
            let _ = shutdown.wait_for(|s| *s).await;
            q.shut_down();
        });
        info!(controller = %name, primary = %gvr_key(&config.primary), resources = caches.by_resource.len(), workers = config.workers, "controller running");
        Running {
            plugin,
            queue,
            workers,
            feeders: tasks,
        }
    }
}

/// The keys a change brings for a controller of every resource, as the garbage
/// collector needs them: the object itself when its owners or its finalizers may
/// call for work (it was added, its ownerReferences changed, or it is being
/// deleted), its owners when it goes or its references change (an owner deleted in
/// the foreground waits for it), and its dependents when it is deleted.
async fn feed_every(
    resource: Arc<str>,
    mut changes: tokio::sync::mpsc::UnboundedReceiver<Change<DynamicObject>>,
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

/// How the changes of a resource found later feed the queue.
enum Feed {
    /// As a controller of every resource's ([`feed_every`]).
    Every,
    /// Through a mapping to primary keys, removals only (a watch of `*`).
    Mapped(Mapping, MapTarget),
}

/// The primary resource a watch maps to.
#[derive(Clone, Debug)]
struct MapTarget {
    primary: Arc<str>,
    /// The primary resource's cache, for the `selector` and `namespaced` mappings.
    cache: Arc<Informer<DynamicObject>>,
    namespaced: bool,
    api_version: String,
    kind: String,
}

/// Feeds the keys a watched resource's changes map to. With `removals`, only the
/// changes that remove something count: a delete, a deletion started, finalizers
/// changed on an object being deleted (what a namespace being emptied waits for).
async fn feed_mapped(
    mut changes: tokio::sync::mpsc::UnboundedReceiver<Change<DynamicObject>>,
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

/// How often a controller of every resource looks for resources served since it
/// started, when no CustomResourceDefinition change tells it sooner.
const DISCOVERY_RESYNC: Duration = Duration::from_secs(30);

/// For a controller of every resource: the resources served later (a new
/// CustomResourceDefinition) get informers and join its caches and its feed. Looks
/// again on every change of a CustomResourceDefinition (and a moment later, as
/// discovery may serve the resource after the change), and every
/// [`DISCOVERY_RESYNC`].
async fn follow_resources(
    manager: Manager,
    shared: SharedCaches,
    queue: WorkQueue<Key>,
    feed: Feed,
) {
    let crds = manager.informers.informer::<DynamicObject>(
        Api::all_with(
            manager.lister.clone(),
            &kube::api::ApiResource {
                group: "apiextensions.k8s.io".into(),
                version: "v1".into(),
                api_version: "apiextensions.k8s.io/v1".into(),
                kind: "CustomResourceDefinition".into(),
                plural: "customresourcedefinitions".into(),
            },
        ),
        watcher::Config::default(),
    );
    let mut changes = crds.subscribe();
    let mut feeds = JoinSet::new();
    let mut again: Option<tokio::time::Instant> = None;
    // After a CustomResourceDefinition changes, discovery may serve its resource a
    // moment later: looked at again after 1, 2, 4 and 8 s until it appears.
    let mut retry = Duration::ZERO;
    loop {
        let later = async {
            match again {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            change = changes.recv() => {
                if change.is_none() {
                    return;
                }
                while changes.try_recv().is_ok() {}
                retry = Duration::from_secs(1);
                again = Some(tokio::time::Instant::now() + retry);
            }
            () = later => {
                retry *= 2;
                again = (retry <= Duration::from_secs(8))
                    .then(|| tokio::time::Instant::now() + retry);
            }
            () = tokio::time::sleep(DISCOVERY_RESYNC) => {}
        }
        let found = match manager.resolve_every().await {
            Ok(found) => found,
            Err(e) => {
                warn!(error = %format!("{e:#}"), "discovering new resources failed; trying again later");
                continue;
            }
        };
        let mut caches = Caches::clone(&shared.current());
        let mut added = Vec::new();
        let mut new_kinds: Vec<(String, String)> = Vec::new();
        for (gvr, resolved) in found {
            let key = gvr_key(&gvr);
            if caches.by_resource.contains_key(&key) {
                continue;
            }
            let informer = manager.informers.informer::<DynamicObject>(
                Api::all_with(manager.lister.clone(), &resolved.resource),
                watcher::Config::default(),
            );
            // One that cannot be listed must not hold up the others.
            if tokio::time::timeout(DISCOVERY_RESYNC, informer.wait_synced())
                .await
                .is_err()
            {
                warn!(resource = %key, "a new resource did not sync; left out until the next look");
                continue;
            }
            new_kinds.push((
                resolved.resource.api_version.clone(),
                resolved.resource.kind.clone(),
            ));
            caches.insert(gvr, resolved, informer.clone());
            added.push((key, informer));
        }
        if added.is_empty() {
            continue;
        }
        again = None;
        shared.replace(caches);
        for (resource, informer) in added {
            info!(%resource, "a new resource joins the caches");
            match &feed {
                Feed::Every => feeds.spawn(feed_every(
                    resource.as_str().into(),
                    informer.subscribe(),
                    shared.clone(),
                    queue.clone(),
                )),
                Feed::Mapped(map, target) => feeds.spawn(feed_mapped(
                    informer.subscribe(),
                    *map,
                    true,
                    target.clone(),
                    queue.clone(),
                )),
            };
        }
        // Objects owned by one of the new kinds were judged while their owners'
        // kind was unknown: they are judged again.
        if matches!(feed, Feed::Every) {
            let caches = shared.current();
            for (resource, cached) in &caches.by_resource {
                let resource: Arc<str> = resource.as_str().into();
                for obj in cached.informer.list() {
                    let owned_by_new = obj.metadata.owner_references.iter().flatten().any(|r| {
                        new_kinds
                            .iter()
                            .any(|(v, k)| *v == r.api_version && *k == r.kind)
                    });
                    if owned_by_new {
                        queue.add(key_of(&resource, &obj));
                    }
                }
            }
        }
    }
}

/// One worker: takes keys until the queue shuts down.
async fn work(
    queue: WorkQueue<Key>,
    plugin: Arc<Plugin>,
    host: Arc<PluginHost>,
    shared: SharedCaches,
    expectations: Arc<Expectations>,
) {
    while let Some(key) = queue.get().await {
        if let Err(timeout) = expectations.check(&key) {
            // The change that meets the expectation brings the key back; the timeout
            // is the backstop.
            debug!(controller = plugin.name(), %key, "waiting for the cache to show the last writes");
            queue.done(&key);
            queue.add_after(key, timeout.min(EXPECTATIONS_RECHECK));
            continue;
        }
        let caches = shared.current();
        let Some(cached) = caches.by_resource.get(&*key.resource) else {
            queue.done(&key);
            continue;
        };
        let object = ObjectKey {
            resource: cached.gvr.clone(),
            namespace: key.namespace.clone(),
            name: key.name.clone(),
        };
        match plugin.reconcile(&host, &object).await {
            Ok(Ok(Action::Done)) => {
                debug!(controller = plugin.name(), %key, "reconciled");
                queue.forget(&key);
            }
            Ok(Ok(Action::RequeueAfter(ms))) => {
                debug!(controller = plugin.name(), %key, ms, "reconciled; again later");
                queue.forget(&key);
                queue.add_after(key.clone(), Duration::from_millis(ms));
            }
            Ok(Err(reason)) => {
                warn!(controller = plugin.name(), %key, retries = queue.num_requeues(&key), %reason, "reconcile failed; retrying with back-off");
                queue.add_rate_limited(key.clone());
            }
            Err(e) => {
                warn!(controller = plugin.name(), %key, error = %e, "reconcile failed in the plugin; retrying with back-off");
                queue.add_rate_limited(key.clone());
            }
        }
        if cached.informer.get(&key.cache_key()).is_none() {
            expectations.forget(&key);
        }
        queue.done(&key);
    }
}

/// Checks that `config` can run: a name, a primary resource, workers.
pub fn check(config: &ControllerConfig) -> anyhow::Result<()> {
    if config.spec.name.is_empty() {
        bail!("a controller needs a name");
    }
    if !is_every(&config.primary)
        && (config.primary.resource.is_empty() || config.primary.version.is_empty())
    {
        bail!("controller {}: no primary resource", config.spec.name);
    }
    Ok(())
}
