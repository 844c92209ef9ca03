//! Work queues with client-go's semantics, for controllers and the scheduler:
//!
//! - a key waiting in the queue is there once, however often it is added;
//! - a key is never handed to two workers at once: added while it is being processed,
//!   it waits until [`WorkQueue::done`], then goes back in;
//! - [`WorkQueue::add_after`] adds once a delay has passed (the earliest of several
//!   delays wins);
//! - [`WorkQueue::add_rate_limited`] retries a key after a delay that grows with its
//!   failures (5 ms doubling to 1,000 s), and never faster than an overall token
//!   bucket (10 per second, bursts of 100) allows; [`WorkQueue::forget`] resets it.
//!
//! Every delay is a `tokio::time` sleep, so tests can pause and advance time.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::sync::Notify;
use tokio::time::Instant;

/// The rate limiter's settings (client-go's `DefaultControllerRateLimiter`).
#[derive(Clone, Copy, Debug)]
pub struct RateLimits {
    /// The first retry's delay; each further failure doubles it.
    pub base_delay: Duration,
    /// The longest per-key delay.
    pub max_delay: Duration,
    /// Retries per second over all keys, and the burst allowed above it.
    pub qps: f64,
    pub burst: u32,
}

impl Default for RateLimits {
    fn default() -> Self {
        Self {
            base_delay: Duration::from_millis(5),
            max_delay: Duration::from_secs(1_000),
            qps: 10.0,
            burst: 100,
        }
    }
}

/// The queues' metrics, shared by every queue of a process and labelled by queue
/// name (client-go's `workqueue_*`).
#[derive(Clone, Debug)]
pub struct QueueMetrics {
    depth: Family<QueueName, Gauge>,
    adds: Family<QueueName, Counter>,
    retries: Family<QueueName, Counter>,
    queue_duration: Family<QueueName, Histogram>,
    work_duration: Family<QueueName, Histogram>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueName {
    name: String,
}

fn seconds_histogram() -> Histogram {
    // 1 µs to ~16 min, ×10 per bucket, as client-go's.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        1e-6, 10.0, 10,
    ))
}

impl Default for QueueMetrics {
    fn default() -> Self {
        Self {
            depth: Family::default(),
            adds: Family::default(),
            retries: Family::default(),
            queue_duration: Family::new_with_constructor(seconds_histogram),
            work_duration: Family::new_with_constructor(seconds_histogram),
        }
    }
}

impl QueueMetrics {
    /// Adds the metrics to `registry` (as `workqueue_depth`, `workqueue_adds_total`,
    /// `workqueue_retries_total`, `workqueue_queue_duration_seconds`,
    /// `workqueue_work_duration_seconds`).
    pub fn register(&self, registry: &mut Registry) {
        let sub = registry.sub_registry_with_prefix("workqueue");
        sub.register("depth", "Keys waiting in the queue", self.depth.clone());
        sub.register("adds", "Keys added", self.adds.clone());
        sub.register(
            "retries",
            "Keys added again after a failure",
            self.retries.clone(),
        );
        sub.register(
            "queue_duration_seconds",
            "How long a key waits before a worker takes it",
            self.queue_duration.clone(),
        );
        sub.register(
            "work_duration_seconds",
            "How long a worker holds a key",
            self.work_duration.clone(),
        );
    }

    /// The depth gauge of queue `name`, for tests and benchmarks.
    pub fn depth(&self, name: &str) -> i64 {
        self.depth
            .get_or_create(&QueueName { name: name.into() })
            .get()
    }

    /// How many retries queue `name` has taken.
    pub fn retries(&self, name: &str) -> u64 {
        self.retries
            .get_or_create(&QueueName { name: name.into() })
            .get()
    }
}

/// A de-duplicating, rate-limited work queue of keys. Clones share the queue.
#[derive(Debug)]
pub struct WorkQueue<T> {
    inner: Arc<Inner<T>>,
}

impl<T> Clone for WorkQueue<T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

