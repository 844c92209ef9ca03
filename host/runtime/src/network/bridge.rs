//! The default network done in the runtime's own process: what the default conflist
//! asks of the CNI `bridge`, `host-local` and `portmap` plugins, without their three
//! executables (each an exec of a Go binary, ~10 ms: more than a pod's start
//! otherwise costs).
//!
//! It stands in only for the conflist the runtime writes ([`Bridge::of`] recognises
//! it, on whichever bridge and pod CIDR it names); any other network, an operator's,
//! goes through the plugins. It does what they would, so that a node may switch
//! between the two with pods running:
//! - the bridge of the conflist's name, up, with the range's first address (the pods'
//!   gateway), IP forwarding on, as `bridge` with `isGateway`;
//! - per pod, a veth pair: `veth<hash of the sandbox id>` a port of the bridge in
//!   hairpin mode, its peer `eth0` in the pod's namespace with the pod's address and a
//!   default route via the gateway;
//! - the address from host-local's own records ([`super::ipam`]);
//! - in an nftables table named after the bridge (`table ip <bridge>`): masquerade of
//!   the pods' traffic leaving the pod CIDR (`ipMasq`), and the pods' hostPorts as
//!   elements of a DNAT map, reached from other hosts, from the node itself (also on
//!   127.0.0.1, masqueraded as portmap's `snat` does) and from the pod itself
//!   (hairpin).
//!
//! What a sandbox was given is recorded in `<root>/bridge/<sandbox id>.json` before
//! anything is made, so DEL finds it after a failure or a restart; DEL deletes the
//! veth, the hostPort elements and the address, each "already gone" being no error.

use std::collections::HashSet;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::cni::{DefaultNetwork, Network, Pod, PortMapping};
use super::ipam::Ipam;
use super::netlink::Netlink;
use super::netns;

/// The interface in the pod's namespace, as CNI names it.
const IFNAME: &str = "eth0";

/// Bridges whose table, forwarding and `route_localnet` this process has set up: once
/// per bridge made, not per pod.
static SET_UP: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// The default network of one conflist.
#[derive(Clone, Debug)]
pub(crate) struct Bridge {
    name: String,
    ipam: Ipam,
    ipam_dir: PathBuf,
    network: String,
    ip_masq: bool,
}

/// What a sandbox was given, for its DEL.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Record {
    bridge: String,
    network: String,
    subnet: String,
    ipam_dir: PathBuf,
    port_mappings: Vec<PortMapping>,
    /// None until the address is given.
    ip: Option<Ipv4Addr>,
}

impl Bridge {
    /// The in-process bridge of `network` when it is the runtime's default conflist,
    /// exactly as the runtime writes it (any bridge name, IPAM directory, `ipMasq`)
    /// on a single IPv4 pod CIDR; `None` for any other network, which the CNI plugins
    /// run.
    pub(crate) fn of(network: &Network) -> Option<Self> {
        let first = network.plugins.first()?;
        let name = first.get("bridge")?.as_str()?.to_string();
        let ipam = first.get("ipam")?;
        let ipam_dir = PathBuf::from(ipam.get("dataDir")?.as_str()?);
        let subnets: Vec<String> = ipam
            .get("ranges")?
            .as_array()?
            .iter()
            .map(|range| Some(range.get(0)?.get("subnet")?.as_str()?.to_string()))
            .collect::<Option<_>>()?;
        let ip_masq = first.get("ipMasq").and_then(Value::as_bool)?;
        let mut expected = DefaultNetwork {
            subnets: subnets.clone(),
            bridge: name.clone(),
            ipam_dir: ipam_dir.clone(),
        }
        .conflist();
        expected["plugins"][0]["ipMasq"] = json!(ip_masq);
        let actual = json!({
            "cniVersion": network.cni_version,
            "name": network.name,
            "plugins": network.plugins,
        });
        if actual != expected {
            return None;
        }
        let [subnet] = subnets.as_slice() else {
            return None;
        };
        let (IpAddr::V4(ip), prefix) = super::parse_cidr(subnet)? else {
            return None;
        };
        (prefix <= 30 && name.len() < 16).then(|| Self {
            ipam: Ipam::new(&ipam_dir, &network.name, ip, prefix),
            ipam_dir,
            network: network.name.clone(),
            name,
            ip_masq,
        })
    }

    fn subnet(&self) -> String {
        let gateway = u32::from(self.ipam.gateway());
        format!("{}/{}", Ipv4Addr::from(gateway - 1), self.ipam.prefix())
    }

