//! HorizontalPodAutoscalers: `autoscaling/v2`'s defaults and validation, as
//! Kubernetes' (`SetDefaults_HorizontalPodAutoscaler`, `ValidateHorizontalPodAutoscaler`),
//! and the conversion between `autoscaling/v1` and `v2`, the version they are stored at.
//!
//! `v1` has one metric, the CPU utilization target; what else a `v2` object holds
//! (other metrics, their current values, the conditions, the behavior) travels in the
//! `autoscaling.alpha.kubernetes.io/*` annotations of the `v1` form, as in Kubernetes,
//! so that an object read at `v1`, changed and written back loses none of it.

use serde_json::{Map, Value, json};
use trellis_api::status::StatusCause;

use crate::object::Object;

/// The annotations that carry, in the `v1` form, what only `v2` has a field for.
const METRICS: &str = "autoscaling.alpha.kubernetes.io/metrics";
const CURRENT_METRICS: &str = "autoscaling.alpha.kubernetes.io/current-metrics";
const CONDITIONS: &str = "autoscaling.alpha.kubernetes.io/conditions";
const BEHAVIOR: &str = "autoscaling.alpha.kubernetes.io/behavior";

/// Kubernetes' `DefaultCPUUtilization`: the target of an autoscaler with no metric.
const DEFAULT_CPU_UTILIZATION: i64 = 80;
/// The longest stabilization window and policy period allowed.
const MAX_STABILIZATION_SECONDS: i64 = 3600;
const MAX_PERIOD_SECONDS: i64 = 1800;

fn map_at<'a>(obj: &'a mut Map<String, Value>, key: &str) -> &'a mut Map<String, Value> {
    let entry = obj.entry(key).or_insert_with(|| json!({}));
    if !entry.is_object() {
        *entry = json!({});
    }
    match entry {
        Value::Object(m) => m,
        _ => unreachable!("just made an object"),
    }
}

/// `v2` defaults: one minimum replica, a CPU utilization target of 80 % when no
/// metric is named, and a behavior's unset rules from Kubernetes' defaults (a
/// scale-down window left unset: the controller's flag decides it).
pub fn default_v2(obj: &mut Object) {
    let spec = map_at(obj, "spec");
    if spec.get("minReplicas").is_none_or(Value::is_null) {
        spec.insert("minReplicas".into(), json!(1));
    }
    if spec
        .get("metrics")
        .and_then(Value::as_array)
        .is_none_or(|m| m.is_empty())
    {
        spec.insert(
            "metrics".into(),
            json!([{"type": "Resource", "resource": {"name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": DEFAULT_CPU_UTILIZATION}}}]),
        );
    }
    let Some(Value::Object(behavior)) = spec.get_mut("behavior") else {
        return;
    };
    for (direction, window, policies) in [
        (
            "scaleUp",
            Some(0),
            json!([{"type": "Pods", "value": 4, "periodSeconds": 15},
                   {"type": "Percent", "value": 100, "periodSeconds": 15}]),
        ),
        (
            "scaleDown",
            None,
            json!([{"type": "Percent", "value": 100, "periodSeconds": 15}]),
        ),
    ] {
        let rules = map_at(behavior, direction);
        if let Some(window) = window
            && rules
                .get("stabilizationWindowSeconds")
                .is_none_or(Value::is_null)
        {
            rules.insert("stabilizationWindowSeconds".into(), json!(window));
        }
        if rules.get("selectPolicy").is_none_or(Value::is_null) {
            rules.insert("selectPolicy".into(), json!("Max"));
        }
        if rules.get("policies").is_none_or(Value::is_null) {
            rules.insert("policies".into(), policies);
        }
    }
}

fn required(field: String, detail: &str) -> StatusCause {
    StatusCause::required(field).with_message(format!("Required value: {detail}"))
}

fn invalid(field: String, value: &Value, detail: &str) -> StatusCause {
    StatusCause::new(
        "FieldValueInvalid",
        field,
        format!("Invalid value: {value}: {detail}"),
    )
}

