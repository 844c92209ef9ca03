//! Merge patches: JSON merge patch (RFC 7386) and the parts of Kubernetes' strategic
//! merge patch that `kubectl apply` relies on most: lists of objects keyed by `name`
//! merge element by element, and `$patch: delete` removes an element.
//!
//! Not yet covered: per-field patch strategies from the OpenAPI extensions
//! (`x-kubernetes-patch-merge-key` other than `name`), `$retainKeys`,
//! `$deleteFromPrimitiveList` and `$setElementOrder`.

use serde_json::{Map, Value};

/// Applies `patch` to `doc`. With `strategic`, lists whose elements all carry a `name`
/// merge by it instead of being replaced.
pub fn merge(doc: &mut Value, patch: &Value, strategic: bool) {
    let Value::Object(patch_map) = patch else {
        *doc = patch.clone();
        return;
    };
    if !doc.is_object() {
        *doc = Value::Object(Map::new());
    }
    let Value::Object(target) = doc else { return };
    for (key, value) in patch_map {
        if strategic && key.starts_with('$') {
            // Directives of the strategic merge patch are not data.
            continue;
        }
        match value {
            Value::Null => {
                target.remove(key);
            }
            Value::Object(_) => {
                let entry = target.entry(key.clone()).or_insert(Value::Null);
                merge(entry, value, strategic);
            }
            Value::Array(items) if strategic && keyed_by_name(items) => {
                let entry = target
                    .entry(key.clone())
                    .or_insert_with(|| Value::Array(Vec::new()));
                merge_named_list(entry, items);
            }
            other => {
                target.insert(key.clone(), other.clone());
            }
        }
    }
}

fn keyed_by_name(items: &[Value]) -> bool {
    !items.is_empty()
        && items
            .iter()
            .all(|i| i.get("name").is_some_and(Value::is_string))
}

fn merge_named_list(target: &mut Value, items: &[Value]) {
    if !target
        .as_array()
        .is_some_and(|t| t.iter().all(|i| i.get("name").is_some()))
    {
        *target = Value::Array(Vec::new());
    }
    let Value::Array(list) = target else { return };
    for item in items {
        let name = item.get("name").cloned();
        let position = list.iter().position(|e| e.get("name") == name.as_ref());
        let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
        match (position, delete) {
            (Some(i), true) => {
                list.remove(i);
            }
            (None, true) => {}
            (Some(i), false) => merge(&mut list[i], item, true),
            (None, false) => {
                let mut fresh = Value::Object(Map::new());
                merge(&mut fresh, item, true);
                list.push(fresh);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn merge_patch_follows_rfc7386() {
        let mut doc = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        merge(
            &mut doc,
            &json!({"a": "z", "c": {"f": null}, "l": [3]}),
            false,
        );
        assert_eq!(doc, json!({"a": "z", "c": {"d": "e"}, "l": [3]}));
    }

    #[test]
    fn strategic_merge_keys_lists_by_name() {
        let mut doc = json!({"spec": {"containers": [
            {"name": "web", "image": "nginx:1", "ports": [{"containerPort": 80}]},
            {"name": "sidecar", "image": "envoy"}
        ]}});
        merge(
            &mut doc,
            &json!({"spec": {"containers": [
                {"name": "web", "image": "nginx:2"},
                {"name": "sidecar", "$patch": "delete"},
                {"name": "log", "image": "fluent"}
            ]}}),
            true,
        );
        assert_eq!(
            doc,
            json!({"spec": {"containers": [
                {"name": "web", "image": "nginx:2", "ports": [{"containerPort": 80}]},
                {"name": "log", "image": "fluent"}
            ]}})
        );
    }
}
