//! Garbage collection of what the runtime holds for pods (the kubelet's
//! `podSandboxGC` and `containerGC`, and the clean-up of pods it no longer has that
//! its housekeeping does after the first sync). Once the node's pods are listed:
//! - the sandboxes of pods this node no longer has (deleted while the agent was down,
//!   or bound elsewhere) are stopped and removed with their containers, and so are
//!   the pods' files and logs;
//! - containers whose sandbox is gone are removed;
//! - a live pod's sandboxes that are not ready and not its newest (left by a sandbox
//!   that had to be made again, after a reboot say) are removed, as the kubelet's
//!   evictable sandboxes.
//!
//! A pass runs at each relist and removes at most [`MAX_REMOVALS`] sandboxes and
//! containers: what is left waits for the next pass, so a node that comes back to many
//! deleted pods does not hold its runtime with one long sweep.

use std::collections::{HashMap, HashSet};

use k8s_cri::v1 as cri;
use tracing::{info, warn};

use crate::Context;
use crate::labels::POD_UID;

/// Sandboxes and containers removed by one pass, at most.
pub const MAX_REMOVALS: usize = 32;

/// What a pass sees of the pods: whether pod `uid` is one this node still has (the
/// informer lists it, or its worker has not finished).
pub type Live<'a> = &'a (dyn Fn(&str) -> bool + Sync);

/// One pass over the runtime's `sandboxes` and `containers` (the relist's listing of
/// them); returns how many it removed.
pub async fn collect(
    ctx: &Context,
    live: Live<'_>,
    sandboxes: &[cri::PodSandbox],
    containers: &[cri::Container],
) -> usize {
    let mut runtime = ctx.cri.runtime.clone();
    let plan = plan(sandboxes, containers, live);
    let mut removed = 0;
    for (id, uid) in plan.sandboxes.iter().take(MAX_REMOVALS) {
        if live(uid) {
            info!(sandbox = %id, pod_uid = %uid, "removing an old sandbox of the pod");
        } else {
            info!(sandbox = %id, pod_uid = %uid, "removing the sandbox of a pod that is gone");
        }
        let stopped = runtime
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: id.clone(),
            })
            .await;
        let removal = runtime
            .remove_pod_sandbox(cri::RemovePodSandboxRequest {
                pod_sandbox_id: id.clone(),
            })
            .await;
        if let Err(e) = stopped.and(removal) {
            // Tried again at the next pass.
            warn!(sandbox = %id, error = %e.message(), "remove a sandbox");
        }
        if !live(uid) {
            let _ = std::fs::remove_dir_all(crate::spec::pod_dir(ctx, uid));
        }
        removed += 1;
    }
    for id in plan.containers.iter().take(MAX_REMOVALS - removed) {
        info!(container = %id, "removing a container whose sandbox is gone");
        if let Err(e) = runtime
            .remove_container(cri::RemoveContainerRequest {
                container_id: id.clone(),
            })
            .await
        {
            warn!(container = %id, error = %e.message(), "remove a container");
        }
        removed += 1;
    }
    remove_orphan_files(ctx, live);
    removed
}

/// What a pass removes: sandboxes (id, pod UID), then containers.
#[derive(Debug, Default, PartialEq)]
struct Plan {
    sandboxes: Vec<(String, String)>,
    containers: Vec<String>,
}

