//! The address a node advertises when `--node-address` is not given: the one a
//! kubelet picks (`ChooseHostInterface`), the first IPv4 address of the interface of
//! the default route, else of any interface that is up and is not a pod network's own
//! (a bridge, a veth, `lo`); 127.0.0.1 only when there is none. Pods on a network of
//! their own reach the node there, where 127.0.0.1 would be each pod itself.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

/// Interface names that belong to pod networks, not to the node: Trellis' bridges and
/// the veths CNI plugins make (and the other usual CNI plugins' links).
const POD_LINK_PREFIXES: &[&str] = &[
    "trellis", "veth", "cni", "flannel", "cali", "cilium", "vxlan", "docker",
];

/// Where the address came from: logged, so an operator sees why it was picked.
#[derive(Debug, PartialEq, Eq)]
pub enum Source {
    DefaultRoute(String),
    Interface(String),
    /// No interface has an address: pods on a network of their own cannot reach it.
    Loopback,
}

/// The node's address and how it was found.
pub fn detect() -> (IpAddr, Source) {
    let addresses = ipv4_addresses().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot list the interfaces' addresses");
        Vec::new()
    });
    let route = std::fs::read_to_string("/proc/net/route").unwrap_or_default();
    pick(&addresses, default_route_interfaces(&route), |name| {
        link_is_up(name) && !is_pod_link(name)
    })
}

/// The choice, given each interface's addresses (in the kernel's order), the default
/// route's interfaces (best first) and which interfaces may serve as a fallback.
fn pick(
    addresses: &[(String, Ipv4Addr)],
    default_interfaces: Vec<String>,
    fallback: impl Fn(&str) -> bool,
) -> (IpAddr, Source) {
    let usable = |ip: &Ipv4Addr| !ip.is_loopback() && !ip.is_unspecified() && !ip.is_link_local();
    for interface in default_interfaces {
        if let Some((_, ip)) = addresses
            .iter()
            .find(|(name, ip)| *name == interface && usable(ip))
        {
            return (IpAddr::V4(*ip), Source::DefaultRoute(interface));
        }
    }
    for (name, ip) in addresses {
        if usable(ip) && fallback(name) {
            return (IpAddr::V4(*ip), Source::Interface(name.clone()));
        }
    }
    (IpAddr::V4(Ipv4Addr::LOCALHOST), Source::Loopback)
}

/// The interfaces of the IPv4 default routes in `/proc/net/route`, lowest metric first.
fn default_route_interfaces(table: &str) -> Vec<String> {
    const RTF_UP: u32 = 0x1;
    let mut routes: Vec<(u32, String)> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (name, destination, flags, metric, mask) = (
                fields.first()?,
                fields.get(1)?,
                u32::from_str_radix(fields.get(3)?, 16).ok()?,
                fields.get(6)?.parse::<u32>().ok()?,
                fields.get(7)?,
            );
            (*destination == "00000000" && *mask == "00000000" && flags & RTF_UP != 0)
                .then(|| (metric, (*name).to_owned()))
        })
        .collect();
    routes.sort();
    routes.into_iter().map(|(_, name)| name).collect()
}

fn link_is_up(name: &str) -> bool {
    const IFF_UP: u32 = 0x1;
    std::fs::read_to_string(Path::new("/sys/class/net").join(name).join("flags"))
        .ok()
        .and_then(|f| u32::from_str_radix(f.trim().trim_start_matches("0x"), 16).ok())
        .is_some_and(|flags| flags & IFF_UP != 0)
}

/// A bridge, or a link named as pod networks name theirs.
fn is_pod_link(name: &str) -> bool {
    POD_LINK_PREFIXES.iter().any(|p| name.starts_with(p))
        || Path::new("/sys/class/net")
            .join(name)
            .join("bridge")
            .exists()
}

