//! ResourceQuota accounting: what an object counts for in its namespace's quotas, and
//! which objects a quota's scopes select.
//!
//! The API server charges creates and recounts after writes by these rules
//! (`host/apiserver/src/admission/quota.rs`), and the ResourceQuota controller
//! (`plugins/controllers/resourcequota`) recounts from its caches by them: were they
//! to count differently, each would correct the other's status for ever. So both use
//! this crate, which depends on nothing but quantities and JSON values, to build for
//! the host and for wasm32-wasip2 alike.
//!
//! What is counted, per namespace: `pods` (those not `Succeeded` or `Failed`),
//! `configmaps`, `secrets`, `services`, `resourcequotas`, the pods' compute resources
//! (`requests.X` and `limits.X` for whatever the containers name, and a bare `cpu`,
//! `memory` or other name as its request), and `count/<resource>[.<group>]` for every
//! resource.
//!
//! Scopes (`spec.scopes` and `spec.scopeSelector`, all of which must match) narrow a
//! quota to the pods they select, as in Kubernetes: `Terminating` and `NotTerminating`
//! (`activeDeadlineSeconds` set or not), `BestEffort` and `NotBestEffort` (no container
//! requests or limits, or some), `PriorityClass` (`In`, `NotIn`, `Exists`,
//! `DoesNotExist` on the pod's `priorityClassName`) and `CrossNamespacePodAffinity`
//! (affinity terms naming other namespaces). A scoped quota counts pods only.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value};
use trellis_quantity::Quantity;

/// Amounts by quota resource name (`pods`, `requests.cpu`, `count/secrets`).
pub type Usage = BTreeMap<String, Quantity>;

static NULL: Value = Value::Null;

/// An object's top-level fields. The API server holds objects as maps and plugins
/// as values; the rules read both the same way, a missing field as `null`.
pub trait Fields {
    /// The field `name`, or `null`.
    fn field(&self, name: &str) -> &Value;
}

impl Fields for Value {
    fn field(&self, name: &str) -> &Value {
        self.get(name).unwrap_or(&NULL)
    }
}

impl Fields for Map<String, Value> {
    fn field(&self, name: &str) -> &Value {
        self.get(name).unwrap_or(&NULL)
    }
}

/// The resource (`pods`, `deployments.apps`) whose objects a quota resource name is
/// counted from. `None`: nothing is counted for it, and its usage stays zero.
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

/// The resources the quota resource names `names` are counted from, each once, in
/// order: a count lists each of them once and adds objects in this order.
pub fn counted_resources<'a>(names: impl IntoIterator<Item = &'a String>) -> BTreeSet<&'a str> {
    names
        .into_iter()
        .filter_map(|n| counted_resource(n))
        .collect()
}

/// A resource (`pods`, `deployments.apps`) as its plural and group (`""` for core).
pub fn plural_and_group(resource: &str) -> (&str, &str) {
    resource.split_once('.').unwrap_or((resource, ""))
}

/// A quota's map of quantities `section.list` (`spec.hard`, `status.used`) parsed;
/// entries that do not parse are left out (validation refuses them on write, so only
/// a status written around it has them, and that status differs from any count).
pub fn amounts(quota: &impl Fields, section: &str, list: &str) -> Usage {
    quota.field(section)[list]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(name, v)| Some((name.clone(), Quantity::parse(v.as_str()?).ok()?)))
        .collect()
}

/// Quantities as a quota's status has them: each in its canonical form.
pub fn to_json(usage: &Usage) -> Value {
    Value::Object(
        usage
            .iter()
            .map(|(name, q)| (name.clone(), Value::String(q.to_string())))
            .collect::<Map<_, _>>(),
    )
}

/// Adds `usage` to the names `used` has; the names it lacks are not the quota's.
pub fn add(used: &mut Usage, usage: &Usage) {
    for (name, q) in usage {
        if let Some(total) = used.get_mut(name) {
            *total = total.saturating_add(*q);
        }
    }
}

