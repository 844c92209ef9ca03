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

use super::node::phase;

/// agnhost netexec's endpoints that the conformance checks use: `/hostname` (the pod's
/// name), `/clientip` (the caller's address as the server sees it) and `/dial` (asks
/// another server, over HTTP or UDP, `tries` times, each within `timeout` seconds, from
/// UDP source port `sport` if given, and returns its answers, its errors and how long
/// each failure took), on an HTTP port; on a UDP port, `hostname` and `clientip` as
/// datagrams. For the DNS checks, which run `dig` and `getent hosts` in a pod: `/dig`
/// (`name`, `type`, `tcp`, `server`) asks the pod's nameserver (or `server`) as `dig +search` does, with the
/// search list and `ndots` of the pod's resolv.conf (the first name of the list that
/// has answers), and `/getent` resolves a name as the C library does for `getent hosts`.
pub(super) const NETEXEC: &str = r#"
import json, os, random, socket, struct, sys, threading, time, urllib.parse, urllib.request
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
    timeout = float(q.get("timeout", ["3"])[0])
    sport = int(q.get("sport", ["0"])[0])
    responses, errors, failed_ms = [], [], []
    for _ in range(int(q.get("tries", ["1"])[0])):
        start = time.monotonic()
        try:
            if protocol == "http":
                with OPENER.open("http://%s:%d/%s" % (host, port, request), timeout=timeout) as r:
                    responses.append(r.read().decode())
            else:
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("", sport))
                s.settimeout(timeout)
                s.sendto((request + "\n").encode(), (host, port))
                responses.append(s.recvfrom(1024)[0].decode().strip())
                s.close()
        except Exception as e:
            errors.append(str(e))
            failed_ms.append(int((time.monotonic() - start) * 1000))
    return {"responses": responses, "errors": errors, "failed_ms": failed_ms}
TYPES = {"A": 1, "CNAME": 5, "PTR": 12, "AAAA": 28, "SRV": 33}
def resolv_conf():
    servers, search, ndots = [], [], 1
    for line in open("/etc/resolv.conf"):
        f = line.split()
        if f and f[0] == "nameserver":
            servers.append(f[1])
        elif f and f[0] == "search":
            search = f[1:]
        elif f and f[0] == "options":
            ndots = next((int(o[6:]) for o in f[1:] if o.startswith("ndots:")), ndots)
    return servers, search, ndots
def name_at(data, off):
    labels, end = [], None
    while data[off]:
        if data[off] & 0xC0 == 0xC0:
            end = off + 2 if end is None else end
            off = ((data[off] & 0x3F) << 8) | data[off + 1]
            continue
        labels.append(data[off + 1:off + 1 + data[off]].decode())
        off += 1 + data[off]
    return ".".join(labels) + ".", off + 1 if end is None else end
def query(server, name, qtype, tcp):
    message = struct.pack(">HHHHHH", random.randrange(65536), 0x0100, 1, 0, 0, 0)
    for label in name.rstrip(".").split("."):
        message += bytes([len(label)]) + label.encode()
    message += b"\0" + struct.pack(">HH", TYPES[qtype], 1)
    if tcp:
        with socket.create_connection((server, 53), timeout=3) as s:
            s.sendall(struct.pack(">H", len(message)) + message)
            data = b""
            while len(data) < 2 or len(data) < 2 + struct.unpack(">H", data[:2])[0]:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            data = data[2:]
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(3)
            s.sendto(message, (server, 53))
            data = s.recv(65536)
    flags, count, answers = struct.unpack(">H", data[2:4])[0], struct.unpack(">H", data[6:8])[0], []
    off = 12
    for _ in range(struct.unpack(">H", data[4:6])[0]):
        off = name_at(data, off)[1] + 4
    for _ in range(count):
        owner, off = name_at(data, off)
        rtype, _, ttl, length = struct.unpack(">HHIH", data[off:off + 10])
        off += 10
        rdata = data[off:off + length]
        if rtype == 1:
            value = socket.inet_ntop(socket.AF_INET, rdata)
        elif rtype == 28:
            value = socket.inet_ntop(socket.AF_INET6, rdata)
        elif rtype in (5, 12):
            value = name_at(data, off)[0]
        elif rtype == 33:
            value = "%d %d %d %s" % (struct.unpack(">HHH", rdata[:6]) + (name_at(data, off + 6)[0],))
        else:
            value = rdata.hex()
        answers.append({"name": owner, "type": rtype, "ttl": ttl, "value": value})
        off += length
    return {"name": name, "rcode": flags & 0xF, "answers": answers}
