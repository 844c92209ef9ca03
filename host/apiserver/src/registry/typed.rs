//! Built-in kinds through their `k8s-openapi` types: a decode into the typed struct
//! checks every field's type and drops unknown fields (refused instead under
//! `fieldValidation=Strict`); then Kubernetes' defaults and the validation rules users
//! meet most (required fields, selector/template agreement, immutable fields) apply.

use base64::Engine;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};
use trellis_api::ApiError;
use trellis_api::registry::ResourceInfo;
use trellis_api::status::StatusCause;

use crate::object::{Object, metadata};

mod workloads;
pub use workloads::parse_schedule;

/// Fields outside the typed structs that Trellis keeps on every object.
const KEPT_METADATA: &[&str] = &["initializers"];

fn roundtrip<T: DeserializeOwned + Serialize>(obj: &Object) -> Result<Object, ApiError> {
    // Read from the map in place: a copy of the object per write was measurable.
    let typed = <T as serde::Deserialize>::deserialize(obj)
        .map_err(|e| ApiError::bad_request(format!("error decoding the object: {e}")))?;
    match serde_json::to_value(&typed) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) | Err(_) => Err(ApiError::internal("re-encoding a typed object failed")),
    }
}

/// Decodes `obj` through its typed struct, if the kind has one; `None` otherwise.
fn typed_roundtrip(res: &ResourceInfo, obj: &Object) -> Option<Result<Object, ApiError>> {
    use k8s_openapi::api::{
        apps, autoscaling, batch, certificates, coordination, core, discovery, node, policy, rbac,
        scheduling, storage,
    };
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1 as apiext;
    use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1 as apiregistration;
    Some(match (res.group.as_str(), res.plural.as_str()) {
        ("", "pods") => roundtrip::<core::v1::Pod>(obj),
        ("", "nodes") => roundtrip::<core::v1::Node>(obj),
        ("", "namespaces") => roundtrip::<core::v1::Namespace>(obj),
        ("", "configmaps") => roundtrip::<core::v1::ConfigMap>(obj),
        ("", "secrets") => roundtrip::<core::v1::Secret>(obj),
        ("", "services") => roundtrip::<core::v1::Service>(obj),
        ("", "endpoints") => roundtrip::<core::v1::Endpoints>(obj),
        ("", "events") => roundtrip::<core::v1::Event>(obj),
        ("", "serviceaccounts") => roundtrip::<core::v1::ServiceAccount>(obj),
        ("", "limitranges") => roundtrip::<core::v1::LimitRange>(obj),
        ("", "resourcequotas") => roundtrip::<core::v1::ResourceQuota>(obj),
        ("apps", "deployments") => roundtrip::<apps::v1::Deployment>(obj),
        ("apps", "replicasets") => roundtrip::<apps::v1::ReplicaSet>(obj),
        ("", "replicationcontrollers") => roundtrip::<core::v1::ReplicationController>(obj),
        ("", "persistentvolumeclaims") => roundtrip::<core::v1::PersistentVolumeClaim>(obj),
        ("", "persistentvolumes") => roundtrip::<core::v1::PersistentVolume>(obj),
        ("apps", "daemonsets") => roundtrip::<apps::v1::DaemonSet>(obj),
        ("apps", "statefulsets") => roundtrip::<apps::v1::StatefulSet>(obj),
        ("apps", "controllerrevisions") => roundtrip::<apps::v1::ControllerRevision>(obj),
        ("batch", "jobs") => roundtrip::<batch::v1::Job>(obj),
        ("batch", "cronjobs") => roundtrip::<batch::v1::CronJob>(obj),
        ("autoscaling", "horizontalpodautoscalers") if res.version == "v2" => {
            roundtrip::<autoscaling::v2::HorizontalPodAutoscaler>(obj)
        }
        ("storage.k8s.io", "storageclasses") => roundtrip::<storage::v1::StorageClass>(obj),
        ("apiregistration.k8s.io", "apiservices") => roundtrip::<apiregistration::APIService>(obj),
        ("coordination.k8s.io", "leases") => roundtrip::<coordination::v1::Lease>(obj),
        ("discovery.k8s.io", "endpointslices") => roundtrip::<discovery::v1::EndpointSlice>(obj),
        ("node.k8s.io", "runtimeclasses") => roundtrip::<node::v1::RuntimeClass>(obj),
        ("scheduling.k8s.io", "priorityclasses") => roundtrip::<scheduling::v1::PriorityClass>(obj),
        ("certificates.k8s.io", "certificatesigningrequests") => {
            roundtrip::<certificates::v1::CertificateSigningRequest>(obj)
        }
        ("policy", "poddisruptionbudgets") => roundtrip::<policy::v1::PodDisruptionBudget>(obj),
        ("rbac.authorization.k8s.io", "roles") => roundtrip::<rbac::v1::Role>(obj),
        ("rbac.authorization.k8s.io", "clusterroles") => roundtrip::<rbac::v1::ClusterRole>(obj),
        ("rbac.authorization.k8s.io", "rolebindings") => roundtrip::<rbac::v1::RoleBinding>(obj),
        ("rbac.authorization.k8s.io", "clusterrolebindings") => {
            roundtrip::<rbac::v1::ClusterRoleBinding>(obj)
        }
        ("apiextensions.k8s.io", "customresourcedefinitions") => {
            roundtrip::<apiext::CustomResourceDefinition>(obj)
        }
        _ => return None,
    })
}

