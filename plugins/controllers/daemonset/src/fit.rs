//! Which nodes a DaemonSet's pod belongs on (Kubernetes' `NodeShouldRunDaemonPod`):
//! the template's `nodeName`, `nodeSelector` and required node affinity, and the
//! node's taints against the pod's tolerations, with the ones the controller adds.

use serde::Deserialize;
use serde_json::{Value, json};

/// What the controller reads of a node.
#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Node {
    pub metadata: NodeMeta,
    pub spec: NodeSpec,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct NodeMeta {
    pub name: String,
    pub labels: serde_json::Map<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct NodeSpec {
    pub taints: Vec<Taint>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Taint {
    pub key: String,
    pub value: Option<String>,
    pub effect: String,
}

/// The tolerations every daemon pod gets, so that it keeps running where the node
/// lifecycle and the kubelet taint a node (`AddOrUpdateDaemonPodTolerations`).
const DAEMON_TOLERATIONS: [(&str, &str); 6] = [
    ("node.kubernetes.io/not-ready", "NoExecute"),
    ("node.kubernetes.io/unreachable", "NoExecute"),
    ("node.kubernetes.io/disk-pressure", "NoSchedule"),
    ("node.kubernetes.io/memory-pressure", "NoSchedule"),
    ("node.kubernetes.io/pid-pressure", "NoSchedule"),
    ("node.kubernetes.io/unschedulable", "NoSchedule"),
];

/// Adds the daemon tolerations to a pod spec (and, for a pod on the host's
/// network, the one for a node whose network is not ready yet).
pub fn add_daemon_tolerations(spec: &mut Value) {
    let host_network = spec["hostNetwork"] == true;
    let extra = host_network.then_some(("node.kubernetes.io/network-unavailable", "NoSchedule"));
    if !spec["tolerations"].is_array() {
        spec["tolerations"] = json!([]);
    }
    let Some(list) = spec["tolerations"].as_array_mut() else {
        return;
    };
    for (key, effect) in DAEMON_TOLERATIONS.into_iter().chain(extra) {
        let toleration = json!({"key": key, "operator": "Exists", "effect": effect});
        // Kubernetes' AddOrUpdateTolerationInPodSpec: one of the same key and
        // effect is replaced.
        list.retain(|t| !(t["key"] == key && t["effect"] == effect));
        list.push(toleration);
    }
}

/// Whether `toleration` tolerates `taint`, as the scheduler decides it.
pub fn tolerates(toleration: &Value, taint: &Taint) -> bool {
    let effect = toleration["effect"].as_str().unwrap_or_default();
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    let key = toleration["key"].as_str().unwrap_or_default();
    let operator = toleration["operator"].as_str().unwrap_or("Equal");
    if key.is_empty() {
        return operator == "Exists";
    }
    if key != taint.key {
        return false;
    }
    match operator {
        "Exists" => true,
        _ => {
            toleration["value"].as_str().unwrap_or_default()
                == taint.value.as_deref().unwrap_or_default()
        }
    }
}

/// One `nodeSelectorRequirement` against a value (a label's or a field's).
fn requirement_matches(r: &Value, value: Option<&str>) -> bool {
    let values: Vec<&str> = r["values"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let number = |s: &str| s.parse::<i64>().ok();
    match r["operator"].as_str().unwrap_or_default() {
        "In" => value.is_some_and(|v| values.contains(&v)),
        "NotIn" => value.is_none_or(|v| !values.contains(&v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(have), Some(bound)) = (
                value.and_then(number),
                values.first().copied().and_then(number),
            ) else {
                return false;
            };
            if r["operator"] == "Gt" {
                have > bound
            } else {
                have < bound
            }
        }
        _ => false,
    }
}

/// A `nodeSelectorTerm`: all of its requirements (an empty term matches nothing).
fn term_matches(term: &Value, node: &Node) -> bool {
    let expressions = term["matchExpressions"].as_array();
    let fields = term["matchFields"].as_array();
    if expressions.is_none_or(|e| e.is_empty()) && fields.is_none_or(|f| f.is_empty()) {
        return false;
    }
    expressions.into_iter().flatten().all(|r| {
        let key = r["key"].as_str().unwrap_or_default();
        requirement_matches(r, node.metadata.labels.get(key).and_then(Value::as_str))
    }) && fields
        .into_iter()
        .flatten()
        .all(|r| r["key"] == "metadata.name" && requirement_matches(r, Some(&node.metadata.name)))
}

/// Whether the node fits the pod's `nodeSelector` and its required node affinity.
pub fn fits_affinity(pod_spec: &Value, node: &Node) -> bool {
    let selector_ok = pod_spec["nodeSelector"]
        .as_object()
        .into_iter()
        .flatten()
        .all(|(k, v)| node.metadata.labels.get(k) == Some(v));
    let required =
        &pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"];
    let affinity_ok = match required["nodeSelectorTerms"].as_array() {
        None if required.is_null() => true,
        None => false,
        Some(terms) => terms.iter().any(|t| term_matches(t, node)),
    };
    selector_ok && affinity_ok
}

/// `(should run, should continue running)` of the DaemonSet's pod on a node.
/// A pod not tolerating a NoSchedule taint is not started there but one that runs
/// stays; one not tolerating a NoExecute taint goes.
pub fn should_run(pod_spec: &Value, node: &Node) -> (bool, bool) {
    let node_name = pod_spec["nodeName"].as_str().unwrap_or_default();
    if !node_name.is_empty() && node_name != node.metadata.name {
        return (false, false);
    }
    if !fits_affinity(pod_spec, node) {
        return (false, false);
    }
    let tolerations = pod_spec["tolerations"].as_array();
    let untolerated = |t: &&Taint| {
        matches!(t.effect.as_str(), "NoSchedule" | "NoExecute")
            && !tolerations
                .into_iter()
                .flatten()
                .any(|tol| tolerates(tol, t))
    };
    let mut blocking = node.spec.taints.iter().filter(untolerated).peekable();
    if blocking.peek().is_none() {
        return (true, true);
    }
    (false, !blocking.any(|t| t.effect == "NoExecute"))
}

/// The pod's required node affinity replaced by one naming the node, as Kubernetes'
/// `ReplaceDaemonSetPodNodeNameNodeAffinity`: the scheduler then places it there.
pub fn pin_to_node(pod_spec: &mut Value, node: &str) {
    let term = json!({"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": [node]}]}]});
    if !pod_spec["affinity"].is_object() {
        pod_spec["affinity"] = json!({});
    }
    if !pod_spec["affinity"]["nodeAffinity"].is_object() {
        pod_spec["affinity"]["nodeAffinity"] = json!({});
    }
    pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] = term;
}