/// One container's `requests.X` and `limits.X`. A limit without a request of the
/// same resource is the request too, as Kubernetes defaults it.
fn container_amounts(container: &Value) -> Usage {
    let requests = container["resources"]["requests"].as_object();
    let limits = container["resources"]["limits"].as_object();
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
pub fn pod_compute(pod: &impl Fields) -> Usage {
    let containers = |list: &str| {
        pod.field("spec")[list]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
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
/// that has not finished also one of `pods` and its compute resources (each request
/// under its bare name too: `cpu` is `requests.cpu`); a core ConfigMap, Secret,
/// Service or ResourceQuota one of its plural.
pub fn usage_of(group: &str, plural: &str, obj: &impl Fields) -> Usage {
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
                obj.field("status")["phase"].as_str(),
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

/// The strings of a list; anything else in it, or a list missing, is none.
fn strings(list: &Value) -> Vec<&str> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

/// Whether `quota`'s scopes select `obj`, an object of `group`/`plural`: a quota
/// without scopes selects every object; a scoped one selects pods only, those that
/// match each of its scopes.
pub fn selects(quota: &impl Fields, group: &str, plural: &str, obj: &impl Fields) -> bool {
    let spec = quota.field("spec");
    let scopes = strings(&spec["scopes"]);
    let expressions = spec["scopeSelector"]["matchExpressions"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    if scopes.is_empty() && expressions.is_empty() {
        return true;
    }
    if !group.is_empty() || plural != "pods" {
        return false;
    }
    // A scope named in `spec.scopes` is the expression `Exists` on it.
    let named = scopes
        .iter()
        .all(|scope| in_scope(obj, scope, "Exists", &[]));
    named
        && expressions.iter().all(|e| {
            in_scope(
                obj,
                e["scopeName"].as_str().unwrap_or_default(),
                e["operator"].as_str().unwrap_or_default(),
                &strings(&e["values"]),
            )
        })
}

/// Whether `pod` satisfies `operator` (with `values`, for `PriorityClass`) on `scope`.
/// An unknown scope or operator selects nothing.
fn in_scope(pod: &impl Fields, scope: &str, operator: &str, values: &[&str]) -> bool {
    let spec = pod.field("spec");
    let exists = |holds: bool| match operator {
        "Exists" => holds,
        "DoesNotExist" => !holds,
        _ => false,
    };
    let terminating = spec["activeDeadlineSeconds"]
        .as_i64()
        .is_some_and(|d| d >= 0);
    match scope {
        "Terminating" => exists(terminating),
        "NotTerminating" => exists(!terminating),
        "BestEffort" => exists(pod_compute(pod).is_empty()),
        "NotBestEffort" => exists(!pod_compute(pod).is_empty()),
        "CrossNamespacePodAffinity" => exists(reaches_other_namespaces(spec)),
        "PriorityClass" => {
            let class = spec["priorityClassName"].as_str().filter(|c| !c.is_empty());
            match operator {
                "In" => class.is_some_and(|c| values.contains(&c)),
                "NotIn" => class.is_none_or(|c| !values.contains(&c)),
                "Exists" => class.is_some(),
                "DoesNotExist" => class.is_none(),
                _ => false,
            }
        }
        _ => false,
    }
}

/// Whether a term of a pod's affinity or anti-affinity (`spec` is the pod's),
/// required or preferred, looks at pods of other namespaces (`namespaces` listed, or
/// a `namespaceSelector`).
fn reaches_other_namespaces(spec: &Value) -> bool {
    let affinity = &spec["affinity"];
    ["podAffinity", "podAntiAffinity"].iter().any(|kind| {
        let rules = &affinity[*kind];
        let required = rules["requiredDuringSchedulingIgnoredDuringExecution"]
            .as_array()
            .into_iter()
            .flatten();
        let preferred = rules["preferredDuringSchedulingIgnoredDuringExecution"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|weighted| &weighted["podAffinityTerm"]);
        required.chain(preferred).any(|term| {
            term["namespaces"].as_array().is_some_and(|n| !n.is_empty())
                || !term["namespaceSelector"].is_null()
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    #[test]
    fn scopes_select_pods_as_kubernetes_does() {
        let quota = |spec: Value| json!({"metadata": {"name": "q"}, "spec": spec});
        let pod = |spec: Value| json!({"metadata": {"name": "p"}, "spec": spec});
        let best_effort = pod(json!({"containers": [{"name": "a"}]}));
        let sized = pod(json!({"containers": [{"name": "a",
            "resources": {"requests": {"cpu": "100m"}}}]}));
        let deadline = pod(
            json!({"activeDeadlineSeconds": 30, "priorityClassName": "high",
            "containers": [{"name": "a"}]}),
        );
        let reaching = pod(
            json!({"containers": [{"name": "a"}], "affinity": {"podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "zone", "namespaces": ["other"]}]}}}),
        );
        let preferring = pod(
            json!({"containers": [{"name": "a"}], "affinity": {"podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1,
                "podAffinityTerm": {"topologyKey": "zone", "namespaceSelector": {}}}]}}}),
        );
        let cm = json!({"metadata": {"name": "c"}});

        let unscoped = quota(json!({"hard": {"pods": "1"}}));
        assert!(selects(&unscoped, "", "pods", &sized));
        assert!(selects(&unscoped, "", "configmaps", &cm));

        let scoped = |scopes: &[&str]| quota(json!({"scopes": scopes}));
        let be = scoped(&["BestEffort"]);
        assert!(selects(&be, "", "pods", &best_effort));
        assert!(!selects(&be, "", "pods", &sized));
        assert!(
            !selects(&be, "", "configmaps", &cm),
            "scoped quotas count pods only"
        );
        assert!(selects(&scoped(&["NotBestEffort"]), "", "pods", &sized));
        assert!(selects(&scoped(&["Terminating"]), "", "pods", &deadline));
        assert!(!selects(&scoped(&["Terminating"]), "", "pods", &sized));
        assert!(selects(&scoped(&["NotTerminating"]), "", "pods", &sized));
        let cross = scoped(&["CrossNamespacePodAffinity"]);
        assert!(selects(&cross, "", "pods", &reaching));
        assert!(selects(&cross, "", "pods", &preferring));
        assert!(!selects(&cross, "", "pods", &sized));
        // Every scope must match.
        assert!(selects(
            &scoped(&["Terminating", "BestEffort"]),
            "",
            "pods",
            &deadline
        ));
        assert!(!selects(
            &scoped(&["Terminating", "NotBestEffort"]),
            "",
            "pods",
            &deadline
        ));

        let priority = |operator: &str, values: &[&str]| {
            quota(json!({"scopeSelector": {"matchExpressions": [
                {"scopeName": "PriorityClass", "operator": operator, "values": values}]}}))
        };
        assert!(selects(&priority("In", &["high"]), "", "pods", &deadline));
        assert!(!selects(&priority("In", &["low"]), "", "pods", &deadline));
        assert!(!selects(&priority("In", &["high"]), "", "pods", &sized));
        assert!(selects(&priority("NotIn", &["high"]), "", "pods", &sized));
        assert!(!selects(
            &priority("NotIn", &["high"]),
            "",
            "pods",
            &deadline
        ));
        assert!(selects(&priority("Exists", &[]), "", "pods", &deadline));
        assert!(selects(&priority("DoesNotExist", &[]), "", "pods", &sized));
        assert!(!selects(&priority("Bogus", &[]), "", "pods", &sized));
    }

    #[test]
    fn maps_and_values_are_read_alike() {
        let quota = json!({"spec": {"hard": {"pods": "2", "bad": "x"}, "scopes": ["BestEffort"]}});
        let pod = json!({"spec": {"containers": [{"name": "a"}]}});
        let (quota_map, pod_map) = (
            quota.as_object().unwrap().clone(),
            pod.as_object().unwrap().clone(),
        );
        assert!(selects(&quota_map, "", "pods", &pod_map));
        assert_eq!(usage_of("", "pods", &pod_map), usage_of("", "pods", &pod));
        let hard = amounts(&quota_map, "spec", "hard");
        assert_eq!(hard, amounts(&quota, "spec", "hard"));
        assert_eq!(
            hard.keys().collect::<Vec<_>>(),
            ["pods"],
            "bad entries are left out"
        );
        assert!(amounts(&quota, "status", "used").is_empty());
    }

    #[test]
    fn a_pod_counts_its_containers_and_its_largest_init_container() {
        let pod = json!({"spec": {
            "containers": [
                {"name": "a", "resources": {"requests": {"cpu": "250m", "memory": "64Mi"}, "limits": {"cpu": "500m"}}},
                {"name": "b", "resources": {"limits": {"cpu": "1", "memory": "128Mi"}}},
            ],
            "initContainers": [
                {"name": "i", "resources": {"requests": {"cpu": "2"}}},
            ],
        }});
        let usage = usage_of("", "pods", &pod);
        assert_eq!(usage["pods"], q("1"));
        assert_eq!(usage["count/pods"], q("1"));
        // b's limits stand for its requests; the init container's 2 cpu wins.
        assert_eq!(usage["requests.cpu"], q("2"));
        assert_eq!(usage["cpu"], q("2"));
        assert_eq!(usage["limits.cpu"], q("1500m"));
        assert_eq!(usage["requests.memory"], q("192Mi"));
        assert_eq!(usage["limits.memory"], q("128Mi"));
        let done = json!({"spec": {"containers": []}, "status": {"phase": "Succeeded"}});
        assert_eq!(
            usage_of("", "pods", &done).keys().collect::<Vec<_>>(),
            ["count/pods"]
        );
        let cm = json!({"metadata": {"name": "c"}});
        assert_eq!(usage_of("", "configmaps", &cm).len(), 2);
        let deployment = usage_of("apps", "deployments", &cm);
        assert_eq!(
            deployment.keys().collect::<Vec<_>>(),
            ["count/deployments.apps"]
        );
    }

    #[test]
    fn quota_names_map_to_the_resources_they_count() {
        assert_eq!(counted_resource("requests.cpu"), Some("pods"));
        assert_eq!(counted_resource("memory"), Some("pods"));
        assert_eq!(
            counted_resource("count/deployments.apps"),
            Some("deployments.apps")
        );
        assert_eq!(counted_resource("secrets"), Some("secrets"));
        assert_eq!(counted_resource("persistentvolumeclaims"), None);
        let names = [
            "limits.cpu",
            "pods",
            "count/configmaps",
            "persistentvolumeclaims",
        ]
        .map(String::from);
        assert_eq!(
            counted_resources(&names).into_iter().collect::<Vec<_>>(),
            ["configmaps", "pods"]
        );
        assert_eq!(
            plural_and_group("deployments.apps"),
            ("deployments", "apps")
        );
        assert_eq!(plural_and_group("pods"), ("pods", ""));
    }

    #[test]
    fn usage_is_added_to_the_quota_names_only() {
        let mut used = Usage::from([("pods".into(), q("1")), ("cpu".into(), q("500m"))]);
        let usage = usage_of(
            "",
            "pods",
            &json!({"spec": {"containers": [{"resources": {"requests": {"cpu": "250m"}}}]}}),
        );
        add(&mut used, &usage);
        assert_eq!(
            used,
            Usage::from([("pods".into(), q("2")), ("cpu".into(), q("750m"))])
        );
        assert_eq!(to_json(&used), json!({"pods": "2", "cpu": "750m"}));
    }
}
