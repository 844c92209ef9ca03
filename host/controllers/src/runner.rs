//! One controller plugin at work: its resources resolved through discovery, their
//! shared informers, the changes mapped to keys of its primary resource (an owned
//! object's change to its controlling owner's key), a work queue, and workers that
//! call `reconcile` (never two at once for one key) and act on the answer.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use kube::api::{Api, DynamicObject};
use kube::core::GroupVersion;
use kube::runtime::watcher;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};
use trellis_client::events::EventRecorder;
use trellis_client::informer::{Change, Informer, SharedInformers};
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
            workers: 2,
            resync: None,
            rate_limits: RateLimits::default(),
            expectations_timeout: Duration::from_secs(300),
        }
    }
}

/// A key of the primary resource.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub namespace: Option<String>,
    pub name: String,
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{ns}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

fn key_of(obj: &DynamicObject) -> Key {
    Key {
        namespace: obj.metadata.namespace.clone().filter(|n| !n.is_empty()),
        name: obj.metadata.name.clone().unwrap_or_default(),
    }
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

    /// Loads the controller's plugin and runs it until `shutdown` (or
    /// [`Running::stop`]): writes through `writer` (the controller's own identity),
    /// events through `events`.
    pub async fn start(
        &self,
        config: ControllerConfig,
        writer: kube::Client,
        events: EventRecorder,
        shutdown: watch::Receiver<bool>,
    ) -> anyhow::Result<Running> {
        check(&config)?;
        let name = config.spec.name.clone();
        let primary = self.resolve(&config.primary).await?;
        let mut caches = HashMap::new();
        for gvr in std::iter::once(&config.primary).chain(&config.owns) {
            let resolved = if gvr_key(gvr) == gvr_key(&config.primary) {
                primary.clone()
            } else {
                self.resolve(gvr).await?
            };
            let informer = self.informers.informer::<DynamicObject>(
                Api::all_with(self.lister.clone(), &resolved.resource),
                watcher::Config::default(),
            );
            caches.insert(gvr_key(gvr), (resolved, informer));
        }
        let expectations = Arc::new(Expectations::new(config.expectations_timeout));
        let host = KubeHost {
            name: name.clone(),
            client: writer,
            caches: caches.clone(),
            events,
            primary: Primary {
                gvr: gvr_key(&config.primary),
                api_version: primary.resource.api_version.clone(),
                kind: primary.resource.kind.clone(),
            },
            expectations: expectations.clone(),
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
        // Reconciling from half a cache would delete what is merely not listed yet.
        for (_, informer) in caches.values() {
            informer.wait_synced().await;
        }

        let queue = WorkQueue::with_limits(&name, &self.queues, config.rate_limits);
        let mut tasks = JoinSet::new();
        let mut workers = JoinSet::new();
        let (_, primary_informer) = &caches[&gvr_key(&config.primary)];
        let mut changes = primary_informer.subscribe();
        let q = queue.clone();
        tasks.spawn(async move {
            while let Some(change) = changes.recv().await {
                q.add(key_of(change.object()));
            }
        });
        for owned in &config.owns {
            if gvr_key(owned) == gvr_key(&config.primary) {
                continue;
            }
            let (_, informer) = &caches[&gvr_key(owned)];
            let mut changes = informer.subscribe();
            let q = queue.clone();
            let kind = primary.resource.kind.clone();
            let api_version = primary.resource.api_version.clone();
            tasks.spawn(async move {
                while let Some(change) = changes.recv().await {
                    let objects = match &change {
                        Change::Updated { old, new } => vec![old.clone(), new.clone()],
                        other => vec![other.object().clone()],
                    };
                    for obj in objects {
                        for owner in obj.metadata.owner_references.iter().flatten() {
                            if owner.controller == Some(true)
                                && owner.kind == kind
                                && owner.api_version == api_version
                            {
                                q.add(Key {
                                    namespace: obj.metadata.namespace.clone(),
                                    name: owner.name.clone(),
                                });
                            }
                        }
                    }
                }
            });
        }
        if let Some(every) = config.resync {
            let q = queue.clone();
            let informer = primary_informer.clone();
            tasks.spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    for obj in informer.list() {
                        q.add(key_of(&obj));
                    }
                }
            });
        }
        for _ in 0..config.workers.max(1) {
            workers.spawn(work(
                queue.clone(),
                plugin.clone(),
                self.plugins.clone(),
                config.primary.clone(),
                primary_informer.clone(),
                expectations.clone(),
            ));
        }
        let q = queue.clone();
        let mut shutdown = shutdown;
        tasks.spawn(async move {
            let _ = shutdown.wait_for(|s| *s).await;
            q.shut_down();
        });
        info!(controller = %name, primary = %gvr_key(&config.primary), workers = config.workers, "controller running");
        Ok(Running {
            plugin,
            queue,
            workers,
            feeders: tasks,
        })
    }
}

/// One worker: takes keys until the queue shuts down.
async fn work(
    queue: WorkQueue<Key>,
    plugin: Arc<Plugin>,
    host: Arc<PluginHost>,
    resource: GroupVersionResource,
    primary: Arc<Informer<DynamicObject>>,
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
        let object = ObjectKey {
            resource: resource.clone(),
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
        if primary.get(&key.to_string()).is_none() {
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
    if config.primary.resource.is_empty() || config.primary.version.is_empty() {
        bail!("controller {}: no primary resource", config.spec.name);
    }
    Ok(())
}
