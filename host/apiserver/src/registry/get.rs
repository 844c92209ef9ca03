//! `get` and `list`: reads from the store, filtered by selectors, paginated.

use axum::http::StatusCode;
use serde_json::{Value, json};
use trellis_api::ApiError;
use trellis_api::registry::ResourceInfo;
use trellis_api::selector::{FieldSelector, LabelSelector};
use trellis_store::{ListRequest, Revision};

use super::{read, respond};
use crate::endpoints::request::ApiRequest;
use crate::endpoints::response::{ApiResult, json_response, store_error};
use crate::endpoints::table;
use crate::object::{Object, metadata};
use crate::state::AppState;
use crate::storage::watch_cache::decode_stored;

/// Most objects a list reads from the store per page while filtering by selectors.
const LIST_PAGE: usize = 500;

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

/// Where a paginated list goes on: the revision all its pages read at, the last key
/// returned, and, for lists without selectors, how many keys remain after it.
#[derive(Debug, Default)]
struct Continue {
    revision: Revision,
    start_after: String,
    /// Counted once, on the first page, and carried down: counting again on every page
    /// would make a relist of N objects cost O(N²).
    remaining: Option<u64>,
}

impl Continue {
    fn encode(&self) -> String {
        use base64::Engine;
        let mut token = json!({"rv": self.revision, "start": self.start_after});
        if let Some(remaining) = self.remaining {
            token["remaining"] = remaining.into();
        }
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(token.to_string())
    }

    fn decode(token: &str) -> Result<Self, ApiError> {
        use base64::Engine;
        let bad = || ApiError::bad_request(format!("continue key is not valid: {token:?}"));
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(token)
            .map_err(|_| bad())?;
        let v: Value = serde_json::from_slice(&raw).map_err(|_| bad())?;
        Ok(Self {
            revision: v["rv"].as_u64().ok_or_else(bad)?,
            start_after: v["start"].as_str().ok_or_else(bad)?.to_owned(),
            remaining: v["remaining"].as_u64(),
        })
    }
}

/// A list's page: the objects, the revision it read at, and where to go on.
#[derive(Debug)]
pub struct Page {
    pub items: Vec<Object>,
    pub revision: Revision,
    /// The continue token, when more objects follow.
    pub next: Option<String>,
    /// `remainingItemCount`: how many objects the next pages hold, for lists without
    /// selectors (with them it is unknown without reading everything), as Kubernetes
    /// reports it.
    pub remaining: Option<u64>,
}

/// The objects of a list request, filtered by its selectors, and the list's metadata.
pub async fn list_objects(state: &AppState, req: &ApiRequest) -> ApiResult<Page> {
    let res = &req.resource;
    let prefix = res.namespace_prefix(req.namespace.as_deref());
    let labels = LabelSelector::parse(req.query.label_selector.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::bad_request(format!("unable to parse requirement: {e}")))?;
    let fields = FieldSelector::parse(req.query.field_selector.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::bad_request(format!("invalid field selector: {e}")))?;
    check_fields(res, &fields)?;
    let limit = req.query.limit.filter(|l| *l > 0);

    let continued = match req.query.continue_token.as_deref() {
        Some(token) if !token.is_empty() => Some(Continue::decode(token)?),
        _ => None,
    };
    let (mut revision, mut start_after) = match &continued {
        Some(c) => (Some(c.revision), Some(c.start_after.clone())),
        None => (None, None),
    };
    let mut keys_read: u64 = 0;
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
        keys_read += page.kvs.len() as u64;
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
            next = start_after.clone();
            break;
        }
    }
    let Some(start_after) = next else {
        return Ok(Page {
            items,
            revision: read_at,
            next: None,
            remaining: None,
        });
    };
    let no_selectors = labels.is_empty() && fields.is_empty();
    let remaining = match continued.and_then(|c| c.remaining) {
        _ if !no_selectors => None,
        Some(before) => Some(before.saturating_sub(keys_read)),
        None => state
            .store
            .count(ListRequest {
                prefix,
                start_after: Some(start_after.clone()),
                revision: Some(read_at),
                limit: None,
            })
            .await
            .ok(),
    };
    let token = Continue {
        revision: read_at,
        start_after,
        remaining,
    };
    Ok(Page {
        items,
        revision: read_at,
        next: Some(token.encode()),
        remaining,
    })
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
    let Page {
        items,
        revision,
        next,
        remaining,
    } = list_objects(state, req).await?;
    if let Some(include) = req.table {
        return Ok(json_response(
            StatusCode::OK,
            &table::object_table(&req.resource, &items, Some((revision, next)), include),
        ));
    }
    let mut meta = json!({"resourceVersion": revision.to_string()});
    if let Some(token) = next {
        if let Some(remaining) = remaining {
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
