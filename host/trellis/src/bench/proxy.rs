//! The service proxy: a full sync of many Services to the kernel, then single endpoint
//! changes, each applied to the kernel and timed, in a network namespace of its own
//! (never the machine's table). Services and EndpointSlices are made here and fed to
//! the proxy's sync code directly: no API server. Then, with the table at that size,
//! HTTP requests (a new connection each, as the first request of a client) to a
//! server in the namespace, straight to its address and through a ClusterIP, timed.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use kube::api::ObjectMeta;
use serde::Serialize;
use trellis_proxy::{Proxier, ProxyConfig, in_new_netns};

use super::Percentiles;

#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// Services, each a ClusterIP; every fourth also a NodePort (the default NodePort
    /// range holds 2,768).
    #[arg(long, default_value_t = 10_000)]
    services: usize,

    #[arg(long, default_value_t = 10)]
    endpoints_per_service: usize,

    /// Single endpoint changes timed after the full sync.
    #[arg(long, default_value_t = 200)]
    changes: usize,

    /// HTTP requests timed straight to the server and through a ClusterIP, each on a
    /// new connection (0: none).
    #[arg(long, default_value_t = 2000)]
    requests: usize,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    services: usize,
    endpoints: usize,
    /// Every Service rendered and written to the kernel in one `nft -f` transaction.
    full_sync_s: f64,
    /// One endpoint replaced: rendered and its transaction applied to the kernel.
    update_p50_ms: f64,
    update_p99_ms: f64,
    update_max_ms: f64,
    /// The periodic drift check at this size: the table's chains and sets read back
    /// (`nft -j -t list table`) and compared.
    drift_check_ms: f64,
    /// The proxy's process (this one) after the changes.
    rss_mb: f64,
    /// A request on a new connection, straight to the server's address...
    direct_p50_ms: f64,
    direct_p99_ms: f64,
    /// ... and through a ClusterIP of the table (DNAT of its first packet).
    clusterip_p50_ms: f64,
    clusterip_p99_ms: f64,
    /// Requests per second through the ClusterIP over those straight to the server,
    /// one client, one after another.
    throughput_kept: f64,
}

/// The server's address, on the namespace's loopback link, and port.
const SERVER: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 200, 0, 2);
const SERVER_PORT: u16 = 8080;

/// Serves every request on `listener` with a short answer, then closes.
async fn serve(listener: tokio::net::TcpListener) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    while let Ok((mut conn, _)) = listener.accept().await {
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let mut read = 0;
            while !buf[..read].windows(4).any(|w| w == b"\r\n\r\n") {
                match conn.read(&mut buf[read..]).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => read += n,
                }
                if read == buf.len() {
                    return;
                }
            }
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                .await;
        });
    }
}

/// `requests` GETs to `to`, each on a connection of its own; their durations and the
/// wall time of all.
async fn requests(
    to: std::net::SocketAddr,
    requests: usize,
) -> anyhow::Result<(Vec<Duration>, Duration)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut samples = Vec::with_capacity(requests);
    let all = Instant::now();
    for _ in 0..requests {
        let started = Instant::now();
        let mut conn = tokio::net::TcpStream::connect(to)
            .await
            .with_context(|| format!("connect to {to}"))?;
        conn.write_all(b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n")
            .await?;
        let mut answer = Vec::new();
        conn.read_to_end(&mut answer).await?;
        anyhow::ensure!(answer.ends_with(b"ok"), "{to} answered {answer:?}");
        samples.push(started.elapsed());
    }
    Ok((samples, all.elapsed()))
}

/// Runs `ip` in the calling thread's network namespace.
async fn ip(args: &[&str]) -> anyhow::Result<()> {
    let status = tokio::process::Command::new("ip")
        .args(args)
        .status()
        .await?;
    anyhow::ensure!(status.success(), "ip {} failed", args.join(" "));
    Ok(())
}

fn service(i: usize) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(format!("svc-{i}")),
            namespace: Some("bench".into()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some(
                if i.is_multiple_of(4) {
                    "NodePort"
                } else {
                    "ClusterIP"
                }
                .into(),
            ),
            cluster_ip: Some(format!("10.43.{}.{}", i / 256, i % 256)),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: 80,
                protocol: Some("TCP".into()),
                node_port: i.is_multiple_of(4).then_some(30_000 + (i / 4) as i32),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn slice(service: usize, ips: &[u32]) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("svc-{service}-abcde")),
            namespace: Some("bench".into()),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        ports: Some(vec![EndpointPort {
            name: Some("http".into()),
            port: Some(8080),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        endpoints: ips
            .iter()
            .map(|ip| Endpoint {
                addresses: vec![std::net::Ipv4Addr::from(*ip).to_string()],
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    serving: Some(true),
                    terminating: Some(false),
                }),
                // Spread over 100 nodes; the proxy runs on node-0.
                node_name: Some(format!("node-{}", ip % 100)),
                ..Default::default()
            })
            .collect(),
    }
}