/// Paths of fields present in `original` but dropped by the typed decode.
pub fn unknown_fields(original: &Value, decoded: &Value, path: &str, out: &mut Vec<String>) {
    match (original, decoded) {
        (Value::Object(a), Value::Object(b)) => unknown_fields_of_map(a, b, path, out),
        (Value::Array(a), Value::Array(b)) => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                unknown_fields(x, y, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// [`unknown_fields`] of two maps.
fn unknown_fields_of_map(
    original: &Map<String, Value>,
    decoded: &Map<String, Value>,
    path: &str,
    out: &mut Vec<String>,
) {
    for (k, v) in original {
        let p = if path.is_empty() {
            k.clone()
        } else {
            format!("{path}.{k}")
        };
        match decoded.get(k) {
            None if !v.is_null() => out.push(p),
            None => {}
            Some(d) => unknown_fields(v, d, &p, out),
        }
    }
}

/// The fields of `obj` its typed decode (`decoded`) dropped, but for those Trellis keeps.
/// `fieldValidation=Strict`'s refusal of unknown fields, in Kubernetes' wording.
pub fn strict_decoding_error(unknown: &[String]) -> ApiError {
    let list: Vec<String> = unknown
        .iter()
        .map(|f| format!("unknown field {f:?}"))
        .collect();
    ApiError::bad_request(format!("strict decoding error: {}", list.join(", ")))
}

fn dropped_fields(obj: &Object, decoded: &Object) -> Vec<String> {
    let mut unknown = Vec::new();
    unknown_fields_of_map(obj, decoded, "", &mut unknown);
    unknown.retain(|f| {
        !KEPT_METADATA
            .iter()
            .any(|k| f == &format!("metadata.{k}") || f.starts_with(&format!("metadata.{k}.")))
    });
    unknown
}

/// What a write does with the fields of a built-in object its type does not have (the
/// `fieldValidation` query parameter): drop them silently, drop them with a warning
/// each (Kubernetes' default), or refuse the write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnknownFields {
    Ignore,
    Warn,
    Strict,
}

/// Applies defaults and validation to a built-in object about to be stored. `old` is
/// the stored object for an update. Unknown fields are dropped silently.
pub fn default_and_validate(
    res: &ResourceInfo,
    obj: &mut Object,
    old: Option<&Object>,
) -> Result<(), ApiError> {
    default_and_validate_with(res, obj, old, UnknownFields::Ignore)
}

pub fn default_and_validate_with(
    res: &ResourceInfo,
    obj: &mut Object,
    old: Option<&Object>,
    unknown: UnknownFields,
) -> Result<(), ApiError> {
    if res.group.is_empty() && res.plural == "secrets" {
        fold_string_data(obj)?;
    }
    if let Some(decoded) = typed_roundtrip(res, obj) {
        let mut decoded = decoded?;
        match unknown {
            UnknownFields::Ignore => {}
            UnknownFields::Warn => {
                for f in dropped_fields(obj, &decoded) {
                    crate::warnings::add(format!("unknown field {f:?}"));
                }
            }
            UnknownFields::Strict => {
                let unknown = dropped_fields(obj, &decoded);
                if !unknown.is_empty() {
                    return Err(strict_decoding_error(&unknown));
                }
            }
        }
        if let Some(meta) = metadata(obj) {
            let kept: Vec<(String, Value)> = KEPT_METADATA
                .iter()
                .filter_map(|k| meta.get(*k).map(|v| ((*k).to_owned(), v.clone())))
                .collect();
            if let Some(Value::Object(m)) = decoded.get_mut("metadata") {
                m.extend(kept);
            }
        }
        // k8s-openapi fills a missing selector in with `{}`: take that back out, so that
        // validation refuses it as missing (Kubernetes' message), not as empty.
        if res.group == "apps"
            && str_field(obj, &["spec", "selector"]).is_none_or(Value::is_null)
            && let Some(Value::Object(spec)) = decoded.get_mut("spec")
        {
            spec.remove("selector");
        }
        *obj = decoded;
    }
    apply_defaults(res, obj, old);
    validate(res, obj, old)
}

fn fold_string_data(obj: &mut Object) -> Result<(), ApiError> {
    let Some(string_data) = obj.remove("stringData") else {
        return Ok(());
    };
    let Value::Object(entries) = string_data else {
        return Err(ApiError::bad_request("stringData must be a map of strings"));
    };
    let data = obj
        .entry("data")
        .or_insert_with(|| Value::Object(Map::new()));
    let Value::Object(data) = data else {
        return Err(ApiError::bad_request(
            "data must be a map of base64 strings",
        ));
    };
    for (k, v) in entries {
        let Value::String(s) = v else {
            return Err(ApiError::bad_request(format!(
                "stringData.{k} must be a string"
            )));
        };
        data.insert(
            k,
            base64::engine::general_purpose::STANDARD.encode(s).into(),
        );
    }
    Ok(())
}

fn set_default(map: &mut Map<String, Value>, key: &str, value: Value) {
    if map.get(key).is_none_or(Value::is_null) {
        map.insert(key.to_owned(), value);
    }
}

fn object_at<'a>(obj: &'a mut Object, key: &str) -> &'a mut Map<String, Value> {
    let entry = obj.entry(key).or_insert_with(|| Value::Object(Map::new()));
    if !entry.is_object() {
        *entry = Value::Object(Map::new());
    }
    entry
        .as_object_mut()
        .unwrap_or_else(|| unreachable!("made an object above"))
}

fn default_pod_spec(spec: &mut Map<String, Value>) {
    set_default(spec, "restartPolicy", json!("Always"));
    set_default(spec, "terminationGracePeriodSeconds", json!(30));
    set_default(spec, "dnsPolicy", json!("ClusterFirst"));
    set_default(spec, "schedulerName", json!("default-scheduler"));
    set_default(spec, "securityContext", json!({}));
    set_default(spec, "enableServiceLinks", json!(true));
    for list in ["containers", "initContainers"] {
        if let Some(Value::Array(containers)) = spec.get_mut(list) {
            for c in containers.iter_mut().filter_map(Value::as_object_mut) {
                if c.contains_key("resources") {
                    crate::admission::limit_ranger::default_requests_from_limits(c);
                }
                let image = c.get("image").and_then(Value::as_str).unwrap_or("");
                let last = image.rsplit('/').next().unwrap_or("");
                let pull =
                    if !last.contains(':') && !image.contains('@') || image.ends_with(":latest") {
                        "Always"
                    } else {
                        "IfNotPresent"
                    };
                set_default(c, "imagePullPolicy", json!(pull));
                set_default(c, "terminationMessagePath", json!("/dev/termination-log"));
                set_default(c, "terminationMessagePolicy", json!("File"));
                set_default(c, "resources", json!({}));
            }
        }
    }
}