fn not_supported(field: String, value: &Value, supported: &[&str]) -> StatusCause {
    let supported: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
    StatusCause::new(
        "FieldValueNotSupported",
        field,
        format!(
            "Unsupported value: {value}: supported values: {}",
            supported.join(", ")
        ),
    )
}

/// A quantity's sign, `None` when it is not one.
fn quantity_sign(v: &Value) -> Option<i32> {
    let q = match v {
        Value::String(s) => trellis_api::quantity::Quantity::parse(s).ok()?,
        Value::Number(n) => trellis_api::quantity::Quantity::parse(&n.to_string()).ok()?,
        _ => return None,
    };
    Some(if q.is_zero() {
        0
    } else if q > trellis_api::quantity::Quantity::ZERO {
        1
    } else {
        -1
    })
}

/// `v2` validation, after defaults: one cause per field, Kubernetes' messages.
pub fn validate_v2(obj: &Object) -> Vec<StatusCause> {
    let mut causes = Vec::new();
    let spec = obj.get("spec").cloned().unwrap_or(Value::Null);
    let min = spec["minReplicas"].as_i64();
    if let Some(m) = min
        && m < 1
    {
        causes.push(invalid(
            "spec.minReplicas".into(),
            &spec["minReplicas"],
            "must be greater than or equal to 1",
        ));
    }
    let max = spec["maxReplicas"].as_i64().unwrap_or(0);
    if max < 1 {
        causes.push(invalid(
            "spec.maxReplicas".into(),
            &json!(max),
            "must be greater than 0",
        ));
    }
    if let Some(m) = min
        && max < m
    {
        causes.push(invalid(
            "spec.maxReplicas".into(),
            &json!(max),
            "must be greater than or equal to `minReplicas`",
        ));
    }
    let target = &spec["scaleTargetRef"];
    for key in ["kind", "name"] {
        let field = format!("spec.scaleTargetRef.{key}");
        match target[key].as_str() {
            None | Some("") => causes.push(StatusCause::required(field)),
            Some(v) if v.contains('/') || v.contains('%') || v == "." || v == ".." => {
                causes.push(invalid(
                    field,
                    &json!(v),
                    "may not contain '/' or '%' and may not be '.' or '..'",
                ))
            }
            Some(_) => {}
        }
    }
    for (i, metric) in spec["metrics"].as_array().into_iter().flatten().enumerate() {
        validate_metric(metric, &format!("spec.metrics[{i}]"), &mut causes);
    }
    let behavior = &spec["behavior"];
    if behavior.is_object() {
        for direction in ["scaleUp", "scaleDown"] {
            let rules = &behavior[direction];
            if rules.is_object() {
                validate_rules(rules, &format!("spec.behavior.{direction}"), &mut causes);
            }
        }
    }
    causes
}

const SOURCE_TYPES: &[&str] = &[
    "ContainerResource",
    "External",
    "Object",
    "Pods",
    "Resource",
];

