//! The `scale`, `binding`, `log` and `token` subresources (`pods/exec` is [`super::exec`]).
//!
//! `scale` shows a workload's `.spec.replicas` as an `autoscaling/v1` `Scale` (what
//! `kubectl scale` and autoscalers read and write); `pods/binding` assigns a pod to a
//! node, once, as the scheduler does; `pods/log` is read from the pod's node.

use axum::http::{StatusCode, header};
use axum::response::IntoResponse as _;
use bytes::Bytes;
use serde_json::{Value, json};
use trellis_api::ApiError;
use trellis_api::selector::LabelSelector;
use trellis_store::Revision;

use crate::endpoints::request::{ApiRequest, BodyFormat, PatchType};
use crate::endpoints::response::{ApiResult, json_response, store_error};
use crate::object::{Object, meta_str, metadata, set_meta};
use crate::registry::read;
use crate::state::AppState;

fn scale_of(obj: &Object, rev: Revision) -> Value {
    let meta = metadata(obj).cloned().unwrap_or_default();
    let selector = crate::object::spec_selector(obj)
        .and_then(|s| serde_json::from_value(s).ok())
        .and_then(|s| LabelSelector::from_k8s(&s).ok())
        .map(|s| s.to_string())
        .unwrap_or_default();
    json!({
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "resourceVersion": rev.to_string(),
            "creationTimestamp": meta.get("creationTimestamp"),
        },
        "spec": {"replicas": obj.get("spec").and_then(|s| s.get("replicas")).and_then(Value::as_i64).unwrap_or(1)},
        "status": {
            "replicas": obj.get("status").and_then(|s| s.get("replicas")).and_then(Value::as_i64).unwrap_or(0),
            "selector": selector,
        },
    })
}

pub async fn get_scale(state: &AppState, req: &ApiRequest) -> ApiResult {
    let (obj, rev) = read(state, &req.resource, req.namespace.as_deref(), req.name()?).await?;
    Ok(json_response(StatusCode::OK, &scale_of(&obj, rev)))
}

