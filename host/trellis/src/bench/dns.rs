//! Cluster DNS: queries per second for cluster names and their latency, with the load
//! generator on the same machine, and how soon a new Service resolves. An API server
//! in this process holds the Services; the DNS server follows them through informers,
//! as a node's does, and answers on a loopback port.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Args;
use futures::{StreamExt as _, TryStreamExt as _};
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RecordType};
use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::api::{Api, PostParams};
use serde::Serialize;
use trellis_client::informer::SharedInformers;
use trellis_dns::{DnsConfig, DnsServer};

use super::Percentiles;
use super::cluster::LocalCluster;

const NAMESPACE: &str = "bench";

#[derive(Debug, Args)]
pub struct DnsArgs {
    /// Services in the cluster, each queried in turn.
    #[arg(long, default_value_t = 1000)]
    services: usize,

    /// How long the query load runs, in seconds.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,

    /// Load generator threads, each with a UDP socket of its own.
    #[arg(long, default_value_t = 2)]
    clients: usize,

    /// Queries each client keeps in flight.
    #[arg(long, default_value_t = 4)]
    window: usize,

    /// Services created one at a time and asked for until they resolve.
    #[arg(long, default_value_t = 200)]
    creates: usize,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    services: usize,
    queries: u64,
    /// Answered queries per second, over every client.
    qps: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    /// Queries that got no answer within a second (UDP drops).
    lost: u64,
    /// From the create request sent to the first A answer for the new name.
    create_to_resolvable_p50_ms: f64,
    create_to_resolvable_p99_ms: f64,
    create_to_resolvable_max_ms: f64,
}

fn service(name: &str) -> anyhow::Result<Service> {
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"ports": [{"name": "http", "port": 80}]},
    }))?)
}

/// An A query for `name`, encoded, its id in the first two bytes.
fn query(name: &str) -> anyhow::Result<Vec<u8>> {
    let mut message = Message::new(0, MessageType::Query, OpCode::Query);
    message.metadata.recursion_desired = true;
    message.add_query(Query::query(Name::from_ascii(name)?, RecordType::A));
    Ok(message.to_vec()?)
}

pub async fn run(args: DnsArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.services > 0 && args.clients > 0 && args.window > 0,
        "--services, --clients and --window must be at least 1"
    );
    let cluster = LocalCluster::start().await?;
    let measured = measure(&args, &cluster).await;
    cluster.stop().await?;
    let report = measured?;
    super::print_report(args.json, &report, || {
        format!(
            "dns: {} Services: {:.0} queries/s, p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms, {} lost; create → resolvable p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            report.services,
            report.qps,
            report.p50_ms,
            report.p99_ms,
            report.max_ms,
            report.lost,
            report.create_to_resolvable_p50_ms,
            report.create_to_resolvable_p99_ms,
            report.create_to_resolvable_max_ms,
        )
    })
}

