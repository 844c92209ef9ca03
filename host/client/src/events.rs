//! The event recorder: core/v1 Events as Kubernetes' components write them, so that
//! `kubectl get events` and `kubectl describe` show what a controller, the scheduler
//! or a node did.
//!
//! As client-go's recorder and correlator:
//! - an event names its object (`involvedObject`), a reason, a message, a type
//!   (`Normal`, `Warning`) and its source (component and host);
//! - repeats of the same event (same object, type, reason, message, source) are not
//!   new objects: the first one's `count` goes up and its `lastTimestamp` moves;
//! - each object gets a token bucket per source (25 at once, then one per five
//!   minutes): a hot loop cannot flood the store; what it drops is counted;
//! - recording never blocks: events go through a bounded queue to one writer task,
//!   and are dropped (and counted) when the queue is full.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::warn;

/// `Normal` or `Warning`, as Kubernetes' event types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventType {
    Normal,
    Warning,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "Normal",
            Self::Warning => "Warning",
        }
    }
}

/// The recorder's limits (client-go's defaults).
#[derive(Clone, Copy, Debug)]
pub struct EventLimits {
    /// Events per object and source at once.
    pub burst: u32,
    /// How often one more is allowed after the burst.
    pub refill: Duration,
    /// Events waiting to be written before new ones are dropped.
    pub queue: usize,
    /// Repeats remembered for aggregation (the oldest are forgotten first).
    pub remembered: usize,
}

impl Default for EventLimits {
    fn default() -> Self {
        Self {
            burst: 25,
            refill: Duration::from_secs(300),
            queue: 1_000,
            remembered: 4_096,
        }
    }
}

enum Message {
    Record(Box<Event>),
    /// Answered once everything recorded before it is written.
    Flush(oneshot::Sender<()>),
}

/// Records events as `component` on `host`. Clones share the writer.
#[derive(Clone, Debug)]
pub struct EventRecorder {
    tx: mpsc::Sender<Message>,
    component: String,
    host: String,
    dropped: Arc<AtomicU64>,
}

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Record(e) => f.debug_tuple("Record").field(&e.reason).finish(),
            Self::Flush(_) => f.write_str("Flush"),
        }
    }
}

impl EventRecorder {
    pub fn new(client: kube::Client, component: &str, host: &str) -> Self {
        Self::with_limits(client, component, host, EventLimits::default())
    }

    pub fn with_limits(
        client: kube::Client,
        component: &str,
        host: &str,
        limits: EventLimits,
    ) -> Self {
        let (tx, rx) = mpsc::channel(limits.queue.max(1));
        let dropped = Arc::new(AtomicU64::new(0));
        tokio::spawn(write(client, rx, limits, dropped.clone()));
        Self {
            tx,
            component: component.to_owned(),
            host: host.to_owned(),
            dropped,
        }
    }

    /// Records an event about `obj`.
    pub fn record<K>(&self, obj: &K, kind: EventType, reason: &str, message: &str)
    where
        K: Resource<DynamicType = ()>,
    {
        self.record_for(reference(obj), kind, reason, message);
    }

    /// Records an event about the object `involved` refers to.
    pub fn record_for(
        &self,
        involved: ObjectReference,
        kind: EventType,
        reason: &str,
        message: &str,
    ) {
        let now = jiff::Timestamp::now();
        let namespace = involved
            .namespace
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "default".to_owned());
        let name = event_name(involved.name.as_deref().unwrap_or("unknown"));
        let event = Event {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: Some(namespace),
                ..ObjectMeta::default()
            },
            involved_object: involved,
            reason: Some(reason.to_owned()),
            message: Some(message.to_owned()),
            type_: Some(kind.as_str().to_owned()),
            source: Some(EventSource {
                component: Some(self.component.clone()),
                host: Some(self.host.clone()),
            }),
            first_timestamp: Some(Time(now)),
            last_timestamp: Some(Time(now)),
            event_time: Some(MicroTime(now)),
            count: Some(1),
            reporting_component: Some(self.component.clone()),
            reporting_instance: Some(self.host.clone()),
            action: None,
            related: None,
            series: None,
        };
        if self.tx.try_send(Message::Record(Box::new(event))).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Waits until every event recorded so far is written (or dropped by the limits).
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Message::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// Events dropped so far: by a full queue or by an object's rate limit.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// The longest object name Kubernetes takes (a DNS subdomain).
const MAX_NAME: usize = 253;

/// An event's name: the object's name and a random suffix, as client-go makes it. The
/// object's name may be as long as the event's may be, so it is cut to leave room for
/// the suffix, and cut back past a `.` or `-` that would end a label.
fn event_name(object: &str) -> String {
    let suffix = format!(".{:016x}", rand::random::<u64>());
    // Names are ASCII (DNS subdomains or segments), so any byte is a boundary.
    let room = MAX_NAME - suffix.len();
    let base = if object.len() > room && object.is_char_boundary(room) {
        object[..room].trim_end_matches(['.', '-'])
    } else {
        object
    };
    format!("{base}{suffix}")
}