    /// Connects `pod`, whose namespace is made, and returns its address; on a
    /// failure, what was made is removed again. Blocking: run it off the async
    /// workers (on any thread of the host's namespace).
    pub(crate) fn attach(&self, root: &Path, pod: &Pod) -> std::io::Result<IpAddr> {
        let mut record = Record {
            bridge: self.name.clone(),
            network: self.network.clone(),
            subnet: self.subnet(),
            ipam_dir: self.ipam_dir.clone(),
            port_mappings: pod.port_mappings.clone(),
            ip: None,
        };
        save(root, &pod.id, &record)?;
        match self.connect(pod) {
            Ok(ip) => {
                record.ip = Some(ip);
                save(root, &pod.id, &record)?;
                Ok(IpAddr::V4(ip))
            }
            Err(e) => {
                if let Err(undo) = detach(root, &pod.id) {
                    tracing::warn!(sandbox = %pod.id, "failed to undo a failed attach: {undo}");
                }
                Err(e)
            }
        }
    }

    fn connect(&self, pod: &Pod) -> std::io::Result<Ipv4Addr> {
        let mut host = Netlink::open()?;
        let bridge = self.ensure(&mut host)?;
        let ip = self.ipam.allocate(&pod.id)?;
        let veth = veth_name(&pod.id);
        let netns = File::open(&pod.netns)?;
        host.add_veth(&veth, bridge, IFNAME, &netns)
            .map_err(|e| context(e, format!("make the veth pair {veth}")))?;
        host.link_index(&veth)
            .and_then(|index| {
                let index = index.ok_or_else(|| std::io::Error::other("no such link"))?;
                host.set_hairpin(index)
            })
            .map_err(|e| context(e, format!("set hairpin mode on {veth}")))?;
        let gateway = self.ipam.gateway();
        let prefix = self.ipam.prefix();
        netns::run_in(&pod.netns, move || {
            let mut inside = Netlink::open()?;
            let index = inside
                .link_index(IFNAME)?
                .ok_or_else(|| std::io::Error::other("no eth0 in the pod's namespace"))?;
            inside.set_up(index)?;
            inside.add_address(index, ip, prefix)?;
            inside.add_default_route(gateway, index)
        })
        .map_err(|e| context(e, "configure eth0 in the pod's namespace".into()))?;
        for mapping in &pod.port_mappings {
            nft(&format!(
                "add element ip {} {}",
                self.name,
                hostport_element(mapping, Some(ip))
            ))
            .map_err(|e| context(e, format!("map hostPort {}", mapping.host_port)))?;
        }
        Ok(ip)
    }

    /// The bridge's index, the bridge made and set up first if it is not there.
    fn ensure(&self, host: &mut Netlink) -> std::io::Result<u32> {
        let (index, made) = match host.link_index(&self.name)? {
            Some(index) => (index, false),
            None => {
                host.add_bridge(&self.name, bridge_mac(&self.name))
                    .map_err(|e| context(e, format!("make bridge {}", self.name)))?;
                let index = host.link_index(&self.name)?.ok_or_else(|| {
                    std::io::Error::other(format!("bridge {} vanished", self.name))
                })?;
                (index, true)
            }
        };
        let mut set_up = SET_UP.lock().unwrap_or_else(|p| p.into_inner());
        let set_up = set_up.get_or_insert_with(HashSet::new);
        if made || !set_up.contains(&self.name) {
            host.add_address(index, self.ipam.gateway(), self.ipam.prefix())?;
            host.set_up(index)?;
            std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
                .map_err(|e| context(e, "turn IP forwarding on".into()))?;
            // hostPorts reached on 127.0.0.1 are routed out of the bridge.
            std::fs::write(
                format!("/proc/sys/net/ipv4/conf/{}/route_localnet", self.name),
                "1",
            )?;
            nft(&self.table())
                .map_err(|e| context(e, format!("set up nftables table ip {}", self.name)))?;
            set_up.insert(self.name.clone());
        }
        Ok(index)
    }

