//! InterPodAffinity: pods placed by the pods already there. Filter keeps the pod to
//! topology domains holding pods its required affinity selects, away from domains
//! holding pods its required anti-affinity selects, and away from domains whose pods'
//! required anti-affinity selects it; Score adds the weights of preferred terms both
//! ways (the pod's terms over existing pods, existing pods' terms over the pod) per
//! domain. PreFilter and PreScore count matches per (topology key, value) once per
//! cycle, so Filter and Score only look up the node's labels.
//!
//! Namespaces: a term selects pods in its `namespaces`, or the namespace of the pod
//! that has the term when it names none and has no `namespaceSelector`. A
//! `namespaceSelector` needs the namespaces' labels, which this component does not
//! see; it is evaluated against the one label the API server gives every namespace,
//! `kubernetes.io/metadata.name`. So `{}` selects every namespace and selectors on the
//! name are exact, while selectors on other namespace labels select nothing (or,
//! with `NotIn`/`DoesNotExist`, every namespace).

use std::collections::{BTreeMap, HashMap};

use trellis_plugin::k8s::api::core::v1::{PodAffinityTerm, WeightedPodAffinityTerm};
use trellis_plugin::scheduler::{
    Cluster, ClusterEvent, MAX_NODE_SCORE, NodeInfo, Plugin, PodInfo, Points, PreFilterResult,
    Status,
};

use crate::labels::{self, Labels, NamespaceLabels};

const AFFINITY: &str = "node(s) didn't match pod affinity rules";
const ANTI_AFFINITY: &str = "node(s) didn't match pod anti-affinity rules";
const EXISTING_ANTI_AFFINITY: &str = "node(s) didn't satisfy existing pods anti-affinity rules";
/// What an existing pod's required affinity term adds to the score of the domains it
/// would accept the pod in (`hardPodAffinityWeight`'s default).
const HARD_POD_AFFINITY_WEIGHT: i64 = 1;

/// Counts per topology key, then per value: nested so that lookups by a node's
/// labels need no owned key.
type TopologyCounts = HashMap<String, HashMap<String, i64>>;

fn add(counts: &mut TopologyCounts, key: &str, value: &str, n: i64) {
    let values = match counts.get_mut(key) {
        Some(values) => values,
        None => counts.entry(key.to_owned()).or_default(),
    };
    match values.get_mut(value) {
        Some(c) => *c += n,
        None => {
            values.insert(value.to_owned(), n);
        }
    }
}

fn get(counts: &TopologyCounts, key: &str, value: &str) -> i64 {
    counts
        .get(key)
        .and_then(|v| v.get(value))
        .copied()
        .unwrap_or(0)
}

fn required_affinity(pod: &PodInfo) -> &[PodAffinityTerm] {
    pod.spec()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.pod_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_deref()
        })
        .unwrap_or_default()
}

fn required_anti_affinity(pod: &PodInfo) -> &[PodAffinityTerm] {
    pod.spec()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.pod_anti_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_deref()
        })
        .unwrap_or_default()
}

fn preferred_affinity(pod: &PodInfo) -> &[WeightedPodAffinityTerm] {
    pod.spec()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.pod_affinity.as_ref())
        .and_then(|a| {
            a.preferred_during_scheduling_ignored_during_execution
                .as_deref()
        })
        .unwrap_or_default()
}

fn preferred_anti_affinity(pod: &PodInfo) -> &[WeightedPodAffinityTerm] {
    pod.spec()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.pod_anti_affinity.as_ref())
        .and_then(|a| {
            a.preferred_during_scheduling_ignored_during_execution
                .as_deref()
        })
        .unwrap_or_default()
}

/// Whether `term`, of a pod in namespace `owner`, selects `target`.
fn term_matches(term: &PodAffinityTerm, owner: &str, target: &PodInfo) -> bool {
    let namespace = target.namespace();
    let listed = term.namespaces.as_deref().unwrap_or_default();
    let in_namespaces = if listed.is_empty() && term.namespace_selector.is_none() {
        namespace == owner
    } else {
        listed.iter().any(|n| n == namespace)
    };
    (in_namespaces
        || labels::matches(
            term.namespace_selector.as_ref(),
            &NamespaceLabels(namespace),
        ))
        && labels::matches(term.label_selector.as_ref(), &target.labels())
}

