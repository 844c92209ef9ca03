//! A real node's Services and cluster DNS: a test host (a network namespace of its own,
//! `trellis_tests::hosts`) runs Trellis' runtime and node agent with the pod network,
//! the service proxy and node-local DNS, against an API server in the test process.
//! The agent makes the dummy link `trellis-dns` with `169.254.20.10` and the `kube-dns`
//! ClusterIP; a `process` pod's `resolv.conf` names the node-local address with the
//! cluster's search list; Python's resolver in the pod finds a Service by its full and
//! its short name, and reaches the pod behind it through the ClusterIP; a pod that
//! names the `kube-dns` ClusterIP as its nameserver is answered by the node's server; a
//! WASM program resolves the Service too; the server's metrics count the queries
//! (`/metrics/dns` through the API server's node proxy). A restart of the agent keeps
//! the link and the proxy's table (the ClusterIP answers while the agent is down) and
//! serves again; an agent started with node-local DNS off removes the link. A UDP
//! Service's client on the node is answered by the new endpoint once the old one is
//! replaced, though its source port (hence its conntrack entry) stays.
//!
//! The Service has no selector: its EndpointSlice is written by the test, so that the
//! node's part is tested alone. Needs root, `ip`, `nft`, python3 and the CNI plugins;
//! skipped otherwise.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_agent::AgentConfig;
use trellis_agent::services::{KUBE_DNS_IP, LINK, NODE_LOCAL_DNS_IP};
use trellis_api::{Shutdown, Stop, UserInfo};
use trellis_client::identity;
use trellis_client::informer::{Informer, SharedInformers};
use trellis_runtime::{Runtime, RuntimeConfig};
use trellis_tests::TestCluster;
use trellis_tests::hosts::{Host, Lan, http_get, unpin_all};

use super::node::{phase, wait_pod};

const BRIDGE: &str = "trellis-ns110";
const LAN: &str = "10.244.110";
const HOST: &str = "ns110-a";
const POD_CIDR: &str = "10.244.111.0/24";
/// The Service's ClusterIP, in the default service range.
const WEB_IP: &str = "10.43.110.20";
const WEB_PORT: u16 = 8080;
/// The UDP Service's ClusterIP, and its endpoints' port.
const UDP_IP: &str = "10.43.110.21";
const UDP_PORT: u16 = 9053;

/// A UDP server answering every datagram with its pod's name.
const UDP: &str = r#"
import os, socket
NAME = os.environ["POD_NAME"].encode()
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("", 9053))
while True:
    data, peer = s.recvfrom(512)
    s.sendto(NAME, peer)
"#;

/// A server answering every GET with its pod's name.
const WEB: &str = r#"
import http.server, os
NAME = os.environ["POD_NAME"].encode()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(NAME)))
        self.end_headers()
        self.wfile.write(NAME)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("", 8080), Handler).serve_forever()
"#;

/// What a client pod reports: its resolv.conf, lookups, and a GET of `http://web/`.
const CLIENT: &str = r#"
import socket, urllib.request
print("resolv " + open("/etc/resolv.conf").read().strip().replace("\n", "|"))
for name in ["web.default.svc.cluster.local", "web", "kubernetes.default.svc.cluster.local"]:
    try:
        print("lookup %s %s" % (name, socket.gethostbyname(name)))
    except Exception as e:
        print("lookup %s error %s" % (name, e))
try:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    print("get " + opener.open("http://web/", timeout=5).read().decode())
except Exception as e:
    print("get error %s" % e)
"#;

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
        eprintln!("skipped: a node's Services and DNS need {missing} (root, make deps)");
    }
    missing.is_some()
}

/// The host's runtime and agent, each with its own stop: the agent restarts alone.
struct Running {
    host: Host,
    runtime: Option<tokio::runtime::Runtime>,
    cri_stop: Option<Stop>,
    server: Option<tokio::task::JoinHandle<Result<()>>>,
    agent_stop: Option<Stop>,
    agent: Option<tokio::task::JoinHandle<Result<()>>>,
    config: AgentConfig,
    client: kube::Client,
    dir: tempfile::TempDir,
}

