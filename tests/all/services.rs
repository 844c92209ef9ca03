//! Services and cluster DNS end to end, on three test hosts (network namespaces of
//! their own, `super::multinode`'s set-up) whose agents run the pod network, the
//! service proxy and the node-local DNS server, against one API server with the
//! EndpointSlice controller. Kubernetes' conformance checks run as they are written in
//! `test/e2e/network/service.go` and `dns.go`, with agnhost netexec (in Python, as a
//! `process` pod) as the exec pod and the servers: each test names the checks it holds
//! in its comments. Besides them: a backend reaches its own Service (hairpin), a
//! Service without ready endpoints refuses at once and serves again once one is ready,
//! a UDP Service, `internalTrafficPolicy: Local`, and an agent restarted keeps the
//! node's Service traffic flowing and repairs its table.
//!
//! The cluster is started once for the module (the first test starts it, the last one
//! to end stops it); each test has a namespace of its own. The test that restarts an
//! agent holds the cluster alone while it does.
//!
//! Needs root, `ip`, `nft`, python3 and the CNI plugins; skipped otherwise.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_agent::AgentConfig;
use trellis_agent::routes::Backend;
use trellis_api::{Shutdown, Stop};
use trellis_client::events::EventRecorder;
use trellis_client::identity;
use trellis_client::informer::Informer;
use trellis_client::workqueue::QueueMetrics;
use trellis_controllers::Manager;
use trellis_plugin_host::{Compilers, HostConfig, PluginHost};
use trellis_tests::TestCluster;
use trellis_tests::hosts::http_get;

use super::multinode::{self, Cluster, Setup, TEST_PORT, UDP_PORT};

/// The node-local DNS address (NodeLocal DNSCache's) and the `kube-dns` ClusterIP,
/// both on every node's `trellis-dns` link.
const NODE_LOCAL_DNS: &str = "169.254.20.10";
const KUBE_DNS: &str = "10.43.0.10";
/// The Service CIDR and NodePort range the API server allocates from (its defaults).
const SERVICE_CIDR: &str = "10.43.0.0/16";
const NODE_PORTS: std::ops::RangeInclusive<i32> = 30000..=32767;
/// The backends' port in the conformance checks (serve-hostname's).
const BACKEND_PORT: u16 = 9376;

const SETUP: Setup = Setup {
    bridge: "trellis-sv100",
    lan: "10.244.100",
    hosts: &["sv-a", "sv-b", "sv-c"],
    cluster_cidr: "10.244.101.0/24",
    pod_cidrs: &["10.244.101.0/26", "10.244.101.64/26", "10.244.101.128/26"],
    backend: Backend::Auto,
    configure: services_on,
};

/// Every node runs the proxy (resynced every second, so that drift is repaired within
/// one, and without batching) and serves DNS on the node-local address and the
/// `kube-dns` ClusterIP.
fn services_on(config: &mut AgentConfig) {
    config.service_proxy = true;
    config.proxy_sync_period = Duration::from_secs(1);
    config.proxy_min_sync_interval = Duration::ZERO;
    config.node_local_dns = [NODE_LOCAL_DNS, KUBE_DNS]
        .iter()
        .filter_map(|ip| ip.parse().ok())
        .collect();
}

/// The module's cluster: the hosts and API server, and the EndpointSlice controller.
struct Shared {
    /// Read by the tests; written (held alone) by the one that restarts an agent.
    cluster: tokio::sync::RwLock<Cluster>,
    slices: Arc<Informer<EndpointSlice>>,
    controllers: Stop,
    _running: Vec<trellis_controllers::Running>,
}

/// The runtime the module's cluster lives on: each test blocks on it, so the cluster
/// outlives any one test.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("services")
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("build the module's runtime: {e}"))
    })
}

/// The cluster while some test uses it.
static SHARED: Mutex<Weak<Shared>> = Mutex::new(Weak::new());

/// Runs `test` against the module's cluster, started if no test holds it; the last test
/// to end stops it (also when it failed), so that nothing is left on the machine.
fn with_cluster<F>(test: impl FnOnce(Arc<Shared>) -> F) -> Result<()>
where
    F: Future<Output = Result<()>> + Send + 'static,
{
    if multinode::skip() {
        return Ok(());
    }
    let shared = {
        let mut slot = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
        match slot.upgrade() {
            Some(shared) => shared,
            None => {
                let shared = Arc::new(runtime().block_on(Shared::start())?);
                *slot = Arc::downgrade(&shared);
                shared
            }
        }
    };
    let started = std::time::Instant::now();
    let result = runtime().block_on(runtime().spawn(test(shared.clone())));
    eprintln!("the test's checks took {:?}", started.elapsed());
    let stopped = {
        // Under the lock, so that no test takes it up while it stops.
        let mut slot = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
        match Arc::into_inner(shared) {
            Some(last) => {
                *slot = Weak::new();
                runtime().block_on(last.stop())
            }
            None => Ok(()),
        }
    };
    if let Err(e) = &stopped {
        eprintln!("stop the cluster: {e:#}");
    }
    result??;
    stopped
}

impl Shared {
    async fn start() -> Result<Self> {
        let started = tokio::time::Instant::now();
        let api = TestCluster::start().await?;
        let in_process = api.in_process();
        let cluster = multinode::start_on(api, &SETUP).await?;
        // Nodes have a default route: a connection to a Service without endpoints is
        // routed, and so meets the proxy's reject in the forward hook, as on kube-proxy's
        // nodes (with no route at all the kernel answers "unreachable", which TCP takes
        // as a soft error and retries until its timeout). Without a gateway: nothing
        // routed this way leaves the LAN.
        for host in &cluster.hosts {
            host.host.ip(&["route", "add", "default", "dev", "eth0"])?;
        }
        let slices = cluster
            .watching
            .informer::<EndpointSlice>(Api::all(cluster.admin.clone()), watcher::Config::default());
        // The EndpointSlice controller, as `trellis up` runs it.
        let manager = Manager {
            plugins: PluginHost::new(HostConfig {
                compilers: Compilers::Baseline,
                ..HostConfig::default()
            })?,
            informers: trellis_client::informer::SharedInformers::new(),
            lister: in_process.client(identity::controller_manager()),
            queues: QueueMetrics::default(),
            running: Default::default(),
        };
        let (controllers, stopped) = Shutdown::new();
        let mut running = Vec::new();
        for builtin in trellis_controllers::bundled::select("endpointslice")? {
            let writer = in_process.client(identity::controller(builtin.account()));
            let events = EventRecorder::new(writer.clone(), builtin.identity, "test");
            running.push(
                manager
                    .start(builtin.config(), writer, events, stopped.clone())
                    .await
                    .with_context(|| format!("start {}", builtin.name))?,
            );
        }
        eprintln!(
            "cluster of {} hosts up in {:?}",
            SETUP.hosts.len(),
            started.elapsed()
        );
        Ok(Self {
            cluster: tokio::sync::RwLock::new(cluster),
            slices,
            controllers,
            _running: running,
        })
    }

