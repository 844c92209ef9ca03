//! What a previous run left of the pods' network, put right at start, before the
//! runtime serves (containerd's and CRI-O's sandbox recovery):
//! - a sandbox whose namespace is still pinned is adopted as it is: its namespace, its
//!   interface, its addresses and its cached CNI result stay;
//! - a sandbox whose pin is no longer a namespace (the host rebooted: bind mounts do
//!   not survive) is lost: its CNI state is released, and the runtime reports it not
//!   ready so that the kubelet makes a new one;
//! - what has no sandbox record (the runtime died between CNI ADD and saving the
//!   record: a pin, a cached result or the in-process network's record of an ADD, an
//!   address reserved by host-local) is torn down as a stop would (CNI DEL with the
//!   cached result), then the pin removed, which also ends the namespace's side of the
//!   veth; an address still reserved for an unknown sandbox in the default network's
//!   IPAM directory is freed.
//!
//! Namespaces are known by their device: every namespace file is on `nsfs`, a plain
//! file left where a pin was is not.

use std::collections::{BTreeSet, HashSet};
use std::net::IpAddr;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use super::{CniNetwork, PodNetwork, netns};

/// A sandbox record's network, as recovery reads it.
#[derive(Debug)]
pub(crate) struct Recorded {
    pub id: String,
    /// The pin its record names; none on the node's network.
    pub netns: Option<PathBuf>,
    pub ready: bool,
}

/// What recovery did.
#[derive(Debug, Default)]
pub(crate) struct Recovered {
    /// Ready sandboxes whose namespace is gone: to be reported not ready.
    pub lost: Vec<String>,
    /// Sandboxes without a record whose network was torn down.
    pub released: Vec<String>,
}

impl PodNetwork {
    /// Adopts the namespaces of `sandboxes` that are still there and releases what is
    /// left of the others and of sandboxes no record names. A hollow node's network
    /// has nothing that outlives the runtime.
    pub(crate) async fn recover(&self, sandboxes: &[Recorded]) -> Recovered {
        match self {
            Self::Cni(cni) => cni.recover(sandboxes).await,
            Self::Fake(_) => Recovered::default(),
        }
    }
}

impl CniNetwork {
    async fn recover(&self, sandboxes: &[Recorded]) -> Recovered {
        let mut recovered = Recovered::default();
        for sandbox in sandboxes {
            let Some(pin) = &sandbox.netns else {
                continue;
            };
            let alive = is_namespace(pin);
            if alive && sandbox.ready {
                tracing::debug!(sandbox = %sandbox.id, "adopting the sandbox's network");
                continue;
            }
            if sandbox.ready {
                tracing::info!(sandbox = %sandbox.id, pin = %pin.display(), "the sandbox's network namespace is gone; the sandbox is no longer ready");
                recovered.lost.push(sandbox.id.clone());
            }
            // Not ready: nothing of its network may stay (a stop the runtime died in,
            // or a namespace that did not survive). Already released costs no exec.
            self.release(&sandbox.id, pin).await;
        }
        let known: HashSet<&str> = sandboxes.iter().map(|s| s.id.as_str()).collect();
        let unknown: BTreeSet<String> = self
            .pinned()
            .into_iter()
            .chain(self.cached())
            .chain(self.bridged())
            .filter(|id| !known.contains(id.as_str()))
            .collect();
        for id in unknown {
            tracing::info!(sandbox = %id, "tearing down the network of a sandbox with no record");
            self.release(&id, &netns::pin_path(&self.root, &id)).await;
            recovered.released.push(id);
        }
        self.free_reservations(&known);
        recovered
    }

    /// Tears down what sandbox `id` may have of its network, as `StopPodSandbox` does
    /// (whichever way its ADD went), and its pin at `pin`. The plugins enter a live
    /// namespace, so it is disconnected before its pin goes; a pin that is no longer a
    /// namespace goes first, so that they find no namespace (which DEL allows) rather
    /// than a plain file. A failure is logged and the pin removed all the same: what
    /// is recorded of the ADD stays for the next try.
    async fn release(&self, id: &str, pin: &Path) {
        let unpin = |pin: &Path| {
            if let Err(e) = netns::remove(pin) {
                tracing::warn!(sandbox = %id, pin = %pin.display(), "failed to remove the network namespace: {e}");
            }
        };
        if !is_namespace(pin) {
            unpin(pin);
        }
        if let Err(e) = self.detach(id, pin).await {
            tracing::warn!(sandbox = %id, "failed to release the pod's network: {}", e.message());
            unpin(pin);
        }
    }