impl Running {
    async fn start(api: &TestCluster, host: Host) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let root = dir.path().to_path_buf();
        let conf_dir = root.join("cni/net.d");
        std::fs::create_dir_all(&conf_dir)?;
        std::fs::write(
            conf_dir.join("10-ns110.conflist"),
            serde_json::to_vec_pretty(&json!({
                "cniVersion": "1.0.0",
                "name": "ns110",
                "plugins": [{
                    "type": "bridge",
                    "bridge": "ns110br",
                    "isGateway": true,
                    "ipMasq": false,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_CIDR}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": root.join("cni/networks"),
                    }
                }]
            }))?,
        )?;
        // The node's resolvers: the LAN's bridge, on this machine (nothing answers
        // there; no query leaves the machine).
        let resolv = root.join("node-resolv.conf");
        std::fs::write(
            &resolv,
            format!("nameserver {LAN}.1\nsearch node.example\n"),
        )?;
        let mut config = AgentConfig::new(HOST, host.ip, root.join("agent"));
        config.pod_network = true;
        config.cluster_cidrs = vec![POD_CIDR.into()];
        config.relist_period = Duration::from_millis(50);
        config.port = 0;
        config.eviction_hard = None;
        config.resolv_conf = Some(resolv);
        // The agent's server, for the DNS server's metrics through the API server.
        config.client_ca_pem = Some(api.ca_pem.clone());
        config.service_proxy = true;
        config.proxy_min_sync_interval = Duration::ZERO;
        config.node_local_dns = vec![NODE_LOCAL_DNS_IP, KUBE_DNS_IP];
        let client = api.in_process().client(identity::node(HOST));
        let runtime = host.runtime()?;
        let (cri_stop, cri_stopped) = Shutdown::new();
        let ip = host.ip;
        let on_host = root.clone();
        let server = runtime
            .spawn(async move {
                let root = on_host;
                let cri_runtime = Runtime::with_cni(
                    trellis_tests::sandboxed(RuntimeConfig {
                        root: root.join("runtime"),
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
                        cri_stopped.wait().await;
                    })
                    .await
                }))
            })
            .await??;
        let mut running = Self {
            host,
            runtime: Some(runtime),
            cri_stop: Some(cri_stop),
            server: Some(server),
            agent_stop: None,
            agent: None,
            config,
            client,
            dir,
        };
        running.start_agent()?;
        Ok(running)
    }

    fn start_agent(&mut self) -> Result<()> {
        let (stop, stopped) = Shutdown::new();
        let socket = self.dir.path().join("cri.sock");
        let (config, client) = (self.config.clone(), self.client.clone());
        let runtime = self.runtime.as_ref().context("the host is stopped")?;
        self.agent = Some(runtime.spawn(async move {
            let cri = trellis_runtime::connect(&socket).await?;
            trellis_agent::run(config, client, cri, SharedInformers::new(), stopped).await
        }));
        self.agent_stop = Some(stop);
        Ok(())
    }

    async fn stop_agent(&mut self) -> Result<()> {
        if let Some(stop) = self.agent_stop.take() {
            stop.stop();
        }
        if let Some(agent) = self.agent.take() {
            agent.await??;
        }
        Ok(())
    }

    async fn on_host<T: Send + 'static>(
        &self,
        f: impl Future<Output = T> + Send + 'static,
    ) -> Result<T> {
        let runtime = self.runtime.as_ref().context("the host is stopped")?;
        Ok(runtime.spawn(f).await?)
    }

    /// The lines `pod`'s container `container` wrote (its first attempt).
    fn log(&self, pod: &Pod, container: &str) -> Result<Vec<String>> {
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
        let log =
            std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        // CRI log lines: time, stream, tag, then the line.
        Ok(log
            .lines()
            .filter_map(|l| l.splitn(4, ' ').nth(3))
            .map(str::to_owned)
            .collect())
    }

    async fn stop(&mut self) -> Result<()> {
        self.stop_agent().await?;
        if let Some(stop) = self.cri_stop.take() {
            stop.stop();
        }
        if let Some(server) = self.server.take() {
            server.await??;
        }
        Ok(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        for stop in [self.agent_stop.take(), self.cri_stop.take()]
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

/// The test's parts, dropped in this order: the host, its LAN, then the API server.
struct Cluster {
    node: Running,
    _lan: Lan,
    admin: kube::Client,
    pods: Arc<Informer<Pod>>,
    _watching: SharedInformers,
    script: tempfile::TempDir,
    api: TestCluster,
}

impl Cluster {
    async fn start() -> Result<Self> {
        let api = TestCluster::start().await?;
        let mut lan = Lan::new(BRIDGE, LAN)?;
        let admin = api
            .in_process()
            .client(UserInfo::new("admin", ["system:masters"]));
        let watching = SharedInformers::new();
        let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
        let script = tempfile::tempdir()?;
        std::fs::write(script.path().join("web.py"), WEB)?;
        std::fs::write(script.path().join("client.py"), CLIENT)?;
        std::fs::write(script.path().join("udp.py"), UDP)?;
        // Readable by the pods' user (nobody), which gets it as a read-only volume.
        std::fs::set_permissions(
            script.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )?;
        let host = lan.host(HOST, 2)?;
        let mut node = Running::start(&api, host).await?;
        let nodes: Api<Node> = Api::all(admin.clone());
        let registered =
            kube::runtime::wait::await_condition(nodes.clone(), HOST, |n: Option<&Node>| {
                n.and_then(|n| n.status.as_ref()).is_some()
            });
        let agent = node.agent.as_mut().context("no agent")?;
        let first = async {
            tokio::select! {
                done = registered => done.map(drop).map_err(anyhow::Error::from),
                ended = agent => Err(anyhow::anyhow!("the agent ended before its Node was written: {:?}", ended?)),
            }
        };
        tokio::time::timeout(Duration::from_secs(30), first)
            .await
            .context("the node did not register within 30 s")??;
        nodes
            .patch(
                HOST,
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"podCIDR": POD_CIDR, "podCIDRs": [POD_CIDR]}})),
            )
            .await?;
        Ok(Self {
            node,
            _lan: lan,
            admin,
            pods,
            _watching: watching,
            script,
            api,
        })
    }

    /// A python3 `process` pod running `script` (in the scripts' volume), with `spec`'s
    /// fields added to its spec and `container`'s to its container's.
    async fn python(
        &self,
        name: &str,
        script: &str,
        spec: serde_json::Value,
        container: serde_json::Value,
    ) -> Result<()> {
        let dir = self.script.path().display().to_string();
        let mut pod = json!({
            "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"nodeName": HOST, "runtimeClassName": "process",
                "terminationGracePeriodSeconds": 1,
                "volumes": [{"name": "script", "hostPath": {"path": dir}}],
                "containers": [{"name": "main", "image": "file:///bin/sh",
                    "volumeMounts": [{"name": "script", "mountPath": dir, "readOnly": true}],
                    "command": ["/bin/sh", "-c", format!("exec /usr/bin/python3 -u {dir}/{script}")],
                    "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]}]}
        });
        for (key, value) in spec.as_object().into_iter().flatten() {
            pod["spec"][key] = value.clone();
        }
        for (key, value) in container.as_object().into_iter().flatten() {
            pod["spec"]["containers"][0][key] = value.clone();
        }
        self.create(pod).await
    }

    async fn create(&self, pod: serde_json::Value) -> Result<()> {
        Api::<Pod>::namespaced(self.admin.clone(), "default")
            .create(&PostParams::default(), &serde_json::from_value(pod)?)
            .await?;
        Ok(())
    }

    /// The log lines of pod `name` once it ended.
    async fn finished(&self, name: &str, container: &str) -> Result<Vec<String>> {
        let pod = wait_pod(&self.pods, name, Duration::from_secs(30), |p| {
            matches!(phase(p), "Succeeded" | "Failed")
        })
        .await?;
        self.node.log(&pod, container)
    }

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
        let netns = self.node.dir.path().join("runtime/netns");
        let pins = || {
            std::fs::read_dir(&netns)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        };
        let _ = trellis_tests::wait_removed(&netns, pins, Duration::from_secs(15)).await;
        self.node.stop().await?;
        gone.context("the pods were not removed")??;
        self.api.stop().await
    }
}

