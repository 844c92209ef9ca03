//! Trellis' scheduler: kube-scheduler's scheduling framework, whose extension points
//! are WebAssembly components of the `scheduler` world (`wit/scheduler`).
//!
//! - [`queue`]: activeQ by priority, backoffQ, unschedulable pods moved back on the
//!   events their rejecting plugins declared (and after the flush interval).
//! - [`cache`]: nodes and the pods on them (bound or assumed), and the changes the
//!   plugins' views are sent.
//! - [`framework`]: one scheduling cycle of a profile: PreFilter, Filter over a
//!   sample of the nodes (`percentageOfNodesToScore`), Score with weights, Reserve,
//!   Permit; then the bind, asynchronously.
//! - this module: the loop that feeds them from the informers and binds.
//!
//! Each plugin component runs in a [`trellis_plugin_host::SchedulerSession`] of the
//! scheduler's own: the component keeps its view of the cluster between cycles, the
//! pod crosses once per cycle, and Filter and Score take batches of nodes.

pub mod cache;
pub mod framework;
pub mod metrics;
pub mod queue;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use trellis_api::Shutdown;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, info, warn};
use trellis_client::events::{EventRecorder, EventType};
use trellis_client::informer::{Change, SharedInformers};
use trellis_plugin_host::{Plugin, PluginHost};

pub use framework::{Decision, Profile};
pub use metrics::SchedulerMetrics;
pub use queue::QueueSettings;

use crate::queue::{Action, Event, PodKey, SchedulingQueue};

/// kube-scheduler's default plugins as one component of the `scheduler` world, built
/// from `plugins/scheduler/default-plugins`.
pub const DEFAULT_PLUGINS: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/default-plugins.wasm"));

/// A component of the scheduler world that does no work (`plugins/fixtures/
/// scheduler-empty`): `trellis bench scheduler` times it on the default plugins'
/// calls to tell the WASM boundary's cost from the plugins' own work.
pub const EMPTY_PLUGIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/scheduler-empty.wasm"));

/// Binds in flight at once.
const BINDS_IN_FLIGHT: usize = 64;
/// Tries of a bind answered 429 (too many requests), after the wait the answer asks
/// for (or 100 ms), as client-go retries them.
const BIND_TRIES: u32 = 10;

/// The profile name of pods that name no scheduler.
pub const DEFAULT_SCHEDULER: &str = "default-scheduler";

/// One plugin component of a profile, and the configuration its `plugins` call
/// gets.
#[derive(Clone, Debug)]
pub struct Component {
    pub plugin: Arc<Plugin>,
    pub configuration: String,
    /// Score weights that replace the plugins' own, by plugin name.
    pub weights: HashMap<String, u32>,
    /// A failure of the component (trap, deadline, memory, an error status) fails the
    /// cycle (`false`), or leaves the component out of it (`true`: `Ignore`).
    pub ignore_failures: bool,
}

/// A change of the profiles, as Plugin objects of kind `scheduler` come and go.
#[derive(Debug)]
pub enum Update {
    /// Adds a component to a profile (made with the default components if new), or
    /// replaces the one of the same plugin name; its session starts at the next cycle.
    Set {
        profile: String,
        component: Component,
    },
    /// Removes the component of this plugin name from every profile.
    Remove { name: String },
}

/// How the scheduler runs.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Profiles by `schedulerName`; pods for other schedulers are left alone.
    pub profiles: Vec<(String, Vec<Component>)>,
    /// The components a profile made by an [`Update`] starts with (the default
    /// plugins).
    pub defaults: Vec<Component>,
    /// `percentageOfNodesToScore`: 0 for kube-scheduler's adaptive default.
    pub percentage_of_nodes_to_score: u32,
    pub queue: QueueSettings,
}

/// A bind that finished.
struct Bound {
    key: PodKey,
    pod: Arc<Pod>,
    profile: usize,
    node: String,
    node_id: u32,
    queued_at: Instant,
    result: Result<(), String>,
}

/// A pod waiting at Permit, holding its node (assumed in the cache).
struct Waiting {
    key: PodKey,
    pod: Arc<Pod>,
    profile: usize,
    node: String,
    node_id: u32,
    /// The components that have not allowed it yet.
    components: Vec<String>,
    deadline: Instant,
    waited: Duration,
    queued_at: Instant,
}

