//! PodTopologySpread: pods spread evenly over topology domains (zones, nodes, ...).
//! A `DoNotSchedule` constraint rejects a node where placing the pod would make its
//! domain hold more than `maxSkew` matching pods beyond the emptiest domain (PreFilter
//! counts the pods per domain once, Filter compares); `ScheduleAnyway` constraints,
//! and Kubernetes' default constraints for pods without any, favour the emptier
//! domains (PreScore counts, Score weighs, NormalizeScore puts the emptiest first).

use std::collections::{HashMap, HashSet};

use trellis_plugin::k8s::api::core::v1::TopologySpreadConstraint;
use trellis_plugin::k8s::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, LabelSelectorRequirement,
};
use trellis_plugin::scheduler::{
    Cluster, ClusterEvent, MAX_NODE_SCORE, NodeId, NodeInfo, Plugin, PodInfo, Points,
    PreFilterResult, Status,
};

use crate::labels::{self, Labels};
use crate::node_affinity::required_matches;
use crate::taint_toleration::untolerated_do_not_schedule;

const REASON: &str = "node(s) didn't match pod topology spread constraints";
const MISSING_LABEL: &str =
    "node(s) didn't match pod topology spread constraints (missing required label)";
const HOSTNAME: &str = "kubernetes.io/hostname";
const ZONE: &str = "topology.kubernetes.io/zone";
/// What Score gives a node the spreading ignores (one missing a topology key), so
/// that NormalizeScore, which sees scores only, can tell it apart; no count reaches it.
const IGNORED: i64 = i64::MIN;

/// A constraint of the pod being scheduled, with kube-scheduler's defaults applied.
struct Constraint {
    max_skew: i64,
    key: String,
    /// `None` selects nothing.
    selector: Option<LabelSelector>,
    min_domains: i64,
    /// `nodeAffinityPolicy: Honor` (the default): only nodes matching the pod's node
    /// selector and required affinity count.
    honor_affinity: bool,
    /// `nodeTaintsPolicy: Honor` (not the default): tainted nodes the pod does not
    /// tolerate do not count.
    honor_taints: bool,
}

impl Constraint {
    fn new(c: &TopologySpreadConstraint, pod: &PodInfo) -> Self {
        let mut selector = c.label_selector.clone();
        // `matchLabelKeys` adds the pod's own values of those keys to the selector;
        // a missing selector stays one that selects nothing.
        if let Some(selector) = &mut selector {
            for key in c.match_label_keys.iter().flatten() {
                if let Some(value) = pod.labels().label(key) {
                    selector
                        .match_expressions
                        .get_or_insert_with(Vec::new)
                        .push(LabelSelectorRequirement {
                            key: key.clone(),
                            operator: "In".to_owned(),
                            values: Some(vec![value.to_owned()]),
                        });
                }
            }
        }
        Self {
            max_skew: i64::from(c.max_skew),
            key: c.topology_key.clone(),
            selector,
            min_domains: i64::from(c.min_domains.unwrap_or(1)),
            honor_affinity: c
                .node_affinity_policy
                .as_deref()
                .is_none_or(|p| p == "Honor"),
            honor_taints: c.node_taints_policy.as_deref() == Some("Honor"),
        }
    }

    /// Whether the constraint counts pods at all: an empty selector counts none.
    fn counts_pods(&self) -> bool {
        let selector = self.selector.as_ref();
        selector.is_some() && !labels::is_everything(selector)
    }
}

/// Per constraint, the pods each node holds that the constraint counts (indexed by
/// node number): those of the pod's namespace, not terminating, that its selector
/// picks. One pass over the pods, rather than one per node and constraint.
fn count_per_node(pod: &PodInfo, cluster: &Cluster, constraints: &[Constraint]) -> Vec<Vec<i64>> {
    let slots = cluster
        .nodes()
        .map(|n| n.id as usize + 1)
        .max()
        .unwrap_or(0);
    let mut counts = vec![vec![0; slots]; constraints.len()];
    // Constraints sharing a selector (the default ones all do) share the counts.
    let first_alike: Vec<usize> = constraints
        .iter()
        .map(|c| {
            constraints
                .iter()
                .position(|d| d.selector == c.selector)
                .unwrap_or_default()
        })
        .collect();
    let namespace = pod.namespace();
    for (id, p) in cluster.pods() {
        if p.namespace() != namespace || p.pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let labels = p.labels();
        for (i, c) in constraints.iter().enumerate() {
            if first_alike[i] == i
                && c.counts_pods()
                && labels::matches(c.selector.as_ref(), &labels)
                && let Some(n) = counts[i].get_mut(id as usize)
            {
                *n += 1;
            }
        }
    }
    for (i, &first) in first_alike.iter().enumerate() {
        if first != i {
            counts[i] = counts[first].clone();
        }
    }
    counts
}

