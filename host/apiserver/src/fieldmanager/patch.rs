//! Merge patches: JSON merge patch (RFC 7386, [`merge`]) and Kubernetes' strategic
//! merge patch ([`strategic_merge`]), which `kubectl apply` and `kubectl patch` send.
//!
//! A strategic merge patch is a merge patch in which lists merge by their patch
//! strategy ([`crate::fieldmanager::merge_keys`]). Lists of objects with strategy `merge` merge element
//! by element, keyed by their merge key (container ports by `containerPort`, volume
//! mounts by `mountPath`, …); lists of objects the table does not know are keyed by
//! `name` when every element has one. Lists of scalars with strategy `merge`
//! (`metadata.finalizers`) merge as sets. Every other list is replaced.
//!
//! A merged list is ordered the way Kubernetes orders it: the elements the patch names
//! in the order it names them, and each of the others before the first named element
//! that followed it in the live list (after the named ones when none did).
//!
//! The directives, none of which is stored:
//! - `$patch: delete` on a list element removes the element with its merge key;
//!   an element `{"$patch": "replace"}` replaces the list with the patch's other
//!   elements.
//! - `$patch: replace` on a map replaces it with the patch's map; `$patch: delete`
//!   removes the map (Kubernetes leaves an empty map, which its encoding of the
//!   built-in kinds omits for map fields such as `labels`).
//! - `$retainKeys: [..]` in a map drops the map's other keys before the patch is
//!   merged (Deployment `spec.strategy`, volume sources); the patch may set no other
//!   key.
//! - `$setElementOrder/<list>: [..]` orders the merged list as listed: by merge key for
//!   lists of objects, by value for lists of scalars.
//! - `$deleteFromPrimitiveList/<list>: [..]` removes these values from a list of
//!   scalars.
//!
//! Not yet covered: custom resources as Kubernetes treats them. It refuses strategic
//! merge patches for them (415); here they are accepted, their lists of objects merge
//! by `name`, and their schemas' `x-kubernetes-patch-merge-key` is not read.

use std::collections::{HashMap, HashSet};

use serde_json::{Map, Value};

/// The directive that deletes or replaces the map or list it is in.
const PATCH: &str = "$patch";
const RETAIN_KEYS: &str = "$retainKeys";
const SET_ELEMENT_ORDER: &str = "$setElementOrder/";
const DELETE_FROM_PRIMITIVE_LIST: &str = "$deleteFromPrimitiveList/";

/// A strategic merge patch that cannot be applied. `field` is the path of the
/// offending field from the object's root (list elements left out).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("{field}: unknown patch directive {value}")]
    UnknownDirective { field: String, value: String },
    #[error("{field}: must be a list")]
    NotAList { field: String },
    #[error("{field}: {key:?} is in the patch but not in $retainKeys")]
    NotRetained { field: String, key: String },
    #[error("{field}: an element lacks the merge key {key:?}")]
    MissingMergeKey { field: String, key: &'static str },
    #[error("{field}: the patch lists the elements in another order than $setElementOrder")]
    OrderMismatch { field: String },
}

