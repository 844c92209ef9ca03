//! Request bodies in Kubernetes' protobuf encoding (`application/vnd.kubernetes.protobuf`),
//! read into the Kubernetes JSON the rest of the server handles.
//!
//! kubectl's imperative commands (`kubectl create configmap|secret|deployment|…`,
//! `kubectl create token`, `kubectl auth can-i`) and client-go's typed clients send
//! built-in kinds as the envelope `k8s\0` + `runtime.Unknown{typeMeta, raw}`, where `raw`
//! is the object's own message (e.g. `k8s.io.api.core.v1.ConfigMap`) without apiVersion
//! and kind. Start with [`decode`].
//!
//! The messages are read with the descriptors in `proto/kubernetes.binpb` (Kubernetes
//! 1.32, taken from kubectl by `proto/extract_descriptors.py`) and written as Go's
//! `encoding/json` writes the same Go value, not in proto3's JSON mapping:
//! - names are the proto field names, which are Kubernetes' JSON names, but for the
//!   few in [`JSON_NAMES`]; embedded structs ([`INLINE`]) are merged into their parent;
//! - a Go pointer field (no `(gogoproto.nullable) = false` option) is kept when present,
//!   zero or not (`replicas: 0`); a Go value field is always on the wire, and is left
//!   out when zero (`""`, `0`, `false`, `{}`), as Kubernetes treats zero as unset;
//! - int64 stay numbers, `bytes` are base64, maps are objects;
//! - `IntOrString`, `Quantity`, `Time`, `MicroTime`, `Duration`, `RawExtension`,
//!   `FieldsV1` and the named string slices (`Verbs`, `ExtraValue`) take their Go JSON
//!   form; a `RawExtension` holding a nested protobuf envelope is decoded too.
//!
//! Responses stay JSON: clients that send protobuf also accept JSON.

use std::collections::HashSet;
use std::sync::LazyLock;

use base64::Engine as _;
use prost_reflect::{
    DescriptorPool, DynamicMessage, FieldDescriptor, Kind, MapKey, MessageDescriptor,
    ReflectMessage as _, Value as ProtoValue,
};
use serde_json::{Map, Number, Value};
use trellis_api::ApiError;
use trellis_api::status::Reason;

/// The content type that selects this decoder.
pub const CONTENT_TYPE: &str = "application/vnd.kubernetes.protobuf";

/// The four bytes that open every Kubernetes protobuf body.
pub const MAGIC: &[u8] = b"k8s\0";

/// `FileDescriptorSet` of every `generated.proto` under `k8s.io/api` and
/// `k8s.io/apimachinery`, with their gogoproto field options.
static DESCRIPTORS: &[u8] = include_bytes!("../../../../proto/kubernetes/kubernetes.binpb");

/// `(gogoproto.nullable)`: `false` marks a Go value (non-pointer) field.
const GOGO_NULLABLE: u32 = 65001;

/// How deep `RawExtension`s may nest protobuf envelopes; bounds the recursion.
const MAX_NESTED_ENVELOPES: usize = 8;

/// Fields whose Go JSON name is not their proto name (from the Go struct tags).
const JSON_NAMES: &[(&str, &str)] = &[
    ("Webhooks", "webhooks"),     // admissionregistration *WebhookConfiguration
    ("Expression", "expression"), // admissionregistration Validation, Variable
    ("Name", "name"),             // admissionregistration Variable
    ("uID", "uid"),               // authentication BoundObjectReference
    ("aPIGroup", "apiGroup"),     // networking IngressClassParametersReference
];

/// Embedded Go structs (`json:",inline"`), as (proto field name, message name): their
/// fields are written into the parent object.
const INLINE: &[(&str, &str)] = &[
    ("volumeSource", "VolumeSource"),                     // core Volume
    ("persistentVolumeSource", "PersistentVolumeSource"), // core PersistentVolumeSpec
    ("handler", "ProbeHandler"),                          // core Probe
    ("ephemeralContainerCommon", "EphemeralContainerCommon"), // core EphemeralContainer
    ("localObjectReference", "LocalObjectReference"),     // core *KeySelector, *EnvSource, …
    ("ingressRuleValue", "IngressRuleValue"),             // networking IngressRule
    ("ruleWithOperations", "RuleWithOperations"),         // admissionregistration
    ("rule", "Rule"),                                     // admissionregistration
    ("deviceConfiguration", "DeviceConfiguration"),       // resource Device*Configuration
];

