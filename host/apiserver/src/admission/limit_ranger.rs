//! LimitRanger: built-in admission that applies a namespace's LimitRanges to the pods
//! created in it, and the rules LimitRange and ResourceQuota objects are held to.
//!
//! For each `type: Container` item of each LimitRange in the namespace, a new pod's
//! containers (init containers too) get the item's `defaultRequest` as requests and
//! its `default` as limits where they name none; then every container must keep
//! within `min` (requests and limits), `max` (limits and requests) and
//! `maxLimitRequestRatio`. A `type: Pod` item holds the pod's totals to the same
//! bounds. A refusal is 403 Forbidden with Kubernetes' wording, every violation
//! listed: `pods "web" is forbidden: maximum cpu usage per Container is 500m, but
//! limit is 1`.
//!
//! The LimitRanges are read through a [`Lister`]: from the watch cache, or from the
//! store while the cache has not yet seen a LimitRange written through this server.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::{Map, Value};
use trellis_api::ApiError;
use trellis_api::quantity::Quantity;
use trellis_api::registry::ResourceInfo;
use trellis_api::status::StatusCause;
use trellis_store::Store;

use crate::admission::chain::{Admission, Attributes};
use crate::object::Object;
use crate::storage::lister::Lister;
use crate::storage::watch_cache::WatchCache;

/// The LimitRanger admission step.
#[derive(Debug)]
pub struct LimitRanger {
    ranges: Lister,
}

impl Default for LimitRanger {
    fn default() -> Self {
        Self {
            ranges: Lister::new("", "limitranges"),
        }
    }
}

/// Requests and limits by resource name, as a container or a pod states them.
#[derive(Debug, Default)]
struct Resources {
    requests: Map<String, Value>,
    limits: Map<String, Value>,
}

fn quantity(list: &Map<String, Value>, name: &str) -> Option<Quantity> {
    list.get(name)
        .and_then(Value::as_str)
        .and_then(|v| Quantity::parse(v).ok())
}

/// A container's `resources`, created empty when missing.
fn resources_mut(container: &mut Map<String, Value>) -> &mut Map<String, Value> {
    let entry = container
        .entry("resources")
        .or_insert_with(|| Value::Object(Map::new()));
    if !entry.is_object() {
        *entry = Value::Object(Map::new());
    }
    entry
        .as_object_mut()
        .unwrap_or_else(|| unreachable!("made an object above"))
}

/// A limit without a request stands for the request, as Kubernetes defaults pods.
pub fn default_requests_from_limits(container: &mut Map<String, Value>) {
    let resources = resources_mut(container);
    let Some(Value::Object(limits)) = resources.get("limits").cloned() else {
        return;
    };
    let requests = resources
        .entry("requests")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Value::Object(requests) = requests {
        for (name, value) in limits {
            requests.entry(name).or_insert(value);
        }
    }
}

fn containers_mut(pod: &mut Object) -> impl Iterator<Item = &mut Map<String, Value>> {
    pod.get_mut("spec")
        .and_then(Value::as_object_mut)
        .into_iter()
        .flat_map(|spec| {
            spec.iter_mut()
                .filter(|(k, _)| *k == "containers" || *k == "initContainers")
                .filter_map(|(_, v)| v.as_array_mut())
                .flatten()
                .filter_map(Value::as_object_mut)
        })
}

fn container_resources(c: &Value) -> Resources {
    let part = |key: &str| {
        c.get("resources")
            .and_then(|r| r.get(key))
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default()
    };
    Resources {
        requests: part("requests"),
        limits: part("limits"),
    }
}

/// The pod's totals: requests summed over containers; a limit only when every
/// container states one.
fn pod_resources(pod: &Object) -> Resources {
    let containers: Vec<Resources> = pod
        .get("spec")
        .and_then(|s| s.get("containers"))
        .and_then(Value::as_array)
        .map(|cs| cs.iter().map(container_resources).collect())
        .unwrap_or_default();
    let mut out = Resources::default();
    let names: std::collections::BTreeSet<&String> = containers
        .iter()
        .flat_map(|c| c.requests.keys().chain(c.limits.keys()))
        .collect();
    for name in names {
        let sum = |pick: fn(&Resources) -> &Map<String, Value>, all: bool| {
            let mut total = Quantity::ZERO;
            for c in &containers {
                match quantity(pick(c), name) {
                    Some(q) => total = total.saturating_add(q),
                    None if all => return None,
                    None => {}
                }
            }
            Some(total)
        };
        if containers.iter().any(|c| c.requests.contains_key(name))
            && let Some(total) = sum(|c| &c.requests, false)
        {
            out.requests
                .insert(name.clone(), Value::String(total.to_string()));
        }
        if let Some(total) = sum(|c| &c.limits, true) {
            out.limits
                .insert(name.clone(), Value::String(total.to_string()));
        }
    }
    out
}

