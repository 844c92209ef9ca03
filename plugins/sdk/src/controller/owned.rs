//! Owned objects: ownerReferences and label selectors, as controllers read them.

use serde_json::{Value, json};

/// The ownerReference a controller puts on what it creates: `controller` and
/// `blockOwnerDeletion` set, so the owner's changes reach it and a foreground
/// deletion of the owner waits for it.
pub fn controller_reference(api_version: &str, kind: &str, owner: &Value) -> Value {
    json!({
        "apiVersion": api_version,
        "kind": kind,
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": true,
        "blockOwnerDeletion": true,
    })
}

/// The patch that adopts `object` (of `resource` in `namespace`): `reference`
/// becomes its controller. The object's uid in the patch makes it fail rather
/// than adopt another object of the same name.
pub fn adopt(
    resource: &crate::GroupVersionResource,
    namespace: Option<&str>,
    object: &Value,
    reference: Value,
) -> super::Write {
    claim_patch(resource, namespace, object, reference)
}

/// The patch that releases `object` from the owner with `owner_uid`.
pub fn release(
    resource: &crate::GroupVersionResource,
    namespace: Option<&str>,
    object: &Value,
    owner_uid: &str,
) -> super::Write {
    claim_patch(
        resource,
        namespace,
        object,
        json!({"$patch": "delete", "uid": owner_uid}),
    )
}

fn claim_patch(
    resource: &crate::GroupVersionResource,
    namespace: Option<&str>,
    object: &Value,
    reference: Value,
) -> super::Write {
    super::Write::Patch {
        resource: resource.clone(),
        namespace: namespace.map(str::to_owned),
        name: object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        patch_type: super::PatchType::Strategic,
        patch: json!({"metadata": {
            "ownerReferences": [reference],
            "uid": object["metadata"]["uid"],
        }}),
        status: false,
        force: false,
    }
}

/// The ownerReference of `object` that has `controller: true`.
pub fn controller_of(object: &Value) -> Option<&Value> {
    object["metadata"]["ownerReferences"]
        .as_array()?
        .iter()
        .find(|r| r["controller"] == true)
}

/// Whether `object`'s controller is the owner with `uid`.
pub fn is_controlled_by(object: &Value, uid: &str) -> bool {
    controller_of(object).is_some_and(|r| r["uid"] == uid)
}

/// A `metav1.LabelSelector` (`matchLabels`, `matchExpressions`) as the string
/// form a list takes (`a=b,c in (d,e),!f`). An empty selector is `""`, which
/// selects everything: callers that must select nothing check
/// [`selector_is_empty`] first, as Kubernetes' controllers do.
pub fn selector_string(selector: &Value) -> Result<String, String> {
    let mut parts = Vec::new();
    if let Some(labels) = selector["matchLabels"].as_object() {
        for (k, v) in labels {
            let v = v
                .as_str()
                .ok_or_else(|| format!("matchLabels.{k}: not a string"))?;
            parts.push(format!("{k}={v}"));
        }
    }
    for (i, e) in selector["matchExpressions"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let key = e["key"]
            .as_str()
            .ok_or_else(|| format!("matchExpressions[{i}].key: required"))?;
        let values: Vec<&str> = e["values"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let op = e["operator"].as_str().unwrap_or_default();
        parts.push(match op {
            "In" | "NotIn" if values.is_empty() => {
                return Err(format!(
                    "matchExpressions[{i}].values: {op} needs at least one value"
                ));
            }
            "In" => format!("{key} in ({})", values.join(",")),
            "NotIn" => format!("{key} notin ({})", values.join(",")),
            "Exists" => key.to_owned(),
            "DoesNotExist" => format!("!{key}"),
            other => {
                return Err(format!(
                    "matchExpressions[{i}].operator: {other:?} is not In, NotIn, Exists or DoesNotExist"
                ));
            }
        });
    }
    Ok(parts.join(","))
}

/// Whether the selector has no requirement (it would select every object).
pub fn selector_is_empty(selector: &Value) -> bool {
    selector["matchLabels"]
        .as_object()
        .is_none_or(|m| m.is_empty())
        && selector["matchExpressions"]
            .as_array()
            .is_none_or(|e| e.is_empty())
}

/// Whether `labels` (a JSON map, or null) satisfy the selector.
pub fn selector_matches(selector: &Value, labels: &Value) -> bool {
    let label = |k: &str| labels.get(k).and_then(Value::as_str);
    let labels_ok = selector["matchLabels"]
        .as_object()
        .into_iter()
        .flatten()
        .all(|(k, v)| label(k).is_some_and(|have| Some(have) == v.as_str()));
    labels_ok
        && selector["matchExpressions"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|e| {
                let key = e["key"].as_str().unwrap_or_default();
                let mut values = e["values"].as_array().into_iter().flatten();
                match e["operator"].as_str() {
                    Some("In") => label(key).is_some_and(|h| values.any(|v| v == h)),
                    Some("NotIn") => label(key).is_none_or(|h| !values.any(|v| v == h)),
                    Some("Exists") => label(key).is_some(),
                    Some("DoesNotExist") => label(key).is_none(),
                    _ => false,
                }
            })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_become_list_strings_and_match_as_the_api_server_does() {
        let selector = json!({
            "matchLabels": {"app": "web"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["a", "b"]},
                {"key": "canary", "operator": "DoesNotExist"},
            ],
        });
        assert_eq!(
            selector_string(&selector).unwrap(),
            "app=web,tier in (a,b),!canary"
        );
        assert!(selector_matches(
            &selector,
            &json!({"app": "web", "tier": "b"})
        ));
        assert!(!selector_matches(
            &selector,
            &json!({"app": "web", "tier": "c"})
        ));
        assert!(!selector_matches(
            &selector,
            &json!({"app": "web", "tier": "a", "canary": "1"})
        ));
        assert!(!selector_matches(&selector, &Value::Null));
        assert!(selector_is_empty(&json!({})));
        let bad = json!({"matchExpressions": [{"key": "k", "operator": "In"}]});
        assert!(
            selector_string(&bad)
                .unwrap_err()
                .contains("at least one value")
        );
    }

    #[test]
    fn the_controller_reference_is_the_one_with_controller_set() {
        let owner = json!({"metadata": {"name": "rs", "uid": "u1"}});
        let pod = json!({"metadata": {"ownerReferences": [
            {"kind": "Other", "uid": "u0", "name": "x"},
            controller_reference("apps/v1", "ReplicaSet", &owner),
        ]}});
        assert!(is_controlled_by(&pod, "u1"));
        assert!(!is_controlled_by(&pod, "u0"));
        assert_eq!(controller_of(&pod).unwrap()["blockOwnerDeletion"], true);
    }
}
