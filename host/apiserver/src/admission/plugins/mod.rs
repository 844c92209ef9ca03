//! WASM plugins in the admission and initializer chains.
//!
//! Plugins are declared as `Plugin` objects (`trellis.dev/v1`, served from a CRD the
//! server installs) or as `NAME.yaml` + `NAME.wasm` pairs in the plugins directory.
//! One task feeds both to a [`Follower`] of `trellis-plugins`, the follow loop every
//! world uses: a changed declaration loads beside the running version and replaces it
//! only once it compiled, started and accepted its configuration; a failed load leaves
//! the last good version serving and says why in the Plugin's status (or the log, for
//! files). Each load runs in a task of its own, so a module fetched slowly (an
//! `https://` or `oci://` server that does not answer) delays only its own plugin; a
//! newer declaration of the same plugin stops the load of the older one, whose outcome
//! is never used. What is the API server's own: which kinds it serves (a controller
//! Plugin is granted its RBAC rules here and runs in the controller manager), and the
//! status it writes through its registry.
//!
//! [`PluginAdmission`] runs the loaded mutating and validating plugins in the
//! admission chain; [`PluginInitializers`] offers the initializer plugins to the
//! initializer chain. Both apply each plugin's rules, selectors and failure policy.
//!
//! # Layout
//! - this file: [`PluginManager`], which follows Plugin objects and the plugins
//!   directory and loads each declaration.
//! - `world`: the API server's world of the follow loop: what it serves, how a loaded
//!   plugin joins the chains, what its status says.
//! - `status`: the `Loaded` condition and call counters written to Plugin statuses.
//! - `controller_policy`: the RBAC rules a controller Plugin is granted.
//! - `glue`: the chains' side: [`PluginAdmission`], [`PluginInitializers`] and the
//!   cluster reader plugins call.

mod controller_policy;
mod glue;
mod status;
mod world;

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::{OnceCell, Semaphore};
use tracing::{info, warn};
use trellis_plugin_host::{ClusterReader, HostConfig, Plugin, PluginHost, PluginKind};
use trellis_plugins::follow::{Change, Finished, Follower, World as _};
use trellis_plugins::{dir, source, spec};
use trellis_store::{ListRequest, Store};

pub use crate::admission::Cluster;
pub use glue::{PluginAdmission, PluginInitializers, StoreReader};
use spec::{FailurePolicy, Parsed};

use self::world::Chains;
use crate::object::Object;

/// How often the plugins directory is looked at.
const DIR_POLL: Duration = Duration::from_millis(250);
/// How often serving counters are copied into Plugin statuses (when they changed).
const STATUS_REFRESH: Duration = Duration::from_secs(10);

/// Where plugins come from and where compiled ones are kept.
#[derive(Clone, Debug, Default)]
pub struct PluginsConfig {
    /// `--plugin-dir`: `NAME.yaml` + `NAME.wasm` pairs.
    pub dir: Option<PathBuf>,
    /// Compiled components and fetched modules, by digest.
    pub cache_dir: PathBuf,
}

/// A loaded plugin with what selects its requests.
#[derive(Debug)]
pub struct Bound {
    pub parsed: Parsed,
    pub plugin: Arc<Plugin>,
    /// `Plugin NAME` or `file NAME.yaml`: where it was declared.
    pub origin: String,
}

impl Bound {
    pub fn kind(&self) -> PluginKind {
        self.parsed.spec.kind
    }

    pub fn failure_policy(&self) -> FailurePolicy {
        self.parsed.failure_policy
    }
}

/// The plugins serving now, in chain order (`order`, then name).
#[derive(Debug, Default)]
pub struct Active {
    pub plugins: Vec<Arc<Bound>>,
}

/// Loads, reloads and serves plugins.
pub struct PluginManager {
    config: PluginsConfig,
    host: OnceCell<Arc<PluginHost>>,
    active: RwLock<Arc<Active>>,
    store: Arc<dyn Store>,
    /// Weak: the server's state holds this manager. Set by [`PluginManager::start`].
    cluster: std::sync::OnceLock<std::sync::Weak<dyn Cluster>>,
    /// Loads compiling and starting their plugin at once: one per core, so that many
    /// plugins changing together (a server's start) do not share the cores and all
    /// finish late. Fetches are not counted: one that hangs must not hold up the rest.
    compiling: Semaphore,
}

