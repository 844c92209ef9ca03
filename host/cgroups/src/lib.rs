//! Linux control groups through their files, v1 and v2: which hierarchy the machine
//! has ([`Hierarchy::detect`]), a group in it ([`Cgroup`]): created, limited
//! ([`Resources`]), joined, measured ([`Stats`]) and removed.
//!
//! A cgroup is named by its path from the hierarchy's root (`/kubepods/burstable/pod<uid>`),
//! as the kubelet's and containerd's cgroupfs drivers name them. On v1 that path is a
//! directory in every controller's mount (cpu, cpuacct, cpuset, memory, pids, and
//! freezer, devices, blkio so that all of a pod's processes are grouped in each); on
//! v2 it is one directory, whose parents delegate the cpu, memory and pids
//! controllers to it through `cgroup.subtree_control`.
//!
//! The kubelet's conversions from Kubernetes' CPU quantities are here too
//! ([`milli_cpu_to_shares`], [`milli_cpu_to_quota`]), and runc's from v1 shares to
//! v2 weight ([`shares_to_weight`]).

use std::fs;
use std::io::{self, ErrorKind};
use std::path::{Path, PathBuf};

/// Which cgroup hierarchy a machine has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    /// One mount per controller (or per group of co-mounted controllers). A hybrid
    /// machine (v1 controllers and an empty cgroup2 mount, at `/sys/fs/cgroup/unified`
    /// say) is V1: its controllers are all on the v1 side.
    V1,
    /// One unified hierarchy, mounted at `/sys/fs/cgroup`.
    V2,
}

/// The v1 controllers a cgroup is made in. The first five are limited or measured;
/// the others group a pod's processes in every hierarchy, as runc does.
const V1_CONTROLLERS: &[&str] = &[
    "cpu", "cpuacct", "cpuset", "memory", "pids", "freezer", "devices", "blkio",
];

/// The v2 controllers a cgroup's parents delegate to it.
const V2_CONTROLLERS: &[&str] = &["cpu", "memory", "pids"];

/// The cgroup hierarchy of a machine: where each controller is mounted.
#[derive(Clone, Debug)]
pub struct Hierarchy {
    version: Version,
    /// V1: each controller's mount point (co-mounted ones share one). V2: one entry,
    /// `("", mount point)`.
    mounts: Vec<(String, PathBuf)>,
}

impl Hierarchy {
    /// Reads the machine's cgroup mounts from `/proc/self/mountinfo`.
    pub fn detect() -> io::Result<Hierarchy> {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo")?;
        Self::from_mountinfo(&mountinfo)
    }

    /// The hierarchy that `mountinfo` (the text of `/proc/<pid>/mountinfo`) describes:
    /// V2 when a cgroup2 file system is mounted at `/sys/fs/cgroup`, else V1 when any
    /// v1 controller this crate uses is mounted, else V2 at the first cgroup2 mount.
    pub fn from_mountinfo(mountinfo: &str) -> io::Result<Hierarchy> {
        let mut v1 = Vec::new();
        let mut v2 = None;
        for line in mountinfo.lines() {
            // `id parent major:minor root mountpoint options [optional...] - fstype source superoptions`
            let Some((before, after)) = line.split_once(" - ") else {
                continue;
            };
            let mut fields = before.split(' ');
            let Some(mount_point) = fields.nth(4) else {
                continue;
            };
            let mount_point = PathBuf::from(unescape(mount_point));
            let mut after = after.split(' ');
            let fs_type = after.next().unwrap_or_default();
            let super_options = after.nth(1).unwrap_or_default();
            match fs_type {
                "cgroup2" if mount_point == Path::new("/sys/fs/cgroup") || v2.is_none() => {
                    v2 = Some(mount_point);
                }
                "cgroup" => {
                    for option in super_options.split(',') {
                        if V1_CONTROLLERS.contains(&option)
                            && !v1.iter().any(|(name, _)| name == option)
                        {
                            v1.push((option.to_string(), mount_point.clone()));
                        }
                    }
                }
                _ => {}
            }
        }
        match v2 {
            Some(root) if root == Path::new("/sys/fs/cgroup") => Ok(Self::v2(root)),
            _ if !v1.is_empty() => Ok(Hierarchy {
                version: Version::V1,
                mounts: v1,
            }),
            Some(root) => Ok(Self::v2(root)),
            None => Err(io::Error::new(
                ErrorKind::NotFound,
                "no cgroup file system is mounted (/proc/self/mountinfo)",
            )),
        }
    }

