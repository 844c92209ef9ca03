//! The scheduler component: `trellis scheduler`, and the scheduler of `trellis up`.
//! It runs the framework of `trellis-scheduler` with the default plugins (one WASM
//! component bundled in the binary) as the `default-scheduler` profile.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tracing::info;
use trellis_client::events::EventRecorder;
use trellis_plugin_host::{HostConfig, PluginHost, PluginKind, PluginSpec};
use trellis_scheduler::{Component as PluginComponent, QueueSettings, SchedulerConfig};

use crate::components::{Component, ComponentArgs, Shared, run_remote};
use crate::flags::seconds;

/// `trellis scheduler`: the component's flags and the framework's settings.
#[derive(Debug, Args)]
pub struct SchedulerArgs {
    #[command(flatten)]
    pub component: ComponentArgs,

    #[command(flatten)]
    pub settings: SchedulerFlags,

    /// Where compiled plugins are kept between runs (none: compiled at each start).
    #[arg(long, value_name = "DIR")]
    pub plugin_cache_dir: Option<PathBuf>,
}

/// The settings `trellis up` shares with `trellis scheduler`.
#[derive(Clone, Debug, Args)]
pub struct SchedulerFlags {
    /// The share of nodes a cycle looks for feasible ones among, as kube-scheduler's
    /// `percentageOfNodesToScore`: 0 for its adaptive default (50 − nodes/125 %,
    /// at least 5 %, at least 100 nodes).
    #[arg(long, default_value_t = 0, value_name = "PERCENT")]
    pub percentage_of_nodes_to_score: u32,

    /// The back-off of a pod that failed to schedule, doubled at each failure...
    #[arg(long, default_value = "1", value_name = "SECONDS", value_parser = seconds)]
    pub pod_initial_backoff: Duration,

    /// ... up to this.
    #[arg(long, default_value = "10", value_name = "SECONDS", value_parser = seconds)]
    pub pod_max_backoff: Duration,

    /// How long an unschedulable pod waits for a cluster event before it is tried
    /// again anyway.
    #[arg(long, default_value = "300", value_name = "SECONDS", value_parser = seconds)]
    pub pod_unschedulable_timeout: Duration,
}

/// What the scheduler runs with.
#[derive(Clone)]
pub struct SchedulerSetup {
    pub plugins: Arc<PluginHost>,
    pub flags: SchedulerFlags,
    pub metrics: trellis_scheduler::SchedulerMetrics,
}

impl std::fmt::Debug for SchedulerSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulerSetup")
            .field("flags", &self.flags)
            .finish_non_exhaustive()
    }
}

/// The default plugins' deadline per call: a Filter or Score of thousands of nodes
/// takes milliseconds; a plugin stuck in a loop is stopped after this.
const CALL_DEADLINE: Duration = Duration::from_secs(2);
/// Their memory cap: a view of 5,000 nodes and 10,000 pods fits well within it.
const MEMORY_LIMIT: usize = 512 << 20;

/// `trellis scheduler --kubeconfig FILE`.
pub async fn run_scheduler(
    args: SchedulerArgs,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let plugins = PluginHost::new(HostConfig {
        cache_dir: args.plugin_cache_dir.clone(),
        ..HostConfig::default()
    })?;
    let setup = SchedulerSetup {
        plugins,
        flags: args.settings,
        metrics: Default::default(),
    };
    run_remote(
        Component::Scheduler,
        args.component,
        None,
        Some(setup),
        shutdown,
    )
    .await
}

