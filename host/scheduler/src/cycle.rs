//! One profile's scheduling cycle, through its plugin components' sessions.
//!
//! As kube-scheduler: PreFilter (a plugin may narrow the nodes), Filter over the
//! nodes starting where the last cycle stopped until enough feasible ones are found
//! (`percentageOfNodesToScore`), Score with weights (NormalizeScore is each plugin's
//! own, over the batch), the best node (ties broken at random), then Reserve and
//! Permit. A pod no node fits gets kube-scheduler's FitError message:
//! `0/5 nodes are available: 2 Insufficient cpu, 3 node(s) had untolerated taint {…}.`,
//! and [`preemption`] looks for room for it, through the cycle's
//! Filters run again without its victims (`DryRun`).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use rand::{Rng, SeedableRng};
use trellis_plugin_host::scheduler::{Code, ExtensionPoints, PermitVerdict, PluginInfo};
use trellis_plugin_host::{PluginHost, SchedulerSession};

use tracing::warn;

use crate::Component;
use crate::cache::{Cache, NodeId};
pub use crate::preemption::Nomination;
use crate::preemption::{self, DryRun};
use crate::queue::{Action, Event};

/// kube-scheduler's `minFeasibleNodesToFind`.
const MIN_FEASIBLE_NODES: usize = 100;
/// kube-scheduler's `minFeasibleNodesPercentageToFind`.
const MIN_FEASIBLE_PERCENTAGE: usize = 5;

/// What a cycle decided.
#[derive(Debug)]
pub enum Decision {
    Bind {
        node: String,
        node_id: NodeId,
    },
    /// No node fits; `plugins` rejected it (the queue moves it back on their events).
    /// `nomination`: where it fits once lower-priority pods there are preempted.
    Unschedulable {
        message: String,
        plugins: BTreeSet<String>,
        nomination: Option<Nomination>,
    },
    /// Permit plugins asked the pod to wait: it holds `node` until each component in
    /// `components` names it in `allowed`, or for `timeout` at most (then it is
    /// given up, as kube-scheduler's waiting pods are).
    Wait {
        node: String,
        node_id: NodeId,
        components: Vec<String>,
        timeout: Duration,
    },
    /// A plugin failed (trap, deadline, error status): the pod is retried.
    Error(String),
}

/// The longest a pod waits at Permit (kube-scheduler's `maxTimeout`).
const MAX_PERMIT_WAIT: Duration = Duration::from_secs(15 * 60);

/// A component as the profile runs it.
struct Slot {
    component: Component,
    session: Option<SchedulerSession>,
    infos: Vec<PluginInfo>,
    /// Score weight per plugin index.
    weights: Vec<i64>,
    points: ExtensionPoints,
}

