//! Namespace deletion, as Kubernetes' namespace controller does it.
//!
//! Deleting a namespace only marks it: `deletionTimestamp`, phase `Terminating`, and
//! the `kubernetes` finalizer in `spec.finalizers`, which only this controller
//! removes (so no update of the namespace can remove it early). The controller then
//! deletes every object in the namespace through the registry's delete — admission
//! sees each delete, and an object with finalizers is marked and waited for, not
//! removed — and once nothing is left, it removes its finalizer and the namespace.
//!
//! Its state is the stored namespaces, not memory: at start it takes up every
//! namespace that is still terminating (a server killed halfway resumes), it passes
//! over them again whenever a namespace is deleted, and while any waits for objects
//! (finalizers, or a create that raced the deletion) it passes again every
//! [`crate::state::Settings::namespace_resync`].

use std::sync::Arc;

use serde_json::Value;
use tracing::{debug, info, warn};
use trellis_api::registry::ResourceInfo;
use trellis_api::{ApiError, UserInfo};
use trellis_store::ListRequest;

use super::delete::{DeleteParams, Deletion, delete_one};
use crate::endpoints::request::{ApiRequest, BodyFormat, Query};
use crate::endpoints::response::ErrorResponse;
use crate::object::{self, meta_str};
use crate::state::AppState;
use crate::storage::watch_cache::decode_stored;

use super::NAMESPACE_FINALIZER as FINALIZER;

/// Who the controller's deletes are made as.
const CONTROLLER: &str = "system:serviceaccount:kube-system:namespace-controller";

/// Runs the namespace controller until `stop` is set.
pub fn start_controller(
    state: Arc<AppState>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let waiting = match pass(&state).await {
                Ok(waiting) => waiting,
                Err(e) => {
                    warn!(error = %e.message, "namespace deletion failed; retrying");
                    true
                }
            };
            let resync = state.settings.namespace_resync;
            tokio::select! {
                () = state.namespace_deletions.notified() => {}
                () = tokio::time::sleep(resync), if waiting => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    })
}

/// One pass over every terminating namespace; whether any is still waiting.
async fn pass(state: &AppState) -> Result<bool, ApiError> {
    let namespaces = state.resource("", "v1", "namespaces")?;
    let listed = state
        .store
        .list(ListRequest::prefix(namespaces.namespace_prefix(None)))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let mut waiting = false;
    for kv in &listed.kvs {
        let Some(ns) = decode_stored(&kv.value, kv.mod_revision) else {
            continue;
        };
        if meta_str(&ns, "deletionTimestamp").is_none() {
            continue;
        }
        let Some(name) = object::name(&ns).map(str::to_owned) else {
            continue;
        };
        match finalize(state, &namespaces, &name).await {
            Ok(true) => info!(namespace = %name, "namespace deleted"),
            Ok(false) => waiting = true,
            Err(e) => {
                warn!(namespace = %name, error = %e.message, "emptying the namespace failed");
                waiting = true;
            }
        }
    }
    Ok(waiting)
}

fn controller_request(resource: ResourceInfo, namespace: Option<&str>) -> ApiRequest {
    ApiRequest {
        resource,
        namespace: namespace.map(str::to_owned),
        name: None,
        subresource: None,
        verb: "delete",
        query: Query::default(),
        user: UserInfo::new(
            CONTROLLER,
            [
                "system:serviceaccounts",
                "system:serviceaccounts:kube-system",
                trellis_api::user::groups::AUTHENTICATED,
            ],
        ),
        content_type: None,
        user_agent: Some("namespace-controller".into()),
        body_format: BodyFormat::Json,
        wants_table: false,
        dry_run: false,
        include_uninitialized: true,
    }
}

/// Deletes what is in namespace `name`; once it is empty, the namespace. Whether the
/// namespace is gone.
async fn finalize(
    state: &AppState,
    namespaces: &ResourceInfo,
    name: &str,
) -> Result<bool, ApiError> {
    let mut remaining = 0_usize;
    for res in state.resources().into_iter().filter(|r| r.namespaced) {
        let prefix = res.namespace_prefix(Some(name));
        let listed = state
            .store
            .list(ListRequest::prefix(&prefix))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?;
        if listed.kvs.is_empty() {
            continue;
        }
        let mut req = controller_request(res, Some(name));
        for kv in &listed.kvs {
            let Some(obj) = decode_stored(&kv.value, kv.mod_revision) else {
                continue;
            };
            let Some(object_name) = object::name(&obj).map(str::to_owned) else {
                continue;
            };
            if meta_str(&obj, "deletionTimestamp").is_some() {
                // Marked already: its finalizers' owners remove it.
                remaining += 1;
                continue;
            }
            req.name = Some(object_name.clone());
            match delete_one(state, &req, &object_name, &DeleteParams::default()).await {
                Ok(Deletion::Removed(_)) => {}
                Ok(Deletion::Marked(_)) => remaining += 1,
                Err(ErrorResponse(e)) if e.code == 404 => {}
                Err(ErrorResponse(e)) => {
                    debug!(namespace = name, object = %object_name, error = %e.message, "delete refused");
                    remaining += 1;
                }
            }
        }
        req.name = None;
        req.verb = "deletecollection";
        super::after_write(state, &req).await;
    }
    if remaining > 0 {
        debug!(
            namespace = name,
            remaining, "namespace waits for its objects"
        );
        return Ok(false);
    }
    // Empty: the finalizer comes off, and the namespace goes once no other holds it.
    let mut req = controller_request(namespaces.clone(), None);
    req.name = Some(name.to_owned());
    req.verb = "update";
    let key = namespaces.key(None, name);
    let Some(kv) = state
        .store
        .get(&key)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
    else {
        return Ok(true);
    };
    let Some(mut ns) = decode_stored(&kv.value, kv.mod_revision) else {
        return Ok(false);
    };
    remove_finalizer(&mut ns);
    let held = object::metadata(&ns)
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty());
    let written = if held {
        object::remove_meta(&mut ns, "resourceVersion");
        state
            .store
            .update(&key, object::encode(&ns)?, Some(kv.mod_revision))
            .await
            .map(|_| ())
    } else {
        state
            .store
            .delete(&key, Some(kv.mod_revision))
            .await
            .map(|_| ())
    };
    match written {
        Ok(()) => {}
        // Changed meanwhile: the next pass sees the new state.
        Err(trellis_store::Error::Conflict { .. }) => return Ok(false),
        Err(trellis_store::Error::NotFound { .. }) => return Ok(true),
        Err(e) => return Err(ApiError::internal(e.to_string())),
    }
    super::after_write(state, &req).await;
    Ok(!held)
}

/// Removes [`FINALIZER`] from a namespace's `spec.finalizers`.
fn remove_finalizer(ns: &mut object::Object) {
    if let Some(Value::Array(finalizers)) = ns.get_mut("spec").and_then(|s| s.get_mut("finalizers"))
    {
        finalizers.retain(|f| f != FINALIZER);
    }
}

/// Whether a namespace still waits for this controller.
pub fn has_finalizer(ns: &object::Object) -> bool {
    ns.get("spec")
        .and_then(|s| s.get("finalizers"))
        .and_then(Value::as_array)
        .is_some_and(|f| f.iter().any(|f| f == FINALIZER))
}
