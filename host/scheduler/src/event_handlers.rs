//! The informers' changes, into the cache and the queue (kube-scheduler's
//! `eventhandlers.go`): nodes, pods (assigned ones into the cache, unassigned ones of
//! a profile into the queue), budgets; and the profiles' updates as Plugin objects
//! come and go. Each change wakes the pods waiting for its event.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use tokio::time::Instant;
use tracing::info;
use trellis_client::informer::Change;

use crate::cycle::Profile;
use crate::queue::{Action, Event, PodKey, SchedulingQueue};
use crate::{DEFAULT_SCHEDULER, SchedulerConfig, Update, cache};

/// The profile that schedules `pod`: its `schedulerName`, `default-scheduler` if none.
pub(crate) fn profile_of(profiles: &[String], pod: &Pod) -> Option<usize> {
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
pub(crate) fn on_update(
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

pub(crate) fn key_of(pod: &Pod) -> PodKey {
    Arc::from(format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    ))
}

pub(crate) fn on_node(
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

pub(crate) fn on_budget(cache: &mut cache::Cache, change: Change<PodDisruptionBudget>) {
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

pub(crate) fn on_pod(
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
