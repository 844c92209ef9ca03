//! Helpers shared by the cross-crate tests in `all/`: stores on both backends, started
//! the way a user would start them (a real redb file, a real etcd process), and
//! [`TestCluster`], an API server driven by the real kubectl.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::io::AsyncWriteExt as _;
use tokio::sync::oneshot;
use trellis_apiserver::Server;
use trellis_store::local_etcd::LocalEtcd;
use trellis_store::{EtcdStore, RedbConfig, RedbStore, Store};

pub mod cgroups;
pub mod hosts;
pub mod pod_network;
pub mod registry;

/// Settings the conformance suite varies on both backends alike.
#[derive(Clone, Debug)]
pub struct StoreSettings {
    pub watch_buffer: usize,
    pub max_value_size: usize,
}

impl Default for StoreSettings {
    fn default() -> Self {
        Self {
            watch_buffer: 1024,
            max_value_size: trellis_store::DEFAULT_MAX_VALUE_SIZE,
        }
    }
}

/// A store and whatever keeps it alive (its directory or its etcd process).
#[allow(missing_debug_implementations)]
pub struct TestStore {
    pub store: Arc<dyn Store>,
    _redb_dir: Option<tempfile::TempDir>,
    _etcd: Option<LocalEtcd>,
}

impl TestStore {
    /// An embedded store in a fresh temporary directory.
    pub fn redb(settings: StoreSettings) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let mut config = RedbConfig::new(dir.path().join("store.redb"));
        config.watch_buffer = settings.watch_buffer;
        config.max_value_size = settings.max_value_size;
        let store = RedbStore::open(config)?;
        Ok(Self {
            store: Arc::new(store),
            _redb_dir: Some(dir),
            _etcd: None,
        })
    }

    /// An etcd store on a fresh etcd process of its own.
    pub async fn etcd(settings: StoreSettings) -> anyhow::Result<Self> {
        let etcd = LocalEtcd::start().await?;
        let mut config = etcd.config();
        config.watch_buffer = settings.watch_buffer;
        config.max_value_size = settings.max_value_size;
        let store = EtcdStore::connect(config).await?;
        Ok(Self {
            store: Arc::new(store),
            _redb_dir: None,
            _etcd: Some(etcd),
        })
    }
}

/// How long one kubectl invocation may take before the test gives up on it.
const KUBECTL_TIMEOUT: Duration = Duration::from_secs(60);

/// An API server on an embedded store, both in a temporary directory, with the system
/// kubectl pointed at it through the server's own `admin.kubeconfig`.
///
/// Dropping it stops the server without waiting; [`TestCluster::stop`] waits.
#[allow(missing_debug_implementations)]
pub struct TestCluster {
    /// The server's data directory (credentials, `tokens.csv`, `admin.kubeconfig`).
    pub data_dir: PathBuf,
    /// `https://127.0.0.1:PORT`.
    pub url: String,
    /// The admin's bearer token, in group `system:masters`.
    pub admin_token: String,
    /// The cluster CA, as kubeconfigs embed it.
    pub ca_pem: String,
    admin: Kubectl,
    server: Option<Server>,
    store: ClusterStore,
    /// Pod Security's settings, kept for [`TestCluster::restart`].
    pod_security: trellis_apiserver::admission::pod_security::Config,
    /// Dropping it ends the server's `shutdown` future: the stop of a cluster that is
    /// dropped rather than stopped.
    _shutdown: oneshot::Sender<()>,
    // Last: the directory outlives the server and the store that use it.
    dir: tempfile::TempDir,
}

/// The store under a [`TestCluster`].
enum ClusterStore {
    Redb(Arc<RedbStore>),
    /// An etcd of the cluster's own, stopped when this is dropped.
    Etcd {
        _etcd: TestStore,
    },
}

/// What a [`TestCluster`] starts with besides the defaults.
#[derive(Debug, Default)]
pub struct TestClusterBuilder {
    /// Extra `tokens.csv` records: token, user, groups.
    tokens: Vec<(String, String, Vec<String>)>,
    /// Admission and initializer chains instead of the built-in ones.
    chains: Option<trellis_apiserver::admission::Chains>,
    /// The server's `--plugin-dir`.
    plugin_dir: Option<PathBuf>,
    /// Limits and intervals instead of the defaults.
    settings: Option<trellis_apiserver::state::Settings>,
    /// Events a client watch may fall behind before it is ended.
    watch_buffer: Option<usize>,
    /// Run on an etcd of the cluster's own rather than the embedded store.
    etcd: bool,
    /// The watch cache's length instead of the default.
    watch_cache_events: Option<usize>,
    /// Leaves namespaces marked for deletion to a controller outside the server.
    no_namespace_controller: bool,
    /// When CertificateSigningRequests done with are deleted, instead of Kubernetes'
    /// hours.
    csr_cleaning: Option<trellis_apiserver::certificates::Cleaning>,
    /// Pod Security's defaults and exemptions; unset: `privileged` everywhere, since
    /// most tests run host-network, host-path or privileged pods freely.
    pod_security: Option<trellis_apiserver::admission::pod_security::Config>,
}