/// The violations of one LimitRange item by one container's or pod's resources.
fn check(item: &Value, scope: &str, r: &Resources, errors: &mut Vec<String>) {
    let bounds = |key: &str| {
        item.get(key)
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default()
    };
    for (name, bound) in &bounds("min") {
        let Some(min) = bound.as_str().and_then(|b| Quantity::parse(b).ok()) else {
            continue;
        };
        match (quantity(&r.requests, name), quantity(&r.limits, name)) {
            (None, _) => errors.push(format!(
                "minimum {name} usage per {scope} is {min}.  No request is specified"
            )),
            (Some(req), _) if req < min => errors.push(format!(
                "minimum {name} usage per {scope} is {min}, but request is {req}"
            )),
            (_, Some(lim)) if lim < min => errors.push(format!(
                "minimum {name} usage per {scope} is {min}, but limit is {lim}"
            )),
            _ => {}
        }
    }
    for (name, bound) in &bounds("max") {
        let Some(max) = bound.as_str().and_then(|b| Quantity::parse(b).ok()) else {
            continue;
        };
        match (quantity(&r.requests, name), quantity(&r.limits, name)) {
            (_, None) => errors.push(format!(
                "maximum {name} usage per {scope} is {max}.  No limit is specified"
            )),
            (_, Some(lim)) if lim > max => errors.push(format!(
                "maximum {name} usage per {scope} is {max}, but limit is {lim}"
            )),
            (Some(req), _) if req > max => errors.push(format!(
                "maximum {name} usage per {scope} is {max}, but request is {req}"
            )),
            _ => {}
        }
    }
    for (name, bound) in &bounds("maxLimitRequestRatio") {
        let Some(ratio) = bound.as_str().and_then(|b| Quantity::parse(b).ok()) else {
            continue;
        };
        let req = quantity(&r.requests, name).filter(|q| !q.is_zero());
        let lim = quantity(&r.limits, name).filter(|q| !q.is_zero());
        match (req, lim) {
            (None, _) => errors.push(format!(
                "{name} max limit to request ratio per {scope} is {ratio}, but no request is specified or request is 0"
            )),
            (_, None) => errors.push(format!(
                "{name} max limit to request ratio per {scope} is {ratio}, but no limit is specified or limit is 0"
            )),
            (Some(req), Some(lim)) => {
                let observed = lim.ratio(req).unwrap_or(0.0);
                if observed > ratio.ratio(Quantity::from_units(1)).unwrap_or(0.0) {
                    errors.push(format!(
                        "{name} max limit to request ratio per {scope} is {ratio}, but provided ratio is {observed:.6}"
                    ));
                }
            }
        }
    }
}

fn items_of_type<'a>(ranges: &'a [Arc<Object>], kind: &'a str) -> impl Iterator<Item = &'a Value> {
    ranges
        .iter()
        .filter_map(|r| r.get("spec")?.get("limits")?.as_array())
        .flatten()
        .filter(move |item| item.get("type").and_then(Value::as_str) == Some(kind))
}

impl LimitRanger {
    async fn ranges(&self, namespace: &str) -> Result<Vec<Arc<Object>>, ApiError> {
        self.ranges
            .list(namespace)
            .await
            .map_err(|e| ApiError::internal(format!("reading limit ranges: {e}")))
    }
}

fn applies(attrs: &Attributes<'_>) -> Option<String> {
    let pods = attrs.resource.group.is_empty() && attrs.resource.plural == "pods";
    (pods && attrs.operation == "CREATE" && attrs.subresource.is_none())
        .then(|| attrs.namespace.map(str::to_owned))
        .flatten()
}

#[async_trait]
impl Admission for LimitRanger {
    fn name(&self) -> &str {
        "LimitRanger"
    }

    fn init(&self, store: &Arc<dyn Store>, cache: &Arc<WatchCache>) {
        self.ranges.init(store, cache);
    }

    async fn written(&self, resource: &ResourceInfo, _verb: &str, _namespace: Option<&str>) {
        if self.ranges.lists(resource) {
            self.ranges.written().await;
        }
    }

