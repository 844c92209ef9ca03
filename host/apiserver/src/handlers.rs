//! The verbs on stored resources: get, list, create, update, patch, delete,
//! deletecollection (watch is in [`crate::watch`]). Each works on any resource of the
//! registry, built-in or custom: objects are Kubernetes JSON, the server owns their
//! uid, timestamps, resourceVersion and generation.

use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::Response;
use bytes::Bytes;
use serde_json::{Value, json};
use trellis_api::ApiError;
use trellis_api::registry::{ResourceInfo, Subresource};
use trellis_api::selector::{FieldSelector, LabelSelector};
use trellis_api::status::StatusCause;
use trellis_store::{ListRequest, Revision};

use crate::admission;
use crate::object::{
    self, Object, meta_str, metadata, metadata_mut, now_timestamp, remove_meta, set_meta,
};
use crate::request::{ApiRequest, BodyFormat, PatchType};
use crate::response::{ApiResult, ErrorResponse, json_response, store_error};
use crate::state::AppState;
use crate::table;
use crate::typed;
use crate::watch_cache::decode_stored;

/// Most objects a list reads from the store per page while filtering by selectors.
const LIST_PAGE: usize = 500;

pub(crate) fn respond(code: StatusCode, obj: &Object, req: &ApiRequest) -> Response {
    if req.wants_table {
        return json_response(
            code,
            &table::object_table(&req.resource, std::slice::from_ref(obj), None),
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

pub async fn get(state: &AppState, req: &ApiRequest) -> ApiResult {
    let name = req.name()?;
    let (obj, _) = read(state, &req.resource, req.namespace.as_deref(), name).await?;
    if !visible(&obj, req) {
        return Err(ApiError::not_found(&req.resource.group, &req.resource.plural, name).into());
    }
    Ok(respond(StatusCode::OK, &obj, req))
}

/// Objects with pending initializers are invisible unless asked for.
fn visible(obj: &Object, req: &ApiRequest) -> bool {
    req.include_uninitialized
        || metadata(obj)
            .and_then(|m| m.get("initializers"))
            .and_then(|i| i.get("pending"))
            .and_then(Value::as_array)
            .is_none_or(|p| p.is_empty())
}

/// A continue token: the list's revision and the last key returned.
fn encode_continue(revision: Revision, key: &str) -> String {
    use base64::Engine;
    let token = json!({"v": "meta.k8s.io/v1", "rv": revision, "start": key});
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(token.to_string())
}

fn decode_continue(token: &str) -> Result<(Revision, String), ApiError> {
    use base64::Engine;
    let bad = || ApiError::bad_request(format!("continue key is not valid: {token:?}"));
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| bad())?;
    let v: Value = serde_json::from_slice(&raw).map_err(|_| bad())?;
    let rev = v["rv"].as_u64().ok_or_else(bad)?;
    let start = v["start"].as_str().ok_or_else(bad)?.to_owned();
    Ok((rev, start))
}

/// The objects of a list request, filtered by its selectors, and the list's metadata.
pub async fn list_objects(
    state: &AppState,
    req: &ApiRequest,
) -> ApiResult<(Vec<Object>, Revision, Option<String>)> {
    let res = &req.resource;
    let prefix = res.namespace_prefix(req.namespace.as_deref());
    let labels = LabelSelector::parse(req.query.label_selector.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::bad_request(format!("unable to parse requirement: {e}")))?;
    let fields = FieldSelector::parse(req.query.field_selector.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::bad_request(format!("invalid field selector: {e}")))?;
    check_fields(res, &fields)?;
    let limit = req.query.limit.filter(|l| *l > 0);

    let (mut revision, mut start_after) = match req.query.continue_token.as_deref() {
        Some(token) if !token.is_empty() => {
            let (rev, start) = decode_continue(token)?;
            (Some(rev), Some(start))
        }
        _ => (None, None),
    };
    if revision.is_none() {
        revision = list_revision(state, req).await?;
    }

    let mut items = Vec::new();
    let mut next = None;
    let read_at;
    loop {
        let want = limit.map_or(LIST_PAGE, |l| (l - items.len()).clamp(1, LIST_PAGE));
        let page = state
            .store
            .list(ListRequest {
                prefix: prefix.clone(),
                start_after: start_after.clone(),
                revision,
                limit: Some(want),
            })
            .await
            .map_err(|e| store_error(e, res, ""))?;
        revision = Some(page.revision);
        let last_key = page.kvs.last().map(|kv| kv.key.clone());
        for kv in page.kvs {
            let Some(obj) = decode_stored(&kv.value, kv.mod_revision) else {
                continue;
            };
            if visible(&obj, req)
                && labels.matches_object(&Value::Object(obj.clone()))
                && matches_fields(res, &fields, &obj)
            {
                items.push(obj);
            }
        }
        if !page.more {
            read_at = page.revision;
            break;
        }
        start_after = last_key;
        if limit.is_some_and(|l| items.len() >= l) {
            read_at = page.revision;
            next = start_after
                .as_deref()
                .map(|k| encode_continue(page.revision, k));
            break;
        }
    }
    Ok((items, read_at, next))
}

/// The revision a list reads at: latest unless `resourceVersionMatch=Exact`.
async fn list_revision(state: &AppState, req: &ApiRequest) -> ApiResult<Option<Revision>> {
    let rv = req.query.resource_version.as_deref().unwrap_or("");
    if rv.is_empty() || rv == "0" {
        return Ok(None);
    }
    let n: Revision = rv
        .parse()
        .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {rv:?}")))?;
    match req.query.resource_version_match.as_deref() {
        Some("Exact") => Ok(Some(n)),
        None | Some("") | Some("NotOlderThan") => {
            let current = state
                .store
                .current_revision()
                .await
                .map_err(|e| store_error(e, &req.resource, ""))?;
            if n > current {
                return Err(ApiError::timeout(format!(
                    "Too large resource version: {n}, current: {current}"
                ))
                .into());
            }
            Ok(None)
        }
        Some(other) => {
            Err(ApiError::bad_request(format!("unsupported resourceVersionMatch {other:?}")).into())
        }
    }
}

/// The fields a field selector may use on this resource.
fn supported_field(res: &ResourceInfo, field: &str) -> bool {
    match field {
        "metadata.name" | "metadata.namespace" => true,
        "spec.nodeName" | "status.phase" | "spec.schedulerName" | "spec.restartPolicy"
        | "status.podIP" => res.plural == "pods",
        f if res.plural == "events" => {
            f.starts_with("involvedObject.")
                || matches!(f, "reason" | "type" | "source" | "reportingComponent")
        }
        _ => false,
    }
}

fn check_fields(res: &ResourceInfo, fields: &FieldSelector) -> Result<(), ApiError> {
    for f in fields.fields() {
        if !supported_field(res, f) {
            return Err(ApiError::bad_request(format!(
                "field label not supported: {f}"
            )));
        }
    }
    Ok(())
}

/// A field's value as a field selector sees it.
pub fn field_value(obj: &Object, field: &str) -> Option<String> {
    let mut cur = obj.get(field.split('.').next()?)?;
    for part in field.split('.').skip(1) {
        cur = cur.get(part)?;
    }
    match cur {
        Value::String(s) => Some(s.clone()),
        Value::Null => None,
        other => Some(other.to_string()),
    }
}

pub fn matches_fields(_res: &ResourceInfo, fields: &FieldSelector, obj: &Object) -> bool {
    fields.is_empty() || fields.matches(|f| field_value(obj, f))
}

pub async fn list(state: &AppState, req: &ApiRequest) -> ApiResult {
    let (items, revision, next) = list_objects(state, req).await?;
    if req.wants_table {
        return Ok(json_response(
            StatusCode::OK,
            &table::object_table(&req.resource, &items, Some((revision, next))),
        ));
    }
    let mut meta = json!({"resourceVersion": revision.to_string()});
    if let Some(token) = next {
        if let Some(remaining) = remaining_items(state, req, &token).await {
            meta["remainingItemCount"] = remaining.into();
        }
        meta["continue"] = token.into();
    }
    let body = json!({
        "kind": req.resource.list_kind(),
        "apiVersion": req.resource.api_version(),
        "metadata": meta,
        "items": items,
    });
    Ok(json_response(StatusCode::OK, &body))
}

/// How many objects the next pages hold, as Kubernetes reports it: only for lists
/// without selectors (with them, the count is unknown without reading everything).
/// Counted by a read of the rest at the list's revision, so it costs as much as the
/// remaining pages would.
async fn remaining_items(state: &AppState, req: &ApiRequest, token: &str) -> Option<u64> {
    let no_selectors = req.query.label_selector.as_deref().unwrap_or("").is_empty()
        && req.query.field_selector.as_deref().unwrap_or("").is_empty();
    if !no_selectors {
        return None;
    }
    let (revision, start_after) = decode_continue(token).ok()?;
    let rest = state
        .store
        .list(ListRequest {
            prefix: req.resource.namespace_prefix(req.namespace.as_deref()),
            start_after: Some(start_after),
            revision: Some(revision),
            limit: None,
        })
        .await
        .ok()?;
    Some(rest.kvs.len() as u64)
}

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
                return Err(ApiError::new(
                    403,
                    trellis_api::status::Reason::Forbidden,
                    format!("unable to create new content in namespace {ns} because it is being terminated"),
                )
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
    let attrs = admission_attributes(req, "CREATE", &name);
    state.chains.mutate(&attrs, obj, None).await?;
    check_unknown_fields(state, req, obj)?;
    typed::default_and_validate_with(res, obj, None, unknown_fields(req))?;
    if let Some(schema) = state.schema_for(res) {
        crate::crd::validate(&schema, res, obj)?;
    }
    state.chains.validate(&attrs, obj, None).await?;
    admission::set_pending(obj, &state.chains.pending_for(res));
    // Status is written through /status only; a create starts without one. Nodes
    // keep theirs, as in Kubernetes: a node agent registers its node with its status.
    let keeps_status = matches!(res.plural.as_str(), "namespaces" | "pods" | "nodes");
    if res.has(Subresource::Status) && !keeps_status {
        obj.remove("status");
    }
    if is_crd(res) {
        let status = crate::crd::established_status(obj);
        obj.insert("status".into(), status);
        // Its objects are deleted with it, before it goes.
        let finalizers = metadata_mut(obj)
            .entry("finalizers")
            .or_insert_with(|| json!([]));
        if let Value::Array(list) = finalizers
            && !list.iter().any(|f| f == crate::crd::CLEANUP_FINALIZER)
        {
            list.push(crate::crd::CLEANUP_FINALIZER.into());
        }
    }
    if state.schema_for(res).is_some()
        && crate::crd::terminating(state.store.as_ref(), &res.qualified()).await
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
pub(crate) async fn create_object(
    state: &AppState,
    req: &ApiRequest,
    mut obj: Object,
) -> ApiResult {
    let key = prepare_create(state, req, &mut obj).await?;
    if req.body_format != BodyFormat::Patch(PatchType::Apply) {
        crate::apply::record_write(state, req, None, &mut obj)?;
    }
    let name = object::name(&obj).unwrap_or_default().to_owned();
    if req.dry_run {
        return Ok(created(&obj, req, name));
    }
    let stored = object::encode(&obj)?;
    let kv = state
        .store
        .create(&key, stored)
        .await
        .map_err(|e| store_error(e, &req.resource, &name))?;
    set_meta(&mut obj, "resourceVersion", kv.mod_revision.to_string());
    if !admission::pending(&obj).is_empty() {
        obj = initialize(state, req, &key, &name).await?;
    }
    Ok(created(&obj, req, name))
}

/// A 201 for `obj`, carrying its name for the audit log: a create's URL has none.
fn created(obj: &Object, req: &ApiRequest, name: String) -> Response {
    let mut response = respond(StatusCode::CREATED, obj, req);
    response
        .extensions_mut()
        .insert(crate::audit::ObjectName(name));
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

fn admission_attributes<'a>(
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
fn unknown_fields(req: &ApiRequest) -> typed::UnknownFields {
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
fn check_unknown_fields(state: &AppState, req: &ApiRequest, obj: &Object) -> ApiResult<()> {
    let Some(schema) = state.schema_for(&req.resource) else {
        return Ok(());
    };
    if req.strict_fields() {
        let unknown = crate::crd::unknown_fields(&schema, obj);
        if !unknown.is_empty() {
            return Err(typed::strict_decoding_error(&unknown).into());
        }
    } else if req.warn_fields() {
        for f in crate::crd::unknown_fields(&schema, obj) {
            crate::warnings::add(format!("unknown field {f:?}"));
        }
    }
    Ok(())
}

/// Fields a write through the main resource may not change, and what `/status` may.
fn merge_for_subresource(
    res: &ResourceInfo,
    sub: Option<Subresource>,
    old: &Object,
    new: &mut Object,
) {
    if !res.has(Subresource::Status) {
        return;
    }
    match sub {
        Some(Subresource::Status) => {
            // Only status changes: everything else comes from the stored object.
            let status = new.remove("status");
            let metadata = new.get("metadata").cloned();
            *new = old.clone();
            match status {
                Some(s) => {
                    new.insert("status".into(), s);
                }
                None => {
                    new.remove("status");
                }
            }
            // Labels and annotations may still change through status, as Kubernetes allows.
            if let (Some(Value::Object(m)), Some(Value::Object(target))) =
                (metadata, new.get_mut("metadata"))
            {
                for field in ["labels", "annotations"] {
                    if let Some(v) = m.get(field) {
                        target.insert(field.into(), v.clone());
                    }
                }
            }
        }
        _ => match old.get("status") {
            Some(s) => {
                new.insert("status".into(), s.clone());
            }
            None => {
                new.remove("status");
            }
        },
    }
}

/// Applies the server's rules to a replacement of `old` by `new`: immutable identity,
/// generation on spec changes, status only through `/status`. Returns the expected
/// revision for the compare-and-swap.
pub(crate) async fn prepare_update(
    state: &AppState,
    req: &ApiRequest,
    old: &Object,
    old_rev: Revision,
    new: &mut Object,
) -> ApiResult<Revision> {
    let res = &req.resource;
    object::check_type(new, res)?;
    let name = req.name()?;
    match object::name(new) {
        None => set_meta(new, "name", name),
        Some(n) if n == name => {}
        Some(n) => {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({n}) does not match the name on the URL ({name})"
            ))
            .into());
        }
    }
    let expected = match meta_str(new, "resourceVersion").filter(|v| !v.is_empty()) {
        Some(v) => v
            .parse::<Revision>()
            .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {v:?}")))?,
        None => old_rev,
    };
    // Identity the client cannot change.
    for field in [
        "uid",
        "creationTimestamp",
        "namespace",
        "generation",
        "deletionTimestamp",
    ] {
        match metadata(old).and_then(|m| m.get(field)).cloned() {
            Some(v) => set_meta(new, field, v),
            None => {
                remove_meta(new, field);
            }
        }
    }
    merge_for_subresource(res, req.subresource, old, new);
    let attrs = admission_attributes(req, "UPDATE", name);
    state.chains.mutate(&attrs, new, Some(old)).await?;
    check_unknown_fields(state, req, new)?;
    typed::default_and_validate_with(res, new, Some(old), unknown_fields(req))?;
    if let Some(schema) = state.schema_for(res) {
        crate::crd::validate(&schema, res, new)?;
    }
    state.chains.validate(&attrs, new, Some(old)).await?;
    if let Err(reason) = admission::check_pending_update(old, new) {
        return Err(ApiError::invalid(
            &res.group,
            &res.kind,
            name,
            vec![StatusCause::forbidden(
                "metadata.initializers.pending",
                &reason,
            )],
        )
        .into());
    }
    if req.subresource != Some(Subresource::Status) && new.get("spec") != old.get("spec") {
        let generation = metadata(old)
            .and_then(|m| m.get("generation"))
            .and_then(Value::as_i64)
            .unwrap_or(1);
        set_meta(new, "generation", generation + 1);
    }
    remove_meta(new, "resourceVersion");
    Ok(expected)
}

/// Whether an update changes nothing: Kubernetes then skips the write, keeping the
/// resourceVersion (and kubectl reports "no change").
pub(crate) fn unchanged(old: &Object, new: &Object) -> bool {
    let strip = |o: &Object| {
        let mut o = o.clone();
        remove_meta(&mut o, "resourceVersion");
        o
    };
    strip(old) == strip(new)
}

/// Writes `new` over the stored object at `expected`; an object whose deletion is
/// pending and whose finalizers are now empty is deleted instead.
pub(crate) async fn write_update(
    state: &AppState,
    req: &ApiRequest,
    mut new: Object,
    expected: Revision,
) -> ApiResult<Object> {
    let res = &req.resource;
    let name = req.name()?;
    let key = res.key(req.namespace.as_deref(), name);
    let finalized = meta_str(&new, "deletionTimestamp").is_some()
        && metadata(&new)
            .and_then(|m| m.get("finalizers"))
            .and_then(Value::as_array)
            .is_none_or(|f| f.is_empty());
    if req.dry_run {
        // As Kubernetes: a dry run checks the version it would write against, so a
        // stale one is a conflict here too.
        match state
            .store
            .get(&key)
            .await
            .map_err(|e| store_error(e, res, name))?
        {
            Some(kv) if kv.mod_revision == expected => {}
            Some(_) => {
                return Err(
                    ApiError::conflict(&res.group, &res.plural, name, ApiError::MODIFIED).into(),
                );
            }
            None => return Err(ApiError::not_found(&res.group, &res.plural, name).into()),
        }
        set_meta(&mut new, "resourceVersion", expected.to_string());
        return Ok(new);
    }
    if finalized {
        let deleted = state
            .store
            .delete(&key, Some(expected))
            .await
            .map_err(|e| store_error(e, res, name))?;
        set_meta(&mut new, "resourceVersion", deleted.revision.to_string());
        return Ok(new);
    }
    let stored = object::encode(&new)?;
    let kv = state
        .store
        .update(&key, stored, Some(expected))
        .await
        .map_err(|e| store_error(e, res, name))?;
    set_meta(&mut new, "resourceVersion", kv.mod_revision.to_string());
    Ok(new)
}

pub async fn update(state: &AppState, req: &ApiRequest, body: Bytes) -> ApiResult {
    let name = req.name()?;
    let mut new = req.decode_body(&body)?;
    let (old, old_rev) = match read(state, &req.resource, req.namespace.as_deref(), name).await {
        Ok(found) => found,
        Err(ErrorResponse(e)) if e.code == 404 && req.subresource.is_none() => {
            // PUT of a missing object creates it, as Kubernetes does for most kinds.
            return create_object(state, req, new).await;
        }
        Err(e) => return Err(e),
    };
    let expected = prepare_update(state, req, &old, old_rev, &mut new).await?;
    crate::apply::record_write(state, req, Some(&old), &mut new)?;
    if expected == old_rev && unchanged(&old, &new) {
        return Ok(respond(StatusCode::OK, &old, req));
    }
    let written = write_update(state, req, new, expected).await?;
    Ok(respond(StatusCode::OK, &written, req))
}

pub async fn patch(state: &AppState, req: &ApiRequest, body: Bytes) -> ApiResult {
    let name = req.name()?;
    let BodyFormat::Patch(kind) = req.body_format else {
        return Err(
            ApiError::unsupported_media_type(req.content_type.as_deref().unwrap_or("")).into(),
        );
    };
    if kind == PatchType::Apply {
        return crate::apply::apply(state, req, body).await;
    }
    crate::apply::check_patch_options(req, false)?;
    let patch_doc: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
    // Retry on conflicts that the client did not ask for (no resourceVersion in the patch).
    for _ in 0..8 {
        let (old, old_rev) = match read(state, &req.resource, req.namespace.as_deref(), name).await
        {
            Ok(found) => found,
            Err(e) => return Err(e),
        };
        let mut doc = Value::Object(old.clone());
        match kind {
            PatchType::Json => {
                let ops: json_patch::Patch =
                    serde_json::from_value(patch_doc.clone()).map_err(|e| {
                        ApiError::bad_request(format!("error decoding JSON patch: {e}"))
                    })?;
                json_patch::patch(&mut doc, &ops).map_err(|e| {
                    ApiError::new(
                        422,
                        trellis_api::status::Reason::Invalid,
                        format!("the JSON patch could not be applied: {e}"),
                    )
                })?;
            }
            PatchType::StrategicMerge => {
                crate::patch::strategic_merge(&mut doc, &patch_doc).map_err(ApiError::from)?;
            }
            PatchType::Merge | PatchType::Apply => crate::patch::merge(&mut doc, &patch_doc),
        }
        let Value::Object(mut new) = doc else {
            return Err(ApiError::bad_request("the patched object is not an object").into());
        };
        let pinned = meta_str(&new, "resourceVersion") != meta_str(&old, "resourceVersion");
        if !pinned {
            set_meta(&mut new, "resourceVersion", old_rev.to_string());
        }
        let expected = prepare_update(state, req, &old, old_rev, &mut new).await?;
        crate::apply::record_write(state, req, Some(&old), &mut new)?;
        if expected == old_rev && unchanged(&old, &new) {
            return Ok(respond(StatusCode::OK, &old, req));
        }
        match write_update(state, req, new, expected).await {
            Ok(written) => return Ok(respond(StatusCode::OK, &written, req)),
            Err(ErrorResponse(e)) if e.code == 409 && !pinned => continue,
            Err(e) => return Err(e),
        }
    }
    Err(ApiError::conflict(
        &req.resource.group,
        &req.resource.plural,
        name,
        ApiError::MODIFIED,
    )
    .into())
}

/// The request's `DeleteOptions` body, `null` when there is none.
fn delete_options(req: &ApiRequest, body: &Bytes) -> ApiResult<Value> {
    if body.is_empty() {
        Ok(Value::Null)
    } else if matches!(req.body_format, BodyFormat::Protobuf | BodyFormat::Yaml) {
        // Typed clients send DeleteOptions in the protobuf envelope; others may in YAML.
        Ok(Value::Object(req.decode_body(body)?))
    } else {
        Ok(serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("error decoding DeleteOptions: {e}")))?)
    }
}

