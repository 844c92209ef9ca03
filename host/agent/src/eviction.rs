//! The eviction manager, as the kubelet's: every `pressure_check` it reads the
//! node's signals ([`crate::pressure`]), and while a threshold is met — a hard one at
//! once, a soft one once it has held for its grace period — it evicts one pod, waits
//! until the pod's containers are stopped, and looks again.
//!
//! - The pods are ranked as the kubelet's `rankMemoryPressure`, `rankDiskPressure`
//!   and `rankPIDPressure` do, from the runtime's container and sandbox stats (CRI
//!   `ListContainerStats`, `ListPodSandboxStats`): for memory, the pods whose usage
//!   exceeds their request first (a BestEffort pod requests nothing), then the lower
//!   priority, then the larger usage above the request; for disk, the same with the
//!   pod's ephemeral storage (writable layers, logs, volumes on the node); for PIDs,
//!   the lower priority, then the more processes. Critical pods (static, mirror, or
//!   of priority `system-node-critical`/`system-cluster-critical`) are never evicted.
//! - The pod's worker ([`crate::worker`]) carries the eviction out: it stops the
//!   containers (a hard threshold gives them the kubelet's 1 s, a soft one the
//!   pod's grace period up to `--eviction-max-pod-grace-period`) and reports the pod
//!   `Failed`, reason `Evicted`, with the kubelet's message; this records the
//!   `Evicted` event.
//! - The pressure conditions hold while a threshold (hard or soft) is met and for
//!   `--eviction-pressure-transition-period` after, so that a node does not flap;
//!   a threshold once met holds until its signal is back above it by its minimum
//!   reclaim. While they hold, the node admits no new BestEffort pod under memory
//!   pressure and no new pod at all under disk or PID pressure, critical pods
//!   excepted ([`Evictions::admit`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_cri::v1 as cri;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tracing::{debug, info, warn};
use trellis_api::Shutdown;
use trellis_client::events::EventType;

use crate::Context;
use crate::labels::POD_UID;
use crate::pressure::{Condition, Pressure, Signal, Signals, Threshold};

/// The kubelet's status reason of evicted pods and pods refused under pressure.
pub const REASON: &str = "Evicted";
/// The grace period of a pod evicted for a hard threshold (the kubelet's
/// `immediateEvictionGracePeriodSeconds`).
const IMMEDIATE_GRACE: i64 = 1;
/// How long an eviction may take before the next pod is looked at (the kubelet's
/// `podCleanupTimeout`).
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Priorities from here on are critical (Kubernetes' `SystemCriticalPriority`).
const SYSTEM_CRITICAL_PRIORITY: i32 = 2_000_000_000;

/// What a pod's worker is asked to do when it is evicted.
#[derive(Clone, Debug, PartialEq)]
pub struct Eviction {
    /// The grace period of its containers' stop.
    pub grace: i64,
    /// The pod status's message.
    pub message: String,
}

/// Where the eviction manager and the pods' workers meet: the evictions asked for,
/// and the pressure conditions admission reads.
#[derive(Debug)]
pub struct Evictions {
    requests: Mutex<HashMap<String, Eviction>>,
    /// Changed at each request: every worker looks whether it is for its pod.
    requested: watch::Sender<u64>,
    /// Told when a worker has carried an eviction out.
    done: Notify,
    /// The pressure conditions that hold, with their transition period.
    conditions: watch::Sender<Pressure>,
}

impl Default for Evictions {
    fn default() -> Self {
        Self {
            requests: Mutex::default(),
            requested: watch::Sender::new(0),
            done: Notify::new(),
            conditions: watch::Sender::new(Pressure::default()),
        }
    }
}

impl Evictions {
    /// Changes whenever an eviction is asked for.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.requested.subscribe()
    }

    /// The eviction asked for pod `uid`, if any.
    pub fn requested(&self, uid: &str) -> Option<Eviction> {
        self.lock().get(uid).cloned()
    }

    /// Pod `uid`'s worker has stopped its containers and reported it evicted.
    pub fn done(&self, uid: &str) {
        if self.lock().remove(uid).is_some() {
            self.done.notify_waiters();
        }
    }

    /// The pressure conditions that hold now (as the Node reports them).
    pub fn conditions(&self) -> Pressure {
        *self.conditions.borrow()
    }

    /// Changes when the pressure conditions do (for the Node's status to be written
    /// at once).
    pub fn watch_conditions(&self) -> watch::Receiver<Pressure> {
        self.conditions.subscribe()
    }

    /// The kubelet's eviction admit handler: `Err` with the message a pod is refused
    /// with (reason [`REASON`]) while the node is under pressure.
    pub fn admit(&self, pod: &Pod) -> Result<(), String> {
        admit(&self.conditions(), pod)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Eviction>> {
        self.requests.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn request(&self, uid: &str, eviction: Eviction) {
        self.lock().insert(uid.to_owned(), eviction);
        self.requested.send_modify(|n| *n = n.wrapping_add(1));
    }
}

fn admit(conditions: &Pressure, pod: &Pod) -> Result<(), String> {
    if !conditions.any() || is_critical(pod) {
        return Ok(());
    }
    let only_memory = conditions.conditions() == [Condition::MemoryPressure];
    if only_memory
        && (crate::status::qos_class(pod) != "BestEffort"
            || tolerates_no_schedule(pod, "node.kubernetes.io/memory-pressure"))
    {
        return Ok(());
    }
    let names: Vec<&str> = conditions.conditions().iter().map(|c| c.name()).collect();
    Err(format!("The node had condition: [{}]. ", names.join(" ")))
}

/// Whether the pod tolerates the NoSchedule taint `key` (without a value).
fn tolerates_no_schedule(pod: &Pod, key: &str) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.tolerations.as_ref())
        .into_iter()
        .flatten()
        .any(|t| {
            let effect = t.effect.as_deref().unwrap_or_default();
            let effect_ok = effect.is_empty() || effect == "NoSchedule";
            let exists = t.operator.as_deref() == Some("Exists");
            let key_ok = match t.key.as_deref() {
                None | Some("") => exists,
                Some(k) => k == key,
            };
            let value_ok = exists || t.value.as_deref().unwrap_or_default().is_empty();
            effect_ok && key_ok && value_ok
        })
}