/// The pod's constraints with `whenUnsatisfiable: action`, or Kubernetes' default
/// constraints when it has none.
fn constraints(pod: &PodInfo, action: &str) -> Vec<Constraint> {
    let own = pod
        .spec()
        .and_then(|s| s.topology_spread_constraints.as_deref())
        .unwrap_or_default();
    if !own.is_empty() {
        return own
            .iter()
            .filter(|c| c.when_unsatisfiable == action)
            .map(|c| Constraint::new(c, pod))
            .collect();
    }
    // The system defaults are all ScheduleAnyway.
    if action != "ScheduleAnyway" {
        return Vec::new();
    }
    let Some(selector) = default_selector(pod) else {
        return Vec::new();
    };
    [(HOSTNAME, 3), (ZONE, 5)]
        .into_iter()
        .map(|(key, max_skew)| Constraint {
            max_skew,
            key: key.to_owned(),
            selector: Some(selector.clone()),
            min_domains: 1,
            honor_affinity: true,
            honor_taints: false,
        })
        .collect()
}

/// The selector of the default constraints. kube-scheduler merges the selectors of
/// the Services, ReplicaSets, StatefulSets and ReplicationControllers that select the
/// pod; this component sees none of those objects, so it approximates them by the
/// pod's own labels when a ReplicaSet, StatefulSet or ReplicationController controls
/// the pod (their selectors are usually the template's labels), and leaves pods that
/// only Services select unspread.
fn default_selector(pod: &PodInfo) -> Option<LabelSelector> {
    let controlled = pod.pod.metadata.owner_references.iter().flatten().any(|r| {
        r.controller == Some(true)
            && matches!(
                (r.api_version.as_str(), r.kind.as_str()),
                ("apps/v1", "ReplicaSet")
                    | ("apps/v1", "StatefulSet")
                    | ("v1", "ReplicationController")
            )
    });
    let labels = pod.labels().filter(|l| !l.is_empty())?;
    controlled.then(|| LabelSelector {
        match_labels: Some(labels.clone()),
        match_expressions: None,
    })
}

fn has_all_keys(node: &NodeInfo, constraints: &[Constraint]) -> bool {
    let labels = node.labels();
    constraints.iter().all(|c| labels.label(&c.key).is_some())
}

/// Whether the node counts for each constraint under its inclusion policies; the
/// node checks are made once per node, and only if a constraint needs them.
fn included<'c>(
    pod: &PodInfo,
    node: &NodeInfo,
    constraints: &'c [Constraint],
) -> impl Iterator<Item = (usize, &'c Constraint)> {
    let mut affinity = None;
    let mut taints = None;
    constraints.iter().enumerate().filter(move |(_, c)| {
        (!c.honor_affinity || *affinity.get_or_insert_with(|| required_matches(pod, node)))
            && (!c.honor_taints
                || *taints.get_or_insert_with(|| untolerated_do_not_schedule(pod, node).is_none()))
    })
}

fn add(counts: &mut HashMap<String, i64>, value: &str, n: i64) {
    match counts.get_mut(value) {
        Some(c) => *c += n,
        None => {
            counts.insert(value.to_owned(), n);
        }
    }
}

/// The cycle's state: what PreFilter and PreScore counted for the pod being
/// scheduled.
#[derive(Default)]
pub struct PodTopologySpread {
    /// The `DoNotSchedule` constraints.
    hard: Vec<Constraint>,
    /// Per hard constraint: matching pods per domain (topology value).
    hard_counts: Vec<HashMap<String, i64>>,
    /// Per hard constraint: the fewest matching pods in a domain.
    hard_min: Vec<i64>,
    /// The `ScheduleAnyway` (or default) constraints.
    soft: Vec<Constraint>,
    /// Per soft constraint but hostname: matching pods per domain of the nodes scored.
    soft_counts: Vec<HashMap<String, i64>>,
    /// Per soft constraint: matching pods per node, by node number (what a hostname
    /// constraint's domains hold).
    soft_per_node: Vec<Vec<i64>>,
    /// Per soft constraint: `ln(domains + 2)`, so that constraints with few domains
    /// are not drowned by those with many.
    soft_weights: Vec<f64>,
    /// Nodes scored that lack a topology key of the pod's own constraints.
    ignored: HashSet<NodeId>,
}

