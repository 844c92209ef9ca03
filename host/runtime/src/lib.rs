//! Trellis' container runtime: Kubernetes' CRI v1 (`runtime.v1` RuntimeService and
//! ImageService) over gRPC on a Unix socket, with two runtime handlers:
//! [`WASMTIME`] runs WebAssembly components, those exporting `wasi:cli/run` as programs
//! and those exporting `wasi:http/incoming-handler` as HTTP servers on the container's
//! port, and [`PROCESS`] (when enabled) runs native executables as plain host processes.
//!
//! Start with [`Runtime::new`] and [`serve`]; a node agent talks to this runtime, or
//! to any other CRI runtime such as containerd, through [`connect`].
//!
//! Sandboxes are on the node's network (the pod IP is the node's) until the node has
//! a pod CIDR (`UpdateRuntimeConfig`); then a sandbox that asks for the pod's network
//! gets a network namespace of its own connected by CNI ([`CniConfig`]). Images are
//! files pulled from `file://` URLs, or WebAssembly artifacts pulled from OCI
//! registries (`127.0.0.1:5000/hello:v1`, with the credentials the pull request carries).
//! A `wasi:http` container listens on the node's IP at the first TCP port of its
//! annotation `io.kubernetes.container.ports` (a JSON list of `v1.ContainerPort`, as the
//! kubelet writes it). Everything the runtime knows is kept as JSON under
//! [`RuntimeConfig::root`], so a restarted runtime adopts the processes and pod networks
//! still there, reports what it could not keep, and tears down what no record names.
//!
//! # Layout
//! One CRI service over the runtime's records, whatever runs the containers: as in
//! containerd, a sandbox names a handler, and persistence is a store, so a hollow
//! node's runtime is this service with a hollow handler and stores in memory. The
//! modules form layers, each using only those listed before it:
//! - `record`: what the runtime knows of each sandbox (`record::sandbox`), container
//!   (`record::container`) and image (`record::image`), as it persists them.
//! - `store`: where the records persist: JSON files under the root, or nowhere; and
//!   the image store (`store::image`): pulling `file://` and registry images (through
//!   `trellis-oci`), the JSON index.
//! - `log`: container output in the CRI log format.
//! - `network`: a pod's network namespace (`network::netns`), the CNI plugins
//!   that connect it (`network::cni`), and what a restart finds of them
//!   (`network::recover`).
//! - `state`: the live tables of sandboxes and containers over a store, what a running
//!   container has in memory only, and the container events stream.
//! - `handler`: what a runtime handler does for the service: start, stop, measure a
//!   container, exec into it.
//! - the handlers: `wasm`, the `wasmtime` handler (its engine and compiled-component
//!   cache, a program's run on a thread of its own, and `wasm::proxy`, the HTTP
//!   servers of `wasi:http` components); `process`, the `process` handler (spawning,
//!   stopping, adopting after a restart, `ExecSync`); and [`hollow`], the runtime of
//!   hollow nodes: the hollow handler, an image store where every image is present,
//!   served over an in-memory stream.
//! - `recover`: what a restarted runtime does with what the previous run left, before
//!   it serves: sandboxes whose namespace is still pinned and processes still running
//!   are adopted, the network of sandboxes with no record is torn down
//!   (`network::recover`).
//! - `service`: the two CRI services on [`Runtime`], the gRPC edge (every error a
//!   client sees is a `tonic::Status` made there or in the module that knows why): a
//!   sandbox's lifecycle in `service::sandbox`, a container's in `service::container`.

mod cgroup;
mod handler;
pub mod hollow;
mod log;
pub mod namespaces;
mod network;
mod pid;
pub mod pod_files;
mod process;
mod record;
mod recover;
pub mod sandbox;
mod service;
mod state;
mod store;
mod wasm;

use std::future::Future;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use hyper_util::rt::TokioIo;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::image_service_server::ImageServiceServer;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::runtime_service_server::RuntimeServiceServer;
use tonic::transport::{Channel, Endpoint, Uri};

pub use network::CniConfig;
pub use network::default_conflist;
pub use network::forward::{connect_in_netns, sandbox_netns};

/// The handler that runs WebAssembly components; the default.
pub const WASMTIME: &str = "wasmtime";
/// The handler that runs native executables as host processes.
pub const PROCESS: &str = "process";
/// The name of what runs a hollow node's images, whichever handler a sandbox names.
pub(crate) const HOLLOW: &str = "hollow";