    /// The bridge's nftables table, made or brought up to date in one transaction
    /// that keeps the hostPorts mapped already. Priorities are numbers (dstnat -100,
    /// srcnat 100): nft 1.0.6 refuses the names in an output chain.
    fn table(&self) -> String {
        let table = format!("ip {}", self.name);
        let subnet = self.subnet();
        let masquerade = if self.ip_masq {
            format!(
                "add rule {table} postrouting ip saddr {subnet} ip daddr != {subnet} ip daddr != 224.0.0.0/4 masquerade\n"
            )
        } else {
            String::new()
        };
        format!(
            "add table {table}
add map {table} hostports {{ type inet_proto . inet_service : ipv4_addr . inet_service; }}
add map {table} hostip_ports {{ type ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service; }}
add chain {table} prerouting {{ type nat hook prerouting priority -100; policy accept; }}
add chain {table} output {{ type nat hook output priority -100; policy accept; }}
add chain {table} hostports
add chain {table} postrouting {{ type nat hook postrouting priority 100; policy accept; }}
flush chain {table} prerouting
flush chain {table} output
flush chain {table} hostports
flush chain {table} postrouting
add rule {table} prerouting fib daddr type local jump hostports
add rule {table} output fib daddr type local jump hostports
add rule {table} hostports dnat ip to ip daddr . meta l4proto . th dport map @hostip_ports
add rule {table} hostports dnat ip to meta l4proto . th dport map @hostports
add rule {table} postrouting ct status dnat ip saddr 127.0.0.0/8 ip daddr {subnet} masquerade
add rule {table} postrouting ct status dnat ip saddr {subnet} ip daddr {subnet} masquerade
{masquerade}"
        )
    }
}

/// Disconnects sandbox `id` as its record says; no record: nothing to do. Blocking.
pub(crate) fn detach(root: &Path, id: &str) -> std::io::Result<()> {
    let file = record_file(root, id);
    let record: Record = match std::fs::read(&file) {
        Ok(text) => serde_json::from_slice(&text).map_err(std::io::Error::other)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for mapping in &record.port_mappings {
        // Each alone: one already gone must not keep the others.
        let _ = nft(&format!(
            "delete element ip {} {}",
            record.bridge,
            hostport_element(mapping, None)
        ));
    }
    Netlink::open()?
        .delete_link(&veth_name(id))
        .map_err(|e| context(e, format!("delete the veth {}", veth_name(id))))?;
    let (network, prefix) = super::parse_cidr(&record.subnet)
        .and_then(|(ip, prefix)| match ip {
            IpAddr::V4(ip) => Some((ip, prefix)),
            IpAddr::V6(_) => None,
        })
        .ok_or_else(|| std::io::Error::other(format!("bad subnet in {}", file.display())))?;
    Ipam::new(&record.ipam_dir, &record.network, network, prefix).release(id)?;
    match std::fs::remove_file(&file) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn record_file(root: &Path, id: &str) -> PathBuf {
    root.join("bridge").join(format!("{id}.json"))
}

fn save(root: &Path, id: &str, record: &Record) -> std::io::Result<()> {
    let file = record_file(root, id);
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let partial = file.with_extension("partial");
    std::fs::write(&partial, serde_json::to_vec(record).unwrap_or_default())?;
    std::fs::rename(&partial, &file)
}

/// The host's end of sandbox `id`'s veth: found again from the id alone.
fn veth_name(id: &str) -> String {
    format!("veth{:08x}", fnv(id) as u32)
}

/// A fixed, locally administered MAC address for the bridge, so that it does not
/// take (and change with) the lowest address of its ports as veths come and go.
fn bridge_mac(bridge: &str) -> [u8; 6] {
    let hash = fnv(bridge).to_be_bytes();
    [0x02, hash[3], hash[4], hash[5], hash[6], hash[7]]
}

fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A hostPort's element in the table's maps: with the pod's address to add it, the
/// key alone to delete it.
fn hostport_element(mapping: &PortMapping, ip: Option<Ipv4Addr>) -> String {
    let protocol = match mapping.protocol.as_str() {
        "udp" => "udp",
        "sctp" => "sctp",
        _ => "tcp",
    };
    let (map, key) = match mapping.host_ip.parse::<Ipv4Addr>() {
        Ok(host_ip) if !host_ip.is_unspecified() => (
            "hostip_ports",
            format!("{host_ip} . {protocol} . {}", mapping.host_port),
        ),
        _ => ("hostports", format!("{protocol} . {}", mapping.host_port)),
    };
    match ip {
        Some(ip) => format!("{map} {{ {key} : {ip} . {} }}", mapping.container_port),
        None => format!("{map} {{ {key} }}"),
    }
}

/// Runs `nft -f -` with `script`: one transaction.
fn nft(script: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut child = std::process::Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| context(e, "run nft (install nftables)".into()))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(script.as_bytes())?;
    }
    let output = child.wait_with_output()?;
    if output.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "nft: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )))
    }
}