/// Whether a delete's `DeleteOptions` ask for a dry run: kubectl sends `dryRun` there
/// rather than in the query.
pub fn delete_dry_run(req: &ApiRequest, body: &Bytes) -> ApiResult<bool> {
    match delete_options(req, body)?.get("dryRun") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Array(modes)) if modes.iter().all(|m| m == "All") => Ok(!modes.is_empty()),
        Some(other) => Err(ApiError::bad_request(format!(
            "unsupported dryRun value {other} in DeleteOptions: only [\"All\"]"
        ))
        .into()),
    }
}

pub async fn delete(state: &AppState, req: &ApiRequest, body: Bytes) -> ApiResult {
    let options = delete_options(req, &body)?;
    let name = req.name()?;
    let res = &req.resource;
    let precondition_rv = options
        .get("preconditions")
        .and_then(|p| p.get("resourceVersion"))
        .and_then(Value::as_str)
        .map(|v| {
            v.parse::<Revision>()
                .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {v:?}")))
        })
        .transpose()?;
    let deleted = delete_one(state, req, name, precondition_rv).await?;
    match deleted {
        Deletion::Marked(obj) => Ok(respond(StatusCode::OK, &obj, req)),
        Deletion::Removed(obj) => {
            let uid = meta_str(&obj, "uid").unwrap_or_default().to_owned();
            if res.plural == "namespaces" || res.group == "apps" || res.plural == "pods" {
                Ok(respond(StatusCode::OK, &obj, req))
            } else {
                Ok(json_response(
                    StatusCode::OK,
                    &trellis_api::status::success(&res.group, &res.plural, name, &uid),
                ))
            }
        }
    }
}

