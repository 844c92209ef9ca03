//! A pod sandbox's record: the config `RunPodSandbox` gave, the handler its
//! containers run with, and its network namespace and IPs when it has its own.

use std::net::IpAddr;
use std::path::PathBuf;

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
    /// The pin of its network namespace; none on the node's network.
    #[serde(default)]
    pub netns: Option<PathBuf>,
    /// Its IPs, from CNI; none on the node's network.
    #[serde(default)]
    pub ips: Vec<IpAddr>,
}