impl TestClusterBuilder {
    /// When CertificateSigningRequests done with are deleted.
    pub fn with_csr_cleaning(
        mut self,
        cleaning: trellis_apiserver::certificates::Cleaning,
    ) -> Self {
        self.csr_cleaning = Some(cleaning);
        self
    }

    /// A bearer token for `user` in `groups`, written to `tokens.csv` before the
    /// server first starts (it creates the file only when it is missing).
    pub fn with_token(mut self, token: &str, user: &str, groups: &[&str]) -> Self {
        self.tokens.push((
            token.to_owned(),
            user.to_owned(),
            groups.iter().map(|g| (*g).to_owned()).collect(),
        ));
        self
    }

    /// Runs the server with these admission and initializer chains.
    pub fn with_chains(mut self, chains: trellis_apiserver::admission::Chains) -> Self {
        self.chains = Some(chains);
        self
    }

    /// Runs the server with this plugins directory.
    pub fn with_plugin_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.plugin_dir = Some(dir.into());
        self
    }

    /// Runs the server with these limits and intervals.
    pub fn with_settings(mut self, settings: trellis_apiserver::state::Settings) -> Self {
        self.settings = Some(settings);
        self
    }

    /// Runs the server on an etcd of its own (Debian's `etcd`, started on loopback).
    pub fn on_etcd(mut self) -> Self {
        self.etcd = true;
        self
    }

    /// Keeps this many changes in the watch cache: watches from before them are
    /// served from the store.
    pub fn with_watch_cache_events(mut self, events: usize) -> Self {
        self.watch_cache_events = Some(events);
        self
    }

    /// Ends a client watch once it falls this many events behind.
    pub fn with_watch_buffer(mut self, events: usize) -> Self {
        self.watch_buffer = Some(events);
        self
    }

    /// Runs the server without its namespace controller: a deleted namespace stays
    /// marked until its `spec.finalizers` are emptied through `namespaces/finalize`.
    pub fn without_namespace_controller(mut self) -> Self {
        self.no_namespace_controller = true;
        self
    }

    /// Runs Pod Security with these defaults and exemptions.
    pub fn with_pod_security(
        mut self,
        config: trellis_apiserver::admission::pod_security::Config,
    ) -> Self {
        self.pod_security = Some(config);
        self
    }

    /// Runs Pod Security as `trellis up` does by default: enforce `baseline`, warn
    /// and audit `restricted`, `kube-system` exempt.
    pub fn with_default_pod_security(self) -> Self {
        self.with_pod_security(Default::default())
    }

    pub async fn start(self) -> anyhow::Result<TestCluster> {
        let dir = tempfile::tempdir().context("create the cluster's directory")?;
        let data_dir = dir.path().join("data");
        if !self.tokens.is_empty() {
            std::fs::create_dir_all(&data_dir).context("create the data directory")?;
            let admin_token = format!("admin-{:032x}", rand::random::<u128>());
            let mut csv = format!("{admin_token},admin,admin,\"system:masters\"\n");
            for (token, user, groups) in &self.tokens {
                csv.push_str(&format!("{token},{user},{user}"));
                if !groups.is_empty() {
                    csv.push_str(&format!(",\"{}\"", groups.join(",")));
                }
                csv.push('\n');
            }
            std::fs::write(data_dir.join("tokens.csv"), csv).context("write tokens.csv")?;
        }
        let (store, dyn_store): (ClusterStore, Arc<dyn Store>) = if self.etcd {
            let etcd = TestStore::etcd(StoreSettings::default())
                .await
                .context("start etcd")?;
            let dyn_store = etcd.store.clone();
            (ClusterStore::Etcd { _etcd: etcd }, dyn_store)
        } else {
            let redb = Arc::new(
                RedbStore::open(RedbConfig::new(dir.path().join("store.redb")))
                    .context("open the store")?,
            );
            (ClusterStore::Redb(redb.clone()), redb)
        };
        let mut config = trellis_apiserver::Config::new(&data_dir);
        config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        config.shutdown_grace = Duration::from_secs(2);
        if let Some(chains) = self.chains {
            config.chains = chains;
        }
        config.plugin_dir = self.plugin_dir;
        if let Some(settings) = self.settings {
            config.settings = settings;
        }
        if let Some(events) = self.watch_buffer {
            config.watch_buffer = events;
        }
        if let Some(events) = self.watch_cache_events {
            config.watch_cache_events = events;
        }
        config.namespace_controller = !self.no_namespace_controller;
        if let Some(cleaning) = self.csr_cleaning {
            config.csr_cleaning = cleaning;
        }
        let pod_security = self
            .pod_security
            .unwrap_or_else(trellis_apiserver::admission::pod_security::Config::privileged);
        config.pod_security = pod_security.clone();
        let (shutdown, stopped) = oneshot::channel::<()>();
        let server = trellis_apiserver::start(config, dyn_store, async move {
            // A send or a drop of the sender: either way, stop.
            let _ = stopped.await;
        })
        .await
        .context("start the API server")?;
        let admin = Kubectl {
            bin: kubectl_bin(),
            kubeconfig: server.kubeconfig.clone(),
            cache_dir: dir.path().join("kubectl-cache"),
        };
        Ok(TestCluster {
            data_dir,
            url: server.url.clone(),
            admin_token: server.admin_token.clone(),
            ca_pem: server.ca_pem.clone(),
            admin,
            server: Some(server),
            store,
            pod_security,
            _shutdown: shutdown,
            dir,
        })
    }
}

