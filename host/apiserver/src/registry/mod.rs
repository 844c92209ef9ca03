//! The registry: the generic verbs every stored resource shares (one module per
//! verb), the built-in kinds through their typed decode, custom resources, the
//! subresources, and namespaces.
//!
//! Each verb works on any resource of the registry, built-in or custom: objects are
//! Kubernetes JSON, the server owns their uid, timestamps, resourceVersion and
//! generation. Watch is served by [`crate::endpoints::watch`] from the watch cache.
//!
//! # Layout
//! - [`get`], [`create`], [`update`] (update and patch), [`apply`] (server-side apply),
//!   [`delete`] (delete and deletecollection): the verbs. Read-modify-write loops come in
//!   two: [`update::modify`] for a client's change (patch, apply: the server's rules and
//!   admission on every try) and [`guaranteed_update`] for a change the server makes
//!   itself (a binding, after admitting the Binding).
//! - [`typed`]: built-in kinds through their `k8s-openapi` types, defaults, validation.
//! - [`crd`]: custom resources from CRDs: registry entries, schema validation, pruning.
//! - [`subresources`]: `scale`, `pods/binding`, `pods/log` (read from the pod's node)
//!   and `serviceaccounts/token` (a TokenRequest). `status`,
//!   `certificatesigningrequests/approval` and `namespaces/finalize` have no handler of
//!   their own: [`get`], [`update`] and [`patch`] serve them, writing only
//!   what the subresource may change.
//! - [`exec`]: `pods/exec`, a WebSocket relayed to the pod's node.
//! - [`portforward`]: `pods/portforward`, SPDY or a WebSocket passed on to the pod's
//!   node.
//! - [`proxy`]: `nodes/proxy`, a GET passed on to the node's agent.
//! - [`eviction`]: `pods/eviction`, a delete that keeps PodDisruptionBudgets.
//! - [`namespace`]: namespace deletion, and what `namespaces/finalize` may write.
//! - [`service`]: Services' ClusterIP and NodePort allocation, its repair, their
//!   defaults, validation and table columns.
//! - [`certificates`]: CertificateSigningRequests' requester, approval and validation.
//! - [`status`]: the status writes the server makes itself (quota usage, Plugin
//!   conditions).

pub mod apply;
pub mod autoscaling;
pub mod certificates;
pub mod crd;
pub mod create;
pub mod delete;
pub mod eviction;
pub mod exec;
pub mod get;
pub mod namespace;
pub mod portforward;
pub mod proxy;
pub mod service;
pub mod status;
pub mod subresources;
pub mod typed;
pub mod update;

pub use apply::apply;
pub use create::{create, create_object, prepare_create};
pub use delete::{Deletion, delete, delete_collection, delete_dry_run, delete_one};
pub use get::{field_value, get, list, list_objects, matches_fields};
pub use update::{prepare_update, unchanged, update, write_update};

use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::Response;
use serde_json::Value;
use trellis_api::ApiError;
use trellis_api::registry::ResourceInfo;
use trellis_store::Revision;

use crate::endpoints::request::ApiRequest;
use crate::endpoints::response::{ApiResult, json_response, store_error};
use crate::endpoints::table;
use crate::object::{self, Object};
use crate::state::AppState;
use crate::storage::watch_cache::decode_stored;

pub fn respond(code: StatusCode, obj: &Object, req: &ApiRequest) -> Response {
    if let Some(include) = req.table {
        return json_response(
            code,
            &table::object_table(&req.resource, std::slice::from_ref(obj), None, include),
        );
    }
    json_response(code, &Value::Object(obj.clone()))
}

/// Reads one object with its resourceVersion, or 404.
pub async fn read(
    state: &AppState,
    res: &ResourceInfo,
    ns: Option<&str>,
    name: &str,
) -> ApiResult<(Object, Revision)> {
    let key = res.key(ns, name);
    let kv = state
        .store
        .get(&key)
        .await
        .map_err(|e| store_error(e, res, name))?
        .ok_or_else(|| ApiError::not_found(&res.group, &res.plural, name))?;
    let obj = decode_stored(&kv.value, kv.mod_revision)
        .ok_or_else(|| ApiError::internal(format!("stored object {key} is not a JSON object")))?;
    Ok((obj, kv.mod_revision))
}

pub(crate) fn is_crd(res: &ResourceInfo) -> bool {
    res.group == "apiextensions.k8s.io" && res.plural == "customresourcedefinitions"
}

