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

use std::collections::HashMap;
use std::path::PathBuf;

use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::sync::watch;
use tracing::{info, warn};
use trellis_client::events::EventRecorder;
use trellis_client::informer::{Change, Informer};
use trellis_controllers::bundled::Builtin;
use trellis_controllers::{ControllerConfig, Loaded, Manager, Running};
use trellis_plugin_host::{GroupVersionResource, PluginKind};
use trellis_plugins::{source, spec};

use crate::components::{ControllerSetup, Shared};

/// The field manager of the statuses written here.
const MANAGER: &str = "trellis-controller-manager";

pub fn plugins_resource() -> ApiResource {
    ApiResource {
        group: spec::GROUP.into(),
        version: spec::VERSION.into(),
        api_version: format!("{}/{}", spec::GROUP, spec::VERSION),
        kind: "Plugin".into(),
        plural: spec::PLURAL.into(),
    }
}

/// One controller Plugin as it runs.
#[derive(Default)]
struct Followed {
    /// uid and generation of the declaration last loaded or tried.
    fingerprint: String,
    running: Option<Running>,
    /// The counters last written to its status.
    reported: [u64; 4],
    /// The entry of a built-in: its counters are those of the built-in running.
    entry: bool,
}

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

/// Whether a Plugin object declares a controller.
fn is_controller(obj: &DynamicObject) -> bool {
    obj.data["spec"]["kind"]
        .as_str()
        .is_some_and(|k| k.eq_ignore_ascii_case("controller"))
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
fn replacer<'a>(slot: &Slot, followed: &'a HashMap<String, Followed>) -> Option<&'a str> {
    followed
        .iter()
        .find(|(n, f)| {
            !f.entry
                && f.running.is_some()
                && replaced_by(n, slot.builtin.name, slot.builtin.identity)
        })
        .map(|(n, _)| n.as_str())
}

