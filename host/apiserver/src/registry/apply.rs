//! Server-side apply as a verb: creates the object if it is missing, else merges the
//! configuration into it under the request's field manager (the merge itself is
//! [`crate::fieldmanager::structured_merge`]).

use bytes::Bytes;
use serde_json::Value;
use trellis_api::ApiError;

use super::create_object;
use super::update::modify;
use crate::endpoints::request::ApiRequest;
use crate::endpoints::response::{ApiResult, ErrorResponse};
use crate::fieldmanager::field_manager::{check_patch_options, scope, subresource_name};
use crate::fieldmanager::managed_fields::{self, Entry, Schema, fields_of, strip};
use crate::fieldmanager::structured_merge::Applied;
use crate::object::{self, meta_str, now_timestamp};
use crate::state::AppState;

/// `PATCH` with an apply patch: creates the object if it is missing, else merges
/// the configuration into it under the request's field manager.
pub async fn apply(state: &AppState, req: &ApiRequest, body: Bytes) -> ApiResult {
    check_patch_options(req, true)?;
    let name = req.name()?;
    let config = object::decode(&body, true)?;
    if let Some(n) = object::name(&config)
        && n != name
    {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({n}) does not match the name on the URL ({name})"
        ))
        .into());
    }
    if object::metadata(&config)
        .and_then(|m| m.get("managedFields"))
        .is_some_and(|f| !f.is_null())
    {
        // Ownership is the server's record, not part of a configuration.
        return Err(ApiError::bad_request("metadata.managedFields must be nil").into());
    }
    let manager = req.query.field_manager.clone().unwrap_or_default();
    let force = req.query.force == Some(true);
    let api_version = req.resource.api_version();
    let crd = state.schema_for(&req.resource);
    let schema = crd
        .as_deref()
        .map_or(Schema::Builtin, |s| Schema::Crd(s.raw()));
    let scope = scope(&req.resource, req.subresource);
    let pinned = meta_str(&config, "resourceVersion").is_some_and(|v| !v.is_empty());
    let applied = modify(state, req, name, false, |live, _| {
        let applied = Applied {
            manager: &manager,
            force,
            schema,
            scope,
            api_version: &api_version,
            subresource: subresource_name(req),
            now: &now_timestamp(),
        };
        Ok((applied.apply_to(live, &config)?, pinned))
    })
    .await;
    match applied {
        // Nothing to apply to: the configuration is created, owned by its manager.
        Err(ErrorResponse(e)) if e.code == 404 && req.subresource.is_none() => {
            let mut obj = config.clone();
            let mut fields = fields_of(&Value::Object(config.clone()), schema, false);
            strip(&mut fields, scope);
            let entry = Entry {
                manager: manager.clone(),
                operation: "Apply".into(),
                api_version: api_version.clone(),
                time: Some(now_timestamp()),
                subresource: String::new(),
                fields,
            };
            managed_fields::encode(&mut obj, vec![entry]);
            create_object(state, req, obj).await
        }
        other => other,
    }
}
