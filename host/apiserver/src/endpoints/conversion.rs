//! Versions served from another version's storage, as kube-apiserver converts between
//! a request's version and the storage version: a request to `autoscaling/v1`
//! HorizontalPodAutoscalers is served as one to `autoscaling/v2`, where they are
//! stored, with its body converted on the way in ([`inbound`]) and the objects of its
//! answer (an object, a list, each event of a watch) on the way out ([`outbound`]).
//!
//! A patch is made on the object in the request's version: the stored object is read,
//! converted, patched, converted back and written as an update of the revision read.
//! Server-side apply is refused at a converted version (its field sets are the
//! storage version's).

use axum::body::Body;
use axum::http::header;
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use serde_json::Value;
use trellis_api::ApiError;
use trellis_api::registry::ResourceInfo;

use crate::endpoints::request::{ApiRequest, BodyFormat, PatchType};
use crate::endpoints::response::ErrorResponse;
use crate::object::{Object, meta_str, set_meta};
use crate::state::AppState;

/// The largest answer converted whole (a list); larger ones pass unconverted.
const MAX_CONVERTED: usize = 256 << 20;

/// How a request was served from another version's storage.
#[derive(Clone, Debug)]
pub struct Served {
    /// The request's resource (`autoscaling/v1`).
    requested: ResourceInfo,
    /// The storage's (`autoscaling/v2`).
    storage: ResourceInfo,
}

/// The version `res` is stored at, when that is another than its own.
fn storage_version(res: &ResourceInfo) -> Option<&'static str> {
    match (
        res.group.as_str(),
        res.plural.as_str(),
        res.version.as_str(),
    ) {
        ("autoscaling", "horizontalpodautoscalers", "v1") => Some("v2"),
        _ => None,
    }
}

/// `obj` of `res`'s group and plural at `version`.
fn convert(res: &ResourceInfo, obj: &Object, version: &str) -> Object {
    match (res.group.as_str(), res.plural.as_str()) {
        ("autoscaling", "horizontalpodautoscalers") => {
            crate::registry::autoscaling::convert(obj, version)
        }
        _ => obj.clone(),
    }
}

/// Turns a request to a version served from another's storage into one to the
/// storage version: the resource, and the body in its version. `None` for every
/// other request, which passes as it came.
pub async fn inbound(
    state: &AppState,
    req: &mut ApiRequest,
    body: Bytes,
) -> Result<(Bytes, Option<Served>), ErrorResponse> {
    let Some(version) = storage_version(&req.resource) else {
        return Ok((body, None));
    };
    let storage = state.resource(&req.resource.group, version, &req.resource.plural)?;
    let served = Served {
        requested: req.resource.clone(),
        storage: storage.clone(),
    };
    let body = match (req.verb, req.body_format) {
        ("create" | "update", _) if !body.is_empty() => {
            let mut obj = req.decode_body(&body)?;
            crate::object::check_type(&mut obj, &req.resource)?;
            let obj = convert(&storage, &obj, version);
            json_body(req, &obj)?
        }
        ("patch", BodyFormat::Patch(PatchType::Apply)) => {
            return Err(ApiError::bad_request(format!(
                "server-side apply is not served at {}: apply at {}",
                served.requested.api_version(),
                storage.api_version()
            ))
            .into());
        }
        ("patch", BodyFormat::Patch(kind)) => {
            let name = req.name()?.to_owned();
            let (stored, _) =
                crate::registry::read(state, &storage, req.namespace.as_deref(), &name).await?;
            let requested = Value::Object(convert(&storage, &stored, &req.resource.version));
            let patched = patch(requested, kind, &body)?;
            let Value::Object(mut patched) = patched else {
                return Err(ApiError::bad_request("the patched object is not an object").into());
            };
            // A resourceVersion the patch left as it was pins the write to the
            // object patched; one the patch changed is the client's precondition.
            if meta_str(&patched, "resourceVersion").is_none()
                && let Some(rv) = meta_str(&stored, "resourceVersion")
            {
                set_meta(&mut patched, "resourceVersion", rv.to_owned());
            }
            req.verb = "update";
            json_body(req, &convert(&storage, &patched, version))?
        }
        _ => body,
    };
    req.resource = storage;
    Ok((body, Some(served)))
}

fn json_body(req: &mut ApiRequest, obj: &Object) -> Result<Bytes, ApiError> {
    req.body_format = BodyFormat::Json;
    req.content_type = Some("application/json".into());
    serde_json::to_vec(obj)
        .map(Bytes::from)
        .map_err(|e| ApiError::internal(format!("encode the converted object: {e}")))
}

fn patch(mut doc: Value, kind: PatchType, body: &[u8]) -> Result<Value, ErrorResponse> {
    let patch: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
    match kind {
        PatchType::Json => {
            let ops: json_patch::Patch = serde_json::from_value(patch)
                .map_err(|e| ApiError::bad_request(format!("error decoding JSON patch: {e}")))?;
            json_patch::patch(&mut doc, &ops).map_err(|e| {
                ApiError::new(
                    422,
                    trellis_api::status::Reason::Invalid,
                    format!("the JSON patch could not be applied: {e}"),
                )
            })?;
        }
        PatchType::StrategicMerge => {
            crate::fieldmanager::patch::strategic_merge(&mut doc, &patch)
                .map_err(ApiError::from)?;
        }
        PatchType::Merge | PatchType::Apply => crate::fieldmanager::patch::merge(&mut doc, &patch),
    }
    Ok(doc)
}

