//! NodeAffinity: a pod fits only nodes that carry its `nodeSelector` labels and match
//! one of its required node affinity terms (PreFilter narrows the nodes when the
//! terms name them by `metadata.name`; Filter checks the rest), and nodes matching
//! its preferred terms score the sum of those terms' weights (Score, scaled to the
//! best node).

use std::collections::BTreeSet;

use trellis_plugin::k8s::api::core::v1::{
    NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PreferredSchedulingTerm,
};
use trellis_plugin::scheduler::{
    Cluster, ClusterEvent, NodeInfo, Plugin, PodInfo, Points, PreFilterResult, Status,
    default_normalize,
};

use crate::labels::{self, Labels};

pub struct NodeAffinity;

const REASON: &str = "node(s) didn't match Pod's node affinity/selector";
const CONFLICT: &str = "pod affinity terms conflict";
/// The one field a node selector term may match.
const NAME_FIELD: &str = "metadata.name";

/// Whether `term` selects `node`: all its label expressions and name fields hold. A
/// term with neither selects nothing, and so does a term Kubernetes would refuse to
/// parse, while the other terms still count (`LazyErrorNodeSelector`).
pub fn term_matches(term: &NodeSelectorTerm, node: &NodeInfo) -> bool {
    let expressions = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if expressions.is_empty() && fields.is_empty() {
        return false;
    }
    let labels = node.labels();
    expressions.iter().all(|r| {
        let values = r.values.as_deref().unwrap_or_default();
        labels::requirement(&r.key, &r.operator, values, &labels, true) == Ok(true)
    }) && fields.iter().all(|r| field_matches(r, node.name()))
}

/// A `matchFields` requirement: `In` or `NotIn` with exactly one value.
fn field_matches(r: &NodeSelectorRequirement, name: &str) -> bool {
    let [value] = r.values.as_deref().unwrap_or_default() else {
        return false;
    };
    // Fields other than the name read as empty, as a fields.Set does.
    let field = if r.key == NAME_FIELD { name } else { "" };
    match r.operator.as_str() {
        "In" => field == value,
        "NotIn" => field != value,
        _ => false,
    }
}

fn required_terms(pod: &PodInfo) -> Option<&NodeSelector> {
    pod.spec()?
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()
}

fn preferred_terms(pod: &PodInfo) -> &[PreferredSchedulingTerm] {
    pod.spec()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.preferred_during_scheduling_ignored_during_execution
                .as_deref()
        })
        .unwrap_or_default()
}

/// Whether `node` satisfies the pod's `nodeSelector` and required node affinity
/// (`nodeaffinity.GetRequiredNodeAffinity(pod).Match(node)`); PodTopologySpread
/// counts only such nodes by default.
pub fn required_matches(pod: &PodInfo, node: &NodeInfo) -> bool {
    let labels = node.labels();
    let selector_ok = pod
        .spec()
        .and_then(|s| s.node_selector.as_ref())
        .into_iter()
        .flatten()
        .all(|(k, v)| labels.label(k) == Some(v.as_str()));
    selector_ok
        && required_terms(pod)
            .is_none_or(|r| r.node_selector_terms.iter().any(|t| term_matches(t, node)))
}

/// The node names the required terms allow, when every term names its nodes:
/// `Some(names)` (empty when the terms contradict themselves), else `None`.
fn named_nodes(required: &NodeSelector) -> Option<BTreeSet<&str>> {
    let mut names = BTreeSet::new();
    for term in &required.node_selector_terms {
        let mut term_names: Option<BTreeSet<&str>> = None;
        for r in term.match_fields.iter().flatten() {
            if r.key != NAME_FIELD || r.operator != "In" {
                continue;
            }
            let these: BTreeSet<&str> = r.values.iter().flatten().map(String::as_str).collect();
            // Requirements of a term are ANDed.
            term_names = Some(match term_names {
                None => these,
                Some(before) => before.intersection(&these).copied().collect(),
            });
        }
        // A term without names lets any node through, as terms are ORed.
        names.extend(term_names?);
    }
    Some(names)
}