impl Slot {
    /// One call of the component's session, timed under `point`: `Ok(None)` when
    /// the component sits this cycle out (no session, or a failure it ignores under
    /// `failurePolicy: Ignore`), `Err` with the cycle's error otherwise.
    async fn call<T>(
        &mut self,
        timings: &mut Vec<(String, &'static str, Duration)>,
        point: &'static str,
        f: impl AsyncFnOnce(&mut SchedulerSession) -> Result<T, trellis_plugin_host::PluginError>,
    ) -> Result<Option<T>, String> {
        let Some(session) = self.session.as_mut() else {
            return Ok(None);
        };
        let started = Instant::now();
        let answer = f(session).await;
        timings.push((self.label(), point, started.elapsed()));
        match answer {
            Ok(value) => Ok(Some(value)),
            Err(e) if self.component.ignore_failures => {
                warn!(plugin = %self.label(), "{e}; left out (failurePolicy Ignore)");
                Ok(None)
            }
            Err(e) => Err(e.to_string()),
        }
    }

    fn label(&self) -> String {
        self.component.plugin.name().to_owned()
    }

    fn plugin_name(&self, index: u32) -> String {
        self.infos
            .get(index as usize)
            .map_or_else(|| self.label(), |i| i.name.clone())
    }
}

/// One profile (`schedulerName`) and its components.
pub struct Profile {
    pub name: String,
    slots: Vec<Slot>,
    percentage: u32,
    /// Where the next cycle's Filter starts, so that every node gets its turn.
    next_start: usize,
    /// (component, extension point, duration) of the calls since the last take.
    timings: Vec<(String, &'static str, Duration)>,
    /// Events the plugins of sessions started since the last take wait for.
    interests: Vec<(String, HashSet<Event>)>,
    rng: rand::rngs::SmallRng,
}

/// How many feasible nodes a cycle looks for among `n` (kube-scheduler's
/// `numFeasibleNodesToFind`): all of them below 100, else a percentage (adaptive:
/// 50 − n/125, at least 5) but at least 100.
pub fn feasible_nodes_to_find(n: usize, percentage: u32) -> usize {
    if n < MIN_FEASIBLE_NODES {
        return n;
    }
    let percentage = match percentage as usize {
        0 => 50usize.saturating_sub(n / 125).max(MIN_FEASIBLE_PERCENTAGE),
        p if p >= 100 => return n,
        p => p,
    };
    (n * percentage / 100).max(MIN_FEASIBLE_NODES)
}

/// kube-scheduler's FitError message.
pub fn fit_error(nodes: usize, reasons: &BTreeMap<String, usize>) -> String {
    let mut parts: Vec<String> = reasons.iter().map(|(r, n)| format!("{n} {r}")).collect();
    parts.sort();
    format!("0/{nodes} nodes are available: {}.", parts.join(", "))
}

impl Profile {
    pub fn new(name: String, components: Vec<Component>, percentage: u32) -> Self {
        Self {
            name,
            slots: components
                .into_iter()
                .map(|component| Slot {
                    component,
                    session: None,
                    infos: Vec::new(),
                    weights: Vec::new(),
                    points: ExtensionPoints::empty(),
                })
                .collect(),
            percentage,
            next_start: 0,
            timings: Vec::new(),
            interests: Vec::new(),
            rng: rand::rngs::SmallRng::from_os_rng(),
        }
    }

    /// Adds `component`, or replaces the one of the same plugin name (its session
    /// starts again at the next cycle, with the whole cluster).
    pub fn set(&mut self, component: Component) {
        let slot = Slot {
            component,
            session: None,
            infos: Vec::new(),
            weights: Vec::new(),
            points: ExtensionPoints::empty(),
        };
        match self
            .slots
            .iter()
            .position(|s| s.component.plugin.name() == slot.component.plugin.name())
        {
            Some(at) => self.slots[at] = slot,
            None => self.slots.push(slot),
        }
    }

    /// Removes the component of this plugin name.
    pub fn remove(&mut self, name: &str) {
        self.slots.retain(|s| s.component.plugin.name() != name);
    }

    /// The calls' durations since the last take.
    pub fn take_timings(&mut self) -> Vec<(String, &'static str, Duration)> {
        std::mem::take(&mut self.timings)
    }

    /// The events the plugins of newly started sessions wait for.
    pub fn take_interests(&mut self) -> Vec<(String, HashSet<Event>)> {
        std::mem::take(&mut self.interests)
    }

    /// Brings every component's view up to date: the changes since the last cycle,
    /// or, for a new session (the first, one after a failure, or one on code that
    /// moved to its optimized tier), the whole cluster.
    async fn prepare(&mut self, host: &Arc<PluginHost>, cache: &mut Cache) -> Result<(), String> {
        let pending = cache.take_pending();
        for slot in &mut self.slots {
            let fresh = slot
                .session
                .as_ref()
                .is_none_or(|s| !s.is_alive() || s.outdated());
            let started = Instant::now();
            let result = match slot.session.as_mut() {
                Some(session) if !fresh => {
                    if pending.is_empty() {
                        continue;
                    }
                    let updated = session.update(&pending).await.map_err(|e| e.to_string());
                    self.timings
                        .push((slot.label(), "Update", started.elapsed()));
                    updated
                }
                _ => Self::start(slot, host, cache, &mut self.interests).await,
            };
            if let Err(e) = result {
                slot.session = None;
                if !slot.component.ignore_failures {
                    return Err(e);
                }
                warn!(plugin = %slot.label(), "{e}; left out (failurePolicy Ignore)");
            }
        }
        Ok(())
    }