fn default_template(obj: &mut Object) {
    let spec = object_at(obj, "spec");
    if let Some(Value::Object(template)) = spec.get_mut("template")
        && let Some(Value::Object(pod_spec)) = template.get_mut("spec")
    {
        default_pod_spec(pod_spec);
    }
}

fn apply_defaults(res: &ResourceInfo, obj: &mut Object, old: Option<&Object>) {
    let create = old.is_none();
    match (res.group.as_str(), res.plural.as_str()) {
        ("", "pods") => {
            default_pod_spec(object_at(obj, "spec"));
            if create {
                set_default(object_at(obj, "status"), "phase", json!("Pending"));
            }
        }
        ("", "namespaces") => {
            // Kubernetes labels every namespace with its own name, for selectors.
            if let Some(name) = crate::object::name(obj).map(str::to_owned) {
                let labels = object_at(crate::object::metadata_mut(obj), "labels");
                labels.insert("kubernetes.io/metadata.name".into(), name.into());
            }
            set_default(object_at(obj, "spec"), "finalizers", json!(["kubernetes"]));
            if create {
                set_default(object_at(obj, "status"), "phase", json!("Active"));
            }
        }
        ("", "secrets") => set_default(obj, "type", json!("Opaque")),
        ("", "limitranges") => crate::admission::limit_ranger::default_limit_range(obj),
        ("", "services") => crate::registry::service::validation::default(obj, old),
        ("apps", "deployments") => {
            let spec = object_at(obj, "spec");
            set_default(spec, "replicas", json!(1));
            set_default(spec, "revisionHistoryLimit", json!(10));
            set_default(spec, "progressDeadlineSeconds", json!(600));
            // Field by field, as Kubernetes: a partial strategy gets the rest filled in.
            let strategy = object_at(spec, "strategy");
            set_default(strategy, "type", json!("RollingUpdate"));
            if strategy.get("type") == Some(&json!("RollingUpdate")) {
                let rolling = object_at(strategy, "rollingUpdate");
                set_default(rolling, "maxUnavailable", json!("25%"));
                set_default(rolling, "maxSurge", json!("25%"));
            }
            default_template(obj);
        }
        ("apps", "replicasets") => {
            set_default(object_at(obj, "spec"), "replicas", json!(1));
            default_template(obj);
        }
        ("", "replicationcontrollers") => {
            // As Kubernetes: the selector, and the object's labels when it has none,
            // come from the template's labels.
            let labels = str_field(obj, &["spec", "template", "metadata", "labels"])
                .filter(|l| l.as_object().is_some_and(|m| !m.is_empty()))
                .cloned();
            let spec = object_at(obj, "spec");
            set_default(spec, "replicas", json!(1));
            if let Some(labels) = &labels {
                if spec
                    .get("selector")
                    .and_then(Value::as_object)
                    .is_none_or(Map::is_empty)
                {
                    spec.insert("selector".into(), labels.clone());
                }
                let meta = crate::object::metadata_mut(obj);
                if meta
                    .get("labels")
                    .and_then(Value::as_object)
                    .is_none_or(Map::is_empty)
                {
                    meta.insert("labels".into(), labels.clone());
                }
            }
            default_template(obj);
        }
        ("autoscaling", "horizontalpodautoscalers") => {
            crate::registry::autoscaling::default_v2(obj)
        }
        _ => {
            workloads::defaults(res, obj, old);
        }
    }
}

/// The most data a ConfigMap or Secret holds: Kubernetes' `MaxSecretSize`, 1 MiB.
const MAX_DATA_BYTES: usize = 1 << 20;

/// The bytes of the values of map `field`; `base64` values count decoded.
fn data_size(obj: &Object, field: &str, base64: bool) -> usize {
    use base64::Engine as _;
    obj.get(field)
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .filter_map(|(_, v)| v.as_str())
        .map(|v| {
            if base64 {
                base64::engine::general_purpose::STANDARD
                    .decode(v)
                    .map_or(v.len(), |d| d.len())
            } else {
                v.len()
            }
        })
        .sum()
}

fn too_long(field: &str, size: usize) -> StatusCause {
    StatusCause::new(
        "FieldValueTooLong",
        field,
        format!("Too long: must have at most {MAX_DATA_BYTES} bytes (has {size})"),
    )
}

fn str_field<'a>(obj: &'a Object, path: &[&str]) -> Option<&'a Value> {
    let (first, rest) = path.split_first()?;
    rest.iter().try_fold(obj.get(*first)?, |cur, p| cur.get(p))
}

fn validate(res: &ResourceInfo, obj: &Object, old: Option<&Object>) -> Result<(), ApiError> {
    let mut causes = crate::object::validate_owner_references(obj);
    match (res.group.as_str(), res.plural.as_str()) {
        ("", "configmaps") => {
            validate_keys(obj, "data", &mut causes);
            validate_keys(obj, "binaryData", &mut causes);
            if let (Some(data), Some(binary)) = (
                obj.get("data").and_then(Value::as_object),
                obj.get("binaryData").and_then(Value::as_object),
            ) {
                for key in data.keys().filter(|k| binary.contains_key(*k)) {
                    causes.push(StatusCause::invalid(
                        format!("data[{key}]"),
                        key,
                        "duplicate of key present in binaryData",
                    ));
                }
            }
            // As Kubernetes: the values of data and binaryData together.
            let size = data_size(obj, "data", false) + data_size(obj, "binaryData", true);
            if size > MAX_DATA_BYTES {
                causes.push(too_long("", size));
            }
        }
        ("", "secrets") => {
            validate_keys(obj, "data", &mut causes);
            let size = data_size(obj, "data", true);
            if size > MAX_DATA_BYTES {
                causes.push(too_long("data", size));
            }
        }
        ("", "pods") => validate_pod_spec(str_field(obj, &["spec"]), "spec", &mut causes),
        ("", "services") => crate::registry::service::validation::validate(obj, old, &mut causes),
        ("apps", kind @ ("deployments" | "replicasets")) => {
            validate_apps(kind == "deployments", obj, old, &mut causes)
        }
        ("", "replicationcontrollers") => validate_replication_controller(obj, &mut causes),
        ("certificates.k8s.io", "certificatesigningrequests") => {
            crate::registry::certificates::validate(obj, &mut causes)
        }
        ("", plural @ ("limitranges" | "resourcequotas")) => {
            crate::admission::limit_ranger::validate(plural, obj, &mut causes)
        }
        ("autoscaling", "horizontalpodautoscalers") => {
            causes.extend(crate::registry::autoscaling::validate_v2(obj))
        }
        _ => {
            workloads::validate(res, obj, old, &mut causes);
        }
    }
    if causes.is_empty() {
        return Ok(());
    }
    let name = crate::object::name(obj).unwrap_or_default();
    Err(ApiError::invalid(&res.group, &res.kind, name, causes))
}

