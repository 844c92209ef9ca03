//! Client watches: a stream of `{"type": …, "object": …}` lines.
//!
//! Without a resourceVersion (or with "0") the watch first sends every matching
//! object as ADDED, then changes after that list. With a resourceVersion it sends
//! every change after it: from the watch cache when the cache still holds it, else
//! from a store watch; a revision the store has compacted ends the watch with an
//! ERROR event carrying 410 Gone. Selectors apply to both states of a change, so an
//! object that stops matching is seen as DELETED and one that starts as ADDED.
//!
//! The response body is [`Events`], a stream that the client's connection polls: a
//! change goes from the cache's channel to the socket in one task wake-up, and the
//! changes that queued for a watch since its last write go out as one chunk (one TLS
//! record and one write for the lot).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::{Stream, StreamExt as _};
use serde_json::{Value, json};
use tokio::time::{Instant, Sleep};
use trellis_api::ApiError;
use trellis_api::registry::ResourceInfo;
use trellis_api::selector::{FieldSelector, LabelSelector};
use trellis_store::{EventKind, Revision, WatchStream};

use crate::endpoints::request::{ApiRequest, IncludeObject};
use crate::endpoints::response::{ApiResult, store_error};
use crate::endpoints::table;
use crate::object::{Object, metadata};
use crate::registry::{self, State};
use crate::storage::watch_cache::{self, CachedEvent, EventType, Subscription, TooOld, WatchCache};

/// How long before its deadline a watch that allows bookmarks gets one, as
/// kube-apiserver does: the client resumes from it rather than from its last change.
const BOOKMARK_BEFORE_DEADLINE: Duration = Duration::from_secs(2);
/// The longest a watch runs when the client names no timeout, as kube-apiserver's
/// default range.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);
/// The most a body chunk gathers before it is handed to the connection: enough for
/// hundreds of queued changes in one write, little enough that a watch replaying a
/// large list does not hold it all at once.
const CHUNK_BYTES: usize = 64 * 1024;

struct Filter {
    labels: LabelSelector,
    fields: FieldSelector,
    include_uninitialized: bool,
}

impl Filter {
    fn matches(&self, obj: &Object) -> bool {
        let initialized = self.include_uninitialized
            || metadata(obj)
                .and_then(|m| m.get("initializers"))
                .and_then(|i| i.get("pending"))
                .and_then(Value::as_array)
                .is_none_or(|p| p.is_empty());
        let labels = metadata(obj)
            .and_then(|m| m.get("labels"))
            .and_then(Value::as_object);
        initialized
            && self
                .labels
                .matches(|key| labels.and_then(|l| l.get(key)).and_then(Value::as_str))
            && (self.fields.is_empty() || self.fields.matches(|f| registry::field_value(obj, f)))
    }
}

enum Source {
    Cache(Subscription),
    /// A watch from the store's history, and the server's stop, which ends it.
    Store(
        WatchStream,
        std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    ),
}

pub async fn watch(state: State, req: ApiRequest) -> ApiResult {
    let res = req.resource.clone();
    let labels = LabelSelector::parse(req.query.label_selector.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::bad_request(format!("unable to parse requirement: {e}")))?;
    let fields = FieldSelector::parse(req.query.field_selector.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::bad_request(format!("invalid field selector: {e}")))?;
    let filter = Filter {
        labels,
        fields,
        include_uninitialized: req.include_uninitialized,
    };
    let prefix = match (&req.name, req.namespace.as_deref()) {
        (Some(name), ns) => res.key(ns, name),
        (None, ns) => res.namespace_prefix(ns),
    };
    let rv = req.query.resource_version.clone().unwrap_or_default();
    let (initial, after) = if rv.is_empty() || rv == "0" {
        let mut list_req = req.clone();
        list_req.query.limit = None;
        list_req.query.continue_token = None;
        list_req.query.resource_version = None;
        let page = registry::list_objects(&state, &list_req).await?;
        let (items, revision) = (page.items, page.revision);
        let items: Vec<Object> = match &req.name {
            Some(n) => items
                .into_iter()
                .filter(|o| crate::object::name(o) == Some(n.as_str()))
                .collect(),
            None => items,
        };
        (items, revision)
    } else {
        let n: Revision = rv
            .parse()
            .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {rv:?}")))?;
        (Vec::new(), n)
    };
    let source = match state.cache.subscribe(&prefix, after) {
        Ok(sub) => Ok(Source::Cache(sub)),
        Err(TooOld) => match state.store.watch(&prefix, after + 1).await {
            Ok(stream) => Ok(Source::Store(stream, Box::pin(state.cache.stopped()))),
            // The client is told of the revision it asked for, not the store's next one.
            Err(trellis_store::Error::Compacted { compacted, .. }) => Err(store_error(
                trellis_store::Error::Compacted {
                    requested: after,
                    compacted,
                },
                &res,
                "",
            )),
            Err(e) => Err(store_error(e, &res, "")),
        },
    };
    let timeout = req
        .query
        .timeout_seconds
        .map_or(DEFAULT_TIMEOUT, Duration::from_secs);
    let lines = Lines {
        resource: req.resource.clone(),
        table: req.table,
        filter,
    };
    let events = Events::new(
        lines,
        state.cache.clone(),
        initial,
        after,
        source,
        req.query
            .allow_watch_bookmarks
            .then_some(state.settings.bookmark_interval),
        timeout,
    );
    let body = Body::from_stream(events);
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::OK;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
    Ok(response)
}