const META: &str = "k8s.io.apimachinery.pkg.apis.meta.v1";
const TIME: &str = "k8s.io.apimachinery.pkg.apis.meta.v1.Time";
const MICRO_TIME: &str = "k8s.io.apimachinery.pkg.apis.meta.v1.MicroTime";
const DURATION: &str = "k8s.io.apimachinery.pkg.apis.meta.v1.Duration";
const FIELDS_V1: &str = "k8s.io.apimachinery.pkg.apis.meta.v1.FieldsV1";
const VERBS: &str = "k8s.io.apimachinery.pkg.apis.meta.v1.Verbs";
const QUANTITY: &str = "k8s.io.apimachinery.pkg.api.resource.Quantity";
const INT_OR_STRING: &str = "k8s.io.apimachinery.pkg.util.intstr.IntOrString";
const RAW_EXTENSION: &str = "k8s.io.apimachinery.pkg.runtime.RawExtension";
const UNKNOWN: &str = "k8s.io.apimachinery.pkg.runtime.Unknown";

/// Reads a protobuf request body into the object's Kubernetes JSON, with its
/// `apiVersion` and `kind`. A malformed body is a 400; a kind without a built-in schema
/// (custom resources) is a 415, as those are sent as JSON.
pub fn decode(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let schema = SCHEMA
        .as_ref()
        .map_err(|e| ApiError::internal(format!("loading the protobuf descriptors: {e}")))?;
    Converter { schema, nested: 0 }.envelope(body)
}

/// The descriptors and what the conversion looks up in them, built on first use.
static SCHEMA: LazyLock<Result<Schema, String>> = LazyLock::new(Schema::load);

struct Schema {
    pool: DescriptorPool,
    unknown: MessageDescriptor,
    /// Full names of the Go value (non-pointer) fields.
    value_fields: HashSet<String>,
}

impl Schema {
    fn load() -> Result<Self, String> {
        let pool = DescriptorPool::decode(DESCRIPTORS).map_err(|e| e.to_string())?;
        let value_fields = pool
            .all_messages()
            .flat_map(|m| m.fields().collect::<Vec<_>>())
            .filter(is_value_field)
            .map(|f| f.full_name().to_owned())
            .collect();
        let unknown = pool
            .get_message_by_name(UNKNOWN)
            .ok_or_else(|| format!("{UNKNOWN} is missing"))?;
        Ok(Schema {
            pool,
            unknown,
            value_fields,
        })
    }

    /// The message of a built-in kind: `apps/v1 Deployment` is
    /// `k8s.io.api.apps.v1.Deployment`; the meta.k8s.io options kinds (DeleteOptions, …)
    /// are accepted under any group. Only groups Kubernetes owns are looked up, so that
    /// a custom `apps.example.com` never reads as `apps`.
    fn message_for(&self, api_version: &str, kind: &str) -> Option<MessageDescriptor> {
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        if kind.is_empty() || version.is_empty() {
            return None;
        }
        let package = match group {
            "" => "k8s.io.api.core".to_owned(),
            "meta.k8s.io" => "k8s.io.apimachinery.pkg.apis.meta".to_owned(),
            "internal.apiserver.k8s.io" => "k8s.io.api.apiserverinternal".to_owned(),
            g if !g.contains('.') || g.ends_with(".k8s.io") => {
                format!("k8s.io.api.{}", g.split('.').next().unwrap_or(g))
            }
            _ => return None,
        };
        self.pool
            .get_message_by_name(&format!("{package}.{version}.{kind}"))
            .or_else(|| {
                (kind.ends_with("Options") || kind == "Status")
                    .then(|| self.pool.get_message_by_name(&format!("{META}.{kind}")))
                    .flatten()
            })
    }
}

/// Whether the field carries `(gogoproto.nullable) = false`.
fn is_value_field(field: &FieldDescriptor) -> bool {
    field.options().unknown_fields().any(|option| {
        let mut encoded = Vec::new();
        option.encode(&mut encoded);
        option.number() == GOGO_NULLABLE && encoded.last() == Some(&0)
    })
}

fn bad_body(detail: impl std::fmt::Display) -> ApiError {
    ApiError::bad_request(format!("error decoding the protobuf body: {detail}"))
}

/// One conversion; counts the envelopes it is inside of.
struct Converter<'s> {
    schema: &'s Schema,
    nested: usize,
}

