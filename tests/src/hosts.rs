//! Test hosts: machines of a multi-node test, each a network namespace of its own on
//! this machine, joined by a bridge the test makes in the root namespace (a LAN).
//!
//! A host's software runs on a Tokio runtime of the host's own whose every thread
//! (workers and blocking pool) enters the host's namespace as it starts, so sockets,
//! netlink, `/proc/sys/net`, and the processes it spawns (CNI plugins, `nft`, pods'
//! programs) are the host's, as on a machine of its own, while the test process keeps
//! one API server all hosts share. Nothing forks: `ip` is run from the test's threads,
//! which stay in the root namespace.
//!
//! [`Lan`]'s `Drop` removes what the test made (namespaces, veths, the bridge) also when
//! the test fails.

use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

/// A bridge in the root namespace, `prefix.1/24`, and the hosts on it.
#[derive(Debug)]
pub struct Lan {
    pub bridge: String,
    /// The first three octets of the LAN's /24 (`10.244.80`).
    pub prefix: String,
    namespaces: Vec<String>,
}

/// One host: its namespace (`ip netns` name) and address on the LAN.
#[derive(Clone, Debug)]
pub struct Host {
    pub name: String,
    pub ip: std::net::IpAddr,
}

/// Runs `ip` with `args`; its error output on a failure.
pub fn ip(args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("ip").args(args).output().context("run ip")?;
    if !output.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

impl Lan {
    /// Makes `bridge` with `prefix.1/24` (any left by an earlier run removed first).
    pub fn new(bridge: &str, prefix: &str) -> anyhow::Result<Self> {
        let _ = ip(&["link", "del", bridge]);
        let lan = Self {
            bridge: bridge.into(),
            prefix: prefix.into(),
            namespaces: Vec::new(),
        };
        ip(&["link", "add", bridge, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{prefix}.1/24"), "dev", bridge])?;
        ip(&["link", "set", bridge, "up"])?;
        Ok(lan)
    }

    /// A host named `name` (also its namespace's) at `prefix.index`, its `eth0` a veth
    /// whose other end is on the bridge.
    pub fn host(&mut self, name: &str, index: u8) -> anyhow::Result<Host> {
        let _ = ip(&["netns", "del", name]);
        ip(&["netns", "add", name])?;
        self.namespaces.push(name.into());
        // The root end's name is at most 15 bytes.
        let outside = format!("v{}", &name[..name.len().min(14)]);
        let _ = ip(&["link", "del", &outside]);
        ip(&[
            "link", "add", &outside, "type", "veth", "peer", "name", "eth0", "netns", name,
        ])?;
        ip(&["link", "set", &outside, "master", &self.bridge, "up"])?;
        let address = format!("{}.{index}", self.prefix);
        ip(&[
            "-n",
            name,
            "addr",
            "add",
            &format!("{address}/24"),
            "dev",
            "eth0",
        ])?;
        ip(&["-n", name, "link", "set", "eth0", "up"])?;
        ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(Host {
            name: name.into(),
            ip: address.parse()?,
        })
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        // A namespace's links (its veth end, bridges, VXLAN devices) go with it, and
        // nftables tables and routes with them.
        for name in &self.namespaces {
            let _ = ip(&["netns", "del", name]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

impl Host {
    /// The namespace's pin, as `ip netns` makes it.
    pub fn netns(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// A Tokio runtime whose threads all run in this host's network namespace.
    pub fn runtime(&self) -> anyhow::Result<tokio::runtime::Runtime> {
        let ns = std::sync::Arc::new(
            std::fs::File::open(self.netns())
                .with_context(|| format!("open {}", self.netns().display()))?,
        );
        let name = self.name.clone();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(format!("host-{name}"))
            .enable_all()
            .on_thread_start(move || {
                // No thread of the host may run outside it: a failure here is the
                // test's set-up failing.
                if let Err(e) = rustix::thread::move_into_link_name_space(
                    ns.as_fd(),
                    Some(rustix::thread::LinkNameSpaceType::Network),
                ) {
                    panic!("enter the network namespace of host {name}: {e}");
                }
            })
            .build()
            .context("build the host's runtime")
    }

    /// `ip` run in this host's namespace.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        ip(&all)
    }
}

/// Unpins the namespaces pinned under `dir` (a runtime's `netns`, `utsns`, `ipcns`), so
/// that a test's temporary directory can be removed after a failure that left pods
/// behind.
pub fn unpin_all(dir: &Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let _ = rustix::mount::unmount(entry.path(), rustix::mount::UnmountFlags::DETACH);
    }
}

/// The body of an HTTP GET of `path` at `ip:port` when it answers 200, asked from the
/// calling thread's network namespace (run it on a host's runtime); an error after
/// `timeout`.
pub async fn http_get(
    ip: std::net::IpAddr,
    port: u16,
    path: &str,
    timeout: std::time::Duration,
) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let attempt = async {
        let mut tcp = tokio::net::TcpStream::connect((ip, port)).await?;
        tcp.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {ip}:{port}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
        let mut reply = Vec::new();
        tcp.read_to_end(&mut reply).await?;
        let reply = String::from_utf8_lossy(&reply).into_owned();
        let (head, body) = reply
            .split_once("\r\n\r\n")
            .context("no end of the headers")?;
        if !head.starts_with("HTTP/1.") || !head.lines().next().unwrap_or("").contains(" 200 ") {
            bail!("GET {path} from {ip}:{port}: {head}");
        }
        anyhow::Ok(body.to_owned())
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .with_context(|| format!("GET {path} from {ip}:{port} within {timeout:?}"))?
}
