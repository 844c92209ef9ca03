//! `create`: the server's fields, defaults, admission and validation, the store, then
//! the initializers.

use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::Response;
use bytes::Bytes;
use serde_json::{Value, json};
use trellis_api::ApiError;
use trellis_api::registry::Subresource;
use trellis_api::status::StatusCause;

use super::{is_crd, read, respond};
use crate::admission;
use crate::endpoints::request::{ApiRequest, BodyFormat, PatchType};
use crate::endpoints::response::{ApiResult, ErrorResponse, store_error};
use crate::object::{self, Object, meta_str, metadata_mut, now_timestamp, remove_meta, set_meta};
use crate::registry::typed;
use crate::state::AppState;

/// Checks that a namespaced object may be created in `ns`.
async fn check_namespace(state: &AppState, ns: &str) -> ApiResult<()> {
    let namespaces = state.resource("", "v1", "namespaces")?;
    let found = match state.namespaces.cached(&namespaces.key(None, ns)) {
        Some(obj) => Ok(obj),
        None => read(state, &namespaces, None, ns)
            .await
            .map(|(obj, _)| Arc::new(obj)),
    };
    match found {
        Ok(obj) => {
            let terminating = meta_str(&obj, "deletionTimestamp").is_some()
                || obj
                    .get("status")
                    .and_then(|s| s.get("phase"))
                    .and_then(Value::as_str)
                    == Some("Terminating");
            if terminating {
                let message = format!(
                    "unable to create new content in namespace {ns} because it is being terminated"
                );
                // The cause Kubernetes gives, which clients test for rather than the text.
                let cause =
                    StatusCause::new("NamespaceTerminating", "metadata.namespace", &message);
                return Err(ApiError {
                    details: Some(Box::new(trellis_api::status::StatusDetails {
                        name: ns.to_owned(),
                        kind: "namespaces".into(),
                        causes: vec![cause],
                        ..Default::default()
                    })),
                    ..ApiError::new(403, trellis_api::status::Reason::Forbidden, message)
                }
                .into());
            }
            Ok(())
        }
        Err(ErrorResponse(e)) if e.code == 404 => {
            Err(ApiError::not_found("", "namespaces", ns).into())
        }
        Err(e) => Err(e),
    }
}

/// Prepares a new object for storage: identity, timestamps, generation, defaults and
/// validation. Returns its key.
pub async fn prepare_create(
    state: &AppState,
    req: &ApiRequest,
    obj: &mut Object,
) -> ApiResult<String> {
    let res = &req.resource;
    object::check_type(obj, res)?;
    if res.namespaced {
        let ns = req
            .namespace
            .as_deref()
            .ok_or_else(|| ApiError::bad_request("a namespace is required"))?;
        match meta_str(obj, "namespace") {
            None | Some("") => set_meta(obj, "namespace", ns),
            Some(other) if other == ns => {}
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "the namespace of the provided object ({other}) does not match the namespace sent on the request ({ns})"
                ))
                .into());
            }
        }
    } else {
        remove_meta(obj, "namespace");
    }
    if object::name(obj).is_none() {
        match meta_str(obj, "generateName").filter(|g| !g.is_empty()) {
            Some(base) => {
                let name = format!("{base}{}", object::name_suffix());
                set_meta(obj, "name", name);
            }
            None => {
                return Err(ApiError::invalid(
                    &res.group,
                    &res.kind,
                    "",
                    vec![
                        StatusCause::required("metadata.name")
                            .with_message("Required value: name or generateName is required"),
                    ],
                )
                .into());
            }
        }
    }
    let name = object::name(obj).unwrap_or_default().to_owned();
    let mut causes = object::validate_name(res, &name);
    if !causes.is_empty() {
        causes.truncate(1);
        return Err(ApiError::invalid(&res.group, &res.kind, &name, causes).into());
    }
    set_meta(obj, "uid", uuid::Uuid::new_v4().to_string());
    set_meta(obj, "creationTimestamp", now_timestamp());
    if obj.contains_key("spec") {
        // As Kubernetes, only objects with a spec track its changes.
        set_meta(obj, "generation", 1);
    }
    remove_meta(obj, "resourceVersion");
    remove_meta(obj, "deletionTimestamp");
    remove_meta(obj, "deletionGracePeriodSeconds");
    if res.namespaced {
        // First, as Kubernetes' NamespaceLifecycle: nothing is admitted (or charged to
        // a quota) in a namespace that is missing or going away.
        check_namespace(state, req.namespace.as_deref().unwrap_or_default()).await?;
    }
    if crate::registry::certificates::is_csr(res) {
        // As Kubernetes' strategy, before admission: who asked is the server's to say.
        crate::registry::certificates::set_requester(obj, &req.user);
    }
    let attrs = admission_attributes(req, "CREATE", &name);
    state.chains.mutate(&attrs, obj, None).await?;
    check_unknown_fields(state, req, obj)?;
    typed::default_and_validate_with(res, obj, None, unknown_fields(req))?;
    if let Some(schema) = state.schema_for(res) {
        crate::registry::crd::validate(&schema, res, obj)?;
    }
    // The store's limit, checked before validating admission charges quota for an
    // object the store would refuse.
    let size = object::encode(obj)?.len();
    if size > MAX_OBJECT_BYTES {
        return Err(ApiError::too_large_object(size, MAX_OBJECT_BYTES).into());
    }
    state.chains.validate(&attrs, obj, None).await?;
    admission::set_pending(obj, &state.chains.pending_for(res));
    // Status is written through /status only; a create starts without one. Nodes
    // keep theirs, as in Kubernetes: a node agent registers its node with its status.
    let keeps_status = matches!(res.plural.as_str(), "namespaces" | "pods" | "nodes");
    if res.has(Subresource::Status) && !keeps_status {
        obj.remove("status");
        // Claims and volumes start Pending, as their strategies' PrepareForCreate
        // sets them, until the binder says otherwise.
        if res.group.is_empty()
            && matches!(
                res.plural.as_str(),
                "persistentvolumeclaims" | "persistentvolumes"
            )
        {
            obj.insert("status".into(), serde_json::json!({"phase": "Pending"}));
        }
    }
    if is_crd(res) {
        let status = crate::registry::crd::established_status(obj);
        obj.insert("status".into(), status);
        // Its objects are deleted with it, before it goes.
        let finalizers = metadata_mut(obj)
            .entry("finalizers")
            .or_insert_with(|| json!([]));
        if let Value::Array(list) = finalizers
            && !list
                .iter()
                .any(|f| f == crate::registry::crd::CLEANUP_FINALIZER)
        {
            list.push(crate::registry::crd::CLEANUP_FINALIZER.into());
        }
    }
    if state.schema_for(res).is_some()
        && crate::registry::crd::terminating(state.store.as_ref(), &res.qualified()).await
    {
        return Err(ApiError::method_not_allowed(
            "create not allowed while custom resource definition is terminating",
        )
        .into());
    }
    Ok(res.key(req.namespace.as_deref(), &name))
}

