//! WASM plugins in the admission and initializer chains.
//!
//! Plugins are declared as `Plugin` objects (`trellis.dev/v1`, served from a CRD the
//! server installs) or as `NAME.yaml` + `NAME.wasm` pairs in the plugins directory.
//! One task follows both: a changed declaration loads beside the running version and
//! replaces it only once it compiled, started and accepted its configuration; a
//! failed load leaves the last good version serving and says why in the Plugin's
//! status (or the log, for files). Each load runs in a task of its own, so a module
//! fetched slowly (an `https://` or `oci://` server that does not answer) delays only
//! its own plugin; a newer declaration of the same plugin stops the load of the older
//! one, whose outcome is never used.
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
use tokio::task::{AbortHandle, JoinSet};
use tracing::{info, warn};
use trellis_plugin_host::{ClusterReader, HostConfig, Plugin, PluginHost, PluginKind, Tier};
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

/// What one declaration last produced.
#[derive(Default)]
struct Tracked {
    /// Changes when the declaration does (uid + generation, or file times and sizes).
    fingerprint: String,
    serving: Option<Arc<Bound>>,
    /// Counters and tier last written to the object's status.
    reported: Option<([u64; 4], Tier)>,
    /// The load of the current fingerprint, while it runs.
    loading: Option<InFlight>,
}

/// A load running in its own task.
struct InFlight {
    /// Matches [`Finished::ticket`] of this load's outcome, and no other's.
    ticket: u64,
    abort: AbortHandle,
}

impl Tracked {
    /// Stops the load in flight, if any: a newer declaration replaces it, or the
    /// declaration is gone.
    fn stop_loading(&mut self) {
        if let Some(load) = self.loading.take() {
            load.abort.abort();
        }
    }
}

/// The loads in flight, each in a task of its own.
#[derive(Default)]
struct Loads {
    tasks: JoinSet<Finished>,
    /// Numbers the loads. A load stopped for a newer one may have finished before it
    /// could be stopped: its outcome, with an older ticket than the declaration's, is
    /// dropped rather than let replace the newer version.
    tickets: u64,
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

/// A load's outcome, and what it loaded.
struct Finished {
    /// The declaration's key in [`PluginManager::run`]'s map.
    id: String,
    ticket: u64,
    declared: Declared,
    outcome: Result<Arc<Bound>, (&'static str, String)>,
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
        let mut tracked: HashMap<String, Tracked> = HashMap::new();
        // Dropped with this task when the server stops, which stops the loads too.
        let mut loads = Loads::default();
        let reader: Arc<dyn ClusterReader> = Arc::new(StoreReader::new(&state));
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
            self.sync_objects(&prefix, &mut tracked, &mut loads, &reader)
                .await;
            loop {
                tokio::select! {
                    event = sub.rx.recv() => {
                        if event.is_none() {
                            break;
                        }
                        // Take whatever else arrived: one relist covers them all.
                        while sub.rx.try_recv().is_ok() {}
                        self.sync_objects(&prefix, &mut tracked, &mut loads, &reader).await;
                    }
                    Some(joined) = loads.tasks.join_next() => match joined {
                        Ok(done) => self.finish(&mut tracked, done).await,
                        // Stopped for a newer declaration, or for none.
                        Err(e) if e.is_cancelled() => {}
                        Err(e) => warn!(error = %e, "a plugin load stopped"),
                    },
                    _ = dir_tick.tick() => {
                        if let Some(dir) = self.config.dir.clone() {
                            self.sync_dir(&dir, &mut tracked, &mut loads, &reader).await;
                        }
                    }
                    _ = status_tick.tick() => self.refresh_counters(&mut tracked).await,
                }
            }
            if !sub.lagged.load(std::sync::atomic::Ordering::Acquire) {
                // The cache closed: the server is stopping.
                return;
            }
        }
    }

