//! The node's pressure conditions, from the signals and hard thresholds of the
//! kubelet's eviction manager (`--eviction-hard`): `MemoryPressure` when
//! `memory.available` is under its threshold, `DiskPressure` when the node's
//! filesystem (the agent's root) is short of space or inodes (`nodefs.available`,
//! `nodefs.inodesFree`), `PIDPressure` when `pid.available` is. The kubelet's
//! defaults: `memory.available<100Mi`, `nodefs.available<10%`, `nodefs.inodesFree<5%`,
//! no PID threshold.
//!
//! The node lifecycle controller taints a node under pressure (NoSchedule), so the
//! scheduler sends it no new pods. The agent evicts nothing: the kubelet's eviction of
//! running pods is not done.
//!
//! `memory.available` is the kernel's `MemAvailable`, where the kubelet reads the root
//! cgroup's working set; both say what can be had without swapping.

use std::path::Path;

/// Hard eviction thresholds: a signal under its threshold is pressure.
#[derive(Clone, Debug, PartialEq)]
pub struct Thresholds {
    /// Bytes of memory available.
    pub memory_available: Option<Threshold>,
    /// Space available on the node's filesystem.
    pub nodefs_available: Option<Threshold>,
    /// Inodes free on the node's filesystem.
    pub nodefs_inodes_free: Option<Threshold>,
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
    /// Whether `available` out of `capacity` is under the threshold.
    fn crossed(self, available: u64, capacity: u64) -> bool {
        match self {
            Threshold::Amount(n) => available < n,
            Threshold::Share(share) => (available as f64) < share * capacity as f64,
        }
    }
}

impl Default for Thresholds {
    /// The kubelet's `--eviction-hard` defaults on Linux.
    fn default() -> Self {
        Self {
            memory_available: Some(Threshold::Amount(100 << 20)),
            nodefs_available: Some(Threshold::Share(0.10)),
            nodefs_inodes_free: Some(Threshold::Share(0.05)),
            pid_available: None,
        }
    }
}

impl std::str::FromStr for Thresholds {
    type Err = String;

    /// `--eviction-hard`'s form: `SIGNAL<QUANTITY` or `SIGNAL<PERCENT%`, comma
    /// separated; the signals named replace the defaults, the others keep theirs.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut thresholds = Thresholds::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (signal, value) = item
                .split_once('<')
                .ok_or_else(|| format!("{item:?}: expected SIGNAL<VALUE"))?;
            let value = value.trim();
            let threshold = match value.strip_suffix('%') {
                Some(percent) => {
                    let p: f64 = percent
                        .parse()
                        .map_err(|e| format!("{item:?}: percentage: {e}"))?;
                    if !(0.0..=100.0).contains(&p) {
                        return Err(format!("{item:?}: a percentage is from 0 to 100"));
                    }
                    Threshold::Share(p / 100.0)
                }
                None => {
                    let q = trellis_quantity::Quantity::parse(value)
                        .map_err(|e| format!("{item:?}: quantity: {e}"))?;
                    Threshold::Amount(
                        u64::try_from(q.value())
                            .map_err(|_| format!("{item:?}: a threshold is not negative"))?,
                    )
                }
            };
            let slot = match signal.trim() {
                "memory.available" => &mut thresholds.memory_available,
                "nodefs.available" => &mut thresholds.nodefs_available,
                "nodefs.inodesFree" => &mut thresholds.nodefs_inodes_free,
                "pid.available" => &mut thresholds.pid_available,
                other => {
                    return Err(format!(
                        "unknown signal {other:?} (memory.available, nodefs.available, \
                         nodefs.inodesFree, pid.available)"
                    ));
                }
            };
            *slot = Some(threshold);
        }
        Ok(thresholds)
    }
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

impl Signals {
    /// Reads them from `/proc` and the filesystem of `root`.
    pub fn observe(root: &Path) -> Self {
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
        let nodefs = fs
            .as_ref()
            .map(|s| (s.f_bavail * s.f_frsize, s.f_blocks * s.f_frsize));
        let inodes = fs
            .filter(|s| s.f_files > 0)
            .map(|s| (s.f_favail, s.f_files));
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
            pids,
        }
    }

    /// The conditions these signals cross with `thresholds`.
    pub fn pressure(&self, thresholds: &Thresholds) -> Pressure {
        let crossed = |threshold: Option<Threshold>, signal: Option<(u64, u64)>| {
            threshold
                .zip(signal)
                .is_some_and(|(t, (available, capacity))| t.crossed(available, capacity))
        };
        Pressure {
            memory: crossed(thresholds.memory_available, self.memory),
            disk: crossed(thresholds.nodefs_available, self.nodefs)
                || crossed(thresholds.nodefs_inodes_free, self.inodes),
            pid: crossed(thresholds.pid_available, self.pids),
        }
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
}