/// The kubelet's `IsCriticalPod`: a static or mirror pod, or one of a system
/// critical priority.
pub fn is_critical(pod: &Pod) -> bool {
    let annotations = pod.metadata.annotations.as_ref();
    let annotation = |key: &str| annotations.and_then(|a| a.get(key)).map(String::as_str);
    if annotation("kubernetes.io/config.source").is_some_and(|s| s != "api")
        || annotation("kubernetes.io/config.mirror").is_some()
    {
        return true;
    }
    let spec = pod.spec.as_ref();
    spec.and_then(|s| s.priority)
        .is_some_and(|p| p >= SYSTEM_CRITICAL_PRIORITY)
        || spec
            .and_then(|s| s.priority_class_name.as_deref())
            .is_some_and(|c| c == "system-node-critical" || c == "system-cluster-critical")
}

/// A threshold the manager watches.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Configured {
    signal: Signal,
    threshold: Threshold,
    /// `None` for a hard threshold; a soft one's grace period.
    grace: Option<Duration>,
}

/// The manager's memory between two checks.
#[derive(Debug, Default)]
struct State {
    /// The thresholds met at the last check: they hold until their minimum reclaim
    /// is back.
    met: Vec<Configured>,
    /// When each met threshold was first seen met, by signal and softness.
    first_observed: HashMap<(Signal, bool), Instant>,
    /// When each condition was last seen.
    conditions_last_observed: BTreeMap<Condition, Instant>,
}

/// The thresholds of the node's configuration.
fn configured(ctx: &Context) -> Vec<Configured> {
    let hard = ctx.config.eviction_hard.iter().flat_map(|t| t.iter());
    let hard = hard.map(|(signal, threshold)| Configured {
        signal,
        threshold,
        grace: None,
    });
    let soft = ctx
        .config
        .eviction_soft
        .iter()
        .map(|(signal, threshold)| Configured {
            signal,
            threshold,
            grace: Some(
                ctx.config
                    .eviction_soft_grace_period
                    .get(signal)
                    .unwrap_or_default(),
            ),
        });
    hard.chain(soft).collect()
}

