//! Quota scopes: which objects a quota counts. `spec.scopes` and
//! `spec.scopeSelector.matchExpressions` must all match; a scoped quota counts pods
//! only, as in Kubernetes and the API server's admission.

use serde_json::Value;

use crate::usage::pod_compute;

/// Whether `quota` counts `obj`, an object of `group`/`plural`.
pub fn selects(quota: &Value, group: &str, plural: &str, obj: &Value) -> bool {
    let spec = &quota["spec"];
    let scopes: Vec<&str> = spec["scopes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let expressions = spec["scopeSelector"]["matchExpressions"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    if scopes.is_empty() && expressions.is_empty() {
        return true;
    }
    if !group.is_empty() || plural != "pods" {
        return false;
    }
    // A scope named in `spec.scopes` is the expression `Exists` on it.
    let named = scopes
        .iter()
        .all(|scope| in_scope(obj, scope, "Exists", &[]));
    named
        && expressions.iter().all(|e| {
            let values: Vec<&str> = e["values"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            in_scope(
                obj,
                e["scopeName"].as_str().unwrap_or_default(),
                e["operator"].as_str().unwrap_or_default(),
                &values,
            )
        })
}

/// Whether `pod` satisfies `operator` (with `values`, for `PriorityClass`) on `scope`.
/// An unknown scope or operator selects nothing.
fn in_scope(pod: &Value, scope: &str, operator: &str, values: &[&str]) -> bool {
    let spec = &pod["spec"];
    let exists = |holds: bool| match operator {
        "Exists" => holds,
        "DoesNotExist" => !holds,
        _ => false,
    };
    let terminating = spec["activeDeadlineSeconds"]
        .as_i64()
        .is_some_and(|d| d >= 0);
    match scope {
        "Terminating" => exists(terminating),
        "NotTerminating" => exists(!terminating),
        "BestEffort" => exists(pod_compute(pod).is_empty()),
        "NotBestEffort" => exists(!pod_compute(pod).is_empty()),
        "CrossNamespacePodAffinity" => exists(reaches_other_namespaces(pod)),
        "PriorityClass" => {
            let class = spec["priorityClassName"].as_str().filter(|c| !c.is_empty());
            match operator {
                "In" => class.is_some_and(|c| values.contains(&c)),
                "NotIn" => class.is_none_or(|c| !values.contains(&c)),
                "Exists" => class.is_some(),
                "DoesNotExist" => class.is_none(),
                _ => false,
            }
        }
        _ => false,
    }
}

/// Whether a term of the pod's affinity or anti-affinity, required or preferred,
/// looks at pods of other namespaces (`namespaces` listed, or a `namespaceSelector`).
fn reaches_other_namespaces(pod: &Value) -> bool {
    let affinity = &pod["spec"]["affinity"];
    ["podAffinity", "podAntiAffinity"].iter().any(|kind| {
        let rules = &affinity[*kind];
        let required = rules["requiredDuringSchedulingIgnoredDuringExecution"]
            .as_array()
            .into_iter()
            .flatten();
        let preferred = rules["preferredDuringSchedulingIgnoredDuringExecution"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|weighted| &weighted["podAffinityTerm"]);
        required.chain(preferred).any(|term| {
            term["namespaces"].as_array().is_some_and(|n| !n.is_empty())
                || !term["namespaceSelector"].is_null()
        })
    })
}