/// `PUT` or `PATCH` of `…/scale`: the new replica count goes to the workload's spec.
pub async fn write_scale(state: &AppState, req: &ApiRequest, body: Bytes) -> ApiResult {
    let name = req.name()?;
    let res = &req.resource;
    for _ in 0..8 {
        let (mut obj, rev) = read(state, res, req.namespace.as_deref(), name).await?;
        let old = obj.clone();
        let mut scale = scale_of(&obj, rev);
        match req.body_format {
            BodyFormat::Json | BodyFormat::Yaml | BodyFormat::Protobuf => {
                scale = Value::Object(req.decode_body(&body)?)
            }
            BodyFormat::Patch(PatchType::Json) => {
                let ops: json_patch::Patch = serde_json::from_slice(&body).map_err(|e| {
                    ApiError::bad_request(format!("error decoding JSON patch: {e}"))
                })?;
                json_patch::patch(&mut scale, &ops).map_err(|e| {
                    ApiError::bad_request(format!("the JSON patch could not be applied: {e}"))
                })?;
            }
            BodyFormat::Patch(_) => {
                let patch: Value = serde_json::from_slice(&body)
                    .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
                crate::fieldmanager::patch::merge(&mut scale, &patch);
            }
            BodyFormat::Unsupported => {
                return Err(ApiError::unsupported_media_type(
                    req.content_type.as_deref().unwrap_or(""),
                )
                .into());
            }
        }
        let replicas = scale
            .get("spec")
            .and_then(|s| s.get("replicas"))
            .and_then(Value::as_i64)
            .ok_or_else(|| {
                ApiError::invalid(
                    "autoscaling",
                    "Scale",
                    name,
                    vec![trellis_api::status::StatusCause::required("spec.replicas")],
                )
            })?;
        if replicas < 0 {
            return Err(ApiError::invalid(
                "autoscaling",
                "Scale",
                name,
                vec![trellis_api::status::StatusCause::invalid(
                    "spec.replicas",
                    &replicas.to_string(),
                    "must be greater than or equal to 0",
                )],
            )
            .into());
        }
        let pinned = scale
            .get("metadata")
            .and_then(|m| m.get("resourceVersion"))
            .and_then(Value::as_str)
            .filter(|v| !v.is_empty())
            .map(|v| {
                v.parse::<Revision>()
                    .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {v:?}")))
            })
            .transpose()?;
        let expected = pinned.unwrap_or(rev);
        let spec = obj.entry("spec").or_insert_with(|| json!({}));
        let changed = spec.get("replicas").and_then(Value::as_i64) != Some(replicas);
        spec["replicas"] = replicas.into();
        if changed {
            let generation = metadata(&obj)
                .and_then(|m| m.get("generation"))
                .and_then(Value::as_i64)
                .unwrap_or(1);
            set_meta(&mut obj, "generation", generation + 1);
        }
        // The scale's writer owns the workload's replicas, as `…/scale` in Kubernetes.
        crate::fieldmanager::field_manager::record_write(state, req, Some(&old), &mut obj)?;
        crate::object::remove_meta(&mut obj, "resourceVersion");
        if req.dry_run {
            return Ok(json_response(StatusCode::OK, &scale_of(&obj, rev)));
        }
        let stored = crate::object::encode(&obj)?;
        match state
            .store
            .update(
                &res.key(req.namespace.as_deref(), name),
                stored,
                Some(expected),
            )
            .await
        {
            Ok(kv) => {
                return Ok(json_response(
                    StatusCode::OK,
                    &scale_of(&obj, kv.mod_revision),
                ));
            }
            Err(trellis_store::Error::Conflict { .. }) if pinned.is_none() => continue,
            Err(e) => return Err(store_error(e, res, name).into()),
        }
    }
    Err(ApiError::conflict(&res.group, &res.plural, name, ApiError::MODIFIED).into())
}

/// `POST pods/{name}/binding`: sets `spec.nodeName` of an unbound pod.
pub async fn bind(state: &AppState, req: &ApiRequest, body: Bytes) -> ApiResult {
    let name = req.name()?;
    let binding = req.decode_body(&body)?;
    if crate::object::name(&binding) != Some(name) {
        return Err(
            ApiError::bad_request("name in URL does not match name in Binding object").into(),
        );
    }
    let node = binding
        .get("target")
        .and_then(|t| t.get("name"))
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| {
            ApiError::invalid(
                "",
                "Binding",
                name,
                vec![trellis_api::status::StatusCause::required("target.name")],
            )
        })?
        .to_owned();
    // The Binding is what is admitted, as in Kubernetes: a CREATE of pods/binding.
    let mut binding = binding;
    let attrs = super::create::admission_attributes(req, "CREATE", name);
    state.chains.mutate(&attrs, &mut binding, None).await?;
    state.chains.validate(&attrs, &binding, None).await?;
    let annotations = metadata(&binding)
        .and_then(|m| m.get("annotations"))
        .and_then(Value::as_object)
        .cloned();
    super::guaranteed_update(state, req, name, |old, pod| {
        if let Some(current) = pod
            .get("spec")
            .and_then(|s| s.get("nodeName"))
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
        {
            return Err(ApiError::conflict(
                "",
                "pods",
                name,
                &format!("pod {name} is already assigned to node {current:?}"),
            ));
        }
        if meta_str(pod, "deletionTimestamp").is_some() {
            return Err(ApiError::conflict(
                "",
                "pods",
                name,
                "pod is being deleted, cannot be assigned to a host",
            ));
        }
        pod.entry("spec").or_insert_with(|| json!({}))["nodeName"] = node.clone().into();
        // As Kubernetes binds: the binding's annotations join the pod's, and the pod is
        // marked scheduled.
        if let Some(annotations) = &annotations {
            let meta = crate::object::metadata_mut(pod);
            let own = meta.entry("annotations").or_insert_with(|| json!({}));
            if !own.is_object() {
                *own = json!({});
            }
            if let Value::Object(own) = own {
                own.extend(annotations.clone());
            }
        }
        set_condition(pod, "PodScheduled", "True");
        crate::fieldmanager::field_manager::record_write(state, req, Some(old), pod)
    })
    .await?;
    Ok(bound())
}

