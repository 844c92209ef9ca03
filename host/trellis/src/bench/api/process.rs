//! `trellis bench api --server-process`: the server under test in a child process, so
//! that its memory is its own and can be read from `/proc`, and its CPU time is not
//! mixed with the clients'.
//!
//! The child is this same binary (or the one `--server-exe` names) running `trellis
//! server` on a temporary data directory and a free loopback port; the clients use the
//! admin token from its token file, as the in-process mode does. It is killed when the run ends: its data
//! directory is thrown away, so there is nothing to flush.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use hyper::{Method, StatusCode};
use serde::Serialize;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::rest::{Credentials, Target, exchange};

/// How long the child may take to answer `/readyz`: it starts in well under a second
/// on an empty store; this bound only catches one that never will.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// The server's memory, from `/proc/PID/status`.
#[derive(Clone, Copy, Debug, Serialize)]
pub(super) struct Memory {
    /// Resident set size now (`VmRSS`), MiB.
    pub rss_mib: f64,
    /// The largest resident set size so far (`VmHWM`), MiB.
    pub peak_rss_mib: f64,
}

#[derive(Debug)]
pub(super) struct ChildServer {
    child: Child,
    pid: u32,
    pub target: Target,
    log: PathBuf,
    // Removed last: the child's store and credentials live in it.
    _dir: tempfile::TempDir,
}

impl ChildServer {
    /// Starts `exe server`, or this program's when `exe` is `None`.
    pub async fn start(exe: Option<&Path>, http2: bool) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("trellis-bench-")
            .tempdir()
            .context("create a temporary data directory")?;
        let addr = free_loopback_addr()?;
        let exe = match exe {
            Some(exe) => exe.to_path_buf(),
            None => std::env::current_exe().context("find this program's path")?,
        };
        let log = dir.path().join("server.log");
        let log_file = std::fs::File::create(&log)
            .with_context(|| format!("create the server log {}", log.display()))?;
        let mut child = Command::new(&exe)
            .arg("server")
            .arg("--data-dir")
            .arg(dir.path())
            .arg("--listen")
            .arg(&addr)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {} server", exe.display()))?;
        let pid = child.id().context("read the server's process id")?;
        let target = match wait_ready(&mut child, dir.path(), &addr, http2, &log).await {
            Ok(target) => target,
            Err(e) => {
                let _ = child.kill().await;
                return Err(e);
            }
        };
        tracing::info!(pid, %addr, "started an API server in a child process");
        Ok(Self {
            child,
            pid,
            target,
            log,
            _dir: dir,
        })
    }

    /// The server's memory now; fails if it has exited.
    pub fn memory(&mut self) -> anyhow::Result<Memory> {
        if let Some(status) = self.child.try_wait().context("check the server process")? {
            bail!("the server exited ({status}): {}", log_tail(&self.log));
        }
        let path = format!("/proc/{}/status", self.pid);
        let status = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
        parse_memory(&status).with_context(|| format!("find VmRSS and VmHWM in {path}"))
    }

    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.child.kill().await.context("stop the server process")
    }
}

/// A loopback address with a port that was free a moment ago.
fn free_loopback_addr() -> anyhow::Result<String> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").context("find a free loopback port")?;
    Ok(listener.local_addr()?.to_string())
}

/// Waits until the child answers `/readyz`, and returns how to reach it.
async fn wait_ready(
    child: &mut Child,
    dir: &Path,
    addr: &str,
    http2: bool,
    log: &Path,
) -> anyhow::Result<Target> {
    let deadline = Instant::now() + READY_WITHIN;
    let ca = dir.join("pki").join("ca.crt");
    let tokens = dir.join("tokens.csv");
    let mut last_error = String::from("no credentials yet");
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().context("check the server process")? {
            bail!("the server exited ({status}): {}", log_tail(log));
        }
        if let (Ok(ca_pem), Ok(token_file)) = (
            std::fs::read_to_string(&ca),
            std::fs::read_to_string(&tokens),
        ) && let Some(token) = admin_token(&token_file)
        {
            let target = Target::new(
                &format!("https://{addr}"),
                &ca_pem,
                Credentials::Token(token),
                http2,
            )?;
            match exchange(&target, Method::GET, "/readyz", Vec::new()).await {
                Ok((StatusCode::OK, _)) => return Ok(target),
                Ok((status, _)) => last_error = format!("/readyz answered {status}"),
                Err(e) => last_error = format!("{e:#}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!(
        "the server was not ready within {READY_WITHIN:?} ({last_error}): {}",
        log_tail(log)
    )
}

/// The admin's token: the first field of the token file's `admin` line.
fn admin_token(file: &str) -> Option<String> {
    file.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split(',').collect::<Vec<_>>())
        .find(|fields| fields.get(1) == Some(&"admin"))
        .map(|fields| fields[0].trim().to_owned())
        .filter(|t| !t.is_empty())
}

/// `VmRSS` and `VmHWM` of a `/proc/PID/status` text.
fn parse_memory(status: &str) -> Option<Memory> {
    let kib = |field: &str| -> Option<f64> {
        let line = status.lines().find(|l| l.starts_with(field))?;
        let value = line[field.len()..].trim().strip_suffix("kB")?.trim();
        value.parse::<u64>().ok().map(|k| k as f64)
    };
    let mib = |k: f64| (k / 1024.0 * 10.0).round() / 10.0;
    Some(Memory {
        rss_mib: mib(kib("VmRSS:")?),
        peak_rss_mib: mib(kib("VmHWM:")?),
    })
}

/// The last lines of the server's log, for an error message.
fn log_tail(log: &Path) -> String {
    const LINES: usize = 10;
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(LINES)..].join("\n");
    if tail.is_empty() {
        format!("its log {} is empty", log.display())
    } else {
        format!("the end of its log:\n{tail}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_comes_from_vmrss_and_vmhwm() {
        let status = "Name:\ttrellis\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\nThreads:\t4\n";
        let m = parse_memory(status).unwrap();
        assert_eq!(m.rss_mib, 100.0);
        assert_eq!(m.peak_rss_mib, 200.0);
        assert!(parse_memory("Name:\ttrellis\n").is_none());
    }

    #[test]
    fn the_admin_token_is_the_admin_lines_first_field() {
        let file = "# Static tokens: token,user,uid,\"group1,group2\"\n\
                    abc123,admin,admin,\"system:masters\"\n";
        assert_eq!(admin_token(file).as_deref(), Some("abc123"));
        assert_eq!(admin_token("# only a comment\n"), None);
    }
}
