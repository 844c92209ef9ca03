//! The service proxy's table in the kernel, end to end: a node in a network namespace
//! of its own, joined by a veth to a namespace of "pods" (two endpoint addresses, each
//! with a TCP and a UDP server), Services fed to the proxy's sync code directly.
//! ClusterIP and NodePort spread over both endpoints, session affinity keeps one,
//! a Service without endpoints refuses at once, an endpoint reaches itself through its
//! Service (hairpin), a ClusterIP refuses a port it does not serve, external IPs serve a
//! client of a third namespace ("outside" the cluster) by their traffic policy, a
//! deleted chain comes back at the next check, and a restarted proxy rewrites the table
//! with no moment without rules.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsFd as _;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use kube::api::ObjectMeta;
use trellis_proxy::{Proxier, ProxyConfig, in_new_netns};

const NODE: &str = "10.244.115.1";
const POD_A: &str = "10.244.115.2";
const POD_B: &str = "10.244.115.3";
/// A client outside the cluster's pod range (`10.244.115.0/25`), in a namespace of its
/// own routed through the node.
const OUTSIDE: &str = "10.244.115.253";
const OUTSIDE_GW: &str = "10.244.115.254";
/// External IPs, routed to the node (outside the pods' /25).
const EXTERNAL: &str = "10.244.115.200";
const EXTERNAL_LOCAL: &str = "10.244.115.201";
const TABLE: &str = "trellis-proxy-test";

/// The namespace of the pods, by name (the node's goes with its thread).
struct PodsNs(String);

impl Drop for PodsNs {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn run(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(args[0]).args(&args[1..]).output()?;
    anyhow::ensure!(
        out.status.success(),
        "{}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Runs `f` on a thread inside the pods' namespace.
fn in_pods<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> std::thread::JoinHandle<anyhow::Result<T>> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path)?;
        rustix::thread::move_into_link_name_space(
            file.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )?;
        f()
    })
}

/// Servers that answer with their name and the peer they saw.
fn serve(ns: &str, ip: &'static str) -> anyhow::Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    in_pods(ns, move || {
        let tcp = TcpListener::bind((ip, 8080))?;
        let udp = UdpSocket::bind((ip, 5353))?;
        tx.send(())?;
        std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            while let Ok((_, peer)) = udp.recv_from(&mut buf) {
                let _ = udp.send_to(format!("{ip} {}", peer.ip()).as_bytes(), peer);
            }
        });
        for stream in tcp.incoming() {
            let mut stream = stream?;
            let peer = stream.peer_addr()?;
            let _ = stream.write_all(format!("{ip} {}", peer.ip()).as_bytes());
        }
        Ok(())
    });
    rx.recv_timeout(Duration::from_secs(5))?;
    Ok(())
}

/// Connects to `to` and returns what the server said (its address, the peer it saw).
fn ask(to: &str) -> std::io::Result<String> {
    let addr: SocketAddr = to.parse().map_err(std::io::Error::other)?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    Ok(answer)
}

fn service(name: &str, ip: &str, node_port: Option<i32>, affinity: bool) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("test".into()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some(
                if node_port.is_some() {
                    "NodePort"
                } else {
                    "ClusterIP"
                }
                .into(),
            ),
            cluster_ip: Some(ip.into()),
            session_affinity: affinity.then(|| "ClientIP".into()),
            ports: Some(vec![
                ServicePort {
                    name: Some("http".into()),
                    port: 80,
                    protocol: Some("TCP".into()),
                    node_port,
                    ..Default::default()
                },
                ServicePort {
                    name: Some("dns".into()),
                    port: 53,
                    protocol: Some("UDP".into()),
                    ..Default::default()
                },
            ]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn slice(ips: &[&str]) -> EndpointSlice {
    slice_on(ips, "node")
}

fn slice_on(ips: &[&str], node: &str) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta::default(),
        address_type: "IPv4".into(),
        ports: Some(vec![
            EndpointPort {
                name: Some("http".into()),
                port: Some(8080),
                protocol: Some("TCP".into()),
                ..Default::default()
            },
            EndpointPort {
                name: Some("dns".into()),
                port: Some(5353),
                protocol: Some("UDP".into()),
                ..Default::default()
            },
        ]),
        endpoints: ips
            .iter()
            .map(|ip| Endpoint {
                addresses: vec![(*ip).into()],
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    serving: Some(true),
                    terminating: Some(false),
                }),
                node_name: Some(node.into()),
                ..Default::default()
            })
            .collect(),
    }
}