/// After a write, tell the admission steps of it. After a write of a CRD, serve what
/// it defines before answering; a deleted CRD takes its objects with it. A write to a
/// custom resource may be what a terminating CRD was waiting for (its last object's
/// finalizers removed).
pub async fn after_write(state: &AppState, req: &ApiRequest) {
    if req.dry_run {
        return;
    }
    let namespace = req.namespace.as_deref();
    if state.namespaces.lists(&req.resource) {
        state.namespaces.written().await;
    }
    if state.service_accounts.lists(&req.resource) {
        state.service_accounts.written().await;
    }
    if state.secrets.lists(&req.resource) {
        state.secrets.written().await;
    }
    state.rbac.written(&req.resource).await;
    state
        .chains
        .written(&req.resource, req.verb, namespace)
        .await;
    let res = &req.resource;
    let deleting = matches!(req.verb, "delete" | "deletecollection");
    let crds: Vec<String> = if is_crd(res) && deleting {
        match &req.name {
            Some(name) => vec![name.clone()],
            None => list_objects(state, req)
                .await
                .map(|page| {
                    page.items
                        .iter()
                        .filter_map(|o| object::name(o).map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default(),
        }
    } else if !is_crd(res) && state.schema_for(res).is_some() && req.verb != "create" {
        vec![format!("{}.{}", res.plural, res.group)]
    } else {
        Vec::new()
    };
    let mut refresh = is_crd(res);
    for name in crds {
        let mut emptied = std::collections::BTreeSet::new();
        match crate::registry::crd::continue_deletion(
            state.store.as_ref(),
            &name,
            is_crd(res),
            &mut emptied,
        )
        .await
        {
            Ok(changed) => refresh |= changed,
            Err(e) => tracing::warn!(crd = %name, error = %e, "deleting a CRD's objects failed"),
        }
        // The objects went without requests of their own: tell the admission steps
        // (quotas counting them) as their deletes would have. The registry still
        // serves the resource until the refresh below.
        let served = state
            .resources()
            .into_iter()
            .find(|r| format!("{}.{}", r.plural, r.group) == name);
        if let Some(resource) = served {
            for namespace in &emptied {
                state
                    .chains
                    .written(&resource, "delete", Some(namespace))
                    .await;
            }
        }
    }
    if refresh && let Err(e) = state.refresh_custom_resources().await {
        tracing::warn!(error = %e, "refreshing custom resources failed");
    }
}

/// Shared state handle for handlers.
pub type State = Arc<AppState>;

/// `PATCH`: server-side apply for an apply patch ([`apply`]), else a JSON, merge or
/// strategic merge patch ([`update::patch`]).
pub async fn patch(state: &AppState, req: &ApiRequest, body: bytes::Bytes) -> ApiResult {
    use crate::endpoints::request::{BodyFormat, PatchType};
    if req.body_format == BodyFormat::Patch(PatchType::Apply) {
        return apply::apply(state, req, body).await;
    }
    update::patch(state, req, body).await
}

/// The one read-modify-write loop: reads `name` of the request's resource, lets
/// `change` turn the stored object (first argument) into the new one (second), and
/// writes it back if the stored one is still the one read; on a conflict it reads
/// again, a bounded number of times (Kubernetes' `GuaranteedUpdate`). A dry run checks
/// and writes nothing. Returns the object written, with its resourceVersion.
pub async fn guaranteed_update<F>(
    state: &AppState,
    req: &ApiRequest,
    name: &str,
    mut change: F,
) -> ApiResult<Object>
where
    F: FnMut(&Object, &mut Object) -> Result<(), ApiError>,
{
    let res = &req.resource;
    let key = res.key(req.namespace.as_deref(), name);
    for _ in 0..GUARANTEED_UPDATE_TRIES {
        let (old, revision) = read(state, res, req.namespace.as_deref(), name).await?;
        let mut new = old.clone();
        change(&old, &mut new)?;
        // Nothing to write: the stored object stands, as Kubernetes skips a no-op update.
        if update::unchanged(&old, &new) {
            return Ok(old);
        }
        crate::object::remove_meta(&mut new, "resourceVersion");
        if req.dry_run {
            crate::object::set_meta(&mut new, "resourceVersion", revision.to_string());
            return Ok(new);
        }
        let stored = crate::object::encode(&new)?;
        match state.store.update(&key, stored, Some(revision)).await {
            Ok(kv) => {
                crate::object::set_meta(&mut new, "resourceVersion", kv.mod_revision.to_string());
                return Ok(new);
            }
            Err(trellis_store::Error::Conflict { .. }) => continue,
            Err(e) => return Err(store_error(e, res, name).into()),
        }
    }
    Err(ApiError::conflict(&res.group, &res.plural, name, ApiError::MODIFIED).into())
}

/// Whether a write of `obj` removes it instead: its deletion is pending and no
/// finalizer holds it any more (a namespace: neither `metadata.finalizers` nor
/// `spec.finalizers`, see [`namespace::finalized`]).
pub fn finalized(res: &ResourceInfo, obj: &Object) -> bool {
    if res.group.is_empty() && res.plural == "namespaces" {
        return namespace::finalized(obj);
    }
    object::meta_str(obj, "deletionTimestamp").is_some()
        && object::metadata(obj)
            .and_then(|m| m.get("finalizers"))
            .and_then(Value::as_array)
            .is_none_or(|f| f.is_empty())
}

/// Stores `obj` (without its resourceVersion) as `name` of `res` in `namespace` if
/// the stored one is still at revision `expected`, or removes it there when it is
/// [`finalized`]: where every write that empties an object's finalizers ends, a
/// client's or the namespace controller's. The revision written and whether the
/// object was removed.
pub async fn store_or_remove(
    state: &AppState,
    res: &ResourceInfo,
    namespace: Option<&str>,
    name: &str,
    obj: &Object,
    expected: Revision,
) -> Result<(Revision, bool), ApiError> {
    let key = res.key(namespace, name);
    if finalized(res, obj) {
        let deleted = state
            .store
            .delete(&key, Some(expected))
            .await
            .map_err(|e| store_error(e, res, name))?;
        return Ok((deleted.revision, true));
    }
    let kv = state
        .store
        .update(&key, object::encode(obj)?, Some(expected))
        .await
        .map_err(|e| store_error(e, res, name))?;
    Ok((kv.mod_revision, false))
}

/// The finalizer a terminating namespace carries in `spec.finalizers` until the
/// namespace controller ([`namespace`]) has emptied it.
pub const NAMESPACE_FINALIZER: &str = "kubernetes";

/// How often [`guaranteed_update`] reads again after a conflicting write.
pub(crate) const GUARANTEED_UPDATE_TRIES: usize = 8;
