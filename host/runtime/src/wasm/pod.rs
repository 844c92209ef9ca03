//! A workload's thread inside its pod's network: the program's store runs on a thread
//! that entered the pod's network namespace, so every socket it opens (`wasi:sockets`)
//! is the pod's, and in a mount namespace of its own where `/etc/resolv.conf` is the
//! pod's, so its name lookups (`wasi:sockets/ip-name-lookup`, glibc's resolver on a
//! blocking thread) follow the pod's DNS settings, not the node's.
//!
//! Namespaces belong to threads, and a thread made by a thread inside them starts
//! inside them too: the executor's blocking threads (name lookups) are the program
//! thread's children, so they are in the pod's namespaces as well. The namespaces end
//! with the last of those threads; nothing is left on the host.

use std::fs::File;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};

use rustix::mount::MountPropagationFlags;
use rustix::thread::{LinkNameSpaceType, UnshareFlags};

/// The resolver configuration glibc reads: what the pod's own replaces.
const RESOLV_CONF: &str = "/etc/resolv.conf";

/// What a thread enters to be in a pod's network.
#[derive(Clone, Debug)]
pub(crate) struct PodNetwork {
    /// The pinned network namespace.
    netns: PathBuf,
    /// The pod's `resolv.conf`, bound over the node's when it exists.
    resolv_conf: PathBuf,
}

impl PodNetwork {
    /// The network of sandbox `sandbox_id`, whose namespace is pinned at `netns`
    /// (`<root>/netns/<sandbox id>`): its `resolv.conf` is the one the sandbox's files
    /// hold under the same root (`pod_files`).
    pub(crate) fn of(netns: &Path, sandbox_id: &str) -> Self {
        let root = netns.parent().and_then(Path::parent).unwrap_or(netns);
        Self {
            netns: netns.to_path_buf(),
            resolv_conf: crate::pod_files::resolv_conf(root, sandbox_id),
        }
    }

    /// Moves the calling thread, which must be made for this and end with its work,
    /// into the pod's network namespace and a mount namespace of its own with the
    /// pod's `resolv.conf` (the node's when the sandbox has none).
    pub(crate) fn enter(&self) -> std::io::Result<()> {
        let ns = File::open(&self.netns)?;
        rustix::thread::move_into_link_name_space(ns.as_fd(), Some(LinkNameSpaceType::Network))?;
        drop(ns);
        if !self.resolv_conf.is_file() {
            return Ok(());
        }
        // A thread may make its own mount namespace only once it shares no filesystem
        // attributes (root, cwd) with the process's other threads. The deprecation is
        // about flags (CLONE_FILES) that can close other threads' descriptors; these
        // two touch this thread alone.
        #[allow(deprecated)]
        rustix::thread::unshare(UnshareFlags::FS | UnshareFlags::NEWNS)?;
        // Private first: the bind mount below must not propagate to the host's
        // namespace, which shares its mounts' peer groups with this copy.
        rustix::mount::mount_change(
            "/",
            MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
        )?;
        rustix::mount::mount_bind(&self.resolv_conf, RESOLV_CONF)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resolv_conf_is_the_sandboxes() {
        let network = PodNetwork::of(Path::new("/var/lib/runtime/netns/abc"), "abc");
        assert_eq!(
            network.resolv_conf,
            Path::new("/var/lib/runtime/sandboxes/abc/resolv.conf")
        );
    }

    #[test]
    fn enters_the_namespace_and_binds_the_pods_resolv_conf() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: network namespaces need root");
            return;
        }
        let root = tempfile::tempdir().unwrap();
        let pin = crate::network::netns::pin_path(root.path(), "pod-a");
        crate::network::netns::create(&pin).unwrap();
        let dir = root.path().join("sandboxes").join("pod-a");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("resolv.conf"), "nameserver 127.0.0.9\n").unwrap();
        let host_resolv = std::fs::read_to_string(RESOLV_CONF).unwrap_or_default();
        let host_netns = std::fs::read_link("/proc/thread-self/ns/net").unwrap();
        let network = PodNetwork::of(&pin, "pod-a");
        let (netns, resolv, child) = std::thread::spawn(move || {
            network.enter().unwrap();
            // A thread made from inside starts inside.
            let child = std::thread::spawn(|| std::fs::read_to_string(RESOLV_CONF).unwrap())
                .join()
                .unwrap();
            (
                std::fs::read_link("/proc/thread-self/ns/net").unwrap(),
                std::fs::read_to_string(RESOLV_CONF).unwrap(),
                child,
            )
        })
        .join()
        .unwrap();
        assert_ne!(netns, host_netns);
        assert_eq!(resolv, "nameserver 127.0.0.9\n");
        assert_eq!(child, resolv);
        assert_eq!(
            std::fs::read_to_string(RESOLV_CONF).unwrap_or_default(),
            host_resolv,
            "the host's resolv.conf is unchanged"
        );
        crate::network::netns::remove(&pin).unwrap();
    }
}