impl Error {
    /// The path of the field the patch got wrong.
    pub fn field(&self) -> &str {
        match self {
            Self::UnknownDirective { field, .. }
            | Self::NotAList { field }
            | Self::NotRetained { field, .. }
            | Self::MissingMergeKey { field, .. }
            | Self::OrderMismatch { field } => field,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Applies JSON merge patch `patch` to `doc`: maps merge, `null` removes a key, every
/// other value (lists too) replaces.
pub fn merge(doc: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *doc = patch.clone();
        return;
    };
    if !doc.is_object() {
        *doc = Value::Object(Map::new());
    }
    let Value::Object(target) = doc else { return };
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// Applies strategic merge patch `patch` to `doc`. On error `doc` may be half patched.
pub fn strategic_merge(doc: &mut Value, patch: &Value) -> Result<()> {
    let mut path = Vec::new();
    let Value::Object(patch) = patch else {
        if let Some(value) = fresh(patch, &mut path)? {
            *doc = value;
        }
        return Ok(());
    };
    if !doc.is_object() {
        *doc = Value::Object(Map::new());
    }
    if let Value::Object(target) = doc {
        // A root that deletes itself leaves an empty object, which fails validation.
        merge_map(target, patch, &mut path)?;
    }
    Ok(())
}

/// `path.field`, how errors name a field.
fn field_path(path: &[String], field: &str) -> String {
    let mut out = path.join(".");
    if !out.is_empty() {
        out.push('.');
    }
    out.push_str(field);
    out
}

/// Merges `patch` into `target`, the map at `path` (field names from the root, list
/// elements left out, which decides the lists' merge keys). `false` when the patch
/// deletes the map.
fn merge_map(
    target: &mut Map<String, Value>,
    patch: &Map<String, Value>,
    path: &mut Vec<String>,
) -> Result<bool> {
    if let Some(directive) = patch.get(PATCH) {
        match directive.as_str() {
            Some("replace") => target.clear(),
            Some("delete") => {
                target.clear();
                return Ok(false);
            }
            _ => {
                return Err(Error::UnknownDirective {
                    field: field_path(path, PATCH),
                    value: directive.to_string(),
                });
            }
        }
    }

    if let Some(retain) = patch.get(RETAIN_KEYS) {
        let not_a_list = || Error::NotAList {
            field: field_path(path, RETAIN_KEYS),
        };
        let keys: HashSet<&str> = retain
            .as_array()
            .ok_or_else(not_a_list)?
            .iter()
            .map(|k| k.as_str().ok_or_else(not_a_list))
            .collect::<Result<_>>()?;
        // A key the patch sets would survive the directive it came with.
        if let Some((key, _)) = patch
            .iter()
            .find(|(k, v)| !k.starts_with('$') && !v.is_null() && !keys.contains(k.as_str()))
        {
            return Err(Error::NotRetained {
                field: field_path(path, RETAIN_KEYS),
                key: key.clone(),
            });
        }
        target.retain(|k, _| keys.contains(k.as_str()));
    }

    // The order is taken relative to the live list before the patch changes it.
    let mut orders = Vec::new();
    for (key, value) in patch {
        let Some(field) = key.strip_prefix(SET_ELEMENT_ORDER) else {
            continue;
        };
        let Value::Array(order) = value else {
            return Err(Error::NotAList {
                field: field_path(path, key),
            });
        };
        let merge_key = list_merge_key(path, field);
        let order = ids(order, merge_key);
        if let Some(Value::Array(items)) = patch.get(field) {
            check_order(items, &order, merge_key).map_err(|()| Error::OrderMismatch {
                field: field_path(path, field),
            })?;
        }
        let live = match target.get(field) {
            Some(Value::Array(live)) => ids(live, merge_key),
            _ => Vec::new(),
        };
        orders.push((field, order, live, merge_key));
    }

    for (key, value) in patch {
        if key.starts_with('$') {
            continue;
        }
        path.push(key.clone());
        match value {
            Value::Null => {
                target.remove(key);
            }
            Value::Object(fields) => {
                let entry = target
                    .entry(key.clone())
                    .or_insert_with(|| Value::Object(Map::new()));
                if !entry.is_object() {
                    *entry = Value::Object(Map::new());
                }
                let keep = match entry {
                    Value::Object(map) => merge_map(map, fields, path)?,
                    _ => true,
                };
                if !keep {
                    target.remove(key);
                }
            }
            Value::Array(items) => {
                let merged = merge_list(target.get(key), items, path)?;
                target.insert(key.clone(), Value::Array(merged));
            }
            other => {
                target.insert(key.clone(), other.clone());
            }
        }
        path.pop();
    }

    for (key, value) in patch {
        let Some(field) = key.strip_prefix(DELETE_FROM_PRIMITIVE_LIST) else {
            continue;
        };
        let Value::Array(gone) = value else {
            return Err(Error::NotAList {
                field: field_path(path, key),
            });
        };
        let gone: HashSet<String> = gone.iter().map(Value::to_string).collect();
        if let Some(Value::Array(list)) = target.get_mut(field) {
            list.retain(|v| !gone.contains(&v.to_string()));
        }
    }

    for (field, order, live, merge_key) in orders {
        if let Some(Value::Array(list)) = target.get_mut(field) {
            reorder(list, &order, &live, merge_key);
        }
    }
    Ok(true)
}

/// How the list `field` at `path` merges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    /// Objects, element by element. `declared` when the merge key is the built-in
    /// kind's, not the guess `name`.
    Keyed {
        key: &'static str,
        declared: bool,
    },
    /// Scalars, as a set.
    Set,
    Replace,
}

/// The strategy of list `field` whose parent is at `path`: the built-in kinds' own,
/// else keyed by `name` (what most lists of objects are keyed by, custom resources'
/// too).
fn strategy(path: &[String], field: &str) -> Strategy {
    let parent: Vec<&str> = path.iter().map(String::as_str).collect();
    match crate::fieldmanager::merge_keys::rule_at(&parent, field) {
        Some(rule) if rule.patch_strategy.split(',').any(|s| s == "merge") => {
            if rule.patch_merge_key.is_empty() {
                Strategy::Set
            } else {
                Strategy::Keyed {
                    key: rule.patch_merge_key,
                    declared: true,
                }
            }
        }
        Some(_) => Strategy::Replace,
        None => Strategy::Keyed {
            key: "name",
            declared: false,
        },
    }
}

/// The key that identifies the elements of list `field` at `path` when they are
/// objects (for `$setElementOrder`).
fn list_merge_key(path: &[String], field: &str) -> &'static str {
    match strategy(path, field) {
        Strategy::Keyed { key, .. } => key,
        Strategy::Set | Strategy::Replace => "name",
    }
}

/// The identity of a list element: its merge key's value for an object, else itself.
fn id<'a>(item: &'a Value, key: &str) -> Option<&'a Value> {
    match item {
        Value::Object(fields) => fields.get(key),
        other => Some(other),
    }
}

