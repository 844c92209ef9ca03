//! Status writes the server makes itself: a ResourceQuota's usage, a Plugin's `Loaded`
//! condition. They go the way a controller's `PUT …/status` goes through the registry
//! (only `status` changes, the kind's validation, managedFields under the writer's
//! manager name, compare-and-swap with retries), without the admission chain: the
//! quota step writing its own usage must not be charged or re-enter itself.

use serde_json::Value;
use trellis_api::ApiError;
use trellis_api::registry::{ResourceInfo, Subresource};
use trellis_api::user::UserInfo;

pub use crate::admission::{StatusChange, StatusTarget};
use crate::endpoints::request::{ApiRequest, BodyFormat, Query};
use crate::endpoints::response::ApiResult;
use crate::object::{self, Object};
use crate::registry::typed;
use crate::state::AppState;

/// The user server-internal writes are made as (audit and managedFields name it).
pub const INTERNAL_USER: &str = "system:apiserver";

/// Writes the status `change` makes to `target`. Returns the object written, or `None`
/// when the object is gone (or is another object of the same name) or the status did
/// not change (no write, as Kubernetes skips a no-op update).
pub async fn write_status(
    state: &AppState,
    target: &StatusTarget,
    change: &mut StatusChange<'_>,
) -> ApiResult<Option<Object>> {
    let resource = state.resource(&target.group, &target.version, &target.plural)?;
    if !resource.has(Subresource::Status) {
        return Err(
            ApiError::internal(format!("{} has no status subresource", resource.plural)).into(),
        );
    }
    let req = internal_request(resource, target);
    let mut skipped = false;
    let written = super::guaranteed_update(state, &req, &target.name, |old, new| {
        skipped = false;
        if target
            .uid
            .as_deref()
            .is_some_and(|uid| object::meta_str(old, "uid") != Some(uid))
        {
            skipped = true;
            return Ok(());
        }
        let mut status = old
            .get("status")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        change(old, &mut status)?;
        new.insert("status".into(), Value::Object(status));
        if super::update::unchanged(old, new) {
            skipped = true;
            return Ok(());
        }
        validate(state, &req, old, new)?;
        crate::fieldmanager::field_manager::record_write(state, &req, Some(old), new)
    })
    .await;
    match written {
        Ok(_) if skipped => Ok(None),
        Ok(obj) => Ok(Some(obj)),
        Err(e) if e.0.code == 404 => Ok(None),
        Err(e) => Err(e),
    }
}

/// The kind's validation of the new object, as a `/status` update gets it.
fn validate(
    state: &AppState,
    req: &ApiRequest,
    old: &Object,
    new: &mut Object,
) -> Result<(), ApiError> {
    typed::default_and_validate_with(&req.resource, new, Some(old), typed::UnknownFields::Ignore)?;
    if let Some(schema) = state.schema_for(&req.resource) {
        crate::registry::crd::validate(&schema, &req.resource, new)?;
    }
    Ok(())
}

fn internal_request(resource: ResourceInfo, target: &StatusTarget) -> ApiRequest {
    ApiRequest {
        resource,
        namespace: target.namespace.clone(),
        name: Some(target.name.clone()),
        subresource: Some(Subresource::Status),
        verb: "update",
        query: Query::default(),
        user: UserInfo::new(INTERNAL_USER, [trellis_api::user::groups::AUTHENTICATED]),
        content_type: None,
        user_agent: Some(target.manager.to_owned()),
        body_format: BodyFormat::Json,
        table: None,
        dry_run: false,
        include_uninitialized: true,
    }
}

/// The server's face to its admission steps, here where the status path is (the
/// state sits below the registry).
#[async_trait::async_trait]
impl crate::admission::Cluster for AppState {
    fn cache(&self) -> &std::sync::Arc<crate::storage::watch_cache::WatchCache> {
        &self.cache
    }

    fn resource(&self, group: &str, version: &str, plural: &str) -> Result<ResourceInfo, ApiError> {
        AppState::resource(self, group, version, plural)
    }

    fn namespaces(&self) -> &crate::storage::lister::Lister {
        &self.namespaces
    }

    async fn write_status(
        &self,
        target: &crate::admission::StatusTarget,
        change: &mut crate::admission::StatusChange<'_>,
    ) -> Result<Option<crate::object::Object>, ApiError> {
        write_status(self, target, change).await.map_err(|e| e.0)
    }
}
