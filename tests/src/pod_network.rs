//! A node on a pod network of its own, for the tests whose pods get addresses: a CNI
//! conflist on the test's own range and bridge, the runtime serving CRI on a socket
//! with CNI, the agent with `pod_network` and short periods, and the Node's pod CIDR
//! set by hand (the node IPAM controller's part). Everything lives in a temporary
//! directory; the pods' namespace pins, the bridge (which CNI's DEL leaves) and the
//! in-process network's nftables table are removed however the test ends.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;
use trellis_agent::AgentConfig;
use trellis_api::{Shutdown, Stop, UserInfo};
use trellis_client::identity;
use trellis_client::informer::{Informer, SharedInformers};
use trellis_runtime::{Runtime, RuntimeConfig};

use crate::TestCluster;

/// Which CNI network the node's pods join.
#[derive(Clone, Copy, Debug)]
pub enum PodNetwork<'a> {
    /// The CNI plugins' `bridge` with `host-local` addresses, as network `name`.
    Bridge { name: &'a str, hairpin: bool },
    /// The runtime's default conflist, which it makes in-process.
    Default,
}

/// How to start a [`NetworkedNode`].
#[derive(Clone, Debug)]
pub struct NetworkedNodeOptions<'a> {
    pub node: &'a str,
    /// The Node's `spec.podCIDR`, and the network's only range.
    pub pod_cidr: &'a str,
    /// The network's bridge: a name no other test uses.
    pub bridge: &'a str,
    pub network: PodNetwork<'a>,
    /// The agent trusts the cluster's CA for client certificates (exec, port-forward).
    pub client_ca: bool,
    /// The agent's restart back-off, when the test waits on one.
    pub backoff_base: Option<Duration>,
}

/// A node (runtime and agent) whose pods have a network of their own.
pub struct NetworkedNode {
    // Dropped first: the pins go before the directory that holds them.
    _guard: NetworkGuard,
    dir: tempfile::TempDir,
    node: String,
    pod_cidr: String,
    client_ca_pem: Option<String>,
    backoff_base: Option<Duration>,
    client: kube::Client,
    /// A client with `system:masters`.
    pub admin: kube::Client,
    /// The runtime's CRI socket.
    pub socket: PathBuf,
    stop_runtime: Stop,
    server: tokio::task::JoinHandle<anyhow::Result<()>>,
    agent: Option<(Stop, tokio::task::JoinHandle<anyhow::Result<()>>)>,
}

impl std::fmt::Debug for NetworkedNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetworkedNode")
            .field("node", &self.node)
            .field("root", &self.dir.path())
            .finish_non_exhaustive()
    }
}

/// What a failing test could leave, removed on drop: its sandboxes' pins (unmounted,
/// which ends their namespaces and veths), the bridge (CNI's DEL leaves it) and the
/// in-process default network's table, which is named after its bridge.
struct NetworkGuard {
    runtime_root: PathBuf,
    bridge: String,
    table: bool,
    /// The agent's masquerade table (`table inet trellis`) was not there before this
    /// node: it goes with it. Tests running beside it may make it again.
    masquerade: bool,
}

impl Drop for NetworkGuard {
    fn drop(&mut self) {
        for kind in ["netns", "utsns", "ipcns"] {
            for entry in std::fs::read_dir(self.runtime_root.join(kind))
                .into_iter()
                .flatten()
                .flatten()
            {
                let pin = entry.path();
                let _ = rustix::mount::unmount(&pin, rustix::mount::UnmountFlags::DETACH);
                let _ = std::fs::remove_file(&pin);
            }
        }
        let _ = std::process::Command::new("ip")
            .args(["link", "delete", &self.bridge])
            .stderr(Stdio::null())
            .status();
        if self.table {
            let _ = std::process::Command::new("nft")
                .args(["delete", "table", "ip", &self.bridge])
                .stderr(Stdio::null())
                .status();
        }
        if self.masquerade {
            let _ = std::process::Command::new("nft")
                .args(["delete", "table", "inet", trellis_agent::routes::NFT_TABLE])
                .stderr(Stdio::null())
                .status();
        }
    }
}

impl NetworkedNode {
    /// Starts the runtime and the agent; the Node has no pod CIDR until
    /// [`NetworkedNode::set_pod_cidr`].
    pub async fn start(
        cluster: &TestCluster,
        options: NetworkedNodeOptions<'_>,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let root = dir.path();
        let guard = NetworkGuard {
            runtime_root: root.join("runtime"),
            bridge: options.bridge.to_owned(),
            table: matches!(options.network, PodNetwork::Default),
            masquerade: !std::process::Command::new("nft")
                .args(["list", "table", "inet", trellis_agent::routes::NFT_TABLE])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success()),
        };
        let conf_dir = root.join("cni/net.d");
        std::fs::create_dir_all(&conf_dir)?;
        let ipam_dir = root.join("cni/networks");
        let (file, conflist) = match options.network {
            PodNetwork::Bridge { name, hairpin } => (
                format!("10-{name}.conflist"),
                json!({
                    "cniVersion": "1.0.0",
                    "name": name,
                    "plugins": [{
                        "type": "bridge",
                        "bridge": options.bridge,
                        "isGateway": true,
                        "hairpinMode": hairpin,
                        "ipam": {
                            "type": "host-local",
                            "ranges": [[{"subnet": options.pod_cidr}]],
                            "dataDir": ipam_dir,
                        }
                    }]
                }),
            ),
            PodNetwork::Default => (
                "10-default.conflist".to_owned(),
                trellis_runtime::default_conflist(
                    &[options.pod_cidr.to_owned()],
                    options.bridge,
                    &ipam_dir,
                ),
            ),
        };
        std::fs::write(conf_dir.join(file), serde_json::to_vec_pretty(&conflist)?)?;

