//! Containers' cgroups, as containerd's cgroupfs driver makes them: a `process`
//! container's is `<cgroup_parent>/<container id>`, under the cgroup the agent made for
//! its pod (`LinuxPodSandboxConfig.cgroup_parent`), or under `/trellis/<sandbox id>`
//! when the agent names none. The runtime creates it with the container's
//! `LinuxContainerResources` before the process starts (the process joins it before
//! it runs its program), changes it on `UpdateContainerResources`, reads its usage for
//! the CRI stats and its OOM kills when the process ends, and removes it with the
//! container. A runtime without cgroups (not root, or none mounted) runs containers
//! without limits.

use std::sync::OnceLock;

use k8s_cri::v1::LinuxContainerResources;
use tonic::Status;
use trellis_cgroups::{Cgroup, Hierarchy, Resources};

use crate::record::SandboxRecord;

/// Where a sandbox's containers' cgroups go when the agent names no pod cgroup.
const DEFAULT_PARENT: &str = "/trellis";

/// The machine's cgroup hierarchy, when this process may make cgroups in it.
pub(crate) fn hierarchy() -> Option<&'static Hierarchy> {
    static HIERARCHY: OnceLock<Option<Hierarchy>> = OnceLock::new();
    HIERARCHY
        .get_or_init(|| {
            if !rustix::process::geteuid().is_root() {
                tracing::info!("not root: containers run without cgroups (no limits, no stats)");
                return None;
            }
            match Hierarchy::detect() {
                Ok(h) => {
                    tracing::info!(version = ?h.version(), "cgroup hierarchy");
                    Some(h)
                }
                Err(e) => {
                    tracing::warn!("no cgroup hierarchy: containers run without limits: {e}");
                    None
                }
            }
        })
        .as_ref()
}

/// The cgroup a sandbox's containers' cgroups go under: the pod cgroup the agent made,
/// or one of the runtime's own ([`default_parent`]).
pub(crate) fn sandbox_parent(sandbox: &SandboxRecord) -> String {
    let parent = sandbox
        .config
        .linux
        .as_ref()
        .map(|l| l.cgroup_parent.trim_end_matches('/'))
        .unwrap_or_default();
    match parent {
        "" => default_parent(&sandbox.id),
        parent => parent.to_owned(),
    }
}

/// The runtime's own cgroup for sandbox `sandbox_id`, when the agent names none.
pub(crate) fn default_parent(sandbox_id: &str) -> String {
    format!("{DEFAULT_PARENT}/{sandbox_id}")
}

/// Whether the runtime made sandbox's parent cgroup (and so removes it with the sandbox).
pub(crate) fn owns_parent(sandbox: &SandboxRecord) -> bool {
    sandbox
        .config
        .linux
        .as_ref()
        .is_none_or(|l| l.cgroup_parent.trim_matches('/').is_empty())
}

/// Creates the cgroup `<sandbox_cgroup_parent>/<container_id>` with `resources`
/// applied (again: it is idempotent); `None` when the runtime has no cgroups. The
/// parent is `State::cgroup_parent(sandbox id)`, which names the runtime's own
/// cgroup for the sandbox when the agent gave none.
pub(crate) fn for_container(
    sandbox_cgroup_parent: &str,
    container_id: &str,
    resources: Option<&LinuxContainerResources>,
) -> Result<Option<Cgroup>, Status> {
    let Some(hierarchy) = hierarchy() else {
        return Ok(None);
    };
    let parent = match sandbox_cgroup_parent.trim_end_matches('/') {
        "" => DEFAULT_PARENT,
        parent => parent,
    };
    let cgroup = hierarchy.cgroup(&format!("{parent}/{container_id}"));
    let failed = |what: &str, e: std::io::Error| {
        Status::internal(format!(
            "container {container_id}: cannot {what} its cgroup {}: {e}",
            cgroup.path()
        ))
    };
    cgroup.create().map_err(|e| failed("create", e))?;
    if let Some(resources) = resources
        && let Err(e) = cgroup.set(&limits(resources))
    {
        let _ = cgroup.remove();
        return Err(failed("limit", e));
    }
    Ok(Some(cgroup))
}

/// The cgroup of container `container_id` under `parent`, if the runtime has
/// cgroups and it is there.
pub(crate) fn container(parent: &str, container_id: &str) -> Option<Cgroup> {
    let cgroup = hierarchy()?.cgroup(&format!("{parent}/{container_id}"));
    cgroup.exists().then_some(cgroup)
}

/// The cgroup sandbox's containers go under, if it is there.
pub(crate) fn of_sandbox(sandbox: &SandboxRecord) -> Option<Cgroup> {
    let cgroup = hierarchy()?.cgroup(&sandbox_parent(sandbox));
    cgroup.exists().then_some(cgroup)
}

/// Kills what is left in `cgroup` (processes the container's own left behind) and
/// removes it; a failure is logged: a leftover cgroup harms nothing but its name.
pub(crate) fn remove(cgroup: &Cgroup) {
    let killed = cgroup.kill_all().unwrap_or(0);
    if killed > 0 {
        tracing::info!(cgroup = %cgroup.path(), killed, "killed processes left in a cgroup");
    }
    if killed == 0 && cgroup.remove().is_ok() {
        return;
    }
    // The killed are still exiting: the cgroup is theirs until they are gone.
    let cgroup = cgroup.clone();
    let remove = move || {
        if let Err(e) = cgroup.kill_and_remove(REMOVE_WAIT) {
            tracing::warn!(cgroup = %cgroup.path(), "failed to remove a cgroup: {e}");
        }
    };
    match tokio::runtime::Handle::try_current() {
        Ok(tokio) => drop(tokio.spawn_blocking(remove)),
        Err(_) => remove(),
    }
}

/// How long a cgroup whose processes were just killed may take to be removable: a
/// killed process leaves its cgroup within milliseconds.
const REMOVE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// CRI's resources as the cgroup's limits: CRI's 0 is "not set", kept as it is.
pub(crate) fn limits(r: &LinuxContainerResources) -> Resources {
    let positive = |v: i64| (v > 0).then_some(v);
    Resources {
        cpu_shares: positive(r.cpu_shares).and_then(|v| u64::try_from(v).ok()),
        cpu_quota: positive(r.cpu_quota),
        cpu_period: positive(r.cpu_period).and_then(|v| u64::try_from(v).ok()),
        memory_limit: positive(r.memory_limit_in_bytes),
        pids_limit: None,
    }
}

/// Writes `adj` as the OOM score adjustment of process `pid` (the kubelet's by QoS
/// class: -997 Guaranteed, 1000 BestEffort, between for Burstable).
pub(crate) fn set_oom_score_adj(pid: i32, adj: i64) {
    if let Err(e) = std::fs::write(format!("/proc/{pid}/oom_score_adj"), adj.to_string()) {
        tracing::warn!(pid, adj, "failed to set the OOM score adjustment: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cri_zero_is_unset() {
        let r = limits(&LinuxContainerResources {
            cpu_shares: 102,
            cpu_quota: 20_000,
            cpu_period: 100_000,
            memory_limit_in_bytes: 0,
            ..Default::default()
        });
        assert_eq!(
            r,
            Resources {
                cpu_shares: Some(102),
                cpu_quota: Some(20_000),
                cpu_period: Some(100_000),
                memory_limit: None,
                pids_limit: None,
            }
        );
    }
}
