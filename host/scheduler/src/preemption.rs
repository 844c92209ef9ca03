//! DefaultPreemption (PostFilter), apart from the cycle as kube-scheduler keeps
//! `preemption` apart from `schedule_one`: for a pod no node fits, the node where it
//! fits once lower-priority pods there are gone, and which of them must go. The
//! cycle runs it with a dry run of its Filters; the loop then deletes the victims.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;

use crate::cache::{Cache, NodeId};

/// DefaultPreemption's choice: the node a pod fits once the victims are gone.
#[derive(Debug)]
pub struct Nomination {
    pub node: String,
    pub victims: Vec<Arc<Pod>>,
}

/// How a preemption candidate's victims rank, the lowest best: PodDisruptionBudget
/// violations, the highest priority, the sum of priorities, their number.
type VictimsRank = (usize, i32, i64, usize);

/// kube-scheduler's `minCandidateNodesAbsolute`: nodes a preemption looks at, at least.
const MIN_CANDIDATES: usize = 100;
/// Candidates whose victims are reprieved one by one before the best is chosen.
const REPRIEVED_CANDIDATES: usize = 3;

/// The profile's Filters run again with some pods taken away: preemption's question
/// to the cycle.
pub(crate) trait DryRun {
    /// The nodes of `nodes` that every Filter of the profile passes with `victims`
    /// (uids) gone.
    async fn fits_without(
        &mut self,
        victims: &[String],
        nodes: &[NodeId],
    ) -> Result<HashSet<NodeId>, String>;
}

fn priority_of(pod: &Pod) -> i32 {
    pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)
}

/// DefaultPreemption (PostFilter), for a pod no node fits: among the nodes
/// that rejected it for reasons preemption can change, those where it fits once
/// its lower-priority pods are gone (one dry run for all of them); for the few
/// whose highest victim priority is lowest, the victims reprieved one by one,
/// highest priority first, as long as the pod still fits; then the node with the
/// lowest highest victim priority, the lowest sum, the fewest victims. The error
/// is kube-scheduler's "preemption: 0/N nodes are available: …" reasons.
pub(crate) async fn preempt(
    profile: &mut impl DryRun,
    cache: &Cache,
    pod: &Pod,
    candidates: &[NodeId],
    unresolvable: &HashSet<NodeId>,
    nodes: usize,
) -> Result<Nomination, String> {
    let priority = priority_of(pod);
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    let hopeless = nodes
        - candidates
            .iter()
            .filter(|n| !unresolvable.contains(n))
            .count();
    if hopeless > 0 {
        reasons.insert("Preemption is not helpful for scheduling.".into(), hopeless);
    }
    // Nothing of lower priority runs anywhere: no node has a victim.
    let by_node = if cache.has_pods_below(priority) {
        cache.pods_by_node()
    } else {
        Default::default()
    };
    let mut lower: Vec<(NodeId, Vec<Arc<Pod>>)> = Vec::new();
    let mut no_victims = 0;
    for &node in candidates.iter().filter(|n| !unresolvable.contains(n)) {
        let victims: Vec<Arc<Pod>> = cache
            .node_name(node)
            .and_then(|name| by_node.get(name))
            .map(|pods| {
                pods.iter()
                    .filter(|p| priority_of(p) < priority)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        if victims.is_empty() {
            no_victims += 1;
        } else {
            lower.push((node, victims));
        }
    }
    let limit = MIN_CANDIDATES.max(lower.len() / 10);
    lower.truncate(limit);
    let uid = |p: &Arc<Pod>| p.metadata.uid.clone().unwrap_or_default();
    let all_victims: Vec<String> = lower.iter().flat_map(|(_, v)| v.iter().map(uid)).collect();
    let nodes_tried: Vec<NodeId> = lower.iter().map(|(n, _)| *n).collect();
    let fit = profile.fits_without(&all_victims, &nodes_tried).await?;
    lower.retain(|(n, _)| fit.contains(n));
    no_victims += nodes_tried.len() - lower.len();
    if no_victims > 0 {
        reasons.insert(
            "No preemption victims found for incoming pod.".into(),
            no_victims,
        );
    }
    if lower.is_empty() {
        let mut parts: Vec<String> = reasons.iter().map(|(r, n)| format!("{n} {r}")).collect();
        parts.sort();
        return Err(format!(
            "0/{nodes} nodes are available: {}.",
            parts.join(", ")
        ));
    }
    // Highest victim priority first decides; reprieve the most promising few.
    lower.sort_by_key(|(_, v)| v.iter().map(|p| priority_of(p)).max().unwrap_or(0));
    lower.truncate(REPRIEVED_CANDIDATES);
    let mut best: Option<(VictimsRank, NodeId, Vec<Arc<Pod>>)> = None;
    for (node, mut victims) in lower {
        victims.sort_by_key(|p| std::cmp::Reverse(priority_of(p)));
        // As kube-scheduler: those whose eviction would break a
        // PodDisruptionBudget are reprieved first, then the others, highest
        // priority first within each; the violations left count against the node.
        let (violating, fine) = cache.split_by_budgets(victims);
        let breaking: HashSet<String> = violating.iter().map(uid).collect();
        let mut victims: Vec<Arc<Pod>> = violating.into_iter().chain(fine).collect();
        let mut i = 0;
        while i < victims.len() {
            let trial: Vec<String> = victims
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, p)| uid(p))
                .collect();
            if profile.fits_without(&trial, &[node]).await?.contains(&node) {
                victims.remove(i);
            } else {
                i += 1;
            }
        }
        let rank = (
            victims
                .iter()
                .filter(|p| breaking.contains(&uid(p)))
                .count(),
            victims
                .iter()
                .map(|p| priority_of(p))
                .max()
                .unwrap_or(i32::MIN),
            victims
                .iter()
                .map(|p| i64::from(priority_of(p)))
                .sum::<i64>(),
            victims.len(),
        );
        if best.as_ref().is_none_or(|(b, _, _)| rank < *b) {
            best = Some((rank, node, victims));
        }
    }
    let (_, node, victims) = best.ok_or_else(|| "no candidate left".to_owned())?;
    Ok(Nomination {
        node: cache.node_name(node).unwrap_or_default().to_owned(),
        victims,
    })
}
