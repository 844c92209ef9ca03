//! The node's pressure signals and thresholds, as the kubelet's eviction manager reads
//! them (`--eviction-hard`, `--eviction-soft`): `MemoryPressure` when
//! `memory.available` is under its threshold, `DiskPressure` when the node's
//! filesystem (the agent's root) or the runtime's image filesystem is short of space
//! or inodes (`nodefs.available`, `nodefs.inodesFree`, `imagefs.available`),
//! `PIDPressure` when `pid.available` is. The kubelet's hard defaults:
//! `memory.available<100Mi`, `nodefs.available<10%`, `nodefs.inodesFree<5%`, no PID
//! or image filesystem threshold (the image filesystem is often the node's, whose
//! own threshold then holds). Soft thresholds have no defaults.
//!
//! [`crate::eviction`] acts on them: it evicts pods while a threshold is met (a soft
//! one after its grace period) and keeps the conditions for the pressure transition
//! period. The node lifecycle controller taints a node under pressure (NoSchedule),
//! so the scheduler sends it no new pods.
//!
//! `memory.available` is the kernel's `MemAvailable`, where the kubelet reads the root
//! cgroup's working set; both say what can be had without swapping.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// An eviction signal: a resource of the node that can run short.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Signal {
    MemoryAvailable,
    NodefsAvailable,
    NodefsInodesFree,
    ImagefsAvailable,
    PidAvailable,
}

/// The node condition a signal's thresholds drive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Condition {
    MemoryPressure,
    DiskPressure,
    PIDPressure,
}

impl Condition {
    pub fn name(self) -> &'static str {
        match self {
            Condition::MemoryPressure => "MemoryPressure",
            Condition::DiskPressure => "DiskPressure",
            Condition::PIDPressure => "PIDPressure",
        }
    }
}

impl Signal {
    pub const ALL: [Signal; 5] = [
        Signal::MemoryAvailable,
        Signal::NodefsAvailable,
        Signal::NodefsInodesFree,
        Signal::ImagefsAvailable,
        Signal::PidAvailable,
    ];

    /// Its name in flags and messages.
    pub fn name(self) -> &'static str {
        match self {
            Signal::MemoryAvailable => "memory.available",
            Signal::NodefsAvailable => "nodefs.available",
            Signal::NodefsInodesFree => "nodefs.inodesFree",
            Signal::ImagefsAvailable => "imagefs.available",
            Signal::PidAvailable => "pid.available",
        }
    }

    fn parse(name: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|s| s.name() == name)
            .ok_or_else(|| {
                format!(
                    "unknown signal {name:?} ({})",
                    Self::ALL.map(Signal::name).join(", ")
                )
            })
    }

    /// The resource the kubelet says the node was low on (`ephemeral-storage` for the
    /// filesystems' space, `inodes`, `pids`).
    pub fn resource(self) -> &'static str {
        match self {
            Signal::MemoryAvailable => "memory",
            Signal::NodefsAvailable | Signal::ImagefsAvailable => "ephemeral-storage",
            Signal::NodefsInodesFree => "inodes",
            Signal::PidAvailable => "pids",
        }
    }

    pub fn condition(self) -> Condition {
        match self {
            Signal::MemoryAvailable => Condition::MemoryPressure,
            Signal::NodefsAvailable | Signal::NodefsInodesFree | Signal::ImagefsAvailable => {
                Condition::DiskPressure
            }
            Signal::PidAvailable => Condition::PIDPressure,
        }
    }
}

/// Eviction thresholds: a signal under its threshold is pressure.
#[derive(Clone, Debug, PartialEq)]
pub struct Thresholds {
    /// Bytes of memory available.
    pub memory_available: Option<Threshold>,
    /// Space available on the node's filesystem.
    pub nodefs_available: Option<Threshold>,
    /// Inodes free on the node's filesystem.
    pub nodefs_inodes_free: Option<Threshold>,
    /// Space available on the runtime's image filesystem.
    pub imagefs_available: Option<Threshold>,
    /// Process IDs available.
    pub pid_available: Option<Threshold>,
}

