//! A container's record: its config, the image and program it runs, and its state
//! from `CreateContainer` to its exit, as CRI reports it.

use std::path::PathBuf;

use k8s_cri::v1::{ContainerConfig, ContainerResources, ContainerState, ContainerStatus};
use serde::{Deserialize, Serialize};

use super::image::ImageKind;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct ContainerRecord {
    pub id: String,
    pub sandbox_id: String,
    pub config: ContainerConfig,
    pub image_id: String,
    pub kind: ImageKind,
    /// The runtime handler that runs it (its sandbox's); records of earlier versions
    /// have none and are run by their kind's.
    #[serde(default)]
    pub handler: String,
    /// The component file or the executable the container runs.
    pub program: PathBuf,
    /// `None` when the sandbox and container name no log: output is dropped.
    pub log_path: Option<PathBuf>,
    /// A `ContainerState`.
    pub state: i32,
    pub created_at: i64,
    pub started_at: i64,
    pub finished_at: i64,
    pub exit_code: i32,
    pub reason: String,
    pub message: String,
    /// A process container's pid and its start time (in clock ticks after boot, as
    /// /proc reports it), which tell it from a later process given the same pid.
    pub pid: Option<i32>,
    pub pid_start: Option<u64>,
    /// Its sandbox's network namespace, which its process starts in; none on the
    /// node's network.
    #[serde(default)]
    pub netns: Option<PathBuf>,
}

impl ContainerRecord {
    /// The name of the runtime handler that runs it.
    pub(crate) fn handler(&self) -> &str {
        match self.handler.as_str() {
            "" => self.kind.handler(),
            name => name,
        }
    }

    /// The record as CRI reports it.
    pub(crate) fn status(&self) -> ContainerStatus {
        let r = self;
        ContainerStatus {
            id: r.id.clone(),
            metadata: r.config.metadata.clone(),
            state: r.state,
            created_at: r.created_at,
            started_at: r.started_at,
            finished_at: r.finished_at,
            exit_code: r.exit_code,
            image: r.config.image.clone(),
            image_ref: r.image_id.clone(),
            reason: r.reason.clone(),
            message: r.message.clone(),
            labels: r.config.labels.clone(),
            annotations: r.config.annotations.clone(),
            mounts: r.config.mounts.clone(),
            log_path: r
                .log_path
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            resources: r
                .config
                .linux
                .as_ref()
                .and_then(|l| l.resources.clone())
                .map(|linux| ContainerResources {
                    linux: Some(linux),
                    windows: None,
                }),
            image_id: r.image_id.clone(),
            user: None,
        }
    }
}

/// The CRI name of a `ContainerState`.
pub(crate) fn state_name(state: i32) -> &'static str {
    ContainerState::try_from(state)
        .map(|s| s.as_str_name())
        .unwrap_or("CONTAINER_UNKNOWN")
}