impl Plugin for PodTopologySpread {
    fn name(&self) -> &'static str {
        "PodTopologySpread"
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
        vec![
            crate::event("pods", true, true, true),
            crate::event("nodes", true, true, true),
        ]
    }

    fn pre_filter(&mut self, pod: &PodInfo, cluster: &Cluster) -> PreFilterResult {
        self.hard = constraints(pod, "DoNotSchedule");
        self.hard_counts = (0..self.hard.len()).map(|_| HashMap::new()).collect();
        if self.hard.is_empty() {
            self.hard_min.clear();
            return Status::skip().into();
        }
        let per_node = count_per_node(pod, cluster, &self.hard);
        for node in cluster.nodes() {
            if !has_all_keys(node, &self.hard) {
                continue;
            }
            let labels = node.labels();
            for (i, c) in included(pod, node, &self.hard) {
                let value = labels.label(&c.key).unwrap_or_default();
                let n = per_node[i].get(node.id as usize).copied().unwrap_or(0);
                add(&mut self.hard_counts[i], value, n);
            }
        }
        self.hard_min = self
            .hard_counts
            .iter()
            .map(|counts| {
                counts
                    .values()
                    .copied()
                    .min()
                    .unwrap_or(i64::from(i32::MAX))
            })
            .collect();
        Status::success().into()
    }

    fn filter(&self, pod: &PodInfo, node: &NodeInfo, _: &Cluster) -> Status {
        let labels = node.labels();
        for (i, c) in self.hard.iter().enumerate() {
            let Some(value) = labels.label(&c.key) else {
                return Status::unresolvable(MISSING_LABEL);
            };
            let counts = &self.hard_counts[i];
            // Fewer domains than `minDomains`: the emptiest is taken to hold none.
            let min = if (counts.len() as i64) < c.min_domains {
                0
            } else {
                self.hard_min[i]
            };
            let itself = i64::from(labels::matches(c.selector.as_ref(), &pod.labels()));
            let here = counts.get(value).copied().unwrap_or(0);
            if here + itself - min > c.max_skew {
                return Status::unschedulable(REASON);
            }
        }
        Status::success()
    }

    fn pre_score(&mut self, pod: &PodInfo, nodes: &[&NodeInfo], cluster: &Cluster) -> Status {
        self.ignored.clear();
        self.soft = constraints(pod, "ScheduleAnyway");
        if self.soft.is_empty() || cluster.nodes().next().is_none() {
            return Status::skip();
        }
        // Nodes missing a key are ignored for the pod's own constraints; with the
        // defaults, a node without a zone is still spread by hostname.
        let require_all = pod
            .spec()
            .and_then(|s| s.topology_spread_constraints.as_ref())
            .is_some_and(|c| !c.is_empty());
        self.soft_counts = (0..self.soft.len()).map(|_| HashMap::new()).collect();
        for node in nodes {
            if require_all && !has_all_keys(node, &self.soft) {
                self.ignored.insert(node.id);
                continue;
            }
            let labels = node.labels();
            for (i, c) in self.soft.iter().enumerate() {
                // Score counts hostname domains, one node each, itself.
                if c.key != HOSTNAME {
                    add(
                        &mut self.soft_counts[i],
                        labels.label(&c.key).unwrap_or_default(),
                        0,
                    );
                }
            }
        }
        let scored = nodes.len() - self.ignored.len();
        self.soft_weights = self
            .soft
            .iter()
            .zip(&self.soft_counts)
            .map(|(c, counts)| {
                let domains = if c.key == HOSTNAME {
                    scored
                } else {
                    counts.len()
                };
                ((domains + 2) as f64).ln()
            })
            .collect();
        self.soft_per_node = count_per_node(pod, cluster, &self.soft);
        for node in cluster.nodes() {
            if require_all && !has_all_keys(node, &self.soft) {
                continue;
            }
            let labels = node.labels();
            for (i, c) in included(pod, node, &self.soft) {
                let value = labels.label(&c.key).unwrap_or_default();
                // Only domains of the nodes scored are counted.
                if let Some(count) = self.soft_counts[i].get_mut(value) {
                    *count += self.soft_per_node[i]
                        .get(node.id as usize)
                        .copied()
                        .unwrap_or(0);
                }
            }
        }
        Status::success()
    }

    fn score(&self, _: &PodInfo, node: &NodeInfo, _: &Cluster) -> Result<i64, String> {
        if self.ignored.contains(&node.id) {
            return Ok(IGNORED);
        }
        let labels = node.labels();
        let mut score = 0.0;
        for (i, c) in self.soft.iter().enumerate() {
            let Some(value) = labels.label(&c.key) else {
                continue;
            };
            let count = if c.key == HOSTNAME {
                self.soft_per_node[i]
                    .get(node.id as usize)
                    .copied()
                    .unwrap_or(0)
            } else {
                self.soft_counts[i].get(value).copied().unwrap_or(0)
            };
            // `maxSkew - 1` waters down the differences a larger skew tolerates.
            score += count as f64 * self.soft_weights[i] + (c.max_skew - 1) as f64;
        }
        Ok(score.round() as i64)
    }

    /// The fewest matching pods scores best: `100 * (max + min - score) / max`.
    fn normalize(&self, scores: &mut [i64]) {
        let counted = || scores.iter().copied().filter(|s| *s != IGNORED);
        let min = counted().min().unwrap_or(i64::MAX);
        let max = counted().max().unwrap_or(0).max(0);
        for s in scores.iter_mut() {
            *s = if *s == IGNORED {
                0
            } else if max == 0 {
                MAX_NODE_SCORE
            } else {
                MAX_NODE_SCORE * (max + min - *s) / max
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{framework, node, placed, pod};
    use serde_json::{Value, json};
    use trellis_plugin::scheduler::Change;

    /// Node `id` in `zone`, with its hostname label; `extra` are more labels.
    fn zoned(id: u32, zone: &str, extra: Value) -> Change {
        let mut labels = json!({"kubernetes.io/hostname": format!("h{id}"), ZONE: zone});
        for (k, v) in extra.as_object().into_iter().flatten() {
            labels[k] = v.clone();
        }
        node(id, json!({"metadata": {"labels": labels}}))
    }

    fn web(name: &str) -> Value {
        json!({"metadata": {"name": name, "labels": {"app": "web"}}, "spec": {"containers": []}})
    }

    fn spread(constraint: Value) -> PodInfo {
        let mut p = web("p");
        p["spec"]["topologySpreadConstraints"] = json!([constraint]);
        pod(p)
    }

    fn zone_constraint(action: &str, extra: Value) -> Value {
        let mut c = json!({"maxSkew": 1, "topologyKey": ZONE, "whenUnsatisfiable": action,
            "labelSelector": {"matchLabels": {"app": "web"}}});
        for (k, v) in extra.as_object().into_iter().flatten() {
            c[k] = v.clone();
        }
        c
    }

    /// The nodes the filter rejects, with the reason.
    fn rejected(
        fw: &mut trellis_plugin::scheduler::Framework,
        p: PodInfo,
        nodes: &[u32],
    ) -> Vec<(u32, String)> {
        fw.cycle(p);
        fw.filter(nodes)
            .into_iter()
            .map(|r| (r.node, r.status.reasons.join(", ")))
            .collect()
    }

    #[test]
    fn max_skew_keeps_domains_within_reach_of_the_emptiest() {
        let mut fw = framework(vec![Box::new(PodTopologySpread::default())]);
        fw.update([
            zoned(0, "a", json!({})),
            zoned(1, "a", json!({})),
            zoned(2, "b", json!({})),
            placed(0, web("w1")),
            placed(1, web("w2")),
            // Another namespace, and terminating pods, do not count.
            placed(
                2,
                json!({"metadata": {"name": "w3", "namespace": "other", "labels": {"app": "web"}},
                "spec": {"containers": []}}),
            ),
            placed(
                2,
                json!({"metadata": {"name": "w4", "labels": {"app": "web"},
                "deletionTimestamp": "2024-01-01T00:00:00Z"}, "spec": {"containers": []}}),
            ),
        ]);
        let p = spread(zone_constraint("DoNotSchedule", json!({})));
        assert_eq!(
            rejected(&mut fw, p.clone(), &[0, 1, 2]),
            [(0, REASON.to_owned()), (1, REASON.to_owned())]
        );
        assert_eq!(fw.schedule(p), Ok("node-2".to_owned()));
    }

    #[test]
    fn a_node_without_the_topology_key_is_unresolvable() {
        let mut fw = framework(vec![Box::new(PodTopologySpread::default())]);
        fw.update([zoned(0, "a", json!({})), node(1, json!({}))]);
        let p = spread(zone_constraint("DoNotSchedule", json!({})));
        assert_eq!(
            rejected(&mut fw, p, &[0, 1]),
            [(1, MISSING_LABEL.to_owned())]
        );
    }

    #[test]
    fn fewer_domains_than_min_domains_count_the_minimum_as_zero() {
        let mut fw = framework(vec![Box::new(PodTopologySpread::default())]);
        fw.update([
            zoned(0, "a", json!({})),
            zoned(1, "b", json!({})),
            placed(0, web("w1")),
            placed(1, web("w2")),
        ]);
        let loose = spread(zone_constraint("DoNotSchedule", json!({})));
        assert_eq!(rejected(&mut fw, loose, &[0, 1]), []);
        let strict = spread(zone_constraint("DoNotSchedule", json!({"minDomains": 3})));
        assert_eq!(rejected(&mut fw, strict, &[0, 1]).len(), 2);
    }

    #[test]
    fn inclusion_policies_choose_the_nodes_counted() {
        let mut fw = framework(vec![Box::new(PodTopologySpread::default())]);
        fw.update([
            zoned(0, "a", json!({"pool": "x"})),
            zoned(1, "b", json!({"pool": "y"})),
            node(
                2,
                json!({"metadata": {"labels": {ZONE: "c", "pool": "x"}},
                "spec": {"taints": [{"key": "k", "value": "v", "effect": "NoSchedule"}]}}),
            ),
            placed(0, web("w1")),
            placed(1, web("w2")),
        ]);
        let with = |extra: Value| {
            let mut p = spread(zone_constraint("DoNotSchedule", extra)).pod;
            if let Some(spec) = &mut p.spec {
                spec.node_selector = Some([("pool".to_owned(), "x".to_owned())].into());
            }
            PodInfo::new(p)
        };
        // Honoring node affinity counts zones a (one pod) and c (none), not b.
        assert_eq!(
            rejected(&mut fw, with(json!({})), &[0, 1, 2]),
            [(0, REASON.to_owned())]
        );
        // Counting zone b too rules out b as well.
        let ignoring = with(json!({"nodeAffinityPolicy": "Ignore"}));
        assert_eq!(rejected(&mut fw, ignoring, &[0, 1, 2]).len(), 2);
        // Honoring taints leaves zone c out: zone a is the only domain.
        let taints = with(json!({"nodeTaintsPolicy": "Honor"}));
        assert_eq!(rejected(&mut fw, taints, &[0, 1, 2]), []);
        assert_eq!(fw.cycle(pod(json!({})))[0].1.status, Status::skip());
    }

    #[test]
    fn schedule_anyway_favours_the_emptier_domain() {
        let mut fw = framework(vec![Box::new(PodTopologySpread::default())]);
        fw.update([
            zoned(0, "a", json!({})),
            zoned(1, "b", json!({})),
            node(
                2,
                json!({"metadata": {"labels": {"kubernetes.io/hostname": "h2"}}}),
            ),
            placed(0, web("w1")),
            placed(0, web("w2")),
        ]);
        fw.cycle(spread(zone_constraint("ScheduleAnyway", json!({}))));
        // Zone a: 2 * ln(4) rounds to 3, zone b: 0; node 2 lacks a zone and is ignored.
        assert_eq!(fw.score(&[0, 1, 2]), Ok(vec![(0, vec![0, 100, 0])]));
    }

    #[test]
    fn default_constraints_spread_controlled_pods_by_hostname_and_zone() {
        let mut fw = framework(vec![Box::new(PodTopologySpread::default())]);
        fw.update([
            zoned(0, "a", json!({})),
            zoned(1, "a", json!({})),
            zoned(2, "b", json!({})),
            node(
                3,
                json!({"metadata": {"labels": {"kubernetes.io/hostname": "h3"}}}),
            ),
            placed(0, web("w1")),
            placed(0, web("w2")),
            placed(2, web("w3")),
        ]);
        let mut owned = web("p");
        owned["metadata"]["ownerReferences"] = json!([{"apiVersion": "apps/v1", "kind": "ReplicaSet",
            "name": "rs", "uid": "rs-uid", "controller": true}]);
        fw.cycle(pod(owned));
        // Raw: 2ln6+2 + 2ln5+4 = 13, 2 + 2ln5+4 = 9, ln6+2 + ln5+4 = 9, and 2 for
        // node 3, which has no zone (the zone's domains count its "" too).
        assert_eq!(
            fw.score(&[0, 1, 2, 3]),
            Ok(vec![(0, vec![15, 46, 46, 100])])
        );
        // A pod no controller owns is not spread by default.
        fw.cycle(pod(web("p")));
        assert_eq!(fw.score(&[0, 1, 2, 3]), Ok(vec![]));
    }
}