/// A threshold: an amount, or a share of the capacity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Threshold {
    Amount(u64),
    /// In [0, 1].
    Share(f64),
}

impl Threshold {
    /// The amount it stands for out of `capacity`.
    pub fn quantity(self, capacity: u64) -> u64 {
        match self {
            Threshold::Amount(n) => n,
            Threshold::Share(share) => (share * capacity as f64) as u64,
        }
    }

    /// Whether `available` out of `capacity` is under the threshold.
    fn crossed(self, available: u64, capacity: u64) -> bool {
        match self {
            Threshold::Amount(n) => available < n,
            Threshold::Share(share) => (available as f64) < share * capacity as f64,
        }
    }

    /// `QUANTITY` or `PERCENT%`.
    fn parse(value: &str) -> Result<Self, String> {
        let value = value.trim();
        Ok(match value.strip_suffix('%') {
            Some(percent) => {
                let p: f64 = percent.parse().map_err(|e| format!("percentage: {e}"))?;
                if !(0.0..=100.0).contains(&p) {
                    return Err("a percentage is from 0 to 100".into());
                }
                Threshold::Share(p / 100.0)
            }
            None => {
                let q = trellis_quantity::Quantity::parse(value)
                    .map_err(|e| format!("quantity: {e}"))?;
                Threshold::Amount(
                    u64::try_from(q.value()).map_err(|_| "a threshold is not negative")?,
                )
            }
        })
    }
}

impl Default for Thresholds {
    /// The kubelet's `--eviction-hard` defaults on Linux.
    fn default() -> Self {
        Self {
            memory_available: Some(Threshold::Amount(100 << 20)),
            nodefs_available: Some(Threshold::Share(0.10)),
            nodefs_inodes_free: Some(Threshold::Share(0.05)),
            imagefs_available: None,
            pid_available: None,
        }
    }
}

impl Thresholds {
    /// No threshold: what `--eviction-soft` starts from.
    pub fn none() -> Self {
        Self {
            memory_available: None,
            nodefs_available: None,
            nodefs_inodes_free: None,
            imagefs_available: None,
            pid_available: None,
        }
    }

    pub fn get(&self, signal: Signal) -> Option<Threshold> {
        match signal {
            Signal::MemoryAvailable => self.memory_available,
            Signal::NodefsAvailable => self.nodefs_available,
            Signal::NodefsInodesFree => self.nodefs_inodes_free,
            Signal::ImagefsAvailable => self.imagefs_available,
            Signal::PidAvailable => self.pid_available,
        }
    }

    fn slot(&mut self, signal: Signal) -> &mut Option<Threshold> {
        match signal {
            Signal::MemoryAvailable => &mut self.memory_available,
            Signal::NodefsAvailable => &mut self.nodefs_available,
            Signal::NodefsInodesFree => &mut self.nodefs_inodes_free,
            Signal::ImagefsAvailable => &mut self.imagefs_available,
            Signal::PidAvailable => &mut self.pid_available,
        }
    }

    /// The signals with a threshold, and theirs.
    pub fn iter(&self) -> impl Iterator<Item = (Signal, Threshold)> + '_ {
        Signal::ALL
            .into_iter()
            .filter_map(|s| self.get(s).map(|t| (s, t)))
    }

    /// `--eviction-soft`'s form (that of `--eviction-hard`), without defaults: only
    /// the signals named have a threshold.
    pub fn parse_soft(s: &str) -> Result<Self, String> {
        Self::parse_onto(Self::none(), s)
    }

    fn parse_onto(mut thresholds: Self, s: &str) -> Result<Self, String> {
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (signal, value) = item
                .split_once('<')
                .ok_or_else(|| format!("{item:?}: expected SIGNAL<VALUE"))?;
            let signal = Signal::parse(signal.trim()).map_err(|e| format!("{item:?}: {e}"))?;
            let threshold = Threshold::parse(value).map_err(|e| format!("{item:?}: {e}"))?;
            *thresholds.slot(signal) = Some(threshold);
        }
        Ok(thresholds)
    }
}

