//! Pods across nodes: two test hosts (network namespaces of their own on this machine,
//! joined by a bridge, `trellis_tests::hosts`) each run Trellis' runtime and node agent
//! with the pod network, against one API server in the test process (reached through
//! its in-process client, as hosts on one machine may). The agents program the routes
//! between the hosts; pods reach pods on the other host with their own source IP (no
//! NAT), the nodes reach pods, and a Node that goes takes its route with it. With it,
//! Kubernetes' conformance checks "Networking Granular Checks: Pods should function for
//! intra-pod communication: http/udp" and "for node-pod communication: http/udp", with
//! agnhost netexec's `/hostname`, `/clientip` and `/dial` written in Python as a
//! `process` container. A `wasi:http` component on one node answers a `wasi:sockets`
//! program on the other (`hello-http` and `dial`, built by plugins/build.sh).
//!
//! Needs root, `ip`, `nft`, python3 and the CNI plugins; skipped otherwise. Each test
//! has its own LAN (bridge and /24) and pod range.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_agent::AgentConfig;
use trellis_agent::routes::{Backend, contains, parse_cidr};
use trellis_api::{Shutdown, Stop, UserInfo};
use trellis_client::identity;
use trellis_client::informer::{Informer, SharedInformers};
use trellis_runtime::{Runtime, RuntimeConfig};
use trellis_tests::TestCluster;
use trellis_tests::hosts::{Host, Lan, http_get, unpin_all};

use super::node::{phase, wait_pod};

/// agnhost netexec's endpoints that the conformance checks use: `/hostname` (the pod's
/// name), `/clientip` (the caller's address as the server sees it) and `/dial` (asks
/// another server, over HTTP or UDP, `tries` times, and returns its answers), on an
/// HTTP port; on a UDP port, `hostname` and `clientip` as datagrams.
const NETEXEC: &str = r#"
import json, os, socket, sys, threading, urllib.parse, urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
NAME = os.environ["POD_NAME"]
HTTP, UDP = int(sys.argv[1]), int(sys.argv[2])
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def answer(request, peer):
    return NAME if request == "hostname" else "%s:%d" % peer[:2] if request == "clientip" else "unknown"
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("", UDP))
    while True:
        data, peer = s.recvfrom(1024)
        s.sendto(answer(data.decode().strip(), peer).encode(), peer)
def dial(q):
    request, protocol, host, port = q["request"][0], q["protocol"][0], q["host"][0], int(q["port"][0])
    responses, errors = [], []
    for _ in range(int(q.get("tries", ["1"])[0])):
        try:
            if protocol == "http":
                with OPENER.open("http://%s:%d/%s" % (host, port, request), timeout=3) as r:
                    responses.append(r.read().decode())
            else:
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.settimeout(3)
                s.sendto((request + "\n").encode(), (host, port))
                responses.append(s.recvfrom(1024)[0].decode().strip())
                s.close()
        except Exception as e:
            errors.append(str(e))
    return {"responses": responses, "errors": errors}
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        url = urllib.parse.urlparse(self.path)
        if url.path == "/dial":
            body = json.dumps(dial(urllib.parse.parse_qs(url.query)))
        elif url.path in ("/hostname", "/clientip"):
            body = answer(url.path[1:], self.client_address)
        else:
            self.send_error(404)
            return
        body = body.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
threading.Thread(target=udp, daemon=True).start()
ThreadingHTTPServer(("", HTTP), Handler).serve_forever()
"#;

/// netexec's ports in the conformance checks: the endpoints' HTTP and UDP, and the
/// test container's HTTP (on the host network in the node-pod checks).
const HTTP_PORT: u16 = 8083;
const UDP_PORT: u16 = 8081;
const TEST_PORT: u16 = 9080;
/// The `wasi:http` component's port.
const WEB_PORT: u16 = 8090;