    /// The sandboxes with a pin under the root.
    fn pinned(&self) -> Vec<String> {
        names(&self.root.join("netns"))
    }

    /// The sandboxes the in-process default network recorded an ADD for
    /// (`<root>/bridge/<id>.json`); none where the plugins did every ADD.
    fn bridged(&self) -> Vec<String> {
        names(&self.root.join("bridge"))
            .into_iter()
            .filter_map(|name| Some(name.strip_suffix(".json")?.to_string()))
            .collect()
    }

    /// The sandboxes with a cached ADD (`<id>-<ifname>`, naming its sandbox inside);
    /// half-written entries (`.partial`) are removed.
    fn cached(&self) -> Vec<String> {
        let mut ids = Vec::new();
        for name in names(&self.cni.cache_dir) {
            let path = self.cni.cache_dir.join(&name);
            if name.ends_with(".partial") {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let id = std::fs::read(&path)
                .ok()
                .and_then(|text| serde_json::from_slice::<serde_json::Value>(&text).ok())
                .and_then(|entry| Some(entry.get("containerId")?.as_str()?.to_string()));
            match id {
                Some(id) => ids.push(id),
                None => {
                    tracing::warn!(path = %path.display(), "skipping an unreadable CNI cache entry")
                }
            }
        }
        ids
    }

    /// Frees the addresses host-local still holds for sandboxes not in `known`, in the
    /// default network's IPAM directory (`<root>/cni/networks/<network>/<ip>`, whose
    /// first line is the sandbox): what a DEL did not release. Only this directory,
    /// which is the runtime's alone: another network's may be shared with other
    /// runtimes of the node.
    fn free_reservations(&self, known: &HashSet<&str>) {
        let networks = self.root.join("cni").join("networks");
        for network in names(&networks) {
            let dir = networks.join(network);
            for name in names(&dir) {
                if name.parse::<IpAddr>().is_err() {
                    // `lock`, `last_reserved_ip.0`: host-local's own.
                    continue;
                }
                let path = dir.join(&name);
                let Ok(text) = std::fs::read_to_string(&path) else {
                    continue;
                };
                let owner = text.lines().next().unwrap_or_default().trim();
                if known.contains(owner) {
                    continue;
                }
                tracing::info!(address = %name, sandbox = %owner, "freeing an address reserved for a sandbox with no record");
                if let Err(e) = std::fs::remove_file(&path)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    tracing::warn!(path = %path.display(), error = %e, "failed to free an address");
                }
            }
        }
    }
}

/// Whether `path` is a namespace file (a live pin), not a plain file or nothing.
pub(crate) fn is_namespace(path: &Path) -> bool {
    let nsfs = std::fs::metadata("/proc/thread-self/ns/net").map(|m| m.dev());
    let pin = std::fs::metadata(path).map(|m| m.dev());
    matches!((nsfs, pin), (Ok(a), Ok(b)) if a == b)
}

/// The names in `dir`; none when it does not exist.
fn names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pin_is_a_namespace_only_while_mounted() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: network namespaces need root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let pin = netns::pin_path(dir.path(), "s");
        assert!(!is_namespace(&pin), "nothing there");
        netns::create(&pin).unwrap();
        assert!(is_namespace(&pin));
        rustix::mount::unmount(&pin, rustix::mount::UnmountFlags::DETACH).unwrap();
        assert!(pin.exists());
        assert!(!is_namespace(&pin), "the plain file a reboot leaves");
        netns::remove(&pin).unwrap();
    }

    #[tokio::test]
    async fn unknown_reservations_are_freed_and_known_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let network = CniNetwork::open(dir.path(), super::super::CniConfig::default());
        let ipam = dir.path().join("cni/networks/trellis");
        std::fs::create_dir_all(&ipam).unwrap();
        std::fs::write(ipam.join("10.0.0.2"), "kept\r\neth0").unwrap();
        std::fs::write(ipam.join("10.0.0.3"), "gone\r\neth0").unwrap();
        std::fs::write(ipam.join("last_reserved_ip.0"), "10.0.0.3").unwrap();
        std::fs::write(ipam.join("lock"), "").unwrap();
        let recovered = network
            .recover(&[Recorded {
                id: "kept".into(),
                netns: None,
                ready: true,
            }])
            .await;
        assert!(recovered.lost.is_empty() && recovered.released.is_empty());
        let mut left = names(&ipam);
        left.sort();
        assert_eq!(left, ["10.0.0.2", "last_reserved_ip.0", "lock"]);
    }
}
