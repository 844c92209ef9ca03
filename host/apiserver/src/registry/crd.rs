//! Custom resources: every served version of a CustomResourceDefinition becomes a
//! resource of the registry as soon as the CRD is stored, validated against its
//! `openAPIV3Schema` (JSON Schema, `jsonschema` crate) and pruned to it, with the
//! `status` and `scale` subresources when the version declares them. A deleted CRD
//! takes its objects with it ([`continue_deletion`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use serde_json::{Map, Value, json};
use trellis_api::ApiError;
use trellis_api::registry::{ALL_VERBS, PrinterColumn, ResourceInfo, Subresource};
use trellis_api::status::StatusCause;

use crate::object::Object;

/// The store prefix of CRDs.
pub const CRD_PREFIX: &str = "/registry/apiextensions.k8s.io/customresourcedefinitions/";

/// One served version's schema.
pub struct Schema {
    raw: Value,
    validator: jsonschema::Validator,
}

impl Schema {
    /// The `openAPIV3Schema` as the CRD declares it.
    pub fn raw(&self) -> &Value {
        &self.raw
    }
}

impl std::fmt::Debug for Schema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Schema").finish_non_exhaustive()
    }
}

/// The resources and schemas that the stored CRDs define.
#[derive(Debug, Default)]
pub struct CustomResources {
    pub resources: Vec<ResourceInfo>,
    /// Keyed by (group, version, plural).
    pub schemas: HashMap<(String, String, String), Arc<Schema>>,
}

fn strs(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// A version's `additionalPrinterColumns`; `None` when it declares none. Columns
/// without a name or a JSONPath are left out (the CRD's validation names them).
fn printer_columns(version: &Value) -> Option<Arc<[PrinterColumn]>> {
    let declared = version.get("additionalPrinterColumns")?.as_array()?;
    let text = |c: &Value, key: &str| {
        c.get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let columns: Vec<PrinterColumn> = declared
        .iter()
        .filter(|c| !text(c, "name").is_empty() && !text(c, "jsonPath").is_empty())
        .map(|c| PrinterColumn {
            name: text(c, "name"),
            kind: text(c, "type"),
            format: text(c, "format"),
            description: text(c, "description"),
            priority: c.get("priority").and_then(Value::as_i64).unwrap_or(0),
            json_path: text(c, "jsonPath"),
        })
        .collect();
    (!columns.is_empty()).then(|| columns.into())
}

/// Reads the served versions of one CRD. Unusable CRDs are skipped with the reason.
pub fn from_crd(crd: &Object, out: &mut CustomResources) -> Result<(), String> {
    let spec = crd.get("spec").ok_or("no spec")?;
    let group = spec
        .get("group")
        .and_then(Value::as_str)
        .ok_or("no spec.group")?;
    let names = spec.get("names").ok_or("no spec.names")?;
    let plural = names
        .get("plural")
        .and_then(Value::as_str)
        .ok_or("no spec.names.plural")?;
    let kind = names
        .get("kind")
        .and_then(Value::as_str)
        .ok_or("no spec.names.kind")?;
    let singular = names
        .get("singular")
        .and_then(Value::as_str)
        .map_or_else(|| kind.to_lowercase(), str::to_owned);
    let namespaced = spec.get("scope").and_then(Value::as_str) != Some("Cluster");
    for version in spec
        .get("versions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if version.get("served").and_then(Value::as_bool) == Some(false) {
            continue;
        }
        let Some(name) = version.get("name").and_then(Value::as_str) else {
            continue;
        };
        let mut subresources = Vec::new();
        if version
            .get("subresources")
            .and_then(|s| s.get("status"))
            .is_some()
        {
            subresources.push(Subresource::Status);
        }
        if version
            .get("subresources")
            .and_then(|s| s.get("scale"))
            .is_some()
        {
            subresources.push(Subresource::Scale);
        }
        out.resources.push(ResourceInfo {
            group: group.to_owned(),
            version: name.to_owned(),
            kind: kind.to_owned(),
            plural: plural.to_owned(),
            singular: singular.clone(),
            namespaced,
            verbs: ALL_VERBS.iter().map(|v| (*v).to_owned()).collect(),
            short_names: strs(names.get("shortNames")),
            categories: strs(names.get("categories")),
            subresources,
            printer_columns: printer_columns(version),
        });
        if let Some(raw) = version.get("schema").and_then(|s| s.get("openAPIV3Schema")) {
            let validator = jsonschema::validator_for(&for_validation(raw))
                .map_err(|e| format!("version {name}: invalid openAPIV3Schema: {e}"))?;
            out.schemas.insert(
                (group.to_owned(), name.to_owned(), plural.to_owned()),
                Arc::new(Schema {
                    raw: raw.clone(),
                    validator,
                }),
            );
        }
    }
    Ok(())
}

/// The schema as a JSON Schema validator reads it: OpenAPI's `nullable` becomes a
/// `null` alternative, and metadata is left to the server's own checks.
fn for_validation(schema: &Value) -> Value {
    match schema {
        Value::Object(m) => {
            let mut out: Map<String, Value> = m
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        if k == "properties" || k == "additionalProperties" || k == "items" {
                            for_validation_children(k, v)
                        } else {
                            v.clone()
                        },
                    )
                })
                .collect();
            if m.get("nullable") == Some(&Value::Bool(true)) {
                if let Some(t) = out.get("type").cloned() {
                    out.insert("type".into(), json!([t, "null"]));
                }
                if let Some(Value::Array(values)) = out.get_mut("enum") {
                    values.push(Value::Null);
                }
            }
            if m.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
                out.remove("type");
                out.insert(
                    "anyOf".into(),
                    json!([{"type": "integer"}, {"type": "string"}]),
                );
            }
            Value::Object(out)
        }
        other => other.clone(),
    }
}