pub async fn create(state: &AppState, req: &ApiRequest, body: Bytes) -> ApiResult {
    let obj = req.decode_body(&body)?;
    create_object(state, req, obj).await
}

/// Creates `obj` (from a POST, a PUT of a missing object, or an apply that finds
/// none): the server's fields, defaults, admission and validation, then the store and
/// the initializers.
pub async fn create_object(state: &AppState, req: &ApiRequest, mut obj: Object) -> ApiResult {
    let generated = object::name(&obj).is_none();
    let mut key = prepare_create(state, req, &mut obj).await?;
    let mut name = object::name(&obj).unwrap_or_default().to_owned();
    let stored = async {
        if req.body_format != BodyFormat::Patch(PatchType::Apply) {
            crate::fieldmanager::field_manager::record_write(state, req, None, &mut obj)?;
        }
        if req.dry_run {
            if super::service::handles(&req.resource) {
                super::service::dry_run(state, &mut obj, None).await?;
            }
            return Ok(None);
        }
        // A generated name that is taken is generated again, as Kubernetes does
        // (five random characters collide within a few thousand objects).
        let mut attempts = 0;
        loop {
            let written = if super::service::handles(&req.resource) {
                super::service::create(state, &key, &mut obj).await?
            } else {
                state.store.create(&key, object::encode(&obj)?).await
            };
            match written {
                Err(trellis_store::Error::AlreadyExists { .. })
                    if generated && attempts < GENERATE_NAME_RETRIES =>
                {
                    attempts += 1;
                    let base = meta_str(&obj, "generateName")
                        .unwrap_or_default()
                        .to_owned();
                    name = format!("{base}{}", object::name_suffix());
                    set_meta(&mut obj, "name", name.clone());
                    key = req.resource.key(req.namespace.as_deref(), &name);
                }
                result => {
                    return result
                        .map(Some)
                        .map_err(|e| ErrorResponse(store_error(e, &req.resource, &name)));
                }
            }
        }
    }
    .await;
    let kv = match stored {
        Ok(Some(kv)) => kv,
        Ok(None) => return Ok(created(&obj, req, name)),
        Err(e) => {
            // Admission has accounted for the object (quota charged it): tell it the
            // create did not happen, so that its usage converges now.
            state
                .chains
                .aborted(&req.resource, &key, req.namespace.as_deref())
                .await;
            return Err(e);
        }
    };
    set_meta(&mut obj, "resourceVersion", kv.mod_revision.to_string());
    if !admission::pending(&obj).is_empty() {
        obj = initialize(state, req, &key, &name).await?;
    }
    Ok(created(&obj, req, name))
}

