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

mod glue;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::{OnceCell, Semaphore};
use tracing::{info, warn};
use trellis_plugin_host::{ClusterReader, HostConfig, Plugin, PluginHost, PluginKind, Tier};
use trellis_plugins::follow::{Change, Failure, Finished, Follower, World};
use trellis_plugins::{dir, source, spec};
use trellis_store::{ListRequest, Store};

pub use crate::admission::Cluster;
pub use glue::{PluginAdmission, PluginInitializers, StoreReader};
use spec::{FailurePolicy, Parsed};

use crate::object::{Object, now_timestamp};

/// The field manager of the statuses the plugin host writes.
const MANAGER: &str = "trellis-plugin-host";

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

/// The API server's world: admission and initializer plugins, keyed `object/NAME`
/// (Plugin objects) and `file/NAME` (the plugins directory).
struct Chains {
    manager: Arc<PluginManager>,
    reader: Arc<dyn ClusterReader>,
    /// The version each declaration serves.
    serving: HashMap<String, Arc<Bound>>,
    /// Counters and tier last written to each object's status.
    reported: HashMap<String, ([u64; 4], Tier)>,
}

impl Chains {
    /// Swaps in the serving set: in-flight calls finish on the plugins they started
    /// with, new requests see the new set.
    fn publish(&self) {
        let mut plugins: Vec<Arc<Bound>> = self.serving.values().cloned().collect();
        plugins.sort_by(|a, b| {
            (a.parsed.order, a.plugin.name(), &a.origin).cmp(&(
                b.parsed.order,
                b.plugin.name(),
                &b.origin,
            ))
        });
        *self
            .manager
            .active
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Arc::new(Active { plugins });
    }
}

impl World for Chains {
    type Declaration = Declared;
    type Loaded = Arc<Bound>;

    fn takes(&self, _: &str, declared: &Declared) -> bool {
        match declared {
            // The scheduler and the controller manager run these.
            Declared::Object { spec, .. } => !spec["kind"].as_str().is_some_and(|k| {
                k.eq_ignore_ascii_case("scheduler") || k.eq_ignore_ascii_case("controller")
            }),
            Declared::File { .. } => true,
        }
    }

    async fn declined(&mut self, _: &str, declared: &Declared) {
        if let Declared::Object { name, meta, spec } = declared
            && spec["kind"]
                .as_str()
                .is_some_and(|k| k.eq_ignore_ascii_case("controller"))
        {
            // The controller manager runs it; the server grants it its rules.
            self.manager.grant_controller(name, meta, spec).await;
        }
    }

