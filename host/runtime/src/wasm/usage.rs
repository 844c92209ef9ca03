//! What a WASM container uses, and its CPU limit, kept by the engine itself: a
//! component runs on threads of the runtime's own process, so no cgroup of its own
//! holds it.
//!
//! Every container runs on an OS thread made for it (a program's, or an HTTP
//! handler's server thread), with a single-threaded executor: its instances, their
//! fibres and the host calls they make are all polled there, never on another thread.
//! That thread's CPU clock (`CLOCK_THREAD_CPUTIME_ID`) is therefore the container's
//! CPU time, read on that thread at each epoch deadline of a running instance, and
//! around each request. (Blocking file I/O that WASI hands to the executor's blocking
//! pool runs elsewhere and is not counted; it is I/O, not computation.)
//!
//! The limit is CFS bandwidth control's: `cpu_quota` of CPU time in every
//! `cpu_period`. An instance over its budget yields at its next epoch deadline with a
//! sleep until the periods to come have paid back what it overran (the executor is
//! the container's own, so the sleep holds up that container alone). A deadline comes
//! every epoch tick of running guest code, so a period may overrun by up to a tick;
//! the overrun is owed to the next periods, so the long-run rate is the quota's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use rustix::time::{ClockId, clock_gettime};

use k8s_cri::v1::LinuxContainerResources;

use crate::record::ContainerRecord;

/// The kubelet's CFS period when a container names none.
const DEFAULT_PERIOD: Duration = Duration::from_millis(100);

/// CPU time a container may use: `quota` in every `period`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limit {
    pub quota: Duration,
    pub period: Duration,
}

impl Limit {
    /// The container's limit: `linux.resources.cpu_quota` (µs) per `cpu_period` (µs),
    /// none when the quota is not positive (the kubelet sends none without
    /// `limits.cpu`).
    pub(crate) fn of(record: &ContainerRecord) -> Option<Limit> {
        Self::from(record.config.linux.as_ref()?.resources.as_ref()?)
    }

    fn from(resources: &LinuxContainerResources) -> Option<Limit> {
        let quota = u64::try_from(resources.cpu_quota).ok().filter(|&q| q > 0)?;
        let period = u64::try_from(resources.cpu_period)
            .ok()
            .filter(|&p| p > 0)
            .map_or(DEFAULT_PERIOD, Duration::from_micros);
        Some(Limit {
            quota: Duration::from_micros(quota),
            period,
        })
    }
}

/// A container's usage over all of its instances: what `ContainerStats` reports.
#[derive(Debug)]
pub(crate) struct Usage {
    /// Bytes its instances' linear memories and tables hold together.
    pub memory: Arc<AtomicU64>,
    /// CPU time of its thread (ns), as last read.
    cpu_ns: AtomicU64,
    budget: Option<Mutex<Budget>>,
}

impl Usage {
    pub(crate) fn new(limit: Option<Limit>) -> Arc<Self> {
        Arc::new(Self {
            memory: Arc::new(AtomicU64::new(0)),
            cpu_ns: AtomicU64::new(0),
            budget: limit.map(|limit| Mutex::new(Budget::new(limit, Instant::now()))),
        })
    }

    /// Reads the CPU clock of the calling thread, which must be the container's own,
    /// and charges it to the limit: how long the container must wait, if it is over.
    pub(crate) fn account(&self) -> Option<Duration> {
        let cpu = thread_cpu_ns();
        self.cpu_ns.fetch_max(cpu, Ordering::Relaxed);
        let budget = self.budget.as_ref()?;
        budget
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .charge(cpu, Instant::now())
    }

    /// CPU time used (ns), as of the last reading.
    pub(crate) fn cpu_ns(&self) -> u64 {
        self.cpu_ns.load(Ordering::Relaxed)
    }

    pub(crate) fn memory_bytes(&self) -> u64 {
        self.memory.load(Ordering::Relaxed)
    }
}

/// The calling thread's CPU time (ns). A thread made for a container starts at 0.
fn thread_cpu_ns() -> u64 {
    let t = clock_gettime(ClockId::ThreadCPUTime);
    u64::try_from(t.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(t.tv_nsec).unwrap_or(0))
}

/// A limit's account: what is left of this period's quota.
#[derive(Debug)]
struct Budget {
    limit: Limit,
    /// The CPU clock (ns) at the last charge.
    seen: u64,
    /// Quota left in this period (ns); negative when overrun, owed to the next ones.
    left: i128,
    period_start: Instant,
}

impl Budget {
    fn new(limit: Limit, now: Instant) -> Self {
        Self {
            limit,
            seen: 0,
            left: limit.quota.as_nanos() as i128,
            period_start: now,
        }
    }

