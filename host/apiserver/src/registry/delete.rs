//! `delete` and `deletecollection`, with finalizers and DeleteOptions.

use axum::http::StatusCode;
use bytes::Bytes;
use serde_json::{Value, json};
use trellis_api::ApiError;
use trellis_store::Revision;

use super::create::admission_attributes;
use super::get::list_objects;
use super::{read, respond};
use crate::endpoints::request::{ApiRequest, BodyFormat};
use crate::endpoints::response::{ApiResult, ErrorResponse, json_response, store_error};
use crate::object::{self, Object, meta_str, metadata, now_timestamp, remove_meta, set_meta};
use crate::state::AppState;

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

/// How a delete treats the object's dependents (`DeleteOptions.propagationPolicy`):
/// `Orphan` and `Foreground` hold the object with the `orphan` or
/// `foregroundDeletion` finalizer until the garbage collector has orphaned or deleted
/// its dependents; `Background` deletes it at once and leaves them to the collector.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Propagation {
    #[default]
    Background,
    Foreground,
    Orphan,
}

impl Propagation {
    /// The finalizer the garbage collector removes once it has done its part.
    fn finalizer(self) -> Option<&'static str> {
        match self {
            Self::Background => None,
            Self::Foreground => Some("foregroundDeletion"),
            Self::Orphan => Some("orphan"),
        }
    }
}

/// What a `DeleteOptions` asks of one delete.
#[derive(Clone, Debug, Default)]
pub struct DeleteParams {
    /// `preconditions.resourceVersion`.
    pub resource_version: Option<Revision>,
    /// `preconditions.uid`: only this very object, not one recreated under its name.
    pub uid: Option<String>,
    pub propagation: Propagation,
    /// `gracePeriodSeconds`: how long a pod on a node has to stop; `None` for the
    /// pod's own `terminationGracePeriodSeconds`.
    pub grace_period_seconds: Option<i64>,
}

impl DeleteParams {
    /// From the body's `DeleteOptions` and the query (`propagationPolicy`), as
    /// Kubernetes reads them, including the older `orphanDependents`.
    fn parse(req: &ApiRequest, options: &Value) -> ApiResult<Self> {
        let preconditions = &options["preconditions"];
        let resource_version = preconditions["resourceVersion"]
            .as_str()
            .map(|v| {
                v.parse::<Revision>()
                    .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {v:?}")))
            })
            .transpose()?;
        let policy = options["propagationPolicy"]
            .as_str()
            .map(str::to_owned)
            .or_else(|| req.query.propagation_policy.clone());
        let orphan = options["orphanDependents"].as_bool();
        let invalid = |field: &str, message: String| {
            ApiError::invalid(
                "",
                "DeleteOptions",
                "",
                vec![trellis_api::status::StatusCause::new(
                    "FieldValueNotSupported",
                    field,
                    message,
                )],
            )
        };
        let propagation = match (policy.as_deref(), orphan) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "propagationPolicy",
                    "orphanDependents and deletionPropagation cannot be both set".into(),
                )
                .into());
            }
            (Some("Background"), _) | (None, Some(false) | None) => Propagation::Background,
            (Some("Foreground"), _) => Propagation::Foreground,
            (Some("Orphan"), _) | (None, Some(true)) => Propagation::Orphan,
            (Some(other), _) => {
                return Err(invalid(
                    "propagationPolicy",
                    format!(
                        "Unsupported value: {other:?}: supported values: \"Foreground\", \"Background\", \"Orphan\""
                    ),
                )
                .into());
            }
        };
        let grace_period_seconds = options["gracePeriodSeconds"]
            .as_i64()
            .or(req.query.grace_period_seconds);
        if let Some(g) = grace_period_seconds
            && g < 0
        {
            return Err(invalid(
                "gracePeriodSeconds",
                format!("Invalid value: {g}: must be >= 0"),
            )
            .into());
        }
        Ok(Self {
            resource_version,
            uid: preconditions["uid"].as_str().map(str::to_owned),
            propagation,
            grace_period_seconds,
        })
    }
}