impl Plugin for NodeAffinity {
    fn name(&self) -> &'static str {
        "NodeAffinity"
    }

    fn points(&self) -> Points {
        Points {
            pre_filter: true,
            filter: true,
            pre_score: true,
            score: true,
            ..Points::default()
        }
    }

    fn weight(&self) -> u32 {
        2
    }

    fn events(&self) -> Vec<ClusterEvent> {
        vec![ClusterEvent::node_added_or_changed()]
    }

    fn pre_filter(&mut self, pod: &PodInfo, cluster: &Cluster) -> PreFilterResult {
        let required = required_terms(pod);
        let has_selector = pod.spec().is_some_and(|s| s.node_selector.is_some());
        let Some(required) = required else {
            return if has_selector {
                Status::success().into()
            } else {
                Status::skip().into()
            };
        };
        if required.node_selector_terms.is_empty() {
            return Status::success().into();
        }
        match named_nodes(required) {
            None => Status::success().into(),
            Some(names) if names.is_empty() => Status::unresolvable(CONFLICT).into(),
            Some(names) => PreFilterResult {
                status: Status::success(),
                nodes: Some(
                    cluster
                        .nodes()
                        .filter(|n| names.contains(n.name()))
                        .map(|n| n.id)
                        .collect(),
                ),
            },
        }
    }

    fn filter(&self, pod: &PodInfo, node: &NodeInfo, _: &Cluster) -> Status {
        if required_matches(pod, node) {
            Status::success()
        } else {
            Status::unresolvable(REASON)
        }
    }

    fn pre_score(&mut self, pod: &PodInfo, _: &[&NodeInfo], _: &Cluster) -> Status {
        if preferred_terms(pod).is_empty() {
            Status::skip()
        } else {
            Status::success()
        }
    }

    fn score(&self, pod: &PodInfo, node: &NodeInfo, _: &Cluster) -> Result<i64, String> {
        Ok(preferred_terms(pod)
            .iter()
            .filter(|t| t.weight != 0 && term_matches(&t.preference, node))
            .map(|t| i64::from(t.weight))
            .sum())
    }

    fn normalize(&self, scores: &mut [i64]) {
        default_normalize(scores, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{framework, node, pod};
    use serde_json::{Value, json};

    fn labelled(id: u32, labels: Value) -> trellis_plugin::scheduler::Change {
        node(id, json!({"metadata": {"labels": labels}}))
    }

    fn with_affinity(node_affinity: Value) -> PodInfo {
        pod(json!({"spec": {"containers": [], "affinity": {"nodeAffinity": node_affinity}}}))
    }

    fn required(terms: Value) -> PodInfo {
        with_affinity(json!({"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": terms}}))
    }

    #[test]
    fn node_selector_needs_every_label() {
        let mut fw = framework(vec![Box::new(NodeAffinity)]);
        fw.update([
            labelled(0, json!({"disk": "ssd"})),
            labelled(1, json!({"disk": "ssd", "zone": "a"})),
        ]);
        let p = |sel: Value| pod(json!({"spec": {"containers": [], "nodeSelector": sel}}));
        assert_eq!(
            fw.schedule(p(json!({"disk": "ssd", "zone": "a"}))),
            Ok("node-1".to_owned())
        );
        assert_eq!(
            fw.schedule(p(json!({"disk": "hdd"}))),
            Err(vec![(REASON.to_owned(), 2)])
        );
    }

    #[test]
    fn required_terms_are_ored_and_their_expressions_anded() {
        let cases = [
            (
                json!([{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}]),
                true,
            ),
            (
                json!([{"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]}]),
                false,
            ),
            (
                json!([{"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}]),
                true,
            ),
            (
                json!([{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]),
                false,
            ),
            (
                json!([{"matchExpressions": [{"key": "cores", "operator": "Gt", "values": ["8"]}]}]),
                true,
            ),
            (
                json!([{"matchExpressions": [{"key": "cores", "operator": "Lt", "values": ["8"]}]}]),
                false,
            ),
            // An empty term selects nothing; the other term still counts.
            (
                json!([{}, {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}]),
                true,
            ),
            (
                json!([{"matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a"]},
                {"key": "cores", "operator": "Lt", "values": ["8"]}]}]),
                false,
            ),
            (
                json!([{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["node-0"]}]}]),
                false,
            ),
        ];
        for (terms, fits) in cases {
            let mut fw = framework(vec![Box::new(NodeAffinity)]);
            fw.update([labelled(0, json!({"zone": "a", "cores": "16"}))]);
            let got = fw.schedule(required(terms.clone()));
            let want = if fits {
                Ok("node-0".to_owned())
            } else {
                Err(vec![(REASON.to_owned(), 1)])
            };
            assert_eq!(got, want, "{terms}");
        }
    }

    #[test]
    fn pre_filter_narrows_to_named_nodes() {
        let mut fw = framework(vec![Box::new(NodeAffinity)]);
        fw.update([
            labelled(0, json!({})),
            labelled(1, json!({})),
            labelled(2, json!({})),
        ]);
        let named = |names: Value| {
            json!({"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": names}]})
        };
        let result = fw.cycle(required(json!([
            named(json!(["node-1"])),
            named(json!(["node-2"]))
        ])));
        assert_eq!(result[0].1.nodes, Some(vec![1, 2]));
        let result = fw.cycle(required(json!([named(json!(["node-1"])),
            {"matchExpressions": [{"key": "x", "operator": "DoesNotExist"}]}])));
        assert_eq!(
            result[0].1.nodes, None,
            "a term without names allows every node"
        );
        let conflicting = required(json!([{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["node-1"]},
            {"key": "metadata.name", "operator": "In", "values": ["node-2"]}]}]));
        assert_eq!(
            fw.schedule(conflicting),
            Err(vec![(format!("NodeAffinity: {CONFLICT}"), 3)])
        );
        assert_eq!(fw.cycle(pod(json!({})))[0].1.status, Status::skip());
    }

    #[test]
    fn preferred_terms_add_their_weights() {
        let mut fw = framework(vec![Box::new(NodeAffinity)]);
        fw.update([
            labelled(0, json!({"zone": "a"})),
            labelled(1, json!({"zone": "a", "disk": "ssd"})),
            labelled(2, json!({})),
        ]);
        let p = with_affinity(json!({"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 2, "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}},
            {"weight": 6, "preference": {"matchExpressions": [{"key": "disk", "operator": "Exists"}]}}]}));
        fw.cycle(p.clone());
        // Raw 2, 8, 0, scaled to the best.
        assert_eq!(fw.score(&[0, 1, 2]), Ok(vec![(0, vec![25, 100, 0])]));
        assert_eq!(fw.schedule(p), Ok("node-1".to_owned()));
    }
}
