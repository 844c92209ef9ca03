//! The service proxy: a full sync of many Services to the kernel, then single endpoint
//! changes, each applied to the kernel and timed, in a network namespace of its own
//! (never the machine's table). Services and EndpointSlices are made here and fed to
//! the proxy's sync code directly: no API server.

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
            "proxy: {} Services, {} endpoints: full sync {:.2} s; one endpoint change p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; drift check {:.0} ms; {:.0} MB resident",
            report.0.services,
            report.0.endpoints,
            report.0.full_sync_s,
            report.0.update_p50_ms,
            report.0.update_p99_ms,
            report.0.update_max_ms,
            report.0.drift_check_ms,
            report.0.rss_mb,
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
        },
        args.json,
    ))
}