fn validate_metric(metric: &Value, path: &str, causes: &mut Vec<StatusCause>) {
    let kind = metric["type"].as_str().unwrap_or_default();
    if kind.is_empty() {
        causes.push(required(
            format!("{path}.type"),
            "must specify a metric source type",
        ));
    } else if !SOURCE_TYPES.contains(&kind) {
        causes.push(not_supported(
            format!("{path}.type"),
            &metric["type"],
            SOURCE_TYPES,
        ));
    }
    let fields = [
        ("Object", "object"),
        ("Pods", "pods"),
        ("Resource", "resource"),
        ("External", "external"),
        ("ContainerResource", "containerResource"),
    ];
    let present: Vec<&str> = fields
        .iter()
        .map(|(_, f)| *f)
        .filter(|f| !metric[*f].is_null())
        .collect();
    if present.len() == 1 {
        let source = &metric[present[0]];
        let path = format!("{path}.{}", present[0]);
        match present[0] {
            "resource" | "containerResource" => {
                if source["name"].as_str().is_none_or(str::is_empty) {
                    causes.push(required(
                        format!("{path}.name"),
                        "must specify a resource name",
                    ));
                }
                if present[0] == "containerResource"
                    && source["container"].as_str().is_none_or(str::is_empty)
                {
                    causes.push(required(
                        format!("{path}.container"),
                        "must specify a container",
                    ));
                }
                let target = &source["target"];
                validate_target(target, &format!("{path}.target"), causes);
                if target["averageUtilization"].is_null() && target["averageValue"].is_null() {
                    causes.push(required(
                        format!("{path}.target.averageUtilization"),
                        "must set either a target raw value or a target utilization",
                    ));
                }
                if !target["averageUtilization"].is_null() && !target["averageValue"].is_null() {
                    causes.push(StatusCause::forbidden(
                        format!("{path}.target.averageValue"),
                        "may not set both a target raw value and a target utilization",
                    ));
                }
            }
            _ => {
                if source["metric"]["name"].as_str().is_none_or(str::is_empty) {
                    causes.push(required(
                        format!("{path}.metric.name"),
                        "must specify a metric name",
                    ));
                }
                if present[0] == "object" {
                    for key in ["kind", "name"] {
                        if source["describedObject"][key]
                            .as_str()
                            .is_none_or(str::is_empty)
                        {
                            causes.push(StatusCause::required(format!(
                                "{path}.describedObject.{key}"
                            )));
                        }
                    }
                }
                validate_target(&source["target"], &format!("{path}.target"), causes);
            }
        }
    }
    let expected = fields.iter().find(|(k, _)| *k == kind).map(|(_, f)| *f);
    if let Some(field) = expected
        && metric[field].is_null()
    {
        causes.push(required(
            format!("{path}.{field}"),
            "must populate information for the given metric source",
        ));
    }
    if present.len() > 1 {
        for field in present.iter().filter(|f| Some(**f) != expected) {
            causes.push(StatusCause::forbidden(
                format!("{path}.{field}"),
                "must populate the given metric source only",
            ));
        }
    }
}

fn validate_target(target: &Value, path: &str, causes: &mut Vec<StatusCause>) {
    match target["type"].as_str().unwrap_or_default() {
        "" => causes.push(required(
            format!("{path}.type"),
            "must specify a metric target type",
        )),
        "Utilization" | "Value" | "AverageValue" => {}
        _ => causes.push(invalid(
            format!("{path}.type"),
            &target["type"],
            "must be either Utilization, Value, or AverageValue",
        )),
    }
    for key in ["value", "averageValue"] {
        let v = &target[key];
        if !v.is_null() && quantity_sign(v) != Some(1) {
            causes.push(invalid(format!("{path}.{key}"), v, "must be positive"));
        }
    }
    if let Some(u) = target["averageUtilization"].as_i64()
        && u < 1
    {
        causes.push(invalid(
            format!("{path}.averageUtilization"),
            &json!(u),
            "must be greater than 0",
        ));
    }
}