/// The identities of `items`, as text so that they can be hashed.
fn ids(items: &[Value], key: &str) -> Vec<Option<String>> {
    items
        .iter()
        .map(|i| id(i, key).map(Value::to_string))
        .collect()
}

/// Where each identity first appears.
fn positions(ids: &[Option<String>]) -> HashMap<&str, usize> {
    let mut out = HashMap::new();
    for (i, id) in ids.iter().enumerate() {
        if let Some(id) = id {
            out.entry(id.as_str()).or_insert(i);
        }
    }
    out
}

fn directive(item: &Value) -> Option<&Value> {
    item.as_object().and_then(|m| m.get(PATCH))
}

/// Merges the patch's list `items` into `live`, the list at `path`.
fn merge_list(live: Option<&Value>, items: &[Value], path: &mut Vec<String>) -> Result<Vec<Value>> {
    let (field, parent) = match path.split_last() {
        Some((field, parent)) => (field.as_str(), parent),
        None => ("", &[][..]),
    };
    let strategy = strategy(parent, field);
    for item in items {
        if let Some(d) = directive(item)
            && !matches!(d.as_str(), Some("delete" | "replace"))
        {
            return Err(Error::UnknownDirective {
                field: field_path(path, PATCH),
                value: d.to_string(),
            });
        }
    }
    let Some(Value::Array(live)) = live else {
        return fresh_list(items, path);
    };
    if items
        .iter()
        .any(|i| directive(i).and_then(Value::as_str) == Some("replace"))
    {
        return fresh_list(items, path);
    }
    let objects = items.iter().any(Value::is_object);
    match strategy {
        // An empty list in the patch changes nothing in a list that merges.
        Strategy::Keyed { declared: true, .. } | Strategy::Set if items.is_empty() => {
            Ok(live.clone())
        }
        Strategy::Keyed { key, declared } if objects => {
            if !items.iter().all(|i| i.get(key).is_some()) {
                if declared {
                    return Err(Error::MissingMergeKey {
                        field: path.join("."),
                        key,
                    });
                }
                return fresh_list(items, path);
            }
            if !declared && !live.iter().all(|e| e.get(key).is_some()) {
                // Not a list keyed by `name` after all.
                return fresh_list(items, path);
            }
            merge_keyed(live, items, key, path)
        }
        Strategy::Set if !objects => {
            let mut seen = HashSet::new();
            let mut merged: Vec<Value> = live
                .iter()
                .chain(items)
                .filter(|v| seen.insert(v.to_string()))
                .cloned()
                .collect();
            reorder(&mut merged, &ids(items, ""), &ids(live, ""), "");
            Ok(merged)
        }
        _ => fresh_list(items, path),
    }
}

/// Merges `items`, objects that all carry `key`, into `live` element by element.
fn merge_keyed(
    live: &[Value],
    items: &[Value],
    key: &'static str,
    path: &mut Vec<String>,
) -> Result<Vec<Value>> {
    let is_delete = |i: &Value| directive(i).and_then(Value::as_str) == Some("delete");
    let deleted: HashSet<String> = items
        .iter()
        .filter(|i| is_delete(i))
        .filter_map(|i| id(i, key).map(Value::to_string))
        .collect();
    let mut merged: Vec<Value> = live
        .iter()
        .filter(|e| !e.get(key).is_some_and(|k| deleted.contains(&k.to_string())))
        .cloned()
        .collect();
    let mut at: HashMap<String, usize> = HashMap::new();
    for (i, e) in merged.iter().enumerate() {
        if let Some(k) = e.get(key) {
            at.entry(k.to_string()).or_insert(i);
        }
    }
    let named: Vec<&Value> = items.iter().filter(|i| directive(i).is_none()).collect();
    for item in &named {
        let (Some(k), Value::Object(fields)) = (id(item, key), item) else {
            continue;
        };
        match at.get(&k.to_string()).and_then(|&i| merged.get_mut(i)) {
            Some(Value::Object(existing)) => {
                merge_map(existing, fields, path)?;
            }
            _ => {
                let mut fresh = Map::new();
                merge_map(&mut fresh, fields, path)?;
                at.insert(k.to_string(), merged.len());
                merged.push(Value::Object(fresh));
            }
        }
    }
    let order: Vec<Option<String>> = named
        .iter()
        .map(|i| id(i, key).map(Value::to_string))
        .collect();
    reorder(&mut merged, &order, &ids(live, key), key);
    Ok(merged)
}