impl State {
    /// The kubelet's `synchronize` up to the choice of a threshold: updates what is
    /// met and the conditions, and returns the thresholds whose grace period is over,
    /// the one to act on first.
    fn observe(
        &mut self,
        thresholds: &[Configured],
        signals: &Signals,
        reclaim: &crate::pressure::MinimumReclaim,
        transition: Duration,
        now: Instant,
    ) -> (Pressure, Vec<Configured>) {
        let mut met: Vec<Configured> = thresholds
            .iter()
            .filter(|t| signals.meets(t.signal, t.threshold, None))
            .copied()
            .collect();
        for t in &self.met {
            if !met.contains(t) && signals.meets(t.signal, t.threshold, reclaim.get(t.signal)) {
                met.push(*t);
            }
        }
        self.first_observed
            .retain(|key, _| met.iter().any(|t| (t.signal, t.grace.is_some()) == *key));
        for t in &met {
            self.first_observed
                .entry((t.signal, t.grace.is_some()))
                .or_insert(now);
        }
        for t in &met {
            self.conditions_last_observed
                .insert(t.signal.condition(), now);
        }
        let conditions: Pressure = self
            .conditions_last_observed
            .iter()
            .filter(|(_, seen)| now.duration_since(**seen) <= transition)
            .map(|(c, _)| *c)
            .collect();
        let mut ready: Vec<Configured> = met
            .iter()
            .filter(|t| {
                let first = self.first_observed[&(t.signal, t.grace.is_some())];
                now.duration_since(first) >= t.grace.unwrap_or_default()
            })
            .copied()
            .collect();
        // Memory first, hard before soft (the kubelet's `byEvictionPriority`).
        ready.sort_by_key(|t| (t.signal, t.grace.is_some()));
        self.met = met;
        (conditions, ready)
    }
}

/// Runs the eviction manager until `stopped`.
pub async fn run(ctx: Arc<Context>, stopped: Shutdown) {
    let thresholds = configured(&ctx);
    let imagefs = image_fs(&ctx).await;
    let api: Api<Pod> = Api::all(ctx.client.clone());
    // The informer the pods' workers are fed by (shared, not a second watch).
    let pods = ctx.informers.informer(
        api,
        watcher::Config::default().fields(&format!("spec.nodeName={}", ctx.config.node_name)),
    );
    let mut state = State::default();
    let mut check = tokio::time::interval(ctx.config.pressure_check);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = check.tick() => {}
            _ = stopped.wait() => return,
        }
        let signals = Signals::observe_with(&ctx.config.root, imagefs.as_deref());
        let (conditions, ready) = state.observe(
            &thresholds,
            &signals,
            &ctx.config.eviction_minimum_reclaim,
            ctx.config.eviction_pressure_transition_period,
            Instant::now(),
        );
        ctx.eviction.conditions.send_if_modified(|c| {
            let changed = *c != conditions;
            if changed {
                info!(node = %ctx.config.node_name, pressure = ?conditions, "eviction manager: the node's pressure changed");
            }
            *c = conditions;
            changed
        });
        let Some(threshold) = ready.first().copied() else {
            continue;
        };
        if !pods.has_synced() {
            continue;
        }
        let active: Vec<Arc<Pod>> = pods
            .list()
            .into_iter()
            .filter(|p| {
                let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
                p.metadata.deletion_timestamp.is_none()
                    && !matches!(phase, Some("Succeeded" | "Failed"))
                    && ctx
                        .eviction
                        .requested(p.metadata.uid.as_deref().unwrap_or_default())
                        .is_none()
            })
            .collect();
        if active.is_empty() {
            debug!(
                signal = threshold.signal.name(),
                "eviction manager: thresholds met, but no pod is active to evict"
            );
            continue;
        }
        let stats = pod_stats(&ctx, threshold.signal).await;
        let ranked = rank(threshold.signal, &active, stats.as_ref());
        let Some((pod, usage)) = ranked.into_iter().find(|(p, _)| {
            let critical = is_critical(p);
            if critical {
                warn!(pod = %p.metadata.name.as_deref().unwrap_or_default(), "eviction manager: cannot evict a critical pod");
            }
            !critical
        }) else {
            continue;
        };
        let message = message(threshold, &signals, &pod, usage);
        let grace = match threshold.grace {
            None => IMMEDIATE_GRACE,
            Some(_) => {
                let own = pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.termination_grace_period_seconds)
                    .unwrap_or(30);
                let max = ctx.config.eviction_max_pod_grace_period;
                if max < 0 { own } else { own.min(max) }
            }
        };
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        info!(pod = %pod.metadata.name.as_deref().unwrap_or_default(), signal = threshold.signal.name(), grace, "eviction manager: evicting");
        ctx.events
            .record(&*pod, EventType::Warning, REASON, &message);
        let done = ctx.eviction.done.notified();
        tokio::pin!(done);
        done.as_mut().enable();
        ctx.eviction.request(&uid, Eviction { grace, message });
        // The pod's containers stopped before the next is looked at.
        let deadline = Instant::now() + CLEANUP_TIMEOUT;
        while ctx.eviction.requested(&uid).is_some() {
            tokio::select! {
                _ = &mut done => {
                    done.set(ctx.eviction.done.notified());
                    done.as_mut().enable();
                }
                _ = tokio::time::sleep_until(deadline) => {
                    warn!(pod = %pod.metadata.name.as_deref().unwrap_or_default(), "eviction manager: timed out waiting for the evicted pod's cleanup");
                    break;
                }
                _ = stopped.wait() => return,
            }
        }
    }
}

