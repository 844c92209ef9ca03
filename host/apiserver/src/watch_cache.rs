//! The server's watch cache: one store watch over all of `/registry/` feeds a ring of
//! recent events, decoded once, and fans them out to client watches.
//!
//! A client watch from revision `N` replays the ring's events after `N` and then
//! receives live events on its own bounded channel, offered only if its key prefix
//! matches. A revision older than the ring is [`TooOld`]: the caller falls back to a
//! store watch (which answers 410 Gone once the store has compacted it). A client
//! that falls behind is dropped, as the store drops slow watchers, and ends its
//! stream so that it relists.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::mpsc;
use tracing::{debug, warn};
use trellis_store::{Event, EventKind, Revision, Store};

use crate::object::{Object, set_meta};

/// One change, decoded once for every client watch.
#[derive(Debug)]
pub struct CachedEvent {
    pub revision: Revision,
    pub key: String,
    pub kind: EventKind,
    /// The object after the change; for a delete, its last state (resourceVersion set
    /// to the deleting revision, as Kubernetes reports it).
    pub object: Arc<Object>,
    /// The object before the change, if it existed.
    pub prev: Option<Arc<Object>>,
    /// `object` as JSON, encoded by the first client watch that sends it and shared by
    /// the rest: with many watchers, encoding once per change rather than once per
    /// watcher is most of the cost of a delivery.
    encoded: OnceLock<Bytes>,
}

impl CachedEvent {
    /// `object` as JSON.
    pub fn encoded(&self) -> &Bytes {
        self.encoded
            .get_or_init(|| Bytes::from(serde_json::to_vec(&*self.object).unwrap_or_default()))
    }
}

/// Decodes a stored value into an object with its resourceVersion set.
pub fn decode_stored(value: &[u8], revision: Revision) -> Option<Object> {
    let mut obj: Object = serde_json::from_slice(value).ok()?;
    set_meta(&mut obj, "resourceVersion", revision.to_string());
    Some(obj)
}

/// Converts a store event; `None` for an undecodable value (logged).
pub fn convert(event: &Event) -> Option<CachedEvent> {
    let revision = event.revision();
    let prev = event
        .prev
        .as_ref()
        .and_then(|p| decode_stored(&p.value, p.mod_revision))
        .map(Arc::new);
    let object = match event.kind {
        EventKind::Put => decode_stored(&event.kv.value, revision),
        EventKind::Delete => prev.as_ref().map(|p| {
            let mut last = (**p).clone();
            set_meta(&mut last, "resourceVersion", revision.to_string());
            last
        }),
    };
    let Some(object) = object else {
        warn!(key = %event.kv.key, revision, "skipping a stored value that is not a JSON object");
        return None;
    };
    Some(CachedEvent {
        revision,
        key: event.kv.key.clone(),
        kind: event.kind,
        object: Arc::new(object),
        prev,
        encoded: OnceLock::new(),
    })
}

/// The client watch's revision is older than the cache holds.
#[derive(Debug)]
pub struct TooOld;

#[derive(Debug)]
struct Slot {
    prefix: String,
    tx: mpsc::Sender<Arc<CachedEvent>>,
    lagged: Arc<AtomicBool>,
}

#[derive(Debug)]
struct State {
    events: VecDeque<Arc<CachedEvent>>,
    /// Every event after this revision is in `events` (or was not under /registry/).
    base: Revision,
    /// The last revision the cache has seen.
    revision: Revision,
    watchers: Vec<Slot>,
}

/// A client watch's feed: what the ring holds after its revision, then live events.
#[derive(Debug)]
pub struct Subscription {
    pub replay: Vec<Arc<CachedEvent>>,
    pub rx: mpsc::Receiver<Arc<CachedEvent>>,
    pub lagged: Arc<AtomicBool>,
}

