//! The `RollingUpdate` strategy (Kubernetes' `rolling.go`): the new set scaled up
//! within `maxSurge`, the old ones down within `maxUnavailable`.

use trellis_plugin::controller::Action;

use crate::util::fenceposts;
use crate::{Pass, Which};

impl Pass<'_> {
    pub(crate) fn rolling(mut self) -> Result<Action, String> {
        // Up: the new set within the surge.
        let Some(new) = self.new.as_ref() else {
            return self.sync_status();
        };
        let (new_replicas, current) = (new.replicas, new.replicas);
        let scaled_up = if new_replicas > self.replicas() {
            self.scale_set(Which::New, self.replicas())?
        } else {
            let target = self.new_set_replicas(current)?;
            self.scale_set(Which::New, target)?
        };
        if scaled_up && self.new.as_ref().is_some_and(|n| n.replicas > current) {
            return self.sync_status();
        }
        // Down: the old sets within the unavailability allowed.
        if self.scale_down_old()? {
            return self.sync_status();
        }
        if self.is_complete() {
            self.cleanup()?;
        }
        self.sync_status()
    }

    /// Scales old sets down as far as `maxUnavailable` allows: their unhealthy pods
    /// first, then available ones, oldest sets first.
    fn scale_down_old(&mut self) -> Result<bool, String> {
        let old_total: i64 = self.old.iter().map(|s| s.replicas).sum();
        if old_total == 0 {
            return Ok(false);
        }
        let all_total: i64 = self.all().map(|s| s.replicas).sum();
        let (_, max_unavailable) = fenceposts(&self.d)?;
        let min_available = self.replicas() - max_unavailable;
        let new_unavailable = self
            .new
            .as_ref()
            .map_or(0, |n| (n.replicas - n.available).max(0));
        let mut budget = all_total - min_available - new_unavailable;
        if budget <= 0 {
            return Ok(false);
        }
        let mut order: Vec<usize> = (0..self.old.len()).collect();
        order.sort_by(|a, b| self.old[*a].created.cmp(&self.old[*b].created));
        let mut scaled = false;
        // Unhealthy pods cost no availability.
        for &i in &order {
            if budget <= 0 {
                break;
            }
            let set = &self.old[i];
            // A status older than the last scale-down may count more available
            // pods than the set now asks for: nothing unhealthy to remove then.
            if set.replicas == 0 || set.available >= set.replicas {
                continue;
            }
            let down = (set.replicas - set.available).min(budget);
            let to = set.replicas - down;
            budget -= down;
            scaled |= self.scale_set(Which::Old(i), to)?;
        }
        // Then available pods, as long as enough stay available.
        let available: i64 = self.all().map(|s| s.available).sum();
        let mut allowed = available - min_available;
        for &i in &order {
            if allowed <= 0 {
                break;
            }
            let set = &self.old[i];
            if set.replicas == 0 {
                continue;
            }
            let down = set.replicas.min(allowed);
            allowed -= down;
            scaled |= self.scale_set(Which::Old(i), set.replicas - down)?;
        }
        Ok(scaled)
    }
}