/// A reference to `obj` for `involvedObject`.
pub fn reference<K: Resource<DynamicType = ()>>(obj: &K) -> ObjectReference {
    ObjectReference {
        api_version: Some(K::api_version(&()).into_owned()),
        kind: Some(K::kind(&()).into_owned()),
        namespace: obj.namespace(),
        name: Some(obj.name_any()),
        uid: obj.uid(),
        resource_version: obj.resource_version(),
        field_path: None,
    }
}

/// An event's source: component and host.
type SourceKey = (String, String);
/// An event's object: apiVersion, kind, namespace, name, uid.
type ObjectKey = (String, String, String, String, String);

/// What makes two events repeats of each other.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct RepeatKey {
    source: SourceKey,
    object: ObjectKey,
    kind: String,
    reason: String,
    message: String,
}

fn object_key(e: &Event) -> ObjectKey {
    let o = &e.involved_object;
    (
        o.api_version.clone().unwrap_or_default(),
        o.kind.clone().unwrap_or_default(),
        o.namespace.clone().unwrap_or_default(),
        o.name.clone().unwrap_or_default(),
        o.uid.clone().unwrap_or_default(),
    )
}

fn source_key(e: &Event) -> SourceKey {
    let s = e.source.clone().unwrap_or_default();
    (s.component.unwrap_or_default(), s.host.unwrap_or_default())
}

/// A repeat's stored event: its namespace, name and count.
struct Written {
    namespace: String,
    name: String,
    count: i32,
    used: u64,
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

async fn write(
    client: kube::Client,
    mut rx: mpsc::Receiver<Message>,
    limits: EventLimits,
    dropped: Arc<AtomicU64>,
) {
    let mut written: HashMap<RepeatKey, Written> = HashMap::new();
    let mut buckets: HashMap<(SourceKey, ObjectKey), Bucket> = HashMap::new();
    let mut clock = 0u64;
    while let Some(message) = rx.recv().await {
        let event = match message {
            Message::Record(event) => *event,
            Message::Flush(done) => {
                let _ = done.send(());
                continue;
            }
        };
        // The object's bucket for this source. Full buckets are forgotten now and then:
        // a new one starts full too.
        let now = Instant::now();
        if buckets.len() > limits.remembered {
            let refill = limits.refill.as_secs_f64().max(f64::EPSILON);
            let burst = f64::from(limits.burst);
            buckets.retain(|_, b| {
                b.tokens + now.saturating_duration_since(b.at).as_secs_f64() / refill < burst
            });
        }
        let bucket = buckets
            .entry((source_key(&event), object_key(&event)))
            .or_insert(Bucket {
                tokens: f64::from(limits.burst),
                at: now,
            });
        let refill = now.saturating_duration_since(bucket.at).as_secs_f64()
            / limits.refill.as_secs_f64().max(f64::EPSILON);
        bucket.tokens = (bucket.tokens + refill).min(f64::from(limits.burst));
        bucket.at = now;
        if bucket.tokens < 1.0 {
            dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        bucket.tokens -= 1.0;

        let key = RepeatKey {
            source: source_key(&event),
            object: object_key(&event),
            kind: event.type_.clone().unwrap_or_default(),
            reason: event.reason.clone().unwrap_or_default(),
            message: event.message.clone().unwrap_or_default(),
        };
        clock += 1;
        if let Some(seen) = written.get_mut(&key) {
            let api: Api<Event> = Api::namespaced(client.clone(), &seen.namespace);
            let count = seen.count + 1;
            let patch = json!({
                "count": count,
                "lastTimestamp": event.last_timestamp,
            });
            match api
                .patch(&seen.name, &PatchParams::default(), &Patch::Merge(patch))
                .await
            {
                Ok(_) => {
                    seen.count = count;
                    seen.used = clock;
                    continue;
                }
                // Gone (expired, deleted): write it anew below.
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => {
                    warn!(error = %e, reason = %key.reason, "updating an event failed");
                    continue;
                }
            }
        }
        let namespace = event.metadata.namespace.clone().unwrap_or_default();
        let api: Api<Event> = Api::namespaced(client.clone(), &namespace);
        match api.create(&PostParams::default(), &event).await {
            Ok(created) => {
                if written.len() >= limits.remembered
                    && let Some(oldest) = written
                        .iter()
                        .min_by_key(|(_, w)| w.used)
                        .map(|(k, _)| k.clone())
                {
                    written.remove(&oldest);
                }
                written.insert(
                    key,
                    Written {
                        namespace,
                        name: created.name_any(),
                        count: created.count.unwrap_or(1),
                        used: clock,
                    },
                );
            }
            Err(e) => warn!(error = %e, reason = %key.reason, "writing an event failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_names_of_long_objects_fit_and_stay_valid() {
        let short = event_name("web-1");
        assert!(short.starts_with("web-1.") && short.len() == "web-1".len() + 17);
        // 236 characters and a '-' where the cut falls: the '-' goes too.
        let long = format!("{}-{}", "a".repeat(235), "b".repeat(17));
        let name = event_name(&long);
        assert!(name.len() <= MAX_NAME, "{}", name.len());
        assert!(
            name.starts_with(&"a".repeat(235)) && !name.contains("-."),
            "{name}"
        );
        assert_ne!(event_name(&long), name, "the suffix keeps names apart");
    }
}