fn validate_rules(rules: &Value, path: &str, causes: &mut Vec<StatusCause>) {
    if let Some(w) = rules["stabilizationWindowSeconds"].as_i64() {
        if w < 0 {
            causes.push(invalid(
                format!("{path}.stabilizationWindowSeconds"),
                &json!(w),
                "must be greater than or equal to zero",
            ));
        }
        if w > MAX_STABILIZATION_SECONDS {
            causes.push(invalid(
                format!("{path}.stabilizationWindowSeconds"),
                &json!(w),
                &format!("must be less than or equal to {MAX_STABILIZATION_SECONDS}"),
            ));
        }
    }
    let select = &rules["selectPolicy"];
    if let Some(s) = select.as_str()
        && !["Disabled", "Max", "Min"].contains(&s)
    {
        causes.push(not_supported(
            format!("{path}.selectPolicy"),
            select,
            &["Disabled", "Max", "Min"],
        ));
    }
    let policies = rules["policies"].as_array().cloned().unwrap_or_default();
    if policies.is_empty() {
        causes.push(required(
            format!("{path}.policies"),
            "must specify at least one Policy",
        ));
    }
    for (i, policy) in policies.iter().enumerate() {
        let path = format!("{path}.policies[{i}]");
        let kind = &policy["type"];
        if !matches!(kind.as_str(), Some("Pods" | "Percent")) {
            causes.push(not_supported(
                format!("{path}.type"),
                kind,
                &["Percent", "Pods"],
            ));
        }
        let value = policy["value"].as_i64().unwrap_or(0);
        if value <= 0 {
            causes.push(invalid(
                format!("{path}.value"),
                &json!(value),
                "must be greater than zero",
            ));
        }
        let period = policy["periodSeconds"].as_i64().unwrap_or(0);
        if period <= 0 {
            causes.push(invalid(
                format!("{path}.periodSeconds"),
                &json!(period),
                "must be greater than zero",
            ));
        }
        if period > MAX_PERIOD_SECONDS {
            causes.push(invalid(
                format!("{path}.periodSeconds"),
                &json!(period),
                &format!("must be less than or equal to {MAX_PERIOD_SECONDS}"),
            ));
        }
    }
}

/// Converts an autoscaler between the versions served (`v1`, `v2`); any other pair is
/// left as it is. `apiVersion` is set to the target's.
pub fn convert(obj: &Object, to: &str) -> Object {
    let from = obj.get("apiVersion").and_then(Value::as_str);
    match (from, to) {
        (Some("autoscaling/v1"), "v2") => v1_to_v2(obj),
        (Some("autoscaling/v2") | None, "v1") => v2_to_v1(obj),
        _ => obj.clone(),
    }
}

fn is_cpu_utilization(metric: &Value) -> bool {
    metric["type"] == "Resource"
        && metric["resource"]["name"] == "cpu"
        && !metric["resource"]["target"]["averageUtilization"].is_null()
}

/// Moves `from[key]` to `to[renamed]` when set.
fn carry(to: &mut Map<String, Value>, renamed: &str, from: &Value, key: &str) {
    if !from[key].is_null() {
        to.insert(renamed.into(), from[key].clone());
    }
}

/// A `v2` target in `v1`'s words: `target{Value,AverageValue,AverageUtilization}`
/// (or `current…` for a status).
fn v1_values(out: &mut Map<String, Value>, values: &Value, prefix: &str) {
    carry(out, &format!("{prefix}Value"), values, "value");
    carry(
        out,
        &format!("{prefix}AverageValue"),
        values,
        "averageValue",
    );
    carry(
        out,
        &format!("{prefix}AverageUtilization"),
        values,
        "averageUtilization",
    );
}

/// `v1`'s `target…` (or `current…`) fields as a `v2` target (with its type) or
/// current value.
fn v2_values(source: &Value, prefix: &str, target: bool) -> Value {
    let mut out = Map::new();
    carry(&mut out, "value", source, &format!("{prefix}Value"));
    carry(
        &mut out,
        "averageValue",
        source,
        &format!("{prefix}AverageValue"),
    );
    carry(
        &mut out,
        "averageUtilization",
        source,
        &format!("{prefix}AverageUtilization"),
    );
    if target {
        let kind = if out.contains_key("averageUtilization") {
            "Utilization"
        } else if out.contains_key("averageValue") {
            "AverageValue"
        } else {
            "Value"
        };
        out.insert("type".into(), json!(kind));
    }
    Value::Object(out)
}