    /// A new session for `slot`: its plugins, then the whole cluster.
    async fn start(
        slot: &mut Slot,
        host: &Arc<PluginHost>,
        cache: &Cache,
        interests: &mut Vec<(String, HashSet<Event>)>,
    ) -> Result<(), String> {
        slot.session = None;
        let mut session = slot
            .component
            .plugin
            .scheduler_session(host)
            .await
            .map_err(|e| e.to_string())?;
        let infos = session
            .plugins(&slot.component.configuration)
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("{} rejected its configuration: {e}", slot.label()))?;
        session
            .update(&cache.snapshot())
            .await
            .map_err(|e| e.to_string())?;
        slot.weights = infos
            .iter()
            .map(|i| {
                i64::from(
                    slot.component
                        .weights
                        .get(&i.name)
                        .copied()
                        .unwrap_or(i.weight),
                )
            })
            .collect();
        slot.points = infos
            .iter()
            .fold(ExtensionPoints::empty(), |all, i| all | i.points);
        for info in &infos {
            let mut events = HashSet::new();
            for e in &info.events {
                for (flag, action) in [
                    (trellis_plugin_host::scheduler::Action::ADD, Action::Add),
                    (
                        trellis_plugin_host::scheduler::Action::UPDATE,
                        Action::Update,
                    ),
                    (
                        trellis_plugin_host::scheduler::Action::DELETE,
                        Action::Delete,
                    ),
                ] {
                    if e.action.contains(flag) {
                        events.insert(Event {
                            resource: e.resource.clone(),
                            action,
                        });
                    }
                }
            }
            interests.push((info.name.clone(), events));
        }
        slot.infos = infos;
        slot.session = Some(session);
        Ok(())
    }

