use super::*;

const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

#[test]
fn hybrid_machine_is_v1() {
    let h = Hierarchy::from_mountinfo(HYBRID).expect("detect");
    assert_eq!(h.version(), Version::V1);
    let cg = h.cgroup("/kubepods/pod1");
    assert_eq!(cg.path(), "/kubepods/pod1");
    assert_eq!(
        cg.procs_files(),
        ["cpu", "cpuacct", "memory", "pids"]
            .iter()
            .map(|c| PathBuf::from(format!("/sys/fs/cgroup/{c}/kubepods/pod1/cgroup.procs")))
            .collect::<Vec<_>>()
    );
}

#[test]
fn unified_machine_is_v2() {
    let text = "\
25 1 0:23 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
26 1 0:24 / /mnt/my\\040dir rw - ext4 /dev/sda rw
";
    let h = Hierarchy::from_mountinfo(text).expect("detect");
    assert_eq!(h.version(), Version::V2);
    assert_eq!(
        h.cgroup("a/b").procs_files(),
        [PathBuf::from("/sys/fs/cgroup/a/b/cgroup.procs")]
    );
    assert_eq!(h.cgroup("/").path(), "/");
    assert!(Hierarchy::from_mountinfo("26 1 0:24 / /mnt rw - ext4 /dev/sda rw\n").is_err());
}

#[test]
fn co_mounted_controllers_share_a_directory() {
    let text = "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n";
    let h = Hierarchy::from_mountinfo(text).expect("detect");
    let cg = h.cgroup("/x");
    assert_eq!(cg.procs_files().len(), 1);
    assert_eq!(
        cg.controller_dir("cpuacct"),
        Some(Path::new("/sys/fs/cgroup/cpu,cpuacct/x"))
    );
}

#[test]
fn mountinfo_escapes() {
    assert_eq!(unescape("/mnt/my\\040dir"), "/mnt/my dir");
    assert_eq!(unescape("/plain"), "/plain");
}

#[test]
fn kubelet_conversions() {
    assert_eq!(milli_cpu_to_shares(0), 2);
    assert_eq!(milli_cpu_to_shares(1), 2);
    assert_eq!(milli_cpu_to_shares(100), 102);
    assert_eq!(milli_cpu_to_shares(1000), 1024);
    assert_eq!(milli_cpu_to_shares(1_000_000), 262_144);
    assert_eq!(milli_cpu_to_quota(0, 100_000), 0);
    assert_eq!(milli_cpu_to_quota(200, 100_000), 20_000);
    assert_eq!(milli_cpu_to_quota(5, 100_000), 1000);
    assert_eq!(shares_to_weight(0), 0);
    assert_eq!(shares_to_weight(2), 1);
    assert_eq!(shares_to_weight(1024), 39);
    assert_eq!(shares_to_weight(262_144), 10_000);
}

/// A fake v2 hierarchy in a temporary directory: the kernel's files as plain files.
fn fake_v2() -> (tempfile::TempDir, Hierarchy) {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(
        dir.path().join("cgroup.controllers"),
        "cpuset cpu io memory pids\n",
    )
    .expect("write");
    fs::write(dir.path().join("cgroup.subtree_control"), "").expect("write");
    let h = Hierarchy::v2(dir.path().to_path_buf());
    (dir, h)
}

#[test]
fn v2_create_delegates_controllers_in_parents() {
    let (dir, h) = fake_v2();
    // The intermediate level exists with its own controller files, as the kernel makes them.
    fs::create_dir(dir.path().join("kubepods")).expect("mkdir");
    fs::write(
        dir.path().join("kubepods/cgroup.controllers"),
        "cpu memory pids\n",
    )
    .expect("write");
    fs::write(
        dir.path().join("kubepods/cgroup.subtree_control"),
        "memory\n",
    )
    .expect("write");
    let cg = h.cgroup("/kubepods/pod1");
    cg.create().expect("create");
    assert!(cg.exists());
    // A plain file keeps the last write: the last controller enabled at each level.
    assert_eq!(
        fs::read_to_string(dir.path().join("cgroup.subtree_control")).expect("read"),
        "+pids"
    );
    assert_eq!(
        fs::read_to_string(dir.path().join("kubepods/cgroup.subtree_control")).expect("read"),
        "+pids"
    );
}

#[test]
fn v2_set_writes_the_files() {
    let (dir, h) = fake_v2();
    let cg = h.cgroup("/c");
    fs::create_dir(dir.path().join("c")).expect("mkdir");
    fs::write(dir.path().join("c/memory.swap.max"), "max").expect("write");
    cg.set(&Resources {
        cpu_shares: Some(1024),
        cpu_quota: Some(20_000),
        cpu_period: Some(100_000),
        memory_limit: Some(32 << 20),
        pids_limit: Some(-1),
    })
    .expect("set");
    let read = |f: &str| fs::read_to_string(dir.path().join("c").join(f)).expect(f);
    assert_eq!(read("cpu.weight"), "39");
    assert_eq!(read("cpu.max"), "20000 100000");
    assert_eq!(read("memory.max"), "33554432");
    assert_eq!(read("memory.swap.max"), "0");
    assert_eq!(read("pids.max"), "max");
    // Only the period: the quota in force stays.
    cg.set(&Resources {
        cpu_period: Some(50_000),
        ..Default::default()
    })
    .expect("set");
    assert_eq!(read("cpu.max"), "20000 50000");
}

