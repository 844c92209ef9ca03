//! A pod sandbox's record: the config `RunPodSandbox` gave, the handler its
//! containers run with, its network namespace and IPs when it has its own, its UTS
//! and IPC namespaces and the directory of its /etc files.

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
    /// The pins of its UTS and IPC namespaces; none where it shares the node's.
    #[serde(default)]
    pub uts: Option<PathBuf>,
    #[serde(default)]
    pub ipc: Option<PathBuf>,
    /// The directory of its `hostname`, `resolv.conf` and `hosts` (`pod_files`); none
    /// for a runtime that keeps no files.
    #[serde(default)]
    pub files: Option<PathBuf>,
}