pub async fn delete(state: &AppState, req: &ApiRequest, body: Bytes) -> ApiResult {
    let options = delete_options(req, &body)?;
    let name = req.name()?;
    let res = &req.resource;
    let params = DeleteParams::parse(req, &options)?;
    let deleted = delete_one(state, req, name, &params).await?;
    match deleted {
        Deletion::Marked(obj) => Ok(respond(StatusCode::OK, &obj, req)),
        Deletion::Removed(obj) => {
            let uid = meta_str(&obj, "uid").unwrap_or_default().to_owned();
            // The resources whose registries return the deleted object (kube-apiserver's
            // `ReturnDeletedObject`); clients parse a Service's delete as a Service.
            let returns_object = res.plural == "namespaces"
                || res.group == "apps"
                || (res.group.is_empty()
                    && matches!(
                        res.plural.as_str(),
                        "pods" | "services" | "persistentvolumes" | "persistentvolumeclaims"
                    ))
                || (res.group == "storage.k8s.io" && res.plural == "storageclasses");
            if returns_object {
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
    params: &DeleteParams,
) -> ApiResult<Deletion> {
    let res = &req.resource;
    let precondition = params.resource_version;
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
        if let Some(uid) = &params.uid {
            let stored = meta_str(&obj, "uid").unwrap_or_default();
            if stored != uid {
                return Err(ApiError::conflict(&res.group, &res.plural, name, &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {stored}"
                ))
                .into());
            }
        }
        // Admission sees a delete as Kubernetes sends it: no object, the stored one as
        // the old object. A mutating step may refuse it; there is nothing to change.
        if attempt == 0 {
            // Once, not again on a retry after a conflicting write.
            let attrs = admission_attributes(req, "DELETE", name);
            state.chains.mutate(&attrs, &mut obj.clone(), None).await?;
            state.chains.validate(&attrs, &obj, None).await?;
        }
        // Orphan and foreground deletion wait for the garbage collector.
        if let Some(finalizer) = params.propagation.finalizer()
            && meta_str(&obj, "deletionTimestamp").is_none()
        {
            let finalizers = object::metadata_mut(&mut obj)
                .entry("finalizers")
                .or_insert_with(|| json!([]));
            if !finalizers.is_array() {
                *finalizers = json!([]);
            }
            if let Value::Array(list) = finalizers
                && !list.iter().any(|f| f == finalizer)
            {
                list.push(finalizer.into());
            }
        }
        let has_finalizers = metadata(&obj)
            .and_then(|m| m.get("finalizers"))
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty());
        let namespace = res.plural == "namespaces";
        let graceful = res.group.is_empty() && res.plural == "pods" && graceful_pod(&obj, params);
        if graceful {
            // A pod on a node is stopped by its agent first, which then deletes it for
            // good; a second delete may only shorten the grace period.
            let grace = params
                .grace_period_seconds
                .or_else(|| {
                    obj.get("spec")
                        .and_then(|s| s.get("terminationGracePeriodSeconds"))
                        .and_then(Value::as_i64)
                })
                .unwrap_or(30)
                .max(1);
            let current = metadata(&obj)
                .and_then(|m| m.get("deletionGracePeriodSeconds"))
                .and_then(Value::as_i64);
            if current.is_some_and(|c| c <= grace) {
                return Ok(Deletion::Marked(obj));
            }
            let deadline = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(grace);
            set_meta(
                &mut obj,
                "deletionTimestamp",
                deadline.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
            );
            set_meta(&mut obj, "deletionGracePeriodSeconds", grace);
        }
        if has_finalizers || namespace || graceful {
            if !graceful && meta_str(&obj, "deletionTimestamp").is_some() {
                if namespace && !req.dry_run {
                    // Deleted again: the namespace controller takes it up again now.
                    state.namespace_deletions.notify_one();
                }
                return Ok(Deletion::Marked(obj));
            }
            if !graceful {
                set_meta(&mut obj, "deletionTimestamp", now_timestamp());
                set_meta(&mut obj, "deletionGracePeriodSeconds", 0);
            }
            if namespace {
                obj.insert("status".into(), json!({"phase": "Terminating"}));
                // Held until the namespace controller has emptied it.
                let spec = obj.entry("spec").or_insert_with(|| json!({}));
                if !spec.is_object() {
                    *spec = json!({});
                }
                let finalizers = &mut spec["finalizers"];
                if !finalizers.is_array() {
                    *finalizers = json!([]);
                }
                if let Value::Array(list) = finalizers
                    && !list.iter().any(|f| f == super::NAMESPACE_FINALIZER)
                {
                    list.push(super::NAMESPACE_FINALIZER.into());
                }
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
                        state.namespace_deletions.notify_one();
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
        let key = res.key(req.namespace.as_deref(), name);
        let deleted = if super::service::handles(res) {
            super::service::delete(state, &key, &obj, rev).await
        } else {
            state.store.delete(&key, Some(rev)).await
        };
        match deleted {
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

/// Whether deleting this pod waits for its node's agent: it is bound to a node, has
/// not finished, and the delete gives no zero grace period (a force delete).
fn graceful_pod(pod: &Object, params: &DeleteParams) -> bool {
    if params.grace_period_seconds == Some(0) {
        return false;
    }
    let bound = pod
        .get("spec")
        .and_then(|s| s.get("nodeName"))
        .and_then(Value::as_str)
        .is_some_and(|n| !n.is_empty());
    let finished = matches!(
        pod.get("status")
            .and_then(|s| s.get("phase"))
            .and_then(Value::as_str),
        Some("Succeeded" | "Failed")
    );
    bound && !finished
}

pub async fn delete_collection(state: &AppState, req: &ApiRequest) -> ApiResult {
    let items = list_objects(state, req).await?.items;
    let mut deleted = Vec::new();
    for obj in items {
        let Some(name) = object::name(&obj).map(str::to_owned) else {
            continue;
        };
        match delete_one(state, req, &name, &DeleteParams::default()).await {
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
