//! Watch streams of the embedded backend.
//!
//! A watcher first replays the log from its start revision in chunks. Once it is
//! within one chunk of the head it subscribes to the live broadcast (learning exactly
//! which revision the broadcast starts after), reads the remaining gap from the log,
//! and from then on only filters live batches. The broadcast is bounded: a watcher
//! that falls `watch_buffer` commits behind is ended with [`Error::WatcherLagged`],
//! naming the revision to resume from, so it never holds back writers or others.

use std::sync::Arc;

use futures::stream;
use tokio::sync::broadcast;

use super::Shared;
use crate::{Error, Event, Result, Revision, WatchStream};

/// Revisions read from the log per step while catching up.
const CATCH_UP_CHUNK: u64 = 1024;

pub(super) fn watch(shared: Arc<Shared>, prefix: String, start: Revision) -> Result<WatchStream> {
    let next = if start == 0 {
        shared.hub.published() + 1
    } else {
        start
    };
    let compacted = shared.compacted.load(std::sync::atomic::Ordering::Acquire);
    if next < compacted {
        return Err(Error::Compacted {
            requested: next,
            compacted: Some(compacted),
        });
    }
    let watcher = Watcher {
        shared,
        prefix,
        next,
        live: None,
        done: false,
    };
    Ok(Box::pin(stream::unfold(watcher, |mut w| async move {
        let item = w.next_batch().await?;
        Some((item, w))
    })))
}

struct Watcher {
    shared: Arc<Shared>,
    prefix: String,
    /// The first revision not yet delivered (or skipped as not matching).
    next: Revision,
    live: Option<broadcast::Receiver<Arc<[Event]>>>,
    done: bool,
}

impl Watcher {
    async fn next_batch(&mut self) -> Option<Result<Vec<Event>>> {
        if self.done {
            return None;
        }
        let item = self.next_inner().await;
        if !matches!(item, Some(Ok(_))) {
            self.done = true;
        }
        item
    }

    async fn next_inner(&mut self) -> Option<Result<Vec<Event>>> {
        loop {
            let Some(live) = self.live.as_mut() else {
                match self.catch_up() {
                    Ok(Some(events)) => return Some(Ok(events)),
                    Ok(None) => continue,
                    Err(Error::Closed) => return None,
                    Err(e) => return Some(Err(e)),
                }
            };
            match live.recv().await {
                Ok(batch) => {
                    let Some(last) = batch.last() else { continue };
                    let events: Vec<Event> = batch
                        .iter()
                        .filter(|e| e.revision() >= self.next && e.kv.key.starts_with(&self.prefix))
                        .cloned()
                        .collect();
                    self.next = self.next.max(last.revision() + 1);
                    if !events.is_empty() {
                        return Some(Ok(events));
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    return Some(Err(Error::WatcherLagged {
                        resume_from: self.next,
                    }));
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }

    /// One catch-up step: a chunk of the log, or the switch to the live broadcast.
    /// `Ok(None)` means nothing matched in this step.
    fn catch_up(&mut self) -> Result<Option<Vec<Event>>> {
        let head = self.shared.hub.published();
        if head >= self.next && head - self.next >= CATCH_UP_CHUNK {
            let to = self.next + CATCH_UP_CHUNK - 1;
            let events = self.shared.read_log(&self.prefix, self.next, to)?;
            self.next = to + 1;
            return Ok(Some(events).filter(|e| !e.is_empty()));
        }
        let (live, head) = self.shared.hub.subscribe().ok_or(Error::Closed)?;
        self.live = Some(live);
        if head < self.next {
            return Ok(None);
        }
        let events = self.shared.read_log(&self.prefix, self.next, head)?;
        self.next = head + 1;
        Ok(Some(events).filter(|e| !e.is_empty()))
    }
}