/// kubectl 1.20: `$TRELLIS_KUBECTL_1_20`, else what `tests/tools/kubectl-1.20.sh`
/// unpacks from Debian's `kubernetes-client` into `~/.cache/trellis` (once per
/// machine; later runs reuse it).
pub fn kubectl_1_20_bin() -> anyhow::Result<PathBuf> {
    static BIN: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);
    tool_bin(&BIN, "TRELLIS_KUBECTL_1_20", "kubectl-1.20.sh")
}

/// A binary one of `tests/tools/` installs: `$env_var` when set, else the path the
/// script prints, run once per test process (`cached` holds its answer).
pub fn tool_bin(
    cached: &std::sync::Mutex<Option<PathBuf>>,
    env_var: &str,
    script: &str,
) -> anyhow::Result<PathBuf> {
    if let Some(bin) = std::env::var_os(env_var) {
        return Ok(PathBuf::from(bin));
    }
    // One installation at a time: tests run in parallel.
    let mut cached = cached.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(bin) = cached.as_ref() {
        return Ok(bin.clone());
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tools")
        .join(script);
    let output = std::process::Command::new(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("run {}", script.display()))?;
    if !output.status.success() {
        bail!("{} failed with {}", script.display(), output.status);
    }
    let bin = PathBuf::from(
        String::from_utf8(output.stdout)
            .context("the script's output is not UTF-8")?
            .trim(),
    );
    *cached = Some(bin.clone());
    Ok(bin)
}

/// The kubectl the tests run: `$TRELLIS_KUBECTL` (`make test` sets it), else what
/// `tests/tools/kubectl-current.sh` prints: the kubectl on PATH when it is 1.30 or
/// newer, else an upstream 1.35 it fetches into `~/.cache/trellis` (once per machine),
/// so that a machine whose only kubectl is Debian's 1.20 still tests a current client.
fn kubectl_bin() -> PathBuf {
    static BIN: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);
    tool_bin(&BIN, "TRELLIS_KUBECTL", "kubectl-current.sh")
        .unwrap_or_else(|e| panic!("no current kubectl (set TRELLIS_KUBECTL): {e:#}"))
}

impl TestCluster {
    /// A cluster with nothing but its defaults.
    pub async fn start() -> anyhow::Result<TestCluster> {
        TestClusterBuilder::default().start().await
    }

    pub fn builder() -> TestClusterBuilder {
        TestClusterBuilder::default()
    }

    /// The API server's router, for in-process clients.
    pub fn in_process(&self) -> trellis_client::InProcess {
        trellis_client::InProcess::new(
            self.server
                .as_ref()
                .map(|s| s.in_process.clone())
                .unwrap_or_default(),
        )
    }

    /// A kube-rs client as the admin, over HTTPS through `admin.kubeconfig`.
    pub async fn kube_admin(&self) -> anyhow::Result<kube::Client> {
        trellis_client::remote(&self.data_dir.join("admin.kubeconfig")).await
    }

    /// kubectl as the admin, through `admin.kubeconfig` (its client certificate).
    /// The embedded store's file.
    pub fn store_path(&self) -> PathBuf {
        self.dir.path().join("store.redb")
    }