    /// A v2 hierarchy mounted at `root` (a test's directory, say).
    pub fn v2(root: PathBuf) -> Hierarchy {
        Hierarchy {
            version: Version::V2,
            mounts: vec![(String::new(), root)],
        }
    }

    /// A v1 hierarchy with these controllers mounted at these directories.
    pub fn v1(mounts: Vec<(String, PathBuf)>) -> Hierarchy {
        Hierarchy {
            version: Version::V1,
            mounts,
        }
    }

    pub fn version(&self) -> Version {
        self.version
    }

    /// The cgroup at `path` from the hierarchy's root, such as
    /// `/kubepods/burstable/pod<uid>` (a leading `/` is optional). Nothing is made.
    pub fn cgroup(&self, path: &str) -> Cgroup {
        let relative = path.trim_matches('/');
        let path = format!("/{relative}");
        let mut dirs: Vec<(Vec<String>, PathBuf, PathBuf)> = Vec::new();
        for (controller, mount) in &self.mounts {
            let dir = if relative.is_empty() {
                mount.clone()
            } else {
                mount.join(relative)
            };
            // Co-mounted controllers (`cpu,cpuacct`) share one directory.
            match dirs.iter_mut().find(|(_, d, _)| *d == dir) {
                Some((controllers, _, _)) => controllers.push(controller.clone()),
                None => dirs.push((vec![controller.clone()], dir, mount.clone())),
            }
        }
        Cgroup {
            version: self.version,
            path,
            dirs,
        }
    }
}

/// `\040` and the like in a mountinfo field, as the kernel escapes space, tab,
/// newline and backslash.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let value = bytes[i + 1..i + 4]
                .iter()
                .fold(0u32, |n, b| n * 8 + u32::from(b - b'0'));
            out.push(u8::try_from(value).unwrap_or(b'?'));
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A control group: its directory in each controller's hierarchy.
#[derive(Clone, Debug)]
pub struct Cgroup {
    version: Version,
    path: String,
    /// (controllers, directory, their mount point); V2: one entry.
    dirs: Vec<(Vec<String>, PathBuf, PathBuf)>,
}

/// Limits to set on a cgroup; `None` leaves a setting as it is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    /// v1 `cpu.shares` (2..=262144); v2 `cpu.weight` through [`shares_to_weight`].
    pub cpu_shares: Option<u64>,
    /// CFS quota in µs per period; ≤ 0 is no quota.
    pub cpu_quota: Option<i64>,
    /// CFS period in µs.
    pub cpu_period: Option<u64>,
    /// Memory limit in bytes; ≤ 0 is no limit. Swap is limited to none beyond it
    /// where the kernel accounts swap, as containerd does when no swap limit is asked.
    pub memory_limit: Option<i64>,
    /// Most tasks; ≤ 0 is no limit.
    pub pids_limit: Option<i64>,
}

/// What a cgroup (and all below it) uses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// CPU time used, in ns.
    pub cpu_usage_ns: u64,
    /// CPU time used in user mode and in the kernel, in ns (v1: from `cpuacct.stat`,
    /// in clock ticks of 10 ms).
    pub cpu_user_ns: u64,
    pub cpu_system_ns: u64,
    /// Periods the CFS quota throttled, and for how long in all, in ns.
    pub cpu_throttled_periods: u64,
    pub cpu_throttled_ns: u64,
    /// Memory charged, page cache included.
    pub memory_usage: u64,
    /// Usage less the inactive file pages (what the kernel can drop first), as
    /// cAdvisor and the kubelet's eviction measure it.
    pub memory_working_set: u64,
    /// Anonymous memory (and swap cache).
    pub memory_rss: u64,
    /// Page faults, and of those the major ones.
    pub page_faults: u64,
    pub major_page_faults: u64,
    /// Processes the kernel's OOM killer killed in it because of its limit.
    pub oom_kills: u64,
    /// Tasks in it.
    pub pids: u64,
}

impl Cgroup {
    /// Its path from the hierarchy's root, with a leading `/`.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Which hierarchy it is in.
    pub fn version(&self) -> Version {
        self.version
    }

