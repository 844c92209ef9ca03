//! The scheduling queue, as kube-scheduler's: pods waiting to be scheduled in an
//! active queue ordered by priority (then by when they were queued: PrioritySort), a
//! backoff queue of pods that failed recently (1 s doubling to 10 s by default), and
//! the unschedulable pods, which wait for a cluster event one of the plugins that
//! rejected them declared, and at the latest for the flush interval (5 minutes).

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::time::Instant;

/// A pod's key: `namespace/name`.
pub type PodKey = Arc<str>;

/// The queue's timings (kube-scheduler's `podInitialBackoffSeconds`,
/// `podMaxBackoffSeconds`, and the unschedulable pods' flush).
#[derive(Clone, Copy, Debug)]
pub struct QueueSettings {
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    pub unschedulable_timeout: Duration,
}

impl Default for QueueSettings {
    fn default() -> Self {
        Self {
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(10),
            unschedulable_timeout: Duration::from_secs(300),
        }
    }
}

/// Where a pod waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Active,
    Backoff,
    Unschedulable,
    /// Popped, being scheduled or bound.
    InFlight,
}

/// A cluster event, as plugins declare the ones they wait for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Event {
    /// `nodes`, `pods`, ...
    pub resource: String,
    pub action: Action,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Add,
    Update,
    Delete,
}

struct Queued {
    pod: Arc<Pod>,
    place: Place,
    /// Failed attempts so far: the backoff doubles with each.
    attempts: u32,
    /// When it was first queued: the order among equal priorities.
    seq: u64,
    /// When its backoff ends.
    backoff_until: Instant,
    /// When it became unschedulable.
    since: Instant,
    /// The plugins that rejected it, whose events move it back.
    rejected_by: BTreeSet<String>,
    /// The scheduling cycle it was last popped in.
    cycle: u64,
}

/// The queue of one scheduler (all profiles).
pub struct SchedulingQueue {
    settings: QueueSettings,
    pods: HashMap<PodKey, Queued>,
    /// (priority, Reverse(seq)) order: highest priority, then oldest.
    active: BinaryHeap<(i32, Reverse<u64>, PodKey)>,
    backoff: BinaryHeap<Reverse<(Instant, u64, PodKey)>>,
    /// The events each plugin waits for.
    interests: HashMap<String, HashSet<Event>>,
    next_seq: u64,
    /// The unschedulable pods: what an event looks at, without a pass over every pod.
    waiting: HashSet<PodKey>,
    /// Pops so far, and the last one an event arrived in (kube-scheduler's
    /// `schedulingCycle` and `moveRequestCycle`): a pod that fails after an event
    /// that came during its cycle goes to backoff, not to the unschedulable pods, so
    /// the event is not missed.
    scheduling_cycle: u64,
    move_request_cycle: u64,
}

fn priority(pod: &Pod) -> i32 {
    pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)
}

impl SchedulingQueue {
    pub fn new(settings: QueueSettings) -> Self {
        Self {
            settings,
            pods: HashMap::new(),
            active: BinaryHeap::new(),
            backoff: BinaryHeap::new(),
            interests: HashMap::new(),
            next_seq: 0,
            waiting: HashSet::new(),
            scheduling_cycle: 0,
            move_request_cycle: 0,
        }
    }

    /// The events `plugin` waits for.
    pub fn set_interests(&mut self, plugin: &str, events: HashSet<Event>) {
        self.interests.insert(plugin.to_owned(), events);
    }

    /// Whether any plugin waits for `event`.
    pub fn wanted(&self, event: &Event) -> bool {
        self.interests.values().any(|events| events.contains(event))
    }

    /// A new pod to schedule, or one changed while waiting: an unschedulable pod
    /// whose spec or labels changed may fit now and is moved back.
    pub fn add_or_update(&mut self, key: PodKey, pod: Arc<Pod>, now: Instant) {
        match self.pods.get_mut(&key) {
            Some(q) => {
                let changed =
                    q.pod.spec != pod.spec || q.pod.metadata.labels != pod.metadata.labels;
                q.pod = pod;
                if q.place == Place::Unschedulable && changed {
                    self.requeue(&key, now);
                }
            }
            None => {
                let seq = self.next_seq;
                self.next_seq += 1;
                let p = priority(&pod);
                self.pods.insert(
                    key.clone(),
                    Queued {
                        pod,
                        place: Place::Active,
                        attempts: 0,
                        seq,
                        backoff_until: now,
                        since: now,
                        rejected_by: BTreeSet::new(),
                        cycle: 0,
                    },
                );
                self.active.push((p, Reverse(seq), key));
            }
        }
    }