def dig(q):
    name, qtype, tcp = q["name"][0], q.get("type", ["A"])[0], q.get("tcp", ["0"])[0] == "1"
    servers, search, ndots = resolv_conf()
    servers = q.get("server", servers)
    names = [name]
    if not name.endswith("."):
        expanded = [name + "." + s for s in search]
        names = expanded + [name] if name.count(".") < ndots else [name] + expanded
    result = None
    for candidate in names:
        try:
            result = query(servers[0], candidate, qtype, tcp)
        except Exception as e:
            result = {"name": candidate, "error": str(e), "answers": []}
        if result["answers"]:
            break
    return dict(result, nameserver=servers[0])
def getent(q):
    try:
        family = socket.AF_INET if q.get("family", ["inet"])[0] == "inet" else socket.AF_UNSPEC
        return {"addresses": sorted({a[4][0] for a in socket.getaddrinfo(q["name"][0], None, family)})}
    except Exception as e:
        return {"addresses": [], "error": str(e)}
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        url = urllib.parse.urlparse(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path == "/dial":
            body = json.dumps(dial(query))
        elif url.path == "/dig":
            body = json.dumps(dig(query))
        elif url.path == "/getent":
            body = json.dumps(getent(query))
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
pub(super) const HTTP_PORT: u16 = 8083;
pub(super) const UDP_PORT: u16 = 8081;
pub(super) const TEST_PORT: u16 = 9080;
/// The `wasi:http` component's port.
const WEB_PORT: u16 = 8090;

/// What a test's agents run besides the pod network (the Service proxy and cluster
/// DNS for the tests of Services); the cluster's settings in `config` are set first.
pub(super) type Configure = fn(&mut AgentConfig);

/// One host's runtime and agent, on the host's own Tokio runtime. The agent can be
/// stopped and started again while the runtime (and so the pods) keeps running, as a
/// kubelet restarts on a node.
pub(super) struct Running {
    pub(super) host: Host,
    runtime: Option<tokio::runtime::Runtime>,
    /// Stops the CRI server.
    server_stop: Option<Stop>,
    server: Option<tokio::task::JoinHandle<Result<()>>>,
    agent_stop: Option<Stop>,
    agent: Option<tokio::task::JoinHandle<Result<()>>>,
    /// The agent's settings, kept for its restart.
    config: AgentConfig,
    in_process: trellis_client::InProcess,
    dir: tempfile::TempDir,
}

impl Running {
    /// Starts the runtime and an agent named as the host, with `backend`.
    async fn start(
        cluster: &TestCluster,
        host: Host,
        setup: &Setup,
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
        let (server_stop, stopped) = Shutdown::new();
        let ip = host.ip;
        let on_host = root.clone();
        let server = runtime
            .spawn(async move {
                let root = on_host;
                let cri_runtime = Runtime::with_cni(
                    trellis_tests::sandboxed(RuntimeConfig {
                        root: root.join("runtime"),
                        // Shared with the other tests: the components compile once.
                        cache_dir: Some(
                            Path::new(env!("CARGO_TARGET_TMPDIR")).join("runtime-cache"),
                        ),
                        process_handler: true,
                        node_ip: ip,
                        ..Default::default()
                    }),
                    trellis_runtime::CniConfig {
                        conf_dir: Some(conf_dir),
                        bin_dirs: Vec::new(),
                    },
                )?;
                let listener = trellis_runtime::listen(&root.join("cri.sock"))?;
                anyhow::Ok(tokio::spawn(async move {
                    trellis_runtime::serve_on(cri_runtime, listener, async move {
                        stopped.wait().await;
                    })
                    .await
                }))
            })
            .await??;
        let mut config = AgentConfig::new(&host.name, ip, root.join("agent"));
        config.pod_network = true;
        config.pod_network_backend = setup.backend;
        config.cluster_cidrs = vec![setup.cluster_cidr.to_owned()];
        config.relist_period = Duration::from_millis(50);
        config.port = 0;
        config.eviction_hard = None;
        (setup.configure)(&mut config);
        let mut running = Self {
            host,
            runtime: Some(runtime),
            server_stop: Some(server_stop),
            server: Some(server),
            agent_stop: None,
            agent: None,
            config,
            in_process: cluster.in_process(),
            dir,
        };
        running.start_agent().await?;
        Ok(running)
    }

    /// Starts the agent (again), on the runtime's socket.
    pub(super) async fn start_agent(&mut self) -> Result<()> {
        let (stop, stopped) = Shutdown::new();
        let client = self.in_process.client(identity::node(&self.host.name));
        let config = self.config.clone();
        let socket = self.dir.path().join("cri.sock");
        let agent = self
            .on_host(async move {
                let cri = trellis_runtime::connect(&socket).await?;
                anyhow::Ok(tokio::spawn(trellis_agent::run(
                    config,
                    client,
                    cri,
                    SharedInformers::new(),
                    stopped,
                )))
            })
            .await??;
        self.agent_stop = Some(stop);
        self.agent = Some(agent);
        Ok(())
    }

    /// Stops the agent and waits for it; the runtime and the pods keep running.
    pub(super) async fn stop_agent(&mut self) -> Result<()> {
        if let Some(stop) = self.agent_stop.take() {
            stop.stop();
        }
        if let Some(agent) = self.agent.take() {
            agent.await??;
        }
        Ok(())
    }

    /// Runs `f` on the host (in its network namespace).
    pub(super) async fn on_host<T: Send + 'static>(
        &self,
        f: impl Future<Output = T> + Send + 'static,
    ) -> Result<T> {
        Ok(self.spawn(f)?.await?)
    }

    /// Starts `f` on the host (in its network namespace).
    pub(super) fn spawn<T: Send + 'static>(
        &self,
        f: impl Future<Output = T> + Send + 'static,
    ) -> Result<tokio::task::JoinHandle<T>> {
        let runtime = self.runtime.as_ref().context("the host is stopped")?;
        Ok(runtime.spawn(f))
    }

    /// The log of `pod`'s container `container` (its first attempt), as the agent
    /// keeps it.
    pub(super) fn log(&self, pod: &Pod, container: &str) -> Result<String> {
        let path = self
            .dir
            .path()
            .join("agent/logs")
            .join(format!(
                "{}_{}_{}",
                pod.metadata.namespace.as_deref().unwrap_or("default"),
                pod.metadata.name.as_deref().unwrap_or_default(),
                pod.metadata.uid.as_deref().unwrap_or_default()
            ))
            .join(container)
            .join("0.log");
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))
    }

    /// Stops the agent and the runtime, and waits for them.
    async fn stop(&mut self) -> Result<()> {
        let agent = self.stop_agent().await;
        if let Some(stop) = self.server_stop.take() {
            stop.stop();
        }
        if let Some(server) = self.server.take() {
            server.await??;
        }
        agent
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        for stop in [self.agent_stop.take(), self.server_stop.take()]
            .into_iter()
            .flatten()
        {
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
pub(super) struct Cluster {
    pub(super) hosts: Vec<Running>,
    _lan: Lan,
    pub(super) admin: kube::Client,
    pub(super) pods: Arc<Informer<Pod>>,
    pub(super) watching: SharedInformers,
    script: tempfile::TempDir,
    // Last: the API server outlives the agents.
    pub(super) api: TestCluster,
}

/// What differs between the tests.
pub(super) struct Setup {
    pub(super) bridge: &'static str,
    /// The LAN's /24, as its first three octets.
    pub(super) lan: &'static str,
    /// The hosts' namespaces.
    pub(super) hosts: &'static [&'static str],
    /// The cluster CIDR and each host's podCIDR in it.
    pub(super) cluster_cidr: &'static str,
    pub(super) pod_cidrs: &'static [&'static str],
    pub(super) backend: Backend,
    pub(super) configure: Configure,
}

