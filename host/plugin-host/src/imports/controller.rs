//! The controller world's imports (`cache`, `client`, `events`): the host's side
//! forwards each to the [`ControllerHost`] the controller runtime gave the plugin.

use std::sync::Arc;

use crate::bindings::controller::trellis::controller::{cache, client, events, types};
use crate::bindings::types::GroupVersionResource;
use crate::grants::ControllerHost;
use crate::state::PluginState;

pub use client::{
    CreateRequest, DeleteRequest, PatchRequest, PatchType, Propagation, UpdateRequest, Write,
};
pub use events::EventType;
pub use types::{Action, ApiError, Cause, ObjectKey, ServedResource};

/// Writes of one `batch` call in flight at once.
const BATCH_CONCURRENCY: usize = 64;

impl PluginState {
    fn controller(&self) -> Result<Arc<dyn ControllerHost>, String> {
        self.controller
            .clone()
            .ok_or_else(|| format!("plugin {} is not run by a controller runtime", self.plugin))
    }

    fn unserved(&self) -> ApiError {
        ApiError {
            code: 500,
            reason: "InternalError".into(),
            message: format!("plugin {} is not run by a controller runtime", self.plugin),
            causes: Vec::new(),
        }
    }

    /// The controller runtime to write through, taken before any await: the state
    /// is `Send` but not `Sync`, so no reference to it may live across one.
    fn writer(&self) -> Result<Arc<dyn ControllerHost>, ApiError> {
        self.controller().map_err(|_| self.unserved())
    }
}

async fn write(
    host: Result<Arc<dyn ControllerHost>, ApiError>,
    write: Write,
) -> Result<String, ApiError> {
    host?.write(write).await
}

impl types::Host for PluginState {}

impl cache::Host for PluginState {
    async fn get(
        &mut self,
        resource: GroupVersionResource,
        namespace: Option<String>,
        name: String,
    ) -> Result<Option<String>, String> {
        self.controller()?
            .get(&resource, namespace.as_deref(), &name)
            .await
    }

    async fn list(
        &mut self,
        resource: GroupVersionResource,
        namespace: Option<String>,
        label_selector: String,
    ) -> Result<Vec<String>, String> {
        self.controller()?
            .list(&resource, namespace.as_deref(), &label_selector)
            .await
    }

    async fn owned_by(
        &mut self,
        resource: GroupVersionResource,
        owner_uid: String,
    ) -> Result<Vec<String>, String> {
        self.controller()?.owned_by(&resource, &owner_uid).await
    }

    async fn dependents(&mut self, owner_uid: String) -> Result<Vec<String>, String> {
        self.controller()?.dependents(&owner_uid).await
    }

    async fn resource_of(&mut self, api_version: String, kind: String) -> Option<ServedResource> {
        self.controller()
            .ok()?
            .resource_of(&api_version, &kind)
            .await
    }

    async fn resources(&mut self) -> Vec<ServedResource> {
        match self.controller() {
            Ok(host) => host.resources().await,
            Err(_) => Vec::new(),
        }
    }
}

impl client::Host for PluginState {
    async fn read(
        &mut self,
        resource: GroupVersionResource,
        namespace: Option<String>,
        name: String,
    ) -> Result<Option<String>, ApiError> {
        self.writer()?
            .read(&resource, namespace.as_deref(), &name)
            .await
    }

    async fn create(&mut self, request: CreateRequest) -> Result<String, ApiError> {
        write(self.writer(), Write::Create(request)).await
    }

    async fn update(&mut self, request: UpdateRequest) -> Result<String, ApiError> {
        write(self.writer(), Write::Update(request)).await
    }

    async fn patch(&mut self, request: PatchRequest) -> Result<String, ApiError> {
        write(self.writer(), Write::Patch(request)).await
    }

    async fn delete(&mut self, request: DeleteRequest) -> Result<String, ApiError> {
        write(self.writer(), Write::Delete(request)).await
    }

    async fn update_subresource(
        &mut self,
        request: UpdateRequest,
        subresource: String,
    ) -> Result<String, ApiError> {
        self.writer()?
            .update_subresource(request, &subresource)
            .await
    }

    async fn batch(&mut self, writes: Vec<Write>) -> Vec<Result<String, ApiError>> {
        let host = match self.writer() {
            Ok(host) => host,
            Err(error) => return writes.iter().map(|_| Err(error.clone())).collect(),
        };
        // Many at once: the API server and the store's group commit take them
        // together, where one call per write would pay a guest round trip each. Bounded,
        // so that a batch of thousands stays within the API server's in-flight limit
        // for writes instead of being answered 429.
        use futures::StreamExt as _;
        futures::stream::iter(writes.into_iter().map(|w| host.write(w)))
            .buffered(BATCH_CONCURRENCY)
            .collect()
            .await
    }
}

impl events::Host for PluginState {
    async fn record(&mut self, object: String, r#type: EventType, reason: String, message: String) {
        let host = self.controller();
        match host {
            Ok(host) => host.record_event(&object, r#type, &reason, &message).await,
            Err(e) => tracing::warn!(error = %e, "event dropped"),
        }
    }
}