    /// The pod is gone, bound elsewhere, or no longer this scheduler's.
    pub fn remove(&mut self, key: &str) {
        // Its heap entries are skipped when they come up.
        self.pods.remove(key);
        self.waiting.remove(key);
    }

    /// Moves pods whose backoff ended to the active queue, and unschedulable pods
    /// that waited the whole flush interval.
    pub fn tick(&mut self, now: Instant) {
        while let Some(Reverse((until, seq, key))) = self.backoff.peek().cloned() {
            if until > now {
                break;
            }
            self.backoff.pop();
            if let Some(q) = self.pods.get_mut(&key)
                && q.place == Place::Backoff
                && q.seq == seq
            {
                q.place = Place::Active;
                self.active.push((priority(&q.pod), Reverse(q.seq), key));
            }
        }
        let timeout = self.settings.unschedulable_timeout;
        let stale: Vec<PodKey> = self
            .waiting
            .iter()
            .filter(|k| {
                self.pods
                    .get(*k)
                    .is_some_and(|q| now.duration_since(q.since) >= timeout)
            })
            .cloned()
            .collect();
        for key in stale {
            self.requeue(&key, now);
        }
    }

    /// When [`tick`](Self::tick) next has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        let backoff = self.backoff.peek().map(|Reverse((t, _, _))| *t);
        let flush = self
            .waiting
            .iter()
            .filter_map(|k| self.pods.get(k))
            .map(|q| q.since + self.settings.unschedulable_timeout)
            .min();
        match (backoff, flush) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The next pod to schedule, now in flight.
    pub fn pop(&mut self) -> Option<(PodKey, Arc<Pod>)> {
        while let Some((_, Reverse(seq), key)) = self.active.pop() {
            let Some(q) = self.pods.get_mut(&key) else {
                continue;
            };
            if q.place != Place::Active || q.seq != seq {
                continue;
            }
            self.scheduling_cycle += 1;
            q.place = Place::InFlight;
            q.cycle = self.scheduling_cycle;
            return Some((key, q.pod.clone()));
        }
        None
    }

    /// The pod in flight did not fit: it waits for an event of one of `plugins`
    /// (the ones that rejected it), or goes to backoff if such an event came while it
    /// was being scheduled.
    pub fn unschedulable(&mut self, key: &str, plugins: BTreeSet<String>, now: Instant) {
        let Some(q) = self.pods.get_mut(key) else {
            return;
        };
        q.attempts += 1;
        q.rejected_by = plugins;
        q.backoff_until = now + backoff(self.settings, q.attempts);
        if self.move_request_cycle >= q.cycle {
            self.send_to_backoff(key, now);
        } else {
            q.place = Place::Unschedulable;
            q.since = now;
            if let Some((key, _)) = self.pods.get_key_value(key) {
                self.waiting.insert(key.clone());
            }
        }
    }

    /// The pod in flight failed for another reason (a plugin error, a failed bind):
    /// it is retried after its backoff.
    pub fn retry(&mut self, key: &str, now: Instant) {
        let Some(q) = self.pods.get_mut(key) else {
            return;
        };
        q.attempts += 1;
        q.backoff_until = now + backoff(self.settings, q.attempts);
        self.send_to_backoff(key, now);
    }

    /// The pod in flight was bound: it leaves the queue.
    pub fn done(&mut self, key: &str) {
        self.remove(key);
    }

    fn send_to_backoff(&mut self, key: &str, now: Instant) {
        self.waiting.remove(key);
        let Some((key, q)) = self.pods.get_key_value(key) else {
            return;
        };
        let key = key.clone();
        let (until, seq) = (q.backoff_until, q.seq);
        if until <= now {
            if let Some(q) = self.pods.get_mut(&key) {
                q.place = Place::Active;
                self.active.push((priority(&q.pod), Reverse(seq), key));
            }
            return;
        }
        if let Some(q) = self.pods.get_mut(&key) {
            q.place = Place::Backoff;
        }
        self.backoff.push(Reverse((until, seq, key)));
    }

    /// An unschedulable pod moved back: to backoff if its backoff has not ended.
    fn requeue(&mut self, key: &PodKey, now: Instant) {
        self.send_to_backoff(key, now);
    }

    /// A cluster event: unschedulable pods that a plugin waiting for it rejected are
    /// moved back; a pod in its cycle now goes to backoff if it fails.
    pub fn on_event(&mut self, event: &Event, now: Instant) {
        self.move_request_cycle = self.scheduling_cycle;
        let moved: Vec<PodKey> = self
            .waiting
            .iter()
            .filter(|key| {
                let Some(q) = self.pods.get(*key) else {
                    return false;
                };
                // No plugin named (a failure outside the plugins): any event; a
                // change of the plugins themselves: every pod.
                event.resource == "plugins"
                    || q.rejected_by.is_empty()
                    || q.rejected_by.iter().any(|p| {
                        self.interests
                            .get(p)
                            .is_none_or(|events| events.contains(event))
                    })
            })
            .cloned()
            .collect();
        for key in moved {
            self.requeue(&key, now);
        }
    }

