//! The scheduler's work while this process leads: the framework of
//! `trellis-scheduler` with the default plugins (one WASM component bundled in the
//! binary) as the `default-scheduler` profile, joined by the Plugin objects of kind
//! `scheduler` as they come and go.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use trellis_api::Shutdown;

use kube::api::{Api, DynamicObject};
use tracing::info;
use trellis_client::events::EventRecorder;
use trellis_plugin_host::{Plugin, PluginKind, PluginSpec};
use trellis_plugins::follow::{Failure, Follower, World};
use trellis_plugins::{object, source, spec};
use trellis_scheduler::{Component as PluginComponent, QueueSettings, SchedulerConfig};

use crate::setup::{SchedulerSetup, Shared};

/// The field manager of the statuses written here (the controller manager's, as
/// these statuses always were).
const MANAGER: &str = "trellis-controller-manager";

/// The default plugins' deadline per call: a Filter or Score of thousands of nodes
/// takes milliseconds; a plugin stuck in a loop is stopped after this.
const CALL_DEADLINE: Duration = Duration::from_secs(2);
/// Their memory cap: a view of 5,000 nodes and 10,000 pods fits well within it.
const MEMORY_LIMIT: usize = 512 << 20;

/// The scheduler's work while this process leads: until `stopped`.
pub(crate) async fn work(
    setup: SchedulerSetup,
    client: kube::Client,
    shared: Shared,
    stopped: Shutdown,
) -> anyhow::Result<()> {
    let mut spec = PluginSpec::new("default-plugins", PluginKind::Scheduler);
    spec.timeout = CALL_DEADLINE;
    spec.memory_limit = MEMORY_LIMIT;
    let plugin = setup
        .plugins
        .load(
            spec,
            Arc::new(trellis_scheduler::DEFAULT_PLUGINS.to_vec()),
            None,
        )
        .await
        .map_err(|e| anyhow::anyhow!("load the default scheduler plugins: {e}"))?;
    info!(digest = plugin.digest(), "default scheduler plugins loaded");
    let defaults = vec![PluginComponent {
        plugin,
        configuration: "{}".into(),
        weights: Default::default(),
        ignore_failures: false,
    }];
    let config = SchedulerConfig {
        profiles: vec![(
            trellis_scheduler::DEFAULT_SCHEDULER.to_owned(),
            defaults.clone(),
        )],
        defaults,
        percentage_of_nodes_to_score: setup.flags.percentage_of_nodes_to_score,
        queue: QueueSettings {
            initial_backoff: setup.flags.pod_initial_backoff,
            max_backoff: setup.flags.pod_max_backoff,
            unschedulable_timeout: setup.flags.pod_unschedulable_timeout,
        },
    };
    let events = EventRecorder::new(
        client.clone(),
        trellis_scheduler::DEFAULT_SCHEDULER,
        &crate::setup::host_name(),
    );
    let (updates, updated) = tokio::sync::mpsc::unbounded_channel();
    let following = tokio::spawn(follow_plugins(
        setup.clone(),
        client.clone(),
        shared.clone(),
        updates,
        stopped.clone(),
    ));
    let parts = trellis_scheduler::Parts {
        host: setup.plugins.clone(),
        client,
        informers: shared.informers.clone(),
        events,
        metrics: setup.metrics.clone(),
    };
    let result = trellis_scheduler::run(config, parts, updated, stopped).await;
    following.abort();
    result
}

/// The scheduler's world of Plugin objects: those of kind `scheduler`. Each is loaded
/// (its module fetched, its configuration checked by its `plugins` call) and joins its
/// profile; a new generation replaces it once it loaded, one that fails leaves the last
/// good version in place, and a deleted Plugin leaves the profile. The `Loaded`
/// condition says which.
struct SchedulerPlugins {
    setup: SchedulerSetup,
    client: kube::Client,
    updates: tokio::sync::mpsc::UnboundedSender<trellis_scheduler::Update>,
    modules_dir: PathBuf,
    /// The plugins joined, by name.
    joined: HashMap<String, Arc<Plugin>>,
}