/// One host's runtime and agent, on the host's own Tokio runtime.
struct Running {
    host: Host,
    runtime: Option<tokio::runtime::Runtime>,
    stop: Option<Stop>,
    agent: Option<tokio::task::JoinHandle<Result<()>>>,
    server: Option<tokio::task::JoinHandle<Result<()>>>,
    dir: tempfile::TempDir,
}

impl Running {
    /// Starts the runtime and an agent named as the host, with `backend`.
    async fn start(
        cluster: &TestCluster,
        host: Host,
        backend: Backend,
        cluster_cidr: &str,
        pod_cidr: &str,
    ) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let root = dir.path().to_path_buf();
        // A bridge network as the default one but without the bridge's masquerade,
        // which knows only the node's subnet and would masquerade traffic to other
        // nodes' pods; the agent masquerades what leaves the cluster. Run by the CNI
        // plugins (the runtime's in-process bridge sets hairpin mode through /sys,
        // which shows the root namespace's links, not a test host's).
        let conf_dir = root.join("cni/net.d");
        std::fs::create_dir_all(&conf_dir)?;
        std::fs::write(
            conf_dir.join("10-multinode.conflist"),
            serde_json::to_vec_pretty(&json!({
                "cniVersion": "1.0.0",
                "name": "multinode",
                "plugins": [{
                    "type": "bridge",
                    "bridge": "trellis0",
                    "isGateway": true,
                    "ipMasq": false,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": pod_cidr}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": root.join("cni/networks"),
                    }
                }]
            }))?,
        )?;
        let runtime = host.runtime()?;
        let (stop, stopped) = Shutdown::new();
        let name = host.name.clone();
        let ip = host.ip;
        let client = cluster.in_process().client(identity::node(&name));
        let cidr = cluster_cidr.to_owned();
        let on_host = root.clone();
        let started = runtime.spawn(async move {
            let root = on_host;
            let cri_runtime = Runtime::with_cni(
                trellis_tests::sandboxed(RuntimeConfig {
                    root: root.join("runtime"),
                    // Shared with the other tests: the components compile once.
                    cache_dir: Some(Path::new(env!("CARGO_TARGET_TMPDIR")).join("runtime-cache")),
                    process_handler: true,
                    node_ip: ip,
                    ..Default::default()
                }),
                trellis_runtime::CniConfig {
                    conf_dir: Some(conf_dir),
                    bin_dirs: Vec::new(),
                },
            )?;
            let socket = root.join("cri.sock");
            let listener = trellis_runtime::listen(&socket)?;
            let server_stop = stopped.clone();
            let server = tokio::spawn(async move {
                trellis_runtime::serve_on(cri_runtime, listener, async move {
                    server_stop.wait().await;
                })
                .await
            });
            let cri = trellis_runtime::connect(&socket).await?;
            let mut config = AgentConfig::new(&name, ip, root.join("agent"));
            config.pod_network = true;
            config.pod_network_backend = backend;
            config.cluster_cidrs = vec![cidr];
            config.relist_period = Duration::from_millis(50);
            config.port = 0;
            config.eviction_hard = None;
            let agent = tokio::spawn(trellis_agent::run(
                config,
                client,
                cri,
                SharedInformers::new(),
                stopped,
            ));
            anyhow::Ok((agent, server))
        });
        let (agent, server) = started.await??;
        Ok(Self {
            host,
            runtime: Some(runtime),
            stop: Some(stop),
            agent: Some(agent),
            server: Some(server),
            dir,
        })
    }

    /// Runs `f` on the host (in its network namespace).
    async fn on_host<T: Send + 'static>(
        &self,
        f: impl Future<Output = T> + Send + 'static,
    ) -> Result<T> {
        Ok(self.spawn(f)?.await?)
    }

    /// Starts `f` on the host (in its network namespace).
    fn spawn<T: Send + 'static>(
        &self,
        f: impl Future<Output = T> + Send + 'static,
    ) -> Result<tokio::task::JoinHandle<T>> {
        let runtime = self.runtime.as_ref().context("the host is stopped")?;
        Ok(runtime.spawn(f))
    }

    /// The log of `pod`'s container `container` (its first attempt), as the agent
    /// keeps it.
    fn log(&self, pod: &Pod, container: &str) -> Result<String> {
        let path = self
            .dir
            .path()
            .join("agent/logs")
            .join(format!(
                "default_{}_{}",
                pod.metadata.name.as_deref().unwrap_or_default(),
                pod.metadata.uid.as_deref().unwrap_or_default()
            ))
            .join(container)
            .join("0.log");
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))
    }

    /// Stops the agent and the runtime, and waits for them.
    async fn stop(&mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            stop.stop();
        }
        if let Some(agent) = self.agent.take() {
            agent.await??;
        }
        if let Some(server) = self.server.take() {
            server.await??;
        }
        Ok(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            stop.stop();
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
        for pins in ["netns", "utsns", "ipcns"] {
            unpin_all(&self.dir.path().join("runtime").join(pins));
        }
    }
}

