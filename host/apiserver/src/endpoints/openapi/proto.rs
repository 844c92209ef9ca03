//! `/openapi/v2` in protobuf: the Swagger 2.0 document as gnostic's `openapi.v2.Document`,
//! the form kubectl asks for first (`application/com.github.proto-openapi.spec.v2@v1.0+protobuf`)
//! and reads its kind schemas, `explain` and client-side validation from.
//!
//! The message is built from the JSON document ([`crate::endpoints::openapi::document`]) with the descriptors
//! in `proto/openapi_v2.binpb` (taken from kubectl by `proto/extract_openapi_v2.py`).
//! gnostic models JSON Schema's loose shapes with wrapper messages, so the conversion
//! follows the JSON by field name and knows these shapes:
//! - `x-…` keys go to `vendor_extension` as `NamedAny`s whose `yaml` holds the value's
//!   JSON (JSON is YAML; kubectl parses that string);
//! - a JSON object whose keys are names (`paths`, `definitions`, `properties`,
//!   `responses`, …) is a message of `vendor_extension` and one repeated `Named…` field;
//! - `$ref` is the field `_ref`, camelCase keys are snake_case fields;
//! - the `oneof` wrappers choose by content: `ParametersItem` and `ResponseValue` (a
//!   `$ref` or the thing itself), `Parameter` and `NonBodyParameter` (by `in`),
//!   `SchemaItem` (`type: file` or a schema), `AdditionalPropertiesItem` (a boolean or
//!   a schema), `TypeItem` and `StringArray` (one string or a list);
//! - `default`, `example` and `enum` values are `Any`s with `yaml` set.
//!
//! Keys without a field are left out, as gnostic's own reader does with what it does
//! not know.

use std::sync::LazyLock;

use prost_reflect::prost::Message as _;
use prost_reflect::{
    DescriptorPool, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor, ReflectMessage as _,
};
use serde_json::Value;

/// The media type kubectl asks for. Go's `mime` parser refuses its `@`, so responses
/// carry [`CONTENT_TYPE`], the spelling without it, which clients also ask for.
pub const ACCEPT_DEPRECATED: &str = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf";

/// The media type of the protobuf document.
pub const CONTENT_TYPE: &str = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf";

/// `google/protobuf/any.proto` and gnostic's `openapiv2/OpenAPIv2.proto`.
static DESCRIPTORS: &[u8] = include_bytes!("../../../../../proto/kubernetes/openapi_v2.binpb");

static POOL: LazyLock<Result<DescriptorPool, String>> =
    LazyLock::new(|| DescriptorPool::decode(DESCRIPTORS).map_err(|e| e.to_string()));

const PACKAGE: &str = "openapi.v2";

/// The protobuf form of a Swagger 2.0 JSON document.
pub fn encode(document: &Value) -> Result<Vec<u8>, String> {
    let pool = POOL.as_ref().map_err(Clone::clone)?;
    let desc = message_by_name(pool, "Document")?;
    Ok(Converter { pool }.message(&desc, document).encode_to_vec())
}

/// The descriptor of `openapi.v2.Document`, for readers of [`encode`]'s output.
pub fn document_descriptor() -> Result<MessageDescriptor, String> {
    let pool = POOL.as_ref().map_err(Clone::clone)?;
    message_by_name(pool, "Document")
}

fn message_by_name(pool: &DescriptorPool, name: &str) -> Result<MessageDescriptor, String> {
    pool.get_message_by_name(&format!("{PACKAGE}.{name}"))
        .ok_or_else(|| format!("{PACKAGE}.{name} is missing from the descriptors"))
}

struct Converter<'a> {
    pool: &'a DescriptorPool,
}

