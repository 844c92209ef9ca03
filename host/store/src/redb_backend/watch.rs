//! Watch streams of the embedded backend.
//!
//! A watcher first replays the log from its start revision in chunks. Once it is
//! within one chunk of the head it subscribes to the [hub](super::hub) (learning
//! exactly which revision its live batches start after), reads the remaining gap from
//! the log, and from then on only filters live batches. Its channel is bounded: a
//! watcher that falls `watch_buffer` batches behind is ended with
//! [`Error::WatcherLagged`], naming the revision to resume from, so it never holds
//! back writers or others.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::Stream;

use super::Shared;
use super::hub::Subscription;
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
    Ok(Box::pin(watcher))
}

struct Watcher {
    shared: Arc<Shared>,
    prefix: String,
    /// The first revision not yet delivered (or skipped as not matching).
    next: Revision,
    live: Option<Subscription>,
    done: bool,
}

impl Stream for Watcher {
    type Item = Result<Vec<Event>>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let item = ready!(this.poll_inner(cx));
        if !matches!(item, Some(Ok(_))) {
            this.done = true;
        }
        Poll::Ready(item)
    }
}

impl Watcher {
    fn poll_inner(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Vec<Event>>>> {
        loop {
            let Some(live) = self.live.as_mut() else {
                match self.catch_up() {
                    Ok(Some(events)) => return Poll::Ready(Some(Ok(events))),
                    Ok(None) => continue,
                    Err(Error::Closed) => return Poll::Ready(None),
                    Err(e) => return Poll::Ready(Some(Err(e))),
                }
            };
            match ready!(live.rx.poll_recv(cx)) {
                Some(batch) => {
                    let Some(last) = batch.last() else { continue };
                    let events: Vec<Event> = batch
                        .iter()
                        .filter(|e| e.revision() >= self.next && e.kv.key.starts_with(&self.prefix))
                        .cloned()
                        .collect();
                    self.next = self.next.max(last.revision() + 1);
                    if !events.is_empty() {
                        return Poll::Ready(Some(Ok(events)));
                    }
                }
                None if live.lagged.load(Ordering::Acquire) => {
                    return Poll::Ready(Some(Err(Error::WatcherLagged {
                        resume_from: self.next,
                    })));
                }
                // The store closed.
                None => return Poll::Ready(None),
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
        let live = self
            .shared
            .hub
            .subscribe(&self.prefix)
            .ok_or(Error::Closed)?;
        let head = live.after;
        self.live = Some(live);
        if head < self.next {
            return Ok(None);
        }
        let events = self.shared.read_log(&self.prefix, self.next, head)?;
        self.next = head + 1;
        Ok(Some(events).filter(|e| !e.is_empty()))
    }
}
