//! Cluster DNS (`trellis-dns`) against a real API server: Services made through the
//! API (a ClusterIP one with a named port, a headless one whose EndpointSlice the test
//! writes, an ExternalName one) answered over UDP and TCP as the Kubernetes DNS
//! specification says, names outside the cluster forwarded to a second server on
//! loopback, and a deleted Service gone from the answers.

use std::net::SocketAddr;
use std::str::FromStr as _;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::{DNSClass, Name, RecordType};
use hickory_server::net::client::{Client, ClientHandle as _};
use hickory_server::net::runtime::TokioRuntimeProvider;
use hickory_server::net::tcp::TcpClientStream;
use hickory_server::net::udp::UdpClientStream;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use tokio::time::Instant;
use trellis_api::Shutdown;
use trellis_client::informer::SharedInformers;
use trellis_dns::{DnsConfig, DnsServer};
use trellis_tests::TestCluster;

const NS: &str = "dns-test";

/// One question to `server`, over TCP or UDP.
async fn ask(server: SocketAddr, name: &str, qtype: RecordType, tcp: bool) -> Result<Message> {
    let provider = TokioRuntimeProvider::new();
    let name = Name::from_str(name)?;
    let response = if tcp {
        let (stream, sender) = TcpClientStream::new(server, None, None, provider);
        let (mut client, background) = Client::<TokioRuntimeProvider>::new(stream.await?, sender);
        tokio::spawn(background);
        client.query(name, DNSClass::IN, qtype).await?
    } else {
        let (mut client, background) = Client::<TokioRuntimeProvider>::from_sender(
            UdpClientStream::builder(server, provider).build(),
        );
        tokio::spawn(background);
        client.query(name, DNSClass::IN, qtype).await?
    };
    Ok(response.into_message())
}

/// The answers' data as text, sorted.
fn data(message: &Message) -> Vec<String> {
    let mut out: Vec<String> = message.answers.iter().map(|r| r.data.to_string()).collect();
    out.sort();
    out
}

/// Asks until `done` holds of the answer (the server follows the API through a watch):
/// a bounded retry of a real query, the only way to see its state from outside; each
/// round trip is the wait.
async fn ask_until(
    server: SocketAddr,
    name: &str,
    qtype: RecordType,
    done: impl Fn(&Message) -> bool,
) -> Result<Message> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let answer = ask(server, name, qtype, false).await?;
        if done(&answer) {
            return Ok(answer);
        }
        if Instant::now() > deadline {
            bail!("{name} {qtype}: still {answer:?}");
        }
    }
}

