//! `POST pods/{name}/eviction` (a `policy/v1` Eviction): a delete that keeps the pod's
//! PodDisruptionBudget, as kube-apiserver's eviction subresource, which `kubectl
//! drain` uses.
//!
//! - A pod that is Pending or has finished, or is being deleted, is deleted without
//!   asking.
//! - A pod with no budget is deleted; a pod that more than one budget selects is
//!   refused (500), as Kubernetes refuses it.
//! - With one budget: a budget whose status has not caught up with its spec, or that
//!   allows no disruption, refuses with 429 TooManyRequests (clients try again
//!   later). Otherwise the budget's status is written first (one disruption fewer,
//!   the pod in `disruptedPods`) with a precondition on its resourceVersion, then
//!   the pod is deleted with the eviction's `deleteOptions` (graceful for a bound pod).
//! - A pod that is not Ready is evicted without counting against the budget when the
//!   budget is healthy anyway (`unhealthyPodEvictionPolicy: IfHealthyBudget`, the
//!   default) or always (`AlwaysAllow`).

use axum::http::StatusCode;
use bytes::Bytes;
use serde_json::{Value, json};
use trellis_api::ApiError;
use trellis_api::selector::LabelSelector;
use trellis_api::status::{StatusCause, StatusDetails};
use trellis_store::ListRequest;

use super::read;
use crate::endpoints::request::{ApiRequest, BodyFormat};
use crate::endpoints::response::{ApiResult, json_response, store_error};
use crate::object::{self, Object, meta_str};
use crate::state::AppState;
use crate::storage::watch_cache::decode_stored;

/// Tries of the budget's status write against concurrent evictions.
const BUDGET_TRIES: usize = 5;

pub async fn evict(state: &AppState, req: &ApiRequest, body: Bytes) -> ApiResult {
    let name = req.name()?;
    let eviction = req.decode_body(&body)?;
    if object::name(&eviction).is_some_and(|n| n != name) {
        return Err(
            ApiError::bad_request("name in URL does not match name in Eviction object").into(),
        );
    }
    let options = eviction
        .get("deleteOptions")
        .cloned()
        .unwrap_or(Value::Null);
    let dry_run = req.dry_run
        || options
            .get("dryRun")
            .and_then(Value::as_array)
            .is_some_and(|modes| modes.iter().any(|m| m == "All"));
    let namespace = req.namespace.as_deref();
    let (pod, _) = read(state, &req.resource, namespace, name).await?;
    let phase = pod
        .get("status")
        .and_then(|s| s.get("phase"))
        .and_then(Value::as_str);
    // As Kubernetes' canIgnorePDB: a pod not running disrupts nothing.
    let not_running = matches!(phase, Some("Succeeded" | "Failed" | "Pending"));
    if !not_running && meta_str(&pod, "deletionTimestamp").is_none() {
        keep_budget(state, req, &pod, name, dry_run).await?;
    }
    if !dry_run {
        delete_pod(state, req, options).await?;
    }
    Ok(json_response(
        StatusCode::CREATED,
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
    ))
}

