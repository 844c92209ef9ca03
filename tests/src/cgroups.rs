//! A cgroup root of a test's own (`/trellis-test-<random>`), under which its node
//! makes `kubepods` and the pods' cgroups: tests do not share the machine's
//! `/kubepods`, and what a test leaves is removed, also when it fails.

use trellis_agent::AgentConfig;
use trellis_cgroups::{Cgroup, Hierarchy};

/// A cgroup made for one test, removed (with anything still in it killed) when
/// dropped.
#[derive(Debug)]
pub struct TestCgroupRoot {
    hierarchy: Hierarchy,
    path: String,
}

impl TestCgroupRoot {
    /// A new cgroup `/trellis-test-<random>`; `Err` says why there can be none here
    /// (no cgroups mounted, not root), for a test to skip with.
    pub fn new() -> Result<Self, String> {
        if !rustix::process::geteuid().is_root() {
            return Err("making cgroups needs root".into());
        }
        let hierarchy = Hierarchy::detect().map_err(|e| format!("no cgroups here: {e}"))?;
        let path = format!("/trellis-test-{:016x}", rand::random::<u64>());
        hierarchy
            .cgroup(&path)
            .create()
            .map_err(|e| format!("cannot make cgroup {path}: {e}"))?;
        Ok(Self { hierarchy, path })
    }

    /// Its path from the hierarchy's root, as `--cgroup-root` takes it.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The cgroup at `relative` below it (`kubepods/burstable/pod<uid>`).
    pub fn cgroup(&self, relative: &str) -> Cgroup {
        self.hierarchy.cgroup(&format!(
            "{}/{}",
            self.path,
            relative.trim_start_matches('/')
        ))
    }

    pub fn hierarchy(&self) -> &Hierarchy {
        &self.hierarchy
    }

    /// Gives `config`'s node pod cgroups per QoS class under this root.
    pub fn configure(&self, config: &mut AgentConfig) {
        config.cgroups_per_qos = true;
        config.cgroup_root = self.path.clone();
    }
}

impl Drop for TestCgroupRoot {
    fn drop(&mut self) {
        let root = self.hierarchy.cgroup(&self.path);
        if let Err(e) = root.kill_and_remove(std::time::Duration::from_secs(2)) {
            eprintln!("cannot remove the test's cgroup {}: {e}", self.path);
        }
        // runc (containerd's) also makes its containers' cgroups in the hierarchies
        // that have no controller (`name=systemd`, a v2 mount beside v1): removed too,
        // deepest first.
        for mount in cgroup_mounts() {
            let dir = mount.join(self.path.trim_start_matches('/'));
            if dir.is_dir() {
                remove_tree(&dir);
            }
        }
    }
}

/// Where cgroup hierarchies (v1 and v2) are mounted.
fn cgroup_mounts() -> Vec<std::path::PathBuf> {
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut fields = l.split(' ');
            let (_, point, kind) = (fields.next()?, fields.next()?, fields.next()?);
            matches!(kind, "cgroup" | "cgroup2").then(|| point.into())
        })
        .collect()
}

fn remove_tree(dir: &std::path::Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_tree(&entry.path());
        }
    }
    if let Err(e) = std::fs::remove_dir(dir) {
        eprintln!("cannot remove cgroup {}: {e}", dir.display());
    }
}

/// Removes the cgroups a runtime whose records lie under `dir` made for its sandboxes
/// without a `cgroup_parent` (`/trellis/<sandbox id>`, what CRI clients other than
/// the agent get), killing what is left in them: a test that drops its runtime with
/// sandboxes still there, as a crash would, leaves them otherwise.
pub fn remove_runtime_cgroups(dir: &std::path::Path) {
    let mut ids = Vec::new();
    sandbox_ids(dir, 4, &mut ids);
    if ids.is_empty() {
        return;
    }
    let Ok(hierarchy) = Hierarchy::detect() else {
        return;
    };
    for id in &ids {
        let cgroup = hierarchy.cgroup(&format!("/trellis/{id}"));
        if cgroup.exists()
            && let Err(e) = cgroup.kill_and_remove(std::time::Duration::from_secs(2))
        {
            eprintln!("cannot remove cgroup {}: {e}", cgroup.path());
        }
    }
}

/// The ids of the sandbox records (`sandboxes/<id>.json`) at most `depth` levels
/// below `dir`.
fn sandbox_ids(dir: &std::path::Path, depth: usize, ids: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let path = entry.path();
        if entry.file_name() == "sandboxes" {
            for record in std::fs::read_dir(&path).into_iter().flatten().flatten() {
                let name = record.file_name();
                if let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".json")) {
                    ids.push(id.to_owned());
                }
            }
        } else if depth > 0 {
            sandbox_ids(&path, depth - 1, ids);
        }
    }
}