impl std::str::FromStr for Thresholds {
    type Err = String;

    /// `--eviction-hard`'s form: `SIGNAL<QUANTITY` or `SIGNAL<PERCENT%`, comma
    /// separated; the signals named replace the defaults, the others keep theirs.
    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse_onto(Self::default(), s)
    }
}

/// A value per signal, as `--eviction-soft-grace-period` and
/// `--eviction-minimum-reclaim` give them: `SIGNAL=VALUE`, comma separated.
#[derive(Clone, Debug, PartialEq)]
pub struct PerSignal<T>(pub BTreeMap<Signal, T>);

impl<T> Default for PerSignal<T> {
    fn default() -> Self {
        Self(BTreeMap::new())
    }
}

impl<T: Copy> PerSignal<T> {
    pub fn get(&self, signal: Signal) -> Option<T> {
        self.0.get(&signal).copied()
    }
}

/// How long each soft threshold must hold before pods are evicted for it
/// (`--eviction-soft-grace-period`, `memory.available=1m30s`).
pub type GracePeriods = PerSignal<Duration>;

/// How much more than its threshold a signal must reach again once met, before it
/// no longer counts as met (`--eviction-minimum-reclaim`, `memory.available=500Mi`):
/// so that an eviction frees enough not to be needed again at once.
pub type MinimumReclaim = PerSignal<Threshold>;

fn parse_per_signal<T>(
    s: &str,
    value: impl Fn(&str) -> Result<T, String>,
) -> Result<PerSignal<T>, String> {
    let mut map = BTreeMap::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (signal, v) = item
            .split_once('=')
            .ok_or_else(|| format!("{item:?}: expected SIGNAL=VALUE"))?;
        let signal = Signal::parse(signal.trim()).map_err(|e| format!("{item:?}: {e}"))?;
        map.insert(
            signal,
            value(v.trim()).map_err(|e| format!("{item:?}: {e}"))?,
        );
    }
    Ok(PerSignal(map))
}

impl std::str::FromStr for PerSignal<Duration> {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_per_signal(s, parse_duration)
    }
}

impl std::str::FromStr for PerSignal<Threshold> {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_per_signal(s, Threshold::parse)
    }
}

/// A duration as Go writes them and the kubelet's flags take them: `1m30s`, `500ms`,
/// `2h`, `0`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    if rest.is_empty() {
        return Err("an empty duration".into());
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| format!("{s:?}: a number without a unit (ms, s, m, h)"))?;
        let (number, after) = rest.split_at(digits);
        let number: f64 = number
            .parse()
            .map_err(|_| format!("{s:?}: not a duration"))?;
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let seconds = match unit {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(format!("{s:?}: unknown unit {unit:?} (ms, s, m, h)")),
        };
        total += Duration::from_secs_f64(number * seconds);
        rest = after;
    }
    Ok(total)
}

/// What the machine has and has left; `None` where it could not be read.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Signals {
    /// Memory: (available, total) bytes.
    pub memory: Option<(u64, u64)>,
    /// The filesystem: (available, total) bytes.
    pub nodefs: Option<(u64, u64)>,
    /// The filesystem: (free, total) inodes.
    pub inodes: Option<(u64, u64)>,
    /// The runtime's image filesystem: (available, total) bytes.
    pub imagefs: Option<(u64, u64)>,
    /// Process IDs: (available, the maximum).
    pub pids: Option<(u64, u64)>,
}

/// The pressure conditions that hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pressure {
    pub memory: bool,
    pub disk: bool,
    pub pid: bool,
}

impl Pressure {
    pub fn holds(&self, condition: Condition) -> bool {
        match condition {
            Condition::MemoryPressure => self.memory,
            Condition::DiskPressure => self.disk,
            Condition::PIDPressure => self.pid,
        }
    }

    fn set(&mut self, condition: Condition) {
        match condition {
            Condition::MemoryPressure => self.memory = true,
            Condition::DiskPressure => self.disk = true,
            Condition::PIDPressure => self.pid = true,
        }
    }