/// Every Service of the test, as the proxy is told of them.
fn feed(proxier: &mut Proxier) {
    let both = slice(&[POD_A, POD_B]);
    let only_a = slice(&[POD_A]);
    proxier.update(
        "test/web",
        Some(&service("web", "10.43.115.10", Some(30115), false)),
        &[&both],
    );
    proxier.update(
        "test/sticky",
        Some(&service("sticky", "10.43.115.11", None, true)),
        &[&both],
    );
    proxier.update(
        "test/empty",
        Some(&service("empty", "10.43.115.12", Some(30116), false)),
        &[],
    );
    proxier.update(
        "test/self",
        Some(&service("self", "10.43.115.13", None, false)),
        &[&only_a],
    );
    let mut ext = service("ext", "10.43.115.14", None, false);
    ext.spec.as_mut().unwrap().external_ips = Some(vec![EXTERNAL.into()]);
    proxier.update("test/ext", Some(&ext), &[&both]);
    // Local: only A is on this node.
    let mut ext_local = service("ext-local", "10.43.115.15", None, false);
    let spec = ext_local.spec.as_mut().unwrap();
    spec.external_ips = Some(vec![EXTERNAL_LOCAL.into()]);
    spec.external_traffic_policy = Some("Local".into());
    proxier.update(
        "test/ext-local",
        Some(&ext_local),
        &[&only_a, &slice_on(&[POD_B], "elsewhere")],
    );
}

fn config() -> ProxyConfig {
    let mut config = ProxyConfig::new("node", vec![NODE.parse().unwrap()]);
    config.table = TABLE.into();
    config.cluster_cidrs = vec!["10.244.115.0/25".into()];
    config.service_cidrs = vec!["10.43.0.0/16".into()];
    config
}

/// `ask` from a thread in namespace `ns`.
fn ask_from(ns: &str, to: &'static str) -> anyhow::Result<String> {
    in_pods(ns, move || Ok(ask(to)?))
        .join()
        .map_err(|_| anyhow::anyhow!("a thread panicked"))?
}

/// Asserts that a new connection to `to` from namespace `ns` (`None`: the node) is
/// refused at once.
fn assert_refused(ns: Option<&str>, to: &'static str) {
    let started = Instant::now();
    let result = match ns {
        Some(ns) => in_pods(ns, move || Ok(ask(to))).join().unwrap().unwrap(),
        None => ask(to),
    };
    let refused = result.unwrap_err();
    assert_eq!(
        refused.kind(),
        std::io::ErrorKind::ConnectionRefused,
        "{to} from {ns:?}: {refused}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{to} refused at once"
    );
}

