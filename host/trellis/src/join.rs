//! `trellis node`'s flags for joining a cluster with a bootstrap token (kubeadm's
//! `join`); the TLS bootstrap itself, and the rotation of the node's certificate after
//! it, are the node agent's: [`trellis_agent::bootstrap`].

use std::path::Path;
use trellis_api::Shutdown;

use clap::Args;
use trellis_agent::bootstrap::BootstrapConfig;

/// The flags of `trellis node` that join with a bootstrap token.
#[derive(Clone, Debug, Args)]
pub struct JoinFlags {
    /// The API server to join, `https://HOST:PORT`.
    #[arg(long, value_name = "URL", requires_all = ["token", "discovery_token_ca_cert_hash"])]
    pub server: Option<String>,

    /// A bootstrap token, `ID.SECRET` (`trellis token create` prints one).
    #[arg(long, value_name = "ID.SECRET")]
    pub token: Option<String>,

    /// The cluster CA's public key hash, `sha256:HEX`: the server is trusted only if
    /// it presents that CA.
    #[arg(long, value_name = "sha256:HEX")]
    pub discovery_token_ca_cert_hash: Option<String>,

    /// The lifetime asked for the node's certificate, in seconds (at least 600); the
    /// signer's default without it.
    #[arg(long, value_name = "SECONDS")]
    pub node_cert_duration: Option<u64>,
}

impl JoinFlags {
    /// What the node agent's TLS bootstrap needs of the flags.
    pub fn bootstrap(&self) -> BootstrapConfig {
        BootstrapConfig {
            server: self.server.clone(),
            token: self.token.clone(),
            discovery_token_ca_cert_hash: self.discovery_token_ca_cert_hash.clone(),
            cert_duration: self.node_cert_duration,
        }
    }
}

/// A joined node's client and the cluster CA (PEM): the credentials of an earlier join,
/// or new ones from a TLS bootstrap with the flags' token; its certificate rotated
/// before it expires until `stopped`.
pub async fn joined_client(
    flags: &JoinFlags,
    data_dir: &Path,
    node_name: &str,
    stopped: Shutdown,
) -> anyhow::Result<(kube::Client, String)> {
    trellis_agent::bootstrap::joined_client(&flags.bootstrap(), data_dir, node_name, stopped).await
}
