//! Controllers declared as `Plugin` objects of kind `controller`: the controller
//! manager follows them as the API server follows admission plugins.
//!
//! A Plugin names its module (`file://`, `https://` with its digest, `oci://`), its
//! configuration, deadline and memory cap, and in `spec.controller` the resource it
//! reconciles (`for`), what it owns, its workers and resync period, and the RBAC rules
//! its writes are held to (the API server grants them to its ServiceAccount
//! `kube-system/NAME`). Each generation is loaded beside the running one and replaces
//! it only once it loaded and accepted its configuration: a version that fails leaves
//! the last good one running, and the Plugin's `Loaded` condition says why. The old
//! version stops before the new one runs, and the new one starts from the informers'
//! full contents, so no key is lost in the swap and no key is reconciled by both.
//! A Plugin named after a built-in controller (`replicaset`, or its ServiceAccount
//! `replicaset-controller`) replaces it by the same rule, the built-in being the
//! version before its first: the built-in keeps running until the Plugin has loaded,
//! and runs again as soon as the Plugin is deleted.
//!
//! The built-ins have Plugin objects too, which the API server creates so that
//! `kubectl get plugins` lists them: named after their ServiceAccount, labelled
//! `trellis.dev/builtin`, with the module `builtin:NAME`. Such an entry is not loaded:
//! the controller manager reports in its status whether the built-in runs here (or
//! was left out by `--controllers`, or is replaced) and its counters. Any other
//! Plugin may name a `builtin:` module, to run a bundled controller again under its
//! own name and rules.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use trellis_api::Shutdown;

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::runtime::watcher;
use serde_json::{Value, json};
use tracing::{info, warn};
use trellis_client::events::EventRecorder;
use trellis_client::informer::Informer;
use trellis_controllers::bundled::Builtin;
use trellis_controllers::{ControllerConfig, Loaded, Manager, Running};
use trellis_plugin_host::{GroupVersionResource, PluginKind};
use trellis_plugins::follow::{Failure, Follower, World};
use trellis_plugins::object::plugins_resource;
use trellis_plugins::{object, source, spec};

use crate::setup::{ControllerSetup, Shared, builtin_configuration, host_name, start_builtin};

/// The field manager of the statuses written here.
const MANAGER: &str = "trellis-controller-manager";

/// A built-in controller this controller manager was asked to run (`--controllers`),
/// running unless a Plugin runs in its place, or it could not start.
struct Slot {
    builtin: &'static Builtin,
    running: Option<Running>,
}

/// A plugin's calls, failed reconciles (`denials`: it returned an error), failures
/// in the plugin (traps, deadlines, memory) and timeouts.
fn counters(running: &Running) -> [u64; 4] {
    use std::sync::atomic::Ordering::Relaxed;
    let m = &running.plugin.metrics;
    [
        m.calls.load(Relaxed),
        m.denials.load(Relaxed),
        m.errors.load(Relaxed),
        m.timeouts.load(Relaxed),
    ]
}

/// Whether a Plugin object is the entry of a built-in (see the module's docs).
fn is_entry(obj: &DynamicObject) -> bool {
    spec::is_builtin_entry(
        &serde_json::to_value(&obj.metadata).unwrap_or_default(),
        &obj.data["spec"],
    )
}

fn gvr(r: &spec::ResourceRef) -> GroupVersionResource {
    GroupVersionResource {
        group: r.group.clone(),
        version: r.version.clone(),
        resource: r.resource.clone(),
    }
}

/// The built-ins a Plugin of this name replaces.
pub(crate) fn replaced_by(name: &str, builtin_name: &str, identity: &str) -> bool {
    name == builtin_name || name == identity
}

/// The slot of the built-in a Plugin named `name` replaces, if it is one of ours.
fn slot_of(slots: &[Slot], name: &str) -> Option<usize> {
    slots
        .iter()
        .position(|s| replaced_by(name, s.builtin.name, s.builtin.identity))
}

/// The Plugin running in the place of the built-in of `slot`, if one does.
fn replacer<'a>(slot: &Slot, running: &'a HashMap<String, Running>) -> Option<&'a str> {
    running
        .keys()
        .find(|n| replaced_by(n, slot.builtin.name, slot.builtin.identity))
        .map(String::as_str)
}

