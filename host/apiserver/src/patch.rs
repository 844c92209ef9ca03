//! Merge patches: JSON merge patch (RFC 7386) and the parts of Kubernetes' strategic
//! merge patch that `kubectl apply` relies on most: lists of objects merge element by
//! element, keyed by the built-in kinds' merge keys ([`crate::merge_keys`]: container
//! ports by `containerPort`, volume mounts by `mountPath`, …) and otherwise by `name`,
//! and `$patch: delete` removes an element.
//!
//! Not yet covered: the merge keys of custom resources' schemas, `$retainKeys`,
//! `$deleteFromPrimitiveList` and `$setElementOrder`.

use serde_json::{Map, Value};

/// Applies `patch` to `doc`. With `strategic`, lists whose elements all carry their
/// merge key (`name` where the list has none of its own) merge by it instead of being
/// replaced.
pub fn merge(doc: &mut Value, patch: &Value, strategic: bool) {
    merge_at(doc, patch, strategic, &mut Vec::new());
}

/// [`merge`] of the value at `path` (field names from the root, list elements left
/// out), which decides the lists' merge keys.
fn merge_at(doc: &mut Value, patch: &Value, strategic: bool, path: &mut Vec<String>) {
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
                path.push(key.clone());
                merge_at(entry, value, strategic, path);
                path.pop();
            }
            Value::Array(items) if strategic => {
                let merge_key = list_merge_key(path, key);
                if keyed_by(items, merge_key) {
                    let entry = target
                        .entry(key.clone())
                        .or_insert_with(|| Value::Array(Vec::new()));
                    path.push(key.clone());
                    merge_keyed_list(entry, items, merge_key, path);
                    path.pop();
                } else {
                    target.insert(key.clone(), value.clone());
                }
            }
            other => {
                target.insert(key.clone(), other.clone());
            }
        }
    }
}

/// The key the elements of list `field` at `path` merge by: the built-in kinds' own,
/// else `name` (what most lists of objects are keyed by, custom resources' too).
fn list_merge_key(path: &[String], field: &str) -> &'static str {
    let parent: Vec<&str> = path.iter().map(String::as_str).collect();
    match crate::merge_keys::rule_at(&parent, field) {
        Some(rule) => rule.patch_merge_key,
        None => "name",
    }
}

fn keyed_by(items: &[Value], key: &str) -> bool {
    !key.is_empty()
        && !items.is_empty()
        && items
            .iter()
            .all(|i| i.get(key).is_some_and(|v| v.is_string() || v.is_number()))
}

fn merge_keyed_list(target: &mut Value, items: &[Value], key: &str, path: &mut Vec<String>) {
    if !target
        .as_array()
        .is_some_and(|t| t.iter().all(|i| i.get(key).is_some()))
    {
        *target = Value::Array(Vec::new());
    }
    let Value::Array(list) = target else { return };
    for item in items {
        let id = item.get(key).cloned();
        let position = list.iter().position(|e| e.get(key) == id.as_ref());
        let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
        match (position, delete) {
            (Some(i), true) => {
                list.remove(i);
            }
            (None, true) => {}
            (Some(i), false) => merge_at(&mut list[i], item, true, path),
            (None, false) => {
                let mut fresh = Value::Object(Map::new());
                merge_at(&mut fresh, item, true, path);
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

    #[test]
    fn strategic_merge_keys_built_in_lists_by_their_own_merge_keys() {
        // What kubectl sends when one of two ports changes: only that element.
        let mut doc = json!({"spec": {"template": {"spec": {"containers": [{
            "name": "web",
            "ports": [{"containerPort": 80}, {"containerPort": 443, "name": "tls"}],
            "volumeMounts": [{"mountPath": "/a", "name": "v"}, {"mountPath": "/b", "name": "v"}]
        }]}}}});
        merge(
            &mut doc,
            &json!({"spec": {"template": {"spec": {"containers": [{
                "name": "web",
                "ports": [{"containerPort": 443, "name": "https"}],
                "volumeMounts": [{"mountPath": "/b", "$patch": "delete"}]
            }]}}}}),
            true,
        );
        let web = &doc["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(
            web["ports"],
            json!([{"containerPort": 80}, {"containerPort": 443, "name": "https"}])
        );
        assert_eq!(
            web["volumeMounts"],
            json!([{"mountPath": "/a", "name": "v"}])
        );

        // A Service's ports merge by port, though they carry names.
        let mut svc =
            json!({"spec": {"ports": [{"name": "a", "port": 80}, {"name": "b", "port": 81}]}});
        merge(
            &mut svc,
            &json!({"spec": {"ports": [{"name": "c", "port": 81}]}}),
            true,
        );
        assert_eq!(
            svc["spec"]["ports"],
            json!([{"name": "a", "port": 80}, {"name": "c", "port": 81}])
        );

        // Finalizers have no merge key: the patch's list replaces the object's.
        let mut meta = json!({"metadata": {"finalizers": ["a", "b"]}});
        merge(&mut meta, &json!({"metadata": {"finalizers": []}}), true);
        assert_eq!(meta["metadata"]["finalizers"], json!([]));
    }
}
