//! What makes Services work on this node: the service proxy (`trellis-proxy`, kube-proxy's
//! part) and the node-local cluster DNS server (`trellis-dns`, NodeLocal DNSCache's
//! part), both in the agent's network namespace — the node's.
//!
//! The DNS server answers on the addresses of a dummy link of its own, [`LINK`]: the
//! node-local address (`169.254.20.10`, what `ClusterFirst` pods' `resolv.conf` names)
//! and the `kube-dns` Service's ClusterIP (`10.43.0.10`), UDP and TCP port 53, never on
//! every address (the node may run a resolver of its own). The proxy is told that the
//! ClusterIP is served here, so it never sends it elsewhere: a pod that names the
//! ClusterIP reaches this node's server, as with NodeLocal DNSCache.
//!
//! The link is a dummy one, or a bridge without ports where the kernel has no dummy
//! driver (both hold local addresses and carry nothing).
//!
//! The link stays when the agent stops (as the proxy's table does): while an agent
//! restarts, pods' queries to the node-local address fail at once on this node rather
//! than being routed off it by the default route, and the next agent finds the link as
//! it left it. It goes only when an agent starts with node-local DNS turned off
//! (`remove_node_local_dns_link`), so that a cluster that brings its own DNS reaches
//! the ClusterIP through its own proxy.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use futures::TryStreamExt as _;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::{Handle, LinkBridge, LinkDummy, LinkUnspec};
use tracing::{info, warn};
use trellis_api::Shutdown;

use crate::Context;

/// The dummy link holding the node-local DNS addresses (NodeLocal DNSCache's
/// `nodelocaldns`).
pub const LINK: &str = "trellis-dns";
/// The node-local DNS address, NodeLocal DNSCache's default: link-local, so that no
/// packet to it leaves the node.
pub const NODE_LOCAL_DNS_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(169, 254, 20, 10));
/// The `kube-dns` Service's ClusterIP in the default service range (`10.43.0.0/16`).
pub const KUBE_DNS_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 43, 0, 10));
/// The DNS port.
const DNS_PORT: u16 = 53;

/// The proxy and the DNS server while they run.
#[derive(Debug, Default)]
pub struct Services {
    proxy: Option<tokio::task::JoinHandle<()>>,
}

impl Services {
    /// Waits for the proxy to end (it ends with `stopped`).
    pub async fn stopped(self) {
        if let Some(proxy) = self.proxy {
            let _ = proxy.await;
        }
    }
}

/// Starts what the configuration turns on: the link and the DNS server (kept in
/// `ctx.dns` for its metrics), then the proxy. With node-local DNS off, a link an
/// earlier agent left is removed if the configuration says so.
pub async fn start(ctx: &Arc<Context>, stopped: Shutdown) -> anyhow::Result<Services> {
    let config = &ctx.config;
    let addresses = &config.node_local_dns;
    if addresses.is_empty() {
        if config.remove_node_local_dns_link && !served_here(NODE_LOCAL_DNS_IP) {
            remove_link().await?;
        }
    } else {
        ensure_link(addresses)
            .await
            .map_err(|e| anyhow::anyhow!("make the link {LINK}: {e:#}"))?;
        let mut dns = trellis_dns::DnsConfig::new(
            addresses
                .iter()
                .map(|ip| SocketAddr::new(*ip, DNS_PORT))
                .collect(),
        );
        dns.cluster_domain = config.cluster_domain.clone();
        if !config.service_cidrs.is_empty() {
            dns.service_cidrs = config.service_cidrs.clone();
        }
        dns.upstream = upstream(config.resolv_conf.as_deref(), addresses);
        let server = trellis_dns::DnsServer::start(
            dns,
            ctx.client.clone(),
            ctx.informers.clone(),
            stopped.clone(),
        )
        .await
        .map_err(|e| anyhow::anyhow!("serve cluster DNS on {LINK}: {e:#}"))?;
        info!(node = %config.node_name, addresses = ?server.local_addrs(), "serving cluster DNS");
        let _ = ctx.dns.set(server);
    }
    let mut services = Services::default();
    if config.service_proxy {
        let mut proxy = trellis_proxy::ProxyConfig::new(&config.node_name, vec![config.node_ip]);
        proxy.cluster_cidrs = config.cluster_cidrs.clone();
        proxy.service_cidrs = config.service_cidrs.clone();
        // The ClusterIP the DNS server answers on is delivered here, never DNATed.
        proxy.local_service_ips = addresses
            .iter()
            .copied()
            .filter(|ip| *ip != NODE_LOCAL_DNS_IP)
            .collect();
        proxy.sync_period = config.proxy_sync_period;
        proxy.min_sync_interval = config.proxy_min_sync_interval;
        let (client, informers) = (ctx.client.clone(), ctx.informers.clone());
        let node = config.node_name.clone();
        services.proxy = Some(tokio::spawn(async move {
            if let Err(e) = trellis_proxy::run(proxy, client, informers, stopped).await {
                warn!(node = %node, "failed to run the service proxy: {e:#}");
            }
        }));
    }
    Ok(services)
}

