//! The server's watch cache: one store watch over all of `/registry/` feeds a ring of
//! recent events, decoded once, and fans them out to client watches. It also keeps
//! the current state, every object under `/registry/` at the cache's revision, which
//! serves reads that may lag the store by the time an event takes to arrive (plugins'
//! `cluster` import, the namespace check of creates). The state holds each object as
//! the store's JSON and decodes it when read: a decoded object takes about five times
//! the memory of its JSON, and most objects are never read this way.
//!
//! A client watch from revision `N` replays the ring's events after `N` and then
//! receives live events on its own bounded channel, offered only if its key prefix
//! matches. A revision older than the ring is [`TooOld`]: the caller falls back to a
//! store watch (which answers 410 Gone once the store has compacted it). A client
//! that falls behind is dropped, as the store drops slow watchers, and ends its
//! stream so that it relists.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::mpsc;
use tracing::{debug, warn};
use trellis_store::{Event, EventKind, ListRequest, Revision, Store};

use crate::object::{Object, set_meta};

/// One change, decoded at most once for every client watch: when a watch first needs
/// it, so that changes nobody watches (most writes of a resource without watchers) cost
/// no decode, and the ring holds their stored bytes rather than decoded objects.
#[derive(Debug)]
pub struct CachedEvent {
    pub revision: Revision,
    pub key: String,
    pub kind: EventKind,
    /// The stored value of the object after the change; for a delete, its last state.
    value: Bytes,
    /// The stored value before the change and its revision, if the object existed.
    prev_value: Option<(Bytes, Revision)>,
    object: OnceLock<Arc<Object>>,
    prev: OnceLock<Option<Arc<Object>>>,
    /// The event lines announcing this change, one per [`EventType`], each encoded by
    /// the first client watch that sends it and shared by the rest: with many
    /// watchers, encoding once per change rather than once per watcher is most of the
    /// cost of a delivery, and sharing the line spares a copy per delivery as well.
    lines: [OnceLock<Bytes>; 3],
}

/// The type of an event line about a change, as a client watch's selectors see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    const ALL: [EventType; 3] = [EventType::Added, EventType::Modified, EventType::Deleted];

    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// The bytes of a watch event line before its object: `{"type":"ADDED","object":`.
