//! TaintToleration: a node's `NoSchedule` and `NoExecute` taints keep off every pod
//! that does not tolerate them (Filter), and nodes with fewer untolerated
//! `PreferNoSchedule` taints score higher (Score, normalized so that the fewest is
//! best).

use trellis_plugin::k8s::api::core::v1::{Taint, Toleration};
use trellis_plugin::scheduler::{
    Cluster, ClusterEvent, NodeInfo, Plugin, PodInfo, Points, Status, default_normalize,
};

pub struct TaintToleration;

/// Whether `toleration` tolerates `taint`, as `Toleration.ToleratesTaint`: an empty
/// effect or key matches any, an empty operator is `Equal`.
pub fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    let effect = toleration.effect.as_deref().unwrap_or_default();
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    let key = toleration.key.as_deref().unwrap_or_default();
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match toleration.operator.as_deref().unwrap_or_default() {
        "" | "Equal" => {
            toleration.value.as_deref().unwrap_or_default()
                == taint.value.as_deref().unwrap_or_default()
        }
        "Exists" => true,
        _ => false,
    }
}

/// The first of the node's `NoSchedule`/`NoExecute` taints that no toleration of the
/// pod tolerates.
pub fn untolerated_do_not_schedule<'a>(pod: &PodInfo, node: &'a NodeInfo) -> Option<&'a Taint> {
    let tolerations = pod
        .spec()
        .and_then(|s| s.tolerations.as_deref())
        .unwrap_or_default();
    node.node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default()
        .iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .find(|t| !tolerations.iter().any(|tol| tolerates(tol, t)))
}

impl Plugin for TaintToleration {
    fn name(&self) -> &'static str {
        "TaintToleration"
    }

    fn points(&self) -> Points {
        Points {
            filter: true,
            score: true,
            ..Points::default()
        }
    }

    fn weight(&self) -> u32 {
        3
    }

    fn events(&self) -> Vec<ClusterEvent> {
        vec![ClusterEvent::node_added_or_changed()]
    }

    fn filter(&self, pod: &PodInfo, node: &NodeInfo, _: &Cluster) -> Status {
        match untolerated_do_not_schedule(pod, node) {
            None => Status::success(),
            Some(taint) => Status::unresolvable(format!(
                "node(s) had untolerated taint {{{}: {}}}",
                taint.key,
                taint.value.as_deref().unwrap_or_default()
            )),
        }
    }

    /// The number of `PreferNoSchedule` taints the pod does not tolerate. Only
    /// tolerations with that effect or none can match such a taint, which is the
    /// subset kube-scheduler's PreScore keeps.
    fn score(&self, pod: &PodInfo, node: &NodeInfo, _: &Cluster) -> Result<i64, String> {
        let tolerations = pod
            .spec()
            .and_then(|s| s.tolerations.as_deref())
            .unwrap_or_default();
        let taints = node
            .node
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_deref())
            .unwrap_or_default();
        Ok(taints
            .iter()
            .filter(|t| t.effect == "PreferNoSchedule")
            .filter(|t| !tolerations.iter().any(|tol| tolerates(tol, t)))
            .count() as i64)
    }

    fn normalize(&self, scores: &mut [i64]) {
        default_normalize(scores, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{framework, node, pod};
    use serde_json::{Value, json};

    fn tainted(id: u32, taints: Value) -> trellis_plugin::scheduler::Change {
        node(id, json!({"spec": {"taints": taints}}))
    }

    fn tolerating(tolerations: Value) -> PodInfo {
        pod(json!({"spec": {"containers": [], "tolerations": tolerations}}))
    }

    #[test]
    fn filter_rejects_untolerated_no_schedule_and_no_execute_taints() {
        let mut fw = framework(vec![Box::new(TaintToleration)]);
        fw.update([
            tainted(
                0,
                json!([{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}]),
            ),
            tainted(
                1,
                json!([{"key": "evict", "value": "now", "effect": "NoExecute"}]),
            ),
        ]);
        assert_eq!(
            fw.schedule(tolerating(json!([]))),
            Err(vec![
                (
                    "node(s) had untolerated taint {dedicated: gpu}".to_owned(),
                    1
                ),
                ("node(s) had untolerated taint {evict: now}".to_owned(), 1),
            ])
        );
    }

    #[test]
    fn tolerations_match_by_key_value_operator_and_effect() {
        let taint = json!([{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}]);
        let cases = [
            (
                json!([{"key": "dedicated", "operator": "Equal", "value": "gpu"}]),
                true,
            ),
            (
                json!([{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}]),
                true,
            ),
            (json!([{"key": "dedicated", "value": "cpu"}]), false),
            (json!([{"key": "dedicated", "operator": "Exists"}]), true),
            (json!([{"operator": "Exists"}]), true),
            (
                json!([{"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}]),
                false,
            ),
            (json!([{"key": "other", "operator": "Exists"}]), false),
        ];
        for (tolerations, fits) in cases {
            let mut fw = framework(vec![Box::new(TaintToleration)]);
            fw.update([tainted(0, taint.clone())]);
            let got = fw.schedule(tolerating(tolerations.clone()));
            assert_eq!(got.is_ok(), fits, "{tolerations}");
        }
    }

    #[test]
    fn prefer_no_schedule_taints_only_lower_the_score() {
        let mut fw = framework(vec![Box::new(TaintToleration)]);
        fw.update([
            tainted(
                0,
                json!([
                {"key": "a", "value": "1", "effect": "PreferNoSchedule"},
                {"key": "b", "value": "1", "effect": "PreferNoSchedule"}]),
            ),
            tainted(
                1,
                json!([{"key": "a", "value": "1", "effect": "PreferNoSchedule"}]),
            ),
            tainted(2, json!([])),
        ]);
        fw.cycle(tolerating(json!([])));
        assert_eq!(fw.score(&[0, 1, 2]), Ok(vec![(0, vec![0, 50, 100])]));
        // Tolerating `a` leaves one untolerated taint on node 0 and none elsewhere.
        fw.cycle(tolerating(
            json!([{"key": "a", "operator": "Exists", "effect": "PreferNoSchedule"}]),
        ));
        assert_eq!(fw.score(&[0, 1, 2]), Ok(vec![(0, vec![0, 100, 100])]));
        assert_eq!(fw.schedule(tolerating(json!([]))), Ok("node-2".to_owned()));
    }
}