    fn load(
        &self,
        id: &str,
        declared: Arc<Declared>,
    ) -> impl Future<Output = Result<Arc<Bound>, Failure>> + Send + 'static {
        let previous = self.serving.get(id).cloned();
        let manager = self.manager.clone();
        let reader = self.reader.clone();
        async move {
            let previous = previous.as_deref();
            match &*declared {
                Declared::Object { name, spec, .. } => {
                    let origin = format!("Plugin {name}");
                    manager
                        .load(name, spec, None, origin, previous, &reader)
                        .await
                }
                Declared::File { entry, dir } => match dir::read_spec(entry).await {
                    Ok(spec) => {
                        let origin = format!("file {}", entry.spec_path.display());
                        manager
                            .load(&entry.name, &spec, Some(dir), origin, previous, &reader)
                            .await
                    }
                    Err(e) => Err(("InvalidSpec", e)),
                },
            }
        }
    }

    async fn install(&mut self, id: &str, declared: &Declared, bound: Arc<Bound>) -> String {
        let digest = bound.plugin.digest().to_owned();
        if let Declared::File { entry, .. } = declared {
            info!(plugin = %entry.name, %digest, "plugin loaded from the plugins directory");
        }
        self.serving.insert(id.to_owned(), bound);
        // Serving before the status says so: a client that sees `Loaded` for this
        // generation gets the new version.
        self.publish();
        digest
    }

    async fn remove(&mut self, id: &str) {
        self.reported.remove(id);
        if self.serving.remove(id).is_some() {
            self.publish();
        }
        match id.split_once('/') {
            Some(("file", name)) => info!(plugin = %name, "plugin file removed"),
            Some((_, name)) => info!(plugin = %name, "plugin removed"),
            None => {}
        }
    }

    fn keeps(&self, id: &str) -> Option<String> {
        self.serving.get(id).map(|b| {
            format!(
                "the last good version ({}) keeps serving",
                b.plugin.digest()
            )
        })
    }

    async fn report(&mut self, id: &str, declared: &Declared, result: Result<String, Failure>) {
        // A file's outcome is in the log (the follower's, and `install`'s).
        let Declared::Object { meta, .. } = declared else {
            return;
        };
        let serving = self.serving.get(id).cloned();
        match &serving {
            Some(bound) => {
                self.reported.insert(id.to_owned(), counters(&bound.plugin));
            }
            None => {
                self.reported.remove(id);
            }
        }
        write_status(
            self.manager.cluster(),
            meta,
            result.map(|_| ()),
            serving.as_deref(),
        )
        .await;
    }

    /// Copies changed call counters into the Plugin objects' statuses.
    async fn refresh(&mut self) {
        for (id, serving) in &self.serving {
            let Some(name) = id.strip_prefix("object/") else {
                continue;
            };
            let now = counters(&serving.plugin);
            if self.reported.get(id) == Some(&now) {
                continue;
            }
            self.reported.insert(id.clone(), now);
            let _ = update_status(self.manager.cluster(), name, None, |status| {
                set_counters(status, &serving.plugin);
            })
            .await;
        }
    }
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
        let mut follower = Follower::new(Chains {
            manager: self.clone(),
            reader: Arc::new(StoreReader::new(&state)),
            serving: HashMap::new(),
            reported: HashMap::new(),
        });
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

    /// Grants a controller plugin the RBAC rules its spec declares: a ClusterRole
    /// `trellis:controller:NAME` bound to its ServiceAccount `kube-system/NAME`, both
    /// owned by the Plugin (the garbage collector removes them with it). Written by
    /// the server itself: whoever may create Plugin objects may grant this much.
    async fn grant_controller(&self, name: &str, meta: &Value, spec: &Value) {
        let parsed = match spec::parse(name, spec) {
            Ok(parsed) => parsed,
            Err(e) => {
                warn!(plugin = %name, "controller plugin not granted its rules: {e}");
                return;
            }
        };
        let Some(controller) = parsed.controller else {
            return;
        };
        // A bundled controller's entry: its bootstrap role grants what it needs.
        if spec::is_builtin_entry(meta, spec) {
            return;
        }
        let role = format!("trellis:controller:{name}");
        let owner = json!([{
            "apiVersion": format!("{}/{}", spec::GROUP, spec::VERSION),
            "kind": "Plugin",
            "name": name,
            "uid": meta["uid"],
        }]);
        // It records events, as every controller does.
        let mut rules = controller.rules.clone();
        rules.push(json!({"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch", "update"]}));
        let objects = [
            (
                format!("{}clusterroles/{role}", crate::authorization::rbac::RBAC),
                json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                       "metadata": {"name": role, "labels": {"trellis.dev/plugin": name}, "ownerReferences": owner},
                       "rules": rules}),
            ),
            (
                format!(
                    "{}clusterrolebindings/{role}",
                    crate::authorization::rbac::RBAC
                ),
                json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                       "metadata": {"name": role, "labels": {"trellis.dev/plugin": name}, "ownerReferences": owner},
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                       "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": "kube-system"}]}),
            ),
        ];
        for (key, mut obj) in objects {
            let result = match self.store.get(&key).await {
                Ok(Some(kv)) => {
                    let mut stored: Value = serde_json::from_slice(&kv.value).unwrap_or_default();
                    let same = ["rules", "roleRef", "subjects"]
                        .iter()
                        .all(|f| stored.get(*f) == obj.get(*f))
                        && stored["metadata"]["ownerReferences"]
                            == obj["metadata"]["ownerReferences"];
                    if same {
                        continue;
                    }
                    for field in ["rules", "roleRef", "subjects"] {
                        if let Some(v) = obj.get(field) {
                            stored[field] = v.clone();
                        }
                    }
                    stored["metadata"]["ownerReferences"] =
                        obj["metadata"]["ownerReferences"].take();
                    self.store
                        .update(
                            &key,
                            bytes::Bytes::from(stored.to_string()),
                            Some(kv.mod_revision),
                        )
                        .await
                        .map(|_| ())
                }
                Ok(None) => {
                    obj["metadata"]["uid"] = uuid::Uuid::new_v4().to_string().into();
                    obj["metadata"]["creationTimestamp"] = now_timestamp().into();
                    self.store
                        .create(&key, bytes::Bytes::from(obj.to_string()))
                        .await
                        .map(|_| ())
                }
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                warn!(plugin = %name, key, error = %e, "granting a controller plugin its rules failed");
            }
        }
        info!(plugin = %name, role, "controller plugin granted its rules");
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