impl Converter<'_> {
    /// `k8s\0` + `runtime.Unknown` → the object, with apiVersion and kind.
    fn envelope(&mut self, body: &[u8]) -> Result<Map<String, Value>, ApiError> {
        let raw = body
            .strip_prefix(MAGIC)
            .ok_or_else(|| bad_body("it does not start with the k8s\\0 prefix"))?;
        let unknown = DynamicMessage::decode(self.schema.unknown.clone(), raw)
            .map_err(|e| bad_body(format!("runtime.Unknown: {e}")))?;
        self.unknown(&unknown)
    }

    /// A decoded `runtime.Unknown`: its raw object with the type it names.
    fn unknown(&mut self, unknown: &DynamicMessage) -> Result<Map<String, Value>, ApiError> {
        let encoding = string_field(unknown, "contentEncoding");
        if !encoding.is_empty() {
            return Err(bad_body(format!(
                "unsupported contentEncoding {encoding:?}"
            )));
        }
        let content_type = string_field(unknown, "contentType");
        if !content_type.is_empty() && content_type != CONTENT_TYPE {
            return Err(bad_body(format!(
                "unsupported contentType {content_type:?}"
            )));
        }
        let (api_version, kind) = match unknown.get_field_by_name("typeMeta").as_deref() {
            Some(ProtoValue::Message(m)) => {
                (string_field(m, "apiVersion"), string_field(m, "kind"))
            }
            _ => Default::default(),
        };
        let desc = self
            .schema
            .message_for(&api_version, &kind)
            .ok_or_else(|| {
                ApiError::new(
                    415,
                    Reason::UnsupportedMediaType,
                    format!(
                        "no protobuf schema for {api_version:?} {kind:?}: send it as application/json"
                    ),
                )
            })?;
        let object = DynamicMessage::decode(desc, bytes_field(unknown, "raw").as_slice())
            .map_err(|e| bad_body(format!("{api_version} {kind}: {e}")))?;
        let mut out = Map::new();
        out.insert("apiVersion".into(), api_version.into());
        out.insert("kind".into(), kind.into());
        self.fields(&object, &mut out)?;
        Ok(out)
    }

    /// Writes the message's fields into `out`, as Go's encoding/json would.
    fn fields(
        &mut self,
        msg: &DynamicMessage,
        out: &mut Map<String, Value>,
    ) -> Result<(), ApiError> {
        for (field, value) in msg.fields() {
            if let (ProtoValue::Message(inner), Kind::Message(desc)) = (value, field.kind())
                && INLINE.contains(&(field.name(), desc.name()))
            {
                self.fields(inner, out)?;
                continue;
            }
            let json = match value {
                ProtoValue::List(items) => Some(Value::Array(
                    items
                        .iter()
                        .map(|v| Ok(self.single(&field.kind(), v)?.unwrap_or(Value::Null)))
                        .collect::<Result<_, ApiError>>()?,
                )),
                ProtoValue::Map(entries) => {
                    let value_kind = match field.kind() {
                        Kind::Message(entry) => entry.map_entry_value_field().kind(),
                        other => other,
                    };
                    let mut map = Map::new();
                    for (k, v) in entries {
                        let v = self.single(&value_kind, v)?.unwrap_or(Value::Null);
                        map.insert(map_key(k), v);
                    }
                    Some(Value::Object(map))
                }
                single => self.single(&field.kind(), single)?,
            };
            let Some(json) = json else { continue };
            if self.schema.value_fields.contains(field.full_name()) && is_zero(&json) {
                continue;
            }
            out.insert(json_name(&field).to_owned(), json);
        }
        Ok(())
    }

    /// One value; `None` for the zero value of a type Go writes as `null`.
    fn single(&mut self, kind: &Kind, value: &ProtoValue) -> Result<Option<Value>, ApiError> {
        Ok(Some(match value {
            ProtoValue::Bool(b) => Value::Bool(*b),
            ProtoValue::I32(n) => Value::from(*n),
            ProtoValue::I64(n) => Value::from(*n),
            ProtoValue::U32(n) => Value::from(*n),
            ProtoValue::U64(n) => Value::from(*n),
            ProtoValue::F32(n) => float(f64::from(*n))?,
            ProtoValue::F64(n) => float(*n)?,
            ProtoValue::String(s) => Value::String(s.clone()),
            ProtoValue::Bytes(b) => base64::engine::general_purpose::STANDARD.encode(b).into(),
            ProtoValue::EnumNumber(n) => match kind {
                Kind::Enum(e) => match e.get_value(*n) {
                    Some(v) => v.name().into(),
                    None => Value::from(*n),
                },
                _ => Value::from(*n),
            },
            ProtoValue::Message(m) => return self.message(m),
            ProtoValue::List(_) | ProtoValue::Map(_) => {
                return Err(bad_body("a list or map inside a list or map"));
            }
        }))
    }

    /// A message: the special Kubernetes types in their JSON form, others as objects.
    fn message(&mut self, msg: &DynamicMessage) -> Result<Option<Value>, ApiError> {
        let desc = msg.descriptor();
        match desc.full_name() {
            TIME => time(msg, false),
            MICRO_TIME => time(msg, true),
            DURATION => Ok(Some(go_duration(int_field(msg, "duration")).into())),
            QUANTITY => {
                let q = string_field(msg, "string");
                Ok((!q.is_empty()).then(|| q.into()))
            }
            INT_OR_STRING => match int_field(msg, "type") {
                0 => Ok(Some(int_field(msg, "intVal").into())),
                1 => Ok(Some(string_field(msg, "strVal").into())),
                t => Err(bad_body(format!("IntOrString of unknown type {t}"))),
            },
            RAW_EXTENSION => self.raw_json(&bytes_field(msg, "raw")),
            FIELDS_V1 => self.raw_json(&bytes_field(msg, "Raw")),
            UNKNOWN => self
                .nested(|c| c.unknown(msg))
                .map(|o| Some(Value::Object(o))),
            name if name == VERBS || desc.name() == "ExtraValue" => {
                match msg.get_field_by_name("items").as_deref() {
                    Some(ProtoValue::List(items)) => Ok(Some(Value::Array(
                        items
                            .iter()
                            .map(|v| match v {
                                ProtoValue::String(s) => Value::String(s.clone()),
                                _ => Value::Null,
                            })
                            .collect(),
                    ))),
                    _ => Ok(Some(Value::Array(Vec::new()))),
                }
            }
            _ => {
                let mut out = Map::new();
                self.fields(msg, &mut out)?;
                Ok(Some(Value::Object(out)))
            }
        }
    }

    /// Embedded raw bytes: JSON as is, or a nested protobuf envelope decoded.
    fn raw_json(&mut self, raw: &[u8]) -> Result<Option<Value>, ApiError> {
        if raw.is_empty() {
            return Ok(None);
        }
        if raw.starts_with(MAGIC) {
            return self
                .nested(|c| c.envelope(raw))
                .map(|o| Some(Value::Object(o)));
        }
        serde_json::from_slice(raw)
            .map(Some)
            .map_err(|e| bad_body(format!("embedded JSON: {e}")))
    }

    fn nested<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        if self.nested >= MAX_NESTED_ENVELOPES {
            return Err(bad_body("envelopes nested too deep"));
        }
        self.nested += 1;
        let result = f(self);
        self.nested -= 1;
        result
    }
}