/// The value of the line of `lines` that starts with `prefix`.
fn line<'a>(lines: &'a [String], prefix: &str) -> Result<&'a str> {
    lines
        .iter()
        .find_map(|l| l.strip_prefix(prefix))
        .with_context(|| format!("no line {prefix:?} in {lines:?}"))
}

/// The IP of pod `name` once it runs.
async fn running_ip(cluster: &Cluster, name: &str) -> Result<IpAddr> {
    let pod = wait_pod(&cluster.pods, name, Duration::from_secs(30), |p| {
        phase(p) == "Running"
    })
    .await?;
    let ip = pod.status.as_ref().and_then(|s| s.pod_ip.as_deref());
    Ok(ip.context("no podIP")?.parse()?)
}

/// Asks `to` from `client` until the answer is `want` (at most 10 s); the last answer
/// otherwise.
async fn udp_answer(
    client: &std::net::UdpSocket,
    to: std::net::SocketAddr,
    want: &str,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut last = String::from("nothing");
    while tokio::time::Instant::now() < deadline {
        let got = tokio::task::block_in_place(|| {
            client.send_to(b"name", to)?;
            let mut buffer = [0u8; 64];
            client
                .recv(&mut buffer)
                .map(|n| String::from_utf8_lossy(&buffer[..n]).into_owned())
        });
        match got {
            Ok(got) if got == want => return Ok(()),
            Ok(got) => last = got,
            // The 100 ms read timeout: asked again.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => last = e.to_string(),
        }
    }
    anyhow::bail!("{to} answered {last}, not {want}, for 10 s")
}