async fn start_dns(
    client: &kube::Client,
    domain: &str,
    upstream: Vec<SocketAddr>,
    stopped: &Shutdown,
) -> Result<DnsServer> {
    let mut config = DnsConfig::new(vec!["127.0.0.1:0".parse()?]);
    config.cluster_domain = domain.to_owned();
    config.upstream = upstream;
    config.upstream_timeout = Duration::from_secs(1);
    DnsServer::start(
        config,
        client.clone(),
        SharedInformers::new(),
        stopped.clone(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_resolve_as_the_dns_specification_says() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let client = cluster.kube_admin().await?;
    let (_stop, stopped) = Shutdown::new();
    // The upstream: a second server, for the same cluster under another domain, so
    // that what it answers is known.
    let upstream = start_dns(&client, "upstream.test", vec![], &stopped).await?;
    let dns = start_dns(&client, "cluster.local", upstream.local_addrs(), &stopped).await?;
    let server = dns.local_addrs()[0];

    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NS}}))?,
        )
        .await?;
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    let created = Instant::now();
    let web = services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "web"},
                "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
            }))?,
        )
        .await?;
    let cluster_ip = web
        .spec
        .as_ref()
        .and_then(|s| s.cluster_ip.clone())
        .context("web has no ClusterIP")?;
    let answer = ask_until(
        server,
        "web.dns-test.svc.cluster.local.",
        RecordType::A,
        |m| !m.answers.is_empty(),
    )
    .await?;
    eprintln!("web resolvable {:?} after its create", created.elapsed());
    for tcp in [false, true] {
        let answer = if tcp {
            ask(
                server,
                "web.dns-test.svc.cluster.local.",
                RecordType::A,
                true,
            )
            .await?
        } else {
            answer.clone()
        };
        ensure!(data(&answer) == [cluster_ip.clone()], "{answer:?}");
        ensure!(answer.answers[0].ttl == 5, "{answer:?}");
        ensure!(answer.metadata.authoritative);

        let v6 = ask(
            server,
            "web.dns-test.svc.cluster.local.",
            RecordType::AAAA,
            tcp,
        )
        .await?;
        ensure!(
            v6.metadata.response_code == ResponseCode::NoError && v6.answers.is_empty(),
            "{v6:?}"
        );
        let srv = ask(
            server,
            "_http._tcp.web.dns-test.svc.cluster.local.",
            RecordType::SRV,
            tcp,
        )
        .await?;
        ensure!(
            data(&srv) == ["0 100 80 web.dns-test.svc.cluster.local."],
            "{srv:?}"
        );
        let missing = ask(
            server,
            "nope.dns-test.svc.cluster.local.",
            RecordType::A,
            tcp,
        )
        .await?;
        ensure!(
            missing.metadata.response_code == ResponseCode::NXDomain,
            "{missing:?}"
        );
        ensure!(
            missing.authorities.len() == 1
                && missing.authorities[0].record_type() == RecordType::SOA
                && missing.authorities[0].ttl == 5,
            "{missing:?}"
        );
    }
    let ip: std::net::Ipv4Addr = cluster_ip.parse()?;
    let [a, b, c, d] = ip.octets();
    let ptr = ask(
        server,
        &format!("{d}.{c}.{b}.{a}.in-addr.arpa."),
        RecordType::PTR,
        false,
    )
    .await?;
    ensure!(data(&ptr) == ["web.dns-test.svc.cluster.local."], "{ptr:?}");

    // Headless, with a slice written here (no controller runs): ready endpoints only.
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "db"},
                "spec": {"clusterIP": "None", "ports": [{"name": "sql", "port": 5432}]},
            }))?,
        )
        .await?;
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
    slices
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "db-abcde", "labels": {"kubernetes.io/service-name": "db"}},
                "addressType": "IPv4",
                "endpoints": [
                    {"addresses": ["10.244.118.5"], "hostname": "db-0", "conditions": {"ready": true}},
                    {"addresses": ["10.244.118.6"], "conditions": {"ready": true}},
                    {"addresses": ["10.244.118.7"], "hostname": "db-2", "conditions": {"ready": false}},
                ],
                "ports": [{"name": "sql", "port": 5432, "protocol": "TCP"}],
            }))?,
        )
        .await?;
    let headless = ask_until(
        server,
        "db.dns-test.svc.cluster.local.",
        RecordType::A,
        |m| m.answers.len() == 2,
    )
    .await?;
    ensure!(
        data(&headless) == ["10.244.118.5", "10.244.118.6"],
        "{headless:?}"
    );
    let host = ask(
        server,
        "db-0.db.dns-test.svc.cluster.local.",
        RecordType::A,
        true,
    )
    .await?;
    ensure!(data(&host) == ["10.244.118.5"], "{host:?}");
    let srv = ask(
        server,
        "_sql._tcp.db.dns-test.svc.cluster.local.",
        RecordType::SRV,
        false,
    )
    .await?;
    ensure!(
        data(&srv)
            == [
                "0 50 5432 10-244-118-6.db.dns-test.svc.cluster.local.",
                "0 50 5432 db-0.db.dns-test.svc.cluster.local."
            ],
        "{srv:?}"
    );
    ensure!(srv.additionals.len() == 2, "{srv:?}");
    let ptr = ask(server, "5.118.244.10.in-addr.arpa.", RecordType::PTR, false).await?;
    ensure!(
        data(&ptr) == ["db-0.db.dns-test.svc.cluster.local."],
        "{ptr:?}"
    );
    let not_ready = ask(
        server,
        "db-2.db.dns-test.svc.cluster.local.",
        RecordType::A,
        false,
    )
    .await?;
    ensure!(
        not_ready.metadata.response_code == ResponseCode::NXDomain,
        "{not_ready:?}"
    );
    let pod = ask(
        server,
        "10-244-118-9.dns-test.pod.cluster.local.",
        RecordType::A,
        false,
    )
    .await?;
    ensure!(data(&pod) == ["10.244.118.9"], "{pod:?}");

    // Outside the cluster domain: the upstream answers (it serves the same Services as
    // `upstream.test`).
    let far = ask(
        server,
        "web.dns-test.svc.upstream.test.",
        RecordType::A,
        true,
    )
    .await?;
    ensure!(
        data(&far) == [cluster_ip.clone()] && !far.metadata.authoritative,
        "{far:?}"
    );
    // ExternalName: the CNAME, and its target's records from the upstream.
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "ext"},
                "spec": {"type": "ExternalName", "externalName": "web.dns-test.svc.upstream.test"},
            }))?,
        )
        .await?;
    let cname = ask_until(
        server,
        "ext.dns-test.svc.cluster.local.",
        RecordType::A,
        |m| !m.answers.is_empty(),
    )
    .await?;
    ensure!(
        cname.answers.len() == 2
            && cname.answers[0].record_type() == RecordType::CNAME
            && cname.answers[0].data.to_string() == "web.dns-test.svc.upstream.test."
            && cname.answers[1].data.to_string() == cluster_ip,
        "{cname:?}"
    );
    let metrics = dns.metrics_text();
    // The chase asked what the cache already held.
    ensure!(
        metrics.contains("coredns_forward_requests_total 1")
            && metrics.contains("coredns_cache_hits_total 1"),
        "{metrics}"
    );

    // A deleted Service is gone.
    services.delete("web", &DeleteParams::default()).await?;
    ask_until(
        server,
        "web.dns-test.svc.cluster.local.",
        RecordType::A,
        |m| m.metadata.response_code == ResponseCode::NXDomain,
    )
    .await?;
    Ok(())
}