/// What the scheduler runs with, beside its configuration.
pub struct Parts {
    /// The plugin host the components were loaded in.
    pub host: Arc<PluginHost>,
    /// The scheduler's own client (`system:kube-scheduler`).
    pub client: kube::Client,
    pub informers: SharedInformers,
    pub events: EventRecorder,
    pub metrics: SchedulerMetrics,
}

impl std::fmt::Debug for Parts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parts").finish_non_exhaustive()
    }
}

/// Runs the scheduler until `stopped`: the loop schedules one pod at a time, as
/// kube-scheduler's `scheduleOne`; binds run beside it. `updates` change the
/// profiles as Plugin objects come and go.
pub async fn run(
    config: SchedulerConfig,
    parts: Parts,
    mut updates: mpsc::UnboundedReceiver<Update>,
    stopped: Shutdown,
) -> anyhow::Result<()> {
    let Parts {
        host,
        client,
        informers,
        events,
        metrics,
    } = parts;
    let pods = informers.informer::<Pod>(Api::all(client.clone()), watcher::Config::default());
    let nodes = informers.informer::<Node>(Api::all(client.clone()), watcher::Config::default());
    let mut pod_changes = pods.subscribe();
    let mut node_changes = nodes.subscribe();
    // Budgets are advice to preemption: the loop does not wait for them.
    let budgets = informers
        .informer::<PodDisruptionBudget>(Api::all(client.clone()), watcher::Config::default());
    let mut budget_changes = budgets.subscribe();
    tokio::select! {
        () = async { tokio::join!(pods.wait_synced(), nodes.wait_synced()); } => {}
        () = stopped.wait() => return Ok(()),
    }

    let mut queue = SchedulingQueue::new(config.queue);
    let mut cache = cache::Cache::default();
    let mut profiles: Vec<Profile> = config
        .profiles
        .iter()
        .map(|(name, components)| {
            Profile::new(
                name.clone(),
                components.clone(),
                config.percentage_of_nodes_to_score,
            )
        })
        .collect();
    let mut names: Vec<String> = profiles.iter().map(|p| p.name.clone()).collect();
    // When each pod was first queued, for the end-to-end latency.
    let mut queued_at: HashMap<PodKey, Instant> = HashMap::new();
    let (bound_tx, mut bound_rx) = mpsc::unbounded_channel::<Bound>();
    let api: Api<Pod> = Api::all(client.clone());
    info!(profiles = ?names, "scheduler running");
    let mut counted_at = Instant::now();
    // Binds run beside the loop, at most this many at once: more only queue up in the
    // API server's own limit of requests in flight and come back 429.
    let binds_in_flight = Arc::new(tokio::sync::Semaphore::new(BINDS_IN_FLIGHT));
    // Pods waiting at Permit, by uid.
    let mut waiting: HashMap<String, Waiting> = HashMap::new();
    let binder = Binder {
        api: api.clone(),
        bound_tx: bound_tx.clone(),
        in_flight: binds_in_flight.clone(),
    };

    loop {
        // Every change that arrived comes first: the next cycle decides on them.
        let now = Instant::now();
        while let Ok(change) = node_changes.try_recv() {
            on_node(&mut cache, &mut queue, change, now);
        }
        while let Ok(change) = pod_changes.try_recv() {
            on_pod(&mut cache, &mut queue, &mut queued_at, &names, change, now);
        }
        while let Ok(change) = budget_changes.try_recv() {
            on_budget(&mut cache, change);
        }
        while let Ok(update) = updates.try_recv() {
            on_update(&mut profiles, &mut names, &config, update, &mut queue, now);
        }
        while let Ok(bound) = bound_rx.try_recv() {
            on_bound(
                &mut cache,
                &mut queue,
                &mut profiles,
                &events,
                &metrics,
                bound,
            )
            .await;
        }
        // The last cycle may have completed what waiting pods wait for, or their
        // wait ran out.
        if !waiting.is_empty() {
            resolve_waiting(
                &mut waiting,
                &mut profiles,
                &mut cache,
                &mut queue,
                &events,
                &binder,
            )
            .await;
        }
        queue.tick(now);
        // Counting the queues walks every pod waiting: ten times a second is enough.
        if now >= counted_at + Duration::from_millis(100) {
            counted_at = now;
            let (active, backoff, unschedulable) = queue.sizes();
            for (label, n) in [
                ("active", active),
                ("backoff", backoff),
                ("unschedulable", unschedulable),
            ] {
                metrics
                    .pending
                    .get_or_create(&metrics::QueueLabel { queue: label })
                    .set(n as i64);
            }
        }

        if let Some((key, pod)) = queue.pop() {
            let Some(p) = profile_of(&names, &pod) else {
                queue.remove(&key);
                continue;
            };
            let started = Instant::now();
            let decision = profiles[p].schedule(&host, &mut cache, &pod).await;
            for (plugin, events) in profiles[p].take_interests() {
                queue.set_interests(&plugin, events);
            }
            let elapsed = started.elapsed();
            let result = match &decision {
                Decision::Bind { .. } | Decision::Wait { .. } => "scheduled",
                Decision::Unschedulable { .. } => "unschedulable",
                Decision::Error(_) => "error",
            };
            let labels = metrics::ResultLabels {
                result,
                profile: profiles[p].name.clone(),
            };
            metrics.attempts.get_or_create(&labels).inc();
            metrics
                .attempt_duration
                .get_or_create(&labels)
                .observe(elapsed.as_secs_f64());
            if let Some(samples) = &metrics.attempt_samples {
                samples
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(elapsed);
            }
            for (plugin, point, took) in profiles[p].take_timings() {
                if metrics.attempt_samples.is_some() {
                    *metrics
                        .point_totals
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry((plugin.clone(), point))
                        .or_default() += took;
                }
                metrics
                    .plugin_duration
                    .get_or_create(&metrics::PointLabels {
                        plugin,
                        extension_point: point,
                    })
                    .observe(took.as_secs_f64());
            }
            let now = Instant::now();
            match decision {
                Decision::Bind { node, node_id } => {
                    cache.assume(&pod, &node);
                    let first = queued_at.get(&key).copied().unwrap_or(started);
                    binder.bind(Bound {
                        key,
                        pod,
                        profile: p,
                        node,
                        node_id,
                        queued_at: first,
                        result: Ok(()),
                    });
                }
                Decision::Wait {
                    node,
                    node_id,
                    components,
                    timeout,
                } => {
                    debug!(pod = %key, %node, ?components, "waiting at Permit");
                    cache.assume(&pod, &node);
                    let uid = pod.metadata.uid.clone().unwrap_or_default();
                    let first = queued_at.get(&key).copied().unwrap_or(started);
                    waiting.insert(
                        uid,
                        Waiting {
                            key,
                            pod,
                            profile: p,
                            node,
                            node_id,
                            components,
                            deadline: now + timeout,
                            waited: timeout,
                            queued_at: first,
                        },
                    );
                }
                Decision::Unschedulable {
                    message,
                    plugins,
                    nomination,
                } => {
                    debug!(pod = %key, %message, "unschedulable");
                    queue.unschedulable(&key, plugins, now);
                    events.record(&*pod, EventType::Warning, "FailedScheduling", &message);
                    mark_unschedulable(&api, &pod, &message, nomination.as_ref());
                    if let Some(nomination) = nomination {
                        preempt(&api, &events, &pod, nomination);
                    }
                }
                Decision::Error(message) => {
                    warn!(pod = %key, %message, "scheduling failed; retrying after a back-off");
                    queue.retry(&key, now);
                    events.record(&*pod, EventType::Warning, "FailedScheduling", &message);
                }
            }
            continue;
        }

        let wake = queue
            .next_deadline()
            .into_iter()
            .chain(waiting.values().map(|w| w.deadline))
            .min()
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            change = node_changes.recv() => match change {
                Some(change) => on_node(&mut cache, &mut queue, change, Instant::now()),
                None => break,
            },
            change = pod_changes.recv() => match change {
                Some(change) => on_pod(&mut cache, &mut queue, &mut queued_at, &names, change, Instant::now()),
                None => break,
            },
            Some(change) = budget_changes.recv() => on_budget(&mut cache, change),
            Some(update) = updates.recv() => {
                on_update(&mut profiles, &mut names, &config, update, &mut queue, Instant::now());
            }
            Some(bound) = bound_rx.recv() => {
                on_bound(&mut cache, &mut queue, &mut profiles, &events, &metrics, bound).await;
            }
            () = tokio::time::sleep_until(wake) => {}
            () = stopped.wait() => break,
        }
    }
    events.flush().await;
    Ok(())
}