/// `Invalid value` with the value as it is already rendered.
fn invalid_shown(field: impl Into<String>, shown: &str, detail: &str) -> StatusCause {
    StatusCause::new(
        "FieldValueInvalid",
        field,
        format!("Invalid value: {shown}: {detail}"),
    )
}

/// `Invalid value` with the value as JSON: numbers bare, strings quoted.
fn invalid_json(field: impl Into<String>, value: &Value, detail: &str) -> StatusCause {
    invalid_shown(field, &value.to_string(), detail)
}

/// The integer `spec.<key>`, if set; a cause if it is negative.
fn nonnegative(obj: &Object, key: &str, causes: &mut Vec<StatusCause>) -> Option<i64> {
    let value = str_field(obj, &["spec", key])?;
    let n = value.as_i64()?;
    if n < 0 {
        causes.push(invalid_json(
            format!("spec.{key}"),
            value,
            "must be greater than or equal to 0",
        ));
    }
    Some(n)
}

/// Labels as Kubernetes' messages show them (Go's rendering of a map, keys sorted).
fn go_labels(labels: Option<&Value>) -> String {
    let Some(map) = labels.and_then(Value::as_object) else {
        return "map[string]string(nil)".to_owned();
    };
    let mut entries: Vec<String> = map
        .iter()
        .map(|(k, v)| format!("{}:{v}", Value::from(k.as_str())))
        .collect();
    entries.sort();
    format!("map[string]string{{{}}}", entries.join(", "))
}

/// `v` without null or empty members, so that an absent list or map equals an empty
/// one, as Kubernetes' semantic comparison has it.
fn without_empty(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, v)| (k.clone(), without_empty(v)))
                .filter(|(_, v)| {
                    !(v.is_null()
                        || v.as_object().is_some_and(Map::is_empty)
                        || v.as_array().is_some_and(Vec::is_empty))
                })
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(without_empty).collect()),
        other => other.clone(),
    }
}

/// Checks `spec.selector` entry by entry, one cause per bad key, value or operator;
/// returns the selector when it is usable for matching.
fn check_selector(
    sel: &Value,
    causes: &mut Vec<StatusCause>,
) -> Option<trellis_api::selector::LabelSelector> {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1 as metav1;
    use trellis_api::selector::{LabelOp, LabelSelector, Requirement, SelectorError};
    let Ok(parsed) = serde_json::from_value::<metav1::LabelSelector>(sel.clone()) else {
        causes.push(invalid_json("spec.selector", sel, "invalid label selector"));
        return None;
    };
    // Key and each value checked alone, so that each bad one gets its own cause.
    let bad_key = |key: &str| match Requirement::new(key, LabelOp::Exists, [""; 0]) {
        Err(SelectorError::InvalidKey { reason, .. }) => Some(reason),
        _ => None,
    };
    let bad_value = |value: &str| match Requirement::new("k", LabelOp::Equals, [value]) {
        Err(SelectorError::InvalidValue { reason, .. }) => Some(reason),
        _ => None,
    };
    let before = causes.len();
    for (key, value) in parsed.match_labels.iter().flatten() {
        if let Some(reason) = bad_key(key) {
            causes.push(StatusCause::invalid(
                "spec.selector.matchLabels",
                key,
                reason,
            ));
        }
        if let Some(reason) = bad_value(value) {
            causes.push(StatusCause::invalid(
                "spec.selector.matchLabels",
                value,
                reason,
            ));
        }
    }
    for (i, expr) in parsed.match_expressions.iter().flatten().enumerate() {
        let path = format!("spec.selector.matchExpressions[{i}]");
        let values = expr.values.as_deref().unwrap_or_default();
        match expr.operator.as_str() {
            "In" | "NotIn" if values.is_empty() => causes.push(
                StatusCause::required(format!("{path}.values")).with_message(
                    "Required value: must be specified when `operator` is 'In' or 'NotIn'",
                ),
            ),
            "Exists" | "DoesNotExist" if !values.is_empty() => causes.push(StatusCause::forbidden(
                format!("{path}.values"),
                "may not be specified when `operator` is 'Exists' or 'DoesNotExist'",
            )),
            "In" | "NotIn" | "Exists" | "DoesNotExist" => {}
            other => causes.push(StatusCause::invalid(
                format!("{path}.operator"),
                other,
                "not a valid selector operator",
            )),
        }
        if let Some(reason) = bad_key(&expr.key) {
            causes.push(StatusCause::invalid(
                format!("{path}.key"),
                &expr.key,
                reason,
            ));
        }
        for (j, value) in values.iter().enumerate() {
            if let Some(reason) = bad_value(value) {
                causes.push(StatusCause::invalid(
                    format!("{path}.values[{j}]"),
                    value,
                    reason,
                ));
            }
        }
    }
    if causes.len() > before {
        return None;
    }
    match LabelSelector::from_k8s(&parsed) {
        Ok(s) => Some(s),
        Err(e) => {
            causes.push(invalid_json("spec.selector", sel, &e.to_string()));
            None
        }
    }
}