/// Every interface's IPv4 addresses, in the kernel's order: one netlink dump
/// (RTM_GETADDR), the interface's name from its index.
fn ipv4_addresses() -> std::io::Result<Vec<(String, Ipv4Addr)>> {
    use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketType, netlink};
    const RTM_NEWADDR: u16 = 20;
    const RTM_GETADDR: u16 = 22;
    const NLMSG_ERROR: u16 = 2;
    const NLMSG_DONE: u16 = 3;
    const NLM_F_REQUEST_DUMP: u16 = 0x1 | 0x300;
    const IFA_ADDRESS: u16 = 1;
    const IFA_LOCAL: u16 = 2;
    const AF_INET: u8 = 2;
    let socket = rustix::net::socket(AddressFamily::NETLINK, SocketType::RAW, None)?;
    // nlmsghdr (length, type, flags, sequence, port), then ifaddrmsg (family,
    // prefix length, flags, scope, index), in the host's byte order.
    let mut request = Vec::with_capacity(24);
    request.extend_from_slice(&24u32.to_ne_bytes());
    request.extend_from_slice(&RTM_GETADDR.to_ne_bytes());
    request.extend_from_slice(&NLM_F_REQUEST_DUMP.to_ne_bytes());
    request.extend_from_slice(&1u32.to_ne_bytes());
    request.extend_from_slice(&0u32.to_ne_bytes());
    request.extend_from_slice(&[AF_INET, 0, 0, 0]);
    request.extend_from_slice(&0u32.to_ne_bytes());
    let kernel = netlink::SocketAddrNetlink::new(0, 0);
    rustix::net::sendto(&socket, &request, SendFlags::empty(), &kernel)?;
    let u16_at = |b: &[u8], at: usize| {
        b.get(at..at + 2)
            .and_then(|b| b.try_into().ok())
            .map(u16::from_ne_bytes)
    };
    let u32_at = |b: &[u8], at: usize| {
        b.get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_ne_bytes)
    };
    let mut found = Vec::new();
    let mut buffer = vec![0u8; 32 * 1024];
    loop {
        let (read, _) = rustix::net::recv(&socket, &mut buffer, RecvFlags::empty())?;
        let mut messages = buffer.get(..read).unwrap_or_default();
        while messages.len() >= 16 {
            let length = u32_at(messages, 0).unwrap_or(0) as usize;
            let kind = u16_at(messages, 4).unwrap_or(0);
            if length < 16 || length > messages.len() {
                break;
            }
            let message = &messages[..length];
            match kind {
                NLMSG_DONE => return Ok(found),
                NLMSG_ERROR => {
                    let errno = u32_at(message, 16).map_or(0, |e| e as i32);
                    return Err(std::io::Error::from_raw_os_error(-errno));
                }
                RTM_NEWADDR => {
                    let index = u32_at(message, 20).unwrap_or(0);
                    let (mut local, mut address) = (None, None);
                    // Attributes (length, type, value), each padded to 4 bytes.
                    let mut at = 24;
                    while let (Some(len), Some(kind)) =
                        (u16_at(message, at), u16_at(message, at + 2))
                    {
                        let len = usize::from(len);
                        if len < 4 {
                            break;
                        }
                        let value = message
                            .get(at + 4..at + len)
                            .and_then(|v| <[u8; 4]>::try_from(v).ok())
                            .map(Ipv4Addr::from);
                        match kind {
                            IFA_LOCAL => local = value,
                            IFA_ADDRESS => address = value,
                            _ => {}
                        }
                        at += len.div_ceil(4) * 4;
                    }
                    if let Some(ip) = local.or(address)
                        && let Ok(name) = rustix::net::netdevice::index_to_name(&socket, index)
                    {
                        found.push((name, ip));
                    }
                }
                _ => {}
            }
            messages = messages.get(length.div_ceil(4) * 4..).unwrap_or_default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROUTES: &str =
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth1\t00000000\t010200C0\t0003\t0\t0\t200\t00000000\t0\t0\t0
trellis0\t004EF40A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
eth0\t00000000\t010200C0\t0003\t0\t0\t100\t00000000\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
";

    fn addresses() -> Vec<(String, Ipv4Addr)> {
        [
            ("lo", "127.0.0.1"),
            ("trellis0", "10.244.78.1"),
            ("eth1", "198.51.100.7"),
            ("eth0", "192.0.2.2"),
        ]
        .iter()
        .map(|(n, ip)| (n.to_string(), ip.parse().unwrap()))
        .collect()
    }

    #[test]
    fn default_routes_by_metric() {
        assert_eq!(default_route_interfaces(ROUTES), ["eth0", "eth1"]);
        assert!(default_route_interfaces("Iface\tDestination\n").is_empty());
    }

    #[test]
    fn the_default_routes_interface_wins() {
        let (ip, source) = pick(&addresses(), default_route_interfaces(ROUTES), |_| true);
        assert_eq!(ip.to_string(), "192.0.2.2");
        assert_eq!(source, Source::DefaultRoute("eth0".into()));
    }

    #[test]
    fn without_a_default_route_an_interface_that_is_not_a_pod_networks() {
        let (ip, source) = pick(&addresses(), Vec::new(), |name| !is_pod_link(name));
        assert_eq!(ip.to_string(), "198.51.100.7");
        assert_eq!(source, Source::Interface("eth1".into()));
    }

    #[test]
    fn loopback_when_nothing_else() {
        let only_pods: Vec<_> = addresses()
            .into_iter()
            .filter(|(n, _)| n == "lo" || n == "trellis0")
            .collect();
        let (ip, source) = pick(&only_pods, vec!["eth0".into()], |name| !is_pod_link(name));
        assert!(ip.is_loopback());
        assert_eq!(source, Source::Loopback);
    }

    #[test]
    fn lists_this_machines_addresses() {
        let found = ipv4_addresses().unwrap();
        assert!(
            found
                .iter()
                .any(|(name, ip)| name == "lo" && ip.is_loopback()),
            "{found:?}"
        );
    }
}