    /// Starts loading what changed among the Plugin objects and drops the deleted ones.
    async fn sync_objects(
        self: &Arc<Self>,
        prefix: &str,
        tracked: &mut HashMap<String, Tracked>,
        loads: &mut Loads,
        reader: &Arc<dyn ClusterReader>,
    ) {
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
            let entry = tracked.entry(id.clone()).or_default();
            if entry.fingerprint == fingerprint {
                continue;
            }
            entry.fingerprint = fingerprint;
            let spec = obj.get("spec").cloned().unwrap_or_default();
            // The scheduler runs it.
            if spec["kind"]
                .as_str()
                .is_some_and(|k| k.eq_ignore_ascii_case("scheduler"))
            {
                entry.stop_loading();
                if entry.serving.take().is_some() {
                    self.publish(tracked);
                }
                continue;
            }
            if spec["kind"]
                .as_str()
                .is_some_and(|k| k.eq_ignore_ascii_case("controller"))
            {
                // The controller manager runs it; the server grants it its rules.
                entry.stop_loading();
                if entry.serving.take().is_some() {
                    self.publish(tracked);
                }
                self.grant_controller(&name, &meta, &spec).await;
                continue;
            }
            let declared = Declared::Object { name, meta, spec };
            self.start_load(loads, id, entry, declared, reader);
        }
        let gone: Vec<String> = tracked
            .keys()
            .filter(|id| id.starts_with("object/") && !seen.contains(id))
            .cloned()
            .collect();
        if !gone.is_empty() {
            for id in &gone {
                if let Some(mut entry) = tracked.remove(id) {
                    entry.stop_loading();
                }
                info!(plugin = %id.trim_start_matches("object/"), "plugin removed");
            }
            self.publish(tracked);
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

    /// Starts loading what changed in the plugins directory and drops removed files.
    async fn sync_dir(
        self: &Arc<Self>,
        dir: &Path,
        tracked: &mut HashMap<String, Tracked>,
        loads: &mut Loads,
        reader: &Arc<dyn ClusterReader>,
    ) {
        let found = dir::scan(dir).await;
        let names: Vec<String> = found.iter().map(|e| e.name.clone()).collect();
        for entry in found {
            let id = format!("file/{}", entry.name);
            let slot = tracked.entry(id.clone()).or_default();
            if slot.fingerprint == entry.fingerprint {
                continue;
            }
            slot.fingerprint = entry.fingerprint.clone();
            let declared = Declared::File {
                entry,
                dir: dir.to_owned(),
            };
            self.start_load(loads, id, slot, declared, reader);
        }
        let gone: Vec<String> = tracked
            .keys()
            .filter(|id| {
                id.strip_prefix("file/")
                    .is_some_and(|n| !names.iter().any(|name| name == n))
            })
            .cloned()
            .collect();
        if !gone.is_empty() {
            for id in &gone {
                if let Some(mut entry) = tracked.remove(id) {
                    entry.stop_loading();
                }
                info!(plugin = %id.trim_start_matches("file/"), "plugin file removed");
            }
            self.publish(tracked);
        }
    }

    /// Loads `declared` in a task of its own, beside the version `entry` serves,
    /// stopping the load of an older declaration still in flight.
    fn start_load(
        self: &Arc<Self>,
        loads: &mut Loads,
        id: String,
        entry: &mut Tracked,
        declared: Declared,
        reader: &Arc<dyn ClusterReader>,
    ) {
        entry.stop_loading();
        loads.tickets += 1;
        let ticket = loads.tickets;
        let previous = entry.serving.clone();
        let manager = self.clone();
        let reader = reader.clone();
        let abort = loads.tasks.spawn(async move {
            let previous = previous.as_deref();
            let outcome = match &declared {
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
            };
            Finished {
                id,
                ticket,
                declared,
                outcome,
            }
        });
        entry.loading = Some(InFlight { ticket, abort });
    }

    /// Serves what a load produced and reports it (the Plugin's status, or the log for
    /// a file), unless a newer declaration replaced the one it loaded.
    async fn finish(&self, tracked: &mut HashMap<String, Tracked>, done: Finished) {
        let Some(entry) = tracked.get_mut(&done.id) else {
            // Deleted while it loaded.
            return;
        };
        if entry.loading.as_ref().map(|l| l.ticket) != Some(done.ticket) {
            // Superseded, and finished before it could be stopped.
            return;
        }
        entry.loading = None;
        let previous = entry.serving.clone();
        match done.declared {
            Declared::Object { name, meta, .. } => {
                let (result, serving) = match done.outcome {
                    Ok(bound) => (Ok(()), Some(bound)),
                    Err(failure) => {
                        warn!(plugin = %name, reason = failure.0, "{}", failure.1);
                        (Err(failure), previous)
                    }
                };
                entry.reported = serving.as_ref().map(|b| counters(&b.plugin));
                if result.is_ok() {
                    entry.serving.clone_from(&serving);
                    // Serving before the status says so: a client that sees `Loaded`
                    // for this generation gets the new version.
                    self.publish(tracked);
                }
                write_status(self.cluster(), &meta, result, serving.as_deref()).await;
            }
            Declared::File { entry: file, .. } => match done.outcome {
                Ok(bound) => {
                    info!(plugin = %file.name, digest = %bound.plugin.digest(), "plugin loaded from the plugins directory");
                    entry.serving = Some(bound);
                    self.publish(tracked);
                }
                Err((reason, message)) => {
                    let keeps = previous
                        .as_ref()
                        .map(|b| format!("; {} keeps serving", b.plugin.digest()))
                        .unwrap_or_default();
                    warn!(plugin = %file.name, reason, "{message}{keeps}");
                }
            },
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

    /// Swaps in the serving set: in-flight calls finish on the plugins they started
    /// with, new requests see the new set.
    fn publish(&self, tracked: &HashMap<String, Tracked>) {
        let mut plugins: Vec<Arc<Bound>> =
            tracked.values().filter_map(|t| t.serving.clone()).collect();
        plugins.sort_by(|a, b| {
            (a.parsed.order, a.plugin.name(), &a.origin).cmp(&(
                b.parsed.order,
                b.plugin.name(),
                &b.origin,
            ))
        });
        *self.active.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(Active { plugins });
    }

    /// Copies changed call counters into the Plugin objects' statuses.
    async fn refresh_counters(&self, tracked: &mut HashMap<String, Tracked>) {
        for (id, entry) in tracked.iter_mut() {
            let Some(name) = id.strip_prefix("object/") else {
                continue;
            };
            let Some(serving) = &entry.serving else {
                continue;
            };
            let now = counters(&serving.plugin);
            if entry.reported == Some(now) {
                continue;
            }
            entry.reported = Some(now);
            let _ = update_status(self.cluster(), name, None, |status| {
                set_counters(status, &serving.plugin);
            })
            .await;
        }
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
        (Err((reason, message)), Some(bound)) => (
            "False",
            (*reason).to_owned(),
            format!(
                "{message}; the last good version ({}) keeps serving",
                bound.plugin.digest()
            ),
        ),
        (Err((reason, message)), None) => ("False", (*reason).to_owned(), message.clone()),
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