/// One `v2` metric (spec, or status with `status`) in `v1`'s alpha form.
fn metric_to_v1(metric: &Value, status: bool) -> Value {
    let kind = metric["type"].as_str().unwrap_or_default();
    let (values_key, prefix) = if status {
        ("current", "current")
    } else {
        ("target", "target")
    };
    let mut out = Map::new();
    match kind {
        "Resource" | "ContainerResource" => {
            let field = if kind == "Resource" {
                "resource"
            } else {
                "containerResource"
            };
            let source = &metric[field];
            carry(&mut out, "name", source, "name");
            carry(&mut out, "container", source, "container");
            v1_values(&mut out, &source[values_key], prefix);
            // v1's resource status requires a current average value.
            if status && !out.contains_key("currentAverageValue") {
                out.insert("currentAverageValue".into(), json!("0"));
            }
            return json!({"type": kind, field: out});
        }
        "Pods" => {
            let source = &metric["pods"];
            carry(&mut out, "metricName", &source["metric"], "name");
            carry(&mut out, "selector", &source["metric"], "selector");
            v1_values(&mut out, &source[values_key], prefix);
            out.remove(&format!("{prefix}Value"));
        }
        "Object" => {
            let source = &metric["object"];
            carry(&mut out, "target", source, "describedObject");
            carry(&mut out, "metricName", &source["metric"], "name");
            carry(&mut out, "selector", &source["metric"], "selector");
            v1_values(&mut out, &source[values_key], prefix);
            if let Some(average) = out.remove(&format!("{prefix}AverageValue")) {
                out.insert("averageValue".into(), average);
            }
        }
        "External" => {
            let source = &metric["external"];
            carry(&mut out, "metricName", &source["metric"], "name");
            carry(&mut out, "metricSelector", &source["metric"], "selector");
            v1_values(&mut out, &source[values_key], prefix);
        }
        _ => return metric.clone(),
    }
    out.remove(&format!("{prefix}AverageUtilization"));
    json!({"type": kind, kind.to_lowercase(): out})
}

/// One `v1` alpha metric (spec, or status with `status`) in `v2`'s form.
fn metric_to_v2(metric: &Value, status: bool) -> Value {
    let kind = metric["type"].as_str().unwrap_or_default();
    let (values_key, prefix) = if status {
        ("current", "current")
    } else {
        ("target", "target")
    };
    let mut out = Map::new();
    match kind {
        "Resource" | "ContainerResource" => {
            let field = if kind == "Resource" {
                "resource"
            } else {
                "containerResource"
            };
            let source = &metric[field];
            carry(&mut out, "name", source, "name");
            carry(&mut out, "container", source, "container");
            out.insert(values_key.into(), v2_values(source, prefix, !status));
            return json!({"type": kind, field: out});
        }
        "Pods" | "External" => {
            let source = &metric[kind.to_lowercase()];
            let mut m = Map::new();
            carry(&mut m, "name", source, "metricName");
            carry(
                &mut m,
                "selector",
                source,
                if kind == "Pods" {
                    "selector"
                } else {
                    "metricSelector"
                },
            );
            out.insert("metric".into(), Value::Object(m));
            out.insert(values_key.into(), v2_values(source, prefix, !status));
        }
        "Object" => {
            let source = &metric["object"];
            let mut m = Map::new();
            carry(&mut m, "name", source, "metricName");
            carry(&mut m, "selector", source, "selector");
            carry(&mut out, "describedObject", source, "target");
            out.insert("metric".into(), Value::Object(m));
            let mut values = v2_values(source, prefix, !status);
            if !source["averageValue"].is_null() {
                values["averageValue"] = source["averageValue"].clone();
                if !status && values["value"].is_null() {
                    values["type"] = json!("AverageValue");
                }
            }
            out.insert(values_key.into(), values);
        }
        _ => return metric.clone(),
    }
    json!({"type": kind, kind.to_lowercase(): out})
}

fn annotations(obj: &mut Object) -> &mut Map<String, Value> {
    map_at(map_at(obj, "metadata"), "annotations")
}