/// The test's parts, dropped in this order: hosts, then their LAN.
struct Cluster {
    hosts: Vec<Running>,
    _lan: Lan,
    admin: kube::Client,
    pods: Arc<Informer<Pod>>,
    _watching: SharedInformers,
    script: tempfile::TempDir,
    // Last: the API server outlives the agents.
    api: TestCluster,
}

/// What differs between the tests.
struct Setup {
    bridge: &'static str,
    /// The LAN's /24, as its first three octets.
    lan: &'static str,
    /// The hosts' namespaces.
    hosts: [&'static str; 2],
    /// The cluster CIDR and each host's podCIDR in it.
    cluster_cidr: &'static str,
    pod_cidrs: [&'static str; 2],
    backend: Backend,
}

fn skip() -> bool {
    let missing = if !rustix::process::geteuid().is_root() {
        Some("root")
    } else {
        [
            "/usr/lib/cni/bridge",
            "/usr/bin/python3",
            "/usr/sbin/nft",
            "/usr/sbin/ip",
        ]
        .into_iter()
        .find(|p| !Path::new(p).exists())
    };
    if let Some(missing) = missing {
        eprintln!("skipped: pods across nodes need {missing} (root, make deps)");
    }
    missing.is_some()
}

async fn start(setup: &Setup) -> Result<Cluster> {
    let api = TestCluster::start().await?;
    let mut lan = Lan::new(setup.bridge, setup.lan)?;
    let admin = api
        .in_process()
        .client(UserInfo::new("admin", ["system:masters"]));
    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let script = tempfile::tempdir()?;
    std::fs::write(script.path().join("netexec.py"), NETEXEC)?;
    // Readable by the pods' user (nobody), which gets it as a read-only volume.
    std::fs::set_permissions(
        script.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )?;
    let mut hosts = Vec::new();
    for (i, name) in setup.hosts.iter().enumerate() {
        let host = lan.host(name, 2 + i as u8)?;
        hosts.push(
            Running::start(
                &api,
                host,
                setup.backend,
                setup.cluster_cidr,
                setup.pod_cidrs[i],
            )
            .await?,
        );
    }
    // The node IPAM controller's part (tested on its own), done by hand so that each
    // test keeps to its range.
    let nodes: Api<Node> = Api::all(admin.clone());
    for (name, cidr) in setup.hosts.iter().zip(setup.pod_cidrs) {
        tokio::time::timeout(
            Duration::from_secs(30),
            kube::runtime::wait::await_condition(nodes.clone(), name, |n: Option<&Node>| {
                n.and_then(|n| n.status.as_ref()).is_some()
            }),
        )
        .await
        .with_context(|| format!("node {name} registered within 30 s"))??;
        nodes
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"podCIDR": cidr, "podCIDRs": [cidr]}})),
            )
            .await?;
    }
    Ok(Cluster {
        hosts,
        _lan: lan,
        admin,
        pods,
        _watching: watching,
        script,
        api,
    })
}

