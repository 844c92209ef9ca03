//! Server-side apply's merge (Kubernetes' `structuredmerge`): what a `PATCH` with
//! `application/apply-patch+yaml` does to the live object and its managed fields.
//!
//! An applied configuration states the fields its manager wants, with their values.
//! Applying it merges it into the live object (maps by key, lists by their merge keys,
//! see [`crate::fieldmanager::managed_fields::Schema`]), makes the manager the owner of exactly those
//! fields, and removes the fields the manager applied before and no longer states,
//! unless another manager owns them too. Changing a field another manager owns is a
//! conflict (409, one cause per field) unless the request has `force=true`, which
//! takes the field over. Stating a field with the value it already has shares it.
//!
//! Every other write records its manager through
//! [`crate::fieldmanager::field_manager::record_write`].

use serde_json::Value;
use trellis_api::ApiError;
use trellis_api::status::{Reason, StatusCause, StatusDetails};

use crate::fieldmanager::managed_fields::{
    self, DisplayPath, Entry, FieldSet, ListType, Path, PathElement, Schema, Scope, fields_of,
    key_of, keyed, remove_at, strip, value_at, value_at_mut,
};
use crate::object::Object;

/// The manager Kubernetes names as owner of everything an object held before its
/// first apply, when it had no managed fields.
const BEFORE_FIRST_APPLY: &str = "before-first-apply";

/// One apply: who applies, how, and what is known of the object's type.
#[derive(Debug)]
pub struct Applied<'a> {
    pub manager: &'a str,
    pub force: bool,
    pub schema: Schema<'a>,
    pub scope: Scope,
    pub api_version: &'a str,
    pub subresource: &'a str,
    pub now: &'a str,
}

/// A field another manager owns with another value.
#[derive(Debug)]
struct Conflict {
    owner: String,
    path: Path,
}

impl Applied<'_> {
    fn entry(&self, fields: FieldSet) -> Entry {
        Entry {
            manager: self.manager.to_owned(),
            operation: "Apply".into(),
            api_version: self.api_version.to_owned(),
            time: Some(self.now.to_owned()),
            subresource: self.subresource.to_owned(),
            fields,
        }
    }

    /// The live object with `config` applied, and its managedFields updated; or the
    /// conflicts as a 409.
    pub fn apply_to(&self, live: &Object, config: &Object) -> Result<Object, ApiError> {
        let live_value = managed_fields::without_managed_fields(live);
        let mut applied_fields = fields_of(&Value::Object(config.clone()), self.schema, false);
        strip(&mut applied_fields, self.scope);
        let mut entries = match managed_fields::decode(live) {
            Some(entries) => entries,
            None => {
                // An object no one manages yet: what it holds belongs to someone.
                let mut all = fields_of(&live_value, self.schema, true);
                strip(&mut all, self.scope);
                vec![Entry {
                    manager: BEFORE_FIRST_APPLY.into(),
                    operation: "Update".into(),
                    api_version: self.api_version.to_owned(),
                    time: Some(self.now.to_owned()),
                    subresource: String::new(),
                    fields: all,
                }]
            }
        };
        let me = self.entry(FieldSet::new());

        let mut merged = live_value.clone();
        let mut config_value = Value::Object(config.clone());
        if let Value::Object(c) = &mut config_value
            && let Some(Value::Object(m)) = c.get_mut("metadata")
        {
            // The server's metadata is not the applier's to set.
            for field in ["uid", "creationTimestamp", "generation", "managedFields"] {
                m.remove(field);
            }
        }
        merge(&mut merged, &config_value, self.schema, &mut Vec::new());

        // Conflicts: fields this apply changes that someone else owns.
        let mut conflicts = Vec::new();
        for leaf in applied_fields.leaves() {
            let before = value_at(&live_value, &leaf);
            if before.is_none() || before == value_at(&merged, &leaf) {
                continue;
            }
            for entry in entries.iter().filter(|e| !e.same_manager(&me)) {
                if entry.fields.contains(&leaf) {
                    conflicts.push(Conflict {
                        owner: entry.describe(),
                        path: leaf.clone(),
                    });
                }
            }
        }
        if !conflicts.is_empty() {
            if !self.force {
                return Err(conflict_error(&conflicts));
            }
            let mut taken = FieldSet::new();
            for c in &conflicts {
                taken.insert(&c.path);
            }
            for entry in entries.iter_mut().filter(|e| !e.same_manager(&me)) {
                entry.fields = entry.fields.difference(&taken);
            }
        }

        // Fields this manager applied before and no longer states go, unless someone
        // else owns them.
        let previous = entries
            .iter()
            .find(|e| e.same_manager(&me))
            .map(|e| e.fields.clone())
            .unwrap_or_default();
        let mut others = FieldSet::new();
        for entry in entries.iter().filter(|e| !e.same_manager(&me)) {
            others.union(&entry.fields);
        }
        for path in previous.difference(&applied_fields).paths() {
            if applied_fields.covers(&path) || others.covers(&path) {
                continue;
            }
            if remove_at(&mut merged, &path) {
                remove_empty_parents(&mut merged, &path, &applied_fields, &others);
            }
        }

        match entries.iter_mut().find(|e| e.same_manager(&me)) {
            Some(mine) => {
                if mine.fields != applied_fields || mine.api_version != self.api_version {
                    *mine = self.entry(applied_fields);
                }
            }
            None => entries.push(self.entry(applied_fields)),
        }
        let Value::Object(mut out) = merged else {
            return Err(ApiError::bad_request("an apply patch must be an object"));
        };
        managed_fields::encode(&mut out, entries);
        Ok(out)
    }
}