/// When a watch allowing bookmarks gets its next one: `every` from `now`, or
/// [`BOOKMARK_BEFORE_DEADLINE`] before it ends if that is sooner; `None` once that
/// moment has passed.
fn next_bookmark(now: Instant, every: Duration, ends_at: Instant) -> Option<Instant> {
    let heartbeat = now + every;
    let at = match ends_at.checked_sub(BOOKMARK_BEFORE_DEADLINE) {
        Some(before_end) if before_end < heartbeat => before_end,
        _ => heartbeat,
    };
    (at > now).then_some(at)
}

/// A watch's response body: the list (for a watch without resourceVersion), then the
/// changes after `after`, as event lines, until the source ends, the deadline passes
/// or the client goes away (the connection drops the body, and with it the
/// subscription).
struct Events {
    lines: Lines,
    cache: Arc<WatchCache>,
    initial: std::vec::IntoIter<Object>,
    /// `None` once it has ended.
    source: Option<Result<Source, ApiError>>,
    /// What the cache held after `after` when the watch subscribed.
    replay: VecDeque<Arc<CachedEvent>>,
    after: Revision,
    /// The revision of the last change sent.
    last: Revision,
    /// How often bookmarks come, when the client allows them.
    bookmark_every: Option<Duration>,
    /// When the next bookmark is due; `None` when none is.
    next_bookmark: Option<Pin<Box<Sleep>>>,
    /// When the watch ends.
    ends_at: Instant,
    /// A bookmark to send once the changes queued before it are sent.
    bookmark_due: Option<Revision>,
    /// Events taken from the source, kept to reuse its allocation.
    received: Vec<Arc<CachedEvent>>,
    deadline: Pin<Box<Sleep>>,
    done: bool,
}