#[derive(Debug)]
pub enum Deletion {
    /// The object has finalizers (or is a namespace): it is only marked.
    Marked(Object),
    Removed(Object),
}

pub async fn delete_one(
    state: &AppState,
    req: &ApiRequest,
    name: &str,
    precondition: Option<Revision>,
) -> ApiResult<Deletion> {
    let res = &req.resource;
    for attempt in 0..8 {
        let (mut obj, rev) = read(state, res, req.namespace.as_deref(), name).await?;
        if let Some(p) = precondition
            && p != rev
        {
            return Err(ApiError::conflict(&res.group, &res.plural, name, &format!(
                "Precondition failed: ResourceVersion in precondition: {p}, ResourceVersion in object meta: {rev}"
            ))
            .into());
        }
        // Admission sees a delete as Kubernetes sends it: no object, the stored one as
        // the old object. A mutating step may refuse it; there is nothing to change.
        if attempt == 0 {
            // Once, not again on a retry after a conflicting write.
            let attrs = admission_attributes(req, "DELETE", name);
            state.chains.mutate(&attrs, &mut obj.clone(), None).await?;
            state.chains.validate(&attrs, &obj, None).await?;
        }
        let has_finalizers = metadata(&obj)
            .and_then(|m| m.get("finalizers"))
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty());
        let namespace = res.plural == "namespaces";
        if has_finalizers || namespace {
            if meta_str(&obj, "deletionTimestamp").is_some() {
                return Ok(Deletion::Marked(obj));
            }
            set_meta(&mut obj, "deletionTimestamp", now_timestamp());
            set_meta(&mut obj, "deletionGracePeriodSeconds", 0);
            if namespace {
                obj.insert("status".into(), json!({"phase": "Terminating"}));
            }
            remove_meta(&mut obj, "resourceVersion");
            if req.dry_run {
                return Ok(Deletion::Marked(obj));
            }
            let stored = object::encode(&obj)?;
            match state
                .store
                .update(&res.key(req.namespace.as_deref(), name), stored, Some(rev))
                .await
            {
                Ok(kv) => {
                    set_meta(&mut obj, "resourceVersion", kv.mod_revision.to_string());
                    if namespace {
                        state.namespace_deleted(name);
                    }
                    return Ok(Deletion::Marked(obj));
                }
                Err(trellis_store::Error::Conflict { .. }) if precondition.is_none() => continue,
                Err(e) => return Err(store_error(e, res, name).into()),
            }
        }
        if req.dry_run {
            return Ok(Deletion::Removed(obj));
        }
        match state
            .store
            .delete(&res.key(req.namespace.as_deref(), name), Some(rev))
            .await
        {
            Ok(d) => {
                set_meta(&mut obj, "resourceVersion", d.revision.to_string());
                return Ok(Deletion::Removed(obj));
            }
            Err(trellis_store::Error::Conflict { .. }) if precondition.is_none() => continue,
            Err(e) => return Err(store_error(e, res, name).into()),
        }
    }
    Err(ApiError::conflict(&res.group, &res.plural, name, ApiError::MODIFIED).into())
}

pub async fn delete_collection(state: &AppState, req: &ApiRequest) -> ApiResult {
    let (items, _, _) = list_objects(state, req).await?;
    let mut deleted = Vec::new();
    for obj in items {
        let Some(name) = object::name(&obj).map(str::to_owned) else {
            continue;
        };
        match delete_one(state, req, &name, None).await {
            Ok(Deletion::Removed(o) | Deletion::Marked(o)) => deleted.push(o),
            Err(ErrorResponse(e)) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    let body = json!({
        "kind": req.resource.list_kind(),
        "apiVersion": req.resource.api_version(),
        "metadata": {},
        "items": deleted,
    });
    Ok(json_response(StatusCode::OK, &body))
}

fn is_crd(res: &ResourceInfo) -> bool {
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
                .map(|(items, _, _)| {
                    items
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
        match crate::crd::continue_deletion(state.store.as_ref(), &name, is_crd(res), &mut emptied)
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