    pub fn admin(&self) -> &Kubectl {
        &self.admin
    }

    /// kubectl with a kubeconfig of its own that holds the cluster CA and `token`, and
    /// no client certificate.
    pub fn kubectl_with_token(&self, name: &str, token: &str) -> anyhow::Result<Kubectl> {
        use base64::Engine as _;
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca_pem);
        let url = &self.url;
        let contents = format!(
            "apiVersion: v1\nkind: Config\n\
             clusters:\n- name: trellis\n  cluster:\n    server: \"{url}\"\n    certificate-authority-data: {ca}\n\
             users:\n- name: \"{name}\"\n  user:\n    token: \"{token}\"\n\
             contexts:\n- name: trellis\n  context:\n    cluster: trellis\n    user: \"{name}\"\n\
             current-context: trellis\n"
        );
        let kubeconfig = self.dir.path().join(format!("{name}.kubeconfig"));
        std::fs::write(&kubeconfig, contents)
            .with_context(|| format!("write {}", kubeconfig.display()))?;
        Ok(Kubectl {
            bin: self.admin.bin.clone(),
            kubeconfig,
            cache_dir: self.admin.cache_dir.clone(),
        })
    }

    /// A kubectl with a client certificate for `user` in `groups`, issued by the
    /// cluster CA (for identities such as nodes: `system:node:NAME` in `system:nodes`).
    pub fn kubectl_with_cert(&self, user: &str, groups: &[&str]) -> anyhow::Result<Kubectl> {
        let pki = trellis_apiserver::server::pki::Pki::load_or_create(&self.data_dir, &[])
            .context("load the cluster CA")?;
        let (cert, key) = pki
            .issue_client_cert(user, groups, 1)
            .context("issue a client certificate")?;
        let contents = trellis_apiserver::server::kubeconfig::admin_kubeconfig(
            &self.url,
            &self.ca_pem,
            &cert,
            &key,
        );
        let kubeconfig = self
            .dir
            .path()
            .join(format!("{}.kubeconfig", user.replace(':', "_")));
        std::fs::write(&kubeconfig, contents)
            .with_context(|| format!("write {}", kubeconfig.display()))?;
        Ok(Kubectl {
            bin: self.admin.bin.clone(),
            kubeconfig,
            cache_dir: self.admin.cache_dir.clone(),
        })
    }

    /// kubectl 1.20 (Debian's `kubernetes-client`) as the admin, with a discovery
    /// cache of its own; see [`kubectl_1_20_bin`].
    pub fn kubectl_1_20(&self) -> anyhow::Result<Kubectl> {
        Ok(Kubectl {
            bin: kubectl_1_20_bin()?,
            kubeconfig: self.admin.kubeconfig.clone(),
            cache_dir: self.dir.path().join("kubectl-1.20-cache"),
        })
    }

    /// Runs kubectl as the admin; see [`Kubectl::run`].
    pub async fn kubectl(&self, args: &[&str]) -> anyhow::Result<Output> {
        self.admin.run(args, None).await
    }

    /// Runs kubectl as the admin and returns its stdout; fails unless it exits 0.
    pub async fn kubectl_ok(&self, args: &[&str]) -> anyhow::Result<String> {
        self.admin.ok(args).await
    }

    /// As [`TestCluster::kubectl_ok`], with `stdin` as its standard input (`-f -`).
    pub async fn kubectl_ok_stdin(&self, args: &[&str], stdin: &str) -> anyhow::Result<String> {
        self.admin.ok_stdin(args, stdin).await
    }

    /// Runs kubectl as the admin, expecting it to fail; returns its stderr.
    pub async fn kubectl_err(&self, args: &[&str]) -> anyhow::Result<String> {
        self.admin.err(args, None).await
    }

    /// As [`TestCluster::kubectl_err`], with `stdin` as its standard input.
    pub async fn kubectl_err_stdin(&self, args: &[&str], stdin: &str) -> anyhow::Result<String> {
        self.admin.err(args, Some(stdin)).await
    }

    /// Compacts the store's history up to `revision`, as the compactor would.
    pub async fn compact(&self, revision: u64) -> anyhow::Result<()> {
        let store: Arc<dyn Store> = match &self.store {
            ClusterStore::Redb(redb) => redb.clone(),
            ClusterStore::Etcd { _etcd } => _etcd.store.clone(),
        };
        store.compact(revision).await.context("compact the store")
    }

    /// Stops the server and starts a new one with the defaults on the same data
    /// directory, store and address, as a restarted server comes back: its clients
    /// reconnect to it (in-process clients made before stay with the old one).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        let server = self.server.take().context("the server is not running")?;
        let addr = server.addr;
        server.stop().await.context("stop the API server")?;
        let store: Arc<dyn Store> = match &self.store {
            ClusterStore::Redb(redb) => redb.clone(),
            ClusterStore::Etcd { _etcd } => _etcd.store.clone(),
        };
        let mut config = trellis_apiserver::Config::new(&self.data_dir);
        config.listen = addr;
        config.shutdown_grace = Duration::from_secs(2);
        config.pod_security = self.pod_security.clone();
        let (shutdown, stopped) = oneshot::channel::<()>();
        let server = trellis_apiserver::start(config, store, async move {
            let _ = stopped.await;
        })
        .await
        .context("start the API server again")?;
        self._shutdown = shutdown;
        self.server = Some(server);
        Ok(())
    }

    /// Stops the server (waiting for requests in flight) and closes the store.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(server) = self.server.take() {
            server.stop().await.context("stop the API server")?;
        }
        if let ClusterStore::Redb(redb) = &self.store {
            redb.close().await.context("close the store")?;
        }
        Ok(())
    }
}