impl Events {
    fn new(
        lines: Lines,
        cache: Arc<WatchCache>,
        initial: Vec<Object>,
        after: Revision,
        mut source: Result<Source, ApiError>,
        bookmark_every: Option<Duration>,
        timeout: Duration,
    ) -> Self {
        let replay = match &mut source {
            Ok(Source::Cache(sub)) => std::mem::take(&mut sub.replay).into(),
            _ => VecDeque::new(),
        };
        let now = Instant::now();
        // A timeoutSeconds beyond any real watch (up to u64::MAX) ends in a year.
        let ends_at = now
            .checked_add(timeout)
            .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600));
        let next_bookmark = bookmark_every
            .and_then(|every| next_bookmark(now, every, ends_at))
            .map(|at| Box::pin(tokio::time::sleep_until(at)));
        Self {
            lines,
            cache,
            initial: initial.into_iter(),
            source: Some(source),
            replay,
            after,
            last: after,
            bookmark_every,
            next_bookmark,
            ends_at,
            bookmark_due: None,
            received: Vec::new(),
            deadline: Box::pin(tokio::time::sleep_until(ends_at)),
            done: false,
        }
    }

    /// Adds to `chunk` what is ready to send, until it holds [`CHUNK_BYTES`]; sets
    /// `done` once nothing more will come. Leaves a waker with everything it found
    /// not ready when it returns with `chunk` empty.
    fn fill(&mut self, cx: &mut Context<'_>, chunk: &mut Chunk) {
        for obj in self.initial.by_ref() {
            chunk.push(self.lines.encode("ADDED", obj));
            if chunk.len() >= CHUNK_BYTES {
                return;
            }
        }
        let source = match &mut self.source {
            Some(Ok(source)) => source,
            Some(Err(_)) => {
                if let Some(Err(e)) = self.source.take() {
                    chunk.push(error_line(&e));
                }
                self.done = true;
                return;
            }
            None => {
                self.done = true;
                return;
            }
        };
        while let Some(event) = self.replay.pop_front() {
            if event.revision > self.last {
                self.last = event.revision;
                self.lines.change(&event, chunk);
                if chunk.len() >= CHUNK_BYTES {
                    return;
                }
            }
        }
        if self.bookmark_due.is_none()
            && let Some(due) = &mut self.next_bookmark
            && due.as_mut().poll(cx).is_ready()
        {
            // One bookmark after a stall, not a burst: the next is counted from now.
            self.next_bookmark = self
                .bookmark_every
                .and_then(|every| next_bookmark(Instant::now(), every, self.ends_at))
                .map(|at| Box::pin(tokio::time::sleep_until(at)));
            // Read before the channel is drained: the cache queues a change for its
            // watches before it advances its revision, so every change up to this one
            // is sent before the bookmark. A store watch's events are only known
            // once they arrive.
            self.bookmark_due = Some(match source {
                Source::Cache(_) => self.cache.revision(),
                Source::Store(..) => self.last,
            });
        }
        loop {
            if chunk.len() >= CHUNK_BYTES {
                return;
            }
            match source.poll_next(cx, &mut self.received) {
                Poll::Ready(true) => {
                    for event in self.received.drain(..) {
                        if event.revision > self.last {
                            self.last = event.revision;
                            self.lines.change(&event, chunk);
                        }
                    }
                }
                Poll::Ready(false) => {
                    // The cache dropped this watch (it fell behind, or the server is
                    // stopping) or the store watch ended: the client resumes from the
                    // last revision it saw.
                    // Asked of the cache, not of `stopped`: that future may have
                    // completed in `poll_next` already, and must not be polled again.
                    if let Source::Store(..) = source
                        && !self.cache.is_stopped()
                    {
                        let after = self.after;
                        chunk.push(error_line(&ApiError::gone(format!(
                            "too old resource version: {after}"
                        ))));
                    }
                    self.source = None;
                    self.done = true;
                    return;
                }
                Poll::Pending => break,
            }
        }
        if let Some(revision) = self.bookmark_due.take() {
            chunk.push(self.lines.bookmark(revision.max(self.last)));
        }
    }
}

impl Stream for Events {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if this.deadline.as_mut().poll(cx).is_ready() {
            this.done = true;
            return Poll::Ready(None);
        }
        let mut chunk = Chunk::Empty;
        this.fill(cx, &mut chunk);
        match chunk.into_bytes() {
            Some(bytes) => Poll::Ready(Some(Ok(bytes))),
            None if this.done => Poll::Ready(None),
            None => Poll::Pending,
        }
    }
}

impl Source {
    /// Moves the next event or batch into `into`: `Ready(false)` once the source has
    /// ended.
    fn poll_next(&mut self, cx: &mut Context<'_>, into: &mut Vec<Arc<CachedEvent>>) -> Poll<bool> {
        match self {
            Source::Cache(sub) => sub.rx.poll_recv(cx).map(|event| match event {
                Some(event) => {
                    into.push(event);
                    true
                }
                None => false,
            }),
            Source::Store(stream, stopped) => {
                // The server is stopping: the client resumes against the next one.
                if stopped.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(false);
                }
                stream.poll_next_unpin(cx).map(|next| match next {
                    Some(Ok(events)) => {
                        into.extend(events.iter().filter_map(watch_cache::convert).map(Arc::new));
                        true
                    }
                    Some(Err(_)) | None => false,
                })
            }
        }
    }
}