/// The controller manager's world of Plugin objects: those of kind `controller`, and
/// the built-ins' entries, whose status it keeps (see the module's docs).
struct ControllerPlugins {
    setup: ControllerSetup,
    manager: Manager,
    client: kube::Client,
    /// The Plugin objects, as the entries' statuses are written from.
    informer: Arc<Informer<DynamicObject>>,
    stopped: Shutdown,
    slots: Vec<Slot>,
    /// The controller Plugins running, by name.
    running: HashMap<String, Running>,
    /// The built-ins' entries followed.
    entries: HashSet<String>,
    /// The counters last written to each status.
    reported: HashMap<String, [u64; 4]>,
}

impl ControllerPlugins {
    /// What a built-in's entry says: whether the built-in runs here, and if not, why.
    fn entry_status(&self, name: &str) -> Result<String, Failure> {
        let Some(slot) = self.slots.iter().find(|s| s.builtin.identity == name) else {
            return Err((
                "Disabled",
                "not among this controller manager's --controllers".to_owned(),
            ));
        };
        if let Some(running) = &slot.running {
            return Ok(running.plugin.digest().to_owned());
        }
        match replacer(slot, &self.running) {
            Some(n) => Err(("Replaced", format!("the Plugin {n} runs in its place"))),
            None if builtin_configuration(&self.setup, slot.builtin).is_none() => Err((
                "Disabled",
                "it needs the cluster CA, which this controller manager does not know".to_owned(),
            )),
            None => Err((
                "LoadFailed",
                "it could not start here; the controller manager's log says why".to_owned(),
            )),
        }
    }

    /// Writes the `Loaded` condition of the entry of the built-in in `slot`, as the
    /// informer holds it, after the built-in stopped or started again.
    async fn write_entry_status(&self, slot: usize) {
        let name = self.slots[slot].builtin.identity;
        // One an administrator took over is theirs, and says how it runs itself.
        if let Some(obj) = self.informer.get(name).filter(|obj| is_entry(obj)) {
            let status = self.entry_status(name);
            object::write_loaded(&self.client, MANAGER, &obj, status, "Builtin").await;
        }
    }

    /// Starts the built-in of `slots[i]` again, a Plugin that ran in its place having
    /// stopped, unless another Plugin of its names still runs there.
    async fn give_back(&mut self, i: usize) {
        let builtin = self.slots[i].builtin;
        if self.slots[i].running.is_some()
            || replacer(&self.slots[i], &self.running).is_some()
            || builtin_configuration(&self.setup, builtin).is_none()
        {
            return;
        }
        match start_builtin(
            &self.setup,
            &self.manager,
            &self.client,
            builtin,
            &self.stopped,
        )
        .await
        {
            Ok(running) => {
                info!(builtin = builtin.name, "the built-in controller runs again");
                self.slots[i].running = Some(running);
            }
            Err(e) => {
                warn!(controller = builtin.name, error = %format!("{e:#}"), "the built-in controller cannot start again");
            }
        }
    }

    /// Stops every controller running here.
    async fn stop(self) {
        for (_, running) in self.running {
            running.stop().await;
        }
        for slot in self.slots {
            if let Some(running) = slot.running {
                running.stop().await;
            }
        }
    }
}

impl World for ControllerPlugins {
    type Declaration = DynamicObject;
    type Loaded = Loaded;

    fn takes(&self, _: &str, obj: &DynamicObject) -> bool {
        object::is_kind(obj, "controller") && !is_entry(obj)
    }