/// Where the runtime keeps its images, if it says.
async fn image_fs(ctx: &Context) -> Option<PathBuf> {
    let mut images = ctx.cri.images.clone();
    let info = images
        .image_fs_info(cri::ImageFsInfoRequest {})
        .await
        .ok()?
        .into_inner();
    info.image_filesystems
        .into_iter()
        .filter_map(|fs| fs.fs_id)
        .map(|id| PathBuf::from(id.mountpoint))
        .find(|p| p.is_absolute())
}

/// A pod's usage of the resource of a signal, as the runtime reports it.
#[derive(Clone, Debug, Default, PartialEq)]
struct PodUsage {
    /// By container name: memory working set, or ephemeral storage, in bytes.
    containers: BTreeMap<String, u64>,
    /// The pod's processes.
    processes: u64,
}

impl PodUsage {
    fn total(&self) -> u64 {
        self.containers.values().sum()
    }
}

/// The usage of the node's pods by uid; `None` when the runtime gives no stats at all
/// (then no pod counts as without stats).
async fn pod_stats(ctx: &Context, signal: Signal) -> Option<HashMap<String, PodUsage>> {
    let mut runtime = ctx.cri.runtime.clone();
    let containers = match runtime
        .list_container_stats(cri::ListContainerStatsRequest { filter: None })
        .await
    {
        Ok(r) => r.into_inner().stats,
        Err(e) => {
            debug!(error = %e.message(), "eviction manager: no container stats");
            return None;
        }
    };
    let mut usage: HashMap<String, PodUsage> = HashMap::new();
    // The latest attempt of each container.
    let mut attempts: HashMap<(String, String), u32> = HashMap::new();
    for stats in containers {
        let Some(attributes) = stats.attributes else {
            continue;
        };
        let Some(uid) = attributes.labels.get(POD_UID).cloned() else {
            continue;
        };
        let (name, attempt) = attributes
            .metadata
            .map(|m| (m.name, m.attempt))
            .unwrap_or_default();
        let latest = attempts
            .entry((uid.clone(), name.clone()))
            .or_insert(attempt);
        if attempt < *latest {
            continue;
        }
        *latest = attempt;
        let bytes = match signal {
            Signal::MemoryAvailable => stats
                .memory
                .and_then(|m| m.working_set_bytes)
                .map_or(0, |v| v.value),
            _ => stats
                .writable_layer
                .and_then(|l| l.used_bytes)
                .map_or(0, |v| v.value),
        };
        usage.entry(uid).or_default().containers.insert(name, bytes);
    }
    if matches!(
        signal,
        Signal::NodefsAvailable | Signal::NodefsInodesFree | Signal::ImagefsAvailable
    ) {
        // Logs and volumes on the node are the pod's ephemeral storage too.
        for (uid, pod) in usage.iter_mut() {
            let volumes = dir_size(&ctx.config.root.join("pods").join(uid));
            let logs = std::fs::read_dir(ctx.config.root.join("logs"))
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| {
                    crate::paths::uid_of_pod_logs_dir(&e.file_name().to_string_lossy())
                        == Some(uid.as_str())
                })
                .map(|e| dir_size(&e.path()))
                .sum::<u64>();
            // Counted against the pod, not a container of it.
            pod.containers.insert(String::new(), volumes + logs);
        }
    }
    if signal == Signal::PidAvailable
        && let Ok(sandboxes) = runtime
            .list_pod_sandbox_stats(cri::ListPodSandboxStatsRequest { filter: None })
            .await
    {
        for stats in sandboxes.into_inner().stats {
            let uid = stats
                .attributes
                .as_ref()
                .and_then(|a| a.metadata.as_ref())
                .map(|m| m.uid.clone());
            let processes = stats
                .linux
                .and_then(|l| l.process)
                .and_then(|p| p.process_count)
                .map_or(0, |c| c.value);
            if let Some(uid) = uid {
                usage.entry(uid).or_default().processes += processes;
            }
        }
    }
    Some(usage)
}