    /// Makes it, and its parents, if they are not there. V1: in every mounted
    /// controller, with `cpuset.cpus`/`cpuset.mems` copied from the parent where
    /// empty (a cpuset without them takes no task). V2: the parents delegate the cpu,
    /// memory and pids controllers (those they have) to their children.
    pub fn create(&self) -> io::Result<()> {
        match self.version {
            Version::V1 => {
                for (controllers, dir, mount) in &self.dirs {
                    fs::create_dir_all(dir)?;
                    if controllers.iter().any(|c| c == "cpuset") {
                        inherit_cpuset(mount, dir)?;
                    }
                }
                Ok(())
            }
            Version::V2 => {
                let (_, dir, mount) = &self.dirs[0];
                let mut parent = mount.clone();
                let relative = dir.strip_prefix(mount).unwrap_or(Path::new(""));
                for part in relative.components() {
                    enable_controllers(&parent)?;
                    parent.push(part);
                    match fs::create_dir(&parent) {
                        Ok(()) => {}
                        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            }
        }
    }

    /// Sets the limits `r` asks for.
    pub fn set(&self, r: &Resources) -> io::Result<()> {
        match self.version {
            Version::V1 => self.set_v1(r),
            Version::V2 => self.set_v2(r),
        }
    }

    fn set_v1(&self, r: &Resources) -> io::Result<()> {
        if let Some(dir) = self.controller_dir("cpu") {
            if let Some(shares) = r.cpu_shares {
                write(dir, "cpu.shares", &shares.to_string())?;
            }
            // The period first: a quota is checked against the period in force.
            if let Some(period) = r.cpu_period.filter(|p| *p > 0) {
                write(dir, "cpu.cfs_period_us", &period.to_string())?;
            }
            if let Some(quota) = r.cpu_quota {
                let quota = if quota <= 0 { -1 } else { quota };
                write(dir, "cpu.cfs_quota_us", &quota.to_string())?;
            }
        }
        if let (Some(dir), Some(limit)) = (self.controller_dir("memory"), r.memory_limit) {
            let limit = if limit <= 0 { -1 } else { limit };
            let limit = limit.to_string();
            if dir.join("memory.memsw.limit_in_bytes").exists() {
                // memory+swap may not be below memory: raise it first when raising,
                // lower memory first when lowering.
                if write(dir, "memory.limit_in_bytes", &limit).is_err() {
                    write(dir, "memory.memsw.limit_in_bytes", &limit)?;
                    write(dir, "memory.limit_in_bytes", &limit)?;
                } else {
                    write(dir, "memory.memsw.limit_in_bytes", &limit)?;
                }
            } else {
                write(dir, "memory.limit_in_bytes", &limit)?;
            }
        }
        if let (Some(dir), Some(limit)) = (self.controller_dir("pids"), r.pids_limit) {
            write(dir, "pids.max", &max_or(limit))?;
        }
        Ok(())
    }

    fn set_v2(&self, r: &Resources) -> io::Result<()> {
        let dir = &self.dirs[0].1;
        if let Some(shares) = r.cpu_shares {
            write(dir, "cpu.weight", &shares_to_weight(shares).to_string())?;
        }
        if r.cpu_quota.is_some() || r.cpu_period.is_some() {
            let quota = match r.cpu_quota {
                Some(quota) => max_or(quota),
                // Only the period changes: keep the quota in force.
                None => fs::read_to_string(dir.join("cpu.max"))?
                    .split_whitespace()
                    .next()
                    .unwrap_or("max")
                    .to_string(),
            };
            let value = match r.cpu_period.filter(|p| *p > 0) {
                Some(period) => format!("{quota} {period}"),
                None => quota,
            };
            write(dir, "cpu.max", &value)?;
        }
        if let Some(limit) = r.memory_limit {
            write(dir, "memory.max", &max_or(limit))?;
            if dir.join("memory.swap.max").exists() {
                write(dir, "memory.swap.max", if limit > 0 { "0" } else { "max" })?;
            }
        }
        if let Some(limit) = r.pids_limit {
            write(dir, "pids.max", &max_or(limit))?;
        }
        Ok(())
    }

    /// The `cgroup.procs` files a process writes its pid (or `0`, itself) into to
    /// join: one per controller directory (v1), the one (v2).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .map(|(_, dir, _)| dir.join("cgroup.procs"))
            .collect()
    }

    /// Moves the process `pid` (all its threads) into it.
    pub fn add_process(&self, pid: u32) -> io::Result<()> {
        for file in self.procs_files() {
            fs::write(&file, pid.to_string())
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", file.display())))?;
        }
        Ok(())
    }

    /// What it and its descendants use now.
    pub fn stats(&self) -> io::Result<Stats> {
        match self.version {
            Version::V1 => self.stats_v1(),
            Version::V2 => self.stats_v2(),
        }
    }

    fn stats_v1(&self) -> io::Result<Stats> {
        let mut stats = Stats::default();
        if let Some(dir) = self.controller_dir("cpuacct") {
            stats.cpu_usage_ns = read_u64(dir, "cpuacct.usage")?;
            if let Ok(text) = fs::read_to_string(dir.join("cpuacct.stat")) {
                // USER_HZ is 100 on every Linux architecture this runs on.
                let ticks = |key| keyed(&text, key).unwrap_or(0) * 10_000_000;
                stats.cpu_user_ns = ticks("user");
                stats.cpu_system_ns = ticks("system");
            }
        }
        if let Some(dir) = self.controller_dir("cpu")
            && let Ok(text) = fs::read_to_string(dir.join("cpu.stat"))
        {
            stats.cpu_throttled_periods = keyed(&text, "nr_throttled").unwrap_or(0);
            stats.cpu_throttled_ns = keyed(&text, "throttled_time").unwrap_or(0);
        }
        if let Some(dir) = self.controller_dir("memory") {
            stats.memory_usage = read_u64(dir, "memory.usage_in_bytes")?;
            let text = fs::read_to_string(dir.join("memory.stat"))?;
            let inactive_file = keyed(&text, "total_inactive_file").unwrap_or(0);
            stats.memory_working_set = stats.memory_usage.saturating_sub(inactive_file);
            stats.memory_rss = keyed(&text, "total_rss").unwrap_or(0);
            stats.page_faults = keyed(&text, "total_pgfault").unwrap_or(0);
            stats.major_page_faults = keyed(&text, "total_pgmajfault").unwrap_or(0);
            // `oom_kill` is there from Linux 4.13; before it no count is kept
            // (`memory.failcnt` counts every time the limit was hit, reclaim or not).
            if let Ok(text) = fs::read_to_string(dir.join("memory.oom_control")) {
                stats.oom_kills = keyed(&text, "oom_kill").unwrap_or(0);
            }
        }
        if let Some(dir) = self.controller_dir("pids") {
            stats.pids = read_u64(dir, "pids.current").unwrap_or(0);
        }
        Ok(stats)
    }

    fn stats_v2(&self) -> io::Result<Stats> {
        let dir = &self.dirs[0].1;
        let mut stats = Stats::default();
        let cpu = fs::read_to_string(dir.join("cpu.stat"))?;
        let usec = |key| keyed(&cpu, key).unwrap_or(0) * 1000;
        stats.cpu_usage_ns = usec("usage_usec");
        stats.cpu_user_ns = usec("user_usec");
        stats.cpu_system_ns = usec("system_usec");
        stats.cpu_throttled_periods = keyed(&cpu, "nr_throttled").unwrap_or(0);
        stats.cpu_throttled_ns = usec("throttled_usec");
        if let Ok(current) = read_u64(dir, "memory.current") {
            stats.memory_usage = current;
            let text = fs::read_to_string(dir.join("memory.stat"))?;
            let inactive_file = keyed(&text, "inactive_file").unwrap_or(0);
            stats.memory_working_set = current.saturating_sub(inactive_file);
            stats.memory_rss = keyed(&text, "anon").unwrap_or(0);
            stats.page_faults = keyed(&text, "pgfault").unwrap_or(0);
            stats.major_page_faults = keyed(&text, "pgmajfault").unwrap_or(0);
            if let Ok(text) = fs::read_to_string(dir.join("memory.events")) {
                stats.oom_kills = keyed(&text, "oom_kill").unwrap_or(0);
            }
        }
        stats.pids = read_u64(dir, "pids.current").unwrap_or(0);
        Ok(stats)
    }

    /// The processes in it (not in its descendants).
    pub fn pids(&self) -> io::Result<Vec<u32>> {
        let mut pids = Vec::new();
        for file in self.procs_files() {
            let text = match fs::read_to_string(&file) {
                Ok(text) => text,
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            for pid in text.lines().filter_map(|l| l.trim().parse().ok()) {
                if !pids.contains(&pid) {
                    pids.push(pid);
                }
            }
        }
        Ok(pids)
    }

    /// The processes in it and in its descendants.
    fn processes_below(&self) -> io::Result<Vec<i32>> {
        // On v1 a process is in every controller's tree: listed once.
        let mut pids = Vec::new();
        for (_, dir, _) in &self.dirs {
            for tree_dir in subtree(dir)? {
                let text = match fs::read_to_string(tree_dir.join("cgroup.procs")) {
                    Ok(text) => text,
                    Err(e) if e.kind() == ErrorKind::NotFound => continue,
                    Err(e) => return Err(e),
                };
                for pid in text.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                    if !pids.contains(&pid) {
                        pids.push(pid);
                    }
                }
            }
        }
        Ok(pids)
    }

    /// Sends SIGKILL to every process in it and in its descendants. Returns how many
    /// were signalled; a process that exits meanwhile is not an error.
    pub fn kill_all(&self) -> io::Result<usize> {
        let mut killed = 0;
        for pid in self.processes_below()? {
            if let Some(pid) = rustix::process::Pid::from_raw(pid)
                && rustix::process::kill_process(pid, rustix::process::Signal::KILL).is_ok()
            {
                killed += 1;
            }
        }
        Ok(killed)
    }

    /// Kills every process in it and below, waits for them to have exited (through a
    /// pidfd each: woken by their exits, not by a clock) and removes it and what is
    /// below it; processes that joined meanwhile are killed in turn. Blocks, up to
    /// `timeout`. The way to remove a cgroup that may still hold processes.
    pub fn kill_and_remove(&self, timeout: std::time::Duration) -> io::Result<()> {
        use rustix::event::{PollFd, PollFlags, Timespec, poll};
        use rustix::process::{Pid, PidfdFlags, Signal, pidfd_open, pidfd_send_signal};
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let pidfds: Vec<_> = self
                .processes_below()?
                .into_iter()
                .filter_map(|pid| pidfd_open(Pid::from_raw(pid)?, PidfdFlags::empty()).ok())
                .collect();
            for pidfd in &pidfds {
                let _ = pidfd_send_signal(pidfd, Signal::KILL);
            }
            for pidfd in &pidfds {
                // A pidfd is readable once its process has exited (and left its cgroup).
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                let left = Timespec::try_from(left).map_err(io::Error::other)?;
                poll(&mut [PollFd::new(pidfd, PollFlags::IN)], Some(&left))?;
            }
            match self.remove() {
                Ok(()) => return Ok(()),
                Err(e) if pidfds.is_empty() || std::time::Instant::now() >= deadline => {
                    return Err(e);
                }
                Err(_) => {}
            }
        }
    }