fn for_validation_children(key: &str, v: &Value) -> Value {
    match (key, v) {
        ("properties", Value::Object(props)) => Value::Object(
            props
                .iter()
                .filter(|(k, _)| k.as_str() != "metadata")
                .map(|(k, s)| (k.clone(), for_validation(s)))
                .collect(),
        ),
        _ => for_validation(v),
    }
}

/// Drops the fields the schema does not declare, as Kubernetes prunes custom
/// resources (`x-kubernetes-preserve-unknown-fields` keeps them).
pub fn prune(value: &mut Value, schema: &Value, root: bool) {
    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true))
        && schema.get("properties").is_none()
    {
        return;
    }
    match value {
        Value::Object(map) => {
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties").filter(|a| a.is_object());
            let preserve =
                schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
            map.retain(|k, v| {
                if root && matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
                    return true;
                }
                match (props.and_then(|p| p.get(k)), additional) {
                    (Some(s), _) | (None, Some(s)) => {
                        prune(v, s, false);
                        true
                    }
                    (None, None) => preserve,
                }
            });
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for item in items {
                    prune(item, item_schema, false);
                }
            }
        }
        _ => {}
    }
}

/// Prunes and validates a custom resource.
pub fn validate(schema: &Schema, res: &ResourceInfo, obj: &mut Object) -> Result<(), ApiError> {
    let mut value = Value::Object(std::mem::take(obj));
    prune(&mut value, &schema.raw, true);
    let mut causes: Vec<StatusCause> = schema
        .validator
        .iter_errors(&value)
        .map(|e| cause_of(&e))
        .collect();
    if let Value::Object(m) = value {
        *obj = m;
    }
    causes.extend(crate::object::validate_owner_references(obj));
    if causes.is_empty() {
        return Ok(());
    }
    let name = crate::object::name(obj).unwrap_or_default();
    Err(ApiError::invalid(&res.group, &res.kind, name, causes))
}