/// The scheduler's work while this process leads: until `stopped`.
pub(crate) async fn work(
    setup: SchedulerSetup,
    client: kube::Client,
    shared: Shared,
    stopped: tokio::sync::watch::Receiver<bool>,
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
        &crate::components::host_name(),
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

/// Follows the Plugin objects of kind `scheduler`: each is loaded (its module
/// fetched, its configuration checked by its `plugins` call) and joins its profile;
/// a new generation replaces it once it loaded, one that fails leaves the last good
/// version in place, and a deleted Plugin leaves the profile. The `Loaded` condition
/// says which.
async fn follow_plugins(
    setup: SchedulerSetup,
    client: kube::Client,
    shared: Shared,
    updates: tokio::sync::mpsc::UnboundedSender<trellis_scheduler::Update>,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    use kube::api::{Api, DynamicObject};
    use trellis_client::informer::Change;
    use trellis_plugins::{source, spec};

    let informer = shared.informers.informer::<DynamicObject>(
        Api::all_with(
            client.clone(),
            &crate::plugin_controllers::plugins_resource(),
        ),
        kube::runtime::watcher::Config::default(),
    );
    let mut changes = informer.subscribe();
    let modules_dir = crate::plugin_controllers::modules_dir(None);
    // uid/generation last tried, by name; and the plugins joined.
    let mut tried: std::collections::HashMap<String, String> = Default::default();
    let mut joined: std::collections::HashMap<String, Arc<trellis_plugin_host::Plugin>> =
        Default::default();
    loop {
        let change = tokio::select! {
            change = changes.recv() => change,
            _ = stopped.wait_for(|s| *s) => return,
        };
        let Some(change) = change else { return };
        let obj = change.object().clone();
        let name = obj.metadata.name.clone().unwrap_or_default();
        let is_scheduler = obj.data["spec"]["kind"]
            .as_str()
            .is_some_and(|k| k.eq_ignore_ascii_case("scheduler"));
        if matches!(change, Change::Deleted(_))
            || obj.metadata.deletion_timestamp.is_some()
            || !is_scheduler
        {
            tried.remove(&name);
            if joined.remove(&name).is_some() {
                info!(plugin = %name, "scheduler plugin removed");
                let _ = updates.send(trellis_scheduler::Update::Remove { name });
            }
            continue;
        }
        let fingerprint = format!(
            "{}/{}",
            obj.metadata.uid.as_deref().unwrap_or_default(),
            obj.metadata.generation.unwrap_or_default()
        );
        if tried.get(&name) == Some(&fingerprint) {
            continue;
        }
        tried.insert(name.clone(), fingerprint);
        let loaded = async {
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
            let previous = joined.get(&name).cloned();
            let plugin = match &previous {
                Some(previous) => {
                    setup
                        .plugins
                        .reload(previous, plugin_spec, Arc::new(wasm), None)
                        .await
                }
                None => setup.plugins.load(plugin_spec, Arc::new(wasm), None).await,
            }
            .map_err(|e| ("LoadFailed", e.message))?;
            let scheduler = parsed.scheduler.clone().unwrap_or_default();
            let component = PluginComponent {
                plugin: plugin.clone(),
                configuration: parsed.spec.configuration.clone(),
                weights: scheduler.weights.into_iter().collect(),
                ignore_failures: parsed.failure_policy == spec::FailurePolicy::Ignore,
            };
            Ok::<_, (&'static str, String)>((plugin, scheduler.profile, component))
        }
        .await;
        let result = match loaded {
            Ok((plugin, profile, component)) => {
                let digest = plugin.digest().to_owned();
                info!(plugin = %name, %profile, %digest, "scheduler plugin joined its profile");
                joined.insert(name.clone(), plugin);
                let _ = updates.send(trellis_scheduler::Update::Set { profile, component });
                Ok(digest)
            }
            Err((reason, message)) => {
                let keeps = joined
                    .get(&name)
                    .map(|p| format!("; the last good version ({}) keeps running", p.digest()))
                    .unwrap_or_default();
                tracing::warn!(plugin = %name, reason, "{message}{keeps}");
                Err((reason, format!("{message}{keeps}")))
            }
        };
        crate::plugin_controllers::write_status(&client, &obj, result, "Loaded").await;
    }
}