    async fn mutate(
        &self,
        attrs: &Attributes<'_>,
        pod: &mut Object,
        _old: Option<&Object>,
    ) -> Result<(), ApiError> {
        let Some(namespace) = applies(attrs) else {
            return Ok(());
        };
        let ranges = self.ranges(&namespace).await?;
        let items: Vec<Value> = items_of_type(&ranges, "Container").cloned().collect();
        for container in containers_mut(pod) {
            // Kubernetes defaults requests from limits before admission runs.
            default_requests_from_limits(container);
            for item in &items {
                for (key, field) in [("defaultRequest", "requests"), ("default", "limits")] {
                    let Some(Value::Object(defaults)) = item.get(key) else {
                        continue;
                    };
                    let resources = resources_mut(container);
                    let list = resources
                        .entry(field)
                        .or_insert_with(|| Value::Object(Map::new()));
                    if let Value::Object(list) = list {
                        for (name, value) in defaults {
                            list.entry(name.clone()).or_insert_with(|| value.clone());
                        }
                    }
                }
            }
        }
        Ok(())
    }

    async fn validate(
        &self,
        attrs: &Attributes<'_>,
        pod: &Object,
        _old: Option<&Object>,
    ) -> Result<(), ApiError> {
        let Some(namespace) = applies(attrs) else {
            return Ok(());
        };
        let ranges = self.ranges(&namespace).await?;
        let mut errors = Vec::new();
        let spec = pod.get("spec");
        for item in items_of_type(&ranges, "Container") {
            for list in ["initContainers", "containers"] {
                let containers = spec
                    .and_then(|s| s.get(list))
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten();
                for c in containers {
                    check(item, "Container", &container_resources(c), &mut errors);
                }
            }
        }
        for item in items_of_type(&ranges, "Pod") {
            check(item, "Pod", &pod_resources(pod), &mut errors);
        }
        let message = match errors.as_slice() {
            [] => return Ok(()),
            [one] => one.clone(),
            many => format!("[{}]", many.join(", ")),
        };
        Err(ApiError::admission_forbidden(
            "", "pods", attrs.name, &message,
        ))
    }
}

/// LimitRange defaults, as Kubernetes applies them: an item's `default` falls back to
/// its `max`, and its `defaultRequest` to its `default`, then to its `min`.
pub fn default_limit_range(obj: &mut Object) {
    let Some(items) = obj
        .get_mut("spec")
        .and_then(|s| s.get_mut("limits"))
        .and_then(Value::as_array_mut)
    else {
        return;
    };
    for item in items.iter_mut().filter_map(Value::as_object_mut) {
        if item.get("type").and_then(Value::as_str) != Some("Container") {
            continue;
        }
        let get = |item: &Map<String, Value>, key: &str| {
            item.get(key)
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default()
        };
        let mut default = get(item, "default");
        for (name, max) in get(item, "max") {
            default.entry(name).or_insert(max);
        }
        let mut default_request = get(item, "defaultRequest");
        for (name, value) in default.iter().chain(get(item, "min").iter()) {
            default_request
                .entry(name.clone())
                .or_insert_with(|| value.clone());
        }
        if !default.is_empty() {
            item.insert("default".into(), Value::Object(default));
        }
        if !default_request.is_empty() {
            item.insert("defaultRequest".into(), Value::Object(default_request));
        }
    }
}

/// Every quantity in `list` (at `path`) must parse; `non_negative` refuses negatives.
fn check_quantities(
    list: Option<&Value>,
    path: &str,
    non_negative: bool,
    causes: &mut Vec<StatusCause>,
) {
    let Some(list) = list.and_then(Value::as_object) else {
        return;
    };
    for (name, value) in list {
        let field = format!("{path}[{name}]");
        let shown = value
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| value.to_string());
        match value.as_str().map(Quantity::parse) {
            Some(Ok(q)) if non_negative && q < Quantity::ZERO => causes.push(StatusCause::invalid(
                field,
                &shown,
                "must be greater than or equal to 0",
            )),
            Some(Ok(_)) => {}
            Some(Err(e)) => causes.push(StatusCause::invalid(field, &shown, &e.to_string())),
            None => causes.push(StatusCause::invalid(
                field,
                &shown,
                "must be a quantity string",
            )),
        }
    }
}

