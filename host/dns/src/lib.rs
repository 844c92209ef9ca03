//! Cluster DNS: the names the Kubernetes DNS-Based Service Discovery specification
//! gives Services, their endpoints and pods under the cluster domain, answered from the
//! node's shared informers, and every other name forwarded to the node's upstream
//! resolvers through a small cache. Served over UDP and TCP by `hickory-server`.
//!
//! Start with [`DnsServer::start`]: it binds its addresses, follows Services and
//! EndpointSlices and answers until its [`Shutdown`].
//!
//! # Layout
//! - [`records`]: the cluster's records, rebuilt per Service on each change and kept in
//!   one map by name.
//! - [`handler`]: the `hickory-server` request handler: the cluster's names, else the
//!   forwarder.
//! - [`forward`]: upstream forwarding and its cache.
//! - [`metrics`]: CoreDNS' metrics.

mod forward;
mod handler;
mod metrics;
mod records;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context as _;
use hickory_server::Server;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::runtime::watcher;
use tokio::sync::mpsc;
use tracing::warn;
use trellis_api::Shutdown;
use trellis_client::informer::{Change, SharedInformers};

use crate::forward::Forwarder;
use crate::handler::Handler;
use crate::metrics::Metrics;
use crate::records::Zone;

/// What the server serves and where.
#[derive(Clone, Debug)]
pub struct DnsConfig {
    /// Addresses to serve on, UDP and TCP (169.254.20.10 and the kube-dns ClusterIP).
    pub listen: Vec<SocketAddr>,
    /// The cluster domain (`cluster.local`).
    pub cluster_domain: String,
    /// Upstream resolvers for names outside the cluster domain (the node's resolv.conf,
    /// minus the listen addresses); empty: REFUSED for those.
    pub upstream: Vec<SocketAddr>,
    /// The TTL of every cluster record (5 s, as CoreDNS' kubernetes plugin).
    pub ttl: u32,
    /// How many upstream answers the cache keeps.
    pub cache_entries: usize,
    /// The service CIDR(s), for PTR of ClusterIPs.
    pub service_cidrs: Vec<String>,
    /// How long one upstream has to answer before the next is asked.
    pub upstream_timeout: Duration,
    /// How long a TCP client may stay silent before its connection is closed.
    pub tcp_idle_timeout: Duration,
}

impl DnsConfig {
    pub fn new(listen: Vec<SocketAddr>) -> Self {
        Self {
            listen,
            cluster_domain: "cluster.local".to_owned(),
            upstream: Vec::new(),
            ttl: 5,
            cache_entries: 10_000,
            service_cidrs: vec!["10.43.0.0/16".to_owned()],
            upstream_timeout: Duration::from_secs(2),
            tcp_idle_timeout: Duration::from_secs(10),
        }
    }
}

/// A running server.
#[derive(Debug)]
pub struct DnsServer {
    local_addrs: Vec<SocketAddr>,
    metrics: Metrics,
}

/// Answers buffered per TCP connection.
const TCP_RESPONSE_BUFFER: usize = 32;

impl DnsServer {
    /// Binds every listen address on the calling thread's network namespace (the agent's
    /// runtime threads are in the node's), then serves until `stopped`. Services and
    /// EndpointSlices come from `informers` (started with `client` unless already
    /// running in the process); until their first lists are in, the cluster's names are
    /// answered SERVFAIL (resolvers retry), not NXDOMAIN.
    pub async fn start(
        config: DnsConfig,
        client: kube::Client,
        informers: SharedInformers,
        stopped: Shutdown,
    ) -> anyhow::Result<Self> {
        let zone = Arc::new(RwLock::new(
            Zone::new(&config.cluster_domain, config.ttl, &config.service_cidrs)
                .context("make the cluster zone")?,
        ));
        let synced = Arc::new(AtomicBool::new(false));
        let server = Self::serve(&config, zone.clone(), synced.clone(), stopped.clone())?;

        let services = informers.informer(
            Api::<Service>::all(client.clone()),
            watcher::Config::default(),
        );
        let slices = informers.informer(
            Api::<EndpointSlice>::all(client),
            watcher::Config::default(),
        );
        let service_changes = services.subscribe();
        let slice_changes = slices.subscribe();
        tokio::spawn(follow(
            zone,
            synced,
            services,
            slices,
            service_changes,
            slice_changes,
            stopped,
        ));
        Ok(server)
    }