async fn measure(args: &DnsArgs, cluster: &LocalCluster) -> anyhow::Result<Report> {
    let in_process = trellis_client::InProcess::new(cluster.server.in_process.clone());
    let admin = in_process.client(trellis_api::UserInfo::new("admin", ["system:masters"]));
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({"metadata": {"name": NAMESPACE}}))?,
        )
        .await
        .context("create the namespace")?;
    let services: Api<Service> = Api::namespaced(admin.clone(), NAMESPACE);
    futures::stream::iter(0..args.services)
        .map(|i| {
            let services = services.clone();
            async move {
                services
                    .create(&PostParams::default(), &service(&format!("svc-{i}"))?)
                    .await
                    .with_context(|| format!("create Service svc-{i}"))
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<_>>()
        .await?;

    let (_stop, stopped) = trellis_api::Shutdown::new();
    let dns = DnsServer::start(
        DnsConfig::new(vec![SocketAddr::from(([127, 0, 0, 1], 0))]),
        admin,
        SharedInformers::new(),
        stopped,
    )
    .await
    .context("start the DNS server")?;
    let server = dns.local_addrs()[0];

    // Every Service resolves before the load starts.
    let last = format!("svc-{}.{NAMESPACE}.svc.cluster.local.", args.services - 1);
    let probe = query(&last)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let socket = client_socket(server)?;
        while !resolves(&socket, &probe)? {
            if Instant::now() > deadline {
                bail!("the DNS server never answered for {last}");
            }
        }
        Ok(())
    })
    .await??;

    let names: Arc<Vec<Vec<u8>>> = Arc::new(
        (0..args.services)
            .map(|i| query(&format!("svc-{i}.{NAMESPACE}.svc.cluster.local.")))
            .collect::<anyhow::Result<_>>()?,
    );
    let load = Duration::from_secs_f64(args.seconds);
    let done = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for client in 0..args.clients {
        let names = names.clone();
        let done = done.clone();
        let window = args.window;
        clients.push(std::thread::spawn(move || {
            generate(server, &names, client, window, &done)
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(load).await;
    done.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let mut samples = Vec::new();
    let mut lost = 0;
    for client in clients {
        let (client_samples, client_lost) = client
            .join()
            .map_err(|_| anyhow::anyhow!("a load generator panicked"))??;
        samples.extend(client_samples);
        lost += client_lost;
    }
    let queries = samples.len() as u64;
    let latency = Percentiles::of(&mut samples);

    // Create → resolvable, one Service at a time.
    let mut creates = Vec::with_capacity(args.creates);
    for i in 0..args.creates {
        let name = format!("new-{i}");
        let probe = query(&format!("{name}.{NAMESPACE}.svc.cluster.local."))?;
        let socket = client_socket(server)?;
        let started = Instant::now();
        services
            .create(&PostParams::default(), &service(&name)?)
            .await
            .with_context(|| format!("create Service {name}"))?;
        let waited = tokio::task::spawn_blocking(move || -> anyhow::Result<Duration> {
            let deadline = started + Duration::from_secs(10);
            while !resolves(&socket, &probe)? {
                if Instant::now() > deadline {
                    bail!("a new Service did not resolve within 10 s");
                }
            }
            Ok(started.elapsed())
        })
        .await??;
        creates.push(waited);
    }
    let creates = Percentiles::of(&mut creates);
    let metrics = dns.metrics_text();
    tracing::debug!(%metrics, "the DNS server's metrics");

    Ok(Report {
        services: args.services,
        queries,
        qps: queries as f64 / elapsed.as_secs_f64(),
        p50_ms: latency.p50_ms,
        p99_ms: latency.p99_ms,
        max_ms: latency.max_ms,
        lost,
        create_to_resolvable_p50_ms: creates.p50_ms,
        create_to_resolvable_p99_ms: creates.p99_ms,
        create_to_resolvable_max_ms: creates.max_ms,
    })
}

fn client_socket(server: SocketAddr) -> anyhow::Result<UdpSocket> {
    let socket = UdpSocket::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    socket.connect(server)?;
    socket.set_read_timeout(Some(Duration::from_secs(1)))?;
    Ok(socket)
}

/// One query and its answer: whether it held an address.
fn resolves(socket: &UdpSocket, query: &[u8]) -> anyhow::Result<bool> {
    socket.send(query)?;
    let mut buffer = [0u8; 1500];
    let len = match socket.recv(&mut buffer) {
        Ok(len) => len,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            return Ok(false);
        }
        Err(e) => return Err(e.into()),
    };
    let answer = Message::from_vec(&buffer[..len])?;
    Ok(answer.metadata.response_code == ResponseCode::NoError && !answer.answers.is_empty())
}

/// Keeps `window` queries in flight on one socket until `done`: the latency of each
/// answered query, and how many went unanswered.
fn generate(
    server: SocketAddr,
    names: &[Vec<u8>],
    client: usize,
    window: usize,
    done: &AtomicBool,
) -> anyhow::Result<(Vec<Duration>, u64)> {
    let socket = client_socket(server)?;
    let mut samples = Vec::with_capacity(1 << 20);
    // Sent time by query id (the slot in the window).
    let mut sent: Vec<Option<Instant>> = vec![None; window];
    let mut next = client * 7919;
    let mut send = |slot: usize, sent: &mut Vec<Option<Instant>>| -> anyhow::Result<()> {
        let mut bytes = names[next % names.len()].clone();
        next += 1;
        bytes[..2].copy_from_slice(&(slot as u16).to_be_bytes());
        sent[slot] = Some(Instant::now());
        socket.send(&bytes)?;
        Ok(())
    };
    for slot in 0..window {
        send(slot, &mut sent)?;
    }
    let mut lost = 0;
    let mut buffer = [0u8; 1500];
    while !done.load(Ordering::Relaxed) {
        match socket.recv(&mut buffer) {
            Ok(len) if len >= 12 => {
                let slot = usize::from(u16::from_be_bytes([buffer[0], buffer[1]]));
                if let Some(at) = sent.get_mut(slot).and_then(Option::take) {
                    // NOERROR with an answer, or it does not count.
                    let ok =
                        buffer[3] & 0x0f == 0 && u16::from_be_bytes([buffer[6], buffer[7]]) > 0;
                    if !ok {
                        bail!("a query for a cluster name was not answered with its address");
                    }
                    samples.push(at.elapsed());
                    send(slot, &mut sent)?;
                }
            }
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                // A second without an answer: whatever is in flight was dropped.
                for slot in 0..window {
                    if sent[slot].is_some() {
                        lost += 1;
                        send(slot, &mut sent)?;
                    }
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok((samples, lost))
}