/// A schema violation in kube-openapi's words, as kubectl users read them.
fn cause_of(e: &jsonschema::ValidationError<'_>) -> StatusCause {
    use jsonschema::error::ValidationErrorKind as Kind;
    let path = e.instance_path().to_string();
    let field = path.trim_start_matches('/').replace('/', ".");
    let value = e.instance().to_string();
    let invalid = |detail: String| {
        StatusCause::new(
            "FieldValueInvalid",
            field.clone(),
            format!("Invalid value: {value}: {field} in body {detail}"),
        )
    };
    // Go prints whole float64 limits without a fraction: 1, not 1.0.
    let number = |v: &Value| match v.as_f64() {
        Some(f) if f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
        _ => v.to_string(),
    };
    match e.kind() {
        Kind::Minimum { limit } => invalid(format!(
            "should be greater than or equal to {}",
            number(limit)
        )),
        Kind::Maximum { limit } => {
            invalid(format!("should be less than or equal to {}", number(limit)))
        }
        Kind::ExclusiveMinimum { limit } => {
            invalid(format!("should be greater than {}", number(limit)))
        }
        Kind::ExclusiveMaximum { limit } => {
            invalid(format!("should be less than {}", number(limit)))
        }
        Kind::MinLength { limit } => invalid(format!("should be at least {limit} chars long")),
        Kind::MaxLength { limit } => StatusCause::new(
            "FieldValueTooLong",
            field.clone(),
            format!("Too long: may not be more than {limit} bytes"),
        ),
        Kind::Pattern { pattern } => invalid(format!("should match '{pattern}'")),
        Kind::Type { kind } => {
            let wanted = format!("{kind:?}").to_lowercase();
            invalid(format!(
                "must be of type {}",
                wanted.trim_start_matches("single(").trim_end_matches(')')
            ))
        }
        Kind::Enum { options } => {
            let supported: Vec<String> = options
                .as_array()
                .map(|o| {
                    o.iter()
                        .filter(|v| !v.is_null())
                        .map(Value::to_string)
                        .collect()
                })
                .unwrap_or_default();
            StatusCause::new(
                "FieldValueNotSupported",
                field.clone(),
                format!(
                    "Unsupported value: {value}: supported values: {}",
                    supported.join(", ")
                ),
            )
        }
        Kind::Required { property } => {
            let name = property
                .as_str()
                .map_or_else(|| property.to_string(), str::to_owned);
            let field = if field.is_empty() {
                name
            } else {
                format!("{field}.{name}")
            };
            StatusCause::required(field)
        }
        _ => StatusCause::new(
            "FieldValueInvalid",
            field.clone(),
            format!("Invalid value: {value}: {e}"),
        ),
    }
}

/// What the server reports in a CRD's status once it serves it.
pub fn established_status(crd: &Object) -> Value {
    let now = crate::object::now_timestamp();
    let names = crd
        .get("spec")
        .and_then(|s| s.get("names"))
        .cloned()
        .unwrap_or_else(|| json!({}));
    let stored: Vec<Value> = crd
        .get("spec")
        .and_then(|s| s.get("versions"))
        .and_then(Value::as_array)
        .map(|v| {
            v.iter()
                .filter(|v| v.get("storage") == Some(&Value::Bool(true)))
                .filter_map(|v| v.get("name").cloned())
                .collect()
        })
        .unwrap_or_default();
    json!({
        "acceptedNames": names,
        "storedVersions": stored,
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found", "lastTransitionTime": now},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "message": "the initial names have been accepted", "lastTransitionTime": now},
        ],
    })
}

/// The finalizer that keeps a CRD until its objects are deleted, as Kubernetes'
/// `customresourcecleanup` controller does.
pub const CLEANUP_FINALIZER: &str = "customresourcecleanup.apiextensions.k8s.io";

/// The store prefix of the objects of CRD `name` (`<plural>.<group>`).
fn objects_prefix(name: &str) -> Option<String> {
    let (plural, group) = name.split_once('.')?;
    Some(format!("/registry/{group}/{plural}/"))
}