const PERCENT_FORMAT: &str = "a valid percent string must be a numeric string followed by an \
     ending '%' (e.g. '1%',  or '93%', regex used for validation is '[0-9]+%')";

/// `rollingUpdate.<key>`, an int >= 0 or a percentage: the number it gives (0 when
/// absent or unreadable, as Kubernetes reads it) and whether it is a percentage.
fn int_or_percent(rolling: &Value, key: &str, causes: &mut Vec<StatusCause>) -> (i64, bool) {
    let field = format!("spec.strategy.rollingUpdate.{key}");
    match rolling.get(key) {
        Some(v @ Value::Number(n)) => {
            let n = n.as_i64().unwrap_or(0);
            if n < 0 {
                causes.push(invalid_json(field, v, "must be greater than or equal to 0"));
            }
            (n, false)
        }
        Some(v @ Value::String(s)) => {
            let digits = s
                .strip_suffix('%')
                .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()));
            match digits {
                Some(d) => (d.parse().unwrap_or(i64::MAX), true),
                None => {
                    causes.push(invalid_json(field, v, PERCENT_FORMAT));
                    (s.parse().unwrap_or(0), false)
                }
            }
        }
        _ => (0, false),
    }
}

fn validate_strategy(strategy: Option<&Value>, causes: &mut Vec<StatusCause>) {
    let kind = strategy
        .and_then(|s| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("");
    let rolling = strategy
        .and_then(|s| s.get("rollingUpdate"))
        .filter(|r| !r.is_null());
    match (kind, rolling) {
        ("Recreate", None) => {}
        ("Recreate", Some(_)) => causes.push(StatusCause::forbidden(
            "spec.strategy.rollingUpdate",
            "may not be specified when strategy `type` is 'Recreate'",
        )),
        // Defaulting fills it in; only a broken default gets here.
        ("RollingUpdate", None) => {
            causes.push(StatusCause::required("spec.strategy.rollingUpdate"))
        }
        ("RollingUpdate", Some(rolling)) => {
            let (unavailable, percent) = int_or_percent(rolling, "maxUnavailable", causes);
            let (surge, _) = int_or_percent(rolling, "maxSurge", causes);
            let field = "spec.strategy.rollingUpdate.maxUnavailable";
            let shown = rolling.get("maxUnavailable").cloned().unwrap_or(json!(0));
            // Nothing could ever be replaced: no pod may go and none may be added.
            if unavailable == 0 && surge == 0 {
                causes.push(invalid_json(
                    field,
                    &shown,
                    "may not be 0 when `maxSurge` is 0",
                ));
            }
            if percent && unavailable > 100 {
                causes.push(invalid_json(field, &shown, "must not be greater than 100%"));
            }
        }
        (other, _) => causes.push(StatusCause::new(
            "FieldValueNotSupported",
            "spec.strategy.type",
            format!(
                "Unsupported value: {other:?}: supported values: \"Recreate\", \"RollingUpdate\""
            ),
        )),
    }
}

/// A `v1` ReplicationController's spec, defaults applied, as Kubernetes validates
/// it: a selector of labels (which may change, unlike a ReplicaSet's) that the
/// template's labels fit, and a valid pod template.
fn validate_replication_controller(obj: &Object, causes: &mut Vec<StatusCause>) {
    nonnegative(obj, "replicas", causes);
    nonnegative(obj, "minReadySeconds", causes);
    let selector = str_field(obj, &["spec", "selector"])
        .and_then(Value::as_object)
        .filter(|m| !m.is_empty());
    let Some(selector) = selector else {
        causes.push(StatusCause::required("spec.selector"));
        return;
    };
    let labels = str_field(obj, &["spec", "template", "metadata", "labels"]);
    let fits = selector
        .iter()
        .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v));
    if str_field(obj, &["spec", "template"]).is_none_or(Value::is_null) {
        causes.push(StatusCause::required("spec.template"));
        return;
    }
    if !fits {
        causes.push(invalid_shown(
            "spec.template.metadata.labels",
            &go_labels(labels),
            "`selector` does not match template `labels`",
        ));
    }
    validate_pod_spec(
        str_field(obj, &["spec", "template", "spec"]),
        "spec.template.spec",
        causes,
    );
}

/// An `apps/v1` Deployment's or ReplicaSet's spec, defaults applied, as Kubernetes
/// validates it; `old` is the stored object on update.
fn validate_apps(
    deployment: bool,
    obj: &Object,
    old: Option<&Object>,
    causes: &mut Vec<StatusCause>,
) {
    nonnegative(obj, "replicas", causes);
    // Whether the template's labels fit the selector; None when that cannot be told.
    let fits = match str_field(obj, &["spec", "selector"]) {
        // Kubernetes then matches against a selector of nothing, so both causes show.
        None | Some(Value::Null) => {
            causes.push(StatusCause::required("spec.selector"));
            Some(false)
        }
        Some(sel) => {
            let usable = check_selector(sel, causes);
            let terms = ["matchLabels", "matchExpressions"]
                .iter()
                .filter_map(|k| sel.get(k))
                .map(|v| v.as_object().map_or(0, Map::len) + v.as_array().map_or(0, Vec::len))
                .sum::<usize>();
            if terms == 0 {
                causes.push(invalid_json(
                    "spec.selector",
                    sel,
                    "empty selector is invalid for deployment",
                ));
            }
            usable.map(|s| {
                let template = str_field(obj, &["spec", "template"]).cloned();
                s.is_empty() || template.is_some_and(|t| s.matches_object(&t))
            })
        }
    };
    if fits == Some(false) {
        causes.push(invalid_shown(
            "spec.template.metadata.labels",
            &go_labels(str_field(obj, &["spec", "template", "metadata", "labels"])),
            "`selector` does not match template `labels`",
        ));
    }
    validate_pod_spec(
        str_field(obj, &["spec", "template", "spec"]),
        "spec.template.spec",
        causes,
    );
    if deployment {
        validate_strategy(str_field(obj, &["spec", "strategy"]), causes);
    }
    let min_ready = nonnegative(obj, "minReadySeconds", causes).unwrap_or(0);
    if deployment {
        nonnegative(obj, "revisionHistoryLimit", causes);
        if let Some(deadline) = nonnegative(obj, "progressDeadlineSeconds", causes)
            && deadline <= min_ready
        {
            causes.push(invalid_json(
                "spec.progressDeadlineSeconds",
                &json!(deadline),
                "must be greater than minReadySeconds",
            ));
        }
    }
    if let (Some(old), Some(sel)) = (old, str_field(obj, &["spec", "selector"]))
        && !sel.is_null()
    {
        let was = old.get("spec").and_then(|s| s.get("selector"));
        if was.map(without_empty) != Some(without_empty(sel)) {
            causes.push(invalid_json("spec.selector", sel, "field is immutable"));
        }
    }
}