/// A patch's list where there is no live list to merge into: its elements with their
/// directives processed, the directive elements left out.
fn fresh_list(items: &[Value], path: &mut Vec<String>) -> Result<Vec<Value>> {
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        if directive(item).is_some() {
            continue;
        }
        if let Some(value) = fresh(item, path)? {
            out.push(value);
        }
    }
    Ok(out)
}

/// A patch's value where there is nothing live: its directives processed. `None` when
/// it deletes itself.
fn fresh(value: &Value, path: &mut Vec<String>) -> Result<Option<Value>> {
    Ok(match value {
        Value::Object(fields) => {
            let mut map = Map::new();
            merge_map(&mut map, fields, path)?.then_some(Value::Object(map))
        }
        Value::Array(items) => Some(Value::Array(fresh_list(items, path)?)),
        other => Some(other.clone()),
    })
}

/// Fails unless the patch's `items` (directive elements aside) appear in `order` in
/// the same relative order.
fn check_order(items: &[Value], order: &[Option<String>], key: &str) -> Result<(), ()> {
    let mut rest = order.iter();
    for item in items.iter().filter(|i| directive(i).is_none()) {
        let want = id(item, key).map(Value::to_string);
        if !rest.any(|o| *o == want) {
            return Err(());
        }
    }
    Ok(())
}