    /// Charges the CPU used up to `cpu` (ns of the thread's clock) at `now`; how long
    /// to wait until the quota is no longer overrun, if it is.
    fn charge(&mut self, cpu: u64, now: Instant) -> Option<Duration> {
        let quota = self.limit.quota.as_nanos() as i128;
        let period = self.limit.period;
        // A new period refills the quota (a debt carries over, an unused quota does
        // not), then the CPU used since the last charge is taken: work that straddled
        // the boundary is charged to the new period whole.
        let periods =
            now.saturating_duration_since(self.period_start).as_nanos() / period.as_nanos();
        if periods > 0 {
            self.left = (self.left + quota * periods as i128).min(quota);
            self.period_start += period * u32::try_from(periods).unwrap_or(u32::MAX);
        }
        self.left -= i128::from(cpu.saturating_sub(self.seen));
        self.seen = self.seen.max(cpu);
        if self.left > 0 {
            return None;
        }
        // The periods whose quotas pay the overrun back and leave some to run on.
        let owed = u32::try_from(-self.left / quota + 1).unwrap_or(u32::MAX);
        Some((self.period_start + period * owed).saturating_duration_since(now))
    }
}

/// The usage of the containers running, found by their memory counter (the one
/// their `Live` part carries).
#[derive(Debug, Default)]
pub(crate) struct Registry(Mutex<HashMap<usize, Weak<Usage>>>);

impl Registry {
    /// Registers `usage` for as long as it lives: a key cannot be reused while its
    /// usage (which holds the counter) lives.
    pub(crate) fn add(&self, usage: &Arc<Usage>) {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, u| u.strong_count() > 0);
        map.insert(key(&usage.memory), Arc::downgrade(usage));
    }

    /// The usage whose memory counter is `memory`, while its container runs.
    pub(crate) fn get(&self, memory: &Arc<AtomicU64>) -> Option<Arc<Usage>> {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&key(memory)).and_then(Weak::upgrade)
    }
}

fn key(memory: &Arc<AtomicU64>) -> usize {
    Arc::as_ptr(memory) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn limit(quota_ms: u64, period_ms: u64) -> Limit {
        Limit {
            quota: Duration::from_millis(quota_ms),
            period: Duration::from_millis(period_ms),
        }
    }

    #[test]
    fn the_limit_is_the_quota_per_period_of_the_cri() {
        let mut resources = LinuxContainerResources {
            cpu_quota: 20_000,
            cpu_period: 100_000,
            ..Default::default()
        };
        assert_eq!(Limit::from(&resources), Some(limit(20, 100)));
        resources.cpu_period = 0;
        assert_eq!(
            Limit::from(&resources),
            Some(limit(20, 100)),
            "the default period"
        );
        resources.cpu_quota = 0;
        assert_eq!(Limit::from(&resources), None, "no quota");
        resources.cpu_quota = -1;
        assert_eq!(Limit::from(&resources), None, "no quota");
    }

    #[test]
    fn an_overrun_waits_for_the_periods_that_pay_it_back() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut budget = Budget::new(limit(20, 100), start);
        // Within the quota: runs on.
        assert_eq!(budget.charge(10 * MS, at(10)), None);
        // 30 ms of 20: waits until the next period (at 100 ms).
        assert_eq!(
            budget.charge(30 * MS, at(30)),
            Some(Duration::from_millis(70))
        );
        // The next period refills 20 and pays back 10: 10 left.
        assert_eq!(budget.charge(30 * MS, at(100)), None);
        // 50 ms more (a long stretch between checks): 40 owed, two more periods.
        assert_eq!(
            budget.charge(80 * MS, at(150)),
            Some(Duration::from_millis(250))
        );
        assert_eq!(budget.charge(80 * MS, at(400)), None);
    }

    #[test]
    fn an_idle_container_does_not_save_up_its_quota() {
        let start = Instant::now();
        let mut budget = Budget::new(limit(20, 100), start);
        // Ten idle periods, then a burst: only one period's quota is there.
        assert_eq!(
            budget.charge(25 * MS, start + Duration::from_millis(1_005)),
            Some(Duration::from_millis(95))
        );
    }

    #[test]
    fn the_thread_clock_counts_this_threads_work_alone() {
        let usage = Usage::new(None);
        let start = Instant::now();
        // Whatever the machine's load: 30 ms of this thread's own CPU.
        while thread_cpu_ns() < 30 * MS {
            std::hint::black_box(0);
        }
        let wall = u64::try_from(start.elapsed().as_nanos()).unwrap();
        assert_eq!(usage.account(), None);
        let used = usage.cpu_ns();
        // The thread's time alone: never more than the wall time it ran (plus what it
        // used before), though other tests' threads run beside it.
        assert!(
            used >= 30 * MS && used < wall + 10 * MS,
            "{used} ns in {wall} ns"
        );
        // A fresh thread starts from zero, whatever this one used.
        let other = std::thread::spawn(thread_cpu_ns).join().unwrap();
        assert!(other < 10 * MS, "{other} ns");
    }
}