    /// Serves `zone` on `config.listen` until `stopped`.
    fn serve(
        config: &DnsConfig,
        zone: Arc<RwLock<Zone>>,
        synced: Arc<AtomicBool>,
        stopped: Shutdown,
    ) -> anyhow::Result<Self> {
        let metrics = Metrics::default();
        let handler = Handler {
            zone,
            synced,
            forwarder: Arc::new(Forwarder::new(
                config.upstream.clone(),
                config.upstream_timeout,
                config.cache_entries,
            )),
            metrics: metrics.clone(),
        };

        // Sockets are made here, on the caller's thread, hence in its network namespace.
        let mut server = Server::new(handler);
        let mut local_addrs = Vec::with_capacity(config.listen.len());
        let readers = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(8);
        for listen in &config.listen {
            let (udp, tcp) = bind(*listen, readers)
                .with_context(|| format!("bind the DNS server to {listen}"))?;
            local_addrs.push(tcp.local_addr()?);
            for socket in udp {
                server.register_socket(socket);
            }
            server.register_listener(tcp, config.tcp_idle_timeout, TCP_RESPONSE_BUFFER);
        }

        let shutdown = server.shutdown_token().clone();
        tokio::spawn(async move {
            stopped.wait().await;
            shutdown.cancel();
        });
        tokio::spawn(async move {
            if let Err(e) = server.block_until_done().await {
                warn!(error = %e, "the DNS server stopped");
            }
        });
        Ok(Self {
            local_addrs,
            metrics,
        })
    }

    /// The addresses it serves on (the ports the system chose for port 0).
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        self.local_addrs.clone()
    }

    /// Prometheus text: queries by type and rcode, latency histogram, cache hits.
    pub fn metrics_text(&self) -> String {
        self.metrics.text()
    }
}

/// `readers` UDP sockets on `addr` (one port, SO_REUSEPORT, so that the kernel spreads
/// queries over as many receive loops) and a TCP listener on the same port. Port 0
/// takes a free port for both.
fn bind(
    addr: SocketAddr,
    readers: usize,
) -> anyhow::Result<(Vec<tokio::net::UdpSocket>, tokio::net::TcpListener)> {
    // A port free for UDP may be taken for TCP: a few tries find one free for both.
    let mut last_error = None;
    for _ in 0..if addr.port() == 0 { 8 } else { 1 } {
        let first = udp_socket(addr)?;
        let bound = first.local_addr()?;
        let tcp = match std::net::TcpListener::bind(bound) {
            Ok(tcp) => tcp,
            Err(e) => {
                last_error = Some(e);
                continue;
            }
        };
        tcp.set_nonblocking(true)?;
        let mut udp = vec![tokio::net::UdpSocket::from_std(first)?];
        for _ in 1..readers {
            udp.push(tokio::net::UdpSocket::from_std(udp_socket(bound)?)?);
        }
        return Ok((udp, tokio::net::TcpListener::from_std(tcp)?));
    }
    Err(last_error.map_or_else(|| anyhow::anyhow!("no free port"), anyhow::Error::from))
}

fn udp_socket(addr: SocketAddr) -> anyhow::Result<std::net::UdpSocket> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let family = if addr.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let fd = rustix::net::socket_with(
        family,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    rustix::net::sockopt::set_socket_reuseport(&fd, true)?;
    rustix::net::bind(&fd, &addr)?;
    Ok(std::net::UdpSocket::from(fd))
}