/// Starts binds beside the loop, at most [`BINDS_IN_FLIGHT`] at once; each reports
/// on the loop's channel.
struct Binder {
    api: Api<Pod>,
    bound_tx: mpsc::UnboundedSender<Bound>,
    in_flight: Arc<tokio::sync::Semaphore>,
}

impl Binder {
    fn bind(&self, mut bound: Bound) {
        let api = self.api.clone();
        let bound_tx = self.bound_tx.clone();
        let in_flight = self.in_flight.clone();
        tokio::spawn(async move {
            bound.result = match in_flight.acquire().await {
                Ok(_permit) => bind(&api, &bound.pod, &bound.node).await,
                Err(e) => Err(e.to_string()),
            };
            let _ = bound_tx.send(bound);
        });
    }
}

/// Pods waiting at Permit: those every component allowed are bound; those whose
/// wait ran out give their node back and return to the queue as unschedulable, as
/// kube-scheduler rejects them; those deleted meanwhile are let go.
async fn resolve_waiting(
    waiting: &mut HashMap<String, Waiting>,
    profiles: &mut [Profile],
    cache: &mut cache::Cache,
    queue: &mut SchedulingQueue,
    events: &EventRecorder,
    binder: &Binder,
) {
    let asked: std::collections::BTreeSet<(usize, String)> = waiting
        .values()
        .flat_map(|w| w.components.iter().map(|c| (w.profile, c.clone())))
        .collect();
    for (profile, component) in asked {
        let Some(p) = profiles.get_mut(profile) else {
            continue;
        };
        for uid in p.allowed(&component).await {
            if let Some(w) = waiting.get_mut(&uid) {
                w.components.retain(|c| *c != component);
            }
        }
    }
    let now = Instant::now();
    let settled: Vec<String> = waiting
        .iter()
        .filter(|(uid, w)| w.components.is_empty() || now >= w.deadline || !cache.has_pod(uid))
        .map(|(uid, _)| uid.clone())
        .collect();
    for uid in settled {
        let Some(w) = waiting.remove(&uid) else {
            continue;
        };
        if w.components.is_empty() {
            debug!(pod = %w.key, node = %w.node, "allowed at Permit");
            binder.bind(Bound {
                key: w.key,
                pod: w.pod,
                profile: w.profile,
                node: w.node,
                node_id: w.node_id,
                queued_at: w.queued_at,
                result: Ok(()),
            });
            continue;
        }
        if let Some(p) = profiles.get_mut(w.profile) {
            p.unreserve(&uid, w.node_id).await;
        }
        if !cache.has_pod(&uid) {
            // Deleted while it waited.
            continue;
        }
        cache.forget(&uid);
        let plugin = w.components.first().cloned().unwrap_or_default();
        let message = format!(
            "pod {} rejected while waiting on permit: rejected due to timeout after waiting {:?} at plugin {plugin}",
            w.key, w.waited
        );
        debug!(pod = %w.key, %message, "given up at Permit");
        queue.unschedulable(&w.key, w.components.into_iter().collect(), now);
        events.record(&*w.pod, EventType::Warning, "FailedScheduling", &message);
        mark_unschedulable(&binder.api, &w.pod, &message, None);
    }
}

