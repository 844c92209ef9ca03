//! What in-cluster clients rely on: the `kubernetes` Service in `default` on the
//! service range's first address, with every live API server's advertise address in its
//! Endpoints and EndpointSlice (each server's Lease in `kube-system`), put back when
//! deleted; the `kube-dns` Service on its fixed ClusterIP; and a serving certificate
//! valid for the names and address a pod dials (`kubernetes.default.svc`, 10.43.0.1).

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Endpoints, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, ListParams};
use kube::runtime::wait::await_condition;
use trellis_api::user::UserInfo;
use trellis_store::Store;
use trellis_tests::{StoreSettings, TestStore};

/// How long a change may take to show: the reconcilers run every 100 ms here.
const SHOWS_WITHIN: Duration = Duration::from_secs(20);

async fn server_on(
    store: Arc<dyn Store>,
    dir: &std::path::Path,
    listen: SocketAddr,
) -> Result<trellis_apiserver::Server> {
    let mut config = trellis_apiserver::Config::new(dir);
    config.listen = listen;
    config.advertise_address = Some(listen.ip());
    config.shutdown_grace = Duration::from_secs(1);
    config.endpoint_reconciler = trellis_apiserver::service_reconciler::Timing {
        interval: Duration::from_millis(100),
        // Longer than any wait: a stopped server must take itself out.
        lease_duration: Duration::from_secs(60),
    };
    trellis_apiserver::start(config, store, std::future::pending())
        .await
        .context("start an API server")
}

fn slice_addresses(slice: Option<&EndpointSlice>) -> BTreeSet<String> {
    slice
        .map(|s| {
            s.endpoints
                .iter()
                .flat_map(|e| e.addresses.iter().cloned())
                .collect()
        })
        .unwrap_or_default()
}

async fn wait_for<K>(
    api: &Api<K>,
    name: &str,
    what: &str,
    cond: impl kube::runtime::wait::Condition<K>,
) -> Result<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + 'static,
{
    tokio::time::timeout(SHOWS_WITHIN, await_condition(api.clone(), name, cond))
        .await
        .with_context(|| format!("wait for {what}"))??
        .with_context(|| format!("{name} is gone"))
}

/// A TLS handshake with the server as a client that dials `name` and trusts the
/// cluster CA: it fails unless the serving certificate names it.
async fn handshake(addr: SocketAddr, ca_pem: &str, name: &str) -> Result<()> {
    tls(addr, ca_pem, name).await.map(drop)
}

