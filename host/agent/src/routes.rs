//! Routes between nodes (flannel's two backends): the agent watches every Node and
//! keeps, for each other Node with a podCIDR and an InternalIP, a route to that podCIDR
//! — via the Node's InternalIP when it is on a subnet of one of this node's links
//! (`host-gw`), else through the VXLAN device [`VXLAN_DEVICE`] (`vxlan`). It also turns
//! on IP forwarding and masquerades pod traffic that leaves the cluster CIDR, in an
//! nftables table of its own ([`NFT_TABLE`]).
//!
//! Changes are applied by diff: the routes in the kernel that carry Trellis' protocol
//! ([`ROUTE_PROTOCOL`]) are compared with the wanted ones; only what differs is
//! replaced, and a route whose Node went is deleted. Routes of anyone else are never
//! read as ours nor touched.
//!
//! Links, addresses, routes and neighbours are spoken over rtnetlink (the `rtnetlink`
//! crate): a VXLAN device with its fdb and neighbour entries is more netlink than a
//! hand-written message is worth, and no `ip` process is spawned per change. The
//! netlink socket lives in the network namespace of the thread that opens it: the
//! agent's. nftables is driven by `nft -f -`, one transaction that replaces the table
//! as a whole (its only user is this module), never another table.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use futures::TryStreamExt as _;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::watcher;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourFlags};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol,
};
use rtnetlink::{Handle, LinkUnspec, LinkVxlan, RouteMessageBuilder};
use tokio::io::AsyncWriteExt as _;
use tracing::{info, warn};
use trellis_api::Shutdown;
use trellis_client::events::EventType;

use crate::Context;

/// The `protocol` of Trellis' routes (`ip route show proto 84`): what tells them from
/// the kernel's, DHCP's or another network's, so that only they are diffed and removed.
/// 84 is `T`, unassigned in iproute2's `rt_protos`.
pub const ROUTE_PROTOCOL: u8 = 84;
/// The VXLAN device, as flannel's `flannel.1`.
pub const VXLAN_DEVICE: &str = "trellis.1";
/// flannel's VNI and UDP port, so that the traffic looks like what operators know.
const VXLAN_VNI: u32 = 1;
const VXLAN_PORT: u16 = 8472;
/// The nftables table of the masquerade rules (`table inet trellis`).
pub const NFT_TABLE: &str = "trellis";

/// How pod traffic reaches another node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// A route via the other node's InternalIP: the nodes share a link.
    HostGw,
    /// An overlay: pod packets in UDP between the nodes' InternalIPs.
    Vxlan,
    /// `host-gw` to the nodes on a shared link, `vxlan` to the others.
    #[default]
    Auto,
}

impl std::str::FromStr for Backend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "host-gw" => Ok(Self::HostGw),
            "vxlan" => Ok(Self::Vxlan),
            "auto" => Ok(Self::Auto),
            other => Err(format!(
                "unknown pod network backend {other:?} (host-gw, vxlan or auto)"
            )),
        }
    }
}

/// An address and its prefix length: a subnet.
pub type Cidr = (IpAddr, u8);

/// How one route goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Via {
    /// Through the other node's InternalIP, on a shared link.
    Gateway(IpAddr),
    /// Through the VXLAN device to `node` (its InternalIP), whose device has address
    /// `vtep` (the first address of its podCIDR, as flannel's) and MAC `mac`.
    Vxlan {
        vtep: Ipv4Addr,
        mac: [u8; 6],
        node: Ipv4Addr,
    },
}

/// What the Nodes ask for: a route per other node's podCIDR, and the Nodes no backend
/// reaches (with why).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub routes: BTreeMap<Cidr, Via>,
    pub unreachable: Vec<(String, String)>,
    /// Every Node's podCIDRs (this node's too): the cluster's, when no cluster CIDR is
    /// set.
    pub pod_cidrs: BTreeSet<Cidr>,
    /// This node's podCIDRs: the sources that are masqueraded.
    pub own: BTreeSet<Cidr>,
}

