//! The [`Framework`] (kube-scheduler's `framework/runtime`): runs a component's
//! plugins at each extension point of a cycle, for the host or natively.

use std::collections::{BTreeMap, HashMap};

use super::cluster::{Change, Cluster};
use super::interface::{Code, Permit, Plugin, PreFilterResult, Status};
use super::types::{NodeId, NodeInfo, PodInfo};

/// A node a plugin rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub node: NodeId,
    /// The plugin's index in the component.
    pub plugin: u32,
    pub status: Status,
}

/// A component's plugins, its view of the cluster, and the pod of the current cycle:
/// what the `scheduler` world's calls run on.
pub struct Framework {
    pub cluster: Cluster,
    pub plugins: Vec<Box<dyn Plugin>>,
    pod: Option<PodInfo>,
    /// Pods reserved and not yet seen bound, for an `unreserve` after their cycle.
    reserved: HashMap<String, PodInfo>,
    /// Pods waiting at Permit, with the plugins that have not allowed them yet:
    /// reserved until allowed or given up, even once the host's view has them on
    /// their node (it holds a waiting pod's node).
    waiting: HashMap<String, (PodInfo, Vec<usize>)>,
    /// Plugins whose PreFilter or PreScore said skip in this cycle.
    skip_filter: Vec<bool>,
    skip_score: Vec<bool>,
}

impl Framework {
    pub fn new(plugins: Vec<Box<dyn Plugin>>) -> Self {
        Self {
            cluster: Cluster::default(),
            plugins,
            pod: None,
            reserved: HashMap::new(),
            waiting: HashMap::new(),
            skip_filter: Vec::new(),
            skip_score: Vec::new(),
        }
    }

    /// Applies changes; the ones that do not parse are returned, named.
    pub fn update(&mut self, changes: impl IntoIterator<Item = Change>) -> Vec<String> {
        changes
            .into_iter()
            .filter_map(|c| {
                // A reserved pod seen on its node (bound) or gone needs no unreserve.
                match &c {
                    Change::PodUpsert { uid, .. } => {
                        self.reserved.remove(uid);
                    }
                    Change::PodRemove(uid) => {
                        self.reserved.remove(uid);
                        self.waiting.remove(uid);
                    }
                    _ => {}
                }
                self.cluster.apply(c).err()
            })
            .collect()
    }

    /// Starts a cycle for `pod`: PreFilter of each plugin that has one, as
    /// `(plugin index, result)`.
    pub fn cycle(&mut self, pod: PodInfo) -> Vec<(u32, PreFilterResult)> {
        let n = self.plugins.len();
        self.skip_filter = vec![false; n];
        self.skip_score = vec![false; n];
        let mut out = Vec::new();
        for (i, p) in self.plugins.iter_mut().enumerate() {
            if !p.points().pre_filter {
                continue;
            }
            let result = p.pre_filter(&pod, &self.cluster);
            if result.status.code == Code::Skip {
                self.skip_filter[i] = true;
            }
            out.push((i as u32, result));
        }
        self.pod = Some(pod);
        out
    }

    /// The pod of the current cycle.
    pub fn pod(&self) -> Option<&PodInfo> {
        self.pod.as_ref()
    }

    /// Filter over `nodes`: each node stops at the first plugin that rejects it.
    pub fn filter(&self, nodes: &[NodeId]) -> Vec<Rejection> {
        let Some(pod) = &self.pod else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for &id in nodes {
            let Some(node) = self.cluster.node(id) else {
                out.push(Rejection {
                    node: id,
                    plugin: 0,
                    status: Status::unresolvable("node(s) were not found"),
                });
                continue;
            };
            for (i, p) in self.plugins.iter().enumerate() {
                if !p.points().filter || self.skip_filter[i] {
                    continue;
                }
                let status = p.filter(pod, node, &self.cluster);
                if !status.is_success() {
                    out.push(Rejection {
                        node: id,
                        plugin: i as u32,
                        status,
                    });
                    break;
                }
            }
        }
        out
    }

    /// Filter as if the pods `victims` were gone: they leave the view, PreFilter runs
    /// again on it for the pod of the cycle, Filter judges `nodes`; then the view and
    /// the PreFilter state are as before.
    pub fn filter_without(&mut self, victims: &[String], nodes: &[NodeId]) -> Vec<Rejection> {
        let Some(pod) = self.pod.take() else {
            return Vec::new();
        };
        let removed: Vec<(String, NodeId, PodInfo)> = victims
            .iter()
            .filter_map(|uid| {
                let (node, info) = self.cluster.pods.get(uid).cloned()?;
                self.cluster.remove_pod(uid);
                Some((uid.clone(), node, info))
            })
            .collect();
        self.cycle(pod.clone());
        let rejected = self.filter(nodes);
        for (uid, node, info) in removed {
            self.cluster.place_parsed(uid, node, info);
        }
        self.cycle(pod);
        rejected
    }

    /// PreScore and Score of every plugin with a Score, normalized: `(plugin, scores
    /// in the order of nodes)`.
    pub fn score(&mut self, nodes: &[NodeId]) -> Result<Vec<(u32, Vec<i64>)>, String> {
        let Some(pod) = &self.pod else {
            return Err("score before a cycle".into());
        };
        let infos: Vec<&NodeInfo> = nodes
            .iter()
            .filter_map(|id| self.cluster.node(*id))
            .collect();
        if infos.len() != nodes.len() {
            return Err("score of a node not in the view".into());
        }
        let mut out = Vec::new();
        for (i, p) in self.plugins.iter_mut().enumerate() {
            let points = p.points();
            if !points.score {
                continue;
            }
            if points.pre_score {
                let status = p.pre_score(pod, &infos, &self.cluster);
                match status.code {
                    Code::Skip => {
                        self.skip_score[i] = true;
                        continue;
                    }
                    Code::Success => {}
                    _ => return Err(format!("{}: {}", p.name(), status.reasons.join(", "))),
                }
            }
            let mut scores = Vec::with_capacity(infos.len());
            for node in &infos {
                scores.push(
                    p.score(pod, node, &self.cluster)
                        .map_err(|e| format!("{}: {e}", p.name()))?,
                );
            }
            p.normalize(&mut scores);
            out.push((i as u32, scores));
        }
        Ok(out)
    }