#[derive(Debug)]
pub struct WatchCache {
    state: Mutex<State>,
    capacity: usize,
    watcher_buffer: usize,
    revision_changed: tokio::sync::watch::Sender<Revision>,
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The prefix every Kubernetes object is stored under.
pub const REGISTRY: &str = "/registry/";

impl WatchCache {
    /// Starts the cache at the store's current revision and its feeder task, which
    /// runs until `shutdown` completes.
    pub async fn start(
        store: Arc<dyn Store>,
        capacity: usize,
        watcher_buffer: usize,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> trellis_store::Result<Arc<Self>> {
        let revision = store.current_revision().await?;
        let (revision_changed, _) = tokio::sync::watch::channel(revision);
        let cache = Arc::new(Self {
            state: Mutex::new(State {
                events: VecDeque::new(),
                base: revision,
                revision,
                watchers: Vec::new(),
            }),
            capacity: capacity.max(1),
            watcher_buffer: watcher_buffer.max(1),
            revision_changed,
        });
        let feeder = cache.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = feeder.feed(store) => {}
                () = shutdown => {}
            }
            feeder.close();
        });
        Ok(cache)
    }

    /// The last revision the cache has seen.
    pub fn revision(&self) -> Revision {
        lock(&self.state).revision
    }

    /// Waits until the cache has seen `revision` (or `timeout` passes); returns whether
    /// it has. Lets a watch that follows a write start after that write.
    pub async fn wait_for(&self, revision: Revision, timeout: Duration) -> bool {
        let mut rx = self.revision_changed.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|r| *r >= revision))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    async fn feed(&self, store: Arc<dyn Store>) {
        loop {
            let from = self.revision() + 1;
            let mut stream = match store.watch(REGISTRY, from).await {
                Ok(s) => s,
                Err(e) => {
                    warn!(error = %e, from, "watch cache cannot watch the store; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            while let Some(item) = stream.next().await {
                match item {
                    Ok(events) => self.apply(&events),
                    Err(e) => {
                        warn!(error = %e, "watch cache's store watch ended; resuming");
                        break;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn apply(&self, events: &[Event]) {
        let converted: Vec<Arc<CachedEvent>> =
            events.iter().filter_map(convert).map(Arc::new).collect();
        let last = events.last().map(Event::revision);
        let mut state = lock(&self.state);
        for event in &converted {
            state.watchers.retain(|slot| {
                if !event.key.starts_with(&slot.prefix) {
                    return !slot.tx.is_closed();
                }
                match slot.tx.try_send(event.clone()) {
                    Ok(()) => true,
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        slot.lagged.store(true, Ordering::Release);
                        debug!(prefix = %slot.prefix, "dropping a client watch that fell behind");
                        false
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => false,
                }
            });
            state.events.push_back(event.clone());
        }
        while state.events.len() > self.capacity {
            if let Some(old) = state.events.pop_front() {
                state.base = old.revision;
            }
        }
        if let Some(last) = last {
            state.revision = state.revision.max(last);
            let revision = state.revision;
            drop(state);
            self.revision_changed.send_replace(revision);
        }
    }

    /// Everything under `prefix` after revision `after`: replayed from the ring, then
    /// live.
    pub fn subscribe(&self, prefix: &str, after: Revision) -> Result<Subscription, TooOld> {
        let mut state = lock(&self.state);
        if after < state.base {
            return Err(TooOld);
        }
        let replay = state
            .events
            .iter()
            .filter(|e| e.revision > after && e.key.starts_with(prefix))
            .cloned()
            .collect();
        let (tx, rx) = mpsc::channel(self.watcher_buffer);
        let lagged = Arc::new(AtomicBool::new(false));
        state.watchers.push(Slot {
            prefix: prefix.to_owned(),
            tx,
            lagged: lagged.clone(),
        });
        Ok(Subscription { replay, rx, lagged })
    }

    /// Ends every client watch: their channels close.
    fn close(&self) {
        lock(&self.state).watchers.clear();
    }

    pub fn watcher_count(&self) -> usize {
        lock(&self.state).watchers.len()
    }
}
