//! The scheduler's loop, as kube-scheduler's `scheduleOne`: it takes in what the
//! informers and the binds report, then schedules the next pod of the queue with its
//! profile, and acts on the decision.

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::Api;
use kube::runtime::watcher;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, info, warn};
use trellis_api::Shutdown;
use trellis_client::events::EventType;

use crate::binder::{Binder, Bound, Waiting, on_bound, resolve_waiting};
use crate::cycle::{Decision, Profile};
use crate::event_handlers::{on_budget, on_node, on_pod, on_update, profile_of};
use crate::queue::{PodKey, SchedulingQueue};
use crate::status::{mark_unschedulable, preempt};
use crate::{Parts, SchedulerConfig, Update, cache, metrics};

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
    let volumes = crate::volume_binding::Volumes::new(&client, &informers);
    let mut volume_events = volumes.events();
    tokio::select! {
        () = async { tokio::join!(pods.wait_synced(), nodes.wait_synced()); } => {}
        () = stopped.wait() => return Ok(()),
    }

    let mut queue = SchedulingQueue::new(config.queue);
    queue.set_interests(
        crate::volume_binding::PLUGIN,
        crate::volume_binding::Volumes::interests(),
    );
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
    // Pods waiting at Permit, by uid.
    let mut waiting: HashMap<String, Waiting> = HashMap::new();
    let binder = Binder::new(api.clone(), bound_tx.clone());

    loop {
        // Every change that arrived comes first: the next cycle decides on them.
        let now = Instant::now();
        while let Ok(change) = node_changes.try_recv() {
            on_node(&mut cache, &mut queue, change, now);
        }
        while let Ok(change) = pod_changes.try_recv() {
            on_pod(&mut cache, &mut queue, &mut queued_at, &names, change, now);
        }
        while let Ok(event) = volume_events.try_recv() {
            queue.on_event(&event, now);
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
            let decision = match volumes.nodes_for(&pod, &cache) {
                Ok(nodes) => profiles[p].schedule(&host, &mut cache, &pod, nodes).await,
                Err(message) => Decision::Unschedulable {
                    message: format!("0/{} nodes are available: {message}.", cache.node_count()),
                    plugins: [crate::volume_binding::PLUGIN.to_owned()].into(),
                    nomination: None,
                },
            };
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
            Some(event) = volume_events.recv() => queue.on_event(&event, Instant::now()),
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