/// After a removal, maps left empty go too when no one owns them (labels emptied of
/// their last applied label disappear).
fn remove_empty_parents(
    value: &mut Value,
    path: &[PathElement],
    mine: &FieldSet,
    others: &FieldSet,
) {
    let mut parent = path.to_vec();
    while parent.len() > 1 {
        parent.pop();
        if !matches!(parent.last(), Some(PathElement::Field(_))) {
            return;
        }
        let empty = value_at(value, &parent).is_some_and(|v| {
            v.as_object().is_some_and(|m| m.is_empty())
                || v.as_array().is_some_and(|a| a.is_empty())
        });
        if !empty || mine.covers(&parent) || others.covers(&parent) {
            return;
        }
        remove_at(value, &parent);
    }
}

/// Merges an applied configuration into a value: maps key by key, lists by their
/// type, everything else replaced; `null` removes a field.
fn merge(dst: &mut Value, src: &Value, schema: Schema<'_>, path: &mut Path) {
    match src {
        Value::Object(fields)
            if dst.is_object() && (path.is_empty() || !schema.atomic_map(path)) =>
        {
            let at_root = path.is_empty();
            for (k, v) in fields {
                let Some(target) = dst.as_object_mut() else {
                    return;
                };
                if v.is_null() {
                    target.remove(k);
                    continue;
                }
                path.push(PathElement::Field(k.clone()));
                match target.get_mut(k) {
                    Some(existing) => merge(existing, v, schema.field(k, at_root), path),
                    None => {
                        target.insert(k.clone(), v.clone());
                    }
                }
                path.pop();
            }
        }
        Value::Array(items) if dst.is_array() => match schema.list_type(path) {
            ListType::Map(keys)
                if keyed(items, &keys) && dst.as_array().is_some_and(|d| keyed(d, &keys)) =>
            {
                let item_schema = schema.items();
                for item in items {
                    let Some(key) = key_of(item, &keys) else {
                        continue;
                    };
                    path.push(key);
                    match value_at_mut(dst, &path[path.len() - 1..]) {
                        Some(existing) => merge(existing, item, item_schema, path),
                        None => {
                            if let Value::Array(list) = dst {
                                list.push(item.clone());
                            }
                        }
                    }
                    path.pop();
                }
            }
            ListType::Set => {
                if let Value::Array(list) = dst {
                    for item in items {
                        if !list.contains(item) {
                            list.push(item.clone());
                        }
                    }
                }
            }
            _ => *dst = src.clone(),
        },
        _ => *dst = src.clone(),
    }
}