    /// Deletes every pod, waits until the agents removed them, stops the hosts.
    async fn stop(self) -> Result<()> {
        self.controllers.stop();
        let cluster = self.cluster.into_inner();
        let keys: Vec<String> = cluster
            .pods
            .list()
            .iter()
            .map(|p| trellis_client::informer::key_of(p.as_ref()))
            .collect();
        cluster.stop_with(&keys).await
    }
}

/// A test's namespace in the module's cluster.
struct Ns<'a> {
    cluster: &'a Cluster,
    slices: &'a Arc<Informer<EndpointSlice>>,
    name: &'static str,
}

impl<'a> Ns<'a> {
    async fn new(shared: &'a Shared, cluster: &'a Cluster, name: &'static str) -> Result<Self> {
        let namespaces: Api<Namespace> = Api::all(cluster.admin.clone());
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": name}}))?,
            )
            .await
            .with_context(|| format!("create namespace {name}"))?;
        Ok(Self {
            cluster,
            slices: &shared.slices,
            name,
        })
    }

    fn services(&self) -> Api<Service> {
        Api::namespaced(self.cluster.admin.clone(), self.name)
    }

    async fn service(&self, service: serde_json::Value) -> Result<Service> {
        let service: Service = serde_json::from_value(service)?;
        let name = service.metadata.name.clone().unwrap_or_default();
        self.services()
            .create(&PostParams::default(), &service)
            .await
            .with_context(|| format!("create Service {}/{name}", self.name))
    }

    /// Changes Service `name` as `change` does (jig.UpdateService: read, change, write).
    async fn update_service(&self, name: &str, change: impl Fn(&mut Service)) -> Result<Service> {
        let mut service = self.services().get(name).await?;
        change(&mut service);
        self.services()
            .replace(name, &PostParams::default(), &service)
            .await
            .with_context(|| format!("update Service {}/{name}", self.name))
    }

    /// A netexec pod on `node` serving HTTP on `port` (UDP on [`UDP_PORT`]) with `labels`
    /// and the container ports `ports` (name, number); `change` adds the rest.
    async fn pod(
        &self,
        name: &str,
        node: usize,
        port: u16,
        labels: serde_json::Value,
        change: impl FnOnce(&mut serde_json::Value),
    ) -> Result<()> {
        let mut pod = self.cluster.netexec_pod(name, SETUP.hosts[node], port);
        pod["metadata"]["labels"] = labels;
        change(&mut pod);
        self.cluster.create_in(self.name, pod).await
    }

    async fn ready(&self, name: &str) -> Result<IpAddr> {
        self.cluster.ready_in(self.name, name).await
    }

    async fn delete_pod(&self, name: &str) -> Result<()> {
        Api::<Pod>::namespaced(self.cluster.admin.clone(), self.name)
            .delete(name, &DeleteParams::default().grace_period(0))
            .await?;
        Ok(())
    }

    /// validateEndpointsPortsOrFail: waits (woken by the slices' changes) until the
    /// ready endpoints of Service `service` in its EndpointSlices are `expected`'s pods
    /// with their ports.
    async fn validate_endpoints(&self, service: &str, expected: &[(&str, &[u16])]) -> Result<()> {
        let expected: BTreeMap<String, BTreeSet<u16>> = expected
            .iter()
            .map(|(pod, ports)| (pod.to_string(), ports.iter().copied().collect()))
            .collect();
        let mut changes = self.slices.subscribe();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let got = self.endpoints(service);
            if got == expected {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, changes.recv()).await {
                Ok(Some(_)) => {}
                Ok(None) => bail!("the slice informer ended"),
                Err(_) => bail!(
                    "Service {}/{service}'s endpoints are {got:?}, not {expected:?}, after 30 s",
                    self.name
                ),
            }
        }
    }

    /// The ready endpoints of `service`'s slices: pod name → ports.
    fn endpoints(&self, service: &str) -> BTreeMap<String, BTreeSet<u16>> {
        let mut got: BTreeMap<String, BTreeSet<u16>> = BTreeMap::new();
        for slice in self.slices.list() {
            let labels = slice.metadata.labels.clone().unwrap_or_default();
            if slice.metadata.namespace.as_deref() != Some(self.name)
                || labels.get("kubernetes.io/service-name").map(String::as_str) != Some(service)
            {
                continue;
            }
            let ports: Vec<u16> = slice
                .ports
                .iter()
                .flatten()
                .filter_map(|p| p.port.and_then(|p| u16::try_from(p).ok()))
                .collect();
            for endpoint in &slice.endpoints {
                let ready = endpoint
                    .conditions
                    .as_ref()
                    .and_then(|c| c.ready)
                    .unwrap_or(true);
                let pod = endpoint.target_ref.as_ref().and_then(|r| r.name.clone());
                if let (true, Some(pod)) = (ready, pod) {
                    got.entry(pod).or_default().extend(ports.iter().copied());
                }
            }
        }
        got
    }

    /// What netexec's `/dial` at `from:from_port` got from `target:port` in `tries`
    /// tries (each within `timeout` seconds).
    async fn dial_from(
        &self,
        from: IpAddr,
        from_port: u16,
        query: String,
    ) -> Result<serde_json::Value> {
        let path = format!("/dial?{query}");
        let body = self.cluster.hosts[0]
            .on_host(async move { http_get(from, from_port, &path, Duration::from_secs(60)).await })
            .await??;
        Ok(serde_json::from_str(&body)?)
    }

    /// The hostnames that `tries` requests from the exec pod at `from` to
    /// `target:port` over `protocol` got; an error if any failed.
    async fn hostnames(
        &self,
        from: IpAddr,
        protocol: &str,
        target: &str,
        port: u16,
        tries: u32,
    ) -> Result<Vec<String>> {
        let json = self
            .dial_from(
                from,
                TEST_PORT,
                format!(
                    "request=hostname&protocol={protocol}&host={target}&port={port}&tries={tries}"
                ),
            )
            .await?;
        let responses: Vec<String> = serde_json::from_value(json["responses"].clone())?;
        ensure!(
            responses.len() == tries as usize,
            "{tries} requests to {target}:{port} over {protocol} from {from}: {json}"
        );
        Ok(responses)
    }

    /// Retries `hostnames` (a bounded retry of the probe, as the checks' polls) until
    /// every answer is one of `backends`; the answers.
    async fn reach(
        &self,
        from: IpAddr,
        protocol: &str,
        target: &str,
        port: u16,
        backends: &[&str],
    ) -> Result<Vec<String>> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let got = self.hostnames(from, protocol, target, port, 5).await;
            match &got {
                Ok(names) if names.iter().all(|n| backends.contains(&n.as_str())) => {
                    return got;
                }
                _ if tokio::time::Instant::now() > deadline => {
                    return Err(anyhow::anyhow!(
                        "{target}:{port} over {protocol} from {from} answered {got:?}, not only {backends:?}, for 20 s"
                    ));
                }
                // The data path has no event a test can take (the proxy applies a
                // slice change some time after the informer has it): a bounded probe
                // of real traffic, as Kubernetes' e2e polls.
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// jig.CheckServiceReachability: the exec pod at `from` reaches each port of
    /// `service` by its name and its ClusterIP, and a NodePort on every node's IP,
    /// served by `backends`; an ExternalName Service's name resolves.
    async fn check_reachability(
        &self,
        service: &Service,
        from: IpAddr,
        backends: &[&str],
    ) -> Result<()> {
        let name = service.metadata.name.as_deref().unwrap_or_default();
        let spec = service.spec.as_ref().context("no spec")?;
        if spec.type_.as_deref() == Some("ExternalName") {
            let addresses = self
                .getent(from, &format!("{name}.{}.svc.cluster.local", self.name))
                .await?;
            ensure!(
                !addresses.is_empty(),
                "ExternalName Service {name} does not resolve"
            );
            return Ok(());
        }
        let cluster_ip = spec.cluster_ip.clone().context("no clusterIP")?;
        for port in spec.ports.iter().flatten() {
            let protocol = if port.protocol.as_deref() == Some("UDP") {
                "udp"
            } else {
                "http"
            };
            let service_port = u16::try_from(port.port)?;
            self.reach(from, protocol, name, service_port, backends)
                .await?;
            self.reach(from, protocol, &cluster_ip, service_port, backends)
                .await?;
            if let Some(node_port) = port.node_port {
                for host in &self.cluster.hosts {
                    let node = host.host.ip.to_string();
                    self.reach(from, protocol, &node, u16::try_from(node_port)?, backends)
                        .await?;
                }
            }
        }
        Ok(())
    }

    /// `dig @server +search NAME TYPE` (over TCP if `tcp`) in the pod at `from`.
    async fn dig_via(
        &self,
        from: IpAddr,
        server: &str,
        name: &str,
        rtype: &str,
        tcp: bool,
    ) -> Result<serde_json::Value> {
        let path = format!(
            "/dig?name={name}&type={rtype}&tcp={}&server={server}",
            u8::from(tcp)
        );
        let body = self.cluster.hosts[0]
            .on_host(async move { http_get(from, TEST_PORT, &path, Duration::from_secs(10)).await })
            .await??;
        Ok(serde_json::from_str(&body)?)
    }

    /// `dig +search NAME TYPE` (over TCP if `tcp`) in the pod at `from`: its answer.
    async fn dig(
        &self,
        from: IpAddr,
        name: &str,
        rtype: &str,
        tcp: bool,
    ) -> Result<serde_json::Value> {
        let path = format!("/dig?name={name}&type={rtype}&tcp={}", u8::from(tcp));
        let body = self.cluster.hosts[0]
            .on_host(async move { http_get(from, TEST_PORT, &path, Duration::from_secs(10)).await })
            .await??;
        Ok(serde_json::from_str(&body)?)
    }

    /// The values `dig` answers for `name`, over UDP and over TCP alike, retried (as
    /// validateDNSResults polls) until there are some.
    async fn dig_values(&self, from: IpAddr, name: &str, rtype: &str) -> Result<Vec<String>> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let mut values = Vec::new();
            for tcp in [false, true] {
                let answer = self.dig(from, name, rtype, tcp).await;
                let found: Vec<String> = answer
                    .as_ref()
                    .ok()
                    .and_then(|a| a["answers"].as_array())
                    .into_iter()
                    .flatten()
                    .filter(|a| a["type"] == rtype_code(rtype))
                    .filter_map(|a| a["value"].as_str().map(str::to_owned))
                    .collect();
                values.push((found, answer));
            }
            if let [(udp, _), (tcp, _)] = &values[..]
                && !udp.is_empty()
                && {
                    let (mut u, mut t) = (udp.clone(), tcp.clone());
                    u.sort();
                    t.sort();
                    u == t
                }
            {
                return Ok(udp.clone());
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "dig +search {name} {rtype} from {from} has no answer over UDP and TCP alike after 20 s: {:?}",
                    values
                        .iter()
                        .map(|(_, a)| a.as_ref().map_err(|e| format!("{e:#}")))
                        .collect::<Vec<_>>()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `getent hosts NAME` in the pod at `from`: the addresses.
    async fn getent(&self, from: IpAddr, name: &str) -> Result<Vec<String>> {
        let path = format!("/getent?name={name}&family=any");
        let body = self.cluster.hosts[0]
            .on_host(async move { http_get(from, TEST_PORT, &path, Duration::from_secs(10)).await })
            .await??;
        let json: serde_json::Value = serde_json::from_str(&body)?;
        Ok(serde_json::from_value(json["addresses"].clone())?)
    }
}

fn rtype_code(rtype: &str) -> u64 {
    match rtype {
        "A" => 1,
        "CNAME" => 5,
        "PTR" => 12,
        "AAAA" => 28,
        "SRV" => 33,
        _ => 0,
    }
}

/// Whether `ip` is in the Service CIDR.
fn in_service_cidr(ip: &str) -> bool {
    let cidr = trellis_agent::routes::parse_cidr(SERVICE_CIDR);
    match (cidr, ip.parse::<IpAddr>()) {
        (Some(cidr), Ok(ip)) => trellis_agent::routes::contains(cidr, ip),
        _ => false,
    }
}

fn cluster_ip(service: &Service) -> Option<&str> {
    service
        .spec
        .as_ref()
        .and_then(|s| s.cluster_ip.as_deref())
        .filter(|ip| !ip.is_empty())
}

fn node_ports(service: &Service) -> Vec<i32> {
    service
        .spec
        .iter()
        .flat_map(|s| s.ports.iter().flatten())
        .filter_map(|p| p.node_port)
        .collect()
}

/// "Services should serve a basic endpoint from pods" and "should serve multiport
/// endpoints from pods" (their EndpointSlices and reachability checks), with the
/// backends on two nodes and the exec pod on the first; then a Service whose pods all
/// went refuses at once (kube-proxy's reject), serves again as soon as a pod is ready,
/// and that pod reaches itself through its Service ("should allow pods to hairpin back
/// to themselves through services").
#[test]
fn services_serve_basic_and_multiport_endpoints_from_pods() -> Result<()> {
    with_cluster(|shared| async move {
        let cluster = shared.cluster.read().await;
        let ns = Ns::new(&shared, &cluster, "svc-endpoints").await?;
        ns.pod("execpod", 0, TEST_PORT, json!({}), |_| {}).await?;

        // should serve a basic endpoint from pods
        let labels = json!({"foo": "bar", "baz": "blah"});
        let svc = ns
            .service(json!({"metadata": {"name": "endpoint-test2"},
                "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": 80}]}}))
            .await?;
        ns.validate_endpoints("endpoint-test2", &[]).await?;
        let with_port = |pod: &mut serde_json::Value| {
            pod["spec"]["containers"][0]["ports"] = json!([{"containerPort": 80}]);
        };
        ns.pod("pod1", 0, 80, labels.clone(), with_port).await?;
        ns.ready("pod1").await?;
        ns.validate_endpoints("endpoint-test2", &[("pod1", &[80])])
            .await?;
        let exec = ns.ready("execpod").await?;
        // Checking if the Service forwards traffic to pod1
        ns.check_reachability(&svc, exec, &["pod1"]).await?;
        ns.pod("pod2", 1, 80, labels.clone(), with_port).await?;
        ns.ready("pod2").await?;
        ns.validate_endpoints("endpoint-test2", &[("pod1", &[80]), ("pod2", &[80])])
            .await?;
        // Checking if the Service forwards traffic to pod1 and pod2: both answer
        // (spread over the endpoints, the one on the other node included).
        ns.check_reachability(&svc, exec, &["pod1", "pod2"]).await?;
        let ip = cluster_ip(&svc).context("no clusterIP")?.to_owned();
        let answers = ns.hostnames(exec, "http", &ip, 80, 20).await?;
        ensure!(
            answers.iter().any(|a| a == "pod1") && answers.iter().any(|a| a == "pod2"),
            "20 requests to {ip} were not spread over pod1 and pod2: {answers:?}; {}",
            proxy_table(&cluster.hosts[0].host)
        );
        ns.delete_pod("pod1").await?;
        ns.validate_endpoints("endpoint-test2", &[("pod2", &[80])])
            .await?;
        // Checking if the Service forwards traffic to pod2
        ns.check_reachability(&svc, exec, &["pod2"]).await?;
        ns.delete_pod("pod2").await?;
        ns.validate_endpoints("endpoint-test2", &[]).await?;

        // Without a ready endpoint, a connection is refused at once (kube-proxy's
        // reject), not left to time out.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let json = ns
                .dial_from(
                    exec,
                    TEST_PORT,
                    format!("request=hostname&protocol=http&host={ip}&port=80&tries=1&timeout=3"),
                )
                .await?;
            let refused = json["errors"][0]
                .as_str()
                .is_some_and(|e| e.contains("refused"));
            let fast = json["failed_ms"][0].as_u64().is_some_and(|ms| ms < 1000);
            if refused && fast {
                break;
            }
            ensure!(
                tokio::time::Instant::now() < deadline,
                "{ip}:80 without endpoints is not refused at once: {json}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // ... and serves again as soon as an endpoint is ready.
        ns.pod("pod3", 1, 80, labels.clone(), with_port).await?;
        ns.ready("pod3").await?;
        let ready_at = tokio::time::Instant::now();
        ns.reach(exec, "http", &ip, 80, &["pod3"]).await?;
        eprintln!(
            "served {:?} after its endpoint was ready",
            ready_at.elapsed()
        );
        // should allow pods to hairpin back to themselves through services: pod3 asks
        // its own Service and gets itself.
        let pod3 = ns.ready("pod3").await?;
        let json = ns
            .dial_from(
                pod3,
                80,
                "request=hostname&protocol=http&host=endpoint-test2&port=80&tries=3".into(),
            )
            .await?;
        ensure!(
            json["responses"] == json!(["pod3", "pod3", "pod3"]),
            "pod3 through its own Service (hairpin): {json}"
        );

        // should serve multiport endpoints from pods
        let labels = json!({"multi": "port"});
        let svc = ns
            .service(json!({"metadata": {"name": "multi-endpoint-test"},
                "spec": {"selector": labels, "ports": [
                    {"name": "portname1", "port": 80, "targetPort": "svc1"},
                    {"name": "portname2", "port": 81, "targetPort": "svc2"}]}}))
            .await?;
        ns.validate_endpoints("multi-endpoint-test", &[]).await?;
        for (pod, node, port, port_name) in [("mpod1", 0, 100, "svc1"), ("mpod2", 1, 101, "svc2")] {
            ns.pod(pod, node, port, labels.clone(), |pod| {
                pod["spec"]["containers"][0]["ports"] =
                    json!([{"name": port_name, "containerPort": port}]);
            })
            .await?;
            ns.ready(pod).await?;
        }
        ns.validate_endpoints(
            "multi-endpoint-test",
            &[("mpod1", &[100]), ("mpod2", &[101])],
        )
        .await?;
        // Checking if the Service forwards traffic to pods: each port to the pod whose
        // named port it targets (named targetPorts resolve per pod).
        for (port, pod) in [(80, "mpod1"), (81, "mpod2")] {
            ns.reach(exec, "http", "multi-endpoint-test", port, &[pod])
                .await?;
            ns.reach(
                exec,
                "http",
                cluster_ip(&svc).context("no clusterIP")?,
                port,
                &[pod],
            )
            .await?;
        }
        ns.delete_pod("mpod1").await?;
        ns.validate_endpoints("multi-endpoint-test", &[("mpod2", &[101])])
            .await?;
        ns.delete_pod("mpod2").await?;
        ns.validate_endpoints("multi-endpoint-test", &[]).await
    })
}