pub async fn run(args: ProxyArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.services <= 65_536 && args.endpoints_per_service > 0,
        "--services up to 65536 (one /16 of ClusterIPs and 16,384 NodePorts), at least one endpoint each"
    );
    let report =
        tokio::task::spawn_blocking(move || in_new_netns(async move || measure(&args).await))
            .await?
            .context(
                "the proxy benchmark runs in a network namespace of its own: root and nft needed",
            )?;
    super::print_report(report.1, &report.0, || {
        format!(
            "proxy: {} Services, {} endpoints: full sync {:.2} s; one endpoint change p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; drift check {:.0} ms; {:.0} MB resident; a request on a new connection p50/p99 {:.3}/{:.3} ms straight, {:.3}/{:.3} ms through a ClusterIP ({:.0} % of the throughput kept)",
            report.0.services,
            report.0.endpoints,
            report.0.full_sync_s,
            report.0.update_p50_ms,
            report.0.update_p99_ms,
            report.0.update_max_ms,
            report.0.drift_check_ms,
            report.0.rss_mb,
            report.0.direct_p50_ms,
            report.0.direct_p99_ms,
            report.0.clusterip_p50_ms,
            report.0.clusterip_p99_ms,
            report.0.throughput_kept * 100.0,
        )
    })
}

async fn measure(args: &ProxyArgs) -> anyhow::Result<(Report, bool)> {
    let mut config = ProxyConfig::new("node-0", vec![]);
    config.table = "trellis-proxy-bench".into();
    config.cluster_cidrs = vec!["10.0.0.0/9".into()];
    let mut proxier = Proxier::new(config);
    let per = args.endpoints_per_service;
    // Endpoint IPs from 10.64.0.0 up, one per endpoint; changes take fresh ones above.
    let base = u32::from(std::net::Ipv4Addr::new(10, 64, 0, 0));
    let services: Vec<Service> = (0..args.services).map(service).collect();
    let mut endpoints: BTreeMap<usize, Vec<u32>> = (0..args.services)
        .map(|i| (i, (0..per).map(|e| base + (i * per + e) as u32).collect()))
        .collect();

    let started = Instant::now();
    for (i, svc) in services.iter().enumerate() {
        let slice = slice(i, &endpoints[&i]);
        proxier.update(&format!("bench/svc-{i}"), Some(svc), &[&slice]);
    }
    proxier.sync().await.context("the full sync")?;
    let full_sync = started.elapsed();

    let fresh = base + (args.services * per) as u32;
    let mut samples: Vec<Duration> = Vec::with_capacity(args.changes);
    for (change, next) in (0..args.changes).zip(fresh..) {
        // Spread over the Services, a different one each time.
        let i = (change * 7919) % args.services;
        let ips = endpoints.get_mut(&i).context("a service")?;
        ips[change % per] = next;
        let slice = slice(i, ips);
        let started = Instant::now();
        proxier.update(&format!("bench/svc-{i}"), Some(&services[i]), &[&slice]);
        proxier.sync().await.context("an endpoint change")?;
        samples.push(started.elapsed());
    }
    let updates = Percentiles::of(&mut samples);
    let started = Instant::now();
    anyhow::ensure!(
        !proxier.repair_drift().await?,
        "the table read back differs from what was written"
    );
    let drift_check = started.elapsed();

    // Requests with the table at full size: the server behind the last Service.
    let (mut direct, mut through, mut kept) = (Vec::new(), Vec::new(), 0.0);
    if args.requests > 0 {
        ip(&["link", "set", "lo", "up"]).await?;
        ip(&["addr", "add", &format!("{SERVER}/32"), "dev", "lo"]).await?;
        // A route for ClusterIPs, as a node's default route is, for the DNAT to bend.
        ip(&["route", "add", "10.43.0.0/16", "dev", "lo"]).await?;
        let listener = tokio::net::TcpListener::bind((SERVER, SERVER_PORT)).await?;
        let server = tokio::spawn(serve(listener));
        let last = args.services - 1;
        let mut to_server = slice(last, &[u32::from(SERVER)]);
        if let Some(ports) = to_server.ports.as_mut() {
            ports[0].port = Some(SERVER_PORT.into());
        }
        proxier.update(
            &format!("bench/svc-{last}"),
            Some(&services[last]),
            &[&to_server],
        );
        proxier.sync().await.context("the server's Service")?;
        let cluster_ip: std::net::Ipv4Addr = services[last]
            .spec
            .as_ref()
            .and_then(|s| s.cluster_ip.as_deref())
            .context("a ClusterIP")?
            .parse()?;
        // Warm both paths (ARP-free loopback, the first connection's costs).
        requests((SERVER, SERVER_PORT).into(), 50).await?;
        requests((cluster_ip, 80).into(), 50).await?;
        let (d, d_wall) = requests((SERVER, SERVER_PORT).into(), args.requests).await?;
        let (t, t_wall) = requests((cluster_ip, 80).into(), args.requests).await?;
        (direct, through) = (d, t);
        kept = d_wall.as_secs_f64() / t_wall.as_secs_f64();
        server.abort();
    }
    let direct = Percentiles::of(&mut direct);
    let through = Percentiles::of(&mut through);
    // The table goes with the namespace; removing it first returns nft's memory sooner.
    proxier.remove().await?;
    Ok((
        Report {
            services: args.services,
            endpoints: args.services * per,
            full_sync_s: full_sync.as_secs_f64(),
            update_p50_ms: updates.p50_ms,
            update_p99_ms: updates.p99_ms,
            update_max_ms: updates.max_ms,
            drift_check_ms: super::ms(drift_check),
            rss_mb: super::pod_start::rss_of(std::process::id()),
            direct_p50_ms: direct.p50_ms,
            direct_p99_ms: direct.p99_ms,
            clusterip_p50_ms: through.p50_ms,
            clusterip_p99_ms: through.p99_ms,
            throughput_kept: kept,
        },
        args.json,
    ))
}
