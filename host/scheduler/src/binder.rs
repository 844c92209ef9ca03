//! The binding cycle: binds run beside the loop (VolumeBinding's PreBind, then
//! kube-scheduler's DefaultBinder), and their outcome comes back to it; pods waiting
//! at Permit hold their node until their components allow them or their wait runs out.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, warn};
use trellis_client::events::{EventRecorder, EventType};

use crate::SchedulerMetrics;
use crate::cache::Cache;
use crate::cycle::Profile;
use crate::queue::{PodKey, SchedulingQueue};
use crate::status::mark_unschedulable;

/// Binds in flight at once.
const BINDS_IN_FLIGHT: usize = 64;
/// Tries of a bind answered 429 (too many requests), after the wait the answer asks
/// for (or 100 ms), as client-go retries them.
const BIND_TRIES: u32 = 10;

/// A bind that finished.
pub(crate) struct Bound {
    pub(crate) key: PodKey,
    pub(crate) pod: Arc<Pod>,
    pub(crate) profile: usize,
    pub(crate) node: String,
    pub(crate) node_id: u32,
    pub(crate) queued_at: Instant,
    pub(crate) result: Result<(), String>,
}

/// A pod waiting at Permit, holding its node (assumed in the cache).
pub(crate) struct Waiting {
    pub(crate) key: PodKey,
    pub(crate) pod: Arc<Pod>,
    pub(crate) profile: usize,
    pub(crate) node: String,
    pub(crate) node_id: u32,
    /// The components that have not allowed it yet.
    pub(crate) components: Vec<String>,
    pub(crate) deadline: Instant,
    pub(crate) waited: Duration,
    pub(crate) queued_at: Instant,
}

/// Starts binds beside the loop, at most [`BINDS_IN_FLIGHT`] at once; each reports
/// on the loop's channel.
pub(crate) struct Binder {
    api: Api<Pod>,
    bound_tx: mpsc::UnboundedSender<Bound>,
    in_flight: Arc<tokio::sync::Semaphore>,
}

impl Binder {
    pub(crate) fn new(api: Api<Pod>, bound_tx: mpsc::UnboundedSender<Bound>) -> Self {
        Self {
            api,
            bound_tx,
            // Binds run beside the loop, at most this many at once: more only queue up
            // in the API server's own limit of requests in flight and come back 429.
            in_flight: Arc::new(tokio::sync::Semaphore::new(BINDS_IN_FLIGHT)),
        }
    }

    pub(crate) fn bind(&self, mut bound: Bound) {
        let api = self.api.clone();
        let bound_tx = self.bound_tx.clone();
        let in_flight = self.in_flight.clone();
        tokio::spawn(async move {
            // PreBind first, outside the binds in flight: a pod whose claims are still
            // being provisioned must not hold a slot that other pods' binds need.
            let client = api.clone().into_client();
            bound.result =
                match crate::volume_binding::pre_bind(&client, &bound.pod, &bound.node).await {
                    Err(e) => Err(e),
                    Ok(()) => match in_flight.acquire().await {
                        Ok(_permit) => bind(&api, &bound.pod, &bound.node).await,
                        Err(e) => Err(e.to_string()),
                    },
                };
            let _ = bound_tx.send(bound);
        });
    }
}

/// Pods waiting at Permit: those every component allowed are bound; those whose
/// wait ran out give their node back and return to the queue as unschedulable, as
/// kube-scheduler rejects them; those deleted meanwhile are let go.
pub(crate) async fn resolve_waiting(
    waiting: &mut HashMap<String, Waiting>,
    profiles: &mut [Profile],
    cache: &mut Cache,
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

pub(crate) async fn on_bound(
    cache: &mut Cache,
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