    fn load(
        &self,
        _: &str,
        obj: Arc<DynamicObject>,
    ) -> impl Future<Output = Result<Loaded, Failure>> + Send + 'static {
        let setup = self.setup.clone();
        let manager = self.manager.clone();
        let client = self.client.clone();
        let stopped = self.stopped.clone();
        async move { load(&setup, &manager, &client, &obj, &stopped).await }
    }

    async fn install(&mut self, name: &str, _: &DynamicObject, loaded: Loaded) -> String {
        let digest = loaded.plugin().digest().to_owned();
        // What ran in its place stops before it runs, so that two versions of one
        // controller never reconcile at once.
        if let Some(old) = self.running.remove(name) {
            old.stop().await;
        }
        let slot = slot_of(&self.slots, name);
        let stood_down = slot.and_then(|i| self.slots[i].running.take());
        if let Some(builtin) = stood_down {
            info!(plugin = %name, builtin = builtin.plugin.name(), "a Plugin replaces the built-in controller");
            builtin.stop().await;
        }
        self.running.insert(name.to_owned(), loaded.run());
        info!(plugin = %name, %digest, "controller plugin running");
        if let Some(i) = slot {
            self.write_entry_status(i).await;
        }
        digest
    }

    async fn remove(&mut self, name: &str) {
        self.entries.remove(name);
        self.reported.remove(name);
        let Some(running) = self.running.remove(name) else {
            return;
        };
        running.stop().await;
        info!(plugin = %name, "controller plugin stopped");
        if let Some(i) = slot_of(&self.slots, name) {
            self.give_back(i).await;
            self.write_entry_status(i).await;
        }
    }

    async fn declined(&mut self, name: &str, obj: &DynamicObject) {
        if !(object::is_kind(obj, "controller") && is_entry(obj)) {
            return;
        }
        // An entry that was a Plugin of its own before (an administrator's, given
        // back) was stopped by `remove`: the built-in's own run is what it stands for.
        self.entries.insert(name.to_owned());
        let result = self.entry_status(name);
        object::write_loaded(&self.client, MANAGER, obj, result, "Builtin").await;
    }

    fn keeps(&self, name: &str) -> Option<String> {
        let builtin = slot_of(&self.slots, name).and_then(|i| self.slots[i].running.as_ref());
        match (self.running.get(name), builtin) {
            (Some(r), _) => Some(format!(
                "the last good version ({}) keeps running",
                r.plugin.digest()
            )),
            (None, Some(builtin)) => Some(format!(
                "the built-in controller {} keeps running",
                builtin.plugin.name()
            )),
            (None, None) => None,
        }
    }

    async fn report(&mut self, name: &str, obj: &DynamicObject, result: Result<String, Failure>) {
        // A Plugin of its own now, whatever it was before.
        self.entries.remove(name);
        object::write_loaded(&self.client, MANAGER, obj, result, "Loaded").await;
    }

    /// Copies each running plugin's counters into its Plugin's status when they
    /// changed, as the API server does for admission plugins: how a controller whose
    /// writes are refused shows it (`denials` counts reconciles that returned an error).
    async fn refresh(&mut self) {
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &plugins_resource());
        let params = PatchParams {
            field_manager: Some(MANAGER.into()),
            ..PatchParams::default()
        };
        let names = self.running.keys().chain(self.entries.iter());
        for name in names {
            let running = match self.running.get(name) {
                Some(running) => running,
                None => match self
                    .slots
                    .iter()
                    .find(|s| s.builtin.identity == name)
                    .and_then(|s| s.running.as_ref())
                {
                    Some(running) => running,
                    None => continue,
                },
            };
            let now = counters(running);
            if self.reported.get(name) == Some(&now) {
                continue;
            }
            let [calls, denials, errors, timeouts] = now;
            let patch = json!({"status": {"calls": calls, "denials": denials, "errors": errors, "timeouts": timeouts}});
            match api.patch_status(name, &params, &Patch::Merge(patch)).await {
                Ok(_) => {
                    self.reported.insert(name.clone(), now);
                }
                Err(e) => {
                    warn!(plugin = %name, error = %e, "writing the controller plugin's counters failed")
                }
            }
        }
    }
}

/// Follows the Plugin objects until `stopped`; `builtins` are the built-ins running.
/// A Plugin named after one of them runs in its place once it loaded (until then,
/// and whenever it cannot load, the built-in or the Plugin's last good version
/// keeps running, as for any other Plugin), and deleting it starts the built-in
/// again.
pub(crate) async fn follow(
    setup: ControllerSetup,
    manager: Manager,
    client: kube::Client,
    shared: Shared,
    builtins: Vec<Running>,
    stopped: Shutdown,
) {
    let informer = shared.informers.informer::<DynamicObject>(
        Api::all_with(client.clone(), &plugins_resource()),
        watcher::Config::default(),
    );
    let mut slots: Vec<Slot> = setup
        .builtins
        .iter()
        .map(|builtin| Slot {
            builtin,
            running: None,
        })
        .collect();
    for running in builtins {
        match slots
            .iter_mut()
            .find(|s| s.builtin.identity == running.plugin.name())
        {
            Some(slot) => slot.running = Some(running),
            None => running.stop().await,
        }
    }
    let refresh = setup.plugin_status_interval;
    let world = ControllerPlugins {
        setup,
        manager,
        client,
        informer: informer.clone(),
        stopped: stopped.clone(),
        slots,
        running: HashMap::new(),
        entries: HashSet::new(),
        reported: HashMap::new(),
    };
    let world =
        crate::plugins::follow_informer(Follower::new(world), &informer, stopped, Some(refresh))
            .await;
    world.stop().await;
}