impl Converter<'_> {
    fn message(&self, desc: &MessageDescriptor, json: &Value) -> DynamicMessage {
        let mut msg = DynamicMessage::new(desc.clone());
        match desc.name() {
            "Any" => self.set(&mut msg, "yaml", Value::String(json.to_string())),
            "TypeItem" | "StringArray" => self.set(&mut msg, "value", json.clone()),
            "ItemsItem" => self.set(&mut msg, "schema", json.clone()),
            "AdditionalPropertiesItem" => match json {
                Value::Bool(_) => self.set(&mut msg, "boolean", json.clone()),
                _ => self.set(&mut msg, "schema", json.clone()),
            },
            "SchemaItem" if json.get("type").and_then(Value::as_str) == Some("file") => {
                self.set(&mut msg, "file_schema", json.clone())
            }
            "SchemaItem" => self.set(&mut msg, "schema", json.clone()),
            "ParametersItem" | "ResponseValue" => {
                let which = if json.get("$ref").is_some() {
                    "json_reference"
                } else if desc.name() == "ParametersItem" {
                    "parameter"
                } else {
                    "response"
                };
                self.set(&mut msg, which, json.clone())
            }
            "SecurityDefinitionsItem" => {
                let flow = json.get("flow").and_then(Value::as_str);
                let which = match (json.get("type").and_then(Value::as_str), flow) {
                    (Some("basic"), _) => "basic_authentication_security",
                    (Some("oauth2"), Some("implicit")) => "oauth2_implicit_security",
                    (Some("oauth2"), Some("password")) => "oauth2_password_security",
                    (Some("oauth2"), Some("application")) => "oauth2_application_security",
                    (Some("oauth2"), _) => "oauth2_access_code_security",
                    _ => "api_key_security",
                };
                self.set(&mut msg, which, json.clone())
            }
            "Parameter" => {
                let which = match json.get("in").and_then(Value::as_str) {
                    Some("body") => "body_parameter",
                    _ => "non_body_parameter",
                };
                self.set(&mut msg, which, json.clone())
            }
            "NonBodyParameter" => {
                let which = match json.get("in").and_then(Value::as_str) {
                    Some("header") => "header_parameter_sub_schema",
                    Some("formData") => "form_data_parameter_sub_schema",
                    Some("path") => "path_parameter_sub_schema",
                    _ => "query_parameter_sub_schema",
                };
                self.set(&mut msg, which, json.clone())
            }
            _ => match (named_entries(desc), json) {
                (Some(entries), Value::Object(map)) => {
                    let mut named = Vec::new();
                    for (key, value) in map {
                        if key.starts_with("x-") {
                            self.vendor_extension(&mut msg, key, value);
                            continue;
                        }
                        let Kind::Message(entry) = entries.kind() else {
                            continue;
                        };
                        let mut pair = DynamicMessage::new(entry.clone());
                        self.set(&mut pair, "name", Value::String(key.clone()));
                        self.set(&mut pair, "value", value.clone());
                        named.push(prost_reflect::Value::Message(pair));
                    }
                    let _ = msg.try_set_field(&entries, prost_reflect::Value::List(named));
                }
                (_, Value::Object(map)) => {
                    for (key, value) in map {
                        if key.starts_with("x-") {
                            self.vendor_extension(&mut msg, key, value);
                        } else {
                            self.set(&mut msg, &field_name(key), value.clone());
                        }
                    }
                }
                _ => {}
            },
        }
        msg
    }

    /// Sets field `name` of `msg` from `json`, if the field exists and the value fits.
    fn set(&self, msg: &mut DynamicMessage, name: &str, json: Value) {
        let Some(field) = msg.descriptor().get_field_by_name(name) else {
            return;
        };
        let value = if field.is_list() {
            let items = match json {
                Value::Array(items) => items,
                one => vec![one],
            };
            prost_reflect::Value::List(
                items
                    .iter()
                    .filter_map(|item| self.scalar(&field, item))
                    .collect(),
            )
        } else {
            match self.scalar(&field, &json) {
                Some(v) => v,
                None => return,
            }
        };
        // A value of the wrong kind is left out rather than refused: the document is
        // ours, and a reader is better served by the rest of it.
        let _ = msg.try_set_field(&field, value);
    }

    fn scalar(&self, field: &FieldDescriptor, json: &Value) -> Option<prost_reflect::Value> {
        use prost_reflect::Value as P;
        Some(match field.kind() {
            Kind::String => P::String(match json {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            }),
            Kind::Bool => P::Bool(json.as_bool()?),
            Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => P::I64(json.as_i64()?),
            Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => P::I32(json.as_i64()?.try_into().ok()?),
            Kind::Double => P::F64(json.as_f64()?),
            Kind::Float => P::F32(json.as_f64()? as f32),
            Kind::Message(m) => P::Message(self.message(&m, json)),
            _ => return None,
        })
    }

    fn vendor_extension(&self, msg: &mut DynamicMessage, key: &str, value: &Value) {
        let Some(field) = msg.descriptor().get_field_by_name("vendor_extension") else {
            return;
        };
        let Ok(named_any) = message_by_name(self.pool, "NamedAny") else {
            return;
        };
        let mut pair = DynamicMessage::new(named_any);
        self.set(&mut pair, "name", Value::String(key.to_owned()));
        self.set(&mut pair, "value", value.clone());
        if let prost_reflect::Value::List(list) = msg.get_field_mut(&field) {
            list.push(prost_reflect::Value::Message(pair));
        }
    }
}

/// For a message that stands for a JSON object keyed by names (gnostic's `Paths`,
/// `Definitions`, `Properties`, `Responses`, …): its repeated `Named…` field. Such a
/// message has that field and at most `vendor_extension` besides.
fn named_entries(desc: &MessageDescriptor) -> Option<FieldDescriptor> {
    let mut entries = None;
    for field in desc.fields() {
        match field.kind() {
            _ if field.name() == "vendor_extension" => {}
            Kind::Message(m) if field.is_list() && m.name().starts_with("Named") => {
                if entries.replace(field).is_some() {
                    return None;
                }
            }
            _ => return None,
        }
    }
    entries
}