#[test]
fn v2_stats_parse() {
    let (dir, h) = fake_v2();
    let c = dir.path().join("c");
    fs::create_dir(&c).expect("mkdir");
    fs::write(
        c.join("cpu.stat"),
        "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\nnr_periods 10\nnr_throttled 4\nthrottled_usec 7\n",
    )
    .expect("write");
    fs::write(c.join("memory.current"), "10000\n").expect("write");
    fs::write(
        c.join("memory.stat"),
        "anon 6000\nfile 4000\ninactive_file 3000\npgfault 12\npgmajfault 2\n",
    )
    .expect("write");
    fs::write(
        c.join("memory.events"),
        "low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\noom_group_kill 0\n",
    )
    .expect("write");
    fs::write(c.join("pids.current"), "3\n").expect("write");
    let stats = h.cgroup("/c").stats().expect("stats");
    assert_eq!(
        stats,
        Stats {
            cpu_usage_ns: 1_500_000,
            cpu_user_ns: 1_000_000,
            cpu_system_ns: 500_000,
            cpu_throttled_periods: 4,
            cpu_throttled_ns: 7000,
            memory_usage: 10_000,
            memory_working_set: 7000,
            memory_rss: 6000,
            page_faults: 12,
            major_page_faults: 2,
            oom_kills: 1,
            pids: 3,
        }
    );
}

/// A cgroup under a root of this test's own in the machine's real hierarchy, removed
/// (its processes killed first) when dropped.
struct TestRoot(Cgroup);

impl Drop for TestRoot {
    fn drop(&mut self) {
        let _ = self.0.kill_all();
        let _ = self.0.remove();
    }
}

fn real_root(name: &str) -> Option<(Hierarchy, TestRoot)> {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: cgroups need root");
        return None;
    }
    let h = match Hierarchy::detect() {
        Ok(h) => h,
        Err(e) => {
            eprintln!("skipped: no cgroup hierarchy: {e}");
            return None;
        }
    };
    let root = h.cgroup(&format!("/trellis-test-{name}-{}", std::process::id()));
    Some((h, TestRoot(root)))
}

#[test]
fn real_hierarchy_limits_measures_and_removes() {
    let Some((_h, root)) = real_root("unit") else {
        return;
    };
    let cg = root.0.child("c1");
    cg.create().expect("create");
    assert!(cg.exists());
    cg.set(&Resources {
        cpu_shares: Some(512),
        cpu_quota: Some(20_000),
        cpu_period: Some(100_000),
        memory_limit: Some(64 << 20),
        pids_limit: Some(10),
    })
    .expect("set");
    let mut child = std::process::Command::new("/bin/sleep")
        .arg("30")
        .spawn()
        .expect("spawn sleep");
    cg.add_process(child.id()).expect("add");
    assert_eq!(cg.pids().expect("pids"), vec![child.id()]);
    let stats = cg.stats().expect("stats");
    assert_eq!(stats.pids, 1);
    // (A process that joins does not bring its memory's charge on v1: no usage to assert.)
    assert_eq!(stats.oom_kills, 0);
    // Populated: the kernel refuses.
    assert!(root.0.remove().is_err());
    assert_eq!(cg.kill_all().expect("kill"), 1);
    child.wait().expect("wait");
    root.0.remove().expect("remove");
    assert!(!cg.exists());
    assert!(!root.0.exists());
}

#[test]
fn real_hierarchy_counts_oom_kills_at_the_memory_limit() {
    let Some((_h, root)) = real_root("oom") else {
        return;
    };
    let cg = root.0.child("hog");
    cg.create().expect("create");
    cg.set(&Resources {
        memory_limit: Some(16 << 20),
        ..Default::default()
    })
    .expect("set");
    // It waits until its memory controller is the cgroup's (on v1 the controllers are
    // joined one after the other: another may show the path first), then `tail`
    // keeps 64 MiB with no newline.
    let mut child = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(
            "until grep -q ':memory:.*trellis-test-oom' /proc/$$/cgroup \
               || { ! grep -q ':memory:' /proc/$$/cgroup \
                    && grep -q '^0::.*trellis-test-oom' /proc/$$/cgroup; }; do :; done; \
             head -c 67108864 /dev/zero | tail",
        )
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn sh");
    cg.add_process(child.id()).expect("add");
    let status = child.wait().expect("wait");
    assert_eq!(status.code(), Some(137), "{status:?}");
    assert_eq!(cg.stats().expect("stats").oom_kills, 1);
}
