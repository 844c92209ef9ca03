//! The instance slots every plugin shares: the optimized engine's pooling allocator
//! has a fixed number of them ([`HostConfig::max_instances`](crate::HostConfig), and
//! four core instances, two memories, two tables and a stack per slot), and no plugin
//! may keep so many idle that another cannot make the instances its calls need.
//!
//! - Each plugin keeps at most its fair share of idle instances: the slots divided
//!   among the plugins alive, and never more than [`MAX_IDLE`].
//! - A call that cannot allocate an instance takes back an idle instance of another
//!   plugin, the one with the most, and tries again.
//! - With none idle, it waits for an instance to be dropped, within its own deadline.
//!   While calls wait, instances are dropped when their call ends instead of kept idle,
//!   so every call that ends frees a slot for a waiter.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;

/// Idle instances kept per plugin at most, however many slots there are; more
/// concurrent calls instantiate more (~10 µs each) and drop them afterwards.
pub(crate) const MAX_IDLE: usize = 32;

/// How long a waiting call sleeps before trying again without being woken: slots
/// freed where no [`Slot`] tells (a store dropped by a failed instantiation, wasmtime's
/// own decommit queue) are noticed within this.
pub(crate) const RECHECK: Duration = Duration::from_millis(10);

/// A loaded plugin, as the pool sees it: idle instances it keeps in slots of the
/// pool, one of which a call of another plugin may take back.
pub(crate) trait Idle: Send + Sync {
    /// How many idle instances hold slots of the pool.
    fn pooled_idle(&self) -> usize;

    /// Drops the oldest idle instance that holds a slot of the pool; `false` if there
    /// was none (another call may have taken it meanwhile).
    fn release_idle(&self) -> bool;
}

/// The slots of one host's pooling allocator, as the plugins use them.
#[derive(Debug)]
pub(crate) struct Pool {
    /// Component instances the pooling allocator holds at once.
    slots: usize,
    /// Plugins alive (loading, serving, or a replaced version finishing its calls):
    /// the slots are shared among them.
    members: AtomicUsize,
    /// Loaded plugins, whose idle instances a call that finds the pool full may take.
    loaded: Mutex<Vec<Weak<dyn Idle>>>,
    /// Calls waiting for a slot. While there are any, an instance is dropped when its
    /// call ends rather than kept idle.
    waiting: AtomicUsize,
    /// Wakes the waiting calls when an instance is dropped.
    freed: Notify,
}

impl Pool {
    pub(crate) fn new(slots: u32) -> Arc<Self> {
        Arc::new(Self {
            slots: usize::try_from(slots).unwrap_or(usize::MAX),
            members: AtomicUsize::new(0),
            loaded: Mutex::new(Vec::new()),
            waiting: AtomicUsize::new(0),
            freed: Notify::new(),
        })
    }

    /// Counts a plugin among those sharing the slots, for as long as the [`Member`]
    /// lives.
    pub(crate) fn join(self: &Arc<Self>) -> Member {
        self.members.fetch_add(1, Ordering::Relaxed);
        Member { pool: self.clone() }
    }

    /// Makes a loaded plugin's idle instances available to calls that find the pool
    /// full.
    pub(crate) fn register<P: Idle + 'static>(&self, plugin: &Arc<P>) {
        let plugin: Weak<P> = Arc::downgrade(plugin);
        let plugin: Weak<dyn Idle> = plugin;
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        loaded.retain(|p| p.strong_count() > 0);
        loaded.push(plugin);
    }

    /// How many idle instances one plugin may keep: its share of the slots, at least
    /// one, at most [`MAX_IDLE`].
    pub(crate) fn idle_share(&self) -> usize {
        fair_share(self.slots, self.members.load(Ordering::Relaxed))
    }

    /// Whether calls are waiting for a slot.
    pub(crate) fn contended(&self) -> bool {
        self.waiting.load(Ordering::SeqCst) > 0
    }

    /// Counts a call as waiting for a slot until the [`Waiting`] is dropped (when the
    /// call gets an instance, fails, or is cancelled at its deadline).
    pub(crate) fn wait(&self) -> Waiting<'_> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        Waiting { pool: self }
    }

    /// The notification a waiting call awaits; enable it before trying to allocate, so
    /// that an instance dropped meanwhile is not missed.
    pub(crate) fn freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
    }

    /// Drops one idle pooled instance, of the loaded plugin that keeps the most;
    /// `false` when no plugin keeps any.
    pub(crate) fn reclaim(&self) -> bool {
        let plugins: Vec<Arc<dyn Idle>> = {
            let loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
            loaded.iter().filter_map(Weak::upgrade).collect()
        };
        let mut keeping: Vec<(usize, &Arc<dyn Idle>)> = plugins
            .iter()
            .map(|p| (p.pooled_idle(), p))
            .filter(|(idle, _)| *idle > 0)
            .collect();
        keeping.sort_by_key(|(idle, _)| std::cmp::Reverse(*idle));
        // A call of that plugin may have taken its instance meanwhile: then the next.
        keeping.iter().any(|(_, plugin)| plugin.release_idle())
    }

    /// Tells waiting calls that a slot may be free.
    fn wake(&self) {
        if self.contended() {
            self.freed.notify_waiters();
        }
    }
}

/// `slots` shared by `members` plugins, as idle instances one of them may keep.
fn fair_share(slots: usize, members: usize) -> usize {
    (slots / members.max(1)).clamp(1, MAX_IDLE)
}

/// A plugin's place among those sharing the slots.
#[derive(Debug)]
pub(crate) struct Member {
    pool: Arc<Pool>,
}

impl Member {
    pub(crate) fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.pool.members.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Held by each instance, declared after its store: dropped after the store has given
/// its slots back, it wakes the calls waiting for one.
#[derive(Debug)]
pub(crate) struct Slot {
    pool: Arc<Pool>,
}

impl Slot {
    pub(crate) fn new(pool: &Arc<Pool>) -> Self {
        Self { pool: pool.clone() }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.pool.wake();
    }
}

/// One call waiting for a slot.
#[derive(Debug)]
pub(crate) struct Waiting<'a> {
    pool: &'a Pool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.pool.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_plugin_may_keep_its_share_of_the_slots_idle_up_to_32() {
        assert_eq!(fair_share(256, 1), 32);
        assert_eq!(fair_share(256, 8), 32);
        assert_eq!(fair_share(256, 16), 16);
        assert_eq!(fair_share(4, 3), 1);
        // More plugins than slots: one each, and calls take them back from each other.
        assert_eq!(fair_share(4, 10), 1);
        assert_eq!(fair_share(256, 0), 32);
    }

    #[test]
    fn members_count_while_they_live() {
        let pool = Pool::new(64);
        let a = pool.join();
        let b = pool.join();
        assert_eq!(pool.idle_share(), 32);
        let c = pool.join();
        assert_eq!(pool.idle_share(), 21);
        drop((a, b, c));
        assert_eq!(pool.members.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn waiting_calls_make_the_pool_contended_until_they_end() {
        let pool = Pool::new(4);
        assert!(!pool.contended());
        let first = pool.wait();
        let second = pool.wait();
        drop(first);
        assert!(pool.contended());
        drop(second);
        assert!(!pool.contended());
    }
}