/// The routes node `own` wants to the other `nodes`, given the subnets of its links
/// (`connected`) and its own addresses (`local`): a Node whose InternalIP is one of
/// them is on this machine (a test's, or a stale Node of this one), and no route leads
/// to it.
pub fn plan(
    backend: Backend,
    own: &str,
    nodes: &[Arc<Node>],
    connected: &[Cidr],
    local: &[IpAddr],
) -> Plan {
    let mut plan = Plan::default();
    for node in nodes {
        let name = node.metadata.name.clone().unwrap_or_default();
        let cidrs: Vec<Cidr> = pod_cidrs(node);
        plan.pod_cidrs.extend(cidrs.iter().copied());
        if name == own {
            plan.own.extend(cidrs);
            continue;
        }
        let ips = internal_ips(node);
        for cidr in cidrs {
            let Some(ip) = ips.iter().find(|ip| ip.is_ipv4() == cidr.0.is_ipv4()) else {
                if !ips.is_empty() {
                    plan.unreachable.push((
                        name.clone(),
                        format!("no InternalIP of the family of {}", show(cidr)),
                    ));
                }
                continue;
            };
            if ip.is_loopback() || local.contains(ip) {
                plan.unreachable.push((
                    name.clone(),
                    format!("its InternalIP {ip} is an address of this node"),
                ));
                continue;
            }
            let shared = connected.iter().any(|subnet| contains(*subnet, *ip));
            let via = match (backend, shared, ip) {
                (Backend::HostGw | Backend::Auto, true, _) => Via::Gateway(*ip),
                (Backend::Vxlan | Backend::Auto, _, IpAddr::V4(node_ip)) => {
                    let IpAddr::V4(network) = cidr.0 else {
                        continue;
                    };
                    Via::Vxlan {
                        vtep: network,
                        mac: vtep_mac(*node_ip),
                        node: *node_ip,
                    }
                }
                (Backend::HostGw, false, _) => {
                    plan.unreachable.push((
                        name.clone(),
                        format!("its InternalIP {ip} is on no link of this node (host-gw)"),
                    ));
                    continue;
                }
                (_, _, IpAddr::V6(_)) => {
                    plan.unreachable.push((
                        name.clone(),
                        format!("its InternalIP {ip} is on no link of this node and VXLAN carries IPv4 only"),
                    ));
                    continue;
                }
            };
            plan.routes.insert(cidr, via);
        }
    }
    plan
}

/// The MAC of the VXLAN device of the node at `ip`: made from the IP so that no Node
/// needs to publish it (flannel annotates its Nodes with theirs). Locally administered
/// (`0e:54` is "T"), so it meets no vendor's.
pub fn vtep_mac(ip: Ipv4Addr) -> [u8; 6] {
    let [a, b, c, d] = ip.octets();
    [0x0e, 0x54, a, b, c, d]
}

fn pod_cidrs(node: &Node) -> Vec<Cidr> {
    let spec = node.spec.as_ref();
    let listed = spec.and_then(|s| s.pod_cidrs.clone()).unwrap_or_default();
    let one = spec.and_then(|s| s.pod_cidr.clone());
    listed
        .into_iter()
        .chain(one)
        .filter_map(|c| parse_cidr(&c))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

fn internal_ips(node: &Node) -> Vec<IpAddr> {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP")
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

/// `10.42.1.0/24` as an address (its network's) and a prefix length.
pub fn parse_cidr(cidr: &str) -> Option<Cidr> {
    let (ip, bits) = cidr.trim().split_once('/')?;
    let ip: IpAddr = ip.parse().ok()?;
    let bits: u8 = bits.parse().ok()?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    (bits <= max).then(|| (network(ip, bits), bits))
}

fn network(ip: IpAddr, bits: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask))
        }
        IpAddr::V6(v6) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
            IpAddr::V6((u128::from(v6) & mask).into())
        }
    }
}

/// Whether `ip` is in subnet `cidr`.
pub fn contains((net, bits): Cidr, ip: IpAddr) -> bool {
    net.is_ipv4() == ip.is_ipv4() && network(ip, bits) == net
}

fn show((ip, bits): Cidr) -> String {
    format!("{ip}/{bits}")
}