impl std::fmt::Debug for PluginManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginManager")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A declaration, as one load takes it.
enum Declared {
    /// A Plugin object: its `metadata`, for the status.
    Object {
        name: String,
        meta: Value,
        spec: Value,
    },
    /// `NAME.yaml` in the plugins directory `dir`.
    File { entry: dir::Entry, dir: PathBuf },
}

impl PluginManager {
    pub fn new(config: PluginsConfig, store: Arc<dyn Store>) -> Arc<Self> {
        Arc::new(Self {
            config,
            host: OnceCell::new(),
            active: RwLock::new(Arc::new(Active::default())),
            store,
            cluster: std::sync::OnceLock::new(),
            compiling: Semaphore::new(
                std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get),
            ),
        })
    }

    /// The server's state, while it runs.
    fn cluster(&self) -> Option<Arc<dyn Cluster>> {
        self.cluster.get().and_then(std::sync::Weak::upgrade)
    }

    /// The plugins serving now.
    pub fn active(&self) -> Arc<Active> {
        self.active
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The engine, created with the first plugin: a server without plugins pays
    /// nothing for it.
    pub async fn host(&self) -> Result<Arc<PluginHost>, String> {
        self.host
            .get_or_try_init(|| async {
                PluginHost::new(HostConfig {
                    cache_dir: Some(self.config.cache_dir.join("compiled")),
                    max_instances: 256,
                    max_memory: (spec::MAX_MEMORY_MIB as usize) << 20,
                    ..HostConfig::default()
                })
                .map_err(|e| format!("starting the plugin engine: {e:#}"))
            })
            .await
            .cloned()
    }

    /// Appends the serving plugins' metrics to a Prometheus exposition.
    pub fn render_metrics(&self, out: &mut String) {
        let plugins: Vec<Arc<Plugin>> = self
            .active()
            .plugins
            .iter()
            .map(|b| b.plugin.clone())
            .collect();
        if !plugins.is_empty() {
            trellis_plugin_host::render_metrics(out, &plugins);
        }
    }

    /// Follows Plugin objects and the plugins directory until the server stops.
    pub fn start(self: &Arc<Self>, state: Arc<dyn Cluster>) {
        let _ = self.cluster.set(Arc::downgrade(&state));
        let manager = self.clone();
        tokio::spawn(async move { manager.run(state).await });
    }

    async fn run(self: Arc<Self>, state: Arc<dyn Cluster>) {
        enum Next {
            Event(bool),
            Loaded(Finished<Arc<Bound>>),
            Dir,
            Counters,
        }
        // Dropped with this task when the server stops, which stops the loads too.
        let mut follower = Follower::new(Chains::new(
            self.clone(),
            Arc::new(StoreReader::new(&state)),
        ));
        let mut dir_tick = tokio::time::interval(DIR_POLL);
        let mut status_tick = tokio::time::interval(STATUS_REFRESH);
        let prefix = format!("/registry/{}/{}/", spec::GROUP, spec::PLURAL);
        loop {
            let after = state.cache().revision();
            let Ok(mut sub) = state.cache().subscribe(&prefix, after) else {
                if state.cache().is_stopped() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            self.sync_objects(&prefix, &mut follower).await;
            loop {
                let next = tokio::select! {
                    event = sub.rx.recv() => Next::Event(event.is_some()),
                    Some(done) = follower.join_next() => Next::Loaded(done),
                    _ = dir_tick.tick() => Next::Dir,
                    _ = status_tick.tick() => Next::Counters,
                };
                match next {
                    Next::Event(false) => break,
                    Next::Event(true) => {
                        // Take whatever else arrived: one relist covers them all.
                        while sub.rx.try_recv().is_ok() {}
                        self.sync_objects(&prefix, &mut follower).await;
                    }
                    Next::Loaded(done) => follower.finish(done).await,
                    Next::Dir => {
                        if let Some(dir) = self.config.dir.clone() {
                            sync_dir(&dir, &mut follower).await;
                        }
                    }
                    Next::Counters => follower.world_mut().refresh().await,
                }
            }
            if !sub.lagged.load(std::sync::atomic::Ordering::Acquire) {
                // The cache closed: the server is stopping.
                return;
            }
        }
    }

    /// Hands the follower the Plugin objects as they are now: each changed one loads,
    /// deleted ones go.
    async fn sync_objects(&self, prefix: &str, follower: &mut Follower<Chains>) {
        let objects = match list_all(self.store.as_ref(), prefix).await {
            Ok(objects) => objects,
            Err(e) => {
                warn!(error = %e, "listing Plugin objects failed");
                return;
            }
        };
        let mut seen = Vec::new();
        for (_, obj) in objects {
            let meta = obj.get("metadata").cloned().unwrap_or_default();
            let name = meta["name"].as_str().unwrap_or_default().to_owned();
            if meta.get("deletionTimestamp").is_some() {
                continue;
            }
            let id = format!("object/{name}");
            seen.push(id.clone());
            let fingerprint = format!("{}/{}", meta["uid"], meta["generation"]);
            let spec = obj.get("spec").cloned().unwrap_or_default();
            follower
                .apply(Change::Applied {
                    name: id,
                    fingerprint,
                    declaration: Declared::Object { name, meta, spec },
                })
                .await;
        }
        let gone: Vec<String> = follower
            .names()
            .filter(|id| id.starts_with("object/") && !seen.iter().any(|s| s == id))
            .map(str::to_owned)
            .collect();
        for name in gone {
            follower.apply(Change::Deleted { name }).await;
        }
    }

    /// Parses, fetches and loads one declaration.
    async fn load(
        &self,
        name: &str,
        spec: &Value,
        base: Option<&Path>,
        origin: String,
        previous: Option<&Bound>,
        reader: &Arc<dyn ClusterReader>,
    ) -> Result<Arc<Bound>, (&'static str, String)> {
        let parsed = spec::parse(name, spec).map_err(|e| ("InvalidSpec", e))?;
        let module = match (&parsed.module, base) {
            (Some(m), _) => m.clone(),
            (None, Some(dir)) => spec::ModuleDoc {
                url: format!("file://{}", dir.join(format!("{name}.wasm")).display()),
                sha256: None,
            },
            (None, None) => {
                return Err(("InvalidSpec", "spec.module: Required value".into()));
            }
        };
        let modules = self.config.cache_dir.join("modules");
        let _ = tokio::fs::create_dir_all(&modules).await;
        let bytes = source::fetch(&module, &modules, base)
            .await
            .map_err(|e| ("FetchFailed", e))?;
        let host = self.host().await.map_err(|e| ("EngineFailed", e))?;
        let cluster = parsed.cluster_read.then(|| reader.clone());
        let bytes = Arc::new(bytes);
        // After the fetch: a fetch waits on the network, not on a core.
        let _compiling = self
            .compiling
            .acquire()
            .await
            .map_err(|e| ("EngineFailed", format!("waiting to compile: {e}")))?;
        let loaded = match previous {
            Some(previous) => {
                host.reload(&previous.plugin, parsed.spec.clone(), bytes, cluster)
                    .await
            }
            None => host.load(parsed.spec.clone(), bytes, cluster).await,
        };
        let plugin = loaded.map_err(|e| (e.reason.as_str(), e.message))?;
        info!(plugin = %name, kind = %parsed.spec.kind, digest = %plugin.digest(), %origin, "plugin loaded");
        Ok(Arc::new(Bound {
            parsed,
            plugin,
            origin,
        }))
    }
}

/// Hands the follower the plugins directory as it is now: each changed file loads,
/// removed ones go.
async fn sync_dir(dir: &Path, follower: &mut Follower<Chains>) {
    let found = dir::scan(dir).await;
    let names: Vec<String> = found.iter().map(|e| format!("file/{}", e.name)).collect();
    for entry in found {
        follower
            .apply(Change::Applied {
                name: format!("file/{}", entry.name),
                fingerprint: entry.fingerprint.clone(),
                declaration: Declared::File {
                    entry,
                    dir: dir.to_owned(),
                },
            })
            .await;
    }
    let gone: Vec<String> = follower
        .names()
        .filter(|id| id.starts_with("file/") && !names.iter().any(|n| n == id))
        .map(str::to_owned)
        .collect();
    for name in gone {
        follower.apply(Change::Deleted { name }).await;
    }
}

async fn list_all(store: &dyn Store, prefix: &str) -> anyhow::Result<Vec<(String, Object)>> {
    let mut out = Vec::new();
    let mut request = ListRequest::prefix(prefix);
    loop {
        let page = store.list(request.clone()).await?;
        for kv in &page.kvs {
            if let Ok(obj) = serde_json::from_slice::<Object>(&kv.value) {
                out.push((kv.key.clone(), obj));
            }
        }
        match (page.more, page.kvs.last()) {
            (true, Some(last)) => {
                request.start_after = Some(last.key.clone());
                request.revision = Some(page.revision);
            }
            _ => return Ok(out),
        }
    }
}