#[derive(Debug)]
struct Inner<T> {
    name: QueueName,
    state: Mutex<State<T>>,
    /// Woken when a key is queued or the queue shuts down.
    ready: Notify,
    limits: RateLimits,
    metrics: QueueMetrics,
}

#[derive(Debug)]
struct State<T> {
    queue: VecDeque<T>,
    /// Keys that need processing: queued, or added again while processing.
    dirty: HashSet<T>,
    processing: HashMap<T, Instant>,
    /// When each dirty key was added (for the queue-duration metric).
    added: HashMap<T, Instant>,
    /// Keys waiting for a delay, and when they are due.
    waiting: HashMap<T, Instant>,
    failures: HashMap<T, u32>,
    bucket: Bucket,
    shutting_down: bool,
}

/// A token bucket: how long the next retry must wait so that retries stay within
/// `qps` with bursts of `burst`.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn reserve(&mut self, limits: &RateLimits, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        self.tokens = (self.tokens + elapsed * limits.qps).min(f64::from(limits.burst));
        self.tokens -= 1.0;
        if self.tokens >= 0.0 || limits.qps <= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / limits.qps)
        }
    }
}

impl<T> WorkQueue<T>
where
    T: Clone + Eq + Hash + Debug + Send + Sync + 'static,
{
    /// A queue named `name` (its metrics' label) with client-go's default limits.
    pub fn new(name: &str, metrics: &QueueMetrics) -> Self {
        Self::with_limits(name, metrics, RateLimits::default())
    }

    pub fn with_limits(name: &str, metrics: &QueueMetrics, limits: RateLimits) -> Self {
        Self {
            inner: Arc::new(Inner {
                name: QueueName { name: name.into() },
                state: Mutex::new(State {
                    queue: VecDeque::new(),
                    dirty: HashSet::new(),
                    processing: HashMap::new(),
                    added: HashMap::new(),
                    waiting: HashMap::new(),
                    failures: HashMap::new(),
                    bucket: Bucket {
                        tokens: f64::from(limits.burst),
                        at: Instant::now(),
                    },
                    shutting_down: false,
                }),
                ready: Notify::new(),
                limits,
                metrics: metrics.clone(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `key` unless it is already waiting; a key being processed goes back in
    /// once its worker is done.
    pub fn add(&self, key: T) {
        let mut state = self.lock();
        if state.shutting_down || state.dirty.contains(&key) {
            return;
        }
        self.inner
            .metrics
            .adds
            .get_or_create(&self.inner.name)
            .inc();
        state.dirty.insert(key.clone());
        state.added.insert(key.clone(), Instant::now());
        if state.processing.contains_key(&key) {
            return;
        }
        state.queue.push_back(key);
        self.set_depth(&state);
        drop(state);
        self.inner.ready.notify_one();
    }

    fn set_depth(&self, state: &State<T>) {
        self.inner
            .metrics
            .depth
            .get_or_create(&self.inner.name)
            .set(i64::try_from(state.queue.len()).unwrap_or(i64::MAX));
    }

    /// Queues `key` once `delay` has passed. A key already waiting for an earlier
    /// time keeps that time.
    pub fn add_after(&self, key: T, delay: Duration) {
        if delay.is_zero() {
            self.add(key);
            return;
        }
        let due = Instant::now() + delay;
        {
            let mut state = self.lock();
            if state.shutting_down {
                return;
            }
            match state.waiting.get(&key) {
                Some(at) if *at <= due => return,
                _ => {
                    state.waiting.insert(key.clone(), due);
                }
            }
        }
        let queue = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(due).await;
            let mine = {
                let mut state = queue.lock();
                // A later call may have moved the key to an earlier time (its own
                // timer adds it) or it may have been added already.
                let mine = state.waiting.get(&key) == Some(&due);
                if mine {
                    state.waiting.remove(&key);
                }
                mine
            };
            if mine {
                queue.add(key);
            }
        });
    }

    /// Queues `key` after its failure's backoff: the longer of its own exponential
    /// delay and the overall bucket's.
    pub fn add_rate_limited(&self, key: T) {
        let delay = {
            let mut state = self.lock();
            let limits = self.inner.limits;
            let failures = state.failures.entry(key.clone()).or_insert(0);
            let exponent = i32::try_from(*failures).unwrap_or(i32::MAX);
            *failures = failures.saturating_add(1);
            let own = limits.base_delay.as_secs_f64() * 2f64.powi(exponent);
            let own = if own.is_finite() && own < limits.max_delay.as_secs_f64() {
                Duration::from_secs_f64(own)
            } else {
                limits.max_delay
            };
            let bucket = state.bucket.reserve(&limits, Instant::now());
            own.max(bucket)
        };
        self.inner
            .metrics
            .retries
            .get_or_create(&self.inner.name)
            .inc();
        self.add_after(key, delay);
    }

    /// Forgets `key`'s failures: its next retry starts from the base delay.
    pub fn forget(&self, key: &T) {
        self.lock().failures.remove(key);
    }

    /// How many times `key` has been retried since it was last forgotten.
    pub fn num_requeues(&self, key: &T) -> u32 {
        self.lock().failures.get(key).copied().unwrap_or(0)
    }

    /// Keys waiting to be taken.
    pub fn len(&self) -> usize {
        self.lock().queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The next key, marked as being processed until [`WorkQueue::done`]; `None` once
    /// the queue is shut down and drained.
    pub async fn get(&self) -> Option<T> {
        loop {
            let ready = self.inner.ready.notified();
            tokio::pin!(ready);
            // Registered before looking, so a key added in between still wakes us.
            ready.as_mut().enable();
            {
                let mut state = self.lock();
                if let Some(key) = state.queue.pop_front() {
                    let now = Instant::now();
                    state.dirty.remove(&key);
                    if let Some(at) = state.added.remove(&key) {
                        self.inner
                            .metrics
                            .queue_duration
                            .get_or_create(&self.inner.name)
                            .observe(now.saturating_duration_since(at).as_secs_f64());
                    }
                    state.processing.insert(key.clone(), now);
                    self.set_depth(&state);
                    let more = !state.queue.is_empty();
                    drop(state);
                    if more {
                        // Another worker may be waiting for what remains.
                        self.inner.ready.notify_one();
                    }
                    return Some(key);
                }
                if state.shutting_down {
                    return None;
                }
            }
            ready.await;
        }
    }

    /// Marks `key` as processed; if it was added meanwhile, it is queued again.
    pub fn done(&self, key: &T) {
        let mut state = self.lock();
        if let Some(at) = state.processing.remove(key) {
            self.inner
                .metrics
                .work_duration
                .get_or_create(&self.inner.name)
                .observe(Instant::now().saturating_duration_since(at).as_secs_f64());
        }
        if state.dirty.contains(key) && !state.shutting_down {
            state.queue.push_back(key.clone());
            self.set_depth(&state);
            drop(state);
            self.inner.ready.notify_one();
        }
    }

    /// Stops taking keys: [`WorkQueue::get`] hands out what is queued, then `None`.
    pub fn shut_down(&self) {
        self.lock().shutting_down = true;
        self.inner.ready.notify_waiters();
    }

    pub fn is_shutting_down(&self) -> bool {
        self.lock().shutting_down
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> WorkQueue<String> {
        WorkQueue::new("test", &QueueMetrics::default())
    }

    #[tokio::test]
    async fn a_key_waits_once_however_often_it_is_added() {
        let q = queue();
        for key in ["a", "b", "a", "a", "c", "b"] {
            q.add(key.to_owned());
        }
        assert_eq!(q.len(), 3);
        let mut got = Vec::new();
        for _ in 0..3 {
            let key = q.get().await.unwrap();
            q.done(&key);
            got.push(key);
        }
        assert_eq!(got, ["a", "b", "c"]);
        assert!(q.is_empty());
        assert_eq!(q.inner.metrics.depth("test"), 0);
    }

    #[tokio::test]
    async fn a_key_is_never_processed_by_two_workers() {
        let q = queue();
        q.add("a".to_owned());
        let first = q.get().await.unwrap();
        // Added again while a worker holds it: not handed out until done.
        q.add("a".to_owned());
        assert!(q.is_empty());
        let second = tokio::time::timeout(Duration::from_millis(20), q.get()).await;
        assert!(
            second.is_err(),
            "a second worker got the key being processed"
        );
        q.done(&first);
        assert_eq!(q.len(), 1);
        assert_eq!(q.get().await.as_deref(), Some("a"));
    }

    #[tokio::test]
    async fn waiting_workers_wake_for_new_keys_and_for_shut_down() {
        let q = queue();
        let worker = {
            let q = q.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while let Some(key) = q.get().await {
                    q.done(&key);
                    seen.push(key);
                }
                seen
            })
        };
        tokio::task::yield_now().await;
        q.add("x".to_owned());
        q.add("y".to_owned());
        while !q.is_empty() {
            tokio::task::yield_now().await;
        }
        q.shut_down();
        q.add("after".to_owned());
        assert_eq!(worker.await.unwrap(), ["x", "y"]);
    }

    #[tokio::test(start_paused = true)]
    async fn delayed_adds_wait_and_the_earliest_delay_wins() {
        let q = queue();
        q.add_after("k".to_owned(), Duration::from_secs(10));
        q.add_after("k".to_owned(), Duration::from_secs(2));
        q.add_after("k".to_owned(), Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(1_999)).await;
        assert!(q.is_empty());
        let start = Instant::now();
        assert_eq!(q.get().await.as_deref(), Some("k"));
        assert!(start.elapsed() <= Duration::from_millis(2));
        q.done(&"k".to_owned());
        // The later timers find the key no longer theirs.
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert!(q.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_exponentially_until_forgotten() {
        let q = queue();
        let key = "k".to_owned();
        let mut delays = Vec::new();
        for _ in 0..4 {
            let start = Instant::now();
            q.add_rate_limited(key.clone());
            let got = q.get().await.unwrap();
            delays.push(start.elapsed());
            q.done(&got);
        }
        assert_eq!(
            delays,
            [5, 10, 20, 40].map(Duration::from_millis),
            "per-key backoff doubles from 5 ms"
        );
        assert_eq!(q.num_requeues(&key), 4);
        assert_eq!(q.inner.metrics.retries("test"), 4);
        q.forget(&key);
        assert_eq!(q.num_requeues(&key), 0);
        let start = Instant::now();
        q.add_rate_limited(key.clone());
        q.get().await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_millis(5));
    }

    #[tokio::test(start_paused = true)]
    async fn per_key_backoff_stops_at_the_maximum() {
        let q = queue();
        let key = "k".to_owned();
        for _ in 0..40 {
            q.add_rate_limited(key.clone());
            q.lock().waiting.clear();
        }
        let start = Instant::now();
        q.add_rate_limited(key.clone());
        q.get().await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_secs(1_000));
    }

    #[tokio::test(start_paused = true)]
    async fn the_bucket_bounds_retries_over_all_keys() {
        let q = WorkQueue::with_limits(
            "bucket",
            &QueueMetrics::default(),
            RateLimits {
                base_delay: Duration::from_millis(1),
                max_delay: Duration::from_secs(1),
                qps: 10.0,
                burst: 3,
            },
        );
        let start = Instant::now();
        for i in 0..5 {
            q.add_rate_limited(format!("k{i}"));
        }
        // The burst goes after its keys' own 1 ms; the fourth and fifth wait for
        // tokens at 10 per second.
        let mut at = Vec::new();
        for _ in 0..5 {
            let key = q.get().await.unwrap();
            at.push(start.elapsed().as_millis());
            q.done(&key);
        }
        assert_eq!(at, [1, 1, 1, 100, 200]);
    }
}