/// "Services should be able to create a functioning NodePort service" (reachable by
/// name, ClusterIP and every node's IP on its NodePort), "should have session affinity
/// work for service with type clusterIP" (15 requests, one backend), a UDP Service, and
/// `internalTrafficPolicy: Local` (each node's clients get the node's own backend).
#[test]
fn services_nodeport_affinity_udp_and_local_traffic() -> Result<()> {
    with_cluster(|shared| async move {
        let cluster = shared.cluster.read().await;
        let ns = Ns::new(&shared, &cluster, "svc-web").await?;
        let web = json!({"app": "web"});
        for (pod, node) in [("web-0", 0), ("web-1", 1), ("web-2", 0)] {
            ns.pod(pod, node, BACKEND_PORT, web.clone(), |_| {}).await?;
        }
        ns.pod("execpod-a", 0, TEST_PORT, json!({}), |_| {}).await?;
        ns.pod("execpod-b", 1, TEST_PORT, json!({}), |_| {}).await?;
        let backends = ["web-0", "web-1", "web-2"];

        // should be able to create a functioning NodePort service
        let nodeport = ns
            .service(json!({"metadata": {"name": "nodeport-test"},
                "spec": {"type": "NodePort", "selector": web,
                    "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": BACKEND_PORT}]}}))
            .await?;
        let ip = cluster_ip(&nodeport).context("no clusterIP")?.to_owned();
        ensure!(
            in_service_cidr(&ip),
            "ClusterIP {ip} is not from {SERVICE_CIDR}"
        );
        let allocated = node_ports(&nodeport);
        ensure!(
            allocated.len() == 1 && NODE_PORTS.contains(&allocated[0]),
            "nodePort {allocated:?} is not from {NODE_PORTS:?}"
        );
        for pod in backends {
            ns.ready(pod).await?;
        }
        let exec_a = ns.ready("execpod-a").await?;
        let exec_b = ns.ready("execpod-b").await?;
        ns.check_reachability(&nodeport, exec_a, &backends).await?;
        // And from outside the pod network: the first node itself on the others'.
        let node_port = u16::try_from(allocated[0])?;
        for host in &cluster.hosts[1..] {
            let node = host.host.ip;
            let name = cluster.hosts[0]
                .on_host(async move {
                    http_get(node, node_port, "/hostname", Duration::from_secs(10)).await
                })
                .await?
                .with_context(|| format!("{node}:{node_port} from node {}", SETUP.hosts[0]))?;
            ensure!(
                backends.contains(&name.as_str()),
                "{node}:{node_port} answered {name}"
            );
        }

        // should have session affinity work for service with type clusterIP: 15
        // requests (AffinityConfirmCount) all go to one backend.
        let affinity = ns
            .service(json!({"metadata": {"name": "affinity-clusterip"},
                "spec": {"selector": web, "sessionAffinity": "ClientIP",
                    "ports": [{"port": 80, "targetPort": BACKEND_PORT}]}}))
            .await?;
        let timeout = affinity
            .spec
            .as_ref()
            .and_then(|s| s.session_affinity_config.as_ref())
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds);
        ensure!(
            timeout == Some(10800),
            "sessionAffinityConfig defaulted to {timeout:?}"
        );
        let ip = cluster_ip(&affinity).context("no clusterIP")?.to_owned();
        ns.reach(exec_a, "http", &ip, 80, &backends).await?;
        let answers = ns.hostnames(exec_a, "http", &ip, 80, 15).await?;
        ensure!(
            answers.iter().all(|a| *a == answers[0]),
            "with ClientIP affinity, 15 requests went to {answers:?}"
        );

        // internalTrafficPolicy: Local: a node's clients get only that node's
        // backends, also where other nodes have some.
        let local = ns
            .service(json!({"metadata": {"name": "local-only"},
                "spec": {"selector": web, "internalTrafficPolicy": "Local",
                    "ports": [{"port": 80, "targetPort": BACKEND_PORT}]}}))
            .await?;
        let ip = cluster_ip(&local).context("no clusterIP")?.to_owned();
        ns.reach(exec_a, "http", &ip, 80, &["web-0", "web-2"])
            .await?;
        ns.reach(exec_b, "http", &ip, 80, &["web-1"]).await?;
        let answers = ns.hostnames(exec_b, "http", &ip, 80, 10).await?;
        ensure!(
            answers.iter().all(|a| a == "web-1"),
            "node {}'s client left its node: {answers:?}",
            SETUP.hosts[1]
        );
        // A UDP Service: datagrams to the ClusterIP reach the backends' UDP port.
        let udp = ns
            .service(json!({"metadata": {"name": "udp-test"},
                "spec": {"selector": web,
                    "ports": [{"name": "udp", "port": 90, "protocol": "UDP", "targetPort": UDP_PORT}]}}))
            .await?;
        ns.check_reachability(&udp, exec_b, &backends)
            .await
            .with_context(|| proxy_table(&cluster.hosts[1].host))?;

        // should be able to preserve UDP traffic when server pod cycles for a ClusterIP
        // service: a client that keeps its source port (and so its conntrack entry)
        // reaches the new server once the old one is gone, as the node drops the
        // entries of an endpoint that went.
        let cycle = json!({"app": "udp-cycle"});
        ns.pod("udp-server-1", 0, BACKEND_PORT, cycle.clone(), |_| {})
            .await?;
        let svc = ns
            .service(json!({"metadata": {"name": "udp-cycle"},
                "spec": {"selector": cycle,
                    "ports": [{"port": 91, "protocol": "UDP", "targetPort": UDP_PORT}]}}))
            .await?;
        let ip = cluster_ip(&svc).context("no clusterIP")?.to_owned();
        ns.ready("udp-server-1").await?;
        let from_one_port = format!(
            "request=hostname&protocol=udp&host={ip}&port=91&tries=1&timeout=1&sport=40000"
        );
        let answered = |server: &'static str| {
            let (ns, query) = (&ns, from_one_port.clone());
            move || {
                let query = query.clone();
                async move {
                    let json = ns.dial_from(exec_a, TEST_PORT, query).await?;
                    ensure!(json["responses"] == json!([server]), "{json}");
                    Ok(())
                }
            }
        };
        until(answered("udp-server-1")).await?;
        ns.delete_pod("udp-server-1").await?;
        ns.pod("udp-server-2", 1, BACKEND_PORT, cycle.clone(), |_| {})
            .await?;
        ns.ready("udp-server-2").await?;
        until(answered("udp-server-2"))
            .await
            .context("the same client port after its server pod cycled")?;

        Ok(())
    })
}