async fn tls(
    addr: SocketAddr,
    ca_pem: &str,
    name: &str,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    use rustls::pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert?)?;
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let server_name = rustls::pki_types::ServerName::try_from(name.to_owned())?;
    tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect(server_name, tcp)
        .await
        .with_context(|| format!("TLS handshake as {name}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_api_servers_keep_the_kubernetes_service_and_its_endpoints() -> Result<()> {
    let etcd = TestStore::etcd(StoreSettings::default()).await?;
    let (dir_a, dir_b) = (tempfile::tempdir()?, tempfile::tempdir()?);
    // Two servers on one port of two loopback addresses: the endpoints list one port,
    // as kube-apiserver's do (every server of a cluster serves the same secure port).
    let a = server_on(etcd.store.clone(), dir_a.path(), "127.0.0.2:0".parse()?).await?;
    let port = a.addr.port();
    let b = server_on(
        etcd.store.clone(),
        dir_b.path(),
        SocketAddr::new("127.0.0.3".parse()?, port),
    )
    .await?;
    let client = trellis_client::InProcess::new(a.in_process.clone())
        .client(UserInfo::new("admin", ["system:masters"]));

    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let kubernetes = wait_for(
        &services,
        "kubernetes",
        "the kubernetes Service",
        |s: Option<&Service>| s.is_some(),
    )
    .await?;
    let spec = kubernetes.spec.clone().unwrap_or_default();
    ensure!(
        spec.cluster_ip.as_deref() == Some("10.43.0.1"),
        "{kubernetes:?}"
    );
    let ports = spec.ports.unwrap_or_default();
    ensure!(ports.len() == 1, "{ports:?}");
    ensure!(
        ports[0].name.as_deref() == Some("https")
            && ports[0].port == 443
            && ports[0].protocol.as_deref() == Some("TCP")
            && ports[0].target_port
                == Some(
                    k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(i32::from(port))
                ),
        "{ports:?}"
    );
    ensure!(
        spec.selector.unwrap_or_default().is_empty(),
        "the kubernetes Service has no selector"
    );

    let system: Api<Service> = Api::namespaced(client.clone(), "kube-system");
    let dns = wait_for(
        &system,
        "kube-dns",
        "the kube-dns Service",
        |s: Option<&Service>| s.is_some(),
    )
    .await?;
    let dns_spec = dns.spec.clone().unwrap_or_default();
    ensure!(
        dns_spec.cluster_ip.as_deref() == Some("10.43.0.10"),
        "{dns:?}"
    );
    let dns_ports: Vec<(String, i32, String)> = dns_spec
        .ports
        .unwrap_or_default()
        .into_iter()
        .map(|p| {
            (
                p.name.unwrap_or_default(),
                p.port,
                p.protocol.unwrap_or_default(),
            )
        })
        .collect();
    ensure!(
        dns_ports
            == [
                ("dns".to_owned(), 53, "UDP".to_owned()),
                ("dns-tcp".to_owned(), 53, "TCP".to_owned()),
                ("metrics".to_owned(), 9153, "TCP".to_owned()),
            ],
        "{dns_ports:?}"
    );
    ensure!(
        dns.metadata.labels.unwrap_or_default().get("k8s-app") == Some(&"kube-dns".to_owned()),
        "kube-dns is labelled k8s-app=kube-dns"
    );

    // Both servers' addresses, in the slice the service proxy reads and in the
    // Endpoints older clients read.
    let both: BTreeSet<String> = ["127.0.0.2".to_owned(), "127.0.0.3".to_owned()].into();
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let slice = wait_for(
        &slices,
        "kubernetes",
        "both servers in the kubernetes EndpointSlice",
        |s: Option<&EndpointSlice>| slice_addresses(s) == both,
    )
    .await?;
    let labels = slice.metadata.labels.clone().unwrap_or_default();
    ensure!(
        labels.get("kubernetes.io/service-name") == Some(&"kubernetes".to_owned()),
        "{labels:?}"
    );
    // Not the EndpointSlice controller's: it leaves this slice alone.
    ensure!(
        !labels.contains_key("endpointslice.kubernetes.io/managed-by"),
        "{labels:?}"
    );
    let slice_ports = slice.ports.clone().unwrap_or_default();
    ensure!(
        slice_ports.len() == 1
            && slice_ports[0].port == Some(i32::from(port))
            && slice_ports[0].name.as_deref() == Some("https"),
        "{slice_ports:?}"
    );
    let endpoints: Api<Endpoints> = Api::namespaced(client.clone(), "default");
    let listed = wait_for(
        &endpoints,
        "kubernetes",
        "both servers in the kubernetes Endpoints",
        |e: Option<&Endpoints>| {
            let ips: BTreeSet<String> = e
                .and_then(|e| e.subsets.as_ref())
                .into_iter()
                .flatten()
                .flat_map(|s| s.addresses.iter().flatten().map(|a| a.ip.clone()))
                .collect();
            ips == both
        },
    )
    .await?;
    ensure!(
        listed
            .metadata
            .labels
            .unwrap_or_default()
            .get("endpointslice.kubernetes.io/skip-mirror")
            == Some(&"true".to_owned()),
        "the Endpoints are not mirrored"
    );
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-system");
    let identities = leases
        .list(&ListParams::default().labels("apiserver.kubernetes.io/identity=kube-apiserver"))
        .await?;
    ensure!(identities.items.len() == 2, "{:?}", identities.items);
    ensure!(
        identities.items.iter().all(|l| l
            .metadata
            .name
            .as_deref()
            .unwrap_or("")
            .starts_with("apiserver-")),
        "{:?}",
        identities.items
    );

    // A server that dies (its lease no longer renewed) drops out once the lease ends.
    let now = jiff::Timestamp::now();
    leases
        .create(
            &kube::api::PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "metadata": {"name": "apiserver-gone",
                             "labels": {"apiserver.kubernetes.io/identity": "kube-apiserver"},
                             "annotations": {
                                 trellis_apiserver::service_reconciler::ADVERTISE_ANNOTATION:
                                     "127.0.0.9"}},
                "spec": {"holderIdentity": "apiserver-gone", "leaseDurationSeconds": 1,
                         "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()},
            }))?,
        )
        .await?;
    let three: BTreeSet<String> = both
        .iter()
        .cloned()
        .chain(["127.0.0.9".to_owned()])
        .collect();
    wait_for(
        &slices,
        "kubernetes",
        "a third server's lease listed",
        |s: Option<&EndpointSlice>| slice_addresses(s) == three,
    )
    .await?;
    wait_for(
        &slices,
        "kubernetes",
        "the third server gone once its lease ended",
        |s: Option<&EndpointSlice>| slice_addresses(s) == both,
    )
    .await?;

    // A deleted `kubernetes` Service comes back, on the same address.
    let old_uid = kubernetes.metadata.uid.clone();
    services
        .delete("kubernetes", &DeleteParams::default())
        .await?;
    let back = wait_for(
        &services,
        "kubernetes",
        "the Service put back",
        |s: Option<&Service>| s.is_some_and(|s| s.metadata.uid != old_uid),
    )
    .await?;
    ensure!(
        back.spec.and_then(|s| s.cluster_ip).as_deref() == Some("10.43.0.1"),
        "the Service comes back on 10.43.0.1"
    );

    // What a pod dials: the Service's names and ClusterIP, and the advertise address.
    for name in [
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
        "10.43.0.1",
        "127.0.0.2",
    ] {
        handshake(a.addr, &a.ca_pem, name).await?;
    }
    ensure!(
        handshake(a.addr, &a.ca_pem, "kubernetes.example")
            .await
            .is_err(),
        "the certificate names only what it should"
    );

    // The official Python client's in-cluster configuration writes the scheme in
    // lower case.
    let mut stream = tls(a.addr, &a.ca_pem, "kubernetes.default.svc").await?;
    let request = format!(
        "GET /api/v1/namespaces/default/services/kubernetes HTTP/1.1\r\nHost: kubernetes.default.svc\r\nAuthorization: bearer {}\r\nConnection: close\r\n\r\n",
        a.admin_token
    );
    tokio::io::AsyncWriteExt::write_all(&mut stream, request.as_bytes()).await?;
    let mut answer = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut answer).await?;
    let answer = String::from_utf8_lossy(&answer);
    ensure!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // A server that stops takes itself out at once, its lease with it.
    b.stop().await?;
    let one: BTreeSet<String> = ["127.0.0.2".to_owned()].into();
    wait_for(
        &slices,
        "kubernetes",
        "the stopped server gone from the EndpointSlice",
        |s: Option<&EndpointSlice>| slice_addresses(s) == one,
    )
    .await?;
    let identities = leases
        .list(&ListParams::default().labels("apiserver.kubernetes.io/identity=kube-apiserver"))
        .await?;
    ensure!(
        identities
            .items
            .iter()
            .filter(|l| l.metadata.name.as_deref() != Some("apiserver-gone"))
            .count()
            == 1,
        "{:?}",
        identities.items
    );
    let ip: IpAddr = "127.0.0.2".parse()?;
    let endpoints_now = endpoints.get("kubernetes").await?;
    ensure!(
        endpoints_now
            .subsets
            .unwrap_or_default()
            .iter()
            .flat_map(|s| s.addresses.iter().flatten())
            .map(|a| a.ip.clone())
            .collect::<Vec<_>>()
            == [ip.to_string()],
        "the Endpoints list the one server left"
    );
    a.stop().await
}