/// The nftables transaction that makes [`NFT_TABLE`] masquerade what leaves `own` for
/// outside `cluster` (and not for multicast), replacing the table whole.
pub fn masquerade_rules(own: &BTreeSet<Cidr>, cluster: &BTreeSet<Cidr>) -> String {
    let mut rules = String::new();
    for (family, v4) in [("ip", true), ("ip6", false)] {
        let set = |cidrs: &BTreeSet<Cidr>| {
            cidrs
                .iter()
                .filter(|c| c.0.is_ipv4() == v4)
                .map(|c| show(*c))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (sources, inside) = (set(own), set(cluster));
        if sources.is_empty() {
            continue;
        }
        let multicast = if v4 { "224.0.0.0/4" } else { "ff00::/8" };
        let inside = if inside.is_empty() {
            String::new()
        } else {
            format!(" {family} daddr != {{ {inside} }}")
        };
        rules.push_str(&format!(
            "\t\t{family} saddr {{ {sources} }}{inside} {family} daddr != {multicast} masquerade\n"
        ));
    }
    // `add` then `delete` makes the delete succeed on a first run: the whole is one
    // transaction, so nothing goes out unmasqueraded in between.
    format!(
        "add table inet {NFT_TABLE}\ndelete table inet {NFT_TABLE}\ntable inet {NFT_TABLE} {{\n\tchain postrouting {{\n\t\ttype nat hook postrouting priority srcnat; policy accept;\n{rules}\t}}\n}}\n"
    )
}

/// Keeps the routes to the other nodes, forwarding and the masquerade until `stopped`.
pub async fn run(ctx: Arc<Context>, stopped: Shutdown) {
    let nodes = ctx
        .informers
        .informer::<Node>(Api::all(ctx.client.clone()), watcher::Config::default());
    let mut changes = nodes.subscribe();
    let mut state = match Routes::open(&ctx) {
        Ok(state) => state,
        Err(e) => {
            warn!(error = %format!("{e:#}"), "failed to open netlink: no routes between nodes");
            return;
        }
    };
    nodes.wait_synced().await;
    loop {
        // Every change queued is one sync.
        while changes.try_recv().is_ok() {}
        if let Err(e) = state.sync(&ctx, &nodes.list()).await {
            warn!(error = %format!("{e:#}"), "failed to program the routes between nodes");
        }
        tokio::select! {
            change = changes.recv() => if change.is_none() { return },
            _ = tokio::time::sleep(ctx.config.route_resync) => {}
            _ = stopped.wait() => return,
        }
    }
}

/// What this node has programmed.
struct Routes {
    handle: Handle,
    connection: tokio::task::JoinHandle<()>,
    /// The VXLAN peers whose neighbour and fdb entries are in place, by node IP.
    peers: BTreeMap<Ipv4Addr, (Ipv4Addr, [u8; 6])>,
    /// The nftables transaction last applied.
    masquerade: Option<String>,
    /// Forwarding is on for IPv4 / IPv6.
    forwarding: (bool, bool),
    /// Nodes told unreachable, not to repeat the event at each sync.
    warned: BTreeSet<(String, String)>,
}

impl Drop for Routes {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

impl Routes {
    fn open(_ctx: &Context) -> anyhow::Result<Self> {
        let (connection, handle, _) = rtnetlink::new_connection()?;
        Ok(Self {
            handle,
            connection: tokio::spawn(connection),
            peers: BTreeMap::new(),
            masquerade: None,
            forwarding: (false, false),
            warned: BTreeSet::new(),
        })
    }

    async fn sync(&mut self, ctx: &Context, nodes: &[Arc<Node>]) -> anyhow::Result<()> {
        let (connected, local) = self.links().await?;
        let plan = plan(
            ctx.config.pod_network_backend,
            &ctx.config.node_name,
            nodes,
            &connected,
            &local,
        );
        for (node, why) in &plan.unreachable {
            if self.warned.insert((node.clone(), why.clone())) {
                warn!(node = %node, "no route to the pods of the node: {why}");
                let reached = nodes
                    .iter()
                    .find(|n| n.metadata.name.as_deref() == Some(node.as_str()));
                if let Some(reached) = reached {
                    ctx.events.record(
                        reached.as_ref(),
                        EventType::Warning,
                        "NodeUnreachable",
                        &format!(
                            "node {} has no route to its pods: {why}",
                            ctx.config.node_name
                        ),
                    );
                }
            }
        }
        self.forwarding(&plan.own)?;
        let vxlan = self.vxlan(ctx, &plan).await?;
        self.routes(&plan, vxlan).await?;
        let cluster: BTreeSet<Cidr> = if ctx.config.cluster_cidrs.is_empty() {
            plan.pod_cidrs.clone()
        } else {
            ctx.config
                .cluster_cidrs
                .iter()
                .filter_map(|c| parse_cidr(c))
                .collect()
        };
        if !plan.own.is_empty() {
            let rules = masquerade_rules(&plan.own, &cluster);
            if self.masquerade.as_ref() != Some(&rules) {
                nft(&rules).await?;
                info!(node = %ctx.config.node_name, "masquerading pod traffic that leaves the cluster");
                self.masquerade = Some(rules);
            }
        }
        Ok(())
    }

    /// Turns on forwarding for the families of this node's pods: routed pod traffic
    /// crosses the node.
    fn forwarding(&mut self, own: &BTreeSet<Cidr>) -> anyhow::Result<()> {
        let write = |path: &str| {
            std::fs::write(path, "1").map_err(|e| anyhow::anyhow!("turn on {path}: {e}"))
        };
        if !self.forwarding.0 && own.iter().any(|c| c.0.is_ipv4()) {
            write("/proc/sys/net/ipv4/ip_forward")?;
            self.forwarding.0 = true;
        }
        if !self.forwarding.1 && own.iter().any(|c| c.0.is_ipv6()) {
            write("/proc/sys/net/ipv6/conf/all/forwarding")?;
            self.forwarding.1 = true;
        }
        Ok(())
    }

    /// The subnets of this node's links (not host-scoped ones, not the VXLAN device's),
    /// and all of its addresses.
    async fn links(&self) -> anyhow::Result<(Vec<Cidr>, Vec<IpAddr>)> {
        let vxlan = self.link_index(VXLAN_DEVICE).await?;
        let mut addresses = self.handle.address().get().execute();
        let (mut subnets, mut local) = (Vec::new(), Vec::new());
        while let Some(address) = addresses.try_next().await? {
            let linked = Some(address.header.index) != vxlan
                && address.header.scope != rtnetlink::packet_route::address::AddressScope::Host;
            for attribute in &address.attributes {
                if let AddressAttribute::Address(ip) = attribute {
                    local.push(*ip);
                    if linked {
                        let bits = address.header.prefix_len;
                        subnets.push((network(*ip, bits), bits));
                    }
                }
            }
        }
        Ok((subnets, local))
    }

    async fn link_index(&self, name: &str) -> anyhow::Result<Option<u32>> {
        let mut links = self.handle.link().get().match_name(name).execute();
        match links.try_next().await {
            Ok(link) => Ok(link.map(|l| l.header.index)),
            // ENODEV: no such link.
            Err(rtnetlink::Error::NetlinkError(e)) if e.code.map(|c| c.get()) == Some(-19) => {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The VXLAN device's index when some route needs it (made then, if missing), and
    /// its neighbour and fdb entries to each peer, by diff with those in place.
    async fn vxlan(&mut self, ctx: &Context, plan: &Plan) -> anyhow::Result<Option<u32>> {
        let wanted: BTreeMap<Ipv4Addr, (Ipv4Addr, [u8; 6])> = plan
            .routes
            .values()
            .filter_map(|via| match via {
                Via::Vxlan { vtep, mac, node } => Some((*node, (*vtep, *mac))),
                Via::Gateway(_) => None,
            })
            .collect();
        let mut index = self.link_index(VXLAN_DEVICE).await?;
        if wanted.is_empty() && self.peers.is_empty() {
            return Ok(index);
        }
        let IpAddr::V4(local) = ctx.config.node_ip else {
            anyhow::bail!(
                "VXLAN needs an IPv4 node address, not {}",
                ctx.config.node_ip
            );
        };
        if index.is_none() {
            self.handle
                .link()
                .add(
                    LinkVxlan::new(VXLAN_DEVICE, VXLAN_VNI)
                        .port(VXLAN_PORT)
                        .local(local)
                        .learning(false)
                        .address(vtep_mac(local).to_vec())
                        .up()
                        .build(),
                )
                .execute()
                .await
                .map_err(|e| anyhow::anyhow!("add {VXLAN_DEVICE}: {e}"))?;
            index = self.link_index(VXLAN_DEVICE).await?;
            info!(device = VXLAN_DEVICE, "made the VXLAN device");
        }
        let index = index.ok_or_else(|| anyhow::anyhow!("{VXLAN_DEVICE} is gone"))?;
        // Its address is this node's VTEP (the first of its IPv4 podCIDR), the source of
        // what the node itself sends through it.
        if let Some((IpAddr::V4(vtep), _)) = plan.own.iter().find(|c| c.0.is_ipv4()) {
            self.handle
                .address()
                .add(index, IpAddr::V4(*vtep), 32)
                .replace()
                .execute()
                .await
                .map_err(|e| anyhow::anyhow!("address {VXLAN_DEVICE}: {e}"))?;
        }
        self.handle
            .link()
            .set(LinkUnspec::new_with_index(index).up().build())
            .execute()
            .await
            .map_err(|e| anyhow::anyhow!("bring {VXLAN_DEVICE} up: {e}"))?;
        for (node, (vtep, mac)) in &wanted {
            if self.peers.get(node) == Some(&(*vtep, *mac)) {
                continue;
            }
            self.handle
                .neighbours()
                .add(index, IpAddr::V4(*vtep))
                .link_layer_address(mac)
                .replace()
                .execute()
                .await
                .map_err(|e| anyhow::anyhow!("neighbour {vtep} on {VXLAN_DEVICE}: {e}"))?;
            self.handle
                .neighbours()
                .add_bridge(index, mac)
                .flags(NeighbourFlags::Own)
                .destination(IpAddr::V4(*node))
                .replace()
                .execute()
                .await
                .map_err(|e| anyhow::anyhow!("fdb entry to {node} on {VXLAN_DEVICE}: {e}"))?;
            self.peers.insert(*node, (*vtep, *mac));
        }
        let gone: Vec<_> = self
            .peers
            .iter()
            .filter(|(node, _)| !wanted.contains_key(node))
            .map(|(node, entry)| (*node, *entry))
            .collect();
        for (node, (vtep, mac)) in gone {
            let mut neighbour = rtnetlink::packet_route::neighbour::NeighbourMessage::default();
            neighbour.header.family = AddressFamily::Inet;
            neighbour.header.ifindex = index;
            neighbour
                .attributes
                .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(
                    vtep,
                )));
            let mut fdb = rtnetlink::packet_route::neighbour::NeighbourMessage::default();
            fdb.header.family = AddressFamily::Bridge;
            fdb.header.ifindex = index;
            fdb.header.flags = NeighbourFlags::Own;
            fdb.attributes
                .push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
            fdb.attributes
                .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(
                    node,
                )));
            for message in [neighbour, fdb] {
                if let Err(e) = self.handle.neighbours().del(message).execute().await {
                    warn!(node = %node, error = %e, "failed to remove a VXLAN entry of a node gone");
                }
            }
            self.peers.remove(&node);
        }
        Ok(Some(index))
    }

    /// Trellis' routes in the kernel, by destination.
    async fn installed(&self) -> anyhow::Result<BTreeMap<Cidr, RouteMessage>> {
        let mut installed = BTreeMap::new();
        for family in [
            RouteMessageBuilder::<Ipv4Addr>::new().build(),
            RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
        ] {
            let mut routes = self.handle.route().get(family).execute();
            while let Some(route) = routes.try_next().await? {
                if route.header.protocol != RouteProtocol::Other(ROUTE_PROTOCOL)
                    || route.header.table != RouteHeader::RT_TABLE_MAIN
                {
                    continue;
                }
                let destination = route.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Destination(RouteAddress::Inet(ip)) => Some(IpAddr::V4(*ip)),
                    RouteAttribute::Destination(RouteAddress::Inet6(ip)) => Some(IpAddr::V6(*ip)),
                    _ => None,
                });
                if let Some(destination) = destination {
                    installed.insert((destination, route.header.destination_prefix_length), route);
                }
            }
        }
        Ok(installed)
    }

    /// Adds or replaces the routes that differ from the plan, deletes Trellis' routes
    /// the plan has not.
    async fn routes(&self, plan: &Plan, vxlan: Option<u32>) -> anyhow::Result<()> {
        let installed = self.installed().await?;
        for (cidr, via) in &plan.routes {
            let route = match route_message(*cidr, via, vxlan) {
                Some(route) => route,
                None => continue,
            };
            if installed
                .get(cidr)
                .is_some_and(|old| same_route(old, &route))
            {
                continue;
            }
            self.handle
                .route()
                .add(route)
                .replace()
                .execute()
                .await
                .map_err(|e| anyhow::anyhow!("route to {}: {e}", show(*cidr)))?;
            info!(pods = %show(*cidr), via = ?via, "route to a node's pods");
        }
        for (cidr, route) in installed {
            if plan.routes.contains_key(&cidr) {
                continue;
            }
            self.handle
                .route()
                .del(route)
                .execute()
                .await
                .map_err(|e| anyhow::anyhow!("remove the route to {}: {e}", show(cidr)))?;
            info!(pods = %show(cidr), "removed the route to the pods of a node gone");
        }
        Ok(())
    }
}