    /// One scheduling cycle for `pod`, on the nodes of `volume_nodes` only when given
    /// (those its volumes allow, see [`crate::volume_binding`]).
    pub async fn schedule(
        &mut self,
        host: &Arc<PluginHost>,
        cache: &mut Cache,
        pod: &Pod,
        volume_nodes: Option<HashSet<NodeId>>,
    ) -> Decision {
        if let Err(e) = self.prepare(host, cache).await {
            return Decision::Error(e);
        }
        let all = cache.node_ids();
        if all.is_empty() {
            return Decision::Unschedulable {
                message: "no nodes available to schedule pods".into(),
                plugins: BTreeSet::new(),
                nomination: None,
            };
        }
        let pod_json = crate::cache::pod_json(pod);
        let uid = pod.metadata.uid.clone().unwrap_or_default();

        // PreFilter.
        let mut only: Option<HashSet<NodeId>> = None;
        let mut narrowed_by = BTreeSet::new();
        for slot in &mut self.slots {
            let results = match slot
                .call(&mut self.timings, "PreFilter", async |s| {
                    s.cycle(&pod_json).await
                })
                .await
            {
                Ok(Some(results)) => results,
                Ok(None) => continue,
                Err(e) => return Decision::Error(e),
            };
            for r in results {
                let name = slot.plugin_name(r.plugin);
                match r.status.code {
                    Code::Success | Code::Skip => {}
                    Code::Unschedulable | Code::UnschedulableAndUnresolvable => {
                        return Decision::Unschedulable {
                            message: format!(
                                "0/{} nodes are available: {}.",
                                all.len(),
                                r.status.reasons.join(", ")
                            ),
                            plugins: BTreeSet::from([name]),
                            nomination: None,
                        };
                    }
                    Code::Error => {
                        return Decision::Error(format!(
                            "running PreFilter plugin {name:?}: {}",
                            r.status.reasons.join(", ")
                        ));
                    }
                }
                if let Some(nodes) = r.nodes {
                    let nodes: HashSet<NodeId> = nodes.into_iter().collect();
                    narrowed_by.insert(name);
                    only = Some(match only {
                        Some(prev) => prev.intersection(&nodes).copied().collect(),
                        None => nodes,
                    });
                }
            }
        }
        let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
        let mut rejecters: BTreeSet<String> = BTreeSet::new();
        let all_before_volumes = all.len();
        let all: Vec<NodeId> = match &volume_nodes {
            Some(set) => {
                let allowed: Vec<NodeId> =
                    all.iter().copied().filter(|n| set.contains(n)).collect();
                if allowed.len() < all.len() {
                    reasons.insert(
                        "node(s) had volume node affinity conflict".into(),
                        all.len() - allowed.len(),
                    );
                    rejecters.insert(crate::volume_binding::PLUGIN.into());
                }
                allowed
            }
            None => all,
        };
        let candidates: Vec<NodeId> = match &only {
            Some(set) => all.iter().copied().filter(|n| set.contains(n)).collect(),
            None => all.clone(),
        };
        if candidates.len() < all.len() {
            let names: Vec<&str> = narrowed_by.iter().map(String::as_str).collect();
            reasons.insert(
                format!("node(s) didn't satisfy plugin(s) [{}]", names.join(" ")),
                all.len() - candidates.len(),
            );
            rejecters.extend(narrowed_by);
        }

        // Filter, from where the last cycle stopped, until enough nodes fit.
        let to_find = feasible_nodes_to_find(candidates.len(), self.percentage);
        let len = candidates.len();
        let start = if len == 0 { 0 } else { self.next_start % len };
        let mut feasible: Vec<NodeId> = Vec::with_capacity(to_find);
        let mut unresolvable: HashSet<NodeId> = HashSet::new();
        let mut processed = 0;
        while processed < len && feasible.len() < to_find {
            let take = (to_find - feasible.len()).max(16).min(len - processed);
            let mut survivors: Vec<NodeId> = (0..take)
                .map(|i| candidates[(start + processed + i) % len])
                .collect();
            processed += take;
            for slot in &mut self.slots {
                if survivors.is_empty() {
                    break;
                }
                if !slot.points.contains(ExtensionPoints::FILTER) {
                    continue;
                }
                let rejected = match slot
                    .call(&mut self.timings, "Filter", async |s| {
                        s.filter(&survivors).await
                    })
                    .await
                {
                    Ok(Some(rejected)) => rejected,
                    Ok(None) => continue,
                    Err(e) => return Decision::Error(e),
                };
                if rejected.is_empty() {
                    continue;
                }
                let mut out = HashSet::with_capacity(rejected.len());
                for r in rejected {
                    if r.status.code == Code::Error {
                        return Decision::Error(format!(
                            "running Filter plugin {:?}: {}",
                            slot.plugin_name(r.plugin),
                            r.status.reasons.join(", ")
                        ));
                    }
                    if r.status.code == Code::UnschedulableAndUnresolvable {
                        unresolvable.insert(r.node);
                    }
                    for reason in r.status.reasons {
                        *reasons.entry(reason).or_default() += 1;
                    }
                    rejecters.insert(slot.plugin_name(r.plugin));
                    out.insert(r.node);
                }
                survivors.retain(|n| !out.contains(n));
            }
            feasible.extend(survivors);
        }
        if len > 0 {
            self.next_start = (start + processed) % len;
        }
        if feasible.is_empty() {
            let mut message = fit_error(all_before_volumes, &reasons);
            let nomination = if pod
                .spec
                .as_ref()
                .and_then(|s| s.preemption_policy.as_deref())
                == Some("Never")
            {
                None
            } else {
                match preemption::preempt(
                    self,
                    cache,
                    pod,
                    &candidates,
                    &unresolvable,
                    all_before_volumes,
                )
                .await
                {
                    Ok(nomination) => Some(nomination),
                    Err(why) => {
                        message.push_str(" preemption: ");
                        message.push_str(&why);
                        None
                    }
                }
            };
            return Decision::Unschedulable {
                message,
                plugins: rejecters,
                nomination,
            };
        }

        // Score.
        let chosen = if feasible.len() == 1 {
            feasible[0]
        } else {
            let mut totals = vec![0i64; feasible.len()];
            for slot in &mut self.slots {
                if !slot.points.contains(ExtensionPoints::SCORE) {
                    continue;
                }
                let scores = match slot
                    .call(&mut self.timings, "Score", async |s| {
                        s.score(&feasible).await
                    })
                    .await
                {
                    Ok(Some(Ok(scores))) => scores,
                    Ok(None) => continue,
                    Ok(Some(Err(_))) if slot.component.ignore_failures => continue,
                    Ok(Some(Err(e))) => {
                        return Decision::Error(format!(
                            "running Score plugins of {}: {e}",
                            slot.label()
                        ));
                    }
                    Err(e) => return Decision::Error(e),
                };
                for ps in scores {
                    let weight = slot.weights.get(ps.plugin as usize).copied().unwrap_or(1);
                    for (total, score) in totals.iter_mut().zip(ps.scores) {
                        *total += weight * score;
                    }
                }
            }
            // The best; among equals, one at random (reservoir sampling).
            let mut best = 0;
            let mut ties = 1u32;
            for i in 1..totals.len() {
                if totals[i] > totals[best] {
                    best = i;
                    ties = 1;
                } else if totals[i] == totals[best] {
                    ties += 1;
                    if self.rng.random_range(0..ties) == 0 {
                        best = i;
                    }
                }
            }
            feasible[best]
        };
        let Some(node) = cache.node_name(chosen).map(str::to_owned) else {
            return Decision::Error("the chosen node left the cache".into());
        };

        // Reserve, then Permit.
        for i in 0..self.slots.len() {
            if !self.slots[i].points.contains(ExtensionPoints::RESERVE) {
                continue;
            }
            let Some(session) = self.slots[i].session.as_mut() else {
                continue;
            };
            let status = match session.reserve(chosen).await {
                Ok(status) => status,
                Err(e) => {
                    self.unreserve_before(i, &uid, chosen).await;
                    return Decision::Error(e.to_string());
                }
            };
            if status.code != Code::Success {
                self.unreserve_before(i + 1, &uid, chosen).await;
                return Decision::Error(format!(
                    "running Reserve plugin {}: {}",
                    self.slots[i].label(),
                    status.reasons.join(", ")
                ));
            }
        }
        let mut waits = Vec::new();
        // kube-scheduler gives a waiting pod up when the first plugin's timer fires,
        // and no wait is longer than its 15 minutes.
        let mut timeout = MAX_PERMIT_WAIT;
        for i in 0..self.slots.len() {
            if !self.slots[i].points.contains(ExtensionPoints::PERMIT) {
                continue;
            }
            let Some(session) = self.slots[i].session.as_mut() else {
                continue;
            };
            let verdict = match session.permit(chosen).await {
                Ok(verdict) => verdict,
                Err(e) => {
                    self.unreserve(&uid, chosen).await;
                    return Decision::Error(e.to_string());
                }
            };
            match verdict {
                PermitVerdict::Allow => {}
                PermitVerdict::Deny(status) => {
                    self.unreserve(&uid, chosen).await;
                    let plugin = self.slots[i].label();
                    return Decision::Unschedulable {
                        message: format!(
                            "0/{} nodes are available: {}.",
                            all_before_volumes,
                            status.reasons.join(", ")
                        ),
                        plugins: BTreeSet::from([plugin]),
                        nomination: None,
                    };
                }
                PermitVerdict::Wait(ms) => {
                    // The component whose wait runs out first leads: the timeout's
                    // message names it.
                    let wait = Duration::from_millis(ms);
                    if wait < timeout {
                        timeout = wait;
                        waits.insert(0, self.slots[i].label());
                    } else {
                        waits.push(self.slots[i].label());
                    }
                }
            }
        }
        if !waits.is_empty() {
            return Decision::Wait {
                node,
                node_id: chosen,
                components: waits,
                timeout,
            };
        }
        Decision::Bind {
            node,
            node_id: chosen,
        }
    }

