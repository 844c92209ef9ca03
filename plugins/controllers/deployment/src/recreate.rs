//! The `Recreate` strategy (Kubernetes' `recreate.go`): the old sets scaled to 0, and
//! the new one only once their pods are gone.

use trellis_plugin::controller::Action;

use crate::{Pass, Which};

impl Pass<'_> {
    pub(crate) fn recreate(mut self) -> Result<Action, String> {
        let mut scaled = false;
        for i in 0..self.old.len() {
            if self.old[i].replicas > 0 {
                scaled |= self.scale_set(Which::Old(i), 0)?;
            }
        }
        if scaled {
            return self.sync_status();
        }
        // The old pods must be gone before a new one starts.
        if self.old.iter().any(|s| s.status_replicas > 0) {
            return self.sync_status();
        }
        if self.new.is_none() {
            let revision = self.old.iter().map(|s| s.revision).max().unwrap_or(0) + 1;
            self.create_new(revision)?;
        }
        if self.new.is_some() {
            self.scale_set(Which::New, self.replicas())?;
        }
        if self.is_complete() {
            self.cleanup()?;
        }
        self.sync_status()
    }
}
