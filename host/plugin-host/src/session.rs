//! [`SchedulerSession`]: one instance of a scheduler plugin held by one scheduler,
//! and its calls, the `scheduler` world's exports, typed.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use wasmtime::Store;

use crate::bindings::scheduler::exports::trellis::scheduler::handler::Guest;
use crate::bindings::scheduler::trellis::scheduler::types::{
    Change, NodeId, PermitVerdict, PluginInfo, PluginScores, PreFilterResult, Rejection, Status,
};
use crate::engine::PluginHost;
use crate::error::{PluginError, PluginErrorKind};
use crate::plugin::{Instance, Plugin};
use crate::state::PluginState;
use crate::world::scheduler::Scheduler;

/// One instance of a scheduler plugin, held by one scheduler for as long as it
/// schedules with the plugin: the instance keeps its view of the cluster and the pod
/// of the cycle between calls, which therefore run one at a time, in the caller's
/// task (no hop to the call threads: a scheduling cycle makes several calls).
///
/// Each call has the plugin's deadline and memory cap. A call that fails (trap,
/// deadline, memory) ends the session: the instance cannot be entered again, and its
/// view is gone, so the scheduler starts a new session and sends the whole cluster.
pub struct SchedulerSession {
    plugin: Arc<Plugin>,
    instance: Option<Instance<Scheduler>>,
}

impl std::fmt::Debug for SchedulerSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulerSession")
            .field("plugin", &self.plugin.name())
            .field("alive", &self.instance.is_some())
            .finish()
    }
}

impl Plugin {
    /// A new instance of a scheduler plugin for one scheduler's own use. The session's
    /// calls run in the caller's task, not on `host`'s call threads: the plugin (loaded
    /// by `host`) is all it needs.
    pub async fn scheduler_session(
        self: &Arc<Self>,
        _host: &Arc<PluginHost>,
    ) -> Result<SchedulerSession, PluginError> {
        let Some(runner) = self.runner::<Scheduler>() else {
            return Err(self.not_of::<Scheduler>());
        };
        let instance = self.bounded(runner.take(self)).await?;
        Ok(SchedulerSession {
            plugin: self.clone(),
            instance: Some(instance),
        })
    }
}

impl SchedulerSession {
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.plugin
    }

    /// Whether the session can still be called: false after a failed call.
    pub fn is_alive(&self) -> bool {
        self.instance.is_some()
    }

    /// Whether the plugin now serves other code than the instance runs (it moved to
    /// optimized code): a new session would be faster.
    pub fn outdated(&self) -> bool {
        self.instance
            .as_ref()
            .is_some_and(|i| i.tier != self.plugin.tier())
    }

    /// Runs one call on the session's instance.
    pub(crate) async fn call<T>(
        &mut self,
        f: impl AsyncFnOnce(&Guest, &mut Store<PluginState>) -> wasmtime::Result<T>,
    ) -> Result<T, PluginError> {
        let plugin = self.plugin.clone();
        let Some(instance) = self.instance.as_mut() else {
            return Err(plugin.error(PluginErrorKind::Trapped(
                "the session ended with an earlier failure".into(),
            )));
        };
        plugin.metrics.calls.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        instance.arm(started + plugin.spec().timeout);
        let answer = plugin
            .bounded(async {
                let Instance { exports, store, .. } = &mut *instance;
                Ok(f(exports.handler(), store).await)
            })
            .await;
        let answer = match answer {
            Ok(answer) => answer,
            Err(e) => {
                plugin.metrics.errors.fetch_add(1, Ordering::Relaxed);
                self.instance = None;
                return Err(e);
            }
        };
        plugin.metrics.memory(instance.store.data().limits.peak);
        match answer {
            Ok(value) => {
                plugin.metrics.observe(started.elapsed());
                Ok(value)
            }
            Err(e) => {
                let e = plugin.failure(e, &instance.store);
                plugin.metrics.errors.fetch_add(1, Ordering::Relaxed);
                self.instance = None;
                Err(e)
            }
        }
    }
}

impl SchedulerSession {
    /// The plugins the component implements, with `configuration`; first of all.
    pub async fn plugins(
        &mut self,
        configuration: &str,
    ) -> Result<Result<Vec<PluginInfo>, String>, PluginError> {
        self.call(async |h, store| h.call_plugins(store, configuration).await)
            .await
    }

    pub async fn update(&mut self, changes: &[Change]) -> Result<(), PluginError> {
        self.call(async |h, store| h.call_update(store, changes).await)
            .await
    }

    pub async fn cycle(&mut self, pod: &str) -> Result<Vec<PreFilterResult>, PluginError> {
        self.call(async |h, store| h.call_cycle(store, pod).await)
            .await
    }

    pub async fn filter(&mut self, nodes: &[NodeId]) -> Result<Vec<Rejection>, PluginError> {
        self.call(async |h, store| h.call_filter(store, nodes).await)
            .await
    }

    pub async fn filter_without(
        &mut self,
        victims: &[String],
        nodes: &[NodeId],
    ) -> Result<Vec<Rejection>, PluginError> {
        self.call(async |h, store| h.call_filter_without(store, victims, nodes).await)
            .await
    }

    pub async fn score(
        &mut self,
        nodes: &[NodeId],
    ) -> Result<Result<Vec<PluginScores>, String>, PluginError> {
        self.call(async |h, store| h.call_score(store, nodes).await)
            .await
    }

    pub async fn reserve(&mut self, node: NodeId) -> Result<Status, PluginError> {
        self.call(async |h, store| h.call_reserve(store, node).await)
            .await
    }

    pub async fn unreserve(&mut self, pod_uid: &str, node: NodeId) -> Result<(), PluginError> {
        self.call(async |h, store| h.call_unreserve(store, pod_uid, node).await)
            .await
    }

    pub async fn permit(&mut self, node: NodeId) -> Result<PermitVerdict, PluginError> {
        self.call(async |h, store| h.call_permit(store, node).await)
            .await
    }

    pub async fn allowed(&mut self) -> Result<Vec<String>, PluginError> {
        self.call(async |h, store| h.call_allowed(store).await)
            .await
    }
}