#[test]
fn service_traffic_through_the_table() {
    if !rustix::process::geteuid().is_root()
        || Command::new("nft").arg("--version").output().is_err()
        || Command::new("ip").arg("-V").output().is_err()
    {
        eprintln!("skipped: the service proxy's test needs root, nft and ip");
        return;
    }
    let pods = PodsNs(format!("tp115-{}", std::process::id()));
    run(&["ip", "netns", "add", &pods.0]).unwrap();
    let ns = pods.0.clone();
    let outside = PodsNs(format!("to115-{}", std::process::id()));
    run(&["ip", "netns", "add", &outside.0]).unwrap();
    let out_ns = outside.0.clone();
    in_new_netns(async move || {
        // The node: the veth to the pods, forwarding, a route to the Service range.
        run(&["ip", "link", "set", "lo", "up"])?;
        run(&[
            "ip", "link", "add", "tp115n", "type", "veth", "peer", "name", "tp115p", "netns", &ns,
        ])?;
        run(&["ip", "addr", "add", &format!("{NODE}/24"), "dev", "tp115n"])?;
        run(&["ip", "link", "set", "tp115n", "up"])?;
        run(&["ip", "route", "add", "10.43.0.0/16", "dev", "tp115n"])?;
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")?;
        // The outside client's link: /32s, so that nothing else of the /24 goes there.
        run(&[
            "ip", "link", "add", "tp115x", "type", "veth", "peer", "name", "tp115o", "netns",
            &out_ns,
        ])?;
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{OUTSIDE_GW}/32"),
            "dev",
            "tp115x",
        ])?;
        run(&["ip", "link", "set", "tp115x", "up"])?;
        run(&[
            "ip",
            "route",
            "add",
            &format!("{OUTSIDE}/32"),
            "dev",
            "tp115x",
        ])?;
        for (ns, args) in [
            (&ns, vec!["ip", "link", "set", "lo", "up"]),
            // A /25: the external IPs and the outside client are reached through the node.
            (
                &ns,
                vec!["ip", "addr", "add", "10.244.115.2/25", "dev", "tp115p"],
            ),
            (
                &ns,
                vec!["ip", "addr", "add", "10.244.115.3/25", "dev", "tp115p"],
            ),
            (&ns, vec!["ip", "link", "set", "tp115p", "up"]),
            (&ns, vec!["ip", "route", "add", "default", "via", NODE]),
            (
                &out_ns,
                vec!["ip", "addr", "add", "10.244.115.253/32", "dev", "tp115o"],
            ),
            (&out_ns, vec!["ip", "link", "set", "tp115o", "up"]),
            (
                &out_ns,
                vec!["ip", "route", "add", "10.244.115.254/32", "dev", "tp115o"],
            ),
            (
                &out_ns,
                vec!["ip", "route", "add", "default", "via", "10.244.115.254"],
            ),
        ] {
            let args: Vec<String> = args.into_iter().map(String::from).collect();
            in_pods(ns, move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                run(&args)
            })
            .join()
            .map_err(|_| anyhow::anyhow!("a thread panicked"))??;
        }
        serve(&ns, POD_A)?;
        serve(&ns, POD_B)?;

        let mut proxier = Proxier::new(config());
        feed(&mut proxier);
        proxier.sync().await?;

        // ClusterIP and NodePort, spread over both endpoints.
        for frontend in ["10.43.115.10:80", "10.244.115.1:30115"] {
            let mut seen = BTreeSet::new();
            for _ in 0..40 {
                let answer = ask(frontend)?;
                seen.insert(answer.split(' ').next().unwrap_or_default().to_owned());
                if seen.len() == 2 {
                    break;
                }
            }
            assert_eq!(seen.len(), 2, "{frontend} reaches both endpoints: {seen:?}");
        }
        // UDP through the ClusterIP.
        let udp = UdpSocket::bind("0.0.0.0:0")?;
        udp.set_read_timeout(Some(Duration::from_secs(2)))?;
        udp.send_to(b"q", "10.43.115.10:53")?;
        let mut buf = [0u8; 64];
        let (n, from) = udp.recv_from(&mut buf)?;
        assert_eq!(
            from.to_string(),
            "10.43.115.10:53",
            "the reply comes from the ClusterIP"
        );
        assert!(std::str::from_utf8(&buf[..n])?.starts_with("10.244.115."));

        // Affinity: every connection of one client to one endpoint.
        let sticky: BTreeSet<String> = (0..12)
            .map(|_| {
                ask("10.43.115.11:80").map(|a| a.split(' ').next().unwrap_or_default().to_owned())
            })
            .collect::<Result<_, _>>()?;
        assert_eq!(
            sticky.len(),
            1,
            "ClientIP affinity keeps one endpoint: {sticky:?}"
        );

        // No endpoints: refused at once, not a timeout, on the ClusterIP and the NodePort.
        for frontend in ["10.43.115.12:80", "10.244.115.1:30116"] {
            let started = Instant::now();
            let refused = ask(frontend).unwrap_err();
            assert_eq!(
                refused.kind(),
                std::io::ErrorKind::ConnectionRefused,
                "{frontend}: {refused}"
            );
            assert!(
                started.elapsed() < Duration::from_millis(500),
                "refused at once"
            );
        }

        // A ClusterIP on a port none of its Service's ports serves: refused at once, from
        // the node (output) and from a pod (forward).
        assert_refused(None, "10.43.115.10:81");
        assert_refused(Some(&ns), "10.43.115.10:81");

        // External IPs, from outside: Cluster spreads over both endpoints, masqueraded
        // to the node; Local keeps the client's address and this node's endpoint.
        let mut seen = BTreeSet::new();
        for _ in 0..40 {
            let answer = ask_from(&out_ns, "10.244.115.200:80")?;
            let (endpoint, peer) = answer.split_once(' ').unwrap_or_default();
            assert_eq!(peer, NODE, "eTP Cluster masquerades: {answer}");
            seen.insert(endpoint.to_owned());
            if seen.len() == 2 {
                break;
            }
        }
        assert_eq!(
            seen.len(),
            2,
            "the external IP reaches both endpoints: {seen:?}"
        );
        for _ in 0..4 {
            assert_eq!(
                ask_from(&out_ns, "10.244.115.201:80")?,
                format!("{POD_A} {OUTSIDE}"),
                "eTP Local: the local endpoint, the client's own address"
            );
        }
        // The node itself follows the Cluster policy, masqueraded.
        let answer = ask("10.244.115.201:80")?;
        assert!(answer.ends_with(&format!(" {NODE}")), "{answer}");

        // Hairpin: pod A reaches itself through its Service, masqueraded to the node.
        let hairpin = || {
            in_pods(&ns, || Ok(ask("10.43.115.13:80")?))
                .join()
                .map_err(|_| anyhow::anyhow!("a thread panicked"))?
        };
        assert_eq!(
            hairpin()?,
            format!("{POD_A} {NODE}"),
            "hairpin, masqueraded"
        );

        // Drift: a base chain deleted by hand is back after the next check.
        run(&["nft", "delete", "chain", "ip", TABLE, "nat-prerouting"])?;
        assert!(proxier.repair_drift().await?, "the missing chain is seen");
        assert_eq!(
            hairpin()?,
            format!("{POD_A} {NODE}"),
            "served again after the repair"
        );
        assert!(!proxier.repair_drift().await?, "nothing more to repair");

        // A restarted proxy: its first sync replaces the table in one transaction, while
        // a client keeps connecting.
        let stop = Arc::new(AtomicBool::new(false));
        let failures = Arc::new(AtomicUsize::new(0));
        let attempts = Arc::new(AtomicUsize::new(0));
        let client = {
            let (stop, failures, attempts) = (stop.clone(), failures.clone(), attempts.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    attempts.fetch_add(1, Ordering::Relaxed);
                    if ask("10.43.115.10:80").is_err() {
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        while attempts.load(Ordering::Relaxed) < 20 {
            tokio::task::yield_now().await;
            std::thread::yield_now();
        }
        let mut restarted = Proxier::new(config());
        feed(&mut restarted);
        restarted.sync().await?;
        let after = attempts.load(Ordering::Relaxed) + 20;
        while attempts.load(Ordering::Relaxed) < after {
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
        client
            .join()
            .map_err(|_| anyhow::anyhow!("the client panicked"))?;
        assert_eq!(
            failures.load(Ordering::Relaxed),
            0,
            "no connection failed across the restart"
        );
        assert!(
            !restarted.repair_drift().await?,
            "the restarted proxy's table is whole"
        );
        Ok(())
    })
    .unwrap();
}
