//! `update` and `patch`: read, modify, compare-and-swap.

use axum::http::StatusCode;
use bytes::Bytes;
use serde_json::Value;
use trellis_api::ApiError;
use trellis_api::registry::{ResourceInfo, Subresource};
use trellis_api::status::StatusCause;
use trellis_store::Revision;

use super::create::{admission_attributes, check_unknown_fields, create_object, unknown_fields};
use super::{read, respond};
use crate::admission;
use crate::endpoints::request::{ApiRequest, BodyFormat, PatchType};
use crate::endpoints::response::{ApiResult, ErrorResponse, store_error};
use crate::object::{self, Object, meta_str, metadata, remove_meta, set_meta};
use crate::registry::typed;
use crate::state::AppState;

/// Fields a write through the main resource may not change, and what `/status` (and a
/// namespace's `/finalize`) may.
fn merge_for_subresource(
    res: &ResourceInfo,
    sub: Option<Subresource>,
    old: &Object,
    new: &mut Object,
) {
    if is_namespaces(res) && sub != Some(Subresource::Status) {
        // `/finalize` writes `spec.finalizers` and nothing else; no other write does.
        let finalize = sub == Some(Subresource::Finalize);
        super::namespace::merge_finalizers(old, new, finalize);
        if finalize {
            return;
        }
    }
    if !res.has(Subresource::Status) {
        return;
    }
    if super::certificates::is_csr(res) && sub == Some(Subresource::Approval) {
        super::certificates::merge(sub, old, new);
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
    if super::certificates::is_csr(res) {
        super::certificates::merge(sub, old, new);
    }
}

/// Applies the server's rules to a replacement of `old` by `new`: immutable identity,
/// generation on spec changes, status only through `/status`. Returns the expected
/// revision for the compare-and-swap.
pub async fn prepare_update(
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
    if req.subresource == Some(Subresource::Finalize) {
        super::namespace::validate_finalizers(new, name)?;
    }
    let attrs = admission_attributes(req, "UPDATE", name);
    state.chains.mutate(&attrs, new, Some(old)).await?;
    check_unknown_fields(state, req, new)?;
    typed::default_and_validate_with(res, new, Some(old), unknown_fields(req))?;
    if let Some(schema) = state.schema_for(res) {
        crate::registry::crd::validate(&schema, res, new)?;
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
    if !matches!(
        req.subresource,
        Some(Subresource::Status | Subresource::Approval)
    ) && new.get("spec") != old.get("spec")
    {
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
pub fn unchanged(old: &Object, new: &Object) -> bool {
    let strip = |o: &Object| {
        let mut o = o.clone();
        remove_meta(&mut o, "resourceVersion");
        o
    };
    strip(old) == strip(new)
}

/// Writes `new` over the stored object at `expected`; an object whose deletion is
/// pending and whose finalizers are now empty is deleted instead.
pub async fn write_update(
    state: &AppState,
    req: &ApiRequest,
    mut new: Object,
    expected: Revision,
) -> ApiResult<Object> {
    let res = &req.resource;
    let name = req.name()?;
    let key = res.key(req.namespace.as_deref(), name);
    if req.dry_run {
        // As Kubernetes: a dry run checks the version it would write against, so a
        // stale one is a conflict here too.
        match state
            .store
            .get(&key)
            .await
            .map_err(|e| store_error(e, res, name))?
        {
            Some(kv) if kv.mod_revision == expected => {
                if super::service::handles(res) {
                    let old = crate::storage::watch_cache::decode_stored(&kv.value, expected);
                    super::service::dry_run(state, &mut new, old.as_ref()).await?;
                }
            }
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
    let namespace = req.namespace.as_deref();
    let (revision, _) = if super::service::handles(res) {
        let finalized = super::finalized(res, &new);
        let place = (namespace, name);
        super::service::store_or_remove(state, res, place, &mut new, expected, finalized).await?
    } else {
        super::store_or_remove(state, res, namespace, name, &new, expected).await?
    };
    set_meta(&mut new, "resourceVersion", revision.to_string());
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
    crate::fieldmanager::field_manager::record_write(state, req, Some(&old), &mut new)?;
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
    crate::fieldmanager::field_manager::check_patch_options(req, false)?;
    let patch_doc: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
    modify(state, req, name, true, |old, _| {
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
                crate::fieldmanager::patch::strategic_merge(&mut doc, &patch_doc)
                    .map_err(ApiError::from)?;
            }
            PatchType::Merge | PatchType::Apply => {
                crate::fieldmanager::patch::merge(&mut doc, &patch_doc)
            }
        }
        let Value::Object(new) = doc else {
            return Err(ApiError::bad_request("the patched object is not an object").into());
        };
        // A resourceVersion in the patch pins the write: its conflict is the answer.
        let pinned = meta_str(&new, "resourceVersion") != meta_str(old, "resourceVersion");
        Ok((new, pinned))
    })
    .await
}

/// The read-modify-write loop of the verbs that change an object in place (patch,
/// server-side apply): read it, let `change` make the new object (and say whether the
/// client pinned its resourceVersion), hold it to the server's rules and admission
/// ([`prepare_update`]), record its field manager when `record`, skip a write that
/// changes nothing, and compare-and-swap. A conflict the client did not pin reads again.
pub async fn modify(
    state: &AppState,
    req: &ApiRequest,
    name: &str,
    record: bool,
    mut change: impl FnMut(&Object, Revision) -> ApiResult<(Object, bool)>,
) -> ApiResult {
    for _ in 0..super::GUARANTEED_UPDATE_TRIES {
        let (old, old_rev) = read(state, &req.resource, req.namespace.as_deref(), name).await?;
        let (mut new, pinned) = change(&old, old_rev)?;
        if !pinned {
            set_meta(&mut new, "resourceVersion", old_rev.to_string());
        }
        let expected = prepare_update(state, req, &old, old_rev, &mut new).await?;
        if record {
            crate::fieldmanager::field_manager::record_write(state, req, Some(&old), &mut new)?;
        }
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

fn is_namespaces(res: &ResourceInfo) -> bool {
    res.group.is_empty() && res.plural == "namespaces"
}