/// The route to `cidr` as `via` says, with Trellis' protocol.
fn route_message((ip, bits): Cidr, via: &Via, vxlan: Option<u32>) -> Option<RouteMessage> {
    let protocol = RouteProtocol::Other(ROUTE_PROTOCOL);
    let route = match (ip, via) {
        (IpAddr::V4(dst), Via::Gateway(IpAddr::V4(gateway))) => {
            RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(dst, bits)
                .gateway(*gateway)
                .protocol(protocol)
                .build()
        }
        (IpAddr::V6(dst), Via::Gateway(IpAddr::V6(gateway))) => {
            RouteMessageBuilder::<std::net::Ipv6Addr>::new()
                .destination_prefix(dst, bits)
                .gateway(*gateway)
                .protocol(protocol)
                .build()
        }
        // As flannel: via the peer's VTEP address, on the device, which the neighbour
        // entry gives its MAC and the fdb entry its node.
        (IpAddr::V4(dst), Via::Vxlan { vtep, .. }) => RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(dst, bits)
            .gateway(*vtep)
            .output_interface(vxlan?)
            .onlink()
            .protocol(protocol)
            .build(),
        _ => return None,
    };
    Some(route)
}

/// Whether an installed route goes where `wanted` does (its gateway and, when
/// `wanted` names one, its device).
fn same_route(installed: &RouteMessage, wanted: &RouteMessage) -> bool {
    let gateway = |r: &RouteMessage| {
        r.attributes.iter().find_map(|a| match a {
            RouteAttribute::Gateway(g) => Some(g.clone()),
            _ => None,
        })
    };
    let device = |r: &RouteMessage| {
        r.attributes.iter().find_map(|a| match a {
            RouteAttribute::Oif(i) => Some(*i),
            _ => None,
        })
    };
    gateway(installed) == gateway(wanted)
        && (device(wanted).is_none() || device(installed) == device(wanted))
}