pub fn line_head(line: &mut Vec<u8>, kind: &str) {
    line.extend_from_slice(br#"{"type":""#);
    line.extend_from_slice(kind.as_bytes());
    line.extend_from_slice(br#"","object":"#);
}

/// The bytes of a watch event line after its object.
pub const LINE_TAIL: &[u8] = b"}\n";

impl CachedEvent {
    /// The object after the change; for a delete, its last state (resourceVersion set
    /// to the deleting revision, as Kubernetes reports it).
    pub fn object(&self) -> &Arc<Object> {
        // Checked to be a JSON object when the event was taken in.
        self.object
            .get_or_init(|| Arc::new(decode_stored(&self.value, self.revision).unwrap_or_default()))
    }

    /// The object before the change, if it existed.
    pub fn prev(&self) -> Option<&Arc<Object>> {
        self.prev
            .get_or_init(|| {
                let (value, revision) = self.prev_value.as_ref()?;
                decode_stored(value, *revision).map(Arc::new)
            })
            .as_ref()
    }

    /// The watch event line `{"type":…,"object":…}` and a newline, announcing this
    /// change as `kind`.
    pub fn line(&self, kind: EventType) -> Bytes {
        self.lines[kind as usize]
            .get_or_init(|| self.encode_line(kind))
            .clone()
    }

    fn encode_line(&self, kind: EventType) -> Bytes {
        let mut line = Vec::new();
        line_head(&mut line, kind.as_str());
        // Another type's line already holds the object's JSON: copy it rather than
        // encode the object again.
        let encoded = EventType::ALL.iter().find_map(|&other| {
            let other_line = self.lines[other as usize].get()?;
            let start = br#"{"type":"","object":"#.len() + other.as_str().len();
            other_line.get(start..other_line.len().checked_sub(LINE_TAIL.len())?)
        });
        match encoded {
            Some(object) => line.extend_from_slice(object),
            None => {
                let head = line.len();
                line.reserve(1024);
                if serde_json::to_writer(&mut line, &**self.object()).is_err() {
                    // Not reachable for a JSON object (its keys are strings); an empty
                    // object keeps the stream well-formed all the same.
                    line.truncate(head);
                    line.extend_from_slice(b"{}");
                }
            }
        }
        line.extend_from_slice(LINE_TAIL);
        Bytes::from(line)
    }
}

/// Decodes a stored value into an object with its resourceVersion set.
pub fn decode_stored(value: &[u8], revision: Revision) -> Option<Object> {
    let mut obj: Object = serde_json::from_slice(value).ok()?;
    set_meta(&mut obj, "resourceVersion", revision.to_string());
    Some(obj)
}

/// Whether a stored value is a JSON object: checked when a change comes in, so that a
/// later decode cannot fail, without building the object.
fn is_object(value: &[u8]) -> bool {
    value.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
        && serde_json::from_slice::<serde::de::IgnoredAny>(value).is_ok()
}

/// Takes in a store event; `None` for a value that is not a JSON object (logged).
pub fn convert(event: &Event) -> Option<CachedEvent> {
    let revision = event.revision();
    let prev_value = event
        .prev
        .as_ref()
        .filter(|p| is_object(&p.value))
        .map(|p| (p.value.clone(), p.mod_revision));
    let value = match event.kind {
        EventKind::Put => Some(event.kv.value.clone()).filter(|v| is_object(v)),
        // The last state, reported at the deleting revision.
        EventKind::Delete => prev_value.as_ref().map(|(v, _)| v.clone()),
    };
    let Some(value) = value else {
        warn!(key = %event.kv.key, revision, "skipping a stored value that is not a JSON object");
        return None;
    };
    Some(CachedEvent {
        revision,
        key: event.kv.key.clone(),
        kind: event.kind,
        value,
        prev_value,
        object: OnceLock::new(),
        prev: OnceLock::new(),
        lines: Default::default(),
    })
}

/// The client watch's revision is older than the cache holds, or the cache has stopped
/// ([`WatchCache::is_stopped`]).
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
    /// Every object at `revision`, by key.
    objects: BTreeMap<String, Stored>,
    /// The last revision that changed something of each resource
    /// (`/registry/GROUP/PLURAL/`), for readers that keep their own view of a few
    /// resources (authorization's index of bindings).
    changed: std::collections::HashMap<String, Revision>,
    /// The revision of the last relist: everything may have changed then.
    relisted: Revision,
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
    /// Read by every lister and client list on the request path, written by the one
    /// feeder: readers do not wait for each other.
    state: RwLock<State>,
    /// Client watches ended because their buffer was full (their client stopped
    /// reading), for `/metrics`.
    terminated: std::sync::atomic::AtomicU64,
    capacity: usize,
    watcher_buffer: usize,
    revision_changed: tokio::sync::watch::Sender<Revision>,
    /// Set once the cache has stopped (the server is stopping).
    closed: tokio::sync::watch::Sender<bool>,
}

fn write(m: &RwLock<State>) -> std::sync::RwLockWriteGuard<'_, State> {
    m.write().unwrap_or_else(|e| e.into_inner())
}

fn read(m: &RwLock<State>) -> std::sync::RwLockReadGuard<'_, State> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

/// The prefix every Kubernetes object is stored under.
pub const REGISTRY: &str = "/registry/";

/// Keys per page of the list that fills the current state.
const LIST_PAGE: usize = 1000;

/// One object of the current state: the store's value and its revision.
#[derive(Clone, Debug)]
struct Stored(Arc<StoredObject>);

/// One object of the current state: its stored bytes, and the object decoded from
/// them the first time a reader asked. Readers that come back for the same objects
/// (authorization's roles and bindings on every request, admission's quotas) then
/// decode nothing.
#[derive(Debug)]
struct StoredObject {
    value: Bytes,
    revision: Revision,
    decoded: OnceLock<Option<Arc<Object>>>,
}

