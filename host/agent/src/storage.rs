//! The node's part of local-path volumes (the bundled provisioner's, as k3s' local-path
//! provisioner keeps them): the Node tells the provisioner where they live (the
//! [`ROOT_ANNOTATION`], `<root>/storage`), a pod that mounts one makes its directory
//! (`spec::volumes`), and a volume's directory goes once its PersistentVolume is
//! deleted (its claim gone, reclaim policy Delete) — also the directories of volumes
//! deleted while the agent was down, found on its first list.
//!
//! Only directories directly under `<root>/storage` named after a PersistentVolume
//! provisioned by the local-path provisioner are ever removed: a static volume's
//! directory is its administrator's.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, PersistentVolume};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt as _, watcher as watch};
use serde_json::json;
use tracing::{info, warn};
use trellis_api::Shutdown;

use crate::Context;

/// The Node annotation that tells the provisioner where this node's volumes live.
pub const ROOT_ANNOTATION: &str = "trellis.dev/local-path-root";
/// The provisioner whose volumes are this node's directories.
pub const PROVISIONER: &str = "trellis.dev/local-path";

/// Where this node keeps its local-path volumes.
pub fn storage_dir(ctx: &Context) -> PathBuf {
    ctx.config.root.join("storage")
}

/// Runs until `stopped`: tells the Node where its volumes live, then removes the
/// directories of deleted volumes.
pub async fn run(ctx: Arc<Context>, stopped: Shutdown) {
    let dir = storage_dir(&ctx);
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let patch = json!({"metadata": {"annotations": {ROOT_ANNOTATION: dir.display().to_string()}}});
    if let Err(e) = nodes
        .patch(
            &ctx.config.node_name,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        warn!(error = %e, "tell the node's local-path root");
    }
    let volumes: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let mut events = watch(volumes, watcher::Config::default())
        .default_backoff()
        .boxed();
    // The names listed since the last (re)list began: what exists.
    let mut listed: HashSet<String> = HashSet::new();
    loop {
        let event = tokio::select! {
            event = events.next() => event,
            _ = stopped.wait() => return,
        };
        match event {
            Some(Ok(Event::Init)) => listed.clear(),
            Some(Ok(Event::InitApply(v))) => {
                listed.insert(v.metadata.name.clone().unwrap_or_default());
            }
            Some(Ok(Event::InitDone)) => remove_unlisted(&dir, &listed),
            Some(Ok(Event::Apply(_))) => {}
            Some(Ok(Event::Delete(v))) => {
                if let Some(path) = directory_of(&dir, &v) {
                    remove(&path);
                }
            }
            Some(Err(e)) => warn!(error = %e, "watch persistent volumes for their removal"),
            None => return,
        }
    }
}

/// The directory of a deleted local-path volume, when it is one of this node's.
pub fn directory_of(dir: &Path, volume: &PersistentVolume) -> Option<PathBuf> {
    let provisioned = volume
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("pv.kubernetes.io/provisioned-by"))
        .is_some_and(|p| p == PROVISIONER);
    let name = volume.metadata.name.as_deref()?;
    let path = PathBuf::from(&volume.spec.as_ref()?.host_path.as_ref()?.path);
    (provisioned && path == dir.join(name)).then_some(path)
}

/// Removes the volume directories (`pvc-*`) no listed volume names.
fn remove_unlisted(dir: &Path, listed: &HashSet<String>) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("pvc-") && !listed.contains(&name) && entry.path().is_dir() {
            remove(&entry.path());
        }
    }
}

fn remove(path: &Path) {
    match std::fs::remove_dir_all(path) {
        Ok(()) => info!(path = %path.display(), "removed a deleted volume's directory"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => warn!(path = %path.display(), error = %e, "remove a deleted volume's directory"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_local_path_volume_of_this_node_names_a_directory_to_remove() {
        let dir = Path::new("/data/storage");
        let volume = |name: &str, path: &str, by: &str| -> PersistentVolume {
            serde_json::from_value(json!({
                "metadata": {"name": name, "annotations": {"pv.kubernetes.io/provisioned-by": by}},
                "spec": {"hostPath": {"path": path}},
            }))
            .unwrap()
        };
        assert_eq!(
            directory_of(dir, &volume("pvc-1", "/data/storage/pvc-1", PROVISIONER)),
            Some(PathBuf::from("/data/storage/pvc-1"))
        );
        assert_eq!(
            directory_of(dir, &volume("pvc-1", "/elsewhere/pvc-1", PROVISIONER)),
            None
        );
        assert_eq!(
            directory_of(dir, &volume("pvc-1", "/data/storage/pvc-1", "someone/else")),
            None
        );
    }
}
