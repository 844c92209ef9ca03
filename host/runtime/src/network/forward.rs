//! Connections into a pod's network namespace, for port forwarding (`kubectl
//! port-forward`): the node connects to `localhost:PORT` as the pod sees it, as
//! containerd's CRI plugin does for `PortForward`.
//!
//! A socket belongs to the namespace of the thread that made it, for its whole life:
//! the connection is made on a thread that entered the pod's namespace (see
//! [`super::netns::run_in`]) and then used from anywhere, a Tokio task included.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Connects to `127.0.0.1:port` inside the network namespace pinned at `netns` (a
/// sandbox's, as [`sandbox_netns`] finds it, or any other namespace file), within
/// `timeout`. Blocking: call it from a blocking task.
pub fn connect_in_netns(netns: &Path, port: u16, timeout: Duration) -> std::io::Result<TcpStream> {
    super::netns::run_in(netns, move || {
        let stream =
            TcpStream::connect_timeout(&SocketAddr::from((Ipv4Addr::LOCALHOST, port)), timeout)?;
        let _ = stream.set_nodelay(true);
        Ok(stream)
    })
}

/// Where the network namespace of sandbox `id` is pinned, found in the process's
/// mount table: the runtime pins each sandbox's namespace by a bind mount (an `nsfs`
/// mount) at a path named by the sandbox's ID, so any process of the node that shares
/// the runtime's mount namespace (the agent, whether the runtime runs in its process or
/// not) finds it by the ID that `RunPodSandbox` returned, with no path of the
/// runtime's to know. `None`: the sandbox has no namespace of its own (it is on the
/// node's network) or is gone.
pub fn sandbox_netns(id: &str) -> Option<PathBuf> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    pin_in_mountinfo(&table, id)
}

/// [`sandbox_netns`] over the text of a `mountinfo` table.
fn pin_in_mountinfo(table: &str, id: &str) -> Option<PathBuf> {
    if id.is_empty() || id.contains('/') {
        return None;
    }
    table.lines().find_map(|line| {
        // ID, parent, major:minor, root, mount point, options, optional fields, "-",
        // file system type, source, super options.
        let (fields, rest) = line.split_once(" - ")?;
        if rest.split(' ').next()? != "nsfs" {
            return None;
        }
        let mount_point = PathBuf::from(unescape(fields.split(' ').nth(4)?));
        // `<root>/netns/<id>`: named by the sandbox, in the runtime's directory of
        // network namespace pins (not another namespace pinned for the same sandbox).
        let named = mount_point.file_name()? == id && mount_point.parent()?.file_name()? == "netns";
        named.then_some(mount_point)
    })
}

/// A mount table's path, whose space, tab, newline and backslash are octal escapes.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = bytes
            .get(i + 1..i + 4)
            .filter(|_| bytes[i] == b'\\')
            .and_then(|digits| std::str::from_utf8(digits).ok())
            .and_then(|digits| u8::from_str_radix(digits, 8).ok());
        match escaped {
            Some(byte) => {
                out.push(byte);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_sandbox_pin_in_the_mount_table() {
        let table = "\
22 1 0:21 / /proc rw,nosuid - proc proc rw
812 29 0:4 net:[4026532845] /var/lib/trellis/runtime/netns/abc123 rw shared:1 - nsfs nsfs rw
813 29 0:4 uts:[4026532846] /var/lib/trellis/runtime/uts/abc124 rw - nsfs nsfs rw
814 29 0:4 net:[4026532847] /tmp/my\\040dir/netns/def456 rw - nsfs nsfs rw
815 29 8:1 / /data/netns/xyz rw - ext4 /dev/sda1 rw
";
        assert_eq!(
            pin_in_mountinfo(table, "abc123"),
            Some(PathBuf::from("/var/lib/trellis/runtime/netns/abc123"))
        );
        assert_eq!(
            pin_in_mountinfo(table, "def456"),
            Some(PathBuf::from("/tmp/my dir/netns/def456"))
        );
        // Not a network namespace pin, not nsfs, no ID.
        assert_eq!(pin_in_mountinfo(table, "abc124"), None);
        assert_eq!(pin_in_mountinfo(table, "xyz"), None);
        assert_eq!(pin_in_mountinfo(table, ""), None);
    }

    #[test]
    fn connects_inside_the_namespace_only() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: network namespaces need root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let pin = super::super::netns::pin_path(dir.path(), "forward-test");
        super::super::netns::create(&pin).unwrap();
        assert_eq!(
            sandbox_netns("forward-test").as_deref(),
            Some(pin.as_path()),
            "the pin is found by the sandbox's ID"
        );
        let listener =
            super::super::netns::run_in(&pin, || std::net::TcpListener::bind("127.0.0.1:0"))
                .unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = std::thread::spawn(move || listener.accept().map(|_| ()));
        let stream = connect_in_netns(&pin, port, Duration::from_secs(5));
        assert!(stream.is_ok(), "{stream:?}");
        accepted.join().unwrap().unwrap();
        drop(stream);
        // Nothing listens on that port on the host's loopback, nor on another inside.
        let refused = connect_in_netns(&pin, port.wrapping_add(1).max(1), Duration::from_secs(5));
        assert_eq!(
            refused.map(|_| ()).unwrap_err().kind(),
            std::io::ErrorKind::ConnectionRefused
        );
        super::super::netns::remove(&pin).unwrap();
        assert_eq!(sandbox_netns("forward-test"), None);
    }
}