/// What the periodic status refresh reports: the counters and the code's tier.
fn counters(plugin: &Plugin) -> ([u64; 4], Tier) {
    use std::sync::atomic::Ordering::Relaxed;
    let m = &plugin.metrics;
    (
        [
            m.calls.load(Relaxed),
            m.denials.load(Relaxed),
            m.errors.load(Relaxed),
            m.timeouts.load(Relaxed),
        ],
        plugin.tier(),
    )
}

fn set_counters(status: &mut serde_json::Map<String, Value>, plugin: &Plugin) {
    let ([calls, denials, errors, timeouts], tier) = counters(plugin);
    status.insert("tier".into(), tier.as_str().into());
    status.insert("calls".into(), calls.into());
    status.insert("denials".into(), denials.into());
    status.insert("errors".into(), errors.into());
    status.insert("timeouts".into(), timeouts.into());
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

/// Records a load's outcome in the Plugin's status: the `Loaded` condition, the
/// digest serving and its counters.
async fn write_status(
    cluster: Option<Arc<dyn Cluster>>,
    meta: &Value,
    result: Result<(), (&'static str, String)>,
    serving: Option<&Bound>,
) {
    let generation = meta["generation"].as_i64().unwrap_or(0);
    let (status, reason, message) = match (&result, serving) {
        (Ok(()), Some(bound)) => (
            "True",
            "Loaded".to_owned(),
            format!("serving {}", bound.plugin.digest()),
        ),
        // The message says what keeps serving.
        (Err((reason, message)), _) => ("False", (*reason).to_owned(), message.clone()),
        (Ok(()), None) => ("False", "NotLoaded".to_owned(), String::new()),
    };
    let uid = meta["uid"].as_str().map(str::to_owned);
    let name = meta["name"].as_str().unwrap_or_default();
    let written = update_status(cluster, name, uid.as_deref(), |s| {
        let previous = s
            .get("conditions")
            .and_then(Value::as_array)
            .and_then(|c| c.iter().find(|c| c["type"] == "Loaded"))
            .cloned();
        let since = match &previous {
            Some(p) if p["status"] == status => p["lastTransitionTime"].clone(),
            _ => Value::String(now_timestamp()),
        };
        s.insert(
            "conditions".into(),
            json!([{
                "type": "Loaded",
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": since,
                "observedGeneration": generation,
            }]),
        );
        s.insert("observedGeneration".into(), generation.into());
        match serving {
            Some(bound) => {
                s.insert("digest".into(), bound.plugin.digest().into());
                set_counters(s, &bound.plugin);
            }
            None => {
                s.remove("digest");
            }
        }
    })
    .await;
    if let Err(e) = written {
        warn!(plugin = name, error = %e, "writing a Plugin status failed");
    }
}

/// Writes a Plugin's status through the registry's status path (the server's own
/// write, as a controller's status update).
async fn update_status(
    cluster: Option<Arc<dyn Cluster>>,
    name: &str,
    uid: Option<&str>,
    mut change: impl FnMut(&mut serde_json::Map<String, Value>) + Send,
) -> anyhow::Result<()> {
    let Some(cluster) = cluster else {
        // The server is stopping.
        return Ok(());
    };
    let target = crate::admission::StatusTarget {
        group: spec::GROUP.into(),
        version: spec::VERSION.into(),
        plural: spec::PLURAL.into(),
        namespace: None,
        name: name.to_owned(),
        uid: uid.map(str::to_owned),
        manager: MANAGER,
    };
    cluster
        .write_status(&target, &mut |_, status| {
            change(status);
            Ok(())
        })
        .await
        .map(|_| ())
        .map_err(|e| anyhow::anyhow!(e.message))
}