/// Parses, fetches and loads one controller Plugin, ready to run.
async fn load(
    setup: &ControllerSetup,
    manager: &Manager,
    client: &kube::Client,
    obj: &DynamicObject,
    stopped: &Shutdown,
) -> Result<Loaded, (&'static str, String)> {
    let name = obj.metadata.name.clone().unwrap_or_default();
    let parsed = spec::parse(&name, &obj.data["spec"]).map_err(|e| ("InvalidSpec", e))?;
    let controller = parsed
        .controller
        .clone()
        .ok_or(("InvalidSpec", "spec.controller: Required value".to_owned()))?;
    let module = parsed
        .module
        .clone()
        .ok_or(("InvalidSpec", "spec.module: Required value".to_owned()))?;
    let bundled = match module.url.strip_prefix(spec::BUILTIN_SCHEME) {
        Some(builtin) => Some(
            trellis_controllers::bundled::BUILTINS
                .iter()
                .find(|b| b.name == builtin)
                .ok_or_else(|| {
                    let known: Vec<&str> = trellis_controllers::bundled::BUILTINS
                        .iter()
                        .map(|b| b.name)
                        .collect();
                    (
                        "FetchFailed",
                        format!("spec.module.url: Unsupported value: {:?}: bundled controllers: {known:?}", module.url),
                    )
                })?,
        ),
        None => None,
    };
    let wasm = match bundled {
        Some(builtin) => builtin.wasm.to_vec(),
        None => {
            let _ = tokio::fs::create_dir_all(&setup.modules_dir).await;
            source::fetch(&module, &setup.modules_dir, None)
                .await
                .map_err(|e| ("FetchFailed", e))?
        }
    };
    let mut config =
        ControllerConfig::new(&name, std::sync::Arc::new(wasm), gvr(&controller.primary));
    config.spec = parsed.spec.clone();
    // A bundled controller takes the configuration it runs with as a built-in unless
    // the Plugin gives one.
    if let Some(builtin) = bundled
        && obj.data["spec"].get("configuration").is_none()
    {
        config.spec.configuration = builtin_configuration(setup, builtin).ok_or((
            "LoadFailed",
            "it needs the cluster CA, and none is known".to_owned(),
        ))?;
    }
    config.spec.kind = PluginKind::Controller;
    config.owns = controller.owns.iter().map(gvr).collect();
    config.watches = controller
        .watches
        .iter()
        .map(|w| {
            Ok(trellis_controllers::Watch {
                resource: GroupVersionResource {
                    group: w.group.clone(),
                    version: w.version.clone(),
                    resource: w.resource.clone(),
                },
                map: w.map.parse()?,
            })
        })
        .collect::<Result<_, String>>()
        .map_err(|e| ("InvalidSpec", format!("spec.controller.watches: {e}")))?;
    config.workers = controller.workers;
    config.resync = (controller.resync_seconds > 0)
        .then(|| std::time::Duration::from_secs(controller.resync_seconds));
    let writer = setup
        .credentials
        .client(client, &name, stopped.clone())
        .await
        .map_err(|e| ("CredentialsFailed", format!("{e:#}")))?;
    let events = EventRecorder::new(writer.clone(), &name, &host_name());
    manager
        .load(config, writer, events, stopped.clone())
        .await
        .map_err(|e| ("LoadFailed", format!("{e:#}")))
}

/// The Plugin objects that stand for the bundled controllers, which the API server
/// creates (see the module's docs).
pub fn builtin_entries() -> Vec<Value> {
    let resource = |(group, version, resource): (&str, &str, &str)| json!({"group": group, "version": version, "resource": resource});
    trellis_controllers::bundled::BUILTINS
        .iter()
        .map(|b| {
            let config = b.config();
            let watches: Vec<Value> = b
                .watches
                .iter()
                .map(|(r, map)| {
                    let mut w = resource(*r);
                    w["map"] = json!(map.as_str());
                    w
                })
                .collect();
            let mut controller = json!({
                "for": resource(b.primary),
                "owns": b.owns.iter().copied().map(resource).collect::<Vec<_>>(),
                "watches": watches,
                "workers": config.workers,
            });
            if let Some(resync) = config.resync {
                controller["resyncSeconds"] = json!(resync.as_secs());
            }
            json!({
                "apiVersion": format!("{}/{}", spec::GROUP, spec::VERSION),
                "kind": "Plugin",
                "metadata": {"name": b.identity, "labels": {spec::BUILTIN_LABEL: "true"}},
                "spec": {
                    "kind": "controller",
                    "module": {"url": format!("{}{}", spec::BUILTIN_SCHEME, b.name)},
                    "controller": controller,
                },
            })
        })
        .collect()
}