        let (stop_runtime, runtime_stopped) = Shutdown::new();
        let runtime = Runtime::with_cni(
            crate::sandboxed(RuntimeConfig {
                root: root.join("runtime"),
                cache_dir: Some(root.join("compiled")),
                process_handler: true,
                node_ip: "127.0.0.1".parse()?,
                ..Default::default()
            }),
            trellis_runtime::CniConfig {
                conf_dir: Some(conf_dir),
                bin_dirs: Vec::new(),
            },
        )?;
        let socket = root.join("cri.sock");
        let listener = trellis_runtime::listen(&socket)?;
        let server = tokio::spawn(async move {
            trellis_runtime::serve_on(runtime, listener, async move {
                runtime_stopped.wait().await;
            })
            .await
        });
        let in_process = cluster.in_process();
        let mut node = Self {
            node: options.node.to_owned(),
            pod_cidr: options.pod_cidr.to_owned(),
            client_ca_pem: options.client_ca.then(|| cluster.ca_pem.clone()),
            backoff_base: options.backoff_base,
            client: in_process.client(identity::node(options.node)),
            admin: in_process.client(UserInfo::new("admin", ["system:masters"])),
            socket,
            stop_runtime,
            server,
            agent: None,
            dir,
            _guard: guard,
        };
        node.start_agent().await?;
        Ok(node)
    }

    /// The temporary directory: the runtime's root is `runtime/` in it, the agent's
    /// `agent/`.
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// A new CRI client to the runtime.
    pub async fn cri(&self) -> anyhow::Result<trellis_runtime::Client> {
        trellis_runtime::connect(&self.socket).await
    }

    /// Starts the agent (again, after [`NetworkedNode::stop_agent`]).
    pub async fn start_agent(&mut self) -> anyhow::Result<()> {
        anyhow::ensure!(self.agent.is_none(), "the agent runs already");
        let (stop, stopped) = Shutdown::new();
        let cri = self.cri().await?;
        let mut config =
            AgentConfig::new(&self.node, "127.0.0.1".parse()?, self.root().join("agent"));
        config.pod_network = true;
        config.relist_period = Duration::from_millis(50);
        if let Some(backoff) = self.backoff_base {
            config.backoff_base = backoff;
        }
        config.port = 0;
        config.eviction_hard = None;
        config.client_ca_pem = self.client_ca_pem.clone();
        let task = tokio::spawn(trellis_agent::run(
            config,
            self.client.clone(),
            cri,
            SharedInformers::new(),
            stopped,
        ));
        self.agent = Some((stop, task));
        Ok(())
    }

    /// Stops the agent and waits for it; the runtime and its pods stay.
    pub async fn stop_agent(&mut self) -> anyhow::Result<()> {
        if let Some((stop, task)) = self.agent.take() {
            stop.stop();
            task.await??;
        }
        Ok(())
    }

    /// Waits (on a watch) for the agent to register the Node, then sets its pod CIDR.
    pub async fn set_pod_cidr(&self) -> anyhow::Result<()> {
        let nodes: Api<Node> = Api::all(self.admin.clone());
        tokio::time::timeout(
            Duration::from_secs(30),
            kube::runtime::wait::await_condition(nodes.clone(), &self.node, |n: Option<&Node>| {
                n.is_some()
            }),
        )
        .await
        .context("the node never registered")??;
        let cidr = &self.pod_cidr;
        nodes
            .patch(
                &self.node,
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"podCIDR": cidr, "podCIDRs": [cidr]}})),
            )
            .await?;
        Ok(())
    }

    /// Stops the agent, then the runtime; removes the directory and the bridge.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        let agent = self.stop_agent().await;
        self.stop_runtime.stop();
        self.server.await??;
        agent
    }
}

/// Deletes the pods at once (grace period 0), whatever the test did before, so that no
/// namespace outlives it; then waits up to `limit` for `pods` to see them gone.
pub async fn delete_pods(
    api: &Api<Pod>,
    pods: &Informer<Pod>,
    names: &[&str],
    limit: Duration,
) -> Result<anyhow::Result<()>, tokio::time::error::Elapsed> {
    let forced = DeleteParams::default().grace_period(0);
    for name in names {
        let _ = api.delete(name, &forced).await;
    }
    let namespace = api.namespace().unwrap_or("default");
    let gone = async {
        let mut changes = pods.subscribe();
        while names
            .iter()
            .any(|n| pods.get(&format!("{namespace}/{n}")).is_some())
        {
            changes.recv().await.context("pod informer ended")?;
        }
        Ok(())
    };
    tokio::time::timeout(limit, gone).await
}
