//! What a plugin is granted beyond WASI with nothing in it: cluster reads, and for a
//! controller plugin its caches, writes and events. The traits are implemented by
//! the API server and the controller runtime; the host's side of the imports
//! (`crate::imports`) forwards to them.

use std::sync::Arc;

use crate::bindings::controller::trellis::controller::client::{UpdateRequest, Write};
use crate::bindings::controller::trellis::controller::events::EventType;
use crate::bindings::controller::trellis::controller::types::{ApiError, ServedResource};
use crate::bindings::types::GroupVersionResource;

/// Read access to cluster state for plugins granted it.
#[async_trait::async_trait]
pub trait ClusterReader: Send + Sync + std::fmt::Debug {
    async fn get(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<String>, String>;

    async fn list(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        label_selector: &str,
    ) -> Result<Vec<String>, String>;
}

/// What a controller plugin can do, served by the controller runtime: reads from its
/// informer caches (`get` and `list` of [`ClusterReader`], and [`Self::owned_by`]),
/// writes through the API server under the controller's identity, and events.
#[async_trait::async_trait]
pub trait ControllerHost: ClusterReader {
    /// Objects of `resource` whose ownerReferences name `owner_uid`.
    async fn owned_by(
        &self,
        resource: &GroupVersionResource,
        owner_uid: &str,
    ) -> Result<Vec<String>, String>;

    /// Objects of every cached resource whose ownerReferences name `owner_uid`.
    async fn dependents(&self, owner_uid: &str) -> Result<Vec<String>, String>;

    /// What serves `kind` of `api_version`, as discovery says.
    async fn resource_of(&self, api_version: &str, kind: &str) -> Option<ServedResource>;

    /// Every resource cached for the controller.
    async fn resources(&self) -> Vec<ServedResource>;

    /// Replaces `subresource` of the object with the whole object.
    async fn update_subresource(
        &self,
        request: UpdateRequest,
        subresource: &str,
    ) -> Result<String, ApiError>;

    /// One object as the API server has it now (not the cache's copy).
    async fn read(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<String>, ApiError>;

    /// One write; the object as stored, or the API server's refusal.
    async fn write(&self, write: Write) -> Result<String, ApiError>;

    /// Records an event about `object` (JSON).
    async fn record_event(&self, object: &str, event_type: EventType, reason: &str, message: &str);
}

/// The host imports a plugin's instances are served by.
#[derive(Clone, Default)]
pub(crate) struct Grants {
    /// Cluster reads (`trellis:core/cluster`), for plugins granted them.
    pub(crate) cluster: Option<Arc<dyn ClusterReader>>,
    /// A controller's caches, writes and events.
    pub(crate) controller: Option<Arc<dyn ControllerHost>>,
}

impl Grants {
    pub(crate) fn cluster(cluster: Option<Arc<dyn ClusterReader>>) -> Self {
        Self {
            cluster,
            controller: None,
        }
    }
}