    /// The uids of pods waiting at the Permit of component `name` that it now
    /// allows; none if the component left the profile or failed to answer.
    pub async fn allowed(&mut self, name: &str) -> Vec<String> {
        let Some(slot) = self.slots.iter_mut().find(|s| s.label() == name) else {
            return Vec::new();
        };
        match slot
            .call(&mut self.timings, "Permit", async |s| s.allowed().await)
            .await
        {
            Ok(Some(uids)) => uids,
            Ok(None) => Vec::new(),
            Err(e) => {
                tracing::warn!(plugin = %name, error = %e, "asking which waiting pods are allowed failed");
                Vec::new()
            }
        }
    }

    /// Undoes the reservations of the components before `end`.
    async fn unreserve_before(&mut self, end: usize, uid: &str, node: NodeId) {
        for slot in self.slots[..end].iter_mut().rev() {
            if slot.points.contains(ExtensionPoints::RESERVE)
                && let Some(session) = slot.session.as_mut()
            {
                let _ = session.unreserve(uid, node).await;
            }
        }
    }

    /// Undoes a pod's reservation in every component (its Permit or bind failed).
    pub async fn unreserve(&mut self, uid: &str, node: NodeId) {
        let end = self.slots.len();
        self.unreserve_before(end, uid, node).await;
    }
}

/// Preemption's dry run: each component's Filter, with the victims gone.
impl DryRun for Profile {
    async fn fits_without(
        &mut self,
        victims: &[String],
        nodes: &[NodeId],
    ) -> Result<HashSet<NodeId>, String> {
        let mut fit: HashSet<NodeId> = nodes.iter().copied().collect();
        for slot in &mut self.slots {
            if !slot.points.contains(ExtensionPoints::FILTER) {
                continue;
            }
            let survivors: Vec<NodeId> =
                nodes.iter().copied().filter(|n| fit.contains(n)).collect();
            if survivors.is_empty() {
                break;
            }
            let rejected = slot
                .call(&mut self.timings, "PostFilter", async |s| {
                    s.filter_without(victims, &survivors).await
                })
                .await?;
            for r in rejected.into_iter().flatten() {
                fit.remove(&r.node);
            }
        }
        Ok(fit)
    }
}

impl std::fmt::Debug for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Profile")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feasible_nodes_to_find_follows_kube_scheduler() {
        assert_eq!(feasible_nodes_to_find(50, 0), 50);
        // Adaptive: 50 − 1000/125 = 42 %.
        assert_eq!(feasible_nodes_to_find(1000, 0), 420);
        // 50 − 5000/125 = 10 %.
        assert_eq!(feasible_nodes_to_find(5000, 0), 500);
        // Never below 5 % ...
        assert_eq!(feasible_nodes_to_find(10_000, 0), 500);
        // ... nor below 100 nodes.
        assert_eq!(feasible_nodes_to_find(150, 10), 100);
        assert_eq!(feasible_nodes_to_find(5000, 100), 5000);
    }

    #[test]
    fn fit_errors_read_as_kube_scheduler_writes_them() {
        let reasons = BTreeMap::from([
            ("Insufficient cpu".to_owned(), 4000),
            (
                "node(s) had untolerated taint {dedicated: gpu}".to_owned(),
                1000,
            ),
        ]);
        assert_eq!(
            fit_error(5000, &reasons),
            "0/5000 nodes are available: 1000 node(s) had untolerated taint {dedicated: gpu}, 4000 Insufficient cpu."
        );
    }
}