/// The system kubectl with one kubeconfig, each run bounded by a timeout.
#[derive(Clone, Debug)]
pub struct Kubectl {
    bin: PathBuf,
    kubeconfig: PathBuf,
    /// Discovery is cached per cluster, not in `~/.kube/cache`, where a later server
    /// on a reused port would find it.
    cache_dir: PathBuf,
}

impl Kubectl {
    /// A kubectl command with this kubeconfig, stdin closed and output captured, that
    /// is killed when dropped: for runs the test drives itself (`get -w`).
    pub fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(&self.cache_dir)
            .args(args)
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        cmd
    }

    /// Runs kubectl to completion with `stdin` (if any) as its input, whatever its
    /// exit status; fails only if it cannot start or outlives the timeout.
    pub async fn run(&self, args: &[&str], stdin: Option<&str>) -> anyhow::Result<Output> {
        let what = format!("kubectl {}", args.join(" "));
        let mut cmd = self.command(args);
        if stdin.is_some() {
            cmd.stdin(Stdio::piped());
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("start {what} ({})", self.bin.display()))?;
        let pipe = match stdin {
            Some(_) => Some(child.stdin.take().context("take kubectl's stdin")?),
            None => None,
        };
        // Fed while kubectl runs, so that neither waits on a full pipe; dropping the
        // pipe ends the input.
        let feed = async move {
            if let (Some(mut pipe), Some(input)) = (pipe, stdin) {
                match pipe.write_all(input.as_bytes()).await {
                    // kubectl exited without reading it all; its output says why.
                    Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                    other => other?,
                }
            }
            std::io::Result::Ok(())
        };
        let run = async {
            let (fed, output) = tokio::join!(feed, child.wait_with_output());
            fed.with_context(|| format!("write the stdin of {what}"))?;
            output.with_context(|| format!("wait for {what}"))
        };
        match tokio::time::timeout(KUBECTL_TIMEOUT, run).await {
            Ok(output) => output,
            Err(_) => bail!("{what} did not finish within {KUBECTL_TIMEOUT:?}"),
        }
    }

    /// Runs kubectl and returns its stdout; fails with its stderr unless it exits 0.
    pub async fn ok(&self, args: &[&str]) -> anyhow::Result<String> {
        succeeded(args, self.run(args, None).await?)
    }

    /// As [`Kubectl::ok`], with `stdin` as its standard input.
    pub async fn ok_stdin(&self, args: &[&str], stdin: &str) -> anyhow::Result<String> {
        succeeded(args, self.run(args, Some(stdin)).await?)
    }

    /// Runs kubectl expecting it to fail; returns its stderr, or fails with its stdout
    /// if it exits 0.
    pub async fn err(&self, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
        let output = self.run(args, stdin).await?;
        if output.status.success() {
            bail!(
                "kubectl {} succeeded but was expected to fail; stdout:\n{}",
                args.join(" "),
                String::from_utf8_lossy(&output.stdout)
            );
        }
        Ok(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

fn succeeded(args: &[&str], output: Output) -> anyhow::Result<String> {
    if !output.status.success() {
        bail!(
            "kubectl {} exited with {}; stderr:\n{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    String::from_utf8(output.stdout).context("kubectl's stdout is not UTF-8")
}

/// A WASM plugin built from `plugins/` or `examples/plugins/` by `plugins/build.sh`
/// (`make plugins`; `make test` runs it first).
pub fn plugin_wasm(name: &str) -> anyhow::Result<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the repository root")?
        .to_owned();
    let built = root
        .join("plugins/target/dist")
        .join(format!("{name}.wasm"));
    if built.exists() {
        return Ok(built);
    }
    bail!(
        "{} is missing: build the plugins first with `make plugins` (plugins/build.sh)",
        built.display()
    )
}

/// A response read whole.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn json(&self) -> anyhow::Result<serde_json::Value> {
        serde_json::from_slice(&self.body).context("the response is not JSON")
    }

    /// The values of a header, in order.
    pub fn header_values(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

impl TestCluster {
    /// One HTTPS request as the admin (bearer token), on a connection of its own: for
    /// what kubectl cannot show (headers, many requests at once).
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        content_type: &str,
        body: &str,
    ) -> anyhow::Result<HttpResponse> {
        self.request_as(Some(&self.admin_token), method, path, content_type, body)
            .await
    }

    /// One HTTPS request with `token` as its bearer token, or none, on a connection of
    /// its own.
    pub async fn request_as(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        content_type: &str,
        body: &str,
    ) -> anyhow::Result<HttpResponse> {
        use http_body_util::BodyExt as _;
        let authority = self.url.trim_start_matches("https://").to_owned();
        let stream = self.tls_stream(b"http/1.1").await?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .context("HTTP handshake")?;
        tokio::spawn(connection);
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", authority)
            .header("content-type", content_type);
        let request = match token {
            Some(token) => request.header("authorization", format!("Bearer {token}")),
            None => request,
        }
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_owned(),
        )))
        .context("build the request")?;
        let response = sender
            .send_request(request)
            .await
            .context("send the request")?;
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let body = response
            .into_body()
            .collect()
            .await
            .context("read the response")?
            .to_bytes()
            .to_vec();
        Ok(HttpResponse {
            status,
            headers,
            body,
        })
    }
}