/// "Services should be able to change the type from ExternalName to ClusterIP", "from
/// ExternalName to NodePort", "from ClusterIP to ExternalName" and "from NodePort to
/// ExternalName", and from ClusterIP to NodePort: each with its reachability check;
/// a ClusterIP and a NodePort that a change freed can be asked for again.
#[test]
fn services_change_type_allocating_and_freeing() -> Result<()> {
    with_cluster(|shared| async move {
        let cluster = shared.cluster.read().await;
        let ns = Ns::new(&shared, &cluster, "svc-types").await?;
        let jig = json!({"testid": "jig"});
        let backends = ["jig-0", "jig-1"];
        for (i, pod) in backends.iter().enumerate() {
            ns.pod(pod, i, BACKEND_PORT, jig.clone(), |_| {}).await?;
        }
        ns.pod("execpod", 0, TEST_PORT, json!({}), |_| {}).await?;
        let external_name = |name: &str| {
            json!({"metadata": {"name": name},
                "spec": {"type": "ExternalName", "externalName": "foo.example.com", "selector": jig}})
        };
        let http_port = || {
            serde_json::from_value::<Vec<k8s_openapi::api::core::v1::ServicePort>>(json!([
                {"port": 80, "name": "http", "protocol": "TCP", "targetPort": BACKEND_PORT}]))
        };
        for pod in backends {
            ns.ready(pod).await?;
        }
        let exec = ns.ready("execpod").await?;

        // should be able to change the type from ExternalName to ClusterIP
        let svc = ns.service(external_name("externalname-service")).await?;
        ensure!(
            cluster_ip(&svc).is_none(),
            "an ExternalName Service got a ClusterIP"
        );
        let ports = http_port()?;
        let svc = ns
            .update_service("externalname-service", |s| {
                let spec = s.spec.get_or_insert_default();
                spec.type_ = Some("ClusterIP".into());
                spec.external_name = None;
                spec.ports = Some(ports.clone());
            })
            .await?;
        let ip = cluster_ip(&svc).context("ExternalName → ClusterIP: no ClusterIP")?;
        ensure!(in_service_cidr(ip), "ClusterIP {ip}");
        ns.check_reachability(&svc, exec, &backends).await?;

        // should be able to change the type from ExternalName to NodePort
        ns.service(external_name("externalname-nodeport")).await?;
        let svc = ns
            .update_service("externalname-nodeport", |s| {
                let spec = s.spec.get_or_insert_default();
                spec.type_ = Some("NodePort".into());
                spec.external_name = None;
                spec.ports = Some(ports.clone());
            })
            .await?;
        ensure!(
            cluster_ip(&svc).is_some(),
            "ExternalName → NodePort: no ClusterIP"
        );
        ensure!(
            node_ports(&svc).iter().all(|p| NODE_PORTS.contains(p)) && node_ports(&svc).len() == 1,
            "ExternalName → NodePort: nodePorts {:?}",
            node_ports(&svc)
        );
        ns.check_reachability(&svc, exec, &backends).await?;

        // should be able to change the type from ClusterIP to ExternalName: the
        // ClusterIP is cleared (and free again); the name resolves through the CNAME
        // to the Service named.
        let external = ns
            .service(json!({"metadata": {"name": "externalsvc"},
                "spec": {"selector": jig, "ports": [{"port": 80, "targetPort": BACKEND_PORT}]}}))
            .await?;
        let external_fqdn = "externalsvc.svc-types.svc.cluster.local";
        let svc = ns
            .service(json!({"metadata": {"name": "clusterip-service"},
                "spec": {"selector": jig, "ports": [{"port": 80, "targetPort": BACKEND_PORT}]}}))
            .await?;
        let freed_ip = cluster_ip(&svc).context("no ClusterIP")?.to_owned();
        let svc = ns
            .update_service("clusterip-service", |s| {
                let spec = s.spec.get_or_insert_default();
                spec.type_ = Some("ExternalName".into());
                spec.external_name = Some(external_fqdn.into());
            })
            .await?;
        ensure!(cluster_ip(&svc).is_none(), "Spec.ClusterIP was not cleared");
        ns.check_reachability(&svc, exec, &backends).await?;
        let resolved = ns.getent(exec, "clusterip-service").await?;
        ensure!(
            resolved == [cluster_ip(&external).unwrap_or_default()],
            "clusterip-service resolves to {resolved:?}, not externalsvc's ClusterIP"
        );
        let again = ns
            .service(json!({"metadata": {"name": "reuses-clusterip"},
                "spec": {"clusterIP": freed_ip, "ports": [{"port": 80}]}}))
            .await
            .context("the ClusterIP freed by the change to ExternalName is asked for again")?;
        ensure!(cluster_ip(&again) == Some(freed_ip.as_str()), "{again:?}");

        // should be able to change the type from NodePort to ExternalName: the
        // ClusterIP is cleared and the NodePort released.
        let svc = ns
            .service(json!({"metadata": {"name": "nodeport-service"},
                "spec": {"type": "NodePort", "selector": jig,
                    "ports": [{"port": 80, "targetPort": BACKEND_PORT}]}}))
            .await?;
        let freed_port = node_ports(&svc).first().copied().context("no nodePort")?;
        let svc = ns
            .update_service("nodeport-service", |s| {
                let spec = s.spec.get_or_insert_default();
                spec.type_ = Some("ExternalName".into());
                spec.external_name = Some(external_fqdn.into());
            })
            .await?;
        ensure!(cluster_ip(&svc).is_none(), "Spec.ClusterIP was not cleared");
        ensure!(
            node_ports(&svc).is_empty(),
            "nodePorts kept: {:?}",
            node_ports(&svc)
        );
        ns.check_reachability(&svc, exec, &backends).await?;
        ns.service(json!({"metadata": {"name": "reuses-nodeport"},
            "spec": {"type": "NodePort", "ports": [{"port": 80, "nodePort": freed_port}]}}))
            .await
            .context("the NodePort freed by the change to ExternalName is asked for again")?;

        // From ClusterIP to NodePort: the ClusterIP is kept, a NodePort allocated, and
        // it is served on every node.
        let svc = ns
            .service(json!({"metadata": {"name": "clusterip-to-nodeport"},
                "spec": {"selector": jig, "ports": [{"port": 80, "targetPort": BACKEND_PORT}]}}))
            .await?;
        let kept = cluster_ip(&svc).context("no ClusterIP")?.to_owned();
        let svc = ns
            .update_service("clusterip-to-nodeport", |s| {
                s.spec.get_or_insert_default().type_ = Some("NodePort".into());
            })
            .await?;
        ensure!(
            cluster_ip(&svc) == Some(kept.as_str()),
            "the ClusterIP changed: {svc:?}"
        );
        ensure!(node_ports(&svc).len() == 1, "no nodePort: {svc:?}");
        ns.check_reachability(&svc, exec, &backends).await
    })
}