    pub fn reserve(&mut self, node: NodeId) -> Status {
        let (Some(pod), Some(info)) = (&self.pod, self.cluster.node(node)) else {
            return Status::error("reserve outside a cycle");
        };
        for i in 0..self.plugins.len() {
            if !self.plugins[i].points().reserve {
                continue;
            }
            let status = self.plugins[i].reserve(pod, info);
            if !status.is_success() {
                // Those reserved already are undone, in reverse, as kube-scheduler does.
                for p in self.plugins[..i].iter_mut().rev() {
                    if p.points().reserve {
                        p.unreserve(pod, info);
                    }
                }
                return status;
            }
        }
        if self.plugins.iter().any(|p| p.points().reserve) {
            self.reserved.insert(pod.uid.clone(), pod.clone());
        }
        Status::success()
    }

    pub fn unreserve(&mut self, uid: &str, node: NodeId) {
        let Some(info) = self.cluster.node(node) else {
            return;
        };
        let waiting = self.waiting.remove(uid).map(|(pod, _)| pod);
        let pod = match waiting.or_else(|| self.reserved.remove(uid)) {
            Some(pod) => pod,
            None => match &self.pod {
                Some(pod) if pod.uid == uid => pod.clone(),
                _ => return,
            },
        };
        for p in self.plugins.iter_mut().rev() {
            if p.points().reserve {
                p.unreserve(&pod, info);
            }
        }
    }

    /// Permit of each plugin with one: the first denial, else the shortest wait (the
    /// pod is given up when the first plugin's wait runs out, as kube-scheduler does).
    pub fn permit(&mut self, node: NodeId) -> Permit {
        let (Some(pod), Some(info)) = (&self.pod, self.cluster.node(node)) else {
            return Permit::Deny(Status::error("permit outside a cycle"));
        };
        let mut verdict = Permit::Allow;
        let mut waits = Vec::new();
        for (i, p) in self.plugins.iter_mut().enumerate() {
            if !p.points().permit {
                continue;
            }
            match p.permit(pod, info) {
                Permit::Allow => {}
                Permit::Deny(status) => return Permit::Deny(status),
                Permit::Wait(ms) => {
                    waits.push(i);
                    if !matches!(verdict, Permit::Wait(w) if w <= ms) {
                        verdict = Permit::Wait(ms);
                    }
                }
            }
        }
        if !waits.is_empty() {
            self.waiting.insert(pod.uid.clone(), (pod.clone(), waits));
        }
        verdict
    }

    /// Waiting pods that every plugin that made them wait now allows.
    pub fn allowed(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, p) in self.plugins.iter_mut().enumerate() {
            for uid in p.allowed() {
                let Some((_, waits)) = self.waiting.get_mut(&uid) else {
                    continue;
                };
                waits.retain(|w| *w != i);
                if waits.is_empty() {
                    self.waiting.remove(&uid);
                    out.push(uid);
                }
            }
        }
        out
    }

    /// Schedules `pod` natively, as the host would with every node sampled and
    /// weights from the plugins: the chosen node's name (ties go to the lowest
    /// number), or the reasons of every rejection (`reason` → node count), sorted.
    pub fn schedule(&mut self, pod: PodInfo) -> Result<String, Vec<(String, usize)>> {
        let prefilter = self.cycle(pod);
        let mut candidates: Vec<NodeId> = self.cluster.nodes().map(|n| n.id).collect();
        for (i, result) in &prefilter {
            match result.status.code {
                Code::Success | Code::Skip => {}
                _ => {
                    let name = self.plugins[*i as usize].name();
                    return Err(result
                        .status
                        .reasons
                        .iter()
                        .map(|r| (format!("{name}: {r}"), candidates.len()))
                        .collect());
                }
            }
            if let Some(only) = &result.nodes {
                candidates.retain(|n| only.contains(n));
            }
        }
        let rejected = self.filter(&candidates);
        if rejected.len() == candidates.len() {
            let mut counts: BTreeMap<String, usize> = BTreeMap::new();
            for r in &rejected {
                for reason in &r.status.reasons {
                    *counts.entry(reason.clone()).or_default() += 1;
                }
            }
            return Err(counts.into_iter().collect());
        }
        let feasible: Vec<NodeId> = candidates
            .into_iter()
            .filter(|n| !rejected.iter().any(|r| r.node == *n))
            .collect();
        let scores = self
            .score(&feasible)
            .map_err(|e| vec![(e, feasible.len())])?;
        let mut totals = vec![0i64; feasible.len()];
        for (plugin, s) in &scores {
            let weight = i64::from(self.plugins[*plugin as usize].weight());
            for (t, v) in totals.iter_mut().zip(s) {
                *t += weight * v;
            }
        }
        let best = (0..feasible.len())
            .max_by(|a, b| totals[*a].cmp(&totals[*b]).then(b.cmp(a)))
            .unwrap_or(0);
        Ok(self
            .cluster
            .node(feasible[best])
            .map(|n| n.name().to_owned())
            .unwrap_or_default())
    }
}