/// The lines of one body chunk. A single line is the shared encoding itself; more
/// are copied into one buffer.
enum Chunk {
    Empty,
    One(Bytes),
    Many(Vec<u8>),
}

impl Chunk {
    fn push(&mut self, line: Bytes) {
        match self {
            Chunk::Empty => *self = Chunk::One(line),
            Chunk::One(first) => {
                let mut many = Vec::with_capacity((first.len() + line.len()) * 4);
                many.extend_from_slice(first);
                many.extend_from_slice(&line);
                *self = Chunk::Many(many);
            }
            Chunk::Many(many) => many.extend_from_slice(&line),
        }
    }

    fn len(&self) -> usize {
        match self {
            Chunk::Empty => 0,
            Chunk::One(line) => line.len(),
            Chunk::Many(many) => many.len(),
        }
    }

    fn into_bytes(self) -> Option<Bytes> {
        match self {
            Chunk::Empty => None,
            Chunk::One(line) => Some(line),
            Chunk::Many(many) => Some(Bytes::from(many)),
        }
    }
}

/// How one client watch writes its lines.
struct Lines {
    resource: ResourceInfo,
    /// Set when the client asked for `meta.k8s.io` Tables (kubectl get -w): what their
    /// rows carry.
    table: Option<IncludeObject>,
    filter: Filter,
}

impl Lines {
    /// An event line for `obj`, encoded for this watch alone.
    fn encode(&self, kind: &str, obj: Object) -> Bytes {
        let object = match self.table {
            Some(include) => {
                table::object_table(&self.resource, std::slice::from_ref(&obj), None, include)
            }
            None => Value::Object(obj),
        };
        value_line(kind, &object)
    }

    /// The line of one change as the client's selectors see it, if they see it.
    fn change(&self, event: &CachedEvent, chunk: &mut Chunk) {
        let was = event.prev().is_some_and(|p| self.filter.matches(p));
        let kind = match event.kind {
            EventKind::Put => match (was, self.filter.matches(event.object())) {
                (false, true) => EventType::Added,
                (true, true) => EventType::Modified,
                (true, false) => EventType::Deleted,
                (false, false) => return,
            },
            EventKind::Delete if was => EventType::Deleted,
            EventKind::Delete => return,
        };
        chunk.push(if self.table.is_some() {
            self.encode(kind.as_str(), (**event.object()).clone())
        } else {
            event.line(kind)
        });
    }

    fn bookmark(&self, revision: Revision) -> Bytes {
        let res = &self.resource;
        value_line(
            "BOOKMARK",
            &json!({
                "kind": res.kind, "apiVersion": res.api_version(),
                "metadata": {"resourceVersion": revision.to_string()},
            }),
        )
    }
}

fn error_line(e: &ApiError) -> Bytes {
    value_line("ERROR", &e.to_status())
}

