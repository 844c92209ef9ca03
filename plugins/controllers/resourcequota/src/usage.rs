//! What one object counts for in its namespace's quotas, by quota resource name.
//!
//! These are the API server's rules (`host/apiserver/src/admission/quota.rs`), which
//! charges creates with them and recounts after writes: the controller must reach
//! the same totals, or the two would correct each other for ever.

use std::collections::BTreeMap;

use serde_json::{Map, Value};
use trellis_plugin::quantity::Quantity;

/// Amounts by quota resource name (`pods`, `requests.cpu`, `count/secrets`).
pub type Usage = BTreeMap<String, Quantity>;

/// The resource (`pods`, `deployments.apps`) whose objects a quota resource name is
/// counted from. `None`: the server counts nothing for it, and its usage stays zero.
pub fn counted_resource(name: &str) -> Option<&str> {
    if let Some(resource) = name.strip_prefix("count/") {
        return Some(resource);
    }
    match name {
        "configmaps" | "secrets" | "services" | "resourcequotas" => Some(name),
        "pods" | "cpu" | "memory" | "ephemeral-storage" => Some("pods"),
        _ if name.starts_with("requests.") || name.starts_with("limits.") => Some("pods"),
        _ => None,
    }
}

/// A map of quantities (`spec.hard`, `status.used`) parsed; entries that do not parse
/// are left out (validation refuses them on write, so only a status written around
/// it has them, and that status differs from any count).
pub fn amounts(map: &Value) -> Usage {
    map.as_object()
        .into_iter()
        .flatten()
        .filter_map(|(name, v)| Some((name.clone(), Quantity::parse(v.as_str()?).ok()?)))
        .collect()
}

/// Quantities as a quota's status writes them: the quantity's canonical form, which
/// is the API server's too.
pub fn to_json(usage: &Usage) -> Value {
    Value::Object(
        usage
            .iter()
            .map(|(name, q)| (name.clone(), Value::String(q.to_string())))
            .collect::<Map<_, _>>(),
    )
}

/// One container's `requests.X` and `limits.X`. A limit without a request of the
/// same resource is the request too, as Kubernetes defaults it.
fn container_amounts(container: &Value) -> Usage {
    let requests = container
        .pointer("/resources/requests")
        .and_then(Value::as_object);
    let limits = container
        .pointer("/resources/limits")
        .and_then(Value::as_object);
    let parse = |v: &Value| v.as_str().and_then(|s| Quantity::parse(s).ok());
    let mut out = Usage::new();
    for (resource, value) in limits.into_iter().flatten() {
        let Some(q) = parse(value) else { continue };
        out.insert(format!("limits.{resource}"), q);
        if !requests.is_some_and(|r| r.contains_key(resource)) {
            out.insert(format!("requests.{resource}"), q);
        }
    }
    for (resource, value) in requests.into_iter().flatten() {
        if let Some(q) = parse(value) {
            out.insert(format!("requests.{resource}"), q);
        }
    }
    out
}

/// A pod's requests and limits: its containers run together, so they add up; its
/// init containers run one after another, so each resource is the larger of that
/// sum and the largest init container's.
pub fn pod_compute(pod: &Value) -> Usage {
    let containers = |field: &str| pod["spec"][field].as_array().cloned().unwrap_or_default();
    let mut total = Usage::new();
    for container in containers("containers") {
        for (name, q) in container_amounts(&container) {
            let sum = total.entry(name).or_default();
            *sum = sum.saturating_add(q);
        }
    }
    for container in containers("initContainers") {
        for (name, q) in container_amounts(&container) {
            if total.get(&name).is_none_or(|t| *t < q) {
                total.insert(name, q);
            }
        }
    }
    total
}

/// What an object of `group`/`plural` uses: one `count/<resource>[.<group>]`; a pod
/// that has not finished also one of `pods` and its compute resources (`cpu` and
/// `memory` standing for their requests, as any bare resource name does); a core
/// ConfigMap, Secret, Service or ResourceQuota one of its plural.
pub fn usage_of(group: &str, plural: &str, obj: &Value) -> Usage {
    let one = Quantity::from_units(1);
    let mut usage = Usage::new();
    let counted = if group.is_empty() {
        format!("count/{plural}")
    } else {
        format!("count/{plural}.{group}")
    };
    usage.insert(counted, one);
    if !group.is_empty() {
        return usage;
    }
    match plural {
        "pods" => {
            let finished = matches!(
                obj["status"]["phase"].as_str(),
                Some("Succeeded" | "Failed")
            );
            if finished {
                return usage;
            }
            usage.insert("pods".into(), one);
            for (name, q) in pod_compute(obj) {
                if let Some(bare) = name.strip_prefix("requests.") {
                    usage.insert(bare.to_owned(), q);
                }
                usage.insert(name, q);
            }
        }
        "configmaps" | "secrets" | "services" | "resourcequotas" => {
            usage.insert(plural.to_owned(), one);
        }
        _ => {}
    }
    usage
}