/// The proto field a JSON key is stored in: `$ref` → `_ref`, `basePath` → `base_path`.
fn field_name(key: &str) -> String {
    if key == "$ref" {
        return "_ref".to_owned();
    }
    let mut out = String::with_capacity(key.len() + 4);
    for c in key.chars() {
        if c.is_ascii_uppercase() {
            out.push('_');
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The decoded message as JSON with proto field names, to assert on.
    fn decode(bytes: &[u8]) -> Value {
        let msg = DynamicMessage::decode(document_descriptor().unwrap(), bytes).unwrap();
        to_json(&msg)
    }

    fn to_json(msg: &DynamicMessage) -> Value {
        fn value(v: &prost_reflect::Value) -> Value {
            use prost_reflect::Value as P;
            match v {
                P::String(s) => json!(s),
                P::Bool(b) => json!(b),
                P::I64(n) => json!(n),
                P::I32(n) => json!(n),
                P::F64(n) => json!(n),
                P::List(items) => Value::Array(items.iter().map(value).collect()),
                P::Message(m) => to_json(m),
                other => json!(format!("{other:?}")),
            }
        }
        Value::Object(
            msg.fields()
                .map(|(f, v)| (f.name().to_owned(), value(v)))
                .collect(),
        )
    }

    #[test]
    fn the_document_round_trips_through_the_descriptor() {
        let doc = json!({
            "swagger": "2.0",
            "info": {"title": "Trellis", "version": "0.1.0"},
            "paths": {
                "/api/v1/namespaces/{namespace}/pods": {
                    "get": {
                        "operationId": "listCoreV1NamespacedPod",
                        "parameters": [{"name": "limit", "in": "query", "type": "integer"}],
                        "responses": {"200": {"description": "OK", "schema": {"$ref": "#/definitions/Pod"}}},
                        "x-kubernetes-action": "list",
                    },
                    "parameters": [{"name": "namespace", "in": "path", "required": true, "type": "string"}],
                },
            },
            "definitions": {
                "Pod": {
                    "type": "object",
                    "required": ["spec"],
                    "properties": {
                        "spec": {"$ref": "#/definitions/PodSpec", "description": "the spec"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "phase": {"type": "string", "enum": ["Pending", "Running"], "default": "Pending"},
                    },
                    "x-kubernetes-group-version-kind": [{"group": "", "version": "v1", "kind": "Pod"}],
                },
            },
            "securityDefinitions": {"BearerToken": {"type": "apiKey", "name": "authorization", "in": "header"}},
            "security": [{"BearerToken": []}],
        });
        let out = decode(&encode(&doc).unwrap());
        assert_eq!(out["swagger"], "2.0");
        let defs = &out["definitions"]["additional_properties"];
        assert_eq!(defs[0]["name"], "Pod");
        let pod = &defs[0]["value"];
        assert_eq!(pod["type"]["value"], json!(["object"]));
        assert_eq!(pod["required"], json!(["spec"]));
        let gvk = &pod["vendor_extension"][0];
        assert_eq!(gvk["name"], "x-kubernetes-group-version-kind");
        let yaml: Value = serde_json::from_str(gvk["value"]["yaml"].as_str().unwrap()).unwrap();
        assert_eq!(yaml[0]["kind"], "Pod");
        let props = &pod["properties"]["additional_properties"];
        let prop = |name: &str| {
            props
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["name"] == name)
                .unwrap()["value"]
                .clone()
        };
        assert_eq!(prop("spec")["_ref"], "#/definitions/PodSpec");
        assert_eq!(
            prop("tags")["items"]["schema"][0]["type"]["value"][0],
            "string"
        );
        assert_eq!(
            prop("labels")["additional_properties"]["schema"]["type"]["value"][0],
            "string"
        );
        assert_eq!(prop("phase")["enum"][1]["yaml"], "\"Running\"");
        let path = &out["paths"]["path"][0];
        assert_eq!(path["name"], "/api/v1/namespaces/{namespace}/pods");
        let get = &path["value"]["get"];
        assert_eq!(get["operation_id"], "listCoreV1NamespacedPod");
        assert_eq!(
            get["parameters"][0]["parameter"]["non_body_parameter"]["query_parameter_sub_schema"]["name"],
            "limit"
        );
        assert_eq!(
            path["value"]["parameters"][0]["parameter"]["non_body_parameter"]["path_parameter_sub_schema"]
                ["required"],
            true
        );
        assert_eq!(
            get["responses"]["response_code"][0]["value"]["response"]["schema"]["schema"]["_ref"],
            "#/definitions/Pod"
        );
        assert_eq!(
            out["security_definitions"]["additional_properties"][0]["value"]["api_key_security"]["in"],
            "header"
        );
    }

    #[test]
    fn field_names_follow_gnostic() {
        assert_eq!(field_name("$ref"), "_ref");
        assert_eq!(field_name("basePath"), "base_path");
        assert_eq!(field_name("x-kubernetes-action"), "x-kubernetes-action");
        let _ = document_descriptor().unwrap().full_name();
    }
}