/// The node a pod is on, or the one its affinity pins it to while unscheduled
/// (`GetTargetNodeName`).
pub fn target_node(pod_spec: &Value) -> Option<String> {
    if let Some(n) = pod_spec["nodeName"].as_str().filter(|n| !n.is_empty()) {
        return Some(n.to_owned());
    }
    let terms = pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"]
        .as_array()?;
    terms.iter().find_map(|t| {
        t["matchFields"].as_array()?.iter().find_map(|r| {
            (r["key"] == "metadata.name" && r["operator"] == "In")
                .then(|| r["values"].as_array()?.first()?.as_str().map(str::to_owned))
                .flatten()
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(v: Value) -> Node {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn selector_affinity_and_name_decide_where_a_daemon_pod_goes() {
        let blue =
            node(json!({"metadata": {"name": "n1", "labels": {"color": "blue", "size": "7"}}}));
        let plain = node(json!({"metadata": {"name": "n2"}}));
        let spec = json!({"nodeSelector": {"color": "blue"}});
        assert_eq!(should_run(&spec, &blue), (true, true));
        assert_eq!(should_run(&spec, &plain), (false, false));
        let affinity = json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{"matchExpressions": [{"key": "size", "operator": "Gt", "values": ["5"]}]}]}}}});
        assert!(fits_affinity(&affinity, &blue));
        assert!(!fits_affinity(&affinity, &plain));
        assert_eq!(
            should_run(&json!({"nodeName": "n2"}), &blue),
            (false, false)
        );
    }

    #[test]
    fn taints_stop_new_pods_and_no_execute_ones_evict_running_pods() {
        let tainted = |effect: &str| {
            node(
                json!({"metadata": {"name": "n"}, "spec": {"taints": [{"key": "k", "value": "v", "effect": effect}]}}),
            )
        };
        let spec = json!({});
        assert_eq!(should_run(&spec, &tainted("NoSchedule")), (false, true));
        assert_eq!(should_run(&spec, &tainted("NoExecute")), (false, false));
        assert_eq!(
            should_run(&spec, &tainted("PreferNoSchedule")),
            (true, true)
        );
        let tolerant = json!({"tolerations": [{"key": "k", "operator": "Equal", "value": "v"}]});
        assert_eq!(should_run(&tolerant, &tainted("NoExecute")), (true, true));
        let wrong_value = json!({"tolerations": [{"key": "k", "value": "w"}]});
        assert_eq!(
            should_run(&wrong_value, &tainted("NoExecute")),
            (false, false)
        );
        let everything = json!({"tolerations": [{"operator": "Exists"}]});
        assert_eq!(should_run(&everything, &tainted("NoExecute")), (true, true));
    }

    #[test]
    fn daemon_pods_tolerate_an_unschedulable_not_ready_node() {
        let cordoned = node(json!({"metadata": {"name": "n"}, "spec": {"taints": [
            {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"}]}}));
        let mut spec = json!({"tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]});
        add_daemon_tolerations(&mut spec);
        assert_eq!(spec["tolerations"].as_array().unwrap().len(), 6);
        assert_eq!(should_run(&spec, &cordoned), (true, true));
        let mut host = json!({"hostNetwork": true});
        add_daemon_tolerations(&mut host);
        assert_eq!(host["tolerations"].as_array().unwrap().len(), 7);
    }

    #[test]
    fn a_pinned_pod_names_its_node_through_match_fields() {
        let mut spec = json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{"matchExpressions": [{"key": "a", "operator": "Exists"}]}]}},
            "podAntiAffinity": {}}});
        pin_to_node(&mut spec, "n7");
        assert_eq!(target_node(&spec).as_deref(), Some("n7"));
        assert!(spec["affinity"]["podAntiAffinity"].is_object());
        assert!(fits_affinity(
            &spec,
            &node(json!({"metadata": {"name": "n7"}}))
        ));
        assert!(!fits_affinity(
            &spec,
            &node(json!({"metadata": {"name": "n8"}}))
        ));
        assert_eq!(
            target_node(&json!({"nodeName": "n1"})).as_deref(),
            Some("n1")
        );
        assert_eq!(target_node(&json!({})), None);
    }
}
