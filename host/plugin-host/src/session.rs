//! The calls of a [`SchedulerSession`]: the `scheduler` world's exports, typed.

use crate::bindings::scheduler::trellis::scheduler::types::{
    Change, NodeId, PermitVerdict, PluginInfo, PluginScores, PreFilterResult, Rejection, Status,
};
use crate::plugin::{PluginError, SchedulerSession};

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