    /// Pods by where they wait: (active, backoff, unschedulable).
    pub fn sizes(&self) -> (usize, usize, usize) {
        let mut sizes = (0, 0, 0);
        for q in self.pods.values() {
            match q.place {
                Place::Active => sizes.0 += 1,
                Place::Backoff => sizes.1 += 1,
                Place::Unschedulable => sizes.2 += 1,
                Place::InFlight => {}
            }
        }
        sizes
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }
}

/// The backoff after `attempts` failures: initial × 2^(attempts−1), capped.
fn backoff(settings: QueueSettings, attempts: u32) -> Duration {
    let factor = 1u32 << attempts.saturating_sub(1).min(16);
    settings
        .initial_backoff
        .saturating_mul(factor)
        .min(settings.max_backoff)
}

impl std::fmt::Debug for SchedulingQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulingQueue")
            .field("sizes", &self.sizes())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, priority: i32) -> (PodKey, Arc<Pod>) {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": [], "priority": priority},
        }))
        .unwrap();
        (Arc::from(format!("default/{name}")), Arc::new(pod))
    }

    fn settings() -> QueueSettings {
        QueueSettings {
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(10),
            unschedulable_timeout: Duration::from_secs(300),
        }
    }

    #[test]
    fn pops_by_priority_then_in_arrival_order() {
        let now = Instant::now();
        let mut q = SchedulingQueue::new(settings());
        for (name, p) in [("low", 0), ("high", 100), ("low2", 0), ("mid", 50)] {
            let (k, pod) = pod(name, p);
            q.add_or_update(k, pod, now);
        }
        let order: Vec<String> =
            std::iter::from_fn(|| q.pop().map(|(k, _)| k.to_string())).collect();
        assert_eq!(
            order,
            ["default/high", "default/mid", "default/low", "default/low2"]
        );
    }

    #[test]
    fn backoff_doubles_from_one_second_to_ten() {
        let s = settings();
        let got: Vec<u64> = (1..=6).map(|a| backoff(s, a).as_secs()).collect();
        assert_eq!(got, [1, 2, 4, 8, 10, 10]);
    }

    #[test]
    fn an_unschedulable_pod_moves_on_an_event_its_plugin_waits_for_and_after_its_backoff() {
        let now = Instant::now();
        let mut q = SchedulingQueue::new(settings());
        q.set_interests(
            "NodeResourcesFit",
            HashSet::from([Event {
                resource: "nodes".into(),
                action: Action::Add,
            }]),
        );
        let (k, p) = pod("a", 0);
        q.add_or_update(k.clone(), p, now);
        q.pop().unwrap();
        q.unschedulable(&k, BTreeSet::from(["NodeResourcesFit".to_owned()]), now);
        assert_eq!(q.sizes(), (0, 0, 1));
        // An event it does not wait for leaves it.
        q.on_event(
            &Event {
                resource: "pods".into(),
                action: Action::Add,
            },
            now,
        );
        assert_eq!(q.sizes(), (0, 0, 1));
        // One it waits for moves it, to backoff first (1 s after the failure).
        q.on_event(
            &Event {
                resource: "nodes".into(),
                action: Action::Add,
            },
            now,
        );
        assert_eq!(q.sizes(), (0, 1, 0));
        assert!(q.pop().is_none());
        q.tick(now + Duration::from_secs(1));
        assert_eq!(q.pop().map(|(k, _)| k), Some(k));
    }

    #[test]
    fn an_event_during_the_cycle_sends_a_failure_to_backoff_and_the_flush_frees_the_rest() {
        let now = Instant::now();
        let mut q = SchedulingQueue::new(settings());
        let (a, pa) = pod("a", 0);
        let (b, pb) = pod("b", 0);
        q.add_or_update(a.clone(), pa, now);
        q.add_or_update(b.clone(), pb, now);
        q.pop().unwrap();
        q.on_event(
            &Event {
                resource: "nodes".into(),
                action: Action::Update,
            },
            now,
        );
        q.unschedulable(&a, BTreeSet::new(), now);
        assert_eq!(q.sizes(), (1, 1, 0));
        q.pop().unwrap();
        q.unschedulable(&b, BTreeSet::new(), now);
        assert_eq!(q.sizes(), (0, 1, 1));
        assert_eq!(q.next_deadline(), Some(now + Duration::from_secs(1)));
        q.tick(now + Duration::from_secs(300));
        assert_eq!(q.sizes(), (2, 0, 0));
    }
}