/// The keys of a ConfigMap's or Secret's `field`, as Kubernetes checks them: 1-253 of
/// `[-._a-zA-Z0-9]`, and not `.` or `..`.
fn validate_keys(obj: &Object, field: &str, causes: &mut Vec<StatusCause>) {
    let Some(map) = obj.get(field).and_then(Value::as_object) else {
        return;
    };
    for key in map.keys() {
        let chars_ok = key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        let detail = if key.is_empty() || key.len() > 253 {
            Some("must be no more than 253 characters and not empty")
        } else if key == "." || key == ".." {
            Some("must not be '.' or '..'")
        } else if key.starts_with("..") {
            // Reserved by the kubelet's atomic writer for its own files.
            Some("must not start with '..'")
        } else if !chars_ok {
            Some(
                "a valid config key must consist of alphanumeric characters, '-', '_' or '.' \
                 (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation \
                 is '[-._a-zA-Z0-9]+')",
            )
        } else {
            None
        };
        if let Some(detail) = detail {
            causes.push(StatusCause::invalid(format!("{field}[{key}]"), key, detail));
        }
    }
}

fn validate_pod_spec(spec: Option<&Value>, path: &str, causes: &mut Vec<StatusCause>) {
    let containers = spec
        .and_then(|s| s.get("containers"))
        .and_then(Value::as_array);
    match containers {
        None => causes.push(StatusCause::required(format!("{path}.containers"))),
        Some(list) if list.is_empty() => {
            causes.push(StatusCause::required(format!("{path}.containers")))
        }
        Some(list) => {
            let mut names = std::collections::HashSet::new();
            for (i, c) in list.iter().enumerate() {
                let name = c.get("name").and_then(Value::as_str).unwrap_or("");
                if name.is_empty() {
                    causes.push(StatusCause::required(format!(
                        "{path}.containers[{i}].name"
                    )));
                } else if !names.insert(name) {
                    causes.push(StatusCause::new(
                        "FieldValueDuplicate",
                        format!("{path}.containers[{i}].name"),
                        format!("Duplicate value: {name:?}"),
                    ));
                }
                if c.get("image")
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty)
                {
                    causes.push(StatusCause::required(format!(
                        "{path}.containers[{i}].image"
                    )));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(plural: &str) -> ResourceInfo {
        trellis_api::registry::builtins()
            .into_iter()
            .find(|r| r.plural == plural)
            .unwrap()
    }

    fn obj(v: Value) -> Object {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn pods_get_kubernetes_defaults() {
        let mut pod = obj(
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "image": "nginx"}, {"name": "d", "image": "nginx:1.25"}]}}),
        );
        default_and_validate(&res("pods"), &mut pod, None).unwrap();
        assert_eq!(pod["spec"]["restartPolicy"], "Always");
        assert_eq!(pod["spec"]["schedulerName"], "default-scheduler");
        assert_eq!(pod["spec"]["terminationGracePeriodSeconds"], 30);
        assert_eq!(pod["spec"]["containers"][0]["imagePullPolicy"], "Always");
        assert_eq!(
            pod["spec"]["containers"][1]["imagePullPolicy"],
            "IfNotPresent"
        );
        assert_eq!(pod["status"]["phase"], "Pending");
    }

    #[test]
    fn pods_without_containers_are_invalid_with_one_cause_per_field() {
        let mut pod = obj(
            json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": ""}, {"name": "x", "image": "i"}, {"name": "x", "image": "i"}]}}),
        );
        let e = default_and_validate(&res("pods"), &mut pod, None).unwrap_err();
        assert_eq!(e.code, 422);
        let fields: Vec<String> = e
            .details
            .unwrap()
            .causes
            .into_iter()
            .map(|c| c.field)
            .collect();
        assert_eq!(
            fields,
            [
                "spec.containers[0].name",
                "spec.containers[0].image",
                "spec.containers[2].name"
            ]
        );
    }

    #[test]
    fn wrong_types_are_bad_requests_and_unknown_fields_are_dropped_or_refused() {
        let mut bad = obj(json!({"metadata": {"name": "c"}, "data": {"k": 5}}));
        let e = default_and_validate(&res("configmaps"), &mut bad, None).unwrap_err();
        assert_eq!(e.code, 400, "{e:?}");
        let mut extra = obj(
            json!({"metadata": {"name": "c", "initializers": {"pending": [{"name": "x"}]}}, "data": {"k": "v"}, "bogus": 1}),
        );
        let mut strict = extra.clone();
        default_and_validate(&res("configmaps"), &mut extra, None).unwrap();
        assert!(extra.get("bogus").is_none());
        assert_eq!(
            extra["metadata"]["initializers"]["pending"][0]["name"], "x",
            "initializers survive"
        );
        let e =
            default_and_validate_with(&res("configmaps"), &mut strict, None, UnknownFields::Strict)
                .unwrap_err();
        assert!(
            e.message.contains("unknown field \"bogus\""),
            "{}",
            e.message
        );
    }

    #[test]
    fn deployments_default_and_check_selector() {
        let mut d = obj(json!({"metadata": {"name": "web"}, "spec": {
            "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "c", "image": "nginx"}]}}}}));
        default_and_validate(&res("deployments"), &mut d, None).unwrap();
        assert_eq!(d["spec"]["replicas"], 1);
        assert_eq!(d["spec"]["strategy"]["rollingUpdate"]["maxSurge"], "25%");
        assert_eq!(d["spec"]["revisionHistoryLimit"], 10);
        let old = d.clone();
        let mut changed = d.clone();
        changed["spec"]["selector"] = json!({"matchLabels": {"app": "other"}});
        changed["spec"]["template"]["metadata"]["labels"] = json!({"app": "other"});
        let e = default_and_validate(&res("deployments"), &mut changed, Some(&old)).unwrap_err();
        assert!(e.message.contains("field is immutable"), "{}", e.message);
        let mut mismatch = old.clone();
        mismatch["spec"]["template"]["metadata"]["labels"] = json!({"app": "nope"});
        let e = default_and_validate(&res("deployments"), &mut mismatch, None).unwrap_err();
        assert!(
            e.message.contains("does not match template"),
            "{}",
            e.message
        );
    }

    /// The fields of the causes `v` as a `plural` gets refused with, or `[]` if stored.
    fn causes_of(plural: &str, v: Value, old: Option<&Object>) -> (Vec<String>, String) {
        match default_and_validate(&res(plural), &mut obj(v), old) {
            Ok(()) => (Vec::new(), String::new()),
            Err(e) => {
                assert_eq!(e.code, 422, "{e:?}");
                let fields = e.details.unwrap().causes.into_iter().map(|c| c.field);
                (fields.collect(), e.message)
            }
        }
    }

    fn web(edit: impl FnOnce(&mut Value)) -> Value {
        let mut v = json!({"metadata": {"name": "web"}, "spec": {
            "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web", "tier": "fe"}},
                "spec": {"containers": [{"name": "c", "image": "nginx"}]}}}});
        edit(&mut v);
        v
    }

    #[test]
    fn deployments_and_replicasets_refuse_invalid_specs_one_cause_per_field() {
        let cases: Vec<(&str, Value, &[&str], &str)> = vec![
            (
                "deployments",
                web(|v| {
                    v["spec"]["replicas"] = json!(-1);
                    v["spec"]["minReadySeconds"] = json!(-2);
                    v["spec"]["revisionHistoryLimit"] = json!(-1);
                }),
                &[
                    "spec.replicas",
                    "spec.minReadySeconds",
                    "spec.revisionHistoryLimit",
                ],
                "spec.replicas: Invalid value: -1: must be greater than or equal to 0",
            ),
            (
                "deployments",
                web(|v| {
                    v["spec"]["minReadySeconds"] = json!(10);
                    v["spec"]["progressDeadlineSeconds"] = json!(10);
                }),
                &["spec.progressDeadlineSeconds"],
                "must be greater than minReadySeconds",
            ),
            (
                "deployments",
                web(|v| v["spec"]["selector"] = json!({})),
                &["spec.selector"],
                "empty selector is invalid for deployment",
            ),
            (
                "deployments",
                web(|v| {
                    v["spec"].as_object_mut().unwrap().remove("selector");
                }),
                &["spec.selector", "spec.template.metadata.labels"],
                "spec.selector: Required value",
            ),
            (
                "deployments",
                web(|v| {
                    v["spec"]["selector"] = json!({"matchExpressions": [
                        {"key": "a", "operator": "Near"},
                        {"key": "b", "operator": "In"},
                        {"key": "c", "operator": "Exists", "values": ["x"]},
                        {"key": "bad key", "operator": "NotIn", "values": ["ok", "bad value"]}]});
                }),
                &[
                    "spec.selector.matchExpressions[0].operator",
                    "spec.selector.matchExpressions[1].values",
                    "spec.selector.matchExpressions[2].values",
                    "spec.selector.matchExpressions[3].key",
                    "spec.selector.matchExpressions[3].values[1]",
                ],
                "Forbidden: may not be specified when `operator` is 'Exists' or 'DoesNotExist'",
            ),
            (
                "deployments",
                web(|v| v["spec"]["selector"] = json!({"matchLabels": {"app": "api"}})),
                &["spec.template.metadata.labels"],
                r#"Invalid value: map[string]string{"app":"web", "tier":"fe"}: `selector` does not match template `labels`"#,
            ),
            (
                "deployments",
                web(|v| {
                    v["spec"]["selector"] = json!({"matchExpressions": [
                        {"key": "tier", "operator": "NotIn", "values": ["fe"]}]});
                }),
                &["spec.template.metadata.labels"],
                "does not match",
            ),
            (
                "deployments",
                web(|v| v["spec"]["template"]["spec"]["containers"][0]["image"] = json!("")),
                &["spec.template.spec.containers[0].image"],
                "Required value",
            ),
            (
                "deployments",
                web(|v| v["spec"]["strategy"] = json!({"type": "BlueGreen"})),
                &["spec.strategy.type"],
                r#"Unsupported value: "BlueGreen": supported values: "Recreate", "RollingUpdate""#,
            ),
            (
                "deployments",
                web(|v| {
                    v["spec"]["strategy"] =
                        json!({"type": "Recreate", "rollingUpdate": {"maxSurge": 1}});
                }),
                &["spec.strategy.rollingUpdate"],
                "Forbidden: may not be specified when strategy `type` is 'Recreate'",
            ),
            (
                "deployments",
                web(|v| {
                    v["spec"]["strategy"] =
                        json!({"rollingUpdate": {"maxSurge": 0, "maxUnavailable": "0%"}});
                }),
                &["spec.strategy.rollingUpdate.maxUnavailable"],
                r#"Invalid value: "0%": may not be 0 when `maxSurge` is 0"#,
            ),
            (
                "deployments",
                web(|v| {
                    v["spec"]["strategy"] = json!({"type": "RollingUpdate",
                        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 0}});
                }),
                &["spec.strategy.rollingUpdate.maxUnavailable"],
                "spec.strategy.rollingUpdate.maxUnavailable: Invalid value: 0: may not be 0 when `maxSurge` is 0",
            ),
            (
                "deployments",
                web(|v| {
                    v["spec"]["strategy"] =
                        json!({"rollingUpdate": {"maxSurge": "lots", "maxUnavailable": "150%"}});
                }),
                &[
                    "spec.strategy.rollingUpdate.maxSurge",
                    "spec.strategy.rollingUpdate.maxUnavailable",
                ],
                "must not be greater than 100%",
            ),
            (
                "deployments",
                web(|v| v["spec"]["strategy"] = json!({"rollingUpdate": {"maxUnavailable": -1}})),
                &["spec.strategy.rollingUpdate.maxUnavailable"],
                "must be greater than or equal to 0",
            ),
            (
                "replicasets",
                web(|v| {
                    v["spec"]["replicas"] = json!(-3);
                    v["spec"]["minReadySeconds"] = json!(-1);
                    v["spec"]["selector"] = json!({"matchLabels": {"app": "api"}});
                }),
                &[
                    "spec.replicas",
                    "spec.template.metadata.labels",
                    "spec.minReadySeconds",
                ],
                "spec.minReadySeconds: Invalid value: -1",
            ),
            (
                "replicasets",
                web(|v| v["spec"]["selector"] = json!({})),
                &["spec.selector"],
                "empty selector is invalid for deployment",
            ),
            // Valid: a partial strategy is filled in; a selector expression that fits.
            (
                "deployments",
                web(|v| {
                    v["spec"]["strategy"] = json!({"rollingUpdate": {"maxSurge": 0}});
                    v["spec"]["selector"] = json!({"matchExpressions": [
                        {"key": "tier", "operator": "In", "values": ["fe", "be"]},
                        {"key": "canary", "operator": "DoesNotExist"}]});
                }),
                &[],
                "",
            ),
            (
                "deployments",
                web(|v| v["spec"]["strategy"] = json!({"type": "Recreate"})),
                &[],
                "",
            ),
            ("replicasets", web(|_| {}), &[], ""),
        ];
        for (i, (plural, v, fields, message)) in cases.into_iter().enumerate() {
            let (got, got_message) = causes_of(plural, v, None);
            assert_eq!(got, fields, "case {i}: {got_message}");
            assert!(
                got_message.contains(message),
                "case {i}: {got_message:?} lacks {message:?}"
            );
        }
        let mut partial = obj(web(|v| {
            v["spec"]["strategy"] = json!({"rollingUpdate": {"maxSurge": 0}})
        }));
        default_and_validate(&res("deployments"), &mut partial, None).unwrap();
        assert_eq!(
            partial["spec"]["strategy"],
            json!({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "25%"}})
        );
    }

    #[test]
    fn apps_selectors_are_immutable_on_update() {
        for plural in ["deployments", "replicasets"] {
            let mut old = obj(web(|_| {}));
            default_and_validate(&res(plural), &mut old, None).unwrap();
            let moved = web(|v| {
                v["spec"]["selector"] = json!({"matchLabels": {"tier": "fe"}});
            });
            let (fields, message) = causes_of(plural, moved, Some(&old));
            assert_eq!(fields, ["spec.selector"], "{plural}: {message}");
            assert!(
                message.contains(r#"spec.selector: Invalid value: {"matchLabels":{"tier":"fe"}}: field is immutable"#),
                "{message}"
            );
            // The same selector, spelt with an empty list, is no change.
            let same = web(|v| v["spec"]["selector"]["matchExpressions"] = json!([]));
            assert_eq!(causes_of(plural, same, Some(&old)).0, Vec::<String>::new());
            let scaled = web(|v| v["spec"]["replicas"] = json!(5));
            assert_eq!(
                causes_of(plural, scaled, Some(&old)).0,
                Vec::<String>::new()
            );
        }
    }

    #[test]
    fn replication_controllers_default_from_the_template_and_refuse_a_selector_it_misses() {
        let rc = |edit: fn(&mut Value)| {
            let mut v = json!({"metadata": {"name": "web"}, "spec": {
                "template": {"metadata": {"labels": {"app": "web"}},
                    "spec": {"containers": [{"name": "c", "image": "nginx"}]}}}});
            edit(&mut v);
            v
        };
        let mut defaulted = obj(rc(|_| {}));
        default_and_validate(&res("replicationcontrollers"), &mut defaulted, None).unwrap();
        assert_eq!(defaulted["spec"]["replicas"], 1);
        assert_eq!(defaulted["spec"]["selector"], json!({"app": "web"}));
        assert_eq!(defaulted["metadata"]["labels"], json!({"app": "web"}));
        // Labels of its own are kept.
        let mut labelled = obj(rc(|v| v["metadata"]["labels"] = json!({"team": "a"})));
        default_and_validate(&res("replicationcontrollers"), &mut labelled, None).unwrap();
        assert_eq!(labelled["metadata"]["labels"], json!({"team": "a"}));
        let cases: Vec<(Value, &[&str])> = vec![
            (
                rc(|v| v["spec"]["selector"] = json!({"app": "api"})),
                &["spec.template.metadata.labels"],
            ),
            (
                rc(|v| v["spec"]["replicas"] = json!(-1)),
                &["spec.replicas"],
            ),
            (
                rc(|v| v["spec"]["template"]["metadata"] = json!({})),
                &["spec.selector"],
            ),
        ];
        for (i, (v, fields)) in cases.into_iter().enumerate() {
            let (got, message) = causes_of("replicationcontrollers", v, None);
            assert_eq!(got, fields, "case {i}: {message}");
        }
    }

    #[test]
    fn secrets_fold_string_data() {
        let mut s = obj(json!({"metadata": {"name": "s"}, "stringData": {"user": "admin"}}));
        default_and_validate(&res("secrets"), &mut s, None).unwrap();
        assert_eq!(s["data"]["user"], "YWRtaW4=");
        assert!(s.get("stringData").is_none());
        assert_eq!(s["type"], "Opaque");
    }
}