/// Checks the pod's budget and, unless a dry run, takes one disruption from it.
async fn keep_budget(
    state: &AppState,
    req: &ApiRequest,
    pod: &Object,
    name: &str,
    dry_run: bool,
) -> Result<(), ApiError> {
    let budgets_res = state.resource("policy", "v1", "poddisruptionbudgets")?;
    for _ in 0..BUDGET_TRIES {
        let budgets = budgets_of(state, &budgets_res, req.namespace.as_deref(), pod).await?;
        let (budget, revision) = match budgets.as_slice() {
            [] => return Ok(()),
            [one] => one.clone(),
            _ => {
                return Err(ApiError::internal(
                    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
                ));
            }
        };
        let budget_name = meta_str(&budget, "name").unwrap_or_default().to_owned();
        let status = budget.get("status").cloned().unwrap_or(Value::Null);
        let number = |field: &str| status.get(field).and_then(Value::as_i64).unwrap_or(0);
        let ready = pod
            .get("status")
            .and_then(|s| s.get("conditions"))
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            });
        let policy = budget
            .get("spec")
            .and_then(|s| s.get("unhealthyPodEvictionPolicy"))
            .and_then(Value::as_str)
            .unwrap_or("IfHealthyBudget");
        if !ready
            && (policy == "AlwaysAllow"
                || number("currentHealthy") >= number("desiredHealthy")
                    && number("desiredHealthy") > 0)
        {
            return Ok(());
        }
        let generation = budget
            .get("metadata")
            .and_then(|m| m.get("generation"))
            .and_then(Value::as_i64)
            .unwrap_or(0);
        if number("observedGeneration") < generation {
            return Err(too_many(format!(
                "The disruption budget {budget_name} is still being processed by the server."
            )));
        }
        if number("disruptionsAllowed") <= 0 {
            return Err(too_many(format!(
                "The disruption budget {budget_name} needs {} healthy pods and has {} currently",
                number("desiredHealthy"),
                number("currentHealthy")
            )));
        }
        if dry_run {
            return Ok(());
        }
        let mut updated = budget.clone();
        let status = updated.entry("status").or_insert_with(|| json!({}));
        status["disruptionsAllowed"] = json!(number("disruptionsAllowed") - 1);
        if !status["disruptedPods"].is_object() {
            status["disruptedPods"] = json!({});
        }
        status["disruptedPods"][name] = json!(object::now_timestamp());
        object::remove_meta(&mut updated, "resourceVersion");
        let key = budgets_res.key(req.namespace.as_deref(), &budget_name);
        match state
            .store
            .update(&key, object::encode(&updated)?, Some(revision))
            .await
        {
            Ok(_) => return Ok(()),
            Err(trellis_store::Error::Conflict { .. }) => continue,
            Err(e) => return Err(store_error(e, &budgets_res, &budget_name)),
        }
    }
    Err(ApiError::conflict(
        "policy",
        "poddisruptionbudgets",
        "",
        "the budget kept changing; try again",
    ))
}

/// The 429 of an eviction the budget does not allow now, in Kubernetes' words; with
/// no Retry-After, so a client's own back-off (kubectl drain's 5 s) decides.
fn too_many(cause: String) -> ApiError {
    ApiError {
        details: Some(Box::new(StatusDetails {
            causes: vec![StatusCause::new("DisruptionBudget", "", cause)],
            ..StatusDetails::default()
        })),
        ..ApiError::new(
            429,
            trellis_api::status::Reason::TooManyRequests,
            "Cannot evict pod as it would violate the pod's disruption budget.",
        )
    }
}

/// The budgets of the pod's namespace whose selector matches it, with their
/// revisions. A null selector selects nothing; an empty one, everything.
async fn budgets_of(
    state: &AppState,
    budgets: &trellis_api::registry::ResourceInfo,
    namespace: Option<&str>,
    pod: &Object,
) -> Result<Vec<(Object, trellis_store::Revision)>, ApiError> {
    let listed = state
        .store
        .list(ListRequest::prefix(budgets.namespace_prefix(namespace)))
        .await
        .map_err(|e| store_error(e, budgets, ""))?;
    let labels: std::collections::BTreeMap<String, String> = pod
        .get("metadata")
        .and_then(|m| m.get("labels"))
        .and_then(|l| serde_json::from_value(l.clone()).ok())
        .unwrap_or_default();
    let mut out = Vec::new();
    for kv in listed.kvs {
        let Some(budget) = decode_stored(&kv.value, kv.mod_revision) else {
            continue;
        };
        let Some(selector) = budget
            .get("spec")
            .and_then(|s| s.get("selector"))
            .filter(|s| !s.is_null())
        else {
            continue;
        };
        let selector = serde_json::from_value(selector.clone())
            .ok()
            .and_then(|s| LabelSelector::from_k8s(&s).ok());
        if selector.is_some_and(|s| s.matches_map(&labels)) {
            out.push((budget, kv.mod_revision));
        }
    }
    Ok(out)
}

/// Deletes the pod as a client's delete with the eviction's options would.
async fn delete_pod(state: &AppState, req: &ApiRequest, options: Value) -> ApiResult<()> {
    let mut delete = req.clone();
    delete.subresource = None;
    delete.verb = "delete";
    delete.body_format = BodyFormat::Json;
    let body = if options.is_null() {
        Bytes::new()
    } else {
        Bytes::from(serde_json::to_vec(&options).unwrap_or_default())
    };
    super::delete(state, &delete, body).await.map(|_| ())
}