    /// Removes it and the cgroups below it, bottom-up. Kills nothing: a cgroup with
    /// processes in it fails with `EBUSY` (and what is below it that could go is gone).
    /// Removing one that is not there succeeds.
    pub fn remove(&self) -> io::Result<()> {
        let mut result = Ok(());
        for (_, dir, mount) in &self.dirs {
            if dir == mount {
                continue;
            }
            let mut dirs = subtree(dir)?;
            // Deepest first.
            dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
            for d in dirs {
                match fs::remove_dir(&d) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => {
                        if result.is_ok() {
                            result = Err(io::Error::new(
                                e.kind(),
                                format!("remove cgroup {}: {e}", d.display()),
                            ));
                        }
                    }
                }
            }
        }
        result
    }

    /// Whether its directory is there (in any controller, on v1).
    pub fn exists(&self) -> bool {
        self.dirs.iter().any(|(_, dir, _)| dir.is_dir())
    }

    /// The cgroup below it at `name` (`pod<uid>`, a container's id).
    pub fn child(&self, name: &str) -> Cgroup {
        let name = name.trim_matches('/');
        Cgroup {
            version: self.version,
            path: if self.path == "/" {
                format!("/{name}")
            } else {
                format!("{}/{name}", self.path)
            },
            dirs: self
                .dirs
                .iter()
                .map(|(c, d, m)| (c.clone(), d.join(name), m.clone()))
                .collect(),
        }
    }

    /// The directory of `controller` (v1), or the one directory (v2): where to
    /// read a file this crate does not.
    pub fn controller_dir(&self, controller: &str) -> Option<&Path> {
        match self.version {
            Version::V2 => self.dirs.first().map(|(_, d, _)| d.as_path()),
            Version::V1 => self
                .dirs
                .iter()
                .find(|(c, _, _)| c.iter().any(|c| c == controller))
                .map(|(_, d, _)| d.as_path()),
        }
    }
}

