//! NodeResourcesBalancedAllocation: nodes whose CPU and memory would be requested in
//! like proportions score higher (Score: `(1 - std) * 100`, `std` the standard
//! deviation of the requested fractions), so that no resource runs out while another
//! idles. Unlike NodeResourcesFit it counts requests as they are, without defaults
//! for missing ones, and leaves out pods that request nothing.

use trellis_plugin::scheduler::{
    Cluster, ClusterEvent, MAX_NODE_SCORE, NodeInfo, Plugin, PodInfo, Points, Status,
};

use crate::node_resources_fit::{allocatable_and_requested, default_resources};

pub struct NodeResourcesBalancedAllocation {
    /// The resources balanced (kube-scheduler's `NodeResourcesBalancedAllocationArgs`;
    /// their weights play no part).
    resources: Vec<(String, i64)>,
}

impl Default for NodeResourcesBalancedAllocation {
    fn default() -> Self {
        Self {
            resources: default_resources(),
        }
    }
}

impl Plugin for NodeResourcesBalancedAllocation {
    fn name(&self) -> &'static str {
        "NodeResourcesBalancedAllocation"
    }

    fn points(&self) -> Points {
        Points {
            pre_score: true,
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

    /// Skips best-effort pods: they would pile onto whichever node is already most
    /// balanced (kubernetes/kubernetes#129138).
    fn pre_score(&mut self, pod: &PodInfo, _: &[&NodeInfo], _: &Cluster) -> Status {
        if self
            .resources
            .iter()
            .all(|(name, _)| pod.requests.get(name) == 0)
        {
            Status::skip()
        } else {
            Status::success()
        }
    }

    fn score(&self, pod: &PodInfo, node: &NodeInfo, _: &Cluster) -> Result<i64, String> {
        // Two passes over the few resources rather than a list per node.
        let fractions = || {
            self.resources.iter().filter_map(|(name, _)| {
                let (capacity, requested) = allocatable_and_requested(name, pod, node, true)?;
                Some((requested as f64 / capacity as f64).min(1.0))
            })
        };
        let (count, sum) = fractions().fold((0usize, 0.0), |(n, s), f| (n + 1, s + f));
        let std = match count {
            0 | 1 => 0.0,
            // The usual case, cpu and memory: half their difference.
            2 => {
                let mut two = fractions();
                let (a, b) = (two.next().unwrap_or(0.0), two.next().unwrap_or(0.0));
                ((a - b) / 2.0).abs()
            }
            n => {
                let mean = sum / n as f64;
                let variance = fractions().map(|f| (f - mean) * (f - mean)).sum::<f64>() / n as f64;
                variance.sqrt()
            }
        };
        Ok(((1.0 - std) * MAX_NODE_SCORE as f64) as i64)
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

    #[test]
    fn balanced_nodes_score_higher() {
        let mut fw = framework(vec![Box::new(NodeResourcesBalancedAllocation::default())]);
        fw.update([
            sized(0, json!({"cpu": "4", "memory": "10000", "pods": "10"})),
            sized(1, json!({"cpu": "6", "memory": "10000", "pods": "10"})),
            sized(2, json!({"cpu": "6", "memory": "10000", "pods": "10"})),
            placed(2, requesting("a", json!({"cpu": "3", "memory": "5000"}))),
        ]);
        fw.cycle(pod(requesting("p", json!({"cpu": "3", "memory": "5000"}))));
        // Fractions 0.75/0.5 (std 0.125), 0.5/0.5, and 1.0/1.0.
        assert_eq!(fw.score(&[0, 1, 2]), Ok(vec![(0, vec![87, 100, 100])]));
    }

    #[test]
    fn fractions_are_capped_and_missing_requests_count_nothing() {
        let mut fw = framework(vec![Box::new(NodeResourcesBalancedAllocation::default())]);
        fw.update([
            sized(0, json!({"cpu": "1", "memory": "10000", "pods": "10"})),
            // Counts nothing here, where NodeResourcesFit would count 100m and 200Mi.
            placed(0, requesting("a", json!({}))),
        ]);
        fw.cycle(pod(requesting("p", json!({"cpu": "2", "memory": "2000"}))));
        // CPU capped at 1.0, memory 0.2: std 0.4.
        assert_eq!(fw.score(&[0]), Ok(vec![(0, vec![60])]));
    }

    #[test]
    fn best_effort_pods_are_not_scored() {
        let mut fw = framework(vec![Box::new(NodeResourcesBalancedAllocation::default())]);
        fw.update([sized(0, json!({"cpu": "1", "memory": "1Gi", "pods": "10"}))]);
        fw.cycle(pod(json!({})));
        assert_eq!(fw.score(&[0]), Ok(vec![]));
    }
}
