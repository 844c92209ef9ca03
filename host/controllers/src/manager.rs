//! The controller manager ([`Manager`]): loads a controller's plugin over synced
//! caches ([`Manager::load`], [`Loaded`]), then feeds its work queue and starts its
//! workers ([`Loaded::run`], [`Running`]).

use std::sync::Arc;

use kube::api::{Api, DynamicObject};
use kube::runtime::watcher;
use tokio::task::JoinSet;
use tracing::info;
use trellis_api::Shutdown;
use trellis_client::events::EventRecorder;
use trellis_client::informer::SharedInformers;
use trellis_client::workqueue::{QueueMetrics, WorkQueue};
use trellis_plugin_host::{Plugin, PluginHost};

use crate::cache::{Caches, SharedCaches};
use crate::config::{ControllerConfig, Mapping, check, is_every, watch_of_every};
use crate::discovery::{Feed, follow_resources, resolve, resolve_every};
use crate::expectations::Expectations;
use crate::handler::{MapTarget, feed_every, feed_mapped, feed_owned, feed_primary, resync};
use crate::imports::{KubeHost, Primary};
use crate::key::{Key, gvr_key};
use crate::worker::work;

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
    /// Loads the controller's plugin and runs it until `shutdown` (or
    /// [`Running::stop`]): writes through `writer` (the controller's own identity),
    /// events through `events`. [`Manager::load`] then [`Loaded::run`].
    pub async fn start(
        &self,
        config: ControllerConfig,
        writer: kube::Client,
        events: EventRecorder,
        shutdown: Shutdown,
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
        shutdown: Shutdown,
    ) -> anyhow::Result<Loaded> {
        check(&config)?;
        let name = config.spec.name.clone();
        let every = is_every(&config.primary);
        let watch_every = watch_of_every(&config);
        let resources = if every {
            resolve_every(&self.lister).await?
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
                    resources.push((gvr.clone(), resolve(&self.lister, gvr).await?));
                }
            }
            if watch_every.is_some() {
                for (gvr, resolved) in resolve_every(&self.lister).await? {
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
    shutdown: Shutdown,
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
                manager.informers.clone(),
                manager.lister.clone(),
                shared.clone(),
                queue.clone(),
                Feed::Every,
            ));
        } else {
            let primary_key: Arc<str> = gvr_key(&config.primary).into();
            let changes = caches.by_resource[&*primary_key].informer.subscribe();
            tasks.spawn(feed_primary(primary_key.clone(), changes, queue.clone()));
            for owned in &config.owns {
                if gvr_key(owned) == *primary_key {
                    continue;
                }
                let changes = caches.by_resource[&gvr_key(owned)].informer.subscribe();
                tasks.spawn(feed_owned(
                    changes,
                    caches.clone(),
                    primary_key.clone(),
                    queue.clone(),
                ));
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
                    manager.informers.clone(),
                    manager.lister.clone(),
                    shared.clone(),
                    queue.clone(),
                    Feed::Mapped(map, target.clone()),
                ));
            }
            if let Some(every) = config.resync {
                let informer = caches.by_resource[&*primary_key].informer.clone();
                tasks.spawn(resync(informer, primary_key, every, queue.clone()));
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
        tasks.spawn(async move {
            shutdown.wait().await;
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