/// "DNS should provide DNS for the cluster", "for services", "should resolve DNS of
/// partial qualified names for services", "for pods for Hostname" (and for Subdomain)
/// and "for ExternalName services", each name over UDP and TCP as the checks' `dig`
/// does, from pods on two nodes; a name that does not exist is NXDOMAIN; TTLs are 5 s.
#[test]
fn dns_provides_records_for_the_cluster_services_and_pods() -> Result<()> {
    with_cluster(|shared| async move {
        let cluster = shared.cluster.read().await;
        let ns = Ns::new(&shared, &cluster, "dns").await?;
        let selector = json!({"dns-test": "true"});
        let port = json!([{"port": 80, "name": "http", "protocol": "TCP", "targetPort": 80}]);
        ns.service(json!({"metadata": {"name": "dns-test-service"},
            "spec": {"clusterIP": "None", "selector": selector, "ports": port}}))
            .await?;
        let regular = ns
            .service(json!({"metadata": {"name": "test-service-2"},
                "spec": {"selector": selector, "ports": port}}))
            .await?;
        let regular_ip = cluster_ip(&regular).context("no ClusterIP")?.to_owned();
        // The probing pod is the headless Service's endpoint, as in the checks.
        ns.pod("dns-querier-1", 0, TEST_PORT, selector.clone(), |pod| {
            pod["spec"]["hostname"] = json!("dns-querier-1");
            pod["spec"]["subdomain"] = json!("dns-test-service");
        })
        .await?;
        let hostname_selector = json!({"dns-test-hostname-attribute": "true"});
        ns.service(json!({"metadata": {"name": "dns-test-service-2"},
            "spec": {"clusterIP": "None", "selector": hostname_selector, "ports": port}}))
            .await?;
        ns.pod(
            "dns-querier-2",
            1,
            TEST_PORT,
            hostname_selector.clone(),
            |pod| {
                pod["spec"]["hostname"] = json!("dns-querier-2");
                pod["spec"]["subdomain"] = json!("dns-test-service-2");
            },
        )
        .await?;
        ns.service(json!({"metadata": {"name": "dns-test-service-3"},
            "spec": {"type": "ExternalName", "externalName": "foo.example.com"}}))
            .await?;
        let querier = ns.ready("dns-querier-1").await?;
        let querier_2 = ns.ready("dns-querier-2").await?;

        // The pods' resolver is the node-local server.
        let answer = ns
            .dig(querier, "kubernetes.default.svc.cluster.local", "A", false)
            .await?;
        ensure!(answer["nameserver"] == NODE_LOCAL_DNS, "{answer}");
        // The kube-dns ClusterIP reaches the same server, on the node (not DNATed to
        // the Service's endpoints, of which it has none), over UDP and TCP.
        for tcp in [false, true] {
            let answer = ns
                .dig_via(
                    querier,
                    KUBE_DNS,
                    "kubernetes.default.svc.cluster.local",
                    "A",
                    tcp,
                )
                .await?;
            ensure!(
                answer["nameserver"] == KUBE_DNS && answer["answers"][0]["value"] == "10.43.0.1",
                "through the kube-dns ClusterIP: {answer}"
            );
        }

        // should provide DNS for the cluster: the `kubernetes` Service's name, and the
        // pod's own A record (a-b-c-d.NS.pod.cluster.local).
        let pod_record =
            |ip: IpAddr| format!("{}.dns.pod.cluster.local", ip.to_string().replace('.', "-"));
        for from in [querier, querier_2] {
            let got = ns
                .dig_values(from, "kubernetes.default.svc.cluster.local", "A")
                .await?;
            ensure!(
                got == ["10.43.0.1"],
                "kubernetes.default.svc.cluster.local: {got:?}"
            );
            let got = ns.dig_values(from, &pod_record(from), "A").await?;
            ensure!(got == [from.to_string()], "{}: {got:?}", pod_record(from));
        }

        // should provide DNS for services: the headless Service's A records (its
        // endpoints), both Services' SRV records for their named port, the regular
        // Service's PTR.
        let fqdn = |name: &str| format!("{name}.dns.svc.cluster.local");
        let got = ns
            .dig_values(querier, &fqdn("dns-test-service"), "A")
            .await?;
        ensure!(
            got == [querier.to_string()],
            "headless dns-test-service: {got:?}"
        );
        for service in ["dns-test-service", "test-service-2"] {
            let name = format!("_http._tcp.{}", fqdn(service));
            let got = ns.dig_values(querier, &name, "SRV").await?;
            ensure!(
                got.len() == 1 && got[0].split(' ').nth(2) == Some("80"),
                "{name} SRV: {got:?}"
            );
        }
        let got = ns.dig_values(querier, &fqdn("test-service-2"), "A").await?;
        ensure!(got == [regular_ip.clone()], "test-service-2: {got:?}");
        let reversed: Vec<&str> = regular_ip.split('.').rev().collect();
        let ptr = format!("{}.in-addr.arpa.", reversed.join("."));
        let got = ns.dig_values(querier, &ptr, "PTR").await?;
        ensure!(
            got == [format!("{}.", fqdn("test-service-2"))],
            "{ptr}: {got:?}"
        );
        let answer = ns.dig(querier, &fqdn("test-service-2"), "A", false).await?;
        ensure!(
            answer["answers"][0]["ttl"].as_u64().is_some_and(|t| t <= 5),
            "TTL of 5 s: {answer}"
        );

        // should resolve DNS of partial qualified names for services: through the
        // pod's search list.
        for name in [
            "dns-test-service",
            "dns-test-service.dns",
            "dns-test-service.dns.svc",
        ] {
            let got = ns.dig_values(querier, name, "A").await?;
            ensure!(got == [querier.to_string()], "{name}: {got:?}");
        }
        for name in [
            "_http._tcp.dns-test-service.dns.svc",
            "_http._tcp.test-service-2.dns.svc",
        ] {
            let got = ns.dig_values(querier, name, "SRV").await?;
            ensure!(got.len() == 1, "{name} SRV: {got:?}");
        }

        // should provide DNS for pods for Hostname: the pod's FQDN and its hostname
        // resolve (getent hosts) to the pod; and for Subdomain, the FQDN and the
        // subdomain are A records.
        let host_fqdn = "dns-querier-2.dns-test-service-2.dns.svc.cluster.local";
        for name in [host_fqdn, "dns-querier-2"] {
            let got = ns.getent(querier_2, name).await?;
            ensure!(
                got == [querier_2.to_string()],
                "getent hosts {name}: {got:?}"
            );
        }
        for name in [host_fqdn, "dns-test-service-2.dns.svc.cluster.local"] {
            let got = ns.dig_values(querier, name, "A").await?;
            ensure!(got == [querier_2.to_string()], "{name}: {got:?}");
        }

        // should provide DNS for ExternalName services: a CNAME, which follows a change
        // of externalName, then an A record once the Service is a ClusterIP one.
        let name = fqdn("dns-test-service-3");
        let got = ns.dig_values(querier, &name, "CNAME").await?;
        ensure!(got == ["foo.example.com."], "{name} CNAME: {got:?}");
        ns.update_service("dns-test-service-3", |s| {
            s.spec.get_or_insert_default().external_name = Some("bar.example.com".into());
        })
        .await?;
        until(|| async {
            let got = ns.dig_values(querier, &name, "CNAME").await?;
            ensure!(got == ["bar.example.com."], "{name} CNAME: {got:?}");
            Ok(())
        })
        .await?;
        let ports: Vec<k8s_openapi::api::core::v1::ServicePort> =
            serde_json::from_value(json!([{"port": 80, "name": "http", "protocol": "TCP"}]))?;
        let svc = ns
            .update_service("dns-test-service-3", |s| {
                let spec = s.spec.get_or_insert_default();
                spec.type_ = Some("ClusterIP".into());
                spec.external_name = None;
                spec.ports = Some(ports.clone());
            })
            .await?;
        let ip = cluster_ip(&svc).context("no ClusterIP")?.to_owned();
        until(|| async {
            let got = ns.dig_values(querier, &name, "A").await?;
            ensure!(got == [ip.clone()], "{name} A: {got:?}");
            Ok(())
        })
        .await?;

        // AAAA of an IPv4 Service: no data (NOERROR), at once, over UDP and TCP; the C
        // library asks A and AAAA together for every name a program looks up.
        for tcp in [false, true] {
            let answer = ns
                .dig(querier, &fqdn("test-service-2"), "AAAA", tcp)
                .await?;
            ensure!(
                answer["rcode"] == 0
                    && answer["answers"] == json!([])
                    && answer.get("error").is_none(),
                "AAAA of test-service-2 (tcp: {tcp}): {answer}"
            );
        }
        let got = ns.getent(querier, "test-service-2").await?;
        ensure!(
            got == [regular_ip.clone()],
            "getent hosts test-service-2: {got:?}"
        );

        // A name in the cluster domain that does not exist: NXDOMAIN.
        let answer = ns
            .dig(querier, "no-such-service.dns.svc.cluster.local.", "A", true)
            .await?;
        ensure!(
            answer["rcode"] == 3 && answer["answers"] == json!([]),
            "{answer}"
        );
        Ok(())
    })
}

