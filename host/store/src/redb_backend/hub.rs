//! Fan-out of committed batches to live watchers.
//!
//! Each live watcher has its own bounded channel. After every commit the committer
//! offers the batch to the watchers whose prefix matches one of its events (watchers
//! are grouped by prefix, so the match is checked once per distinct prefix). A full
//! channel means the watcher fell `watch_buffer` batches behind: it is dropped from the
//! hub and flagged, and ends with [`crate::Error::WatcherLagged`] once it has drained
//! what it already holds. Nobody waits for a slow watcher.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use super::lock;
use crate::{Event, Revision};

pub(super) type Batch = Arc<[Event]>;

#[derive(Debug)]
pub(super) struct Hub {
    /// Live watchers by prefix; `None` once the store is closed. Held while publishing,
    /// so a subscriber learns exactly which revisions it will receive live.
    watchers: Mutex<Option<BTreeMap<String, Vec<Subscriber>>>>,
    /// The last revision offered to live watchers; every acknowledged write is at or
    /// below it.
    published: AtomicU64,
    /// Batches a watcher may hold before it counts as fallen behind.
    buffer: usize,
}

#[derive(Debug)]
struct Subscriber {
    tx: mpsc::Sender<Batch>,
    lagged: Arc<AtomicBool>,
}

/// A live watcher's end of the hub.
#[derive(Debug)]
pub(super) struct Subscription {
    pub rx: mpsc::Receiver<Batch>,
    /// Set when the hub dropped this watcher for falling behind.
    pub lagged: Arc<AtomicBool>,
    /// The watcher receives every matching batch after this revision.
    pub after: Revision,
}

impl Hub {
    pub fn new(published: Revision, buffer: usize) -> Self {
        Self {
            watchers: Mutex::new(Some(BTreeMap::new())),
            published: AtomicU64::new(published),
            buffer: buffer.max(1),
        }
    }

    pub fn published(&self) -> Revision {
        self.published.load(Ordering::Acquire)
    }

    pub fn publish(&self, events: Batch, revision: Revision) {
        let mut watchers = lock(&self.watchers);
        if let Some(watchers) = watchers.as_mut() {
            watchers.retain(|prefix, subscribers| {
                if events.iter().any(|e| e.kv.key.starts_with(prefix.as_str())) {
                    subscribers.retain(|s| match s.tx.try_send(events.clone()) {
                        Ok(()) => true,
                        Err(mpsc::error::TrySendError::Full(_)) => {
                            s.lagged.store(true, Ordering::Release);
                            false
                        }
                        Err(mpsc::error::TrySendError::Closed(_)) => false,
                    });
                } else {
                    subscribers.retain(|s| !s.tx.is_closed());
                }
                !subscribers.is_empty()
            });
        }
        self.published.store(revision, Ordering::Release);
    }

    /// Subscribes to every batch after the current published revision; `None` once the
    /// store is closed.
    pub fn subscribe(&self, prefix: &str) -> Option<Subscription> {
        let mut watchers = lock(&self.watchers);
        let watchers = watchers.as_mut()?;
        let (tx, rx) = mpsc::channel(self.buffer);
        let lagged = Arc::new(AtomicBool::new(false));
        watchers
            .entry(prefix.to_owned())
            .or_default()
            .push(Subscriber {
                tx,
                lagged: lagged.clone(),
            });
        Some(Subscription {
            rx,
            lagged,
            after: self.published(),
        })
    }

    /// Ends every live watch (their streams end) and refuses new subscribers.
    pub fn close(&self) {
        lock(&self.watchers).take();
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::{EventKind, KeyValue};

    fn batch(keys: &[&str], revision: Revision) -> Batch {
        keys.iter()
            .map(|k| Event {
                kind: EventKind::Put,
                kv: KeyValue {
                    key: (*k).to_owned(),
                    value: Bytes::new(),
                    create_revision: revision,
                    mod_revision: revision,
                    version: 1,
                },
                prev: None,
            })
            .collect()
    }

    #[test]
    fn offers_batches_only_to_matching_prefixes() {
        let hub = Hub::new(1, 4);
        let mut pods = hub.subscribe("/pods/").unwrap();
        let mut nodes = hub.subscribe("/nodes/").unwrap();
        assert_eq!(pods.after, 1);
        hub.publish(batch(&["/pods/a"], 2), 2);
        hub.publish(batch(&["/nodes/n"], 3), 3);
        assert_eq!(pods.rx.try_recv().unwrap()[0].kv.key, "/pods/a");
        assert!(pods.rx.try_recv().is_err());
        assert_eq!(nodes.rx.try_recv().unwrap()[0].kv.key, "/nodes/n");
        assert_eq!(hub.published(), 3);
        assert_eq!(hub.subscribe("/x/").unwrap().after, 3);
    }

    #[test]
    fn drops_and_flags_a_watcher_that_fell_behind() {
        let hub = Hub::new(1, 2);
        let mut slow = hub.subscribe("/").unwrap();
        let mut fast = hub.subscribe("/").unwrap();
        for rev in 2..=4 {
            hub.publish(batch(&["/k"], rev), rev);
            fast.rx.try_recv().unwrap();
        }
        assert!(slow.lagged.load(Ordering::Acquire));
        assert!(!fast.lagged.load(Ordering::Acquire));
        // What it already held is still there, then its channel ends.
        assert!(slow.rx.try_recv().is_ok() && slow.rx.try_recv().is_ok());
        assert!(matches!(
            slow.rx.try_recv(),
            Err(mpsc::error::TryRecvError::Disconnected)
        ));
        hub.close();
        assert!(hub.subscribe("/").is_none());
        assert!(matches!(
            fast.rx.try_recv(),
            Err(mpsc::error::TryRecvError::Disconnected)
        ));
    }
}
