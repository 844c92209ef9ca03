//! Client watches: a stream of `{"type": …, "object": …}` lines.
//!
//! Without a resourceVersion (or with "0") the watch first sends every matching
//! object as ADDED, then changes after that list. With a resourceVersion it sends
//! every change after it: from the watch cache when the cache still holds it, else
//! from a store watch; a revision the store has compacted ends the watch with an
//! ERROR event carrying 410 Gone. Selectors apply to both states of a change, so an
//! object that stops matching is seen as DELETED and one that starts as ADDED.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use trellis_api::ApiError;
use trellis_api::selector::{FieldSelector, LabelSelector};
use trellis_store::{EventKind, Revision, WatchStream};

use crate::handlers::{self, State};
use crate::object::{Object, metadata};
use crate::request::ApiRequest;
use crate::response::{ApiResult, store_error};
use crate::table;
use crate::watch_cache::{self, CachedEvent, Subscription, TooOld};

/// How often a watch that allows bookmarks gets one.
const BOOKMARK_EVERY: Duration = Duration::from_secs(30);
/// The longest a watch runs when the client names no timeout, as kube-apiserver's
/// default range.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

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
            && (self.fields.is_empty() || self.fields.matches(|f| handlers::field_value(obj, f)))
    }
}

enum Source {
    Cache(Subscription),
    Store(WatchStream),
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
        let (items, revision, _) = handlers::list_objects(&state, &list_req).await?;
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
            Ok(stream) => Ok(Source::Store(stream)),
            Err(e) => Err(store_error(e, &res, "")),
        },
    };
    let timeout = req
        .query
        .timeout_seconds
        .map_or(DEFAULT_TIMEOUT, Duration::from_secs);
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    let writer = Writer {
        tx,
        req: req.clone(),
    };
    tokio::spawn(async move {
        let _ =
            tokio::time::timeout(timeout, writer.run(state, initial, after, source, filter)).await;
    });
    let body = Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    }));
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

struct Writer {
    tx: mpsc::Sender<Bytes>,
    req: ApiRequest,
}

impl Writer {
    /// Sends one event line; false once the client is gone.
    async fn send(&self, kind: &str, obj: &Object) -> bool {
        let object = if self.req.wants_table {
            table::object_table(&self.req.resource, std::slice::from_ref(obj), None)
        } else {
            Value::Object(obj.clone())
        };
        self.send_value(&json!({"type": kind, "object": object}))
            .await
    }

    /// Sends one event line for a cached change, reusing its encoding.
    async fn send_cached(&self, kind: &str, event: &CachedEvent) -> bool {
        if self.req.wants_table {
            return self.send(kind, &event.object).await;
        }
        let object = event.encoded();
        let mut line = Vec::with_capacity(object.len() + 32);
        line.extend_from_slice(br#"{"type":""#);
        line.extend_from_slice(kind.as_bytes());
        line.extend_from_slice(br#"","object":"#);
        line.extend_from_slice(object);
        line.extend_from_slice(b"}\n");
        self.tx.send(Bytes::from(line)).await.is_ok()
    }

    async fn send_value(&self, event: &Value) -> bool {
        let mut line = serde_json::to_vec(event).unwrap_or_default();
        line.push(b'\n');
        self.tx.send(Bytes::from(line)).await.is_ok()
    }

    async fn send_error(&self, e: ApiError) {
        let _ = self
            .send_value(&json!({"type": "ERROR", "object": e.to_status()}))
            .await;
    }

    async fn bookmark(&self, revision: Revision) -> bool {
        let res = &self.req.resource;
        self.send_value(&json!({"type": "BOOKMARK", "object": {
            "kind": res.kind, "apiVersion": res.api_version(),
            "metadata": {"resourceVersion": revision.to_string()},
        }}))
        .await
    }

    /// Sends the event of one change as the client's selectors see it.
    async fn change(&self, event: &CachedEvent, filter: &Filter) -> bool {
        let was = event.prev.as_deref().is_some_and(|p| filter.matches(p));
        match event.kind {
            EventKind::Put => {
                let is = filter.matches(&event.object);
                match (was, is) {
                    (false, true) => self.send_cached("ADDED", event).await,
                    (true, true) => self.send_cached("MODIFIED", event).await,
                    (true, false) => self.send_cached("DELETED", event).await,
                    (false, false) => true,
                }
            }
            EventKind::Delete if was => self.send_cached("DELETED", event).await,
            EventKind::Delete => true,
        }
    }

    async fn run(
        self,
        state: State,
        initial: Vec<Object>,
        after: Revision,
        source: Result<Source, ApiError>,
        filter: Filter,
    ) {
        for obj in &initial {
            if !self.send("ADDED", obj).await {
                return;
            }
        }
        let mut source = match source {
            Ok(s) => s,
            Err(e) => return self.send_error(e).await,
        };
        let mut last = after;
        if let Source::Cache(sub) = &mut source {
            for event in std::mem::take(&mut sub.replay) {
                if event.revision > last {
                    last = event.revision;
                    if !self.change(&event, &filter).await {
                        return;
                    }
                }
            }
        }
        let mut bookmarks = tokio::time::interval(BOOKMARK_EVERY);
        bookmarks.tick().await;
        loop {
            let next: Option<Vec<Arc<CachedEvent>>> = tokio::select! {
                _ = bookmarks.tick(), if self.req.query.allow_watch_bookmarks => {
                    let revision = state.cache.revision().max(last);
                    if !self.bookmark(revision).await {
                        return;
                    }
                    continue;
                }
                () = self.tx.closed() => return,
                next = next_events(&mut source) => next,
            };
            let Some(events) = next else {
                // The cache dropped this watch (it fell behind) or the store watch
                // ended: the client resumes from the last revision it saw.
                if let Source::Store(_) = source {
                    self.send_error(ApiError::gone(format!("too old resource version: {after}")))
                        .await;
                }
                return;
            };
            for event in events {
                if event.revision <= last {
                    continue;
                }
                last = event.revision;
                if !self.change(&event, &filter).await {
                    return;
                }
            }
        }
    }
}

async fn next_events(source: &mut Source) -> Option<Vec<Arc<CachedEvent>>> {
    match source {
        Source::Cache(sub) => sub.rx.recv().await.map(|e| vec![e]),
        Source::Store(stream) => match stream.next().await? {
            Ok(events) => Some(
                events
                    .iter()
                    .filter_map(watch_cache::convert)
                    .map(Arc::new)
                    .collect(),
            ),
            Err(_) => None,
        },
    }
}
