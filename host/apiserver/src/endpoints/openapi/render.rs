//! The renderer: a catalog schema as each OpenAPI version writes it (v3 wraps a `$ref`
//! that has siblings in `allOf`; v2 points `$ref`s at `#/definitions/` and drops what
//! Swagger 2.0 lacks), with what the built-in kinds' definitions add: the
//! int-or-string and quantity types, `DeleteOptions`' kinds, and patch strategies.

use k8s_openapi::schemars::JsonSchema;
use serde_json::{Map, Value, json};

use super::catalog::{
    GVK_EXTENSION, Gvk, SCHEMA_KEYWORDS, SCHEMA_LIST_KEYWORDS, SCHEMA_MAP_KEYWORDS, V2_REF_PREFIX,
    V3_REF_PREFIX,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Spec {
    V2,
    V3,
}

/// One catalog schema as a v3 `components.schemas` or v2 `definitions` entry.
pub(super) fn render_definition(
    name: &str,
    schema: &Value,
    spec: Spec,
    delete_options: &[Gvk],
) -> Value {
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::DeleteOptions;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    let mut out = render(schema, spec);
    let Value::Object(m) = &mut out else {
        return out;
    };
    add_patch_strategies(name, m);
    // The two "int or string" types: schemars gives only the extension; OpenAPI
    // readers want a type too, spelled as Kubernetes spells it in each version.
    if name == IntOrString::schema_name() {
        m.insert("format".to_owned(), Value::from("int-or-string"));
        match spec {
            Spec::V3 => {
                m.insert(
                    "oneOf".to_owned(),
                    json!([{ "type": "integer" }, { "type": "string" }]),
                );
            }
            Spec::V2 => {
                m.insert("type".to_owned(), Value::from("string"));
            }
        }
    } else if name == Quantity::schema_name() {
        match spec {
            Spec::V3 => {
                m.insert(
                    "oneOf".to_owned(),
                    json!([{ "type": "string" }, { "type": "number" }]),
                );
            }
            Spec::V2 => {
                m.insert("type".to_owned(), Value::from("string"));
            }
        }
    } else if name == DeleteOptions::schema_name() {
        let kinds: Vec<Value> = delete_options.iter().map(Gvk::to_value).collect();
        m.insert(GVK_EXTENSION.to_owned(), Value::Array(kinds));
    }
    out
}

/// Adds the built-in kinds' patch strategies and merge keys ([`crate::fieldmanager::merge_keys`]) to
/// schema `name`. kubectl reads them from `/openapi/v2` when it computes a strategic
/// merge patch from it; without them every list would be replaced whole.
fn add_patch_strategies(name: &str, schema: &mut Map<String, Value>) {
    let Some(Value::Object(properties)) = schema.get_mut("properties") else {
        return;
    };
    for rule in crate::fieldmanager::merge_keys::of_schema(name) {
        let Some(Value::Object(property)) = properties.get_mut(rule.field) else {
            continue;
        };
        property.insert(
            "x-kubernetes-patch-strategy".into(),
            Value::from(rule.patch_strategy),
        );
        if !rule.patch_merge_key.is_empty() {
            property.insert(
                "x-kubernetes-patch-merge-key".into(),
                Value::from(rule.patch_merge_key),
            );
        }
    }
}

/// A catalog schema in the dialect of `spec`: v3 wraps a `$ref` that has siblings in
/// `allOf` (OpenAPI 3.0 ignores a `$ref`'s siblings); v2 points `$ref`s at
/// `#/definitions/` and drops `oneOf` and `anyOf`, which Swagger 2.0 lacks.
pub(super) fn render(schema: &Value, spec: Spec) -> Value {
    let Value::Object(m) = schema else {
        return schema.clone();
    };
    let mut out = Map::with_capacity(m.len());
    for (k, v) in m {
        let key = k.as_str();
        let rendered = match (key, spec) {
            ("$ref", Spec::V2) => v
                .as_str()
                .map(|r| Value::from(r.replacen(V3_REF_PREFIX, V2_REF_PREFIX, 1)))
                .unwrap_or_else(|| v.clone()),
            ("$ref", Spec::V3) if m.len() > 1 => {
                out.insert("allOf".to_owned(), json!([{ "$ref": v }]));
                continue;
            }
            ("oneOf" | "anyOf", Spec::V2) => continue,
            _ if SCHEMA_KEYWORDS.contains(&key) => render(v, spec),
            _ if SCHEMA_LIST_KEYWORDS.contains(&key) => match v {
                Value::Array(items) => items.iter().map(|s| render(s, spec)).collect(),
                other => other.clone(),
            },
            _ if SCHEMA_MAP_KEYWORDS.contains(&key) => match v {
                Value::Object(named) => Value::Object(
                    named
                        .iter()
                        .map(|(name, s)| (name.clone(), render(s, spec)))
                        .collect(),
                ),
                other => other.clone(),
            },
            _ => v.clone(),
        };
        out.insert(k.clone(), rendered);
    }
    Value::Object(out)
}