fn json_name(field: &FieldDescriptor) -> &str {
    let name = field.name();
    JSON_NAMES
        .iter()
        .find(|(proto, _)| *proto == name)
        .map_or(name, |(_, json)| json)
}

/// Go's zero values, which a value field leaves out.
fn is_zero(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

fn map_key(k: &MapKey) -> String {
    match k {
        MapKey::String(s) => s.clone(),
        MapKey::Bool(b) => b.to_string(),
        MapKey::I32(n) => n.to_string(),
        MapKey::I64(n) => n.to_string(),
        MapKey::U32(n) => n.to_string(),
        MapKey::U64(n) => n.to_string(),
    }
}

fn float(n: f64) -> Result<Value, ApiError> {
    Number::from_f64(n)
        .map(Value::Number)
        .ok_or_else(|| bad_body(format!("{n} is not a JSON number")))
}

fn int_field(msg: &DynamicMessage, name: &str) -> i64 {
    match msg.get_field_by_name(name).as_deref() {
        Some(ProtoValue::I32(n)) => i64::from(*n),
        Some(ProtoValue::I64(n)) => *n,
        _ => 0,
    }
}

fn string_field(msg: &DynamicMessage, name: &str) -> String {
    match msg.get_field_by_name(name).as_deref() {
        Some(ProtoValue::String(s)) => s.clone(),
        _ => String::new(),
    }
}

fn bytes_field(msg: &DynamicMessage, name: &str) -> Vec<u8> {
    match msg.get_field_by_name(name).as_deref() {
        Some(ProtoValue::Bytes(b)) => b.to_vec(),
        _ => Vec::new(),
    }
}

/// `Time` as RFC 3339 in seconds, `MicroTime` in microseconds; an empty message is
/// Go's zero time, written as `null` (left out here).
fn time(msg: &DynamicMessage, micro: bool) -> Result<Option<Value>, ApiError> {
    if !msg.has_field_by_name("seconds") && !msg.has_field_by_name("nanos") {
        return Ok(None);
    }
    let seconds = int_field(msg, "seconds");
    // Time drops nanoseconds on decode, as apimachinery does; MicroTime keeps micros.
    let nanos = if micro {
        i32::try_from(int_field(msg, "nanos")).map_err(bad_body)? / 1000 * 1000
    } else {
        0
    };
    let ts = jiff::Timestamp::new(seconds, nanos).map_err(bad_body)?;
    let text = if micro {
        format!("{}.{:06}Z", ts.strftime("%Y-%m-%dT%H:%M:%S"), nanos / 1000)
    } else {
        ts.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
    };
    Ok(Some(text.into()))
}

/// A duration in nanoseconds as Go's `time.Duration.String` writes it: `1h0m0s`,
/// `1.5s`, `300ms`, `0s`.
fn go_duration(nanos: i64) -> String {
    /// `v / 10^prec` with the fraction's trailing zeros (and a bare point) dropped.
    fn decimal(v: u64, prec: u32) -> String {
        let unit = 10u64.pow(prec);
        let (int, frac) = (v / unit, v % unit);
        if frac == 0 {
            return int.to_string();
        }
        let digits = format!("{frac:0width$}", width = prec as usize);
        format!("{int}.{}", digits.trim_end_matches('0'))
    }
    let u = nanos.unsigned_abs();
    let text = match u {
        0 => "0s".to_owned(),
        1..1_000 => format!("{u}ns"),
        1_000..1_000_000 => format!("{}µs", decimal(u, 3)),
        1_000_000..1_000_000_000 => format!("{}ms", decimal(u, 6)),
        _ => {
            let whole = u / 1_000_000_000;
            let seconds = decimal(whole % 60 * 1_000_000_000 + u % 1_000_000_000, 9);
            let (minutes, hours) = (whole / 60 % 60, whole / 3600);
            if hours > 0 {
                format!("{hours}h{minutes}m{seconds}s")
            } else if minutes > 0 {
                format!("{minutes}m{seconds}s")
            } else {
                format!("{seconds}s")
            }
        }
    };
    if nanos < 0 { format!("-{text}") } else { text }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/testdata/protobuf");

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(format!("{FIXTURES}/{name}")).unwrap()
    }

    /// A message described by a JSON object with its proto field names; a `bytes`
    /// field takes a string or an array of byte values.
    fn message(desc: MessageDescriptor, fields: &Value) -> DynamicMessage {
        let mut msg = DynamicMessage::new(desc.clone());
        for (name, v) in fields.as_object().unwrap() {
            let field = desc
                .get_field_by_name(name)
                .unwrap_or_else(|| panic!("{name}"));
            let value = match field.kind() {
                Kind::Message(entry) if field.is_map() => {
                    let kind = entry.map_entry_value_field().kind();
                    let entries = v.as_object().unwrap().iter();
                    ProtoValue::Map(
                        entries
                            .map(|(k, v)| (MapKey::String(k.clone()), proto_value(&kind, v)))
                            .collect(),
                    )
                }
                kind if field.is_list() => ProtoValue::List(
                    v.as_array()
                        .unwrap()
                        .iter()
                        .map(|v| proto_value(&kind, v))
                        .collect(),
                ),
                kind => proto_value(&kind, v),
            };
            msg.set_field(&field, value);
        }
        msg
    }

    fn proto_value(kind: &Kind, v: &Value) -> ProtoValue {
        match (kind, v) {
            (Kind::Message(desc), v) => ProtoValue::Message(message(desc.clone(), v)),
            (Kind::String, Value::String(s)) => ProtoValue::String(s.clone()),
            (Kind::Bytes, Value::String(s)) => ProtoValue::Bytes(s.clone().into_bytes().into()),
            (Kind::Bytes, Value::Array(a)) => ProtoValue::Bytes(
                a.iter()
                    .map(|b| u8::try_from(b.as_u64().unwrap()).unwrap())
                    .collect::<Vec<u8>>()
                    .into(),
            ),
            (Kind::Bool, Value::Bool(b)) => ProtoValue::Bool(*b),
            (Kind::Int32, v) => ProtoValue::I32(i32::try_from(v.as_i64().unwrap()).unwrap()),
            (Kind::Int64, v) => ProtoValue::I64(v.as_i64().unwrap()),
            (kind, v) => panic!("{v} as {kind:?}"),
        }
    }

    /// The envelope kubectl would send for the object described by `fields`.
    fn envelope(api_version: &str, kind: &str, fields: Value) -> Vec<u8> {
        use prost_reflect::prost::Message as _;
        let schema = SCHEMA.as_ref().unwrap();
        let raw = message(schema.message_for(api_version, kind).unwrap(), &fields);
        let unknown = message(
            schema.unknown.clone(),
            &json!({
                "typeMeta": {"apiVersion": api_version, "kind": kind},
                "raw": raw.encode_to_vec(),
            }),
        );
        [MAGIC, &unknown.encode_to_vec()].concat()
    }

    /// What kubectl's JSON for the same object means: Go writes zero structs as `{}`
    /// and zero times as `null`, both of which mean unset.
    fn without_empty(v: Value) -> Option<Value> {
        match v {
            Value::Null => None,
            Value::Object(o) => {
                let o: Map<String, Value> = o
                    .into_iter()
                    .filter_map(|(k, v)| without_empty(v).map(|v| (k, v)))
                    .collect();
                (!o.is_empty()).then_some(Value::Object(o))
            }
            Value::Array(a) => Some(Value::Array(
                a.into_iter()
                    .map(|v| without_empty(v).unwrap_or(json!({})))
                    .collect(),
            )),
            other => Some(other),
        }
    }

    /// Every `NAME.pb` kubectl sent matches `NAME.json`, what
    /// `kubectl create … --dry-run=client -o json` prints for the same command. Status
    /// is left out of the comparison: create ignores it, and Go writes the zero
    /// counters of a PodDisruptionBudget's status (`json:"currentHealthy"`, no omitempty).
    #[test]
    fn reads_what_kubectl_create_sends_as_kubectl_writes_it_in_json() {
        let mut checked = 0;
        for entry in std::fs::read_dir(FIXTURES).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "pb") {
                continue;
            }
            let golden = path.with_extension("json");
            if !golden.exists() {
                continue;
            }
            let mut decoded = decode(&std::fs::read(&path).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
            let mut expected: Map<String, Value> =
                serde_json::from_slice(&std::fs::read(&golden).unwrap()).unwrap();
            decoded.remove("status");
            expected.remove("status");
            assert_eq!(
                Value::Object(decoded),
                without_empty(Value::Object(expected)).unwrap(),
                "{}",
                path.display()
            );
            checked += 1;
        }
        assert!(checked >= 15, "only {checked} fixtures");
    }

    /// What kubectl sends passes the server's typed decode, defaults and validation,
    /// with `fieldValidation=Strict` as kubectl asks: no field has a wrong name.
    #[test]
    fn the_server_accepts_what_kubectl_create_sends() {
        let builtins = trellis_api::registry::builtins();
        let mut checked = 0;
        for entry in std::fs::read_dir(FIXTURES).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "pb") {
                continue;
            }
            let mut obj = decode(&std::fs::read(&path).unwrap()).unwrap();
            let Some(res) = builtins
                .iter()
                .find(|r| r.api_version() == obj["apiVersion"] && r.kind == obj["kind"])
            else {
                continue;
            };
            crate::registry::typed::default_and_validate_with(
                res,
                &mut obj,
                None,
                crate::registry::typed::UnknownFields::Strict,
            )
            .unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
            checked += 1;
        }
        assert!(checked >= 9, "only {checked} fixtures");
    }

    #[test]
    fn reads_a_configmap() {
        assert_eq!(
            Value::Object(decode(&fixture("configmap.pb")).unwrap()),
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": "b"}})
        );
    }

    #[test]
    fn writes_bytes_as_base64() {
        let cm = decode(&fixture("configmap-binary-data.pb")).unwrap();
        assert_eq!(cm["binaryData"], json!({"blob": "YmluAP8="}));
        assert_eq!(
            cm["data"],
            json!({"a": "b", "empty": ""}),
            "map values stay, even empty"
        );
        let secret = decode(&fixture("secret-generic.pb")).unwrap();
        assert_eq!(
            secret["data"],
            json!({"password": "aHVudGVyMg==", "user": "YWRtaW4="})
        );
    }

    #[test]
    fn keeps_explicit_zeros_of_pointer_fields_and_drops_zero_value_fields() {
        let d = decode(&fixture("deployment-zero-replicas.pb")).unwrap();
        assert_eq!(d["spec"]["replicas"], json!(0));
        let spec = d["spec"].as_object().unwrap();
        for unset in [
            "minReadySeconds",
            "paused",
            "strategy",
            "revisionHistoryLimit",
        ] {
            assert!(!spec.contains_key(unset), "{unset}");
        }
        let container = &d["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(container["ports"], json!([{"containerPort": 80}]));
        assert!(container.get("imagePullPolicy").is_none());
        assert!(d["metadata"].get("creationTimestamp").is_none());
        assert!(d.get("status").is_none());
    }

    #[test]
    fn reads_int_or_string_and_quantities() {
        let svc = decode(&fixture("service.pb")).unwrap();
        assert_eq!(svc["spec"]["ports"][0]["targetPort"], json!(8080));
        assert_eq!(svc["spec"]["ports"][1]["targetPort"], json!("https"));
        let pdb = decode(&fixture("poddisruptionbudget.pb")).unwrap();
        assert_eq!(pdb["spec"]["minAvailable"], json!("50%"));
        let quota = decode(&fixture("resourcequota.pb")).unwrap();
        assert_eq!(
            quota["spec"]["hard"],
            json!({"cpu": "1500m", "memory": "1Gi", "pods": "10"})
        );
    }

    #[test]
    fn reads_subresource_and_review_bodies() {
        assert_eq!(
            Value::Object(decode(&fixture("tokenrequest.pb")).unwrap()),
            json!({
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": 3600},
            })
        );
        assert_eq!(
            Value::Object(decode(&fixture("selfsubjectaccessreview.pb")).unwrap()),
            json!({
                "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": {"namespace": "default", "verb": "get", "resource": "pods"}},
            })
        );
    }

    #[test]
    fn merges_embedded_structs_into_their_parent() {
        let body = envelope(
            "v1",
            "Pod",
            json!({
                "metadata": {"name": "p"},
                "spec": {
                    "volumes": [{"name": "data", "volumeSource": {"emptyDir": {}}}],
                    "containers": [{
                        "name": "c", "image": "nginx",
                        "envFrom": [{"configMapRef": {"localObjectReference": {"name": "cm"}}}],
                        "readinessProbe": {
                            "handler": {"httpGet": {"path": "/", "port": {"type": 1, "strVal": "http"}}},
                            "periodSeconds": 5,
                        },
                    }],
                },
            }),
        );
        let pod = decode(&body).unwrap();
        assert_eq!(
            pod["spec"]["volumes"],
            json!([{"name": "data", "emptyDir": {}}])
        );
        let c = &pod["spec"]["containers"][0];
        assert_eq!(c["envFrom"], json!([{"configMapRef": {"name": "cm"}}]));
        assert_eq!(
            c["readinessProbe"],
            json!({"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 5})
        );
    }

    #[test]
    fn writes_times_as_rfc3339() {
        let body = envelope(
            "coordination.k8s.io/v1",
            "Lease",
            json!({
                "metadata": {"name": "l", "creationTimestamp": {"seconds": 1_700_000_000, "nanos": 5}},
                "spec": {
                    "holderIdentity": "a",
                    "acquireTime": {"seconds": 1_700_000_000, "nanos": 123_456_789},
                    "renewTime": {},
                },
            }),
        );
        let lease = decode(&body).unwrap();
        assert_eq!(
            lease["metadata"]["creationTimestamp"],
            json!("2023-11-14T22:13:20Z")
        );
        assert_eq!(
            lease["spec"],
            json!({"holderIdentity": "a", "acquireTime": "2023-11-14T22:13:20.123456Z"})
        );
    }

    #[test]
    fn embeds_raw_extensions_and_nested_envelopes() {
        let nested = envelope("v1", "ConfigMap", json!({"metadata": {"name": "inner"}}));
        let rev = decode(&envelope(
            "apps/v1",
            "ControllerRevision",
            json!({"metadata": {"name": "r1"}, "revision": 1, "data": {"raw": nested}}),
        ))
        .unwrap();
        assert_eq!(
            rev["data"],
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "inner"}})
        );
        let rev = decode(&envelope(
            "apps/v1",
            "ControllerRevision",
            json!({"metadata": {"name": "r2"}, "data": {"raw": r#"{"spec":{"x":1}}"#}}),
        ))
        .unwrap();
        assert_eq!(rev["data"], json!({"spec": {"x": 1}}));
    }

    #[test]
    fn renames_fields_whose_json_name_differs() {
        let body = envelope(
            "networking.k8s.io/v1",
            "IngressClass",
            json!({
                "metadata": {"name": "ic"},
                "spec": {
                    "controller": "x",
                    "parameters": {"aPIGroup": "k8s.example.com", "kind": "P", "name": "p"},
                },
            }),
        );
        let ic = decode(&body).unwrap();
        assert_eq!(
            ic["spec"]["parameters"],
            json!({"apiGroup": "k8s.example.com", "kind": "P", "name": "p"})
        );
    }

    #[test]
    fn writes_named_string_slices_as_arrays() {
        let body = envelope(
            "authorization.k8s.io/v1",
            "SubjectAccessReview",
            json!({"spec": {"user": "u", "extra": {"scopes": {"items": ["a", "b"]}}}}),
        );
        let sar = decode(&body).unwrap();
        assert_eq!(sar["spec"]["extra"], json!({"scopes": ["a", "b"]}));
    }

    #[test]
    fn reads_delete_options_under_any_group() {
        let body = envelope(
            "meta.k8s.io/v1",
            "DeleteOptions",
            json!({"gracePeriodSeconds": 0}),
        );
        assert_eq!(
            Value::Object(decode(&body).unwrap()),
            json!({"apiVersion": "meta.k8s.io/v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        );
        let schema = SCHEMA.as_ref().unwrap();
        assert!(schema.message_for("apps/v1", "DeleteOptions").is_some());
    }

    #[test]
    fn refuses_custom_kinds_and_malformed_bodies() {
        let schema = SCHEMA.as_ref().unwrap();
        assert!(
            schema
                .message_for("apps.example.com/v1", "Deployment")
                .is_none()
        );
        assert!(
            schema
                .message_for("stable.example.com/v1", "CronTab")
                .is_none()
        );
        let custom = [MAGIC, b"\x0a\x1e\x0a\x15stable.example.com/v1\x12\x05Thing"].concat();
        assert_eq!(decode(&custom).unwrap_err().code, 415);
        assert_eq!(decode(b"{\"kind\":\"Pod\"}").unwrap_err().code, 400);
        let truncated = fixture("deployment.pb");
        assert_eq!(
            decode(&truncated[..truncated.len() - 9]).unwrap_err().code,
            400
        );
    }

    #[test]
    fn bounds_nested_envelopes() {
        let mut body = envelope("v1", "ConfigMap", json!({}));
        for _ in 0..=MAX_NESTED_ENVELOPES {
            body = envelope(
                "apps/v1",
                "ControllerRevision",
                json!({"data": {"raw": body}}),
            );
        }
        assert!(decode(&body).unwrap_err().message.contains("too deep"));
    }

    #[test]
    fn writes_durations_as_go_does() {
        let cases = [
            (0, "0s"),
            (1, "1ns"),
            (1_500, "1.5µs"),
            (300_000_000, "300ms"),
            (1_500_000_000, "1.5s"),
            (61_000_000_000, "1m1s"),
            (3_600_000_000_000, "1h0m0s"),
            (-90_000_000_000, "-1m30s"),
        ];
        for (nanos, text) in cases {
            assert_eq!(go_duration(nanos), text);
        }
    }

    #[test]
    fn descriptors_cover_the_built_in_kinds() {
        let schema = SCHEMA.as_ref().unwrap();
        for (api_version, kind) in [
            ("v1", "Pod"),
            ("v1", "Namespace"),
            ("apps/v1", "StatefulSet"),
            ("batch/v1", "CronJob"),
            ("rbac.authorization.k8s.io/v1", "ClusterRole"),
            ("networking.k8s.io/v1", "NetworkPolicy"),
            ("policy/v1", "Eviction"),
            ("coordination.k8s.io/v1", "Lease"),
            ("internal.apiserver.k8s.io/v1alpha1", "StorageVersion"),
            ("flowcontrol.apiserver.k8s.io/v1", "FlowSchema"),
        ] {
            assert!(schema.message_for(api_version, kind).is_some(), "{kind}");
        }
        assert!(
            schema
                .value_fields
                .contains("k8s.io.api.apps.v1.DeploymentSpec.minReadySeconds")
        );
        assert!(
            !schema
                .value_fields
                .contains("k8s.io.api.apps.v1.DeploymentSpec.replicas")
        );
    }
}