/// The profile that schedules `pod`: its `schedulerName`, `default-scheduler` if none.
fn profile_of(profiles: &[String], pod: &Pod) -> Option<usize> {
    let wanted = pod
        .spec
        .as_ref()
        .and_then(|s| s.scheduler_name.as_deref())
        .unwrap_or(DEFAULT_SCHEDULER);
    profiles.iter().position(|name| name == wanted)
}

/// Applies a change of the profiles. A new profile's pods may be queued already
/// under no profile: they were left alone, and the next change of each brings it in;
/// a cluster event wakes those that failed.
fn on_update(
    profiles: &mut Vec<Profile>,
    names: &mut Vec<String>,
    config: &SchedulerConfig,
    update: Update,
    queue: &mut SchedulingQueue,
    now: Instant,
) {
    match update {
        Update::Set { profile, component } => {
            let at = match names.iter().position(|n| *n == profile) {
                Some(at) => at,
                None => {
                    info!(%profile, "a new scheduling profile");
                    profiles.push(Profile::new(
                        profile.clone(),
                        config.defaults.clone(),
                        config.percentage_of_nodes_to_score,
                    ));
                    names.push(profile);
                    profiles.len() - 1
                }
            };
            profiles[at].set(component);
        }
        Update::Remove { name } => {
            for p in profiles.iter_mut() {
                p.remove(&name);
            }
        }
    }
    // Pods a removed or changed plugin rejected may fit now.
    queue.on_event(
        &Event {
            resource: "plugins".into(),
            action: Action::Update,
        },
        now,
    );
}