/// The node's resolvers, from its `resolv.conf`, that the DNS server forwards other
/// names to: not its own addresses (a node whose `resolv.conf` names the node-local
/// address would otherwise ask itself).
pub fn upstream(resolv_conf: Option<&std::path::Path>, own: &[IpAddr]) -> Vec<SocketAddr> {
    let Some(path) = resolv_conf else {
        return Vec::new();
    };
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) => {
            warn!(file = %path.display(), error = %e, "read the node's resolvers failed: names outside the cluster do not resolve");
            return Vec::new();
        }
    };
    crate::dns::parse_resolv_conf(&text)
        .servers
        .iter()
        .filter_map(|s| s.parse::<IpAddr>().ok())
        .filter(|ip| !own.contains(ip))
        .map(|ip| SocketAddr::new(ip, DNS_PORT))
        .collect()
}

/// Makes [`LINK`] (if missing) with exactly `addresses`, up. Idempotent: a restarted
/// agent finds it as it wants it and changes nothing.
async fn ensure_link(addresses: &[IpAddr]) -> anyhow::Result<()> {
    with_handle(|handle| async move {
        let index = match link_index(&handle).await? {
            Some(index) => index,
            None => {
                let dummy = handle
                    .link()
                    .add(LinkDummy::new(LINK).up().build())
                    .execute()
                    .await;
                match dummy {
                    // EOPNOTSUPP: a kernel built without the dummy driver (some VMs'). A
                    // bridge without ports holds local addresses just as well.
                    Err(rtnetlink::Error::NetlinkError(e))
                        if e.code.map(|c| c.get()) == Some(-95) =>
                    {
                        handle
                            .link()
                            .add(LinkBridge::new(LINK).up().build())
                            .execute()
                            .await?;
                        info!(link = LINK, "made the node-local DNS link (a bridge without ports: this kernel has no dummy links)");
                    }
                    other => {
                        other?;
                        info!(link = LINK, "made the node-local DNS link");
                    }
                }
                link_index(&handle)
                    .await?
                    .ok_or_else(|| anyhow::anyhow!("{LINK} is gone"))?
            }
        };
        let wanted: BTreeSet<IpAddr> = addresses.iter().copied().collect();
        let mut present = handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute();
        let mut stale = Vec::new();
        let mut have = BTreeSet::new();
        while let Some(message) = present.try_next().await? {
            let ip = message.attributes.iter().find_map(|a| match a {
                AddressAttribute::Address(ip) => Some(*ip),
                _ => None,
            });
            match ip {
                Some(ip) if wanted.contains(&ip) => {
                    have.insert(ip);
                }
                _ => stale.push(message),
            }
        }
        for message in stale {
            handle.address().del(message).execute().await?;
        }
        for ip in wanted.difference(&have) {
            let bits = if ip.is_ipv4() { 32 } else { 128 };
            handle
                .address()
                .add(index, *ip, bits)
                .replace()
                .execute()
                .await?;
        }
        // Up: the addresses are local (and bindable) only on a link that is up.
        handle
            .link()
            .set(LinkUnspec::new_with_index(index).up().build())
            .execute()
            .await?;
        Ok(())
    })
    .await
}

/// Whether something on this network namespace answers DNS on `ip` now: the link is
/// then another agent's (two nodes of a test on one machine), not one an earlier run
/// left, and stays.
fn served_here(ip: IpAddr) -> bool {
    match std::net::UdpSocket::bind(SocketAddr::new(ip, DNS_PORT)) {
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            info!(link = LINK, %ip, "the node-local DNS address is served here by another node: its link stays");
            true
        }
        _ => false,
    }
}

/// Removes [`LINK`] if it is there.
pub async fn remove_link() -> anyhow::Result<()> {
    with_handle(|handle| async move {
        if let Some(index) = link_index(&handle).await? {
            handle.link().del(index).execute().await?;
            info!(
                link = LINK,
                "removed the node-local DNS link: node-local DNS is off"
            );
        }
        Ok(())
    })
    .await
    .map_err(|e| anyhow::anyhow!("remove the link {LINK}: {e:#}"))
}

/// Runs `f` with an rtnetlink handle in the calling thread's network namespace.
async fn with_handle<F, Fut>(f: F) -> anyhow::Result<()>
where
    F: FnOnce(Handle) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let (connection, handle, _) = rtnetlink::new_connection()?;
    let connection = tokio::spawn(connection);
    let result = f(handle).await;
    connection.abort();
    result
}

async fn link_index(handle: &Handle) -> anyhow::Result<Option<u32>> {
    let mut links = handle.link().get().match_name(LINK.to_owned()).execute();
    match links.try_next().await {
        Ok(link) => Ok(link.map(|l| l.header.index)),
        // ENODEV: no such link.
        Err(rtnetlink::Error::NetlinkError(e)) if e.code.map(|c| c.get()) == Some(-19) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_is_the_nodes_resolvers_without_our_own_addresses() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("resolv.conf");
        std::fs::write(
            &path,
            "nameserver 169.254.20.10\nnameserver 192.168.1.1\nnameserver not-an-ip\nnameserver 10.43.0.10\nsearch example.test\n",
        )
        .unwrap();
        let own = [NODE_LOCAL_DNS_IP, KUBE_DNS_IP];
        assert_eq!(
            upstream(Some(&path), &own),
            ["192.168.1.1:53".parse::<SocketAddr>().unwrap()]
        );
        assert!(upstream(None, &own).is_empty());
        assert!(upstream(Some(&dir.path().join("missing")), &own).is_empty());
    }
}