    /// The conditions that hold, in the kubelet's order.
    pub fn conditions(&self) -> Vec<Condition> {
        [
            Condition::MemoryPressure,
            Condition::DiskPressure,
            Condition::PIDPressure,
        ]
        .into_iter()
        .filter(|c| self.holds(*c))
        .collect()
    }

    pub fn any(&self) -> bool {
        self.memory || self.disk || self.pid
    }
}

impl FromIterator<Condition> for Pressure {
    fn from_iter<I: IntoIterator<Item = Condition>>(conditions: I) -> Self {
        let mut pressure = Pressure::default();
        for c in conditions {
            pressure.set(c);
        }
        pressure
    }
}

impl Signals {
    /// Reads them from `/proc` and the filesystem of `root`; the image filesystem is
    /// taken to be that one.
    pub fn observe(root: &Path) -> Self {
        Self::observe_with(root, None)
    }

    /// Reads them from `/proc`, the filesystem of `root` and that of `imagefs` (the
    /// runtime's image filesystem, when it says where it is).
    pub fn observe_with(root: &Path, imagefs: Option<&Path>) -> Self {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib = |field: &str| {
            meminfo
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|k| k * 1024)
        };
        let memory = kib("MemAvailable:").zip(kib("MemTotal:"));
        let fs = rustix::fs::statvfs(root).ok();
        let space = |s: &rustix::fs::StatVfs| (s.f_bavail * s.f_frsize, s.f_blocks * s.f_frsize);
        let nodefs = fs.as_ref().map(space);
        let inodes = fs
            .as_ref()
            .filter(|s| s.f_files > 0)
            .map(|s| (s.f_favail, s.f_files));
        let imagefs = match imagefs {
            Some(path) => rustix::fs::statvfs(path).ok().as_ref().map(space),
            None => nodefs,
        };
        let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok());
        let running = std::fs::read_dir("/proc").ok().map(|entries| {
            entries
                .flatten()
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
                })
                .count() as u64
        });
        let pids = pid_max
            .zip(running)
            .map(|(max, running)| (max.saturating_sub(running), max));
        Self {
            memory,
            nodefs,
            inodes,
            imagefs,
            pids,
        }
    }

    /// (available, capacity) of `signal`.
    pub fn get(&self, signal: Signal) -> Option<(u64, u64)> {
        match signal {
            Signal::MemoryAvailable => self.memory,
            Signal::NodefsAvailable => self.nodefs,
            Signal::NodefsInodesFree => self.inodes,
            Signal::ImagefsAvailable => self.imagefs,
            Signal::PidAvailable => self.pids,
        }
    }

    /// Whether `signal` is under `threshold`, raised by `reclaim` (the minimum
    /// reclaim of a threshold already met).
    pub fn meets(&self, signal: Signal, threshold: Threshold, reclaim: Option<Threshold>) -> bool {
        self.get(signal).is_some_and(|(available, capacity)| {
            let reclaim = reclaim.map_or(0, |r| r.quantity(capacity));
            let at = threshold.quantity(capacity).saturating_add(reclaim);
            if reclaim == 0 {
                threshold.crossed(available, capacity)
            } else {
                available < at
            }
        })
    }

    /// The conditions these signals cross with `thresholds`.
    pub fn pressure(&self, thresholds: &Thresholds) -> Pressure {
        thresholds
            .iter()
            .filter(|(signal, threshold)| self.meets(*signal, *threshold, None))
            .map(|(signal, _)| signal.condition())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_read_as_the_kubelets_eviction_hard() {
        let t: Thresholds = "memory.available<1Gi, nodefs.available<15%,pid.available<1000"
            .parse()
            .unwrap();
        assert_eq!(t.memory_available, Some(Threshold::Amount(1 << 30)));
        assert_eq!(t.nodefs_available, Some(Threshold::Share(0.15)));
        assert_eq!(t.pid_available, Some(Threshold::Amount(1000)));
        // Not named: the default.
        assert_eq!(t.nodefs_inodes_free, Some(Threshold::Share(0.05)));
        assert_eq!("".parse::<Thresholds>().unwrap(), Thresholds::default());
        for bad in [
            "memory.available>1Gi",
            "cpu.available<1",
            "nodefs.available<150%",
            "memory.available<lots",
            "memory.available<-1",
        ] {
            assert!(bad.parse::<Thresholds>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_signal_under_its_threshold_is_pressure() {
        let signals = Signals {
            memory: Some((50 << 20, 8 << 30)),
            nodefs: Some((20, 100)),
            inodes: Some((4, 100)),
            imagefs: Some((20, 100)),
            pids: Some((30_000, 32_768)),
        };
        let pressure = signals.pressure(&Thresholds::default());
        // 50 MiB < 100 MiB; 20 % of space is enough, 4 % of inodes is not.
        assert_eq!(
            pressure,
            Pressure {
                memory: true,
                disk: true,
                pid: false
            }
        );
        let roomy = Signals {
            memory: Some((4 << 30, 8 << 30)),
            inodes: Some((50, 100)),
            ..signals
        };
        assert_eq!(roomy.pressure(&Thresholds::default()), Pressure::default());
        // Unread signals are no pressure.
        assert_eq!(
            Signals::default().pressure(&Thresholds::default()),
            Pressure::default()
        );
    }

    #[test]
    fn this_machine_can_be_observed() {
        let dir = tempfile::tempdir().unwrap();
        let signals = Signals::observe(dir.path());
        let (available, total) = signals.memory.unwrap();
        assert!(available <= total && total > 0, "{signals:?}");
        let (free, size) = signals.nodefs.unwrap();
        assert!(free <= size && size > 0, "{signals:?}");
        let (left, max) = signals.pids.unwrap();
        assert!(left < max, "{signals:?}");
    }

    #[test]
    fn soft_thresholds_grace_periods_and_reclaim_read_as_the_kubelets() {
        let soft = Thresholds::parse_soft("memory.available<1.5Gi,imagefs.available<20%").unwrap();
        assert_eq!(soft.memory_available, Some(Threshold::Amount(3 << 29)));
        assert_eq!(soft.imagefs_available, Some(Threshold::Share(0.20)));
        // No defaults for soft thresholds.
        assert_eq!(soft.nodefs_available, None);
        assert_eq!(Thresholds::parse_soft("").unwrap(), Thresholds::none());
        let grace: GracePeriods = "memory.available=1m30s, pid.available=500ms"
            .parse()
            .unwrap();
        assert_eq!(
            grace.get(Signal::MemoryAvailable),
            Some(Duration::from_secs(90))
        );
        assert_eq!(
            grace.get(Signal::PidAvailable),
            Some(Duration::from_millis(500))
        );
        assert_eq!(grace.get(Signal::NodefsAvailable), None);
        let reclaim: MinimumReclaim = "memory.available=0Mi,nodefs.available=500Mi"
            .parse()
            .unwrap();
        assert_eq!(
            reclaim.get(Signal::NodefsAvailable),
            Some(Threshold::Amount(500 << 20))
        );
        for bad in ["memory.available", "memory.available=1x", "disk=1s"] {
            assert!(bad.parse::<GracePeriods>().is_err(), "{bad}");
        }
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_duration("5").is_err());
    }

    #[test]
    fn a_met_threshold_holds_until_its_minimum_reclaim_is_back() {
        let signals = Signals {
            memory: Some((150 << 20, 1 << 30)),
            ..Default::default()
        };
        let threshold = Threshold::Amount(100 << 20);
        assert!(!signals.meets(Signal::MemoryAvailable, threshold, None));
        // Once met, 100Mi + 100Mi must be available again.
        assert!(signals.meets(
            Signal::MemoryAvailable,
            threshold,
            Some(Threshold::Amount(100 << 20))
        ));
        // Unread: never met.
        assert!(!Signals::default().meets(Signal::PidAvailable, threshold, None));
    }
}