impl Stored {
    fn of(kv: &trellis_store::KeyValue) -> Self {
        Self(Arc::new(StoredObject {
            value: kv.value.clone(),
            revision: kv.mod_revision,
            decoded: OnceLock::new(),
        }))
    }

    fn decode(&self) -> Option<Arc<Object>> {
        self.0
            .decoded
            .get_or_init(|| decode_stored(&self.0.value, self.0.revision).map(Arc::new))
            .clone()
    }
}

/// Objects read from the cache's current state, and the revision they are at.
#[derive(Debug)]
pub struct Listed {
    pub revision: Revision,
    pub objects: Vec<Arc<Object>>,
}

/// Every object under `/registry/`, read at one revision, page by page.
async fn list_registry(
    store: &dyn Store,
) -> trellis_store::Result<(Revision, BTreeMap<String, Stored>)> {
    let mut objects = BTreeMap::new();
    let mut request = ListRequest {
        limit: Some(LIST_PAGE),
        ..ListRequest::prefix(REGISTRY)
    };
    loop {
        let page = store.list(request.clone()).await?;
        for kv in &page.kvs {
            // Checked once here so that reads never meet a value that is not an object.
            match serde_json::from_slice::<Object>(&kv.value) {
                Ok(_) => {
                    objects.insert(kv.key.clone(), Stored::of(kv));
                }
                Err(_) => warn!(key = %kv.key, "skipping a stored value that is not a JSON object"),
            }
        }
        match (page.more, page.kvs.last()) {
            (true, Some(last)) => {
                request.start_after = Some(last.key.clone());
                request.revision = Some(page.revision);
            }
            _ => return Ok((page.revision, objects)),
        }
    }
}