fn key_of(pod: &Pod) -> PodKey {
    Arc::from(format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    ))
}

fn on_node(
    cache: &mut cache::Cache,
    queue: &mut SchedulingQueue,
    change: Change<Node>,
    now: Instant,
) {
    let action = match &change {
        Change::Added(node) => {
            cache.upsert_node(node);
            Action::Add
        }
        Change::Updated { new, .. } => {
            cache.upsert_node(new);
            Action::Update
        }
        Change::Deleted(node) => {
            cache.remove_node(node.metadata.name.as_deref().unwrap_or_default());
            Action::Delete
        }
    };
    queue.on_event(
        &Event {
            resource: "nodes".into(),
            action,
        },
        now,
    );
}

fn on_budget(cache: &mut cache::Cache, change: Change<PodDisruptionBudget>) {
    let pdb = change.object();
    let key = format!(
        "{}/{}",
        pdb.metadata.namespace.as_deref().unwrap_or_default(),
        pdb.metadata.name.as_deref().unwrap_or_default()
    );
    match change {
        Change::Deleted(_) => cache.remove_budget(&key),
        _ => cache.set_budget(key, cache::Budget::from_object(pdb)),
    }
}

fn on_pod(
    cache: &mut cache::Cache,
    queue: &mut SchedulingQueue,
    queued_at: &mut HashMap<PodKey, Instant>,
    profiles: &[String],
    change: Change<Pod>,
    now: Instant,
) {
    let pod = change.object().clone();
    let key = key_of(&pod);
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let assigned = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|n| !n.is_empty());
    if let Change::Deleted(_) = change {
        queue.remove(&key);
        queued_at.remove(&key);
        if assigned || cache.has_pod(&uid) {
            cache.remove_pod(&uid);
            queue.on_event(
                &Event {
                    resource: "pods".into(),
                    action: Action::Delete,
                },
                now,
            );
        }
        return;
    }
    if assigned {
        let finished = !cache.has_pod(&uid);
        cache.upsert_pod(&pod);
        queue.remove(&key);
        queued_at.remove(&key);
        let action = if matches!(change, Change::Added(_)) || finished {
            Action::Add
        } else {
            Action::Update
        };
        // A pod that finished frees what it held, as a delete does.
        let action = if cache.has_pod(&uid) {
            action
        } else {
            Action::Delete
        };
        queue.on_event(
            &Event {
                resource: "pods".into(),
                action,
            },
            now,
        );
        return;
    }
    // Assumed: this scheduler chose its node and the bind is on its way.
    if cache.has_pod(&uid) {
        return;
    }
    let terminal = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    if terminal || pod.metadata.deletion_timestamp.is_some() || profile_of(profiles, &pod).is_none()
    {
        queue.remove(&key);
        return;
    }
    queued_at.entry(key.clone()).or_insert(now);
    let added = matches!(change, Change::Added(_));
    queue.add_or_update(key, pod, now);
    // Kept apart from `pods` (pods on nodes), which most plugins wait for: a pod
    // arriving frees nothing, and only a plugin that waits for one hears of it.
    let arrived = Event {
        resource: "unscheduledpods".into(),
        action: Action::Add,
    };
    if added && queue.wanted(&arrived) {
        queue.on_event(&arrived, now);
    }
}