fn value_line(kind: &str, object: &impl serde::Serialize) -> Bytes {
    let mut line = Vec::new();
    watch_cache::line_head(&mut line, kind);
    let head = line.len();
    if serde_json::to_writer(&mut line, object).is_err() {
        line.truncate(head);
        line.extend_from_slice(b"{}");
    }
    line.extend_from_slice(watch_cache::LINE_TAIL);
    Bytes::from(line)
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use futures::StreamExt as _;
    use serde_json::json;
    use trellis_api::registry::builtins;
    use trellis_store::{RedbConfig, RedbStore, Store};

    use super::*;

    const A: &str = "/registry/configmaps/a/";

    struct Fixture {
        _dir: tempfile::TempDir,
        store: Arc<dyn Store>,
        cache: Arc<WatchCache>,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
    }

    async fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> =
            Arc::new(RedbStore::open(RedbConfig::new(dir.path().join("s.redb"))).unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let cache = WatchCache::start(store.clone(), 64, 64, async move {
            let _ = stopped.await;
        })
        .await
        .unwrap();
        Fixture {
            _dir: dir,
            store,
            cache,
            stop: Some(stop),
        }
    }

    fn config_map(name: &str, team: &str) -> Bytes {
        Bytes::from(
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": name, "namespace": "a", "labels": {"team": team}}})
            .to_string(),
        )
    }

    fn lines(selector: &str) -> Lines {
        Lines {
            resource: builtins()
                .into_iter()
                .find(|r| r.plural == "configmaps")
                .unwrap(),
            table: None,
            filter: Filter {
                labels: LabelSelector::parse(selector).unwrap(),
                fields: FieldSelector::default(),
                include_uninitialized: false,
            },
        }
    }

    impl Fixture {
        /// A watch of namespace `a` from the cache's revision.
        fn watch(&self, selector: &str, bookmark_every: Option<Duration>) -> Events {
            let after = self.cache.revision();
            let sub = self.cache.subscribe(A, after).unwrap();
            Events::new(
                lines(selector),
                self.cache.clone(),
                Vec::new(),
                after,
                Ok(Source::Cache(sub)),
                bookmark_every,
                Duration::from_secs(60),
            )
        }

        async fn create(&self, name: &str, team: &str) -> Revision {
            let kv = self
                .store
                .create(&format!("{A}{name}"), config_map(name, team))
                .await
                .unwrap();
            assert!(
                self.cache
                    .wait_for(kv.mod_revision, Duration::from_secs(5))
                    .await
            );
            kv.mod_revision
        }
    }

    /// The next chunk, split into its decoded lines.
    async fn next_chunk(events: &mut Events) -> Option<(Bytes, Vec<Value>)> {
        let chunk = tokio::time::timeout(Duration::from_secs(5), events.next())
            .await
            .expect("a chunk or the end within 5 s")?
            .unwrap();
        assert!(chunk.ends_with(b"\n"), "a chunk holds whole lines");
        let lines = chunk
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        Some((chunk, lines))
    }

    fn summary(lines: &[Value]) -> Vec<(String, String)> {
        lines
            .iter()
            .map(|l| {
                let name = l["object"]["metadata"]["name"]
                    .as_str()
                    .or(l["object"]["metadata"]["resourceVersion"].as_str())
                    .unwrap_or_default();
                (l["type"].as_str().unwrap().to_owned(), name.to_owned())
            })
            .collect()
    }

    #[tokio::test]
    async fn changes_queued_for_a_watch_go_out_as_one_chunk_in_order() {
        let f = fixture().await;
        let mut events = f.watch("", None);
        for name in ["one", "two", "three"] {
            f.create(name, "x").await;
        }
        let (_, lines) = next_chunk(&mut events).await.unwrap();
        assert_eq!(
            summary(&lines),
            [("ADDED", "one"), ("ADDED", "two"), ("ADDED", "three")]
                .map(|(t, n)| (t.to_owned(), n.to_owned()))
        );
    }

    #[tokio::test]
    async fn watchers_of_one_change_share_its_encoded_line() {
        let f = fixture().await;
        let (mut first, mut second) = (f.watch("", None), f.watch("", None));
        f.create("one", "x").await;
        let (a, lines) = next_chunk(&mut first).await.unwrap();
        let (b, _) = next_chunk(&mut second).await.unwrap();
        assert_eq!(summary(&lines), [("ADDED".to_owned(), "one".to_owned())]);
        assert_eq!(
            a.as_ptr(),
            b.as_ptr(),
            "one encoding, not a copy per watcher"
        );
    }

    #[tokio::test]
    async fn selectors_see_an_object_leave_as_deleted() {
        let f = fixture().await;
        let mut events = f.watch("team=x", None);
        f.create("one", "x").await;
        f.create("other", "y").await;
        let key = format!("{A}one");
        let kv = f
            .store
            .update(&key, config_map("one", "y"), None)
            .await
            .unwrap();
        assert!(
            f.cache
                .wait_for(kv.mod_revision, Duration::from_secs(5))
                .await
        );
        let (_, lines) = next_chunk(&mut events).await.unwrap();
        assert_eq!(
            summary(&lines),
            [("ADDED", "one"), ("DELETED", "one")].map(|(t, n)| (t.to_owned(), n.to_owned()))
        );
    }

    #[tokio::test]
    async fn a_bookmark_comes_after_the_changes_it_covers() {
        let f = fixture().await;
        let mut events = f.watch("", Some(Duration::from_millis(50)));
        let first = f.create("one", "x").await;
        let second = f.create("two", "x").await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (_, lines) = next_chunk(&mut events).await.unwrap();
        let types: Vec<&str> = lines.iter().map(|l| l["type"].as_str().unwrap()).collect();
        assert_eq!(types, ["ADDED", "ADDED", "BOOKMARK"]);
        assert_eq!(
            lines[0]["object"]["metadata"]["resourceVersion"],
            first.to_string()
        );
        assert_eq!(lines[2]["object"]["kind"], "ConfigMap");
        assert_eq!(
            lines[2]["object"]["metadata"]["resourceVersion"],
            second.to_string()
        );
    }

    #[tokio::test]
    async fn a_timeout_past_any_clock_is_a_long_watch_not_a_panic() {
        let f = fixture().await;
        let after = f.cache.revision();
        let sub = f.cache.subscribe(A, after).unwrap();
        let events = Events::new(
            lines(""),
            f.cache.clone(),
            Vec::new(),
            after,
            Ok(Source::Cache(sub)),
            Some(Duration::from_secs(30)),
            Duration::from_secs(u64::MAX),
        );
        assert!(events.ends_at > Instant::now() + Duration::from_secs(3600));
    }

    #[test]
    fn bookmarks_come_periodically_and_once_just_before_the_end() {
        let now = Instant::now();
        let every = Duration::from_secs(30);
        // A long watch: the period.
        assert_eq!(
            next_bookmark(now, every, now + Duration::from_secs(600)),
            Some(now + every)
        );
        // A watch ending within the period: two seconds before its end.
        assert_eq!(
            next_bookmark(now, every, now + Duration::from_secs(10)),
            Some(now + Duration::from_secs(8))
        );
        // At that moment, or with under two seconds left: none.
        assert_eq!(
            next_bookmark(now, every, now + Duration::from_secs(2)),
            None
        );
        assert_eq!(
            next_bookmark(now, every, now + Duration::from_millis(500)),
            None
        );
    }

    #[tokio::test]
    async fn a_store_watch_that_ends_sends_410_gone_and_closes() {
        let f = fixture().await;
        let mut events = Events::new(
            lines(""),
            f.cache.clone(),
            Vec::new(),
            7,
            Ok(Source::Store(
                futures::stream::empty().boxed(),
                Box::pin(std::future::pending()),
            )),
            None,
            Duration::from_secs(60),
        );
        let (_, lines) = next_chunk(&mut events).await.unwrap();
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0]["type"], "ERROR");
        assert_eq!(lines[0]["object"]["code"], 410);
        assert_eq!(lines[0]["object"]["reason"], "Expired");
        assert!(next_chunk(&mut events).await.is_none());
    }

    #[tokio::test]
    async fn the_list_comes_before_an_error_that_ends_the_watch() {
        let f = fixture().await;
        let obj: Object = serde_json::from_slice(&config_map("listed", "x")).unwrap();
        let mut events = Events::new(
            lines(""),
            f.cache.clone(),
            vec![obj],
            0,
            Err(ApiError::gone("too old resource version: 0")),
            None,
            Duration::from_secs(60),
        );
        let (_, lines) = next_chunk(&mut events).await.unwrap();
        let types: Vec<&str> = lines.iter().map(|l| l["type"].as_str().unwrap()).collect();
        assert_eq!(types, ["ADDED", "ERROR"]);
        assert!(next_chunk(&mut events).await.is_none());
    }

    #[tokio::test]
    async fn a_watch_ends_at_its_timeout() {
        let f = fixture().await;
        let after = f.cache.revision();
        let sub = f.cache.subscribe(A, after).unwrap();
        let mut events = Events::new(
            lines(""),
            f.cache.clone(),
            Vec::new(),
            after,
            Ok(Source::Cache(sub)),
            None,
            Duration::from_millis(50),
        );
        let started = Instant::now();
        assert!(next_chunk(&mut events).await.is_none());
        assert!(started.elapsed() >= Duration::from_millis(50));
    }

    #[tokio::test]
    async fn a_stopping_cache_closes_its_watches_without_an_error() {
        let mut f = fixture().await;
        let mut events = f.watch("", None);
        f.create("one", "x").await;
        let _ = f.stop.take().unwrap().send(());
        let (_, lines) = next_chunk(&mut events).await.unwrap();
        assert_eq!(summary(&lines), [("ADDED".to_owned(), "one".to_owned())]);
        assert!(next_chunk(&mut events).await.is_none());
    }
}