/// The agent of one node stops and starts again while a pod on that node uses a
/// Service: traffic keeps flowing while it is down (the table stays, as kube-proxy's
/// rules do), and once it is back its table is rebuilt from what changed meanwhile (an
/// endpoint gone, the table flushed behind its back); drift while it runs is repaired
/// by its resync.
#[test]
fn a_restarted_node_agent_keeps_service_traffic_flowing_and_repairs_its_table() -> Result<()> {
    with_cluster(|shared| async move {
        // Alone on the cluster: the other tests' pods on this node would not resolve
        // names while its DNS server is down.
        let mut cluster = shared.cluster.write().await;
        let node = 2;
        let (client, service_ip) = {
            let ns = Ns::new(&shared, &cluster, "svc-restart").await?;
            let app = json!({"app": "restart"});
            ns.pod("restart-0", 0, BACKEND_PORT, app.clone(), |_| {})
                .await?;
            ns.pod("restart-1", 1, BACKEND_PORT, app.clone(), |_| {})
                .await?;
            ns.pod("client", node, TEST_PORT, json!({}), |_| {}).await?;
            let svc = ns
                .service(json!({"metadata": {"name": "restart"},
                    "spec": {"selector": app, "ports": [{"port": 80, "targetPort": BACKEND_PORT}]}}))
                .await?;
            ns.ready("restart-0").await?;
            ns.ready("restart-1").await?;
            let client = ns.ready("client").await?;
            ns.reach(client, "http", "restart", 80, &["restart-0", "restart-1"])
                .await?;
            (client, cluster_ip(&svc).context("no ClusterIP")?.to_owned())
        };
        // `nft` in the node's namespace.
        let nft = |args: &[&str]| -> Result<String> {
            let out = std::process::Command::new("ip")
                .args(["netns", "exec", SETUP.hosts[node], "nft"])
                .args(args)
                .output()?;
            ensure!(
                out.status.success(),
                "nft {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        };

        cluster.hosts[node].stop_agent().await?;
        {
            // While the agent is down, the node's pods still reach the Service.
            let ns = Ns {
                cluster: &cluster,
                slices: &shared.slices,
                name: "svc-restart",
            };
            ns.hostnames(client, "http", &service_ip, 80, 5).await?;
            // Meanwhile an endpoint goes, and the table is flushed behind its back.
            ns.delete_pod("restart-1").await?;
            ns.validate_endpoints("restart", &[("restart-0", &[BACKEND_PORT])])
                .await?;
        }
        nft(&["flush", "table", "ip", "trellis-proxy"])?;
        cluster.hosts[node].start_agent().await?;
        let restarted = tokio::time::Instant::now();
        let ns = Ns {
            cluster: &cluster,
            slices: &shared.slices,
            name: "svc-restart",
        };
        ns.reach(client, "http", &service_ip, 80, &["restart-0"])
            .await?;
        let answers = ns.hostnames(client, "http", &service_ip, 80, 10).await?;
        ensure!(
            answers.iter().all(|a| a == "restart-0"),
            "after the restart, the gone endpoint still gets traffic: {answers:?}"
        );
        eprintln!(
            "the table was repaired {:?} after the restart",
            restarted.elapsed()
        );
        // Drift while it runs: a flushed table is rebuilt by the next resync.
        nft(&["flush", "table", "ip", "trellis-proxy"])?;
        let flushed = tokio::time::Instant::now();
        ns.reach(client, "http", &service_ip, 80, &["restart-0"])
            .await?;
        eprintln!("drift repaired in {:?}", flushed.elapsed());
        let listed = nft(&["list", "table", "ip", "trellis-proxy"])?;
        ensure!(
            listed.contains(&service_ip),
            "the table has no rule for {service_ip}: {listed}"
        );
        Ok(())
    })
}

/// The proxy's table on `host`, for a failure's message.
fn proxy_table(host: &trellis_tests::hosts::Host) -> String {
    match std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &host.name,
            "nft",
            "list",
            "table",
            "ip",
            "trellis-proxy",
        ])
        .output()
    {
        Ok(out) => format!(
            "the proxy's table on {}:\n{}{}",
            host.name,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => format!("nft on {}: {e}", host.name),
    }
}

/// Retries `probe` (a bounded retry of a real probe) for up to 20 s until it holds.
async fn until<F, Fut>(probe: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match probe().await {
            Ok(()) => return Ok(()),
            Err(e) if tokio::time::Instant::now() > deadline => return Err(e.context("for 20 s")),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