/// A binding's answer: a Status of success.
fn bound() -> axum::response::Response {
    json_response(
        StatusCode::CREATED,
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
    )
}

/// Sets the pod's condition `kind` to `status`, its transition time now when it changes.
fn set_condition(pod: &mut Object, kind: &str, status: &str) {
    let status_obj = pod.entry("status").or_insert_with(|| json!({}));
    let Some(status_map) = status_obj.as_object_mut() else {
        return;
    };
    let conditions = status_map.entry("conditions").or_insert_with(|| json!([]));
    let Some(list) = conditions.as_array_mut() else {
        return;
    };
    let now = crate::object::now_timestamp();
    match list
        .iter_mut()
        .find(|c| c.get("type").and_then(Value::as_str) == Some(kind))
    {
        Some(existing) => {
            if existing.get("status").and_then(Value::as_str) != Some(status) {
                existing["status"] = status.into();
                existing["lastTransitionTime"] = now.into();
            }
        }
        None => list.push(json!({
            "type": kind,
            "status": status,
            "lastProbeTime": null,
            "lastTransitionTime": now,
        })),
    }
}

/// `GET pods/{name}/log`: checked as Kubernetes checks it (the pod exists, the
/// container is one of its own or the only one); nothing for a pod no node has taken
/// (204, as kube-apiserver answers). Otherwise the pod's node serves the log (its
/// agent's `/containerLogs`, at the Node's `InternalIP` and
/// `daemonEndpoints.kubeletEndpoint.Port`), streamed back as it comes: a followed log
/// lasts as long as the client reads it.
pub async fn log(state: &AppState, req: &ApiRequest) -> ApiResult {
    let name = req.name()?;
    let namespace = req.namespace.as_deref().unwrap_or_default();
    let (pod, _) = read(state, &req.resource, req.namespace.as_deref(), name).await?;
    let spec = pod.get("spec");
    let container = container_of(&pod, name, req.query.container.as_deref())?;
    let node_name = spec
        .and_then(|s| s.get("nodeName"))
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty());
    let Some(node_name) = node_name else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    let option = |key: &str| {
        req.query
            .log_options
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    };
    let previous = option("previous").is_some_and(|v| matches!(v, "true" | "1" | "True"));
    if !previous && let Some(reason) = waiting_to_start(&pod, &container) {
        return Err(ApiError::bad_request(format!(
            "container {container:?} in pod {name:?} is waiting to start: {reason}"
        ))
        .into());
    }
    let nodes = state.resource("", "v1", "nodes")?;
    let (node, _) = read(state, &nodes, None, node_name).await?;
    let Some((host, port)) = kubelet_endpoint(&node) else {
        return Err(ApiError::unavailable(format!("node {node_name} does not serve logs")).into());
    };
    // Passed on as given: the node checks them, as the kubelet does.
    let mut query = String::new();
    for key in [
        "follow",
        "previous",
        "timestamps",
        "tailLines",
        "sinceSeconds",
        "sinceTime",
        "limitBytes",
    ] {
        if let Some(value) = option(key) {
            query.push(if query.is_empty() { '?' } else { '&' });
            query.push_str(key);
            query.push('=');
            query.push_str(&query_escape(value));
        }
    }
    let path = format!("/containerLogs/{namespace}/{name}/{container}{query}");
    let response = state
        .kubelet
        .get(&host, port, &path)
        .await
        .map_err(|e| ApiError::unavailable(format!("node {node_name}: {e}")))?;
    let status = response.status();
    if !status.is_success() {
        // What the node says, as kube-apiserver passes on the kubelet's answer: its
        // "not found"s are about containers of a pod that exists, which Kubernetes
        // reports as bad requests.
        let body = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            http_body_util::BodyExt::collect(http_body_util::Limited::new(
                response.into_body(),
                MAX_NODE_ERROR,
            )),
        )
        .await
        .ok()
        .and_then(Result::ok)
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).trim().to_owned())
        .unwrap_or_default();
        let message = if body.is_empty() {
            format!("node {node_name} answered {status}")
        } else {
            body
        };
        return Err(match status {
            StatusCode::BAD_REQUEST | StatusCode::NOT_FOUND => ApiError::bad_request(message),
            _ => ApiError::internal(format!("node {node_name} answered {status}: {message}")),
        }
        .into());
    }
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain")],
        axum::body::Body::new(response.into_body()),
    )
        .into_response())
}