/// The bytes of the files under `dir`.
fn dir_size(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_size(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// A pod's request of `resource` (the kubelet's `GetResourceRequestQuantity`): its
/// containers' sum, or its largest init container's when that is more.
fn request(pod: &Pod, resource: &str) -> u64 {
    let Some(spec) = &pod.spec else {
        return 0;
    };
    let of = |c: &k8s_openapi::api::core::v1::Container| {
        c.resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .and_then(|r| r.get(resource))
            .and_then(|q| trellis_quantity::Quantity::parse(&q.0).ok())
            .map_or(0, |q| u64::try_from(q.value()).unwrap_or(0))
    };
    let containers: u64 = spec.containers.iter().map(of).sum();
    let init = spec.init_containers.iter().flatten().map(of).max();
    containers.max(init.unwrap_or(0))
}

fn container_request(pod: &Pod, container: &str, resource: &str) -> u64 {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == container))
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get(resource))
        .and_then(|q| trellis_quantity::Quantity::parse(&q.0).ok())
        .map_or(0, |q| u64::try_from(q.value()).unwrap_or(0))
}

fn priority(pod: &Pod) -> i32 {
    pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)
}

/// The pods in the order they are evicted for `signal`, each with its usage (`None`:
/// the runtime had no stats of it).
fn rank(
    signal: Signal,
    pods: &[Arc<Pod>],
    stats: Option<&HashMap<String, PodUsage>>,
) -> Vec<(Arc<Pod>, Option<PodUsage>)> {
    let resource = signal.resource();
    let mut ranked: Vec<(Arc<Pod>, Option<PodUsage>)> = pods
        .iter()
        .map(|p| {
            let uid = p.metadata.uid.as_deref().unwrap_or_default();
            let usage = match stats {
                Some(stats) => stats.get(uid).cloned(),
                // No stats at all: every pod alike.
                None => Some(PodUsage::default()),
            };
            (p.clone(), usage)
        })
        .collect();
    ranked.sort_by(|(p1, u1), (p2, u2)| {
        // Pods without stats first, as the kubelet does.
        let found = u1.is_some().cmp(&u2.is_some());
        let by_priority = priority(p1).cmp(&priority(p2));
        match signal {
            Signal::PidAvailable => by_priority.then_with(|| {
                let n = |u: &Option<PodUsage>| u.as_ref().map_or(0, |u| u.processes);
                n(u2).cmp(&n(u1))
            }),
            _ => {
                let used = |u: &Option<PodUsage>| u.as_ref().map_or(0, PodUsage::total);
                let over =
                    |p: &Pod, u: &Option<PodUsage>| used(u) as i128 - request(p, resource) as i128;
                let exceeds = |p: &Pod, u: &Option<PodUsage>| over(p, u) > 0;
                found
                    .then_with(|| exceeds(p2, u2).cmp(&exceeds(p1, u1)))
                    .then_with(|| by_priority)
                    .then_with(|| over(p2, u2).cmp(&over(p1, u1)))
            }
        }
    });
    ranked
}

/// A byte count as Kubernetes writes a `BinarySI` quantity: `50Mi`, `1536Ki`, or
/// bytes when no binary suffix keeps it whole.
fn binary_si(n: u64) -> String {
    if n < 1024 {
        return trellis_quantity::Quantity::from_units(n as i64).to_string();
    }
    let mut value = n;
    let mut suffix = 0;
    while value.is_multiple_of(1024) && suffix < 6 {
        value /= 1024;
        suffix += 1;
    }
    format!(
        "{value}{}",
        ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"][suffix]
    )
}