/// `dir` and every directory below it.
fn subtree(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let entries = match fs::read_dir(&d) {
            Ok(entries) => entries,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                todo.push(entry.path());
            }
        }
        out.push(d);
    }
    Ok(out)
}

/// Copies `cpuset.cpus` and `cpuset.mems` down from `mount` to `dir` wherever a
/// level has them empty.
fn inherit_cpuset(mount: &Path, dir: &Path) -> io::Result<()> {
    let relative = dir.strip_prefix(mount).unwrap_or(Path::new(""));
    let mut parent = mount.to_path_buf();
    for part in relative.components() {
        let child = parent.join(part);
        for file in ["cpuset.cpus", "cpuset.mems"] {
            let own = fs::read_to_string(child.join(file))?;
            if own.trim().is_empty() {
                let inherited = fs::read_to_string(parent.join(file))?;
                write(&child, file, inherited.trim())?;
            }
        }
        parent = child;
    }
    Ok(())
}

/// Delegates the v2 controllers `dir` has to its children.
fn enable_controllers(dir: &Path) -> io::Result<()> {
    let available = fs::read_to_string(dir.join("cgroup.controllers"))?;
    let enabled = fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
    for controller in V2_CONTROLLERS {
        let has = |text: &str| text.split_whitespace().any(|c| c == *controller);
        if has(&available) && !has(&enabled) {
            write(dir, "cgroup.subtree_control", &format!("+{controller}"))?;
        }
    }
    Ok(())
}