/// The container a `pods/log` or `pods/exec` request is for: the one it names, which
/// must be one of the pod's, or the pod's only container.
pub(crate) fn container_of(
    pod: &Object,
    name: &str,
    requested: Option<&str>,
) -> Result<String, ApiError> {
    let spec = pod.get("spec");
    let names = |list: &str| -> Vec<String> {
        spec.and_then(|s| s.get(list))
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|c| c.get("name").and_then(Value::as_str).map(str::to_owned))
            .collect()
    };
    let containers = names("containers");
    match requested {
        Some(container) => {
            let known = containers.iter().any(|c| c == container)
                || names("initContainers").iter().any(|c| c == container)
                || names("ephemeralContainers").iter().any(|c| c == container);
            if !known {
                return Err(ApiError::bad_request(format!(
                    "container {container} is not valid for pod {name}"
                )));
            }
            Ok(container.to_owned())
        }
        None if containers.len() > 1 => Err(ApiError::bad_request(format!(
            "a container name must be specified for pod {name}, choose one of: [{}]",
            containers.join(" ")
        ))),
        None => containers
            .into_iter()
            .next()
            .ok_or_else(|| ApiError::bad_request(format!("pod {name} does not have a container"))),
    }
}

/// The most of a node's error answer that is read.
pub(crate) const MAX_NODE_ERROR: usize = 64 * 1024;

/// Why a container that never ran has no log yet, from the pod's status (the kubelet's
/// check): its waiting reason, when it is waiting and has not terminated before.
fn waiting_to_start(pod: &Object, container: &str) -> Option<String> {
    let status = pod.get("status")?;
    let found = [
        "containerStatuses",
        "initContainerStatuses",
        "ephemeralContainerStatuses",
    ]
    .into_iter()
    .filter_map(|list| status.get(list).and_then(Value::as_array))
    .flatten()
    .find(|s| s.get("name").and_then(Value::as_str) == Some(container))?;
    let waiting = found.get("state")?.get("waiting")?;
    let ran_before = found
        .get("lastState")
        .and_then(|s| s.get("terminated"))
        .is_some_and(|t| !t.is_null());
    if ran_before {
        return None;
    }
    Some(
        waiting
            .get("reason")
            .and_then(Value::as_str)
            .filter(|r| !r.is_empty())
            .unwrap_or("ContainerCreating")
            .to_owned(),
    )
}

/// Where a Node's agent serves logs: its `InternalIP` (else its first address) and
/// `status.daemonEndpoints.kubeletEndpoint.Port`.
pub(crate) fn kubelet_endpoint(node: &Object) -> Option<(String, u16)> {
    let status = node.get("status")?;
    let port = status
        .get("daemonEndpoints")
        .and_then(|d| d.get("kubeletEndpoint"))
        .and_then(|k| k.get("Port"))
        .and_then(Value::as_u64)
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0)?;
    let addresses = status.get("addresses").and_then(Value::as_array)?;
    fn address(a: &Value) -> Option<&str> {
        a.get("address")
            .and_then(Value::as_str)
            .filter(|a| !a.is_empty())
    }
    let host = addresses
        .iter()
        .find(|a| a.get("type").and_then(Value::as_str) == Some("InternalIP"))
        .and_then(address)
        .or_else(|| addresses.iter().find_map(address))?;
    Some((host.to_owned(), port))
}