/// Whether this machine can run test hosts with the pod network; says why not.
pub(super) fn skip() -> bool {
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
    start_on(TestCluster::start().await?, setup).await
}

/// Starts the hosts of `setup` against `api`.
pub(super) async fn start_on(api: TestCluster, setup: &Setup) -> Result<Cluster> {
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
        hosts.push(Running::start(&api, host, setup, setup.pod_cidrs[i]).await?);
    }
    // The node IPAM controller's part (tested on its own), done by hand so that each
    // test keeps to its range.
    let nodes: Api<Node> = Api::all(admin.clone());
    for ((name, cidr), host) in setup.hosts.iter().zip(setup.pod_cidrs).zip(&mut hosts) {
        let registered = tokio::time::timeout(
            Duration::from_secs(30),
            kube::runtime::wait::await_condition(nodes.clone(), name, |n: Option<&Node>| {
                n.and_then(|n| n.status.as_ref()).is_some()
            }),
        )
        .await;
        if registered.is_err() {
            // An agent that ended says why.
            let ended = match host.agent.take_if(|a| a.is_finished()) {
                Some(agent) => format!("{:?}", agent.await),
                None => "running".into(),
            };
            anyhow::bail!("node {name} not registered within 30 s; its agent: {ended}");
        }
        registered??;
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
        watching,
        script,
        api,
    })
}

