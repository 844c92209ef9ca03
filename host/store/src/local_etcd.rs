//! A throwaway etcd server on loopback, for the conformance tests and the benchmarks.
//!
//! It runs the real `etcd` binary (Debian `etcd-server`; `TRELLIS_ETCD_BIN` overrides
//! the path) with a temporary data directory on free loopback ports, and is killed and
//! removed when dropped.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{Error, EtcdConfig, EtcdStore, Result};

/// A running etcd process and its data directory.
#[derive(Debug)]
pub struct LocalEtcd {
    child: Child,
    endpoint: String,
    _data: tempfile::TempDir,
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn etcd_binary() -> PathBuf {
    std::env::var_os("TRELLIS_ETCD_BIN").map_or_else(|| PathBuf::from("etcd"), PathBuf::from)
}

impl LocalEtcd {
    /// Starts etcd and waits until it serves requests (at most 20 s).
    pub async fn start() -> Result<Self> {
        let start_err = |e: std::io::Error| Error::backend("start local etcd", e);
        let data = tempfile::Builder::new()
            .prefix("trellis-etcd-")
            .tempdir()
            .map_err(start_err)?;
        let (client_port, peer_port) = (
            free_port().map_err(start_err)?,
            free_port().map_err(start_err)?,
        );
        let endpoint = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let binary = etcd_binary();
        let child = Command::new(&binary)
            .arg("--name=trellis-test")
            .arg(format!("--data-dir={}", data.path().join("etcd").display()))
            .arg(format!("--listen-client-urls={endpoint}"))
            .arg(format!("--advertise-client-urls={endpoint}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=trellis-test={peer}"))
            .arg("--log-level=error")
            .arg("--logger=zap")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                Error::backend(
                    "start local etcd",
                    format!(
                        "run {}: {e} (install Debian's etcd-server, or set TRELLIS_ETCD_BIN)",
                        binary.display()
                    ),
                )
            })?;
        let mut etcd = Self {
            child,
            endpoint,
            _data: data,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let mut config = EtcdConfig::new([etcd.endpoint.clone()]);
            config.request_timeout = Duration::from_secs(1);
            match EtcdStore::connect(config).await {
                Ok(_) => return Ok(etcd),
                Err(e) => {
                    if let Ok(Some(status)) = etcd.child.try_wait() {
                        return Err(Error::backend(
                            "start local etcd",
                            format!("etcd exited with {status} before serving"),
                        ));
                    }
                    if tokio::time::Instant::now() > deadline {
                        return Err(e);
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// The client URL, e.g. `http://127.0.0.1:40123`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// A config for an [`EtcdStore`] on this server.
    pub fn config(&self) -> EtcdConfig {
        EtcdConfig::new([self.endpoint.clone()])
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