impl WatchCache {
    /// Starts the cache with the objects of a list of `/registry/` (at that list's
    /// revision) and its feeder task, which runs until `shutdown` completes.
    pub async fn start(
        store: Arc<dyn Store>,
        capacity: usize,
        watcher_buffer: usize,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> trellis_store::Result<Arc<Self>> {
        let (revision, objects) = list_registry(store.as_ref()).await?;
        let (revision_changed, _) = tokio::sync::watch::channel(revision);
        let cache = Arc::new(Self {
            state: RwLock::new(State {
                events: VecDeque::new(),
                base: revision,
                revision,
                watchers: Vec::new(),
                objects,
                changed: std::collections::HashMap::new(),
                relisted: revision,
            }),
            capacity: capacity.max(1),
            watcher_buffer: watcher_buffer.max(1),
            terminated: std::sync::atomic::AtomicU64::new(0),
            revision_changed,
            closed: tokio::sync::watch::channel(false).0,
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
        read(&self.state).revision
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
                Err(trellis_store::Error::Compacted { .. }) => {
                    self.relist(store.as_ref()).await;
                    continue;
                }
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

    /// The store compacted events the cache has not seen: start again from a list.
    /// Client watches end (they relist too) and the ring starts empty at the list's
    /// revision, so older watch revisions fall back to the store.
    async fn relist(&self, store: &dyn Store) {
        let (revision, objects) = match list_registry(store).await {
            Ok(listed) => listed,
            Err(e) => {
                warn!(error = %e, "watch cache cannot list the store; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
                return;
            }
        };
        warn!(
            revision,
            "watch cache missed compacted events; relisted the store"
        );
        let mut state = write(&self.state);
        for slot in state.watchers.drain(..) {
            slot.lagged.store(true, Ordering::Release);
        }
        state.events.clear();
        state.base = revision;
        state.revision = revision;
        state.relisted = revision;
        state.changed.clear();
        state.objects = objects;
        drop(state);
        self.revision_changed.send_replace(revision);
    }

    fn apply(&self, events: &[Event]) {
        let converted: Vec<(&Event, Option<Arc<CachedEvent>>)> = events
            .iter()
            .map(|e| (e, convert(e).map(Arc::new)))
            .collect();
        let last = events.last().map(Event::revision);
        let mut state = write(&self.state);
        for (raw, event) in converted {
            let Some(event) = event else {
                // Not an object any more (or a delete without its last state): the key
                // holds nothing a reader could use.
                state.objects.remove(&raw.kv.key);
                continue;
            };
            if let Some(resource) = resource_prefix(&event.key) {
                match state.changed.get_mut(resource) {
                    Some(at) => *at = event.revision,
                    None => {
                        state.changed.insert(resource.to_owned(), event.revision);
                    }
                }
            }
            match event.kind {
                EventKind::Put => {
                    state.objects.insert(event.key.clone(), Stored::of(&raw.kv));
                }
                EventKind::Delete => {
                    state.objects.remove(&event.key);
                }
            }
            state.watchers.retain(|slot| {
                if !event.key.starts_with(&slot.prefix) {
                    return !slot.tx.is_closed();
                }
                match slot.tx.try_send(event.clone()) {
                    Ok(()) => true,
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        slot.lagged.store(true, Ordering::Release);
                        self.terminated.fetch_add(1, Ordering::Relaxed);
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
        let mut state = write(&self.state);
        // A stopped cache takes no new watchers: one added now would never be fed nor
        // ended, and would hold its client's connection open for ever.
        if after < state.base || *self.closed.borrow() {
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
        let mut state = write(&self.state);
        state.watchers.clear();
        // Under the lock: no subscribe can slip in between.
        self.closed.send_replace(true);
    }

    /// Whether the cache has stopped (the server is stopping): loops that follow it end.
    pub fn is_stopped(&self) -> bool {
        *self.closed.borrow()
    }

    /// Completes once the cache has stopped: what serves clients beside it (watches
    /// from the store's history) ends then too.
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.closed.subscribe();
        async move {
            let _ = rx.wait_for(|c| *c).await;
        }
    }

    /// The last revision the cache saw change anything under `resource_prefix`
    /// (`/registry/GROUP/PLURAL/`), or its start or last relist.
    pub fn last_change(&self, resource_prefix: &str) -> Revision {
        let state = read(&self.state);
        state
            .changed
            .get(resource_prefix)
            .copied()
            .unwrap_or(0)
            .max(state.relisted)
    }

    /// Client watches ended so far because their client stopped reading.
    pub fn terminated_watchers(&self) -> u64 {
        self.terminated.load(Ordering::Relaxed)
    }

    pub fn watcher_count(&self) -> usize {
        read(&self.state).watchers.len()
    }

    /// One object of the current state.
    pub fn get(&self, key: &str) -> Option<Arc<Object>> {
        let stored = read(&self.state).objects.get(key).cloned();
        stored?.decode()
    }

    /// The current state's objects under `prefix`, in key order, and the revision
    /// they are at.
    pub fn list(&self, prefix: &str) -> Listed {
        // Copied out under the lock (reference counts only), decoded after it.
        let (revision, stored): (Revision, Vec<Stored>) = {
            let state = read(&self.state);
            let stored = state
                .objects
                .range::<str, _>((
                    std::ops::Bound::Included(prefix),
                    std::ops::Bound::Unbounded,
                ))
                .take_while(|(key, _)| key.starts_with(prefix))
                .map(|(_, stored)| stored.clone())
                .collect();
            (state.revision, stored)
        };
        Listed {
            revision,
            objects: stored.iter().filter_map(Stored::decode).collect(),
        }
    }

    /// How many objects the current state holds.
    pub fn object_count(&self) -> usize {
        read(&self.state).objects.len()
    }
}

/// `/registry/GROUP/PLURAL/` of a key under it.
fn resource_prefix(key: &str) -> Option<&str> {
    let mut slashes = key.match_indices('/').map(|(i, _)| i);
    let end = slashes.nth(3)?;
    Some(&key[..=end])
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use serde_json::json;
    use trellis_store::{RedbConfig, RedbStore};

    use super::*;

    fn value(name: &str, label: &str) -> Bytes {
        Bytes::from(
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": name, "namespace": "a", "labels": {"l": label}}})
            .to_string(),
        )
    }

    fn rv(obj: &Object) -> String {
        obj["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    async fn started() -> (tempfile::TempDir, Arc<dyn Store>) {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> =
            Arc::new(RedbStore::open(RedbConfig::new(dir.path().join("s.redb"))).unwrap());
        (dir, store)
    }

    const A: &str = "/registry/configmaps/a/";

    #[tokio::test]
    async fn current_state_starts_from_a_list_and_follows_puts_and_deletes() {
        let (_dir, store) = started().await;
        let one = store
            .create(&format!("{A}one"), value("one", "x"))
            .await
            .unwrap();
        store
            .create("/registry/configmaps/b/other", value("other", "x"))
            .await
            .unwrap();
        store.create("/elsewhere/k", value("k", "x")).await.unwrap();
        let cache = WatchCache::start(store.clone(), 16, 16, std::future::pending())
            .await
            .unwrap();
        assert_eq!(cache.object_count(), 2, "only /registry/ is kept");
        let first = cache.get(&format!("{A}one")).unwrap();
        assert_eq!(rv(&first), one.mod_revision.to_string());

        let two = store
            .create(&format!("{A}two"), value("two", "y"))
            .await
            .unwrap();
        let updated = store
            .update(&format!("{A}one"), value("one", "z"), None)
            .await
            .unwrap();
        let gone = store
            .delete("/registry/configmaps/b/other", None)
            .await
            .unwrap();
        assert!(cache.wait_for(gone.revision, Duration::from_secs(5)).await);

        let listed = cache.list(A);
        assert!(listed.revision >= gone.revision);
        let names: Vec<&str> = listed
            .objects
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["one", "two"]);
        assert_eq!(rv(&listed.objects[0]), updated.mod_revision.to_string());
        assert_eq!(listed.objects[0]["metadata"]["labels"]["l"], "z");
        assert_eq!(rv(&listed.objects[1]), two.mod_revision.to_string());
        assert!(cache.get("/registry/configmaps/b/other").is_none());
        assert!(cache.list("/registry/configmaps/b/").objects.is_empty());
        // What an earlier read handed out is not changed by later events.
        assert_eq!(first["metadata"]["labels"]["l"], "x");
    }

    #[tokio::test]
    async fn current_state_reads_what_the_events_carry() {
        let (_dir, store) = started().await;
        let cache = WatchCache::start(store.clone(), 16, 16, std::future::pending())
            .await
            .unwrap();
        let mut sub = cache.subscribe(A, cache.revision()).unwrap();
        let kv = store
            .create(&format!("{A}one"), value("one", "x"))
            .await
            .unwrap();
        let event = sub.rx.recv().await.unwrap();
        assert_eq!(event.revision, kv.mod_revision);
        let current = cache.get(&format!("{A}one")).unwrap();
        assert_eq!(**event.object(), *current);
    }

    #[tokio::test]
    async fn a_value_that_is_not_an_object_leaves_nothing_to_read() {
        let (_dir, store) = started().await;
        let cache = WatchCache::start(store.clone(), 16, 16, std::future::pending())
            .await
            .unwrap();
        let key = format!("{A}one");
        store.create(&key, value("one", "x")).await.unwrap();
        let kv = store
            .update(&key, Bytes::from_static(b"not json"), None)
            .await
            .unwrap();
        assert!(
            cache
                .wait_for(kv.mod_revision, Duration::from_secs(5))
                .await
        );
        assert!(cache.get(&key).is_none());
    }

    #[tokio::test]
    async fn a_relist_replaces_the_state_and_ends_client_watches() {
        let (_dir, store) = started().await;
        let cache = WatchCache::start(store.clone(), 16, 16, std::future::pending())
            .await
            .unwrap();
        let key = format!("{A}one");
        let kv = store.create(&key, value("one", "x")).await.unwrap();
        assert!(
            cache
                .wait_for(kv.mod_revision, Duration::from_secs(5))
                .await
        );
        let sub = cache.subscribe(A, cache.revision()).unwrap();
        cache.relist(store.as_ref()).await;
        assert!(sub.lagged.load(Ordering::Acquire));
        assert_eq!(cache.watcher_count(), 0);
        assert!(matches!(
            cache.subscribe(A, kv.mod_revision - 1),
            Err(TooOld)
        ));
        assert_eq!(rv(&cache.get(&key).unwrap()), kv.mod_revision.to_string());
    }
}
