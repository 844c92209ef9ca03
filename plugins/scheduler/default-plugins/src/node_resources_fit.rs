//! NodeResourcesFit: a pod fits a node only if the node's allocatable resources, less
//! what the pods on it request, cover the pod's requests, and the node takes one pod
//! more (Filter); nodes score by how much of them would be requested, with the
//! strategy the configuration picks (Score): `LeastAllocated` (the default) favours
//! the emptiest, `MostAllocated` the fullest, `RequestedToCapacityRatio` follows a
//! utilization-to-score shape.
//!
//! The configuration takes kube-scheduler's `NodeResourcesFitArgs`:
//! `{"scoringStrategy": {"type": "MostAllocated", "resources": [{"name": "cpu",
//! "weight": 2}]}, "ignoredResources": ["example.com/foo"]}`.

use serde::Deserialize;
use trellis_plugin::scheduler::{
    Cluster, ClusterEvent, Code, MAX_NODE_SCORE, NodeInfo, Plugin, PodInfo, Points, Status,
};

/// `NodeResourcesFitArgs`, as the configuration's `nodeResourcesFit`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Args {
    pub scoring_strategy: Option<ScoringStrategy>,
    /// Extended resources the Filter does not check.
    pub ignored_resources: Vec<String>,
    /// Groups (the part before `/`) of extended resources the Filter does not check.
    pub ignored_resource_groups: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct ScoringStrategy {
    #[serde(rename = "type")]
    pub kind: StrategyType,
    /// The resources scored and their weights; empty means cpu and memory, weight 1.
    pub resources: Vec<ResourceSpec>,
    pub requested_to_capacity_ratio: Option<RequestedToCapacityRatio>,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
pub enum StrategyType {
    #[default]
    LeastAllocated,
    MostAllocated,
    RequestedToCapacityRatio,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceSpec {
    pub name: String,
    /// 1..=100; 0 (or none) is 1.
    #[serde(default)]
    pub weight: i64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RequestedToCapacityRatio {
    pub shape: Vec<UtilizationShapePoint>,
}

#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UtilizationShapePoint {
    /// Percent requested, 0..=100, increasing along the shape.
    pub utilization: i64,
    /// 0..=10, scaled to 0..=100.
    pub score: i64,
}

/// The highest score of a shape point (`MaxCustomPriorityScore`).
const MAX_SHAPE_SCORE: i64 = 10;

/// The resources scored when the configuration names none.
pub fn default_resources() -> Vec<(String, i64)> {
    vec![("cpu".to_owned(), 1), ("memory".to_owned(), 1)]
}

enum Scorer {
    Least,
    Most,
    /// The shape's points as (utilization, score scaled to `MAX_NODE_SCORE`).
    Ratio(Vec<(i64, i64)>),
}

pub struct NodeResourcesFit {
    /// Resources scored, with their weights.
    resources: Vec<(String, i64)>,
    scorer: Scorer,
    ignored_resources: Vec<String>,
    ignored_resource_groups: Vec<String>,
}

impl Default for NodeResourcesFit {
    fn default() -> Self {
        Self {
            resources: default_resources(),
            scorer: Scorer::Least,
            ignored_resources: Vec::new(),
            ignored_resource_groups: Vec::new(),
        }
    }
}

impl NodeResourcesFit {
    /// The plugin as `args` configure it, checked as kube-scheduler validates them.
    pub fn new(args: Args) -> Result<Self, String> {
        let strategy = args.scoring_strategy.unwrap_or_default();
        let mut resources = Vec::with_capacity(strategy.resources.len());
        for r in &strategy.resources {
            let weight = if r.weight == 0 { 1 } else { r.weight };
            if !(1..=100).contains(&weight) {
                return Err(format!(
                    "nodeResourcesFit: resource weight of {} not in valid range [1, 100]",
                    r.name
                ));
            }
            resources.push((r.name.clone(), weight));
        }
        if resources.is_empty() {
            resources = default_resources();
        }
        let scorer = match strategy.kind {
            StrategyType::LeastAllocated => Scorer::Least,
            StrategyType::MostAllocated => Scorer::Most,
            StrategyType::RequestedToCapacityRatio => {
                let shape = strategy
                    .requested_to_capacity_ratio
                    .map(|r| r.shape)
                    .unwrap_or_default();
                Scorer::Ratio(checked_shape(&shape)?)
            }
        };
        Ok(Self {
            resources,
            scorer,
            ignored_resources: args.ignored_resources,
            ignored_resource_groups: args.ignored_resource_groups,
        })
    }
}

fn checked_shape(shape: &[UtilizationShapePoint]) -> Result<Vec<(i64, i64)>, String> {
    if shape.is_empty() {
        return Err("nodeResourcesFit: requestedToCapacityRatio.shape: at least one point must be specified".into());
    }
    let mut previous = None;
    for p in shape {
        if !(0..=100).contains(&p.utilization) {
            return Err("nodeResourcesFit: shape utilization not in valid range [0, 100]".into());
        }
        if !(0..=MAX_SHAPE_SCORE).contains(&p.score) {
            return Err("nodeResourcesFit: shape score not in valid range [0, 10]".into());
        }
        if previous.is_some_and(|u| p.utilization <= u) {
            return Err(
                "nodeResourcesFit: shape utilization values must be sorted in increasing order"
                    .into(),
            );
        }
        previous = Some(p.utilization);
    }
    Ok(shape
        .iter()
        .map(|p| (p.utilization, p.score * (MAX_NODE_SCORE / MAX_SHAPE_SCORE)))
        .collect())
}

/// Resources counted by name in the scheduler's `ScalarResources`: extended
/// (`example.com/gpu`), `kubernetes.io/`-prefixed, hugepages and attachable volumes.
pub fn is_scalar(name: &str) -> bool {
    is_extended(name)
        || name.contains("kubernetes.io/")
        || name.starts_with("hugepages-")
        || name.starts_with("attachable-volumes-")
}

fn is_extended(name: &str) -> bool {
    name.contains('/') && !name.contains("kubernetes.io/") && !name.starts_with("requests.")
}

/// A node's allocatable amount of `resource` and what would be requested of it with
/// the pod placed there, for scoring: `None` leaves the resource out (nothing
/// allocatable, or an extended resource the pod does not ask for).
/// `use_requested` counts requests as they are; otherwise CPU and memory count
/// missing requests as the scheduler's defaults (`NonZeroRequested`).
pub fn allocatable_and_requested(
    resource: &str,
    pod: &PodInfo,
    node: &NodeInfo,
    use_requested: bool,
) -> Option<(i64, i64)> {
    let (pod_requests, node_requested) = if use_requested {
        (&pod.requests, &node.requested)
    } else {
        (&pod.non_zero_requests, &node.non_zero_requested)
    };
    let wanted = pod_requests.get(resource);
    let alloc = &node.allocatable;
    let (allocatable, requested) = match resource {
        "cpu" => (alloc.milli_cpu, node_requested.milli_cpu + wanted),
        "memory" => (alloc.memory, node_requested.memory + wanted),
        "ephemeral-storage" => (
            alloc.ephemeral_storage,
            node.requested.ephemeral_storage + wanted,
        ),
        other if is_scalar(other) && wanted != 0 => (
            *alloc.scalar.get(other)?,
            node.requested.get(other) + wanted,
        ),
        _ => return None,
    };
    (allocatable != 0).then_some((allocatable, requested))
}

fn least_requested(requested: i64, capacity: i64) -> i64 {
    if requested > capacity {
        return 0;
    }
    (capacity - requested) * MAX_NODE_SCORE / capacity
}

fn most_requested(requested: i64, capacity: i64) -> i64 {
    // Defaults for missing requests can take a node past its capacity.
    requested.min(capacity) * MAX_NODE_SCORE / capacity
}

/// The shape as a piecewise linear function of utilization (`BuildBrokenLinearFunction`).
fn broken_linear(shape: &[(i64, i64)], utilization: i64) -> i64 {
    for (i, &(u, score)) in shape.iter().enumerate() {
        if utilization <= u {
            let Some(&(pu, ps)) = i.checked_sub(1).and_then(|p| shape.get(p)) else {
                return score;
            };
            return ps + (score - ps) * (utilization - pu) / (u - pu);
        }
    }
    shape.last().map_or(0, |&(_, score)| score)
}

impl Plugin for NodeResourcesFit {
    fn name(&self) -> &'static str {
        "NodeResourcesFit"
    }

    fn points(&self) -> Points {
        Points {
            filter: true,
            score: true,
            ..Points::default()
        }
    }

    fn events(&self) -> Vec<ClusterEvent> {
        vec![
            ClusterEvent::pod_deleted(),
            ClusterEvent::node_added_or_changed(),
        ]
    }

    fn filter(&self, pod: &PodInfo, node: &NodeInfo, _: &Cluster) -> Status {
        let mut reasons = Vec::new();
        // Preemption cannot help where the node is smaller than the request.
        let mut unresolvable = false;
        if node.pods.len() as i64 + 1 > node.allowed_pods {
            reasons.push("Too many pods".to_owned());
        }
        let want = &pod.requests;
        let alloc = &node.allocatable;
        let used = &node.requested;
        let mut check = |name: &str, wanted: i64, allocatable: i64, requested: i64| {
            if wanted > 0 && wanted > allocatable - requested {
                reasons.push(format!("Insufficient {name}"));
                unresolvable |= wanted > allocatable;
            }
        };
        check("cpu", want.milli_cpu, alloc.milli_cpu, used.milli_cpu);
        check("memory", want.memory, alloc.memory, used.memory);
        check(
            "ephemeral-storage",
            want.ephemeral_storage,
            alloc.ephemeral_storage,
            used.ephemeral_storage,
        );
        for (name, &wanted) in &want.scalar {
            if !is_scalar(name) {
                continue;
            }
            if is_extended(name) {
                let group = name.split('/').next().unwrap_or_default();
                if self.ignored_resources.iter().any(|r| r == name)
                    || self.ignored_resource_groups.iter().any(|g| g == group)
                {
                    continue;
                }
            }
            check(name, wanted, alloc.get(name), used.get(name));
        }
        if reasons.is_empty() {
            return Status::success();
        }
        Status {
            code: if unresolvable {
                Code::UnschedulableAndUnresolvable
            } else {
                Code::Unschedulable
            },
            reasons,
        }
    }

    fn score(&self, pod: &PodInfo, node: &NodeInfo, _: &Cluster) -> Result<i64, String> {
        let (mut total, mut weights) = (0, 0);
        for (name, weight) in &self.resources {
            let Some((capacity, requested)) = allocatable_and_requested(name, pod, node, false)
            else {
                continue;
            };
            let score = match &self.scorer {
                Scorer::Least => least_requested(requested, capacity),
                Scorer::Most => most_requested(requested, capacity),
                Scorer::Ratio(shape) => {
                    let utilization = if requested > capacity {
                        100
                    } else {
                        requested * 100 / capacity
                    };
                    let score = broken_linear(shape, utilization);
                    // A resource scoring nothing does not weigh in the average.
                    if score <= 0 {
                        continue;
                    }
                    score
                }
            };
            total += score * weight;
            weights += weight;
        }
        if weights == 0 {
            return Ok(0);
        }
        Ok(match self.scorer {
            Scorer::Ratio(_) => (total as f64 / weights as f64).round() as i64,
            _ => total / weights,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{framework, node, placed, pod};
    use serde_json::{Value, json};

    fn sized(id: u32, allocatable: Value) -> trellis_plugin::scheduler::Change {
        node(id, json!({"status": {"allocatable": allocatable}}))
    }

    fn requesting(name: &str, requests: Value) -> Value {
        json!({"metadata": {"name": name}, "spec": {"containers": [
            {"name": "c", "resources": {"requests": requests}}]}})
    }

    fn fit(config: Value) -> NodeResourcesFit {
        NodeResourcesFit::new(serde_json::from_value(config).expect("args")).expect("valid args")
    }

    #[test]
    fn filter_names_every_insufficient_resource() {
        let plugin = NodeResourcesFit::default();
        let mut fw = framework(vec![]);
        fw.update([
            sized(
                0,
                json!({"cpu": "2", "memory": "1Gi", "pods": "2", "example.com/gpu": "1",
                "ephemeral-storage": "1Gi"}),
            ),
            placed(
                0,
                requesting("a", json!({"cpu": "1500m", "memory": "512Mi"})),
            ),
            sized(1, json!({"cpu": "4", "memory": "4Gi", "pods": "1"})),
            placed(1, requesting("b", json!({}))),
        ]);
        let big = pod(requesting(
            "p",
            json!({"cpu": "1", "memory": "768Mi",
            "example.com/gpu": "2", "ephemeral-storage": "2Gi"}),
        ));
        let n0 = fw.cluster.node(0).expect("node 0");
        let status = plugin.filter(&big, n0, &fw.cluster);
        assert_eq!(
            status.reasons,
            [
                "Insufficient cpu",
                "Insufficient memory",
                "Insufficient ephemeral-storage",
                "Insufficient example.com/gpu",
            ]
        );
        // Two GPUs and 2Gi of storage exceed the node itself.
        assert_eq!(status.code, Code::UnschedulableAndUnresolvable);
        let small = pod(requesting("p", json!({"cpu": "1"})));
        let status = plugin.filter(&small, n0, &fw.cluster);
        assert_eq!(
            (status.code, status.reasons),
            (Code::Unschedulable, vec!["Insufficient cpu".to_owned()])
        );
        let n1 = fw.cluster.node(1).expect("node 1");
        assert_eq!(
            plugin.filter(&small, n1, &fw.cluster).reasons,
            ["Too many pods"]
        );
        let ignoring = fit(json!({"ignoredResourceGroups": ["example.com"]}));
        let gpu = pod(requesting("p", json!({"example.com/gpu": "2"})));
        assert!(ignoring.filter(&gpu, n0, &fw.cluster).is_success());
    }

    /// The cases of kube-scheduler's scoring tests: a pod asking 3000m and 5000 bytes
    /// on nodes of 4000m/10000 and 6000m/10000.
    fn score_two_sized_nodes(plugin: NodeResourcesFit) -> Vec<i64> {
        let mut fw = framework(vec![Box::new(plugin)]);
        fw.update([
            sized(0, json!({"cpu": "4", "memory": "10000", "pods": "10"})),
            sized(1, json!({"cpu": "6", "memory": "10000", "pods": "10"})),
        ]);
        fw.cycle(pod(requesting("p", json!({"cpu": "3", "memory": "5000"}))));
        let scores = fw.score(&[0, 1]).expect("scores");
        scores[0].1.clone()
    }

    #[test]
    fn strategies_score_as_kube_scheduler() {
        assert_eq!(score_two_sized_nodes(NodeResourcesFit::default()), [37, 50]);
        assert_eq!(
            score_two_sized_nodes(fit(json!({"scoringStrategy": {"type": "MostAllocated"}}))),
            [62, 50]
        );
        let ratio = json!({"scoringStrategy": {"type": "RequestedToCapacityRatio",
            "requestedToCapacityRatio": {"shape": [
                {"utilization": 0, "score": 0}, {"utilization": 100, "score": 10}]}}});
        // (75 + 50) / 2 rounds up.
        assert_eq!(score_two_sized_nodes(fit(ratio)), [63, 50]);
        let weighted = json!({"scoringStrategy": {"resources": [
            {"name": "cpu", "weight": 3}, {"name": "memory", "weight": 1}]}});
        // (25 * 3 + 50) / 4 and 50.
        assert_eq!(score_two_sized_nodes(fit(weighted)), [31, 50]);
    }

    #[test]
    fn missing_requests_score_as_the_defaults() {
        let mut fw = framework(vec![Box::new(NodeResourcesFit::default())]);
        fw.update([
            sized(0, json!({"cpu": "1", "memory": "1000Mi", "pods": "10"})),
            placed(0, requesting("a", json!({}))),
        ]);
        fw.cycle(pod(requesting("p", json!({}))));
        // 200m of 1000m and 400Mi of 1000Mi requested: (80 + 60) / 2.
        assert_eq!(fw.score(&[0]), Ok(vec![(0, vec![70])]));
    }

    #[test]
    fn configuration_is_checked() {
        let err = |config: Value| {
            NodeResourcesFit::new(serde_json::from_value(config).expect("args")).err()
        };
        assert!(
            err(json!({"scoringStrategy": {"resources": [{"name": "cpu", "weight": 101}]}}))
                .is_some()
        );
        assert!(err(json!({"scoringStrategy": {"type": "RequestedToCapacityRatio"}})).is_some());
        assert!(
            err(
                json!({"scoringStrategy": {"type": "RequestedToCapacityRatio",
            "requestedToCapacityRatio": {"shape": [
                {"utilization": 50, "score": 1}, {"utilization": 40, "score": 2}]}}})
            )
            .is_some()
        );
        assert!(
            serde_json::from_value::<Args>(json!({"scoringStrategy": {"type": "Balanced"}}))
                .is_err()
        );
        assert_eq!(broken_linear(&[(0, 100), (50, 0), (100, 100)], 25), 50);
    }
}