/// The cycle's state: what PreFilter and PreScore counted for the pod being
/// scheduled.
#[derive(Default)]
pub struct InterPodAffinity {
    /// Existing pods whose required anti-affinity selects the pod, per domain.
    existing_anti: TopologyCounts,
    /// Existing pods matching all the pod's required affinity terms, per domain of
    /// each term.
    affinity: TopologyCounts,
    /// Existing pods matching one of the pod's required anti-affinity terms.
    anti: TopologyCounts,
    /// Preferred weights per domain, both ways.
    scores: TopologyCounts,
}

impl Plugin for InterPodAffinity {
    fn name(&self) -> &'static str {
        "InterPodAffinity"
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
            ClusterEvent::node_added_or_changed(),
        ]
    }

    fn pre_filter(&mut self, pod: &PodInfo, cluster: &Cluster) -> PreFilterResult {
        self.existing_anti.clear();
        self.affinity.clear();
        self.anti.clear();
        let affinity = required_affinity(pod);
        let anti = required_anti_affinity(pod);
        let namespace = pod.namespace();
        // A pod without required terms of its own is judged only by the existing
        // pods' anti-affinity: those with terms are indexed.
        let existing_pods: Box<dyn Iterator<Item = _>> = if affinity.is_empty() && anti.is_empty() {
            Box::new(cluster.pods_with_affinity())
        } else {
            Box::new(cluster.pods())
        };
        for (id, existing) in existing_pods {
            let Some(node) = cluster.node(id) else {
                continue;
            };
            let labels = node.labels();
            for term in required_anti_affinity(existing) {
                if let Some(value) = labels.label(&term.topology_key)
                    && term_matches(term, existing.namespace(), pod)
                {
                    add(&mut self.existing_anti, &term.topology_key, value, 1);
                }
            }
            if !affinity.is_empty()
                && affinity
                    .iter()
                    .all(|t| term_matches(t, namespace, existing))
            {
                for term in affinity {
                    if let Some(value) = labels.label(&term.topology_key) {
                        add(&mut self.affinity, &term.topology_key, value, 1);
                    }
                }
            }
            for term in anti {
                if let Some(value) = labels.label(&term.topology_key)
                    && term_matches(term, namespace, existing)
                {
                    add(&mut self.anti, &term.topology_key, value, 1);
                }
            }
        }
        if self.existing_anti.is_empty() && affinity.is_empty() && anti.is_empty() {
            Status::skip().into()
        } else {
            Status::success().into()
        }
    }

    fn filter(&self, pod: &PodInfo, node: &NodeInfo, _: &Cluster) -> Status {
        let labels = node.labels();
        let affinity = required_affinity(pod);
        let mut found = true;
        for term in affinity {
            let Some(value) = labels.label(&term.topology_key) else {
                return Status::unresolvable(AFFINITY);
            };
            found &= get(&self.affinity, &term.topology_key, value) > 0;
        }
        // The first pod of a group with affinity to itself would wait forever: it
        // may go where the topology keys exist if no pod anywhere matches and it
        // matches its own terms.
        let first_of_group = || {
            self.affinity.is_empty()
                && affinity
                    .iter()
                    .all(|t| term_matches(t, pod.namespace(), pod))
        };
        if !found && !first_of_group() {
            return Status::unresolvable(AFFINITY);
        }
        if !self.anti.is_empty() {
            for term in required_anti_affinity(pod) {
                if let Some(value) = labels.label(&term.topology_key)
                    && get(&self.anti, &term.topology_key, value) > 0
                {
                    return Status::unschedulable(ANTI_AFFINITY);
                }
            }
        }
        // Any of the node's labels may be an existing term's topology key; looking
        // up the few keys counted is the same test.
        for (key, values) in &self.existing_anti {
            if let Some(value) = labels.label(key)
                && values.get(value).is_some_and(|n| *n > 0)
            {
                return Status::unschedulable(EXISTING_ANTI_AFFINITY);
            }
        }
        Status::success()
    }

    fn pre_score(&mut self, pod: &PodInfo, nodes: &[&NodeInfo], cluster: &Cluster) -> Status {
        self.scores.clear();
        if nodes.is_empty() {
            return Status::skip();
        }
        let affinity = preferred_affinity(pod);
        let anti = preferred_anti_affinity(pod);
        let preferences = !affinity.is_empty() || !anti.is_empty();
        let namespace = pod.namespace();
        let scores = &mut self.scores;
        let mut process = |term: &PodAffinityTerm,
                           weight: i64,
                           owner: &str,
                           target: &PodInfo,
                           labels: &BTreeMap<String, String>| {
            if let Some(value) = labels.get(&term.topology_key)
                && term_matches(term, owner, target)
            {
                add(scores, &term.topology_key, value, weight);
            }
        };
        // Without preferences of its own, only pods with affinity terms matter: those
        // are indexed.
        let existing_pods: Box<dyn Iterator<Item = _>> = if preferences {
            Box::new(cluster.pods())
        } else {
            Box::new(cluster.pods_with_affinity())
        };
        for (id, existing) in existing_pods {
            let existing_has_affinity = existing.has_pod_affinity();
            // Without preferences of its own, only pods with affinity terms matter.
            if !preferences && !existing_has_affinity {
                continue;
            }
            let Some(labels) = cluster
                .node(id)
                .and_then(NodeInfo::labels)
                .filter(|l| !l.is_empty())
            else {
                continue;
            };
            for t in affinity {
                let w = i64::from(t.weight);
                process(&t.pod_affinity_term, w, namespace, existing, labels);
            }
            for t in anti {
                let w = -i64::from(t.weight);
                process(&t.pod_affinity_term, w, namespace, existing, labels);
            }
            if !existing_has_affinity {
                continue;
            }
            let owner = existing.namespace();
            for t in required_affinity(existing) {
                process(t, HARD_POD_AFFINITY_WEIGHT, owner, pod, labels);
            }
            for t in preferred_affinity(existing) {
                process(
                    &t.pod_affinity_term,
                    i64::from(t.weight),
                    owner,
                    pod,
                    labels,
                );
            }
            for t in preferred_anti_affinity(existing) {
                process(
                    &t.pod_affinity_term,
                    -i64::from(t.weight),
                    owner,
                    pod,
                    labels,
                );
            }
        }
        if self.scores.is_empty() {
            Status::skip()
        } else {
            Status::success()
        }
    }

    fn score(&self, _: &PodInfo, node: &NodeInfo, _: &Cluster) -> Result<i64, String> {
        let labels = node.labels();
        Ok(self
            .scores
            .iter()
            .filter_map(|(key, values)| values.get(labels.label(key)?).copied())
            .sum())
    }

    /// Scales to 0..=100 between the lowest and the highest score.
    fn normalize(&self, scores: &mut [i64]) {
        let min = scores.iter().copied().min().unwrap_or(0);
        let max = scores.iter().copied().max().unwrap_or(0);
        let spread = max - min;
        for s in scores.iter_mut() {
            *s = if spread > 0 {
                (MAX_NODE_SCORE as f64 * ((*s - min) as f64 / spread as f64)) as i64
            } else {
                0
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{framework, node, placed, pod};
    use serde_json::{Value, json};
    use trellis_plugin::scheduler::{Change, Framework};

    const ZONE: &str = "topology.kubernetes.io/zone";
    const HOST: &str = "kubernetes.io/hostname";

    fn zoned(id: u32, zone: &str) -> Change {
        node(
            id,
            json!({"metadata": {"labels": {HOST: format!("h{id}"), ZONE: zone}}}),
        )
    }

    /// A pod `name` labelled `app: app`, with `affinity` as its spec's.
    fn app(name: &str, app: &str, affinity: Value) -> Value {
        json!({"metadata": {"name": name, "labels": {"app": app}},
            "spec": {"containers": [], "affinity": affinity}})
    }

    fn term(app: &str, key: &str) -> Value {
        json!({"labelSelector": {"matchLabels": {"app": app}}, "topologyKey": key})
    }

    fn rejected(fw: &mut Framework, p: Value, nodes: &[u32]) -> Vec<(u32, String)> {
        fw.cycle(pod(p));
        fw.filter(nodes)
            .into_iter()
            .map(|r| (r.node, r.status.reasons.join(", ")))
            .collect()
    }

    fn three_nodes() -> Framework {
        let mut fw = framework(vec![Box::new(InterPodAffinity::default())]);
        fw.update([zoned(0, "a"), zoned(1, "a"), zoned(2, "b")]);
        fw
    }

    #[test]
    fn required_affinity_keeps_the_pod_in_domains_with_matching_pods() {
        let mut fw = three_nodes();
        fw.update([node(3, json!({})), placed(0, app("db", "db", json!({})))]);
        let p = app(
            "p",
            "web",
            json!({"podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [term("db", ZONE)]}}),
        );
        assert_eq!(
            rejected(&mut fw, p, &[0, 1, 2, 3]),
            [(2, AFFINITY.to_owned()), (3, AFFINITY.to_owned())]
        );
        // No pod matches yet, but the pod matches its own term: the first of its
        // group goes anywhere the key exists.
        let first = app(
            "p",
            "cache",
            json!({"podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [term("cache", ZONE)]}}),
        );
        assert_eq!(
            rejected(&mut fw, first, &[0, 1, 2, 3]),
            [(3, AFFINITY.to_owned())]
        );
    }

    #[test]
    fn required_anti_affinity_keeps_the_pod_from_matching_pods() {
        let mut fw = three_nodes();
        fw.update([placed(0, app("w1", "web", json!({})))]);
        let by_host = app(
            "p",
            "web",
            json!({"podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [term("web", HOST)]}}),
        );
        assert_eq!(
            rejected(&mut fw, by_host, &[0, 1, 2]),
            [(0, ANTI_AFFINITY.to_owned())]
        );
        let by_zone = app(
            "p",
            "web",
            json!({"podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [term("web", ZONE)]}}),
        );
        assert_eq!(
            rejected(&mut fw, by_zone, &[0, 1, 2]),
            [(0, ANTI_AFFINITY.to_owned()), (1, ANTI_AFFINITY.to_owned())]
        );
    }

    #[test]
    fn existing_pods_anti_affinity_keeps_the_pod_away() {
        let mut fw = three_nodes();
        fw.update([placed(
            2,
            app(
                "db",
                "db",
                json!({"podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [term("web", ZONE)]}}),
            ),
        )]);
        assert_eq!(
            rejected(&mut fw, app("p", "web", json!({})), &[0, 1, 2]),
            [(2, EXISTING_ANTI_AFFINITY.to_owned())]
        );
        assert_eq!(
            fw.cycle(pod(app("p", "cache", json!({}))))[0].1.status,
            Status::skip()
        );
    }

    #[test]
    fn terms_select_their_namespaces() {
        let mut fw = three_nodes();
        fw.update([placed(
            0,
            json!({"metadata": {"name": "db", "namespace": "prod",
            "labels": {"app": "db"}}, "spec": {"containers": []}}),
        )]);
        let with_term = |extra: Value| {
            let mut t = term("db", HOST);
            for (k, v) in extra.as_object().into_iter().flatten() {
                t[k] = v.clone();
            }
            app(
                "p",
                "web",
                json!({"podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [t]}}),
            )
        };
        let cases = [
            // The pod's own namespace, "", holds no db.
            (json!({}), false),
            (json!({"namespaces": ["prod"]}), true),
            (json!({"namespaces": ["dev"]}), false),
            (json!({"namespaceSelector": {}}), true),
            (
                json!({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "prod"}}}),
                true,
            ),
            (
                json!({"namespaceSelector": {"matchLabels": {"team": "x"}}}),
                false,
            ),
        ];
        for (extra, blocks) in cases {
            let got = rejected(&mut fw, with_term(extra.clone()), &[0, 1, 2]);
            assert_eq!(got.len(), usize::from(blocks), "{extra}");
        }
    }

    #[test]
    fn preferred_terms_score_both_ways() {
        let mut fw = three_nodes();
        fw.update([
            placed(0, app("db", "db", json!({}))),
            placed(1, app("w1", "web", json!({}))),
        ]);
        let p = app(
            "p",
            "web",
            json!({
            "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "podAffinityTerm": term("db", ZONE)}]},
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 5, "podAffinityTerm": term("web", HOST)}]}}),
        );
        fw.cycle(pod(p.clone()));
        // Raw 10, 10 - 5, 0.
        assert_eq!(fw.score(&[0, 1, 2]), Ok(vec![(0, vec![100, 50, 0])]));
        // An existing pod in zone b prefers web pods near it (20), and one on node 1
        // requires them (the hard weight, 1).
        fw.update([
            placed(
                2,
                app(
                    "cache",
                    "cache",
                    json!({"podAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 20, "podAffinityTerm": term("web", ZONE)}]}}),
                ),
            ),
            placed(
                1,
                app(
                    "proxy",
                    "proxy",
                    json!({"podAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [term("web", HOST)]}}),
                ),
            ),
        ]);
        fw.cycle(pod(p));
        // Raw 10, 6, 20: scaled between 6 and 20.
        assert_eq!(fw.score(&[0, 1, 2]), Ok(vec![(0, vec![28, 0, 100])]));
        fw.cycle(pod(app("q", "other", json!({}))));
        assert_eq!(fw.score(&[0, 1, 2]), Ok(vec![]), "nothing to score");
    }
}