async fn on_bound(
    cache: &mut cache::Cache,
    queue: &mut SchedulingQueue,
    profiles: &mut [Profile],
    events: &EventRecorder,
    metrics: &SchedulerMetrics,
    bound: Bound,
) {
    let now = Instant::now();
    let name = format!(
        "{}/{}",
        bound.pod.metadata.namespace.as_deref().unwrap_or_default(),
        bound.pod.metadata.name.as_deref().unwrap_or_default()
    );
    match bound.result {
        Ok(()) => {
            queue.done(&bound.key);
            metrics
                .e2e
                .observe(now.duration_since(bound.queued_at).as_secs_f64());
            events.record(
                &*bound.pod,
                EventType::Normal,
                "Scheduled",
                &format!("Successfully assigned {name} to {}", bound.node),
            );
        }
        Err(message) => {
            let uid = bound.pod.metadata.uid.clone().unwrap_or_default();
            cache.forget(&uid);
            if let Some(profile) = profiles.get_mut(bound.profile) {
                profile.unreserve(&uid, bound.node_id).await;
            }
            warn!(pod = %name, node = %bound.node, %message, "binding failed; retrying after a back-off");
            events.record(
                &*bound.pod,
                EventType::Warning,
                "FailedScheduling",
                &format!("Binding rejected: {message}"),
            );
            queue.retry(&bound.key, now);
        }
    }
}

/// `POST pods/NAME/binding`, as the DefaultBinder does; a 429 is tried again after
/// a short wait, as client-go does, rather than failing the pod.
async fn bind(api: &Api<Pod>, pod: &Pod, node: &str) -> Result<(), String> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(api.clone().into_client(), namespace);
    let binding = json!({
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name, "namespace": namespace, "uid": pod.metadata.uid},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    });
    let mut tries = 0;
    loop {
        tries += 1;
        let answer = api
            .create_subresource::<_, serde_json::Value>(
                "binding",
                name,
                &PostParams::default(),
                &binding,
            )
            .await;
        match answer {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 429 && tries < BIND_TRIES => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(kube::Error::Api(s)) => return Err(s.message),
            Err(other) => return Err(other.to_string()),
        }
    }
}

/// Deletes the victims of a preemption (each told why in a `Preempted` event, as
/// kube-scheduler tells them); their deletion moves the preemptor back into the
/// queue, and it is scheduled on the node they leave.
fn preempt(api: &Api<Pod>, events: &EventRecorder, pod: &Pod, nomination: framework::Nomination) {
    let preemptor = pod.metadata.uid.clone().unwrap_or_default();
    info!(
        pod = %key_of(pod),
        node = %nomination.node,
        victims = nomination.victims.len(),
        "preempting lower-priority pods"
    );
    for victim in nomination.victims {
        events.record(
            &*victim,
            EventType::Normal,
            "Preempted",
            &format!("Preempted by pod {preemptor} on node {}", nomination.node),
        );
        let namespace = victim.metadata.namespace.clone().unwrap_or_default();
        let name = victim.metadata.name.clone().unwrap_or_default();
        let uid = victim.metadata.uid.clone();
        let api: Api<Pod> = Api::namespaced(api.clone().into_client(), &namespace);
        tokio::spawn(async move {
            let params = kube::api::DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    uid,
                    resource_version: None,
                }),
                ..Default::default()
            };
            if let Err(e) = api.delete(&name, &params).await {
                warn!(pod = %name, error = %e, "deleting a preemption victim failed");
            }
        });
    }
}

/// Sets the pod's PodScheduled condition to False (Unschedulable) with the message,
/// as kube-scheduler does, and its `nominatedNodeName` when it preempts, unless they
/// say so already.
fn mark_unschedulable(
    api: &Api<Pod>,
    pod: &Pod,
    message: &str,
    nomination: Option<&framework::Nomination>,
) {
    let current = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "PodScheduled"));
    let nominated = pod
        .status
        .as_ref()
        .and_then(|s| s.nominated_node_name.as_deref());
    if current.is_some_and(|c| c.status == "False" && c.message.as_deref() == Some(message))
        && nominated == nomination.map(|n| n.node.as_str())
    {
        return;
    }
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(api.clone().into_client(), &namespace);
    let mut patch = json!({"status": {"conditions": [{
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": message,
        "lastTransitionTime": jiff_now(),
    }]}});
    if let Some(n) = nomination {
        patch["status"]["nominatedNodeName"] = json!(n.node);
    }
    tokio::spawn(async move {
        let params = PatchParams::default();
        if let Err(e) = api
            .patch_status(&name, &params, &Patch::Strategic(patch))
            .await
        {
            debug!(pod = %name, error = %e, "setting PodScheduled=False failed");
        }
    });
}

fn jiff_now() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}