/// The 409 Kubernetes answers for apply conflicts: one cause per field, and a
/// message grouping the fields by manager.
fn conflict_error(conflicts: &[Conflict]) -> ApiError {
    let causes: Vec<StatusCause> = conflicts
        .iter()
        .map(|c| {
            StatusCause::new(
                "FieldManagerConflict",
                DisplayPath(&c.path).to_string(),
                format!("conflict with {}", c.owner),
            )
        })
        .collect();
    let message = match conflicts {
        [one] => format!(
            "Apply failed with 1 conflict: conflict with {}: {}",
            one.owner,
            DisplayPath(&one.path)
        ),
        many => {
            let mut owners: Vec<&str> = many.iter().map(|c| c.owner.as_str()).collect();
            owners.sort();
            owners.dedup();
            let mut lines = Vec::new();
            for owner in owners {
                lines.push(format!("conflicts with {owner}:"));
                for c in many.iter().filter(|c| c.owner == owner) {
                    lines.push(format!("- {}", DisplayPath(&c.path)));
                }
            }
            format!(
                "Apply failed with {} conflicts: {}",
                many.len(),
                lines.join("\n")
            )
        }
    };
    ApiError {
        code: 409,
        reason: Reason::Conflict,
        message,
        details: Some(Box::new(StatusDetails {
            causes,
            ..StatusDetails::default()
        })),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn obj(v: Value) -> Object {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    fn applier(manager: &str, force: bool) -> Applied<'_> {
        Applied {
            manager,
            force,
            schema: Schema::Builtin,
            scope: Scope::NoStatus,
            api_version: "apps/v1",
            subresource: "",
            now: "2026-01-01T00:00:00Z",
        }
    }

    fn deployment(replicas: i64, image: &str) -> Object {
        obj(json!({
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
            "spec": {"replicas": replicas, "template": {"spec": {"containers": [
                {"name": "web", "image": image}
            ]}}}
        }))
    }

    /// `config` as an apply by `manager` creates it.
    fn created_by(manager: &str, config: Object) -> Object {
        let mut fields = fields_of(&Value::Object(config.clone()), Schema::Builtin, false);
        strip(&mut fields, Scope::NoStatus);
        let mut obj = config;
        managed_fields::encode(&mut obj, vec![applier(manager, false).entry(fields)]);
        obj
    }

    fn managers(o: &Object) -> Vec<String> {
        managed_fields::decode(o)
            .unwrap_or_default()
            .into_iter()
            .map(|e| format!("{}/{}", e.manager, e.operation))
            .collect()
    }

    #[test]
    fn reapplying_without_a_field_removes_it() {
        let live = obj(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}));
        let first = obj(
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c",
            "labels": {"a": "1"}}, "data": {"x": "1", "y": "2"}}),
        );
        let a = Applied {
            api_version: "v1",
            scope: Scope::All,
            ..applier("a", false)
        };
        let once = a.apply_to(&live, &first).unwrap();
        assert_eq!(once["data"], json!({"x": "1", "y": "2"}));
        let second = obj(
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"},
            "data": {"x": "1"}}),
        );
        let twice = a.apply_to(&once, &second).unwrap();
        assert_eq!(twice["data"], json!({"x": "1"}));
        assert!(twice["metadata"].get("labels").is_none(), "{twice:?}");
    }

    #[test]
    fn changing_anothers_field_conflicts_unless_forced() {
        let live = created_by("a", deployment(1, "nginx:1"));
        // Same values: shared, no conflict.
        let shared = applier("b", false)
            .apply_to(&live, &deployment(1, "nginx:1"))
            .unwrap();
        assert!(managers(&shared).contains(&"b/Apply".to_owned()));

        let e = applier("b", false)
            .apply_to(&live, &deployment(3, "nginx:2"))
            .unwrap_err();
        assert_eq!(e.code, 409);
        assert_eq!(e.reason, Reason::Conflict);
        let causes = &e.details.as_ref().unwrap().causes;
        let fields: Vec<&str> = causes.iter().map(|c| c.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                ".spec.replicas",
                ".spec.template.spec.containers[name=\"web\"].image"
            ]
        );
        assert!(causes.iter().all(|c| c.reason == "FieldManagerConflict"));
        assert!(
            e.message.starts_with(
                "Apply failed with 2 conflicts: conflicts with \"a\":\n- .spec.replicas"
            ),
            "{}",
            e.message
        );

        let forced = applier("b", true)
            .apply_to(&live, &deployment(3, "nginx:2"))
            .unwrap();
        assert_eq!(forced["spec"]["replicas"], 3);
        let entries = managed_fields::decode(&forced).unwrap();
        let a = entries.iter().find(|e| e.manager == "a").unwrap();
        assert!(!a.fields.contains(&[
            PathElement::Field("spec".into()),
            PathElement::Field("replicas".into())
        ]));
    }

    #[test]
    fn fields_others_still_own_stay_when_an_applier_drops_them() {
        let live = created_by("a", deployment(2, "nginx"));
        let live = applier("b", false)
            .apply_to(&live, &deployment(2, "nginx"))
            .unwrap();
        let mut without_replicas = deployment(2, "nginx");
        without_replicas["spec"]
            .as_object_mut()
            .unwrap()
            .remove("replicas");
        let after = applier("a", false)
            .apply_to(&live, &without_replicas)
            .unwrap();
        assert_eq!(after["spec"]["replicas"], 2, "b still owns it");
    }

    #[test]
    fn updates_before_the_first_apply_are_owned() {
        let mut live = deployment(1, "nginx");
        live.insert("status".into(), json!({"replicas": 1}));
        let e = applier("a", false)
            .apply_to(&live, &deployment(5, "nginx"))
            .unwrap_err();
        assert_eq!(
            e.message,
            "Apply failed with 1 conflict: conflict with \"before-first-apply\" using apps/v1: .spec.replicas"
        );
    }

    #[test]
    fn keyed_lists_merge_by_key() {
        let mut dst =
            json!({"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "2"}]});
        let src = json!({"containers": [{"name": "b", "image": "3"}, {"name": "c", "image": "4"}]});
        merge(&mut dst, &src, Schema::Builtin, &mut Vec::new());
        assert_eq!(
            dst,
            json!({"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "3"},
                {"name": "c", "image": "4"}]})
        );
        let mut atomic = json!({"args": ["x", "y"]});
        merge(
            &mut atomic,
            &json!({"args": ["z"]}),
            Schema::Builtin,
            &mut Vec::new(),
        );
        assert_eq!(atomic, json!({"args": ["z"]}));
    }

    #[test]
    fn one_conflict_reads_like_kubernetes() {
        assert_eq!(
            conflict_error(&[Conflict {
                owner: "\"kubectl-client-side-apply\" using apps/v1".into(),
                path: vec![
                    PathElement::Field("spec".into()),
                    PathElement::Field("replicas".into())
                ],
            }])
            .message,
            "Apply failed with 1 conflict: conflict with \"kubectl-client-side-apply\" using apps/v1: .spec.replicas"
        );
    }
}