/// What a built-in's entry says: whether the built-in runs here, and if not, why.
fn entry_status(
    setup: &ControllerSetup,
    slots: &[Slot],
    followed: &HashMap<String, Followed>,
    name: &str,
) -> Result<String, (&'static str, String)> {
    let Some(slot) = slots.iter().find(|s| s.builtin.identity == name) else {
        return Err((
            "Disabled",
            "not among this controller manager's --controllers".to_owned(),
        ));
    };
    if let Some(running) = &slot.running {
        return Ok(running.plugin.digest().to_owned());
    }
    match replacer(slot, followed) {
        Some(n) => Err(("Replaced", format!("the Plugin {n} runs in its place"))),
        None if crate::components::builtin_configuration(setup, slot.builtin).is_none() => Err((
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
async fn write_entry_status(
    setup: &ControllerSetup,
    client: &kube::Client,
    entries: &Informer<DynamicObject>,
    slots: &[Slot],
    followed: &HashMap<String, Followed>,
    slot: usize,
) {
    let name = slots[slot].builtin.identity;
    // One an administrator took over is theirs, and says how it runs itself.
    if let Some(obj) = entries.get(name).filter(|obj| is_entry(obj)) {
        let status = entry_status(setup, slots, followed, name);
        write_status(client, &obj, status, "Builtin").await;
    }
}

/// Starts the built-in of `slots[i]` again, a Plugin that ran in its place having
/// stopped, unless another Plugin of its names still runs there.
async fn give_back(
    setup: &ControllerSetup,
    manager: &Manager,
    client: &kube::Client,
    slots: &mut [Slot],
    followed: &HashMap<String, Followed>,
    i: usize,
    stopped: &watch::Receiver<bool>,
) {
    let builtin = slots[i].builtin;
    if slots[i].running.is_some()
        || replacer(&slots[i], followed).is_some()
        || crate::components::builtin_configuration(setup, builtin).is_none()
    {
        return;
    }
    match crate::components::start_builtin(setup, manager, client, builtin, stopped).await {
        Ok(running) => {
            info!(builtin = builtin.name, "the built-in controller runs again");
            slots[i].running = Some(running);
        }
        Err(e) => {
            warn!(controller = builtin.name, error = %format!("{e:#}"), "the built-in controller cannot start again");
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
    mut stopped: watch::Receiver<bool>,
) {
    let informer = shared.informers.informer::<DynamicObject>(
        Api::all_with(client.clone(), &plugins_resource()),
        watcher::Config::default(),
    );
    let mut changes = informer.subscribe();
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
    let mut followed: HashMap<String, Followed> = HashMap::new();
    let mut status_tick = tokio::time::interval(setup.plugin_status_interval);
    status_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let change = tokio::select! {
            change = changes.recv() => Some(change),
            _ = status_tick.tick() => None,
            _ = stopped.wait_for(|s| *s) => break,
        };
        let Some(change) = change else {
            report_counters(&client, &mut followed, &slots).await;
            continue;
        };
        let Some(change) = change else { break };
        let obj = change.object().clone();
        let name = obj.metadata.name.clone().unwrap_or_default();
        let gone = matches!(change, Change::Deleted(_))
            || obj.metadata.deletion_timestamp.is_some()
            || !is_controller(&obj);
        if gone {
            let Some(running) = followed.remove(&name).and_then(|f| f.running) else {
                continue;
            };
            running.stop().await;
            info!(plugin = %name, "controller plugin stopped");
            if let Some(i) = slot_of(&slots, &name) {
                give_back(
                    &setup, &manager, &client, &mut slots, &followed, i, &stopped,
                )
                .await;
                write_entry_status(&setup, &client, &informer, &slots, &followed, i).await;
            }
            continue;
        }
        let fingerprint = format!(
            "{}/{}",
            obj.metadata.uid.as_deref().unwrap_or_default(),
            obj.metadata.generation.unwrap_or_default()
        );
        if followed
            .get(&name)
            .is_some_and(|f| f.fingerprint == fingerprint)
        {
            continue;
        }
        let entry = is_entry(&obj);
        if entry {
            let f = record(&mut followed, &name, fingerprint, true);
            // An entry that was a Plugin of its own before (an administrator's, given
            // back) runs no more: the built-in's own run is what it stands for.
            if let Some(running) = f.running.take() {
                running.stop().await;
                if let Some(i) = slot_of(&slots, &name) {
                    give_back(
                        &setup, &manager, &client, &mut slots, &followed, i, &stopped,
                    )
                    .await;
                }
            }
            let result = entry_status(&setup, &slots, &followed, &name);
            write_status(&client, &obj, result, "Builtin").await;
            continue;
        }
        let slot = slot_of(&slots, &name);
        let outcome = load(&setup, &manager, &client, &obj, &stopped).await;
        let f = record(&mut followed, &name, fingerprint, false);
        let result = match outcome {
            Ok(loaded) => {
                let digest = loaded.plugin().digest().to_owned();
                // What ran in its place stops before it runs, so that two versions
                // of one controller never reconcile at once.
                if let Some(old) = f.running.take() {
                    old.stop().await;
                }
                let stood_down = slot.and_then(|i| slots[i].running.take());
                if let Some(builtin) = stood_down {
                    info!(plugin = %name, builtin = builtin.plugin.name(), "a Plugin replaces the built-in controller");
                    builtin.stop().await;
                }
                f.running = Some(loaded.run());
                info!(plugin = %name, %digest, "controller plugin running");
                if let Some(i) = slot {
                    write_entry_status(&setup, &client, &informer, &slots, &followed, i).await;
                }
                Ok(digest)
            }
            Err((reason, message)) => {
                let keeps = match (&f.running, slot.and_then(|i| slots[i].running.as_ref())) {
                    (Some(r), _) => format!(
                        "; the last good version ({}) keeps running",
                        r.plugin.digest()
                    ),
                    (None, Some(builtin)) => format!(
                        "; the built-in controller {} keeps running",
                        builtin.plugin.name()
                    ),
                    (None, None) => String::new(),
                };
                warn!(plugin = %name, reason, "{message}{keeps}");
                Err((reason, format!("{message}{keeps}")))
            }
        };
        write_status(&client, &obj, result, "Loaded").await;
    }
    for (_, f) in followed {
        if let Some(running) = f.running {
            running.stop().await;
        }
    }
    for slot in slots {
        if let Some(running) = slot.running {
            running.stop().await;
        }
    }
}

/// The record of the Plugin `name`, made if new, with the declaration now followed.
fn record<'a>(
    followed: &'a mut HashMap<String, Followed>,
    name: &str,
    fingerprint: String,
    entry: bool,
) -> &'a mut Followed {
    let f = followed.entry(name.to_owned()).or_default();
    f.fingerprint = fingerprint;
    f.entry = entry;
    f
}

/// Parses, fetches and loads one controller Plugin, ready to run.
async fn load(
    setup: &ControllerSetup,
    manager: &Manager,
    client: &kube::Client,
    obj: &DynamicObject,
    stopped: &watch::Receiver<bool>,
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
        config.spec.configuration = crate::components::builtin_configuration(setup, builtin)
            .ok_or((
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
    let events = EventRecorder::new(writer.clone(), &name, &crate::components::host_name());
    manager
        .load(config, writer, events, stopped.clone())
        .await
        .map_err(|e| ("LoadFailed", format!("{e:#}")))
}

/// Writes the Plugin's `Loaded` condition (and digest) through its status.
/// `loaded` is the reason when it runs.
pub(crate) async fn write_status(
    client: &kube::Client,
    obj: &DynamicObject,
    result: Result<String, (&'static str, String)>,
    loaded: &'static str,
) {
    let name = obj.metadata.name.clone().unwrap_or_default();
    let previous = obj.data["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Loaded"))
        .cloned()
        .unwrap_or(Value::Null);
    let (status, reason, message, digest) = match &result {
        Ok(digest) => (
            "True",
            loaded,
            format!("running {digest}"),
            Some(digest.clone()),
        ),
        Err((reason, message)) => ("False", *reason, message.clone(), None),
    };
    let since = if previous["status"] == status {
        previous["lastTransitionTime"].clone()
    } else {
        json!(trellis_apiserver::object::now_timestamp())
    };
    let mut patch = json!({"status": {
        "observedGeneration": obj.metadata.generation,
        "conditions": [{
            "type": "Loaded",
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since,
            "observedGeneration": obj.metadata.generation,
        }],
    }});
    if let Some(digest) = digest {
        patch["status"]["digest"] = json!(digest);
    }
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &plugins_resource());
    let params = PatchParams {
        field_manager: Some(MANAGER.into()),
        ..PatchParams::default()
    };
    if let Err(e) = api.patch_status(&name, &params, &Patch::Merge(patch)).await {
        warn!(plugin = %name, error = %e, "writing the controller plugin's status failed");
    }
}

/// Copies each running plugin's counters into its Plugin's status when they changed,
/// as the API server does for admission plugins: how a controller whose writes are
/// refused shows it (`denials` counts reconciles that returned an error).
async fn report_counters(
    client: &kube::Client,
    followed: &mut HashMap<String, Followed>,
    slots: &[Slot],
) {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &plugins_resource());
    let params = PatchParams {
        field_manager: Some(MANAGER.into()),
        ..PatchParams::default()
    };
    for (name, f) in followed.iter_mut() {
        let running = match &f.running {
            Some(running) => running,
            None if f.entry => match slots
                .iter()
                .find(|s| s.builtin.identity == name)
                .and_then(|s| s.running.as_ref())
            {
                Some(running) => running,
                None => continue,
            },
            None => continue,
        };
        let now = counters(running);
        if now == f.reported {
            continue;
        }
        let [calls, denials, errors, timeouts] = now;
        let patch = json!({"status": {"calls": calls, "denials": denials, "errors": errors, "timeouts": timeouts}});
        match api.patch_status(name, &params, &Patch::Merge(patch)).await {
            Ok(_) => f.reported = now,
            Err(e) => {
                warn!(plugin = %name, error = %e, "writing the controller plugin's counters failed")
            }
        }
    }
}

/// Where fetched modules are kept: the plugin cache's `modules`, or a directory of
/// the process's own.
pub fn modules_dir(cache: Option<&std::path::Path>) -> PathBuf {
    match cache {
        Some(dir) => dir.join("modules"),
        None => std::env::temp_dir().join(format!("trellis-modules-{}", std::process::id())),
    }
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