/// Percent-encodes a query value: everything but RFC 3986's unreserved characters.
pub(crate) fn query_escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `POST serviceaccounts/{name}/token`: a TokenRequest answered with a signed token.
pub async fn token_request(state: &AppState, req: &ApiRequest, body: Bytes) -> ApiResult {
    let name = req.name()?;
    let namespace = req.namespace.as_deref().unwrap_or_default();
    let (account, _) = read(state, &req.resource, Some(namespace), name).await?;
    let request = if body.is_empty() {
        Object::new()
    } else {
        req.decode_body(&body)?
    };
    let spec = request.get("spec").cloned().unwrap_or_else(|| json!({}));
    let seconds = token_expiration(
        spec.get("expirationSeconds"),
        state.settings.max_token_expiration,
        name,
    )?;
    let audiences: Vec<String> = spec
        .get("audiences")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    let now = jiff::Timestamp::now().as_second();
    let claims = crate::authentication::sa_token::Claims {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        uid: meta_str(&account, "uid").unwrap_or_default().to_owned(),
        expires: now + seconds,
    };
    let token = state
        .signer
        .issue(&claims, &audiences, now)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let expires = jiff::Timestamp::from_second(claims.expires)
        .map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_default();
    let audiences = if audiences.is_empty() {
        vec![crate::authentication::sa_token::ISSUER.to_owned()]
    } else {
        audiences
    };
    Ok(json_response(
        StatusCode::CREATED,
        &json!({
            "kind": "TokenRequest",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": crate::object::now_timestamp()},
            "spec": {"audiences": audiences, "expirationSeconds": seconds, "boundObjectRef": null},
            "status": {"token": token, "expirationTimestamp": expires},
        }),
    ))
}

/// The shortest token Kubernetes issues, and the longest it accepts a request for.
const MIN_TOKEN_SECONDS: i64 = 600;
const MAX_TOKEN_SECONDS: i64 = 1 << 32;

/// A TokenRequest's `spec.expirationSeconds` as Kubernetes reads it: an integer (a
/// fraction or a number past `i64` is a decode error, not a default), at least ten
/// minutes, at most 2^32 seconds; then cut to the server's maximum, if it has one.
fn token_expiration(
    requested: Option<&Value>,
    max: Option<std::time::Duration>,
    name: &str,
) -> ApiResult<i64> {
    let seconds = match requested {
        None | Some(Value::Null) => crate::authentication::sa_token::DEFAULT_EXPIRATION_SECONDS,
        Some(v) => v.as_i64().ok_or_else(|| {
            ApiError::bad_request(format!(
                "TokenRequest in version \"v1\" cannot be handled as a TokenRequest: \
                 spec.expirationSeconds: {v} is not a 64-bit integer"
            ))
        })?,
    };
    let invalid = |message: &str| {
        ApiError::invalid(
            "authentication.k8s.io",
            "TokenRequest",
            name,
            vec![trellis_api::status::StatusCause::invalid(
                "spec.expirationSeconds",
                &seconds.to_string(),
                message,
            )],
        )
    };
    if seconds < MIN_TOKEN_SECONDS {
        return Err(invalid("may not specify a duration less than 10 minutes").into());
    }
    if seconds > MAX_TOKEN_SECONDS {
        return Err(invalid("may not specify a duration larger than 2^32 seconds").into());
    }
    let max = max.map_or(i64::MAX, |m| i64::try_from(m.as_secs()).unwrap_or(i64::MAX));
    Ok(seconds.min(max.max(MIN_TOKEN_SECONDS)))
}
