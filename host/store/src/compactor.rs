//! Keeps a time window of history on any [`Store`], as kube-apiserver does for etcd.
//!
//! Every `interval` the compactor samples the current revision; it then compacts to the
//! newest sample that is at least `window` old. History therefore always covers at
//! least the last `window` (and at most `window + interval`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, warn};

use crate::{Error, Revision, Store};

/// Settings of a [`Compactor`].
#[derive(Clone, Debug)]
pub struct CompactorConfig {
    /// How much history to keep. Watchers and lists may resume within it.
    pub window: Duration,
    /// How often to sample the revision and compact.
    pub interval: Duration,
}

impl Default for CompactorConfig {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(300),
            interval: Duration::from_secs(30),
        }
    }
}

/// The background compaction loop.
#[derive(Debug)]
pub struct Compactor {
    samples: VecDeque<(Instant, Revision)>,
    compacted: Revision,
    config: CompactorConfig,
}

impl Compactor {
    pub fn new(config: CompactorConfig) -> Self {
        Self {
            samples: VecDeque::new(),
            compacted: 0,
            config,
        }
    }

    /// Runs until `shutdown` completes.
    pub async fn run(mut self, store: Arc<dyn Store>, shutdown: impl Future<Output = ()>) {
        let mut ticker = tokio::time::interval(self.config.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    self.tick(store.as_ref()).await;
                }
                () = &mut shutdown => return,
            }
        }
    }

    /// One sample-and-compact step; returns the revision compacted to, if any.
    pub async fn tick(&mut self, store: &dyn Store) -> Option<Revision> {
        let now = Instant::now();
        match store.current_revision().await {
            Ok(rev) => self.samples.push_back((now, rev)),
            Err(e) => warn!(error = %e, "compactor failed to read the current revision"),
        }
        let mut target = None;
        while let Some(&(at, rev)) = self.samples.front() {
            if now.duration_since(at) < self.config.window {
                break;
            }
            target = Some(rev);
            self.samples.pop_front();
        }
        let target = target.filter(|t| *t > self.compacted)?;
        match store.compact(target).await {
            Ok(()) => {
                debug!(revision = target, "compacted history");
                self.compacted = target;
                Some(target)
            }
            // Another control-plane process compacted further already.
            Err(Error::Compacted { .. }) => {
                self.compacted = target;
                None
            }
            Err(e) => {
                warn!(error = %e, revision = target, "compaction failed");
                None
            }
        }
    }
}