impl TestCluster {
    /// Sends a GET for `path` as the admin over HTTP/1.1 on a connection whose receive
    /// buffer is as small as the kernel allows, and returns the connection unread: a
    /// client that has stopped reading.
    pub async fn unread_request(
        &self,
        path: &str,
    ) -> anyhow::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        use tokio::io::AsyncWriteExt as _;
        let mut stream = self.tls_stream_with(b"http/1.1", Some(1)).await?;
        let authority = self.url.trim_start_matches("https://");
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {authority}\r\nAuthorization: Bearer {}\r\n\r\n",
            self.admin_token
        );
        stream
            .write_all(request.as_bytes())
            .await
            .context("send the request")?;
        stream.flush().await.context("send the request")?;
        Ok(stream)
    }

    /// Writes `request` as is on an HTTP/1.1 connection of its own and returns all the
    /// server sends until it closes the connection: for requests no client library
    /// would send.
    pub async fn raw_http1(&self, request: &[u8]) -> anyhow::Result<Vec<u8>> {
        self.raw_http1_then(request, false).await
    }

    /// [`TestCluster::raw_http1`]; with `close`, the client closes its sending side
    /// after the request (a client that stops before the end of its body).
    pub async fn raw_http1_then(&self, request: &[u8], close: bool) -> anyhow::Result<Vec<u8>> {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut stream = self.tls_stream(b"http/1.1").await?;
        stream
            .write_all(request)
            .await
            .context("send the request")?;
        stream.flush().await.context("send the request")?;
        if close {
            stream.shutdown().await.context("close the sending side")?;
        }
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
            .await
            .context("the server did not close the connection")?;
        Ok(answer)
    }

    /// A TLS connection to the server that offers only `alpn`, its handshake done.
    pub async fn tls_stream(
        &self,
        alpn: &[u8],
    ) -> anyhow::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        self.tls_stream_with(alpn, None).await
    }

    /// [`TestCluster::tls_stream`], with the socket's receive buffer set first.
    async fn tls_stream_with(
        &self,
        alpn: &[u8],
        recv_buffer: Option<u32>,
    ) -> anyhow::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile_certs(&self.ca_pem)? {
            roots.add(cert).context("add the cluster CA")?;
        }
        let mut tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_root_certificates(roots)
        .with_no_client_auth();
        tls.alpn_protocols = vec![alpn.to_vec()];
        let authority = self.url.trim_start_matches("https://");
        let address: std::net::SocketAddr = authority.parse().context("the server address")?;
        let socket = tokio::net::TcpSocket::new_v4().context("a socket")?;
        if let Some(bytes) = recv_buffer {
            socket
                .set_recv_buffer_size(bytes)
                .context("set the receive buffer")?;
        }
        let tcp = socket
            .connect(address)
            .await
            .context("connect to the server")?;
        let name =
            rustls::pki_types::ServerName::try_from("127.0.0.1").context("the server name")?;
        tokio_rustls::TlsConnector::from(Arc::new(tls))
            .connect(name, tcp)
            .await
            .context("TLS handshake")
    }

    /// An HTTP/2 connection to the server, as client-go opens one, driven by a task of
    /// its own; requests go out as streams on it ([`TestCluster::http2_request`]).
    pub async fn http2(
        &self,
    ) -> anyhow::Result<hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>>>
    {
        let stream = self.tls_stream(b"h2").await?;
        let (sender, connection) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .context("HTTP/2 handshake")?;
        tokio::spawn(connection);
        Ok(sender)
    }

    /// A bodiless request as the admin, for [`TestCluster::http2`]'s connection.
    pub fn http2_request(
        &self,
        method: &str,
        path: &str,
    ) -> anyhow::Result<hyper::Request<http_body_util::Full<bytes::Bytes>>> {
        hyper::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url))
            .header("authorization", format!("Bearer {}", self.admin_token))
            .body(http_body_util::Full::default())
            .context("build the request")
    }
}