/// The answer in the request's version: the storage version's objects converted,
/// in an object, a list, or each line of a watch; anything else (a Status, a Table)
/// as it is.
pub async fn outbound(response: Response, served: &Served, watch: bool) -> Response {
    let (mut parts, body) = response.into_parts();
    let is_json = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/json"));
    if !is_json {
        return Response::from_parts(parts, body);
    }
    parts.headers.remove(header::CONTENT_LENGTH);
    if watch {
        // A watch: one event a line, chunks of whole lines.
        let served = served.clone();
        let lines = body.into_data_stream().map(move |chunk| {
            chunk.map(|chunk| {
                let mut out = Vec::with_capacity(chunk.len());
                for line in chunk.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                    match serde_json::from_slice::<Value>(line) {
                        Ok(mut event) => {
                            convert_value(&mut event["object"], &served);
                            out.extend(
                                serde_json::to_vec(&event).unwrap_or_else(|_| line.to_vec()),
                            );
                        }
                        Err(_) => out.extend_from_slice(line),
                    }
                    out.push(b'\n');
                }
                Bytes::from(out)
            })
        });
        return Response::from_parts(parts, Body::from_stream(lines));
    }
    let Ok(bytes) = axum::body::to_bytes(body, MAX_CONVERTED).await else {
        return Response::from_parts(
            parts,
            Body::from(
                serde_json::to_vec(
                    &ApiError::internal("the answer was too large to convert").to_status(),
                )
                .unwrap_or_default(),
            ),
        );
    };
    let Ok(mut value) = serde_json::from_slice::<Value>(&bytes) else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    convert_value(&mut value, served);
    let bytes = serde_json::to_vec(&value).map_or(bytes, Bytes::from);
    Response::from_parts(parts, Body::from(bytes))
}

/// Converts `value` in place when it is an object of the storage version, or a list
/// of them.
fn convert_value(value: &mut Value, served: &Served) {
    let (storage, requested) = (&served.storage, &served.requested);
    let kind = value["kind"].as_str().unwrap_or_default();
    let list_kind = format!("{}List", storage.kind);
    if kind == list_kind {
        value["apiVersion"] = Value::from(requested.api_version());
        for item in value["items"].as_array_mut().into_iter().flatten() {
            convert_value_item(item, served);
        }
    } else if kind == storage.kind && value["apiVersion"] == storage.api_version().as_str() {
        convert_value_item(value, served);
    }
}

fn convert_value_item(item: &mut Value, served: &Served) {
    if let Value::Object(obj) = item {
        let had_version = obj.contains_key("apiVersion");
        let mut converted = convert(&served.storage, obj, &served.requested.version);
        if !had_version {
            converted.remove("apiVersion");
        }
        *obj = converted;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn served() -> Served {
        let hpa = trellis_api::registry::builtins()
            .into_iter()
            .find(|r| r.plural == "horizontalpodautoscalers")
            .unwrap();
        let mut requested = hpa.clone();
        requested.version = "v1".into();
        Served {
            requested,
            storage: hpa,
        }
    }

    fn v2() -> Value {
        json!({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "web", "resourceVersion": "7"},
            "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "web"}, "maxReplicas": 3,
                "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                    "target": {"type": "Utilization", "averageUtilization": 50}}}]}})
    }

    #[test]
    fn objects_lists_and_watch_events_of_the_storage_version_are_converted() {
        let served = served();
        let mut one = v2();
        convert_value(&mut one, &served);
        assert_eq!(one["apiVersion"], "autoscaling/v1");
        assert_eq!(one["spec"]["targetCPUUtilizationPercentage"], 50);
        assert_eq!(one["metadata"]["resourceVersion"], "7");
        let mut list = json!({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscalerList",
            "metadata": {}, "items": [v2()]});
        convert_value(&mut list, &served);
        assert_eq!(list["apiVersion"], "autoscaling/v1");
        assert_eq!(
            list["items"][0]["spec"]["targetCPUUtilizationPercentage"],
            50
        );
        // A Status or a Table passes as it is.
        let mut status = json!({"kind": "Status", "apiVersion": "v1", "code": 404});
        convert_value(&mut status, &served);
        assert_eq!(status["apiVersion"], "v1");
    }

    #[tokio::test]
    async fn a_watch_is_converted_line_by_line() {
        let served = served();
        let events = format!(
            "{}\n{}\n",
            json!({"type": "ADDED", "object": v2()}),
            json!({"type": "BOOKMARK", "object": {"kind": "HorizontalPodAutoscaler",
                "apiVersion": "autoscaling/v2", "metadata": {"resourceVersion": "9"}}})
        );
        let response = Response::builder()
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::CACHE_CONTROL, "no-cache, private")
            .body(Body::from(events))
            .unwrap();
        let converted = outbound(response, &served, true).await;
        let bytes = axum::body::to_bytes(converted.into_body(), 1 << 20)
            .await
            .unwrap();
        let lines: Vec<Value> = bytes
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["object"]["apiVersion"], "autoscaling/v1");
        assert_eq!(
            lines[0]["object"]["spec"]["targetCPUUtilizationPercentage"],
            50
        );
        assert_eq!(lines[1]["object"]["apiVersion"], "autoscaling/v1");
    }
}