impl Cluster {
    /// A netexec pod on `node`: `port` for HTTP (and UDP_PORT for UDP), Ready once it
    /// answers.
    async fn netexec(&self, name: &str, node: &str, host_network: bool, port: u16) -> Result<()> {
        let dir = self.script.path().display().to_string();
        let script = self.script.path().join("netexec.py");
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"nodeName": node, "runtimeClassName": "process",
                "hostNetwork": host_network,
                "terminationGracePeriodSeconds": 1,
                "volumes": [{"name": "script", "hostPath": {"path": dir}}],
                "containers": [{"name": "netexec", "image": "file:///bin/sh",
                    "volumeMounts": [{"name": "script", "mountPath": dir, "readOnly": true}],
                    "command": ["/bin/sh", "-c",
                        format!("exec /usr/bin/python3 {} {port} {UDP_PORT}", script.display())],
                    "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                    "ports": [{"containerPort": port}],
                    "readinessProbe": {"httpGet": {"path": "/hostname", "port": port}, "periodSeconds": 1}}]}
        }))?;
        Api::<Pod>::namespaced(self.admin.clone(), "default")
            .create(&PostParams::default(), &pod)
            .await?;
        Ok(())
    }

    /// Creates `pod` in `default`.
    async fn create(&self, pod: serde_json::Value) -> Result<()> {
        let pod: Pod = serde_json::from_value(pod)?;
        Api::<Pod>::namespaced(self.admin.clone(), "default")
            .create(&PostParams::default(), &pod)
            .await?;
        Ok(())
    }

    /// Waits until pod `name` is Ready; its IP.
    async fn ready(&self, name: &str) -> Result<IpAddr> {
        let pod = wait_pod(&self.pods, name, Duration::from_secs(60), |p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                .is_some_and(|c| c.status == "True")
        })
        .await?;
        let ip = pod.status.as_ref().and_then(|s| s.pod_ip.clone());
        ip.context("no podIP")?.parse().context("podIP")
    }

    /// What `/dial` on the test container at `from` ([`TEST_PORT`], asked from the
    /// first host as the conformance checks ask from a host-network pod) got from
    /// `target` (at most five tries, as the checks' retries).
    async fn dial(
        &self,
        from: IpAddr,
        request: &str,
        protocol: &str,
        target: IpAddr,
        target_port: u16,
    ) -> Result<Vec<String>> {
        let path = format!(
            "/dial?request={request}&protocol={protocol}&host={target}&port={target_port}&tries=1"
        );
        let mut last = None;
        for _ in 0..5 {
            let path = path.clone();
            let answer = self.hosts[0]
                .on_host(
                    async move { http_get(from, TEST_PORT, &path, Duration::from_secs(10)).await },
                )
                .await?;
            match answer.and_then(|body| {
                let json: serde_json::Value = serde_json::from_str(&body)?;
                let responses: Vec<String> = serde_json::from_value(json["responses"].clone())?;
                ensure!(!responses.is_empty(), "{body}");
                Ok(responses)
            }) {
                Ok(responses) => return Ok(responses),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no try")))
            .with_context(|| format!("{request} over {protocol} from {from} to {target}"))
    }

    /// Deletes the pods, waits until the agents removed them, then stops the hosts.
    async fn stop(mut self, names: &[&str]) -> Result<()> {
        let api: Api<Pod> = Api::namespaced(self.admin.clone(), "default");
        let forced = DeleteParams::default().grace_period(0);
        for name in names {
            let _ = api.delete(name, &forced).await;
        }
        let gone = async {
            let mut changes = self.pods.subscribe();
            while names
                .iter()
                .any(|n| self.pods.get(&format!("default/{n}")).is_some())
            {
                changes.recv().await.context("pod informer ended")?;
            }
            anyhow::Ok(())
        };
        let gone = tokio::time::timeout(Duration::from_secs(30), gone).await;
        for host in &mut self.hosts {
            // The pods' sandboxes are gone once their pins are.
            let netns = host.dir.path().join("runtime/netns");
            let pins = || {
                std::fs::read_dir(&netns)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            };
            // Stopped either way; the guard unmounts what is left.
            let _ = trellis_tests::wait_removed(&netns, pins, Duration::from_secs(15)).await;
            host.stop().await?;
        }
        gone.context("the pods were not removed")??;
        drop(self.hosts);
        self.api.stop().await
    }
}

/// Whether `host` has a route of Trellis' protocol to `cidr`.
fn has_route(host: &Host, cidr: &str) -> Result<bool> {
    let routes = host.ip(&["route", "show", "proto", "84"])?;
    Ok(routes.lines().any(|l| l.starts_with(&format!("{cidr} "))))
}

/// Waits, probing the host's routes, until `want` holds for the route to `cidr`.
async fn wait_route(host: &Host, cidr: &str, want: bool) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if has_route(host, cidr)? == want {
            return Ok(());
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "host {} {} a route to {cidr} after 20 s: {}",
            host.name,
            if want { "has not" } else { "still has" },
            host.ip(&["route"])?
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The two nodes share a link: the agents route each other's pods through each
/// other's InternalIP (`host-gw`, chosen by `auto`). Kubernetes' Granular Checks run as
/// they do: a test container pod `/dial`s the endpoint pod of each node by HTTP and by
/// UDP and gets its hostname (intra-pod), and so does a test container on the host's
/// network (node-pod); across nodes the endpoint sees the client pod's own IP. A
/// `wasi:sockets` program on the second node gets the answer of a `wasi:http`
/// component on the first (both `wasmtime` pods). A deleted Node's route goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn granular_checks_pods_function_for_intra_pod_and_node_pod_communication() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let setup = Setup {
        bridge: "trellis-mn80",
        lan: "10.244.80",
        hosts: ["mn80-a", "mn80-b"],
        cluster_cidr: "10.244.87.0/24",
        pod_cidrs: ["10.244.87.0/26", "10.244.87.64/26"],
        backend: Backend::Auto,
    };
    let cluster = start(&setup).await?;
    let [a, b] = setup.hosts;
    let names = [
        "netserver-0",
        "netserver-1",
        "test-container",
        "host-test-container",
        "web",
        "dialer",
    ];
    let image = |name: &str| -> Result<String> {
        Ok(format!(
            "file://{}",
            trellis_tests::plugin_wasm(name)?.display()
        ))
    };
    let work = async {
        cluster.netexec("netserver-0", a, false, HTTP_PORT).await?;
        cluster.netexec("netserver-1", b, false, HTTP_PORT).await?;
        cluster.netexec("test-container", a, false, TEST_PORT).await?;
        cluster.netexec("host-test-container", a, true, TEST_PORT).await?;
        // No runtimeClassName: the agents' default handler, wasmtime.
        cluster
            .create(json!({
                "metadata": {"name": "web"},
                "spec": {"nodeName": a, "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "web", "image": image("hello-http")?,
                        "env": [{"name": "GREETING", "value": a}],
                        "ports": [{"containerPort": WEB_PORT}]}]}
            }))
            .await?;
        let endpoints = [
            ("netserver-0", cluster.ready("netserver-0").await?),
            ("netserver-1", cluster.ready("netserver-1").await?),
        ];
        let test_container = cluster.ready("test-container").await?;
        let host_container = cluster.ready("host-test-container").await?;
        ensure!(host_container == cluster.hosts[0].host.ip, "{host_container}");
        for ((name, ip), cidr) in endpoints.iter().zip(setup.pod_cidrs) {
            let cidr = parse_cidr(cidr).context("podCIDR")?;
            ensure!(contains(cidr, *ip), "{name}'s IP {ip} is from its node's podCIDR");
        }
        wait_route(&cluster.hosts[0].host, setup.pod_cidrs[1], true).await?;
        wait_route(&cluster.hosts[1].host, setup.pod_cidrs[0], true).await?;
        ensure!(
            cluster.hosts[0].host.ip(&["route", "show", setup.pod_cidrs[1]])?.contains("via 10.244.80.3"),
            "host-gw: via the other node's InternalIP"
        );
        // Ready once it listens (the runtime binds before the start returns); the
        // program runs while the checks below do.
        let web = cluster.ready("web").await?;
        cluster
            .create(json!({
                "metadata": {"name": "dialer"},
                "spec": {"nodeName": b, "restartPolicy": "Never",
                    "containers": [{"name": "dial", "image": image("dial")?,
                        "env": [{"name": "GET", "value": format!("{web}:{WEB_PORT}/")}]}]}
            }))
            .await?;

        for (check, from) in [("intra-pod", test_container), ("node-pod", host_container)] {
            for (protocol, port) in [("http", HTTP_PORT), ("udp", UDP_PORT)] {
                for (name, ip) in &endpoints {
                    let got = cluster
                        .dial(from, "hostname", protocol, *ip, port)
                        .await
                        .with_context(|| format!("{check} communication: {protocol}"))?;
                    ensure!(
                        got == [name.to_string()],
                        "{check} {protocol}: {name} at {ip} answered {got:?}"
                    );
                }
            }
        }
        // No NAT between pods: the endpoint on the other node sees the client pod's IP.
        for protocol in ["http", "udp"] {
            let port = if protocol == "http" { HTTP_PORT } else { UDP_PORT };
            let seen = cluster
                .dial(test_container, "clientip", protocol, endpoints[1].1, port)
                .await?;
            let seen = seen[0].rsplit_once(':').map(|(ip, _)| ip.to_owned()).unwrap_or_default();
            ensure!(
                seen == test_container.to_string(),
                "across nodes over {protocol}, the server saw {seen}, not the client pod's {test_container}"
            );
        }
        // What leaves the cluster CIDR is masqueraded: a server on the other node's
        // own address (outside the cluster CIDR, though that node could route the
        // reply to the pod) sees the client's node, not the pod.
        let node_b = cluster.hosts[1].host.ip;
        let outside = cluster.hosts[1]
            .on_host(async move { tokio::net::TcpListener::bind((node_b, 0)).await })
            .await??;
        let port = outside.local_addr()?.port();
        let serving = cluster.hosts[1].spawn(serve_client_ip(outside))?;
        let seen = cluster
            .dial(test_container, "clientip", "http", node_b, port)
            .await;
        serving.abort();
        let seen = seen?;
        let node_a = cluster.hosts[0].host.ip.to_string();
        ensure!(
            seen[0].rsplit_once(':').map(|(ip, _)| ip) == Some(node_a.as_str()),
            "a pod's request to {node_b} comes from its node {node_a}, not {seen:?}"
        );

        // The program on the second node got the component's answer from the first.
        let dialer = wait_pod(&cluster.pods, "dialer", Duration::from_secs(30), |p| {
            matches!(phase(p), "Succeeded" | "Failed")
        })
        .await?;
        let status = dialer.status.as_ref().context("dialer status")?;
        let dialer_ip: IpAddr = status.pod_ip.as_deref().context("dialer podIP")?.parse()?;
        ensure!(
            contains(parse_cidr(setup.pod_cidrs[1]).context("podCIDR")?, dialer_ip),
            "the dialer's IP {dialer_ip} is from {b}'s podCIDR"
        );
        let log = cluster.hosts[1].log(&dialer, "dial")?;
        // CRI log lines: time, stream, tag, then the line.
        let lines: Vec<&str> = log.lines().filter_map(|l| l.splitn(4, ' ').nth(3)).collect();
        ensure!(
            lines == [format!("get {web}:{WEB_PORT}/: 200 hello from {a}")]
                && phase(&dialer) == "Succeeded",
            "the wasi:sockets program on {b} asked the wasi:http component on {a}: {log}"
        );

        // A Node that goes takes its route with it.
        let nodes: Api<Node> = Api::all(cluster.admin.clone());
        nodes.delete(b, &DeleteParams::default()).await?;
        wait_route(&cluster.hosts[0].host, setup.pod_cidrs[1], false).await
    }
    .await;
    let stopped = cluster.stop(&names).await;
    if let Err(e) = &stopped {
        eprintln!("stop: {e:#}");
    }
    work?;
    stopped
}