/// A scheduler plugin loaded, and where it joins.
struct Joining {
    plugin: Arc<Plugin>,
    profile: String,
    component: PluginComponent,
}

impl World for SchedulerPlugins {
    type Declaration = DynamicObject;
    type Loaded = Joining;

    fn takes(&self, _: &str, obj: &DynamicObject) -> bool {
        object::is_kind(obj, "scheduler")
    }

    fn load(
        &self,
        name: &str,
        obj: Arc<DynamicObject>,
    ) -> impl Future<Output = Result<Joining, Failure>> + Send + 'static {
        let name = name.to_owned();
        let host = self.setup.plugins.clone();
        let modules_dir = self.modules_dir.clone();
        let previous = self.joined.get(&name).cloned();
        async move {
            let parsed = spec::parse(&name, &obj.data["spec"]).map_err(|e| ("InvalidSpec", e))?;
            let module = parsed
                .module
                .clone()
                .ok_or(("InvalidSpec", "spec.module: Required value".to_owned()))?;
            let _ = tokio::fs::create_dir_all(&modules_dir).await;
            let wasm = source::fetch(&module, &modules_dir, None)
                .await
                .map_err(|e| ("FetchFailed", e))?;
            let mut plugin_spec = parsed.spec.clone();
            plugin_spec.kind = PluginKind::Scheduler;
            let plugin = match &previous {
                Some(previous) => {
                    host.reload(previous, plugin_spec, Arc::new(wasm), None)
                        .await
                }
                None => host.load(plugin_spec, Arc::new(wasm), None).await,
            }
            .map_err(|e| ("LoadFailed", e.message))?;
            let scheduler = parsed.scheduler.clone().unwrap_or_default();
            let component = PluginComponent {
                plugin: plugin.clone(),
                configuration: parsed.spec.configuration.clone(),
                weights: scheduler.weights.into_iter().collect(),
                ignore_failures: parsed.failure_policy == spec::FailurePolicy::Ignore,
            };
            Ok(Joining {
                plugin,
                profile: scheduler.profile,
                component,
            })
        }
    }

    async fn install(&mut self, name: &str, _: &DynamicObject, loaded: Joining) -> String {
        let Joining {
            plugin,
            profile,
            component,
        } = loaded;
        let digest = plugin.digest().to_owned();
        info!(plugin = %name, %profile, %digest, "scheduler plugin joined its profile");
        self.joined.insert(name.to_owned(), plugin);
        let _ = self
            .updates
            .send(trellis_scheduler::Update::Set { profile, component });
        digest
    }

    async fn remove(&mut self, name: &str) {
        if self.joined.remove(name).is_some() {
            info!(plugin = %name, "scheduler plugin removed");
            let _ = self.updates.send(trellis_scheduler::Update::Remove {
                name: name.to_owned(),
            });
        }
    }

    fn keeps(&self, name: &str) -> Option<String> {
        self.joined
            .get(name)
            .map(|p| format!("the last good version ({}) keeps running", p.digest()))
    }

    async fn report(&mut self, _: &str, obj: &DynamicObject, result: Result<String, Failure>) {
        object::write_loaded(&self.client, MANAGER, obj, result, "Loaded").await;
    }
}

/// Follows the Plugin objects of kind `scheduler` until `stopped` (see
/// [`SchedulerPlugins`]).
async fn follow_plugins(
    setup: SchedulerSetup,
    client: kube::Client,
    shared: Shared,
    updates: tokio::sync::mpsc::UnboundedSender<trellis_scheduler::Update>,
    stopped: Shutdown,
) {
    let informer = shared.informers.informer::<DynamicObject>(
        Api::all_with(client.clone(), &object::plugins_resource()),
        kube::runtime::watcher::Config::default(),
    );
    let world = SchedulerPlugins {
        setup,
        client,
        updates,
        modules_dir: crate::plugins::modules_dir(None),
        joined: HashMap::new(),
    };
    crate::plugins::follow_informer(Follower::new(world), &informer, stopped, None).await;
}
