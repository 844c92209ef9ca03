//! Expectations: a key is not reconciled again until the caches show the writes its
//! last reconcile made.
//!
//! An informer's cache lags behind the API server. A ReplicaSet reconciled twice in
//! a row, the second time before the cache holds the pods the first created, would
//! create them again. Kubernetes' controllers each keep counts of the creations and
//! deletions they expect to see; here the host does it for every controller plugin:
//! each successful write is noted against the primary key it belongs to (the object
//! itself when it is of the primary resource, else its controlling owner), with the
//! resourceVersion the API server answered, and the key waits until the informer of
//! the written resource has seen that revision. A watch delivers a resource's changes
//! in revision order, so by then the cache reflects the write (or something later).
//! Expectations that are not met within a timeout (5 minutes, as Kubernetes') are
//! dropped, so a lost event delays a key but never stalls it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::DynamicObject;
use trellis_client::informer::Informer;

use crate::key::Key;

/// One write waited for.
pub(crate) struct Expected {
    pub informer: Arc<Informer<DynamicObject>>,
    /// The written object's cache key (`namespace/name` or `name`).
    pub object: String,
    /// The resourceVersion the write was answered with, when it said one.
    pub revision: Option<u64>,
    /// A delete.
    pub gone: bool,
}

impl Expected {
    fn met(&self) -> bool {
        if let Some(r) = self.revision {
            return self.informer.seen_revision() >= r;
        }
        // No revision (a delete answered with a Status): the object is gone, or
        // marked for deletion.
        match self.informer.get(&self.object) {
            Some(o) => !self.gone || o.metadata.deletion_timestamp.is_some(),
            None => self.gone,
        }
    }
}

struct Pending {
    since: Instant,
    waiting: Vec<Expected>,
}

/// The writes each key waits for.
pub(crate) struct Expectations {
    pending: Mutex<HashMap<Key, Pending>>,
    timeout: Duration,
}

impl std::fmt::Debug for Expectations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Expectations")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Expectations {
    pub fn new(timeout: Duration) -> Self {
        Self {
            pending: Mutex::new(HashMap::new()),
            timeout,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Pending>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes that `key` waits for `expected`.
    pub fn expect(&self, key: Key, expected: Expected) {
        if expected.met() {
            return;
        }
        let mut pending = self.lock();
        let entry = pending.entry(key).or_insert_with(|| Pending {
            since: Instant::now(),
            waiting: Vec::new(),
        });
        entry.since = Instant::now();
        entry.waiting.push(expected);
    }

    /// `Ok` when `key` may be reconciled; `Err(wait)` while writes are not yet in the
    /// caches, with how long until the expectations time out.
    pub fn check(&self, key: &Key) -> Result<(), Duration> {
        let mut pending = self.lock();
        let Some(entry) = pending.get_mut(key) else {
            return Ok(());
        };
        entry.waiting.retain(|e| !e.met());
        let waited = entry.since.elapsed();
        if entry.waiting.is_empty() || waited >= self.timeout {
            if !entry.waiting.is_empty() {
                tracing::warn!(%key, waiting = entry.waiting.len(), "expected writes not seen in the cache in time; reconciling anyway");
            }
            pending.remove(key);
            return Ok(());
        }
        Err(self.timeout - waited)
    }

    /// Forgets `key` (its object is gone).
    pub fn forget(&self, key: &Key) {
        self.lock().remove(key);
    }
}
