//! A pod's network namespace, pinned by a bind mount of its namespace file at
//! `<root>/netns/<sandbox id>` so that it outlives every process in it, as
//! containerd and `ip netns` pin theirs.
//!
//! Namespaces belong to threads: each operation runs on a thread of its own, made for
//! it and ended after it, so no thread of the runtime's pools ever changes namespace.
//! Nothing forks: a new namespace is made by `unshare` on that thread.

use std::fs::File;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};

use rustix::mount::UnmountFlags;
use rustix::thread::{LinkNameSpaceType, UnshareFlags};

/// Where the namespace of sandbox `id` is pinned, under the runtime's root.
pub(crate) fn pin_path(root: &Path, id: &str) -> PathBuf {
    root.join("netns").join(id)
}

/// Makes a new network namespace pinned at `pin` (its directory made if missing).
pub(crate) fn create(pin: &Path) -> std::io::Result<()> {
    if let Some(dir) = pin.parent() {
        std::fs::create_dir_all(dir)?;
    }
    File::create(pin)?;
    let target = pin.to_path_buf();
    let made = on_thread(move || {
        // Deprecated only because other flags (CLONE_FILES) can invalidate other
        // threads' descriptors; a new network namespace cannot.
        #[allow(deprecated)]
        rustix::thread::unshare(UnshareFlags::NEWNET)?;
        loopback_up()?;
        rustix::mount::mount_bind("/proc/thread-self/ns/net", &target)?;
        Ok(())
    });
    if made.is_err() {
        let _ = std::fs::remove_file(pin);
    }
    made
}

/// Brings up `lo` in the calling thread's (new) network namespace: one netlink
/// request, where the CNI `loopback` plugin would cost an exec of its own.
fn loopback_up() -> std::io::Result<()> {
    use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketType, netlink};
    const RTM_NEWLINK: u16 = 16;
    const NLM_F_REQUEST_ACK: u16 = 0x1 | 0x4;
    const NLMSG_ERROR: u16 = 2;
    const IFF_UP: u32 = 0x1;
    // `lo` is the first link of every network namespace.
    const LO_INDEX: i32 = 1;
    let socket = rustix::net::socket(AddressFamily::NETLINK, SocketType::RAW, None)?;
    // nlmsghdr (length, type, flags, sequence, port) then ifinfomsg (family, type,
    // index, flags, change), in the host's byte order.
    let mut request = Vec::with_capacity(32);
    request.extend_from_slice(&32u32.to_ne_bytes());
    request.extend_from_slice(&RTM_NEWLINK.to_ne_bytes());
    request.extend_from_slice(&NLM_F_REQUEST_ACK.to_ne_bytes());
    request.extend_from_slice(&1u32.to_ne_bytes());
    request.extend_from_slice(&0u32.to_ne_bytes());
    request.extend_from_slice(&[0, 0, 0, 0]);
    request.extend_from_slice(&LO_INDEX.to_ne_bytes());
    request.extend_from_slice(&IFF_UP.to_ne_bytes());
    request.extend_from_slice(&IFF_UP.to_ne_bytes());
    let kernel = netlink::SocketAddrNetlink::new(0, 0);
    rustix::net::sendto(&socket, &request, SendFlags::empty(), &kernel)?;
    let mut reply = [0u8; 256];
    let (read, _) = rustix::net::recv(&socket, &mut reply, RecvFlags::empty())?;
    let field = |at: usize| reply.get(at..at + 4).and_then(|b| b.try_into().ok());
    let kind = reply
        .get(4..6)
        .and_then(|b| b.try_into().ok())
        .map(u16::from_ne_bytes);
    match (kind, field(16).map(i32::from_ne_bytes)) {
        (Some(NLMSG_ERROR), Some(0)) => Ok(()),
        (Some(NLMSG_ERROR), Some(errno)) => Err(std::io::Error::from_raw_os_error(-errno)),
        _ => Err(std::io::Error::other(format!(
            "unexpected netlink reply to bringing up lo ({read} bytes)"
        ))),
    }
}

/// Unpins the namespace at `pin` and removes the pin: the namespace ends with its last
/// process. Removing one that is not there is not an error. Any pinned namespace (UTS,
/// IPC: `crate::namespaces`) is removed so; unlinking the pin also drops the copies of
/// its mount that containers' mount namespaces hold.
pub(crate) fn remove(pin: &Path) -> std::io::Result<()> {
    match rustix::mount::unmount(pin, UnmountFlags::DETACH) {
        // EINVAL: not a mount point (a pin whose mount is gone); ENOENT: no pin.
        Ok(()) | Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => {}
        Err(e) => return Err(e.into()),
    }
    match std::fs::remove_file(pin) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Runs `f` on a thread of its own inside the namespace pinned at `pin`. Sockets `f`
/// opens stay in that namespace after it returns, and processes it spawns start in it.
pub(crate) fn run_in<T: Send + 'static>(
    pin: &Path,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let ns = File::open(pin)?;
    on_thread(move || {
        rustix::thread::move_into_link_name_space(ns.as_fd(), Some(LinkNameSpaceType::Network))?;
        drop(ns);
        f()
    })
}

/// Runs `f` on a new thread that ends with it, so that whatever namespace it enters
/// dies with it.
pub(crate) fn on_thread<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    std::thread::Builder::new()
        .name("netns".into())
        .spawn(f)?
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("the namespace thread panicked")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inode(path: &str) -> u64 {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::metadata(path).map(|m| m.ino()).unwrap_or(0)
    }

    fn root() -> bool {
        rustix::process::geteuid().is_root()
    }

    #[test]
    fn create_enter_remove() {
        if !root() {
            eprintln!("skipped: network namespaces need root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let pin = pin_path(dir.path(), "sandbox-a");
        create(&pin).unwrap();
        let outside = inode("/proc/thread-self/ns/net");
        let inside = run_in(&pin, || Ok(inode("/proc/thread-self/ns/net"))).unwrap();
        assert_ne!(inside, 0);
        assert_ne!(inside, outside, "the pod's namespace is not the host's");
        let up = run_in(&pin, || {
            let probe = std::net::TcpListener::bind("127.0.0.1:0")?;
            std::net::TcpStream::connect(probe.local_addr()?).map(|_| ())
        });
        assert!(up.is_ok(), "lo is up inside: {up:?}");
        assert_eq!(
            inode(pin.to_str().unwrap()),
            inside,
            "the pin is the namespace"
        );
        // A socket opened inside stays inside: its port is free on the host.
        let listener = run_in(&pin, || std::net::TcpListener::bind("0.0.0.0:0")).unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
        drop(listener);
        remove(&pin).unwrap();
        assert!(!pin.exists());
        assert_eq!(std::fs::read_dir(pin.parent().unwrap()).unwrap().count(), 0);
        remove(&pin).unwrap();
    }
}