/// The kubelet's eviction message: the resource, the threshold and what was
/// available, and the containers using more than they requested.
fn message(threshold: Configured, signals: &Signals, pod: &Pod, usage: Option<PodUsage>) -> String {
    let resource = threshold.signal.resource();
    let mut message = format!("The node was low on resource: {resource}. ");
    if let Some((available, capacity)) = signals.get(threshold.signal) {
        let quantity = threshold.threshold.quantity(capacity);
        let (quantity, available) = match threshold.signal {
            Signal::NodefsInodesFree | Signal::PidAvailable => {
                let decimal = |n: u64| trellis_quantity::Quantity::from_units(n as i64).to_string();
                (decimal(quantity), decimal(available))
            }
            _ => (binary_si(quantity), binary_si(available)),
        };
        message.push_str(&format!(
            "Threshold quantity: {quantity}, available: {available}. "
        ));
    }
    if !matches!(resource, "memory" | "ephemeral-storage") {
        return message;
    }
    let Some(usage) = usage else {
        return message;
    };
    for container in pod.spec.iter().flat_map(|s| s.containers.iter()) {
        let Some(&used) = usage.containers.get(&container.name) else {
            continue;
        };
        let requested = container_request(pod, &container.name, resource);
        if used > requested {
            message.push_str(&format!(
                "Container {} was using {}, request is {}, has larger consumption of {resource}. ",
                container.name,
                binary_si(used),
                if requested == 0 {
                    "0".to_owned()
                } else {
                    binary_si(requested)
                },
            ));
        }
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pressure::Thresholds;
    use serde_json::json;

    fn pod(name: &str, spec: serde_json::Value) -> Arc<Pod> {
        let mut pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "uid": name},
            "spec": spec,
        }))
        .unwrap();
        if pod.spec.is_none() {
            pod.spec = Some(Default::default());
        }
        Arc::new(pod)
    }

    fn with_memory(requests: serde_json::Value) -> serde_json::Value {
        json!({"containers": [{"name": "c", "resources": {"requests": requests}}]})
    }

    fn usage(bytes: u64) -> PodUsage {
        PodUsage {
            containers: [("c".to_owned(), bytes)].into(),
            processes: 0,
        }
    }

    fn names(ranked: &[(Arc<Pod>, Option<PodUsage>)]) -> Vec<&str> {
        ranked
            .iter()
            .map(|(p, _)| p.metadata.name.as_deref().unwrap_or_default())
            .collect()
    }

    #[test]
    fn memory_pressure_evicts_best_effort_then_burstable_over_request() {
        let best_effort = pod("best-effort", json!({"containers": [{"name": "c"}]}));
        let under = pod("under", with_memory(json!({"memory": "100Mi"})));
        let over = pod("over", with_memory(json!({"memory": "10Mi"})));
        let important = pod(
            "important",
            json!({"priority": 1000, "containers": [{"name": "c"}]}),
        );
        let pods = [
            under.clone(),
            important.clone(),
            over.clone(),
            best_effort.clone(),
        ];
        let stats: HashMap<String, PodUsage> = [
            ("best-effort".to_owned(), usage(5 << 20)),
            ("under".to_owned(), usage(50 << 20)),
            ("over".to_owned(), usage(30 << 20)),
            ("important".to_owned(), usage(500 << 20)),
        ]
        .into();
        let ranked = rank(Signal::MemoryAvailable, &pods, Some(&stats));
        // Over their requests first, by priority, then by how far over; the
        // high-priority BestEffort pod after the others over their requests.
        assert_eq!(
            names(&ranked),
            ["over", "best-effort", "important", "under"]
        );
        // Without any stats: a BestEffort pod is still the furthest over its request.
        let ranked = rank(Signal::MemoryAvailable, &[under, best_effort], None);
        assert_eq!(names(&ranked), ["best-effort", "under"]);
        // A pod the runtime has no stats of comes first.
        let ranked = rank(
            Signal::MemoryAvailable,
            &[over, important],
            Some(&HashMap::new()),
        );
        assert_eq!(names(&ranked).len(), 2);
    }

    #[test]
    fn pid_pressure_evicts_by_priority_then_processes() {
        let few = pod("few", json!({"containers": [{"name": "c"}]}));
        let many = pod("many", json!({"containers": [{"name": "c"}]}));
        let stats: HashMap<String, PodUsage> = [
            (
                "few".to_owned(),
                PodUsage {
                    processes: 2,
                    ..Default::default()
                },
            ),
            (
                "many".to_owned(),
                PodUsage {
                    processes: 200,
                    ..Default::default()
                },
            ),
        ]
        .into();
        let ranked = rank(Signal::PidAvailable, &[few, many], Some(&stats));
        assert_eq!(names(&ranked), ["many", "few"]);
    }

    #[test]
    fn the_message_is_the_kubelets() {
        let p = pod(
            "p",
            json!({"containers": [{"name": "x"}, {"name": "y",
            "resources": {"requests": {"memory": "100Mi"}}}]}),
        );
        let signals = Signals {
            memory: Some((50 << 20, 8 << 30)),
            ..Default::default()
        };
        let threshold = Configured {
            signal: Signal::MemoryAvailable,
            threshold: Threshold::Amount(100 << 20),
            grace: None,
        };
        let usage = PodUsage {
            containers: [("x".to_owned(), 10 << 20), ("y".to_owned(), 20 << 20)].into(),
            processes: 0,
        };
        assert_eq!(
            message(threshold, &signals, &p, Some(usage)),
            "The node was low on resource: memory. Threshold quantity: 100Mi, available: 50Mi. \
             Container x was using 10Mi, request is 0, has larger consumption of memory. "
        );
        assert_eq!(binary_si(1536), "1536");
        assert_eq!(binary_si(3 << 29), "1536Mi");
        assert_eq!(binary_si(1000), "1k");
    }

    #[test]
    fn soft_thresholds_wait_their_grace_and_conditions_their_transition() {
        let thresholds = [
            Configured {
                signal: Signal::MemoryAvailable,
                threshold: Threshold::Amount(100 << 20),
                grace: Some(Duration::from_secs(30)),
            },
            Configured {
                signal: Signal::PidAvailable,
                threshold: Threshold::Amount(100),
                grace: None,
            },
        ];
        let low = Signals {
            memory: Some((50 << 20, 8 << 30)),
            pids: Some((1000, 4096)),
            ..Default::default()
        };
        let roomy = Signals {
            memory: Some((4 << 30, 8 << 30)),
            ..low
        };
        let reclaim = Default::default();
        let transition = Duration::from_secs(300);
        let mut state = State::default();
        let t0 = Instant::now();
        let (conditions, ready) = state.observe(&thresholds, &low, &reclaim, transition, t0);
        // The condition at once; the eviction only after the grace period.
        assert!(conditions.memory && !conditions.pid);
        assert!(ready.is_empty());
        let (_, ready) = state.observe(
            &thresholds,
            &low,
            &reclaim,
            transition,
            t0 + Duration::from_secs(30),
        );
        assert_eq!(ready, [thresholds[0]]);
        // Back to roomy: no eviction, but the condition holds for the transition
        // period.
        let later = t0 + Duration::from_secs(60);
        let (conditions, ready) = state.observe(&thresholds, &roomy, &reclaim, transition, later);
        assert!(conditions.memory && ready.is_empty());
        let (conditions, _) = state.observe(
            &thresholds,
            &roomy,
            &reclaim,
            transition,
            later + Duration::from_secs(301),
        );
        assert_eq!(conditions, Pressure::default());
        let _ = Thresholds::none();
    }

    #[test]
    fn admission_under_pressure_is_the_kubelets() {
        let best_effort = pod("be", json!({"containers": [{"name": "c"}]}));
        let burstable = pod("bu", with_memory(json!({"memory": "10Mi"})));
        let tolerating = pod(
            "t",
            json!({"containers": [{"name": "c"}], "tolerations": [
                {"key": "node.kubernetes.io/memory-pressure", "operator": "Exists", "effect": "NoSchedule"}]}),
        );
        let critical = pod(
            "crit",
            json!({"priorityClassName": "system-node-critical", "containers": [{"name": "c"}]}),
        );
        let memory = Pressure {
            memory: true,
            ..Default::default()
        };
        assert_eq!(
            admit(&memory, &best_effort),
            Err("The node had condition: [MemoryPressure]. ".into())
        );
        assert_eq!(admit(&memory, &burstable), Ok(()));
        assert_eq!(admit(&memory, &tolerating), Ok(()));
        assert_eq!(admit(&memory, &critical), Ok(()));
        let disk = Pressure {
            memory: true,
            disk: true,
            pid: false,
        };
        assert_eq!(
            admit(&disk, &burstable),
            Err("The node had condition: [MemoryPressure DiskPressure]. ".into())
        );
        assert_eq!(admit(&Pressure::default(), &best_effort), Ok(()));
    }
}