/// Deletes the objects under `prefix`: those with finalizers are marked for deletion,
/// the others removed. Returns whether none remain; adds the namespaces it removed
/// objects from to `emptied`.
async fn delete_objects(
    store: &dyn trellis_store::Store,
    prefix: &str,
    emptied: &mut BTreeSet<String>,
) -> trellis_store::Result<bool> {
    use trellis_store::{Error, ListRequest};
    let page = store.list(ListRequest::prefix(prefix)).await?;
    let mut remaining = false;
    let mut removed_from = |key: &str| {
        // `<prefix><namespace>/<name>` for namespaced objects, `<prefix><name>` else.
        if let Some((namespace, _)) = key.strip_prefix(prefix).and_then(|k| k.split_once('/')) {
            emptied.insert(namespace.to_owned());
        }
    };
    for kv in &page.kvs {
        let Some(mut obj) = crate::storage::watch_cache::decode_stored(&kv.value, kv.mod_revision)
        else {
            continue;
        };
        let finalizers = crate::object::metadata(&obj)
            .and_then(|m| m.get("finalizers"))
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty());
        if !finalizers {
            match store.delete(&kv.key, Some(kv.mod_revision)).await {
                Ok(_) => removed_from(&kv.key),
                Err(Error::NotFound { .. }) => {}
                Err(Error::Conflict { .. }) => remaining = true,
                Err(e) => return Err(e),
            }
            continue;
        }
        remaining = true;
        if crate::object::meta_str(&obj, "deletionTimestamp").is_some() {
            continue;
        }
        crate::object::set_meta(
            &mut obj,
            "deletionTimestamp",
            crate::object::now_timestamp(),
        );
        crate::object::set_meta(&mut obj, "deletionGracePeriodSeconds", 0);
        crate::object::remove_meta(&mut obj, "resourceVersion");
        let Ok(bytes) = crate::object::encode(&obj) else {
            continue;
        };
        match store.update(&kv.key, bytes, Some(kv.mod_revision)).await {
            Ok(_) | Err(Error::NotFound { .. } | Error::Conflict { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(!remaining)
}

/// Moves the deletion of CRD `name` on: once it is marked for deletion, its objects
/// are deleted, and when none remain its cleanup finalizer goes (and with the last
/// finalizer, the CRD). With `deleted` (the CRD was just deleted), a CRD already gone
/// has its objects deleted too. Returns whether the CRD or its objects changed, and adds
/// the namespaces objects were removed from to `emptied`.
pub async fn continue_deletion(
    store: &dyn trellis_store::Store,
    name: &str,
    deleted: bool,
    emptied: &mut BTreeSet<String>,
) -> trellis_store::Result<bool> {
    let Some(prefix) = objects_prefix(name) else {
        return Ok(false);
    };
    let key = format!("{CRD_PREFIX}{name}");
    let Some(kv) = store.get(&key).await? else {
        if deleted {
            delete_objects(store, &prefix, emptied).await?;
        }
        return Ok(deleted);
    };
    let Some(mut crd) = crate::storage::watch_cache::decode_stored(&kv.value, kv.mod_revision)
    else {
        return Ok(false);
    };
    if crate::object::meta_str(&crd, "deletionTimestamp").is_none() {
        return Ok(false);
    }
    if !delete_objects(store, &prefix, emptied).await? {
        return Ok(true);
    }
    let meta = crate::object::metadata_mut(&mut crd);
    let mut finalizers: Vec<Value> = meta
        .get("finalizers")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    finalizers.retain(|f| f.as_str() != Some(CLEANUP_FINALIZER));
    let result = if finalizers.is_empty() {
        store.delete(&key, Some(kv.mod_revision)).await.map(|_| ())
    } else {
        meta.insert("finalizers".into(), Value::Array(finalizers));
        meta.remove("resourceVersion");
        match crate::object::encode(&crd) {
            Ok(bytes) => store
                .update(&key, bytes, Some(kv.mod_revision))
                .await
                .map(|_| ()),
            Err(_) => Ok(()),
        }
    };
    match result {
        Ok(())
        | Err(trellis_store::Error::Conflict { .. } | trellis_store::Error::NotFound { .. }) => {
            Ok(true)
        }
        Err(e) => Err(e),
    }
}

/// Whether CRD `name` (`<plural>.<group>`) is being deleted: its objects are then
/// being removed, and new ones are refused.
pub async fn terminating(store: &dyn trellis_store::Store, name: &str) -> bool {
    let Ok(Some(kv)) = store.get(&format!("{CRD_PREFIX}{name}")).await else {
        return false;
    };
    crate::storage::watch_cache::decode_stored(&kv.value, kv.mod_revision)
        .is_some_and(|crd| crate::object::meta_str(&crd, "deletionTimestamp").is_some())
}

/// With `fieldValidation=Strict`, the fields the schema does not declare (those
/// pruning would drop), as paths like `spec.color`.
pub fn unknown_fields(schema: &Schema, obj: &Object) -> Vec<String> {
    let original = Value::Object(obj.clone());
    let mut pruned = original.clone();
    prune(&mut pruned, &schema.raw, true);
    let mut out = Vec::new();
    crate::registry::typed::unknown_fields(&original, &pruned, "", &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crd() -> Object {
        serde_json::from_value(json!({
            "metadata": {"name": "widgets.example.com"},
            "spec": {
                "group": "example.com", "scope": "Namespaced",
                "names": {"plural": "widgets", "kind": "Widget", "shortNames": ["wd"]},
                "versions": [{
                    "name": "v1", "served": true, "storage": true,
                    "subresources": {"status": {}},
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                        "spec": {"type": "object", "required": ["size"], "properties": {
                            "size": {"type": "integer", "minimum": 1},
                            "color": {"type": "string", "enum": ["red", "blue"], "nullable": true},
                            "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
                        }},
                        "status": {"type": "object", "properties": {"ready": {"type": "boolean"}}}
                    }}}
                }, {"name": "v0", "served": false}]
            }
        }))
        .unwrap()
    }

    #[test]
    fn served_versions_become_resources() {
        let mut out = CustomResources::default();
        from_crd(&crd(), &mut out).unwrap();
        assert_eq!(out.resources.len(), 1);
        let r = &out.resources[0];
        assert_eq!(
            (r.group.as_str(), r.version.as_str(), r.kind.as_str()),
            ("example.com", "v1", "Widget")
        );
        assert!(r.namespaced && r.has(Subresource::Status) && !r.has(Subresource::Scale));
        assert_eq!(r.short_names, ["wd"]);
        assert_eq!(
            established_status(&crd())["conditions"][1]["type"],
            "Established"
        );
    }

    #[test]
    fn objects_are_pruned_then_validated() {
        let mut out = CustomResources::default();
        from_crd(&crd(), &mut out).unwrap();
        let res = out.resources[0].clone();
        let schema = out.schemas.values().next().unwrap().clone();
        let mut ok: Object = serde_json::from_value(json!({
            "apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w", "labels": {"a": "b"}},
            "spec": {"size": 3, "color": null, "unknown": 1, "extra": {"anything": [1]}}, "junk": true
        }))
        .unwrap();
        validate(&schema, &res, &mut ok).unwrap();
        assert!(ok.get("junk").is_none() && ok["spec"].get("unknown").is_none());
        assert_eq!(ok["spec"]["extra"]["anything"][0], 1);
        assert_eq!(ok["metadata"]["labels"]["a"], "b");

        let mut bad: Object = serde_json::from_value(
            json!({"metadata": {"name": "w"}, "spec": {"size": 0, "color": "green"}}),
        )
        .unwrap();
        let e = validate(&schema, &res, &mut bad).unwrap_err();
        assert_eq!(e.code, 422);
        let fields: Vec<String> = e
            .details
            .unwrap()
            .causes
            .into_iter()
            .map(|c| c.field)
            .collect();
        assert!(
            fields.contains(&"spec.size".to_owned()) && fields.contains(&"spec.color".to_owned()),
            "{fields:?}"
        );
        let mut missing: Object =
            serde_json::from_value(json!({"metadata": {"name": "w"}, "spec": {}})).unwrap();
        assert!(
            validate(&schema, &res, &mut missing)
                .unwrap_err()
                .message
                .contains("size")
        );
    }
}