/// Orders `list` as Kubernetes does: the elements named in `order` in that order; each
/// other element, in live order, goes before the first named element that followed it
/// in the `live` list; the rest after them.
fn reorder(list: &mut Vec<Value>, order: &[Option<String>], live: &[Option<String>], key: &str) {
    let order = positions(order);
    let live = positions(live);
    let place = |map: &HashMap<&str, usize>, v: &Value| {
        id(v, key).and_then(|k| map.get(k.to_string().as_str()).copied())
    };
    let (mut named, mut others): (Vec<Value>, Vec<Value>) = std::mem::take(list)
        .into_iter()
        .partition(|v| place(&order, v).is_some());
    named.sort_by_key(|v| place(&order, v));
    others.sort_by_key(|v| place(&live, v).unwrap_or(usize::MAX));
    let mut named = named.into_iter().peekable();
    let mut others = others.into_iter().peekable();
    loop {
        let other_first = match (others.peek(), named.peek()) {
            (Some(o), Some(n)) => matches!(
                (place(&live, o), place(&live, n)),
                (Some(a), Some(b)) if a < b
            ),
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => break,
        };
        let next = if other_first {
            others.next()
        } else {
            named.next()
        };
        list.extend(next);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// `doc` after strategic merge patch `patch`.
    fn patched(mut doc: Value, patch: Value) -> Value {
        strategic_merge(&mut doc, &patch).expect("the patch applies");
        doc
    }

    fn containers(doc: &Value) -> Vec<&str> {
        doc["spec"]["template"]["spec"]["containers"]
            .as_array()
            .map(|c| c.iter().filter_map(|c| c["name"].as_str()).collect())
            .unwrap_or_default()
    }

    fn deployment(names: &[&str]) -> Value {
        let containers: Vec<Value> = names
            .iter()
            .map(|n| json!({"name": n, "image": format!("{n}:1")}))
            .collect();
        json!({"spec": {"template": {"spec": {"containers": containers}}}})
    }

    #[test]
    fn merge_patch_follows_rfc7386() {
        let mut doc = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        merge(&mut doc, &json!({"a": "z", "c": {"f": null}, "l": [3]}));
        assert_eq!(doc, json!({"a": "z", "c": {"d": "e"}, "l": [3]}));
    }

    #[test]
    fn merge_patch_stores_directives_as_data() {
        // Only the strategic merge patch knows directives.
        let mut doc = json!({"data": {"a": "1"}});
        merge(&mut doc, &json!({"data": {"$patch": "delete"}}));
        assert_eq!(doc, json!({"data": {"a": "1", "$patch": "delete"}}));
    }

    #[test]
    fn strategic_merge_keys_lists_by_name() {
        let doc = json!({"spec": {"containers": [
            {"name": "web", "image": "nginx:1", "ports": [{"containerPort": 80}]},
            {"name": "sidecar", "image": "envoy"}
        ]}});
        let doc = patched(
            doc,
            json!({"spec": {"containers": [
                {"name": "web", "image": "nginx:2"},
                {"name": "sidecar", "$patch": "delete"},
                {"name": "log", "image": "fluent"}
            ]}}),
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
        let doc = json!({"spec": {"template": {"spec": {"containers": [{
            "name": "web",
            "ports": [{"containerPort": 80}, {"containerPort": 443, "name": "tls"}],
            "volumeMounts": [{"mountPath": "/a", "name": "v"}, {"mountPath": "/b", "name": "v"}]
        }]}}}});
        let doc = patched(
            doc,
            json!({"spec": {"template": {"spec": {"containers": [{
                "name": "web",
                "ports": [{"containerPort": 443, "name": "https"}],
                "volumeMounts": [{"mountPath": "/b", "$patch": "delete"}]
            }]}}}}),
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
        let svc = patched(
            json!({"spec": {"ports": [{"name": "a", "port": 80}, {"name": "b", "port": 81}]}}),
            json!({"spec": {"ports": [{"name": "c", "port": 81}]}}),
        );
        assert_eq!(
            svc["spec"]["ports"],
            json!([{"name": "a", "port": 80}, {"name": "c", "port": 81}])
        );
    }

    #[test]
    fn set_element_order_orders_what_kubectl_apply_sends() {
        // `kubectl apply` after container b was removed from the file.
        let doc = patched(
            deployment(&["a", "b"]),
            json!({"spec": {"template": {"spec": {
                "$setElementOrder/containers": [{"name": "a"}],
                "containers": [{"$patch": "delete", "name": "b"}]
            }}}}),
        );
        assert_eq!(
            doc,
            json!({"spec": {"template": {"spec": {"containers": [{"name": "a", "image": "a:1"}]}}}})
        );

        // ... after the file went from [web, log, proxy] to [proxy, web] with a new image
        // for web: the list follows the directive, not the order of the patch's list.
        let doc = patched(
            deployment(&["web", "log", "proxy"]),
            json!({"spec": {"template": {"spec": {
                "$setElementOrder/containers": [{"name": "proxy"}, {"name": "web"}],
                "containers": [
                    {"name": "web", "image": "web:2"},
                    {"$patch": "delete", "name": "log"}
                ]
            }}}}),
        );
        assert_eq!(containers(&doc), ["proxy", "web"]);
        assert_eq!(
            doc["spec"]["template"]["spec"]["containers"][1]["image"],
            "web:2"
        );

        // A reorder alone names no list at all.
        let doc = patched(
            deployment(&["a", "b", "c"]),
            json!({"spec": {"template": {"spec": {
                "$setElementOrder/containers": [{"name": "c"}, {"name": "a"}, {"name": "b"}]
            }}}}),
        );
        assert_eq!(containers(&doc), ["c", "a", "b"]);
    }

    #[test]
    fn set_element_order_keeps_other_elements_where_the_live_list_had_them() {
        // Elements the directive does not name (added by someone else) go before the
        // first named element that followed them in the live list, else after the named
        // ones; names the list lacks are ignored.
        let doc = patched(
            deployment(&["c", "b", "d", "a", "e"]),
            json!({"spec": {"template": {"spec": {
                "$setElementOrder/containers": [{"name": "a"}, {"name": "x"}, {"name": "b"}],
                "containers": [{"name": "a", "image": "a:2"}]
            }}}}),
        );
        assert_eq!(containers(&doc), ["c", "d", "a", "b", "e"]);

        // Env vars keep their order, which matters for `$(VAR)` references.
        let doc = patched(
            json!({"spec": {"template": {"spec": {"containers": [{"name": "web", "env": [
                {"name": "B", "value": "b"}, {"name": "A", "value": "a"}
            ]}]}}}}),
            json!({"spec": {"template": {"spec": {"containers": [{"name": "web",
                "$setElementOrder/env": [{"name": "A"}, {"name": "B"}, {"name": "C"}],
                "env": [{"name": "C", "value": "$(A)"}]
            }]}}}}),
        );
        let env: Vec<&str> = doc["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_array()
            .map(|e| e.iter().filter_map(|e| e["name"].as_str()).collect())
            .unwrap_or_default();
        assert_eq!(env, ["A", "B", "C"]);
    }

    #[test]
    fn merged_lists_follow_the_patch_order_without_the_directive() {
        // `kubectl patch` sends no `$setElementOrder`: the named elements take the patch's
        // order, the others keep their place before the elements that followed them.
        let doc = patched(
            deployment(&["a", "b", "c"]),
            json!({"spec": {"template": {"spec": {"containers": [
                {"name": "c", "image": "c:2"}, {"name": "a", "image": "a:2"}
            ]}}}}),
        );
        assert_eq!(containers(&doc), ["b", "c", "a"]);

        // A new element goes before the live ones it is not ordered against.
        let doc = patched(
            deployment(&["a"]),
            json!({"spec": {"template": {"spec": {"containers": [{"name": "z", "image": "z"}]}}}}),
        );
        assert_eq!(containers(&doc), ["z", "a"]);
    }

    #[test]
    fn set_element_order_that_contradicts_the_patch_list_is_refused() {
        let mut doc = deployment(&["a", "b"]);
        let err = strategic_merge(
            &mut doc,
            &json!({"spec": {"template": {"spec": {
                "$setElementOrder/containers": [{"name": "a"}, {"name": "b"}],
                "containers": [{"name": "b", "image": "b:2"}, {"name": "a", "image": "a:2"}]
            }}}}),
        )
        .unwrap_err();
        assert_eq!(
            err,
            Error::OrderMismatch {
                field: "spec.template.spec.containers".into()
            }
        );

        let err = strategic_merge(
            &mut deployment(&["a"]),
            &json!({"spec": {"template": {"spec": {"$setElementOrder/containers": "a"}}}}),
        )
        .unwrap_err();
        assert_eq!(
            err.field(),
            "spec.template.spec.$setElementOrder/containers"
        );
    }

    #[test]
    fn finalizers_merge_as_a_set() {
        // `finalizers` has strategy `merge` and no merge key: new values join the live
        // ones, an empty list changes nothing, `null` clears.
        let meta = json!({"metadata": {"finalizers": ["a", "b"]}});
        let doc = patched(
            meta.clone(),
            json!({"metadata": {"finalizers": ["b", "c"]}}),
        );
        assert_eq!(doc["metadata"]["finalizers"], json!(["a", "b", "c"]));
        let doc = patched(meta.clone(), json!({"metadata": {"finalizers": []}}));
        assert_eq!(doc["metadata"]["finalizers"], json!(["a", "b"]));
        let doc = patched(meta.clone(), json!({"metadata": {"finalizers": null}}));
        assert_eq!(doc["metadata"], json!({}));
        let doc = patched(
            json!({"metadata": {}}),
            json!({"metadata": {"finalizers": ["x"]}}),
        );
        assert_eq!(doc["metadata"]["finalizers"], json!(["x"]));

        // So do a pod template's, but not a Namespace's `spec.finalizers`, which has no
        // strategy.
        let doc = patched(
            json!({"spec": {"template": {"metadata": {"finalizers": ["a"]}}}}),
            json!({"spec": {"template": {"metadata": {"finalizers": ["b"]}}}}),
        );
        assert_eq!(
            doc["spec"]["template"]["metadata"]["finalizers"],
            json!(["b", "a"])
        );
        let doc = patched(
            json!({"spec": {"finalizers": ["kubernetes", "example.com/x"]}}),
            json!({"spec": {"finalizers": ["kubernetes"]}}),
        );
        assert_eq!(doc["spec"]["finalizers"], json!(["kubernetes"]));

        // A list of scalars without the strategy is replaced.
        let doc = patched(
            json!({"spec": {"template": {"spec": {"containers": [{"name": "a", "args": ["-v", "1"]}]}}}}),
            json!({"spec": {"template": {"spec": {"containers": [{"name": "a", "args": ["-q"]}]}}}}),
        );
        assert_eq!(
            doc["spec"]["template"]["spec"]["containers"][0]["args"],
            json!(["-q"])
        );
    }

    #[test]
    fn delete_from_primitive_list_removes_finalizers() {
        // `kubectl apply` after finalizer b was removed from the file; c was added by a
        // controller and stays.
        let doc = patched(
            json!({"metadata": {"finalizers": ["a", "b", "c", "b"]}}),
            json!({"metadata": {
                "$setElementOrder/finalizers": ["a"],
                "$deleteFromPrimitiveList/finalizers": ["b", "not-there"]
            }}),
        );
        assert_eq!(doc, json!({"metadata": {"finalizers": ["a", "c"]}}));

        // ... and with one added in the same apply.
        let doc = patched(
            json!({"metadata": {"finalizers": ["a", "b"]}}),
            json!({"metadata": {
                "$setElementOrder/finalizers": ["d", "a"],
                "$deleteFromPrimitiveList/finalizers": ["b"],
                "finalizers": ["d"]
            }}),
        );
        assert_eq!(doc, json!({"metadata": {"finalizers": ["d", "a"]}}));

        // Deleting from a list that is not there does not create it.
        let doc = patched(
            json!({"metadata": {"name": "x"}}),
            json!({"metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]}}),
        );
        assert_eq!(doc, json!({"metadata": {"name": "x"}}));
    }

    #[test]
    fn retain_keys_clears_the_fields_of_the_old_strategy() {
        // `kubectl apply` after the file's strategy went from RollingUpdate to Recreate
        // when it never named `rollingUpdate` (the server defaulted it).
        let doc = patched(
            json!({"spec": {"replicas": 2, "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}
            }}}),
            json!({"spec": {"strategy": {"$retainKeys": ["type"], "type": "Recreate"}}}),
        );
        assert_eq!(
            doc,
            json!({"spec": {"replicas": 2, "strategy": {"type": "Recreate"}}})
        );

        // A volume's source changes from emptyDir to configMap; the name stays.
        let doc = patched(
            json!({"spec": {"template": {"spec": {"volumes": [
                {"name": "cache", "emptyDir": {}},
                {"name": "keep", "emptyDir": {}}
            ]}}}}),
            json!({"spec": {"template": {"spec": {"volumes": [{
                "$retainKeys": ["configMap", "name"],
                "name": "cache",
                "configMap": {"name": "settings"}
            }]}}}}),
        );
        assert_eq!(
            doc["spec"]["template"]["spec"]["volumes"],
            json!([
                {"name": "cache", "configMap": {"name": "settings"}},
                {"name": "keep", "emptyDir": {}}
            ])
        );

        // The patch may not set a key the directive drops.
        let err = strategic_merge(
            &mut json!({"spec": {}}),
            &json!({"spec": {"strategy": {"$retainKeys": ["type"], "rollingUpdate": {}}}}),
        )
        .unwrap_err();
        assert_eq!(
            err,
            Error::NotRetained {
                field: "spec.strategy.$retainKeys".into(),
                key: "rollingUpdate".into()
            }
        );
    }

    #[test]
    fn patch_directive_replaces_or_deletes_a_map() {
        let doc = json!({"metadata": {"labels": {"a": "1", "b": "2"}, "name": "x"}});
        let replaced = patched(
            doc.clone(),
            json!({"metadata": {"labels": {"$patch": "replace", "c": "3"}}}),
        );
        assert_eq!(
            replaced,
            json!({"metadata": {"labels": {"c": "3"}, "name": "x"}})
        );
        let deleted = patched(
            doc.clone(),
            json!({"metadata": {"labels": {"$patch": "delete"}}}),
        );
        assert_eq!(deleted, json!({"metadata": {"name": "x"}}));
        // Deleting a map that is not there leaves nothing behind.
        let deleted = patched(
            doc,
            json!({"metadata": {"annotations": {"$patch": "delete"}}}),
        );
        assert_eq!(deleted["metadata"].get("annotations"), None);

        // A replacing map's own directives are processed too.
        let doc = patched(
            json!({"spec": {"template": {"spec": {"securityContext": {"runAsUser": 1}}}}}),
            json!({"spec": {"template": {"spec": {"securityContext": {
                "$patch": "replace",
                "seLinuxOptions": {"$patch": "replace", "level": "s0"}
            }}}}}),
        );
        assert_eq!(
            doc["spec"]["template"]["spec"]["securityContext"],
            json!({"seLinuxOptions": {"level": "s0"}})
        );
    }

    #[test]
    fn patch_replace_element_replaces_the_list() {
        let doc = patched(
            deployment(&["a", "b"]),
            json!({"spec": {"template": {"spec": {"containers": [
                {"$patch": "replace"},
                {"name": "c", "image": "c:1"}
            ]}}}}),
        );
        assert_eq!(
            doc,
            json!({"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "c:1"}]}}}})
        );
        // Alone, it empties the list.
        let doc = patched(
            deployment(&["a"]),
            json!({"spec": {"template": {"spec": {"containers": [{"$patch": "replace"}]}}}}),
        );
        assert_eq!(containers(&doc), Vec::<&str>::new());
    }

    #[test]
    fn directives_are_never_stored() {
        // New maps and lists, with nothing live to merge into, lose their directives too.
        let doc = patched(
            json!({"metadata": {"name": "x"}}),
            json!({
                "metadata": {"labels": {"$patch": "replace", "a": "1"}, "$retainKeys": ["labels", "name"]},
                "spec": {
                    "$setElementOrder/containers": [{"name": "a"}],
                    "strategy": {"$retainKeys": ["type"], "type": "Recreate"},
                    "containers": [
                        {"name": "a", "env": [{"name": "E", "$patch": "delete"}]},
                        {"name": "gone", "$patch": "delete"}
                    ]
                }
            }),
        );
        assert_eq!(
            doc,
            json!({
                "metadata": {"name": "x", "labels": {"a": "1"}},
                "spec": {"strategy": {"type": "Recreate"}, "containers": [{"name": "a", "env": []}]}
            })
        );
        assert!(!doc.to_string().contains('$'), "{doc}");
    }

    #[test]
    fn bad_directives_are_refused_with_the_field() {
        let cases = [
            (
                json!({"spec": {"strategy": {"$patch": "merge"}}}),
                "spec.strategy.$patch",
            ),
            (
                json!({"spec": {"template": {"spec": {"containers": [{"name": "a", "$patch": "bogus"}]}}}}),
                "spec.template.spec.containers.$patch",
            ),
            (
                json!({"spec": {"strategy": {"$retainKeys": "type"}}}),
                "spec.strategy.$retainKeys",
            ),
            (
                json!({"metadata": {"$deleteFromPrimitiveList/finalizers": "a"}}),
                "metadata.$deleteFromPrimitiveList/finalizers",
            ),
            (
                // Containers are keyed by name.
                json!({"spec": {"template": {"spec": {"containers": [{"image": "b:1"}]}}}}),
                "spec.template.spec.containers",
            ),
        ];
        for (patch, field) in cases {
            let err = strategic_merge(&mut deployment(&["a"]), &patch).unwrap_err();
            assert_eq!(err.field(), field, "{err}");
        }
    }

    /// Whether any map in `v` still has a directive key.
    fn has_directive(v: &Value) -> bool {
        match v {
            Value::Object(m) => m
                .iter()
                .any(|(k, v)| k.starts_with('$') || has_directive(v)),
            Value::Array(items) => items.iter().any(has_directive),
            _ => false,
        }
    }

    #[test]
    fn odd_directives_are_refused_or_leave_no_trace() {
        let doc = json!({"metadata": {"name": "x", "finalizers": ["a", "b"]},
            "spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b"}],
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1}}}});
        let patches = [
            json!({"spec": {"$setElementOrder/containers": "a"}}),
            json!({"spec": {"$setElementOrder/containers": [1, null, {"x": 1}]}}),
            json!({"spec": {"$setElementOrder/containers": [{"name": "b"}, {"name": "a"}, {"name": "zz"}]}}),
            json!({"spec": {"$setElementOrder/strategy": [{"name": "a"}]}}),
            json!({"spec": {"$setElementOrder/": []}}),
            json!({"spec": {"$setElementOrder/containers": [{"name": "a"}], "containers": [{"name": "b"}]}}),
            json!({"metadata": {"$deleteFromPrimitiveList/finalizers": "a"}}),
            json!({"metadata": {"$deleteFromPrimitiveList/finalizers": [{"a": 1}, ["b"]]}}),
            json!({"metadata": {"$deleteFromPrimitiveList/name": ["x"]}}),
            json!({"spec": {"$deleteFromPrimitiveList/containers": [{"name": "a"}]}}),
            json!({"spec": {"strategy": {"$retainKeys": "type"}}}),
            json!({"spec": {"strategy": {"$retainKeys": [1, {"a": 2}], "type": "Recreate"}}}),
            json!({"spec": {"$retainKeys": []}}),
            json!({"$retainKeys": ["nothing"]}),
            json!({"spec": {"$patch": 7}}),
            json!({"spec": {"$patch": "replace", "$retainKeys": ["x"], "x": {"$patch": "delete"}}}),
            json!({"spec": {"containers": [{"$patch": "replace"}, {"$patch": "delete"}]}}),
            json!({"spec": {"containers": [{"$patch": "delete"}]}}),
            json!({"spec": {"containers": [{"$patch": "merge", "name": "a"}]}}),
            json!({"spec": {"containers": [{"name": "a", "$setElementOrder/ports": [{"containerPort": 1}], "ports": [{"containerPort": 1, "$patch": "delete"}]}]}}),
            json!({"$patch": "delete"}),
            json!({"$patch": "replace", "kind": "X"}),
            json!({"metadata": {"finalizers": [{"$patch": "replace"}, "c"]}}),
            json!({"metadata": {"finalizers": [{"$patch": "delete"}]}}),
            json!({"spec": {"containers": {"$patch": "delete"}}}),
            json!({"spec": {"$unknown": 1, "containers": [{"name": "c", "$deleteFromPrimitiveList/args": ["x"]}]}}),
        ];
        for patch in patches {
            let mut merged = doc.clone();
            match strategic_merge(&mut merged, &patch) {
                Ok(()) => assert!(
                    !has_directive(&merged),
                    "{patch} left a directive in {merged}"
                ),
                Err(e) => assert!(!e.to_string().is_empty(), "{patch}"),
            }
        }
    }
}