/// Validation of LimitRange (`spec.limits[*]`) and ResourceQuota (`spec.hard`).
pub fn validate(plural: &str, obj: &Object, causes: &mut Vec<StatusCause>) {
    let spec = obj.get("spec");
    match plural {
        "resourcequotas" => {
            check_quantities(spec.and_then(|s| s.get("hard")), "spec.hard", true, causes)
        }
        "limitranges" => {
            let items = spec
                .and_then(|s| s.get("limits"))
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            for (i, item) in items.iter().enumerate() {
                let path = format!("spec.limits[{i}]");
                match item.get("type").and_then(Value::as_str) {
                    Some("Container" | "Pod" | "PersistentVolumeClaim") => {}
                    other => causes.push(StatusCause::invalid(
                        format!("{path}.type"),
                        other.unwrap_or(""),
                        "supported values: \"Container\", \"PersistentVolumeClaim\", \"Pod\"",
                    )),
                }
                for key in [
                    "max",
                    "min",
                    "default",
                    "defaultRequest",
                    "maxLimitRequestRatio",
                ] {
                    check_quantities(item.get(key), &format!("{path}.{key}"), true, causes);
                }
                let bound = |key: &str, name: &str| {
                    item.get(key)
                        .and_then(|m| m.get(name))
                        .and_then(Value::as_str)
                        .and_then(|v| Quantity::parse(v).ok())
                };
                let names: std::collections::BTreeSet<String> = item
                    .get("min")
                    .and_then(Value::as_object)
                    .map(|m| m.keys().cloned().collect())
                    .unwrap_or_default();
                for name in names {
                    if let (Some(min), Some(max)) = (bound("min", &name), bound("max", &name))
                        && min > max
                    {
                        causes.push(StatusCause::invalid(
                            format!("{path}.min[{name}]"),
                            &min.to_string(),
                            &format!("min value {min} is greater than max value {max}"),
                        ));
                    }
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Object {
        serde_json::from_value(v).unwrap()
    }

    fn container(requests: Value, limits: Value) -> Resources {
        container_resources(&json!({"resources": {"requests": requests, "limits": limits}}))
    }

    #[test]
    fn container_bounds_are_reported_in_kubernetes_words() {
        let item = json!({"type": "Container", "min": {"cpu": "100m"}, "max": {"cpu": "1", "memory": "1Gi"}, "maxLimitRequestRatio": {"cpu": "2"}});
        let mut errors = Vec::new();
        check(
            &item,
            "Container",
            &container(json!({"cpu": "50m"}), json!({"cpu": "2"})),
            &mut errors,
        );
        assert_eq!(
            errors,
            [
                "minimum cpu usage per Container is 100m, but request is 50m",
                "maximum cpu usage per Container is 1, but limit is 2",
                "maximum memory usage per Container is 1Gi.  No limit is specified",
                "cpu max limit to request ratio per Container is 2, but provided ratio is 40.000000",
            ]
        );
        let mut fine = Vec::new();
        check(
            &item,
            "Container",
            &container(
                json!({"cpu": "500m"}),
                json!({"cpu": "1", "memory": "512Mi"}),
            ),
            &mut fine,
        );
        assert!(fine.is_empty(), "{fine:?}");
    }

    #[test]
    fn pod_totals_sum_containers_and_need_every_limit() {
        let pod = obj(json!({"spec": {"containers": [
            {"resources": {"requests": {"cpu": "300m"}, "limits": {"cpu": "1"}}},
            {"resources": {"requests": {"cpu": "200m"}}},
        ]}}));
        let totals = pod_resources(&pod);
        assert_eq!(totals.requests["cpu"], "500m");
        assert!(!totals.limits.contains_key("cpu"));
    }

    #[test]
    fn limit_range_defaults_fall_back_to_max_and_default() {
        let mut range = obj(json!({"spec": {"limits": [
            {"type": "Container", "max": {"cpu": "2"}, "default": {"memory": "256Mi"}},
        ]}}));
        default_limit_range(&mut range);
        let item = &range["spec"]["limits"][0];
        assert_eq!(item["default"], json!({"cpu": "2", "memory": "256Mi"}));
        assert_eq!(
            item["defaultRequest"],
            json!({"cpu": "2", "memory": "256Mi"})
        );
    }

    #[test]
    fn bad_quantities_and_inverted_bounds_are_invalid() {
        let range = obj(json!({"spec": {"limits": [
            {"type": "Container", "min": {"cpu": "2"}, "max": {"cpu": "1", "memory": "lots"}},
            {"type": "Node"},
        ]}}));
        let mut causes = Vec::new();
        validate("limitranges", &range, &mut causes);
        let fields: Vec<&str> = causes.iter().map(|c| c.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "spec.limits[0].max[memory]",
                "spec.limits[0].min[cpu]",
                "spec.limits[1].type"
            ]
        );
        let quota = obj(json!({"spec": {"hard": {"pods": "-1", "requests.cpu": "1"}}}));
        let mut causes = Vec::new();
        validate("resourcequotas", &quota, &mut causes);
        assert_eq!(causes.len(), 1);
        assert_eq!(causes[0].field, "spec.hard[pods]");
    }

    #[test]
    fn limits_stand_for_missing_requests() {
        let mut c = json!({"resources": {"limits": {"cpu": "1"}, "requests": {"memory": "1Gi"}}});
        default_requests_from_limits(c.as_object_mut().unwrap());
        assert_eq!(
            c["resources"]["requests"],
            json!({"memory": "1Gi", "cpu": "1"})
        );
    }
}
