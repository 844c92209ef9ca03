//! A pod sandbox's record: the config `RunPodSandbox` gave and the handler its
//! containers run with.

use k8s_cri::v1::PodSandboxConfig;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct SandboxRecord {
    pub id: String,
    pub config: PodSandboxConfig,
    pub handler: String,
    /// A `PodSandboxState`.
    pub state: i32,
    pub created_at: i64,
}