/// The certificates in a PEM bundle.
fn rustls_pemfile_certs(
    pem: &str,
) -> anyhow::Result<Vec<rustls::pki_types::CertificateDer<'static>>> {
    use rustls::pki_types::pem::PemObject as _;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .context("read the cluster CA")
}

impl TestCluster {
    /// Waits until Plugin `name`'s `Loaded` condition has `status` for `generation`, and
    /// returns the Plugin object.
    pub async fn plugin_loaded(
        &self,
        name: &str,
        status: &str,
        generation: i64,
        within: Duration,
    ) -> anyhow::Result<serde_json::Value> {
        let deadline = std::time::Instant::now() + within;
        loop {
            let out = self
                .kubectl_ok(&["get", "plugin", name, "-o", "json"])
                .await?;
            let obj: serde_json::Value = serde_json::from_str(&out)?;
            if let Some(cond) = obj["status"]["conditions"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == "Loaded"))
                && cond["status"] == status
                && cond["observedGeneration"] == generation
            {
                return Ok(obj);
            }
            if std::time::Instant::now() > deadline {
                bail!("plugin {name} never became Loaded={status}: {obj}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Whether an HTTP server answers 200 at `ip:port` from the host, retried for up to
/// 15 s as it starts: a pod's server on its own IP, reached from the node.
pub async fn http_answers(ip: &str, port: u16) -> bool {
    use tokio::io::AsyncReadExt as _;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while tokio::time::Instant::now() < deadline {
        let attempt = async {
            let mut tcp = tokio::net::TcpStream::connect((ip, port)).await?;
            tcp.write_all(
                format!("GET / HTTP/1.1\r\nHost: {ip}:{port}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await?;
            let mut reply = Vec::new();
            tcp.read_to_end(&mut reply).await?;
            let first = reply.split(|&b| b == b'\n').next().unwrap_or_default();
            anyhow::Ok(first.starts_with(b"HTTP/1.") && first.windows(5).any(|w| w == b" 200 "))
        };
        if let Ok(Ok(true)) = tokio::time::timeout(Duration::from_secs(2), attempt).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// A temporary directory for a test's runtime or node, which unmounts whatever is still
/// mounted below it before it is removed: a runtime keeps its sandboxes' namespace pins
/// across its own restarts by design, so a test that drops it with sandboxes left would
/// otherwise leave them mounted (and its directory behind).
#[derive(Debug)]
pub struct TestDir(tempfile::TempDir);

impl TestDir {
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        unmount_under(self.0.path());
        cgroups::remove_runtime_cgroups(self.0.path());
    }
}

/// The init program of sandboxed `process` containers (`src/bin/trellis_init.rs`)
/// for runtimes started in a test's process: built by `cargo test` with the test
/// binaries, beside them.
pub fn init_program() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().unwrap_or(Path::new("."));
    let dir = if dir.ends_with("deps") {
        dir.parent().unwrap_or(dir)
    } else {
        dir
    };
    dir.join("trellis_init")
}

/// `config` with [`init_program`] as the init of sandboxed `process` containers.
pub fn sandboxed(config: trellis_runtime::RuntimeConfig) -> trellis_runtime::RuntimeConfig {
    trellis_runtime::RuntimeConfig {
        init_program: Some(init_program()),
        ..config
    }
}

/// A new [`TestDir`].
pub fn test_dir() -> std::io::Result<TestDir> {
    tempfile::tempdir().map(TestDir)
}

/// Lazily unmounts every mount at or below `dir`, deepest first.
pub fn unmount_under(dir: &Path) {
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    // The mount point is the fifth field, with spaces and the like escaped in octal.
    let mut points: Vec<String> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| p.replace("\\040", " "))
        .filter(|p| Path::new(p).starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for point in points {
        let _ = std::process::Command::new("umount")
            .args(["-l", &point])
            .status();
    }
}

/// Waits until `left` (what is still in `dir`) is empty, up to `limit`: woken by
/// inotify at each removal in `dir`, not by a clock.
pub async fn wait_removed(
    dir: &std::path::Path,
    left: impl Fn() -> Vec<String>,
    limit: Duration,
) -> anyhow::Result<()> {
    wait_removed_in(&[dir], left, limit).await
}

/// [`wait_removed`] for what is spread over several directories: woken by a removal in
/// any of `dirs` (those that exist).
pub async fn wait_removed_in(
    dirs: &[&std::path::Path],
    left: impl Fn() -> Vec<String>,
    limit: Duration,
) -> anyhow::Result<()> {
    let done = wait_on_files(
        dirs,
        rustix::fs::inotify::WatchFlags::DELETE,
        || left().is_empty().then_some(()),
        limit,
    )
    .await?;
    if done.is_none() {
        let named = dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        anyhow::bail!("left in {named} after {limit:?}: {:?}", left());
    }
    Ok(())
}

/// Waits until `found` finds what a file in `dir` should come to hold (a line a
/// background writer appends), up to `limit`: looked at again at each write to a file
/// of `dir`, not by a clock. `None` when it never came.
pub async fn wait_written<T>(
    dir: &std::path::Path,
    found: impl FnMut() -> Option<T>,
    limit: Duration,
) -> anyhow::Result<Option<T>> {
    use rustix::fs::inotify::WatchFlags;
    wait_on_files(
        &[dir],
        WatchFlags::MODIFY | WatchFlags::CREATE | WatchFlags::MOVED_TO,
        found,
        limit,
    )
    .await
}

/// Calls `check` until it gives a value, up to `limit`: again at each inotify event
/// of `events` in any of `dirs` (those that exist). `None` when the time ran out.
async fn wait_on_files<T>(
    dirs: &[&std::path::Path],
    events: rustix::fs::inotify::WatchFlags,
    mut check: impl FnMut() -> Option<T>,
    limit: Duration,
) -> anyhow::Result<Option<T>> {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    use rustix::fs::inotify;
    let watch = std::sync::Arc::new(inotify::init(
        inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK,
    )?);
    for dir in dirs.iter().filter(|d| d.exists()) {
        inotify::add_watch(&*watch, *dir, events)?;
    }
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        // Looked at after the watch is set, so no change goes unseen.
        if let Some(value) = check() {
            return Ok(Some(value));
        }
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if remaining.is_zero() {
            return Ok(None);
        }
        let watch = watch.clone();
        tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
            let timeout = Timespec::try_from(remaining)?;
            poll(&mut [PollFd::new(&*watch, PollFlags::IN)], Some(&timeout))?;
            let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
            let mut events = inotify::Reader::new(&*watch, &mut buf);
            while events.next().is_ok() {}
            Ok(())
        })
        .await??;
    }
}

/// Network objects of this machine a test may make (links, nftables tables, each as its
/// `ip link`/`nft` name): those missing when it is made are deleted when it is dropped,
/// whatever way the test ends; those already there are left alone.
#[derive(Debug)]
pub struct NetworkLeftovers(Vec<(&'static str, String)>);

impl NetworkLeftovers {
    /// `links` are `ip link` names, `tables` `nft` family and name (`"ip trellis0"`).
    pub fn new(links: &[&str], tables: &[&str]) -> Self {
        let quiet = |program: &str, args: &[&str]| {
            std::process::Command::new(program)
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let mut missing = Vec::new();
        for link in links {
            if !quiet("ip", &["link", "show", link]) {
                missing.push(("link", (*link).to_owned()));
            }
        }
        for table in tables {
            let mut args = vec!["list", "table"];
            args.extend(table.split(' '));
            if !quiet("nft", &args) {
                missing.push(("table", (*table).to_owned()));
            }
        }
        Self(missing)
    }
}

impl Drop for NetworkLeftovers {
    fn drop(&mut self) {
        for (kind, name) in &self.0 {
            let mut args = match *kind {
                "link" => vec!["link", "delete"],
                _ => vec!["delete", "table"],
            };
            args.extend(name.split(' '));
            let program = if *kind == "link" { "ip" } else { "nft" };
            let _ = std::process::Command::new(program)
                .args(&args)
                .stderr(Stdio::null())
                .status();
        }
    }
}