/// Keeps the zone in step with the informers until `stopped`: each change is applied
/// as soon as it arrives (a new Service resolves as soon as its watch event does).
async fn follow(
    zone: Arc<RwLock<Zone>>,
    synced: Arc<AtomicBool>,
    services: Arc<trellis_client::informer::Informer<Service>>,
    slices: Arc<trellis_client::informer::Informer<EndpointSlice>>,
    mut service_changes: mpsc::UnboundedReceiver<Change<Service>>,
    mut slice_changes: mpsc::UnboundedReceiver<Change<EndpointSlice>>,
    stopped: Shutdown,
) {
    let both_synced = async {
        services.wait_synced().await;
        slices.wait_synced().await;
    };
    tokio::pin!(both_synced);
    let mut is_synced = false;
    loop {
        let mut service_batch = Vec::new();
        let mut slice_batch = Vec::new();
        tokio::select! {
            _ = stopped.wait() => return,
            change = service_changes.recv() => match change {
                Some(change) => service_batch.push(change),
                None => return,
            },
            change = slice_changes.recv() => match change {
                Some(change) => slice_batch.push(change),
                None => return,
            },
            () = &mut both_synced, if !is_synced => {}
        }
        // What else is queued goes in under the same lock.
        while let Ok(change) = service_changes.try_recv() {
            service_batch.push(change);
        }
        while let Ok(change) = slice_changes.try_recv() {
            slice_batch.push(change);
        }
        {
            let mut zone = zone.write().unwrap_or_else(|e| e.into_inner());
            for change in service_batch {
                match change {
                    Change::Added(s) | Change::Updated { new: s, .. } => zone.set_service(s),
                    Change::Deleted(s) => zone.delete_service(&s),
                }
            }
            for change in slice_batch {
                match change {
                    Change::Added(s) | Change::Updated { new: s, .. } => zone.set_slice(s),
                    Change::Deleted(s) => zone.delete_slice(&s),
                }
            }
        }
        // Once both first lists are in, their changes were queued before they were
        // marked synced, and are now applied.
        if !is_synced
            && services.has_synced()
            && slices.has_synced()
            && service_changes.is_empty()
            && slice_changes.is_empty()
        {
            is_synced = true;
            synced.store(true, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr as _;

    use hickory_proto::op::{Message, ResponseCode};
    use hickory_proto::rr::{DNSClass, Name, RecordType};
    use hickory_server::net::client::{Client, ClientHandle as _};
    use hickory_server::net::runtime::TokioRuntimeProvider;
    use hickory_server::net::tcp::TcpClientStream;
    use hickory_server::net::udp::UdpClientStream;
    use k8s_openapi::api::core::v1::ServiceSpec;
    use k8s_openapi::api::discovery::v1::Endpoint;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    async fn ask(
        server: SocketAddr,
        name: &str,
        qtype: RecordType,
        tcp: bool,
        edns: bool,
    ) -> Message {
        let provider = TokioRuntimeProvider::new();
        let query = Name::from_str(name).unwrap();
        let response = if tcp {
            let (stream, sender) = TcpClientStream::new(server, None, None, provider);
            let (mut client, background) =
                Client::<TokioRuntimeProvider>::new(stream.await.unwrap(), sender);
            if !edns {
                client.disable_edns();
            }
            tokio::spawn(background);
            client.query(query, DNSClass::IN, qtype).await
        } else {
            let (mut client, background) = Client::<TokioRuntimeProvider>::from_sender(
                UdpClientStream::builder(server, provider).build(),
            );
            if !edns {
                client.disable_edns();
            }
            tokio::spawn(background);
            client.query(query, DNSClass::IN, qtype).await
        };
        response.unwrap().into_message()
    }

    fn service(name: &str, namespace: &str, cluster_ip: &str) -> Arc<Service> {
        Arc::new(Service {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some(namespace.to_owned()),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceSpec {
                cluster_ip: Some(cluster_ip.to_owned()),
                ..ServiceSpec::default()
            }),
            ..Service::default()
        })
    }

    /// A server on a free loopback port, serving `domain` with `services`.
    fn server(
        domain: &str,
        services: Vec<Arc<Service>>,
        slices: Vec<Arc<EndpointSlice>>,
        upstream: Vec<SocketAddr>,
    ) -> (DnsServer, trellis_api::Stop) {
        let mut config = DnsConfig::new(vec!["127.0.0.1:0".parse().unwrap()]);
        config.cluster_domain = domain.to_owned();
        config.upstream = upstream;
        let mut zone = Zone::new(domain, config.ttl, &config.service_cidrs).unwrap();
        for s in services {
            zone.set_service(s);
        }
        for s in slices {
            zone.set_slice(s);
        }
        let (stop, stopped) = Shutdown::new();
        let server = DnsServer::serve(
            &config,
            Arc::new(RwLock::new(zone)),
            Arc::new(AtomicBool::new(true)),
            stopped,
        )
        .unwrap();
        (server, stop)
    }

    #[tokio::test]
    async fn answers_over_udp_and_tcp_and_forwards_the_rest() {
        let (upstream, _stop_upstream) = server(
            "upstream.test",
            vec![service("far", "ns", "10.43.9.9")],
            vec![],
            vec![],
        );
        let (local, _stop) = server(
            "cluster.local",
            vec![service("web", "ns", "10.43.0.20")],
            vec![],
            upstream.local_addrs(),
        );
        let addr = local.local_addrs()[0];
        for tcp in [false, true] {
            let answer = ask(addr, "web.ns.svc.cluster.local.", RecordType::A, tcp, true).await;
            assert_eq!(answer.metadata.response_code, ResponseCode::NoError);
            assert!(answer.metadata.authoritative);
            assert_eq!(answer.answers.len(), 1);
            assert_eq!(answer.answers[0].data.to_string(), "10.43.0.20");
            assert_eq!(answer.answers[0].ttl, 5);

            let missing = ask(addr, "nope.ns.svc.cluster.local.", RecordType::A, tcp, true).await;
            assert_eq!(missing.metadata.response_code, ResponseCode::NXDomain);
            assert_eq!(missing.authorities.len(), 1);
            assert_eq!(missing.authorities[0].record_type(), RecordType::SOA);
            assert_eq!(missing.authorities[0].ttl, 5);

            let no_v6 = ask(
                addr,
                "web.ns.svc.cluster.local.",
                RecordType::AAAA,
                tcp,
                true,
            )
            .await;
            assert_eq!(no_v6.metadata.response_code, ResponseCode::NoError);
            assert!(no_v6.answers.is_empty());

            let far = ask(addr, "far.ns.svc.upstream.test.", RecordType::A, tcp, true).await;
            assert_eq!(far.metadata.response_code, ResponseCode::NoError);
            assert!(!far.metadata.authoritative);
            assert_eq!(far.answers[0].data.to_string(), "10.43.9.9");
        }
        let metrics = local.metrics_text();
        assert!(
            metrics
                .contains(r#"coredns_dns_requests_total{zone="cluster",proto="udp",type="A"} 2"#),
            "{metrics}"
        );
        assert!(
            metrics.contains(r#"coredns_dns_responses_total{zone="cluster",rcode="NXDOMAIN"} 2"#),
            "{metrics}"
        );
        // The second forwarded query (over TCP) came from the cache.
        assert!(metrics.contains("coredns_cache_hits_total 1"), "{metrics}");
        assert!(
            metrics.contains("coredns_forward_requests_total 1"),
            "{metrics}"
        );
    }

    #[tokio::test]
    async fn a_large_answer_is_truncated_over_udp_and_whole_over_tcp() {
        let endpoints = (0..60)
            .map(|i| Endpoint {
                addresses: vec![format!("10.244.118.{i}")],
                ..Endpoint::default()
            })
            .collect();
        let slice = Arc::new(EndpointSlice {
            metadata: ObjectMeta {
                name: Some("many-x".to_owned()),
                namespace: Some("ns".to_owned()),
                labels: Some([(records::SERVICE_NAME_LABEL.to_owned(), "many".to_owned())].into()),
                ..ObjectMeta::default()
            },
            address_type: "IPv4".to_owned(),
            endpoints,
            ports: None,
        });
        let (local, _stop) = server(
            "cluster.local",
            vec![service("many", "ns", "None")],
            vec![slice],
            vec![],
        );
        let addr = local.local_addrs()[0];
        let udp = ask(
            addr,
            "many.ns.svc.cluster.local.",
            RecordType::A,
            false,
            false,
        )
        .await;
        assert!(udp.metadata.truncation);
        assert!(udp.answers.len() < 60);
        let tcp = ask(
            addr,
            "many.ns.svc.cluster.local.",
            RecordType::A,
            true,
            false,
        )
        .await;
        assert!(!tcp.metadata.truncation);
        assert_eq!(tcp.answers.len(), 60);
    }
}