/// Whether the link holds both DNS addresses, and the proxy's table is there.
fn node_state(host: &Host) -> Result<(String, bool)> {
    let link = host.ip(&["-o", "addr", "show", "dev", LINK])?;
    let table = std::process::Command::new("ip")
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
        .output()?
        .status
        .success();
    Ok((link, table))
}

/// A node serves Services and cluster DNS to its pods, and an agent restart keeps both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_serves_cluster_dns_and_cluster_ips_to_its_pods() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let mut cluster = Cluster::start().await?;
    let names = [
        "web",
        "client",
        "client-kube-dns",
        "wasm-lookup",
        "client-after",
        "udp-a",
        "udp-b",
    ];
    let work = async {
        let services: Api<Service> = Api::namespaced(cluster.admin.clone(), "default");
        services
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "web"},
                    "spec": {"clusterIP": WEB_IP, "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": WEB_PORT}]}
                }))?,
            )
            .await?;
        cluster
            .python(
                "web",
                "web.py",
                json!({}),
                json!({"ports": [{"containerPort": WEB_PORT}],
                    "readinessProbe": {"httpGet": {"path": "/", "port": WEB_PORT}, "periodSeconds": 1}}),
            )
            .await?;
        let web = wait_pod(&cluster.pods, "web", Duration::from_secs(30), |p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                .is_some_and(|c| c.status == "True")
        })
        .await?;
        let web_ip: IpAddr = web
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.as_deref())
            .context("web's podIP")?
            .parse()?;
        let slices: Api<EndpointSlice> = Api::namespaced(cluster.admin.clone(), "default");
        slices
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "web-test", "labels": {"kubernetes.io/service-name": "web"}},
                    "addressType": "IPv4",
                    "endpoints": [{"addresses": [web_ip.to_string()], "nodeName": HOST,
                        "conditions": {"ready": true, "serving": true, "terminating": false},
                        "targetRef": {"kind": "Pod", "namespace": "default", "name": "web"}}],
                    "ports": [{"name": "http", "port": WEB_PORT, "protocol": "TCP"}]
                }))?,
            )
            .await?;

        // The link, with both addresses.
        let (link, _) = node_state(&cluster.node.host)?;
        for ip in [NODE_LOCAL_DNS_IP, KUBE_DNS_IP] {
            ensure!(link.contains(&format!("inet {ip}/32")), "{LINK}: {link}");
        }
        // A node reaches Service IPs through its default route, which the proxy's
        // DNAT then bends; this host has none (nothing may leave the machine), so a
        // route to the service range over the DNS link, which carries nothing, stands
        // in for it.
        cluster
            .node
            .host
            .ip(&["route", "replace", "10.43.0.0/16", "dev", LINK])?;

        // A ClusterFirst pod: the node-local server, the cluster's searches, ndots:5.
        cluster
            .python("client", "client.py", json!({"restartPolicy": "Never"}), json!({}))
            .await?;
        // One naming the kube-dns ClusterIP instead: the proxy leaves it to the node.
        cluster
            .python(
                "client-kube-dns",
                "client.py",
                json!({"restartPolicy": "Never", "dnsPolicy": "None",
                    "dnsConfig": {"nameservers": [KUBE_DNS_IP.to_string()], "searches": ["default.svc.cluster.local"]}}),
                json!({}),
            )
            .await?;
        // A WASM program's lookups (wasi:sockets/ip-name-lookup) follow its resolv.conf.
        let dial = trellis_tests::plugin_wasm("dial")?;
        cluster
            .create(json!({
                "metadata": {"name": "wasm-lookup"},
                "spec": {"nodeName": HOST, "restartPolicy": "Never",
                    "containers": [{"name": "dial", "image": format!("file://{}", dial.display()),
                        "env": [{"name": "LOOKUP", "value": "web.default.svc.cluster.local,web"}]}]}
            }))
            .await?;

        let client = cluster.finished("client", "main").await?;
        let resolv: Vec<&str> = line(&client, "resolv ")?.split('|').collect();
        for want in [
            "nameserver 169.254.20.10",
            "search default.svc.cluster.local svc.cluster.local cluster.local node.example",
            "options ndots:5",
        ] {
            ensure!(resolv.contains(&want), "the pod's resolv.conf lacks {want:?}: {resolv:?}");
        }
        ensure!(
            resolv.iter().filter(|l| l.starts_with("nameserver")).count() == 1,
            "the node-local server alone: {resolv:?}"
        );
        for name in ["web.default.svc.cluster.local", "web"] {
            let got = line(&client, &format!("lookup {name} "))?;
            ensure!(got == WEB_IP, "{name} resolved to {got} in a ClusterFirst pod");
        }
        // The API server's own Service, when it keeps one.
        let kubernetes = services.get_opt("kubernetes").await?;
        if let Some(ip) = kubernetes
            .as_ref()
            .and_then(|s| s.spec.as_ref())
            .and_then(|s| s.cluster_ip.clone())
        {
            let got = line(&client, "lookup kubernetes.default.svc.cluster.local ")?;
            ensure!(got == ip, "kubernetes.default resolved to {got}, not {ip}");
        }
        let got = line(&client, "get ")?;
        ensure!(got == "web", "http://web/ through the ClusterIP answered {got:?}");

        let kube_dns = cluster.finished("client-kube-dns", "main").await?;
        let got = line(&kube_dns, "lookup web ")?;
        ensure!(got == WEB_IP, "web resolved to {got} through {KUBE_DNS_IP}");

        let wasm = cluster.finished("wasm-lookup", "dial").await?;
        for name in ["web.default.svc.cluster.local", "web"] {
            let got = line(&wasm, &format!("lookup {name}: "))?;
            ensure!(
                got.split(' ').any(|ip| ip == WEB_IP),
                "the WASM program resolved {name} to {got}"
            );
        }

        // A UDP Service whose endpoint goes: the node's client, keeping its source
        // port, is answered by the new endpoint, not held to the gone one by its
        // conntrack entry (the proxy flushes it).
        for name in ["udp-a", "udp-b"] {
            cluster.python(name, "udp.py", json!({}), json!({})).await?;
        }
        let [udp_a, udp_b] = [running_ip(&cluster, "udp-a").await?, running_ip(&cluster, "udp-b").await?];
        services
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "udp"},
                    "spec": {"clusterIP": UDP_IP, "ports": [{"name": "echo", "port": 53, "protocol": "UDP", "targetPort": UDP_PORT}]}
                }))?,
            )
            .await?;
        let slice = |ip: IpAddr, pod: &str| {
            json!({
                "metadata": {"name": "udp-test", "labels": {"kubernetes.io/service-name": "udp"}},
                "addressType": "IPv4",
                "endpoints": [{"addresses": [ip.to_string()], "nodeName": HOST,
                    "conditions": {"ready": true, "serving": true, "terminating": false},
                    "targetRef": {"kind": "Pod", "namespace": "default", "name": pod}}],
                "ports": [{"name": "echo", "port": UDP_PORT, "protocol": "UDP"}]
            })
        };
        slices
            .create(&PostParams::default(), &serde_json::from_value(slice(udp_a, "udp-a"))?)
            .await?;
        // From the node's address (the route to the service range would pick the
        // link's).
        let node_ip = cluster.node.host.ip;
        let client = cluster
            .node
            .on_host(async move { std::net::UdpSocket::bind((node_ip, 0)) })
            .await??;
        client.set_read_timeout(Some(Duration::from_millis(100)))?;
        let service = std::net::SocketAddr::new(UDP_IP.parse()?, 53);
        udp_answer(&client, std::net::SocketAddr::new(udp_a, UDP_PORT), "udp-a")
            .await
            .context("straight to the pod")?;
        // Asked at once: datagrams sent before the proxy has the Service make a
        // conntrack entry without translation, which the proxy flushes when the
        // Service gets its first endpoint (else the client's retries would keep it).
        udp_answer(&client, service, "udp-a").await?;
        slices
            .patch(
                "udp-test",
                &PatchParams::default(),
                &Patch::Merge(&slice(udp_b, "udp-b")),
            )
            .await?;
        udp_answer(&client, service, "udp-b")
            .await
            .context("after its endpoint changed, from the same client port")?;

        // The server counted the cluster's queries: its metrics through the API
        // server's node proxy.
        let metrics = cluster
            .api
            .kubectl_ok(&["get", "--raw", &format!("/api/v1/nodes/{HOST}/proxy/metrics/dns")])
            .await?;
        ensure!(
            metrics.lines().any(|l| l.starts_with("coredns_dns_requests_total{")
                && l.contains(r#"zone="cluster""#)
                && l.contains(r#"type="A""#)
                && !l.ends_with(" 0")),
            "no cluster A query counted: {metrics}"
        );

        // The agent stops: the link and the table stay, and the ClusterIP still
        // reaches the pod from the node.
        cluster.node.stop_agent().await?;
        let (link_down, table) = node_state(&cluster.node.host)?;
        ensure!(table, "the proxy's table went with the agent");
        ensure!(link_down == link, "the link changed with the agent's stop: {link_down}");
        let web_ip: IpAddr = WEB_IP.parse()?;
        let got = cluster
            .node
            .on_host(async move { http_get(web_ip, 80, "/", Duration::from_secs(5)).await })
            .await??;
        ensure!(got == "web", "{WEB_IP} while the agent is down answered {got:?}");
        // Started again: the same link, and pods resolve and reach the Service again.
        cluster.node.start_agent()?;
        cluster
            .python("client-after", "client.py", json!({"restartPolicy": "Never"}), json!({}))
            .await?;
        let after = cluster.finished("client-after", "main").await?;
        ensure!(
            line(&after, "lookup web ")? == WEB_IP && line(&after, "get ")? == "web",
            "after the agent's restart: {after:?}"
        );
        let (link_after, table) = node_state(&cluster.node.host)?;
        ensure!(table && link_after == link, "after the restart: {link_after}");

        // Started with node-local DNS off (a cluster that brings its own): the link
        // goes, so that the kube-dns ClusterIP is no longer taken by this node.
        cluster.node.stop_agent().await?;
        cluster.node.config.node_local_dns.clear();
        cluster.node.config.remove_node_local_dns_link = true;
        // The kernel's link events, watched before the agent starts.
        let mut monitor = tokio::process::Command::new("ip")
            .args(["netns", "exec", &cluster.node.host.name, "ip", "monitor", "link"])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let mut events = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
            monitor.stdout.take().context("no stdout")?,
        ));
        cluster.node.start_agent()?;
        let gone = async {
            while cluster.node.host.ip(&["link", "show", LINK]).is_ok() {
                match events.next_line().await? {
                    Some(_) => {}
                    None => anyhow::bail!("ip monitor ended"),
                }
            }
            Ok(())
        };
        tokio::time::timeout(Duration::from_secs(10), gone)
            .await
            .with_context(|| format!("{LINK} is still there 10 s after an agent without node-local DNS started"))??;
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