/// How many times a create whose generated name is taken tries another.
const GENERATE_NAME_RETRIES: u32 = 7;

/// The largest object the store takes: its value limit, checked before admission
/// accounts for the object.
const MAX_OBJECT_BYTES: usize = trellis_store::DEFAULT_MAX_VALUE_SIZE;

/// A 201 for `obj`, carrying its name for the audit log: a create's URL has none.
fn created(obj: &Object, req: &ApiRequest, name: String) -> Response {
    let mut response = respond(StatusCode::CREATED, obj, req);
    response
        .extensions_mut()
        .insert(crate::observability::audit::ObjectName(name));
    response
}

/// How long a create waits for its object's initializers.
const INITIALIZE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Runs the in-process initializers of a new object in order, and waits for the
/// others (controllers acting on uninitialized objects) until none is pending.
async fn initialize(
    state: &AppState,
    req: &ApiRequest,
    key: &str,
    name: &str,
) -> ApiResult<Object> {
    let res = &req.resource;
    let deadline = tokio::time::Instant::now() + INITIALIZE_TIMEOUT;
    loop {
        let (mut obj, rev) = read(state, res, req.namespace.as_deref(), name).await?;
        let pending = admission::pending(&obj);
        let Some(first) = pending.first() else {
            return Ok(obj);
        };
        match state.chains.initializer(first) {
            Some(initializer) => {
                let result = initializer.initialize(res, obj.clone()).await;
                match result {
                    Ok(mut initialized) => {
                        admission::set_pending(&mut initialized, &pending[1..]);
                        remove_meta(&mut initialized, "resourceVersion");
                        let stored = object::encode(&initialized)?;
                        match state.store.update(key, stored, Some(rev)).await {
                            Ok(_) | Err(trellis_store::Error::Conflict { .. }) => continue,
                            Err(e) => return Err(store_error(e, res, name).into()),
                        }
                    }
                    Err(reason) => {
                        let failure =
                            ApiError::internal(format!("initializer {first} failed: {reason}"));
                        metadata_mut(&mut obj).insert(
                            "initializers".into(),
                            json!({"pending": [], "result": failure.to_status()}),
                        );
                        // The object never becomes visible: record why, then remove it.
                        remove_meta(&mut obj, "resourceVersion");
                        let stored = object::encode(&obj)?;
                        if let Ok(kv) = state.store.update(key, stored, Some(rev)).await {
                            let _ = state.store.delete(key, Some(kv.mod_revision)).await;
                        }
                        return Err(failure.into());
                    }
                }
            }
            None => {
                // Another party's turn: wait for the object to change.
                let now = tokio::time::Instant::now();
                if now >= deadline {
                    return Err(ApiError::timeout(format!(
                        "{} {name:?} is still waiting for initializer {first}",
                        res.qualified()
                    ))
                    .into());
                }
                if let Ok(mut sub) = state.cache.subscribe(key, rev) {
                    let _ = tokio::time::timeout(deadline - now, sub.rx.recv()).await;
                } else {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
            }
        }
    }
}

pub(super) fn admission_attributes<'a>(
    req: &'a ApiRequest,
    operation: &'static str,
    name: &'a str,
) -> admission::Attributes<'a> {
    admission::Attributes {
        resource: &req.resource,
        operation,
        namespace: req.namespace.as_deref(),
        name,
        subresource: req.subresource.map(|s| s.name()),
        user: &req.user,
        dry_run: req.dry_run,
    }
}

/// What the request's `fieldValidation` does with fields a built-in kind's type does
/// not have, as its typed decode finds them.
pub(super) fn unknown_fields(req: &ApiRequest) -> typed::UnknownFields {
    if req.strict_fields() {
        typed::UnknownFields::Strict
    } else if req.warn_fields() {
        typed::UnknownFields::Warn
    } else {
        typed::UnknownFields::Ignore
    }
}

/// Fields a custom resource's schema does not have: with `fieldValidation=Warn` (the
/// default) each becomes a warning; with `Strict` the write is refused. Built-in kinds
/// are checked by their typed decode (see [`unknown_fields`]).
pub(super) fn check_unknown_fields(
    state: &AppState,
    req: &ApiRequest,
    obj: &Object,
) -> ApiResult<()> {
    let Some(schema) = state.schema_for(&req.resource) else {
        return Ok(());
    };
    if req.strict_fields() {
        let unknown = crate::registry::crd::unknown_fields(&schema, obj);
        if !unknown.is_empty() {
            return Err(typed::strict_decoding_error(&unknown).into());
        }
    } else if req.warn_fields() {
        for f in crate::registry::crd::unknown_fields(&schema, obj) {
            crate::warnings::add(format!("unknown field {f:?}"));
        }
    }
    Ok(())
}