/// A container annotation holding the environment values that are not UTF-8, as a JSON
/// object of name to base64 bytes: CRI's values are protobuf strings, which a Rust
/// client sends only as UTF-8, while Kubernetes passes a Secret's bytes unchanged. The
/// `process` handler sets them as they are; a WebAssembly component's environment is
/// strings (`wasi:cli/environment`), so the `wasmtime` handler refuses the container.
pub const ENV_BYTES: &str = "trellis.dev/env-bytes";

/// The values of [`ENV_BYTES`], by name; none when the container has no such
/// annotation.
fn env_bytes(
    config: &k8s_cri::v1::ContainerConfig,
) -> Result<Vec<(String, Vec<u8>)>, tonic::Status> {
    use base64::Engine as _;
    let Some(raw) = config.annotations.get(ENV_BYTES) else {
        return Ok(Vec::new());
    };
    let bad =
        |why: String| tonic::Status::invalid_argument(format!("annotation {ENV_BYTES}: {why}"));
    let values: std::collections::BTreeMap<String, String> =
        serde_json::from_str(raw).map_err(|e| bad(e.to_string()))?;
    values
        .into_iter()
        .map(|(name, value)| {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(&value)
                .map_err(|e| bad(format!("{name}: {e}")))?;
            Ok((name, bytes))
        })
        .collect()
}

/// A `process` container's environment, with the values [`ENV_BYTES`] holds as bytes.
fn environment(
    config: &k8s_cri::v1::ContainerConfig,
) -> Result<Vec<(std::ffi::OsString, std::ffi::OsString)>, tonic::Status> {
    use std::ffi::OsString;
    use std::os::unix::ffi::OsStringExt as _;
    let raw = env_bytes(config)?;
    Ok(config
        .envs
        .iter()
        .map(|kv| {
            let value = match raw.iter().find(|(k, _)| *k == kv.key) {
                Some((_, bytes)) => OsString::from_vec(bytes.clone()),
                None => OsString::from(&kv.value),
            };
            (OsString::from(&kv.key), value)
        })
        .collect())
}

/// What a [`Runtime`] is given.
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Where the runtime keeps its state: images, container and sandbox records.
    pub root: PathBuf,
    /// Where compiled components are cached, named by content digest and engine
    /// (the plugin host's cache may be shared); `None` uses `root/compiled`.
    pub cache_dir: Option<PathBuf>,
    /// Whether the `process` handler is offered: it runs host executables with the
    /// runtime's own privileges, so a node opts in.
    pub process_handler: bool,
    /// The node's IP: a sandbox on the node's network reports it as its IP.
    pub node_ip: IpAddr,
    /// The program a sandboxed `process` container starts through (the `trellis`
    /// binary, whose hidden init mode builds the sandbox and then runs the container's
    /// program): a threaded runtime cannot prepare a child between fork and exec.
    /// `None`: only privileged `process` containers can run.
    pub init_program: Option<PathBuf>,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            root: PathBuf::from("/var/lib/trellis/runtime"),
            cache_dir: None,
            process_handler: false,
            node_ip: IpAddr::from([127, 0, 0, 1]),
            init_program: None,
        }
    }
}

/// The container runtime: implements the CRI `RuntimeService` and `ImageService`
/// over its records, running containers through its handlers.
pub struct Runtime {
    /// What `Version` reports as the runtime's name.
    name: &'static str,
    /// A sandbox on the node's network reports it as its IP.
    node_ip: IpAddr,
    state: Arc<state::State>,
    images: Arc<dyn store::ImageStore>,
    /// The handlers by name; the first is a sandbox's that names none.
    handlers: Vec<(String, Arc<dyn handler::Handler>)>,
    /// The pods' own network: CNI's, or a hollow node's addresses only.
    network: network::PodNetwork,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("name", &self.name)
            .field("handlers", &self.handlers())
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// Opens the runtime's state under `config.root` (creating it), reloads the
    /// records a previous run left, adopts its processes and pod networks still there
    /// and tears down the networks no record names (see `recover`). Must be called
    /// within a Tokio runtime: adopted processes are watched by tasks.
    pub fn new(config: RuntimeConfig) -> anyhow::Result<Arc<Self>> {
        Self::with_cni(config, CniConfig::default())
    }