impl Cluster {
    /// A netexec pod in `default` on `node`: `port` for HTTP (and UDP_PORT for UDP),
    /// Ready once it answers.
    async fn netexec(&self, name: &str, node: &str, host_network: bool, port: u16) -> Result<()> {
        let mut pod = self.netexec_pod(name, node, port);
        pod["spec"]["hostNetwork"] = json!(host_network);
        self.create_in("default", pod).await
    }

    /// A netexec pod's manifest: on `node`, `port` for HTTP (and UDP_PORT for UDP),
    /// Ready once it answers; callers add labels, ports, a hostname.
    pub(super) fn netexec_pod(&self, name: &str, node: &str, port: u16) -> serde_json::Value {
        let dir = self.script.path().display().to_string();
        let script = self.script.path().join("netexec.py");
        json!({
            "metadata": {"name": name, "labels": {}},
            "spec": {"nodeName": node, "runtimeClassName": "process",
                "terminationGracePeriodSeconds": 1,
                "volumes": [{"name": "script", "hostPath": {"path": dir}}],
                "containers": [{"name": "netexec", "image": "file:///bin/sh",
                    "volumeMounts": [{"name": "script", "mountPath": dir, "readOnly": true}],
                    "command": ["/bin/sh", "-c",
                        format!("exec /usr/bin/python3 {} {port} {UDP_PORT}", script.display())],
                    "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                    "ports": [{"containerPort": port}],
                    "readinessProbe": {"httpGet": {"path": "/hostname", "port": port}, "periodSeconds": 1}}]}
        })
    }

    /// Creates `pod` in `default`.
    async fn create(&self, pod: serde_json::Value) -> Result<()> {
        self.create_in("default", pod).await
    }

    /// Creates `pod` in namespace `ns`.
    pub(super) async fn create_in(&self, ns: &str, pod: serde_json::Value) -> Result<()> {
        let pod: Pod = serde_json::from_value(pod)?;
        Api::<Pod>::namespaced(self.admin.clone(), ns)
            .create(&PostParams::default(), &pod)
            .await?;
        Ok(())
    }

    /// Waits until pod `name` in `default` is Ready; its IP.
    async fn ready(&self, name: &str) -> Result<IpAddr> {
        self.ready_in("default", name).await
    }