fn max_or(value: i64) -> String {
    if value <= 0 {
        "max".to_string()
    } else {
        value.to_string()
    }
}

fn write(dir: &Path, file: &str, value: &str) -> io::Result<()> {
    let path = dir.join(file);
    fs::write(&path, value).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("write {value:?} to {}: {e}", path.display()),
        )
    })
}

fn read_u64(dir: &Path, file: &str) -> io::Result<u64> {
    let path = dir.join(file);
    let text = fs::read_to_string(&path)?;
    text.trim().parse().map_err(|e| {
        io::Error::new(
            ErrorKind::InvalidData,
            format!("{}: {text:?}: {e}", path.display()),
        )
    })
}

/// The value of `key` in a file of `key value` lines (`memory.stat`, `cpu.stat`).
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// The kubelet's smallest `cpu.shares` (and the kernel's).
pub const MIN_SHARES: u64 = 2;
/// The kernel's largest `cpu.shares`.
pub const MAX_SHARES: u64 = 262_144;
/// The kubelet's CFS period, in µs.
pub const DEFAULT_CPU_PERIOD: u64 = 100_000;
/// The kubelet's smallest CFS quota, in µs (the kernel's is 1 ms).
pub const MIN_QUOTA: i64 = 1000;

/// CPU shares for a request of `milli` millicores, as the kubelet's `MilliCPUToShares`:
/// 1024 per core, at least 2, at most 262144.
pub fn milli_cpu_to_shares(milli: i64) -> u64 {
    if milli <= 0 {
        return MIN_SHARES;
    }
    let shares = u64::try_from(milli).unwrap_or(0).saturating_mul(1024) / 1000;
    shares.clamp(MIN_SHARES, MAX_SHARES)
}

/// The CFS quota in µs for a limit of `milli` millicores over `period` µs, as the
/// kubelet's `MilliCPUToQuota`: 0 (no quota) for no limit, at least 1 ms.
pub fn milli_cpu_to_quota(milli: i64, period: u64) -> i64 {
    if milli <= 0 {
        return 0;
    }
    let quota = milli.saturating_mul(i64::try_from(period).unwrap_or(i64::MAX)) / 1000;
    quota.max(MIN_QUOTA)
}

/// The v2 `cpu.weight` (1..=10000) for v1 `cpu.shares` (2..=262144), as runc maps
/// them; 0 shares (unset) is weight 0 (unset).
pub fn shares_to_weight(shares: u64) -> u64 {
    if shares == 0 {
        return 0;
    }
    1 + (shares.clamp(MIN_SHARES, MAX_SHARES) - 2) * 9999 / 262_142
}

#[cfg(test)]
mod tests;