/// Answers each HTTP request on `listener` with the caller's address, as netexec's
/// `/clientip`.
async fn serve_client_ip(listener: tokio::net::TcpListener) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    while let Ok((mut tcp, peer)) = listener.accept().await {
        tokio::spawn(async move {
            let mut request = [0u8; 4096];
            let _ = tcp.read(&mut request).await;
            let body = peer.to_string();
            let reply = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = tcp.write_all(reply.as_bytes()).await;
        });
    }
}

/// With the `vxlan` backend the same pods talk through the overlay (`trellis.1`, VNI 1,
/// port 8472): a pod reaches a pod on the other node with its own source IP over HTTP
/// and UDP, and a node reaches the other node's pods; a deleted Node's route, fdb and
/// neighbour entries go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_reach_pods_on_other_nodes_over_vxlan_without_nat() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let setup = Setup {
        bridge: "trellis-mn88",
        lan: "10.244.88",
        hosts: ["mn88-a", "mn88-b"],
        cluster_cidr: "10.244.89.0/24",
        pod_cidrs: ["10.244.89.0/26", "10.244.89.64/26"],
        backend: Backend::Vxlan,
    };
    let cluster = start(&setup).await?;
    let [a, b] = setup.hosts;
    let names = ["client", "server"];
    let work = async {
        cluster.netexec("client", a, false, TEST_PORT).await?;
        cluster.netexec("server", b, false, HTTP_PORT).await?;
        let client = cluster.ready("client").await?;
        let server = cluster.ready("server").await?;
        wait_route(&cluster.hosts[0].host, setup.pod_cidrs[1], true).await?;
        let route = cluster.hosts[0]
            .host
            .ip(&["route", "show", setup.pod_cidrs[1]])?;
        ensure!(
            route.contains("via 10.244.89.64 dev trellis.1"),
            "through the other node's VTEP on the VXLAN device: {route}"
        );
        for (protocol, port) in [("http", HTTP_PORT), ("udp", UDP_PORT)] {
            let seen = cluster
                .dial(client, "clientip", protocol, server, port)
                .await?;
            let seen = seen[0]
                .rsplit_once(':')
                .map(|(ip, _)| ip.to_owned())
                .unwrap_or_default();
            ensure!(
                seen == client.to_string(),
                "over {protocol}, the server saw {seen}, not the client pod's {client}"
            );
        }
        // Node to pod, across the overlay.
        let name = cluster.hosts[0]
            .on_host(async move {
                http_get(server, HTTP_PORT, "/hostname", Duration::from_secs(10)).await
            })
            .await??;
        ensure!(name == "server", "{name}");

        let entries = |host: &Host| -> Result<String> {
            let fdb = std::process::Command::new("bridge")
                .args(["-n", &host.name, "fdb", "show", "dev", "trellis.1"])
                .output()?;
            Ok(format!(
                "{}{}",
                String::from_utf8_lossy(&fdb.stdout),
                host.ip(&["neigh", "show", "dev", "trellis.1"])?
            ))
        };
        let before = entries(&cluster.hosts[0].host)?;
        ensure!(
            before.contains("dst 10.244.88.3") && before.contains("10.244.89.64 lladdr"),
            "the fdb and neighbour entries of the other node: {before}"
        );
        let nodes: Api<Node> = Api::all(cluster.admin.clone());
        nodes.delete(b, &DeleteParams::default()).await?;
        wait_route(&cluster.hosts[0].host, setup.pod_cidrs[1], false).await?;
        // Its VXLAN entries go with it.
        let after = entries(&cluster.hosts[0].host)?;
        ensure!(
            !after.contains("10.244.88.3") && !after.contains("10.244.89.64"),
            "entries of a node gone are left: {after}"
        );
        Ok(())
    }
    .await;
    let stopped = cluster.stop(&names).await;
    if let Err(e) = &stopped {
        eprintln!("stop: {e:#}");
    }
    work?;
    stopped
}