    /// Waits until pod `ns/name` is Ready; its IP.
    pub(super) async fn ready_in(&self, ns: &str, name: &str) -> Result<IpAddr> {
        let pod = self
            .wait_pod(ns, name, Duration::from_secs(60), |p| {
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

    /// Waits, woken by the pod informer, until pod `ns/name` is there and `done`.
    pub(super) async fn wait_pod(
        &self,
        ns: &str,
        name: &str,
        limit: Duration,
        done: impl Fn(&Pod) -> bool,
    ) -> Result<Arc<Pod>> {
        let mut changes = self.pods.subscribe();
        let key = format!("{ns}/{name}");
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(pod) = self.pods.get(&key)
                && done(&pod)
            {
                return Ok(pod);
            }
            match tokio::time::timeout_at(deadline, changes.recv()).await {
                Ok(Some(_)) => {}
                Ok(None) => anyhow::bail!("the pod informer ended"),
                Err(_) => anyhow::bail!(
                    "pod {key} did not get there in {limit:?}; it is {:?}",
                    self.pods.get(&key).map(|p| p.status.clone())
                ),
            }
        }
    }

    /// What netexec's `/dial` on the test container at `from` ([`TEST_PORT`], asked
    /// from the first host as the conformance checks ask from a host-network pod)
    /// answered for `query` (`request=…&protocol=…&host=…&port=…&tries=…`): its
    /// `responses` and `errors`.
    pub(super) async fn dial_raw(&self, from: IpAddr, query: &str) -> Result<serde_json::Value> {
        let path = format!("/dial?{query}");
        let body = self.hosts[0]
            .on_host(async move { http_get(from, TEST_PORT, &path, Duration::from_secs(30)).await })
            .await??;
        Ok(serde_json::from_str(&body)?)
    }

    /// What `/dial` on the test container at `from` got from `target` (at most five
    /// tries, as the checks' retries).
    pub(super) async fn dial(
        &self,
        from: IpAddr,
        request: &str,
        protocol: &str,
        target: impl std::fmt::Display,
        target_port: u16,
    ) -> Result<Vec<String>> {
        let query = format!(
            "request={request}&protocol={protocol}&host={target}&port={target_port}&tries=1"
        );
        let mut last = None;
        for _ in 0..5 {
            match self.dial_raw(from, &query).await.and_then(|json| {
                let responses: Vec<String> = serde_json::from_value(json["responses"].clone())?;
                ensure!(!responses.is_empty(), "{json}");
                Ok(responses)
            }) {
                Ok(responses) => return Ok(responses),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no try")))
            .with_context(|| format!("{request} over {protocol} from {from} to {target}"))
    }

    /// Deletes the pods in `default`, waits until the agents removed them, then stops
    /// the hosts.
    async fn stop(self, names: &[&str]) -> Result<()> {
        let names: Vec<String> = names.iter().map(|n| format!("default/{n}")).collect();
        self.stop_with(&names).await
    }

    /// Deletes the pods `namespace/name`, waits until the agents removed them, then
    /// stops the hosts.
    pub(super) async fn stop_with(mut self, keys: &[String]) -> Result<()> {
        let forced = DeleteParams::default().grace_period(0);
        for key in keys {
            if let Some((ns, name)) = key.split_once('/') {
                let api: Api<Pod> = Api::namespaced(self.admin.clone(), ns);
                let _ = api.delete(name, &forced).await;
            }
        }
        let gone = async {
            let mut changes = self.pods.subscribe();
            while keys.iter().any(|k| self.pods.get(k).is_some()) {
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
        hosts: &["mn80-a", "mn80-b"],
        cluster_cidr: "10.244.87.0/24",
        pod_cidrs: &["10.244.87.0/26", "10.244.87.64/26"],
        backend: Backend::Auto,
        configure: |_| {},
    };
    let cluster = start(&setup).await?;
    let [a, b] = [setup.hosts[0], setup.hosts[1]];
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
        let dialer = cluster
            .wait_pod("default", "dialer", Duration::from_secs(30), |p| {
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
        hosts: &["mn88-a", "mn88-b"],
        cluster_cidr: "10.244.89.0/24",
        pod_cidrs: &["10.244.89.0/26", "10.244.89.64/26"],
        backend: Backend::Vxlan,
        configure: |_| {},
    };
    let cluster = start(&setup).await?;
    let [a, b] = [setup.hosts[0], setup.hosts[1]];
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
