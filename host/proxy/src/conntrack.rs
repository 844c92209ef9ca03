//! Removal of UDP conntrack entries that still send a Service's traffic to an endpoint
//! that is gone, as kube-proxy's `conntrack.CleanStaleEntries`.
//!
//! UDP has no connection to end: while a client keeps sending from one port, its
//! conntrack entry keeps the DNAT it got first, to an endpoint that may be gone (and,
//! for a Service that had no endpoint, the entry that was rejected). So when a UDP
//! endpoint goes, the entries whose replies come from it are deleted and the next
//! datagram is NATed afresh. Entries are deleted by the `conntrack` tool (Debian's
//! `conntrack`, as kube-proxy runs it), in the network namespace of the calling thread:
//! the node's.

use std::net::IpAddr;
use std::time::Duration;

use anyhow::Context as _;

/// How long one `conntrack` run may take: the proxy's sync waits for it.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Deletes the UDP conntrack entries to `dest` (any destination if it is unspecified,
/// `0.0.0.0`, as for a NodePort on every address), to `port` if given, whose reply
/// source is `endpoint` (any, if none): kube-proxy's `ClearEntriesForNAT` (a
/// ClusterIP's endpoint gone), `ClearEntriesForPortNAT` (a NodePort's) and
/// `ClearEntriesForIP` (a Service that had no endpoint now has one). Finding no entry
/// is no error.
pub async fn flush_udp(
    dest: IpAddr,
    port: Option<u16>,
    endpoint: Option<IpAddr>,
) -> anyhow::Result<()> {
    let args = arguments(dest, port, endpoint);
    let run = tokio::process::Command::new("conntrack")
        .args(&args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(TIMEOUT, run)
        .await
        .with_context(|| format!("conntrack {} within {TIMEOUT:?}", args.join(" ")))?
        .with_context(|| {
            format!(
                "run conntrack {} (Debian's conntrack package)",
                args.join(" ")
            )
        })?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    // It exits 1 when nothing matched, saying so.
    if output.status.success() || stderr.contains("0 flow entries have been deleted") {
        return Ok(());
    }
    anyhow::bail!("conntrack {}: {}", args.join(" "), stderr.trim())
}

/// The `conntrack` command line of [`flush_udp`].
fn arguments(dest: IpAddr, port: Option<u16>, endpoint: Option<IpAddr>) -> Vec<String> {
    let family = if dest.is_ipv6() || endpoint.is_some_and(|e| e.is_ipv6()) {
        "ipv6"
    } else {
        "ipv4"
    };
    let mut args: Vec<String> = ["-D", "-f", family, "-p", "udp"].map(str::to_owned).into();
    if !dest.is_unspecified() {
        args.extend(["--orig-dst".to_owned(), dest.to_string()]);
    }
    if let Some(port) = port {
        args.extend(["--orig-port-dst".to_owned(), port.to_string()]);
    }
    if let Some(endpoint) = endpoint {
        args.extend(["--reply-src".to_owned(), endpoint.to_string()]);
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn the_command_line_names_what_is_given() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            arguments(ip("10.43.0.20"), Some(53), Some(ip("10.244.1.5"))).join(" "),
            "-D -f ipv4 -p udp --orig-dst 10.43.0.20 --orig-port-dst 53 --reply-src 10.244.1.5"
        );
        assert_eq!(
            arguments(ip("0.0.0.0"), Some(30053), None).join(" "),
            "-D -f ipv4 -p udp --orig-port-dst 30053"
        );
        assert_eq!(
            arguments(ip("fd00::1"), None, None).join(" "),
            "-D -f ipv6 -p udp --orig-dst fd00::1"
        );
    }

    /// Inserts a UDP entry from a client to `dest:port`, DNATed to `endpoint`.
    fn insert(dest: &str, port: u16, endpoint: &str, sport: u16) -> std::io::Result<()> {
        let status = Command::new("conntrack")
            .args(["-I", "-p", "udp", "-s", "10.9.0.1", "-d", dest])
            .args(["--sport", &sport.to_string(), "--dport", &port.to_string()])
            .args(["-r", endpoint, "-q", "10.9.0.1"])
            .args(["--reply-port-src", &port.to_string()])
            .args(["--reply-port-dst", &sport.to_string(), "-t", "60"])
            .output()?;
        assert!(status.status.success(), "{status:?}");
        Ok(())
    }

    fn listed() -> String {
        let out = Command::new("conntrack")
            .args(["-L", "-p", "udp"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// In a network namespace of the test's thread alone: entries to a ClusterIP go
    /// when their endpoint goes, and only theirs.
    #[test]
    fn flushes_the_entries_of_a_gone_endpoint_only() {
        let root = rustix::process::geteuid().is_root();
        let tool = Command::new("conntrack").arg("--version").output().is_ok();
        if !root || !tool {
            eprintln!("skipped: needs root and conntrack (make deps)");
            return;
        }
        std::thread::spawn(|| {
            // NEWNET alone touches no descriptor of another thread (the deprecation is
            // about CLONE_FILES).
            #[allow(deprecated)]
            rustix::thread::unshare(rustix::thread::UnshareFlags::NEWNET)
                .expect("a network namespace of the thread's own");
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            insert("10.43.0.20", 53, "10.244.1.5", 40001).unwrap();
            insert("10.43.0.20", 53, "10.244.1.6", 40002).unwrap();
            insert("10.43.0.21", 53, "10.244.1.5", 40003).unwrap();
            let before = listed();
            assert_eq!(before.lines().count(), 3, "{before}");
            let ip = |s: &str| s.parse::<IpAddr>().unwrap();
            runtime
                .block_on(flush_udp(
                    ip("10.43.0.20"),
                    Some(53),
                    Some(ip("10.244.1.5")),
                ))
                .unwrap();
            let after = listed();
            assert_eq!(after.lines().count(), 2, "{after}");
            assert!(!after.contains("sport=40001"), "{after}");
            // Nothing left to match: no error.
            runtime
                .block_on(flush_udp(
                    ip("10.43.0.20"),
                    Some(53),
                    Some(ip("10.244.1.5")),
                ))
                .unwrap();
            // Every entry to a destination.
            runtime
                .block_on(flush_udp(ip("10.43.0.20"), None, None))
                .unwrap();
            let after = listed();
            assert_eq!(after.lines().count(), 1, "{after}");
            assert!(after.contains("dst=10.43.0.21"), "{after}");
        })
        .join()
        .unwrap();
    }
}