/// Which of `sandboxes` and `containers` go: every sandbox of a pod that is not
/// `live`; of a live pod's, those not ready but its newest; containers whose sandbox is
/// not listed. Sandboxes the agent did not make (no pod UID label) are left alone.
fn plan(sandboxes: &[cri::PodSandbox], containers: &[cri::Container], live: Live<'_>) -> Plan {
    let ready = cri::PodSandboxState::SandboxReady as i32;
    let mut newest: HashMap<&str, (i64, &str)> = HashMap::new();
    for sandbox in sandboxes {
        if let Some(uid) = sandbox.labels.get(POD_UID) {
            let entry = newest
                .entry(uid.as_str())
                .or_insert((sandbox.created_at, sandbox.id.as_str()));
            if (sandbox.created_at, sandbox.id.as_str()) > *entry {
                *entry = (sandbox.created_at, sandbox.id.as_str());
            }
        }
    }
    let mut plan = Plan::default();
    for sandbox in sandboxes {
        let Some(uid) = sandbox.labels.get(POD_UID) else {
            continue;
        };
        let old = sandbox.state != ready
            && newest.get(uid.as_str()).map(|&(_, id)| id) != Some(sandbox.id.as_str());
        if !live(uid) || old {
            plan.sandboxes.push((sandbox.id.clone(), uid.clone()));
        }
    }
    let listed: HashSet<&str> = sandboxes.iter().map(|s| s.id.as_str()).collect();
    plan.containers = containers
        .iter()
        .filter(|c| c.labels.contains_key(POD_UID))
        .filter(|c| !listed.contains(c.pod_sandbox_id.as_str()))
        .map(|c| c.id.clone())
        .collect();
    plan
}

/// The files and logs of pods this node no longer has, as the kubelet's housekeeping
/// removes them: a pod's worker removes its own when the pod goes, so what is left is
/// a pod's that went while the agent was down, or whose removal failed.
fn remove_orphan_files(ctx: &Context, live: Live<'_>) {
    let root = &ctx.config.root;
    for (dir, uid_of) in [
        (
            root.join("pods"),
            (|n: &str| Some(n)) as fn(&str) -> Option<&str>,
        ),
        (root.join("logs"), crate::paths::uid_of_pod_logs_dir),
    ] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(uid) = name.to_str().and_then(uid_of) else {
                continue;
            };
            if live(uid) {
                continue;
            }
            let path = entry.path();
            info!(path = %path.display(), pod_uid = %uid, "removing what is left of a pod that is gone");
            if let Err(e) = std::fs::remove_dir_all(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                warn!(path = %path.display(), error = %e, "remove what is left of a pod");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(id: &str, uid: &str, ready: bool, created_at: i64) -> cri::PodSandbox {
        cri::PodSandbox {
            id: id.into(),
            labels: [(POD_UID.to_string(), uid.to_string())].into(),
            state: if ready {
                cri::PodSandboxState::SandboxReady
            } else {
                cri::PodSandboxState::SandboxNotready
            } as i32,
            created_at,
            ..Default::default()
        }
    }

    fn container(id: &str, sandbox: &str) -> cri::Container {
        cri::Container {
            id: id.into(),
            pod_sandbox_id: sandbox.into(),
            labels: [(POD_UID.to_string(), "u".to_string())].into(),
            ..Default::default()
        }
    }

    #[test]
    fn gone_pods_old_sandboxes_and_orphan_containers_go() {
        let sandboxes = [
            // A live pod: an old stopped sandbox, its ready one; another whose only
            // sandbox is stopped (a finished pod), kept.
            sandbox("old", "live", false, 1),
            sandbox("current", "live", true, 2),
            sandbox("finished", "done", false, 1),
            // A pod that is gone: all of its sandboxes, ready or not.
            sandbox("gone-1", "gone", true, 3),
            sandbox("gone-2", "gone", false, 1),
            // Not the agent's.
            cri::PodSandbox {
                id: "foreign".into(),
                ..Default::default()
            },
        ];
        let containers = [
            container("in-current", "current"),
            container("orphan", "removed-meanwhile"),
            cri::Container {
                id: "foreign".into(),
                pod_sandbox_id: "nowhere".into(),
                ..Default::default()
            },
        ];
        let live = |uid: &str| uid != "gone";
        let plan = plan(&sandboxes, &containers, &live);
        assert_eq!(
            plan,
            Plan {
                sandboxes: vec![
                    ("old".into(), "live".into()),
                    ("gone-1".into(), "gone".into()),
                    ("gone-2".into(), "gone".into()),
                ],
                containers: vec!["orphan".into()],
            }
        );
    }
}