    /// [`Runtime::new`], with the pods' CNI network configured by `cni`.
    pub fn with_cni(config: RuntimeConfig, cni: CniConfig) -> anyhow::Result<Arc<Self>> {
        tokio::runtime::Handle::try_current()
            .context("the container runtime must be created within a Tokio runtime")?;
        std::fs::create_dir_all(&config.root)
            .with_context(|| format!("create the runtime root {}", config.root.display()))?;
        let images = Arc::new(store::Images::open(&config.root.join("images"))?);
        let cache_dir = config
            .cache_dir
            .clone()
            .unwrap_or_else(|| config.root.join("compiled"));
        let wasm = wasm::Wasmtime {
            host: Arc::new(wasm::WasmHost::new(cache_dir)?),
            node_ip: config.node_ip,
        };
        let mut handlers: Vec<(String, Arc<dyn handler::Handler>)> =
            vec![(WASMTIME.to_string(), Arc::new(wasm))];
        if config.process_handler {
            let process = process::Process::new(config.init_program.clone());
            handlers.push((PROCESS.to_string(), Arc::new(process)));
        }
        let network = network::PodNetwork::cni(&config.root, cni);
        let state = state::State::open(Box::new(store::Files { root: config.root }))?;
        let runtime = Arc::new(Self {
            name: "trellis",
            node_ip: config.node_ip,
            state,
            images,
            handlers,
            network,
        });
        runtime.recover();
        Ok(runtime)
    }

    /// The runtime handlers this node offers: `wasmtime`, and `process` when on.
    pub fn handlers(&self) -> Vec<String> {
        self.handlers.iter().map(|(name, _)| name.clone()).collect()
    }

    /// The containers it holds, whatever their state.
    pub fn container_count(&self) -> usize {
        self.state.tables().containers.len()
    }

    /// The sandboxes it holds, whatever their state.
    pub fn sandbox_count(&self) -> usize {
        self.state.tables().sandboxes.len()
    }

    /// A receiver that changes whenever a container is created, changes state or is
    /// removed.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.state.changes()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // As a crash would: running programs' records stay as they are on disk for
        // the next run to recover; its own tasks and WASM threads end.
        self.state.close();
    }
}

/// Serves both CRI services on the Unix socket `socket` until `shutdown` completes.
/// A socket file left by an earlier run is removed first.
pub async fn serve(
    runtime: Arc<Runtime>,
    socket: &Path,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let listener = listen(socket)?;
    serve_on(runtime, listener, shutdown).await
}

/// Listens on the Unix socket `socket` (replacing a stale one, making its directory):
/// once this returns, clients can connect, so a caller that serves in a task of its
/// own connects at once rather than waiting for the socket to appear.
pub fn listen(socket: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("create the socket's directory {}", dir.display()))?;
    }
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(e).with_context(|| format!("remove the stale socket {}", socket.display()));
        }
    }
    tokio::net::UnixListener::bind(socket)
        .with_context(|| format!("listen on {}", socket.display()))
}

/// Serves both CRI services on `listener` (from [`listen`]) until `shutdown`.
pub async fn serve_on(
    runtime: Arc<Runtime>,
    listener: tokio::net::UnixListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    tracing::info!(socket = ?listener.local_addr().ok(), handlers = ?runtime.handlers(), "CRI runtime serving");
    tonic::transport::Server::builder()
        .add_service(RuntimeServiceServer::from_arc(runtime.clone()))
        .add_service(ImageServiceServer::from_arc(runtime))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            shutdown,
        )
        .await
        .context("serve CRI")
}

/// Clients of a CRI runtime's two services, sharing one connection.
#[derive(Clone, Debug)]
pub struct Client {
    pub runtime: RuntimeServiceClient<Channel>,
    pub images: ImageServiceClient<Channel>,
}

/// Connects to the CRI runtime listening on the Unix socket `socket`: this one, or
/// any other (containerd's, say).
pub async fn connect(socket: &Path) -> anyhow::Result<Client> {
    let path = socket.to_path_buf();
    // The URI is never dialled: the connector below opens the socket.
    let channel = Endpoint::try_from("http://localhost")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await
        .with_context(|| format!("connect to the CRI runtime at {}", socket.display()))?;
    Ok(Client {
        runtime: RuntimeServiceClient::new(channel.clone()),
        images: ImageServiceClient::new(channel),
    })
}