/// Applies an nftables transaction with `nft -f -` (in the agent's network namespace:
/// a child starts in its spawning thread's).
async fn nft(rules: &str) -> anyhow::Result<()> {
    let mut child = tokio::process::Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| anyhow::anyhow!("run nft: {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(rules.as_bytes()).await?;
    }
    let output = child.wait_with_output().await?;
    anyhow::ensure!(
        output.status.success(),
        "nft refused the masquerade table: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str, cidr: Option<&str>, ip: Option<&str>) -> Arc<Node> {
        let mut node = json!({"metadata": {"name": name}, "spec": {}, "status": {}});
        if let Some(cidr) = cidr {
            node["spec"] = json!({"podCIDR": cidr, "podCIDRs": [cidr]});
        }
        if let Some(ip) = ip {
            node["status"] = json!({"addresses": [{"type": "InternalIP", "address": ip}]});
        }
        Arc::new(serde_json::from_value(node).unwrap())
    }

    fn cidr(s: &str) -> Cidr {
        parse_cidr(s).unwrap()
    }

    #[test]
    fn nodes_on_a_shared_link_get_host_gw_routes_and_others_vxlan() {
        let nodes = [
            node("me", Some("10.42.0.0/24"), Some("192.168.1.10")),
            node("near", Some("10.42.1.0/24"), Some("192.168.1.11")),
            node("far", Some("10.42.2.0/24"), Some("172.16.0.5")),
            node("new", None, Some("192.168.1.12")),
            node("silent", Some("10.42.3.0/24"), None),
        ];
        let connected = [cidr("192.168.1.0/24"), cidr("10.42.0.1/24")];
        let local = [
            "192.168.1.10".parse().unwrap(),
            "10.42.0.1".parse().unwrap(),
        ];
        let auto = plan(Backend::Auto, "me", &nodes, &connected, &local);
        assert_eq!(
            auto.routes,
            BTreeMap::from([
                (
                    cidr("10.42.1.0/24"),
                    Via::Gateway("192.168.1.11".parse().unwrap())
                ),
                (
                    cidr("10.42.2.0/24"),
                    Via::Vxlan {
                        vtep: "10.42.2.0".parse().unwrap(),
                        mac: [0x0e, 0x54, 172, 16, 0, 5],
                        node: "172.16.0.5".parse().unwrap(),
                    }
                ),
            ])
        );
        assert!(auto.unreachable.is_empty(), "{:?}", auto.unreachable);
        assert_eq!(auto.own, BTreeSet::from([cidr("10.42.0.0/24")]));
        assert_eq!(auto.pod_cidrs.len(), 4);

        let host_gw = plan(Backend::HostGw, "me", &nodes, &connected, &local);
        assert_eq!(host_gw.routes.len(), 1);
        assert_eq!(host_gw.unreachable.len(), 1);
        assert_eq!(host_gw.unreachable[0].0, "far");

        let vxlan = plan(Backend::Vxlan, "me", &nodes, &connected, &local);
        assert!(
            vxlan
                .routes
                .values()
                .all(|v| matches!(v, Via::Vxlan { .. }))
        );
        assert_eq!(vxlan.routes.len(), 2);

        // A Node at one of this node's addresses is this machine: no route to it.
        let twins = [
            node("me", Some("10.42.0.0/24"), Some("192.168.1.10")),
            node("twin", Some("10.42.5.0/24"), Some("192.168.1.10")),
            node("loop", Some("10.42.6.0/24"), Some("127.0.0.1")),
        ];
        let same = plan(Backend::Auto, "me", &twins, &connected, &local);
        assert!(same.routes.is_empty(), "{:?}", same.routes);
        assert_eq!(same.unreachable.len(), 2);
    }

    #[test]
    fn the_masquerade_spares_the_cluster_and_replaces_only_its_table() {
        let rules = masquerade_rules(
            &BTreeSet::from([cidr("10.42.0.0/24")]),
            &BTreeSet::from([cidr("10.42.0.0/16")]),
        );
        assert!(rules.starts_with("add table inet trellis\ndelete table inet trellis\n"));
        assert!(
            rules.contains(
                "ip saddr { 10.42.0.0/24 } ip daddr != { 10.42.0.0/16 } ip daddr != 224.0.0.0/4 masquerade"
            ),
            "{rules}"
        );
        assert!(!rules.contains("ip6"), "{rules}");
        assert_eq!(rules.matches("table ").count(), 3);
    }

    #[test]
    fn cidrs_are_read_as_their_network() {
        assert_eq!(cidr("10.42.1.7/24"), ("10.42.1.0".parse().unwrap(), 24));
        assert_eq!(cidr("fd00::1/64"), ("fd00::".parse().unwrap(), 64));
        assert!(parse_cidr("10.42.1.0").is_none());
        assert!(parse_cidr("10.42.1.0/33").is_none());
        assert!(contains(cidr("10.0.0.0/8"), "10.1.2.3".parse().unwrap()));
        assert!(!contains(cidr("10.0.0.0/8"), "fd00::1".parse().unwrap()));
    }
}