fn context(e: std::io::Error, what: String) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn network(conflist: Value) -> Network {
        serde_json::from_value(conflist).unwrap()
    }

    #[test]
    fn stands_in_only_for_the_default_conflist() {
        let default = DefaultNetwork {
            subnets: vec!["10.244.9.0/24".into()],
            bridge: "br-x".into(),
            ipam_dir: "/var/lib/x".into(),
        }
        .conflist();
        let bridge = Bridge::of(&network(default.clone())).expect("the default network");
        assert_eq!(bridge.name, "br-x");
        assert_eq!(bridge.subnet(), "10.244.9.0/24");
        assert_eq!(bridge.ipam.gateway(), Ipv4Addr::new(10, 244, 9, 1));
        // The node agent masquerades what leaves the cluster, not the bridge.
        assert!(!bridge.ip_masq);

        let mut renamed = default.clone();
        renamed["name"] = json!("operator");
        assert!(Bridge::of(&network(renamed)).is_none());
        let mut more = default.clone();
        more["plugins"]
            .as_array_mut()
            .unwrap()
            .push(json!({"type": "bandwidth"}));
        assert!(Bridge::of(&network(more)).is_none());
        let mut no_hairpin = default.clone();
        no_hairpin["plugins"][0]["hairpinMode"] = json!(false);
        assert!(Bridge::of(&network(no_hairpin)).is_none());
        let dual = DefaultNetwork {
            subnets: vec!["10.244.9.0/24".into(), "fd00:9::/64".into()],
            bridge: "br-x".into(),
            ipam_dir: "/var/lib/x".into(),
        }
        .conflist();
        assert!(
            Bridge::of(&network(dual)).is_none(),
            "dual-stack: the plugins"
        );
    }

    #[test]
    fn hostport_elements() {
        let mapping = PortMapping {
            host_port: 8080,
            container_port: 80,
            protocol: "udp".into(),
            host_ip: String::new(),
        };
        assert_eq!(
            hostport_element(&mapping, Some(Ipv4Addr::new(10, 0, 0, 5))),
            "hostports { udp . 8080 : 10.0.0.5 . 80 }"
        );
        let on_ip = PortMapping {
            host_ip: "192.168.1.2".into(),
            ..mapping
        };
        assert_eq!(
            hostport_element(&on_ip, None),
            "hostip_ports { 192.168.1.2 . udp . 8080 }"
        );
        assert_eq!(veth_name("abc").len(), 12);
        assert_ne!(veth_name("abc"), veth_name("abd"));
    }

    #[test]
    fn connects_and_disconnects_as_root() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let bridge = Bridge::of(&network(
            DefaultNetwork {
                subnets: vec!["10.244.84.0/28".into()],
                bridge: "trellisut84".into(),
                ipam_dir: dir.path().join("ipam"),
            }
            .conflist(),
        ))
        .unwrap();
        let pod = Pod {
            id: "unit-bridge".into(),
            netns: netns::pin_path(dir.path(), "unit-bridge"),
            ..Pod::default()
        };
        netns::create(&pod.netns).unwrap();
        let attached = bridge.attach(dir.path(), &pod);
        let listener = netns::run_in(&pod.netns, || std::net::TcpListener::bind("0.0.0.0:8080"));
        // Through netlink, as the port was set: sysfs may show another namespace.
        let hairpin = std::process::Command::new("bridge")
            .args(["-d", "link", "show", "dev", &veth_name(&pod.id)])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
        let reached = attached.as_ref().is_ok_and(|ip| {
            std::net::TcpStream::connect_timeout(
                &(*ip, 8080).into(),
                std::time::Duration::from_secs(2),
            )
            .is_ok()
        });
        drop(listener);
        let detached = detach(dir.path(), &pod.id);
        let _ = netns::remove(&pod.netns);
        let _ = std::process::Command::new("ip")
            .args(["link", "del", "trellisut84"])
            .status();
        let _ = std::process::Command::new("nft")
            .args(["delete", "table", "ip", "trellisut84"])
            .status();
        assert_eq!(attached.unwrap(), IpAddr::from([10, 244, 84, 2]));
        assert!(reached, "the host reaches the pod");
        let hairpin = hairpin.unwrap();
        assert!(hairpin.contains("hairpin on"), "{hairpin}");
        detached.unwrap();
        assert!(recorded_none(dir.path()));
    }

    fn recorded_none(root: &Path) -> bool {
        std::fs::read_dir(root.join("bridge")).map_or(true, |d| d.count() == 0)
    }
}