/// The `v1` form of a `v2` autoscaler.
pub fn v2_to_v1(obj: &Object) -> Object {
    let mut out = obj.clone();
    out.insert("apiVersion".into(), json!("autoscaling/v1"));
    let spec = obj.get("spec").cloned().unwrap_or(Value::Null);
    let status = obj.get("status").cloned().unwrap_or(Value::Null);
    let metrics = spec["metrics"].as_array().cloned().unwrap_or_default();
    let current = status["currentMetrics"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let other: Vec<Value> = metrics
        .iter()
        .filter(|m| !is_cpu_utilization(m))
        .map(|m| metric_to_v1(m, false))
        .collect();
    let mut carried = Vec::new();
    if !other.is_empty() {
        carried.push((METRICS, Value::Array(other)));
    }
    if !current.is_empty() {
        let current: Vec<Value> = current.iter().map(|m| metric_to_v1(m, true)).collect();
        carried.push((CURRENT_METRICS, Value::Array(current)));
    }
    if !spec["behavior"].is_null() {
        carried.push((BEHAVIOR, spec["behavior"].clone()));
    }
    if let Some(conditions) = status["conditions"].as_array()
        && !conditions.is_empty()
    {
        carried.push((CONDITIONS, status["conditions"].clone()));
    }
    if !carried.is_empty() {
        let annotations = annotations(&mut out);
        for (key, value) in carried {
            annotations.insert(key.into(), json!(value.to_string()));
        }
    }
    let mut v1_spec = Map::new();
    for key in ["scaleTargetRef", "minReplicas", "maxReplicas"] {
        carry(&mut v1_spec, key, &spec, key);
    }
    if let Some(cpu) = metrics.iter().find(|m| is_cpu_utilization(m)) {
        v1_spec.insert(
            "targetCPUUtilizationPercentage".into(),
            cpu["resource"]["target"]["averageUtilization"].clone(),
        );
    }
    out.insert("spec".into(), Value::Object(v1_spec));
    if !status.is_null() {
        let mut v1_status = Map::new();
        for key in [
            "observedGeneration",
            "lastScaleTime",
            "currentReplicas",
            "desiredReplicas",
        ] {
            carry(&mut v1_status, key, &status, key);
        }
        if let Some(cpu) = current
            .iter()
            .find(|m| m["type"] == "Resource" && m["resource"]["name"] == "cpu")
        {
            carry(
                &mut v1_status,
                "currentCPUUtilizationPercentage",
                &cpu["resource"]["current"],
                "averageUtilization",
            );
        }
        out.insert("status".into(), Value::Object(v1_status));
    }
    out
}

/// The `v2` form of a `v1` autoscaler: the CPU target becomes a Resource metric after
/// those the annotations carry, which are taken off.
pub fn v1_to_v2(obj: &Object) -> Object {
    let mut out = obj.clone();
    out.insert("apiVersion".into(), json!("autoscaling/v2"));
    let spec = obj.get("spec").cloned().unwrap_or(Value::Null);
    let status = obj.get("status").cloned().unwrap_or(Value::Null);
    let mut carried = Map::new();
    if let Some(Value::Object(a)) = out
        .get_mut("metadata")
        .and_then(|m| m.get_mut("annotations"))
    {
        for key in [METRICS, CURRENT_METRICS, CONDITIONS, BEHAVIOR] {
            if let Some(v) = a.remove(key) {
                let parsed = v
                    .as_str()
                    .and_then(|s| serde_json::from_str(s).ok())
                    .unwrap_or(Value::Null);
                carried.insert(key.into(), parsed);
            }
        }
        if a.is_empty()
            && let Some(Value::Object(m)) = out.get_mut("metadata")
        {
            m.remove("annotations");
        }
    }
    let get = |key: &str| carried.get(key).cloned().unwrap_or(Value::Null);
    let mut metrics: Vec<Value> = get(METRICS)
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| metric_to_v2(m, false))
        .collect();
    if let Some(cpu) = spec["targetCPUUtilizationPercentage"].as_i64() {
        metrics.push(json!({"type": "Resource", "resource": {"name": "cpu",
            "target": {"type": "Utilization", "averageUtilization": cpu}}}));
    }
    let mut v2_spec = Map::new();
    for key in ["scaleTargetRef", "minReplicas", "maxReplicas"] {
        carry(&mut v2_spec, key, &spec, key);
    }
    if !metrics.is_empty() {
        v2_spec.insert("metrics".into(), Value::Array(metrics));
    }
    let behavior = get(BEHAVIOR);
    if !behavior.is_null() {
        v2_spec.insert("behavior".into(), behavior);
    }
    out.insert("spec".into(), Value::Object(v2_spec));
    if !status.is_null() {
        let mut v2_status = Map::new();
        for key in [
            "observedGeneration",
            "lastScaleTime",
            "currentReplicas",
            "desiredReplicas",
        ] {
            carry(&mut v2_status, key, &status, key);
        }
        let mut current: Vec<Value> = get(CURRENT_METRICS)
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| metric_to_v2(m, true))
            .collect();
        if current.is_empty()
            && let Some(cpu) = status["currentCPUUtilizationPercentage"].as_i64()
        {
            current.push(json!({"type": "Resource", "resource": {"name": "cpu",
                "current": {"averageUtilization": cpu}}}));
        }
        if !current.is_empty() {
            v2_status.insert("currentMetrics".into(), Value::Array(current));
        }
        let conditions = get(CONDITIONS);
        if conditions.is_array() {
            v2_status.insert("conditions".into(), conditions);
        }
        out.insert("status".into(), Value::Object(v2_status));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Object {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    fn fields(causes: &[StatusCause]) -> Vec<String> {
        causes
            .iter()
            .map(|c| format!("{}: {}", c.field, c.message))
            .collect()
    }

    fn web(spec: Value) -> Object {
        let mut spec = spec;
        spec["scaleTargetRef"] =
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": "web"});
        obj(
            json!({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "web", "namespace": "ns"}, "spec": spec}),
        )
    }

    #[test]
    fn v2_defaults_are_kubernetes() {
        let mut hpa = web(json!({"maxReplicas": 3}));
        default_v2(&mut hpa);
        assert_eq!(hpa["spec"]["minReplicas"], 1);
        assert_eq!(
            hpa["spec"]["metrics"][0]["resource"]["target"],
            json!({"type": "Utilization", "averageUtilization": 80})
        );
        assert!(hpa["spec"].get("behavior").is_none());
        let mut hpa =
            web(json!({"maxReplicas": 3, "behavior": {"scaleDown": {"selectPolicy": "Min"}}}));
        default_v2(&mut hpa);
        let behavior = &hpa["spec"]["behavior"];
        assert_eq!(behavior["scaleUp"]["stabilizationWindowSeconds"], 0);
        assert_eq!(behavior["scaleUp"]["policies"].as_array().unwrap().len(), 2);
        assert_eq!(behavior["scaleDown"]["selectPolicy"], "Min");
        assert!(
            behavior["scaleDown"]
                .get("stabilizationWindowSeconds")
                .is_none()
        );
        assert_eq!(
            behavior["scaleDown"]["policies"],
            json!([{"type": "Percent", "value": 100, "periodSeconds": 15}])
        );
    }

    #[test]
    fn v2_validation_names_each_field_as_kubernetes_does() {
        let mut hpa = web(json!({
            "minReplicas": 0, "maxReplicas": 0,
            "metrics": [
                {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 0}}},
                {"type": "Resource"},
                {"type": "Bogus"},
                {"type": "Pods", "resource": {"name": "cpu", "target": {"type": "AverageValue", "averageValue": "-1"}},
                 "pods": {"metric": {"name": "qps"}, "target": {"type": "AverageValue", "averageValue": "1"}}},
            ],
            "behavior": {"scaleUp": {"stabilizationWindowSeconds": 4000, "policies": []},
                         "scaleDown": {"policies": [{"type": "Nodes", "value": 0, "periodSeconds": 2000}]}},
        }));
        hpa["spec"]["scaleTargetRef"]["name"] = json!("");
        let got = fields(&validate_v2(&hpa));
        let want = [
            "spec.minReplicas: Invalid value: 0: must be greater than or equal to 1",
            "spec.maxReplicas: Invalid value: 0: must be greater than 0",
            "spec.scaleTargetRef.name: Required value",
            "spec.metrics[0].resource.target.averageUtilization: Invalid value: 0: must be greater than 0",
            "spec.metrics[1].resource: Required value: must populate information for the given metric source",
            "spec.metrics[2].type: Unsupported value: \"Bogus\": supported values: \"ContainerResource\", \"External\", \"Object\", \"Pods\", \"Resource\"",
            "spec.metrics[3].resource: Forbidden: must populate the given metric source only",
            "spec.behavior.scaleUp.stabilizationWindowSeconds: Invalid value: 4000: must be less than or equal to 3600",
            "spec.behavior.scaleUp.policies: Required value: must specify at least one Policy",
            "spec.behavior.scaleDown.policies[0].type: Unsupported value: \"Nodes\": supported values: \"Percent\", \"Pods\"",
            "spec.behavior.scaleDown.policies[0].value: Invalid value: 0: must be greater than zero",
            "spec.behavior.scaleDown.policies[0].periodSeconds: Invalid value: 2000: must be less than or equal to 1800",
        ];
        assert_eq!(got, want);
        let mut fine = web(json!({"maxReplicas": 3, "behavior": {}}));
        default_v2(&mut fine);
        assert_eq!(fields(&validate_v2(&fine)), Vec::<String>::new());
    }

    #[test]
    fn v1_round_trips_through_v2_keeping_what_only_v2_has() {
        let mut v2 = web(json!({
            "minReplicas": 2, "maxReplicas": 5,
            "metrics": [
                {"type": "Resource", "resource": {"name": "memory", "target": {"type": "AverageValue", "averageValue": "100Mi"}}},
                {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}}},
            ],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 5}},
        }));
        v2.insert(
            "status".into(),
            json!({"currentReplicas": 2, "desiredReplicas": 3, "lastScaleTime": "2026-11-28T10:00:00Z",
                "currentMetrics": [{"type": "Resource", "resource": {"name": "cpu", "current": {"averageUtilization": 70, "averageValue": "70m"}}}],
                "conditions": [{"type": "AbleToScale", "status": "True", "reason": "SucceededRescale"}]}),
        );
        let v1 = convert(&v2, "v1");
        assert_eq!(v1["apiVersion"], "autoscaling/v1");
        assert_eq!(
            v1["spec"],
            json!({"scaleTargetRef": v2["spec"]["scaleTargetRef"], "minReplicas": 2, "maxReplicas": 5,
                "targetCPUUtilizationPercentage": 50})
        );
        assert_eq!(
            v1["status"],
            json!({"currentReplicas": 2, "desiredReplicas": 3, "lastScaleTime": "2026-11-28T10:00:00Z",
                "currentCPUUtilizationPercentage": 70})
        );
        let carried: Value =
            serde_json::from_str(v1["metadata"]["annotations"][METRICS].as_str().unwrap()).unwrap();
        assert_eq!(
            carried,
            json!([{"type": "Resource", "resource": {"name": "memory", "targetAverageValue": "100Mi"}}])
        );
        let back = convert(&v1, "v2");
        assert_eq!(back["apiVersion"], "autoscaling/v2");
        assert_eq!(back["spec"], v2["spec"]);
        assert_eq!(back["status"], v2["status"]);
        assert!(back["metadata"].get("annotations").is_none());
        // kubectl 1.20's autoscale: a v1 object with only the CPU target.
        let v1 = obj(
            json!({"apiVersion": "autoscaling/v1", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "web"},
            "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "web"}, "maxReplicas": 3,
                "targetCPUUtilizationPercentage": 50}}),
        );
        let v2 = convert(&v1, "v2");
        assert_eq!(
            v2["spec"]["metrics"],
            json!([{"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}}}])
        );
    }
}
