//! Trellis' scheduler: kube-scheduler's scheduling framework, whose extension points
//! are WebAssembly components of the `scheduler` world (`wit/scheduler`).
//!
//! - [`queue`]: activeQ by priority, backoffQ, unschedulable pods moved back on the
//!   events their rejecting plugins declared (and after the flush interval).
//! - [`cache`]: nodes and the pods on them (bound or assumed), and the changes the
//!   plugins' views are sent.
//! - [`cycle`]: one scheduling cycle of a profile: PreFilter, Filter over a
//!   sample of the nodes (`percentageOfNodesToScore`), Score with weights, Reserve,
//!   Permit; then the bind, asynchronously.
//! - [`preemption`]: DefaultPreemption, for a pod no node fits: the node and the
//!   lower-priority pods whose deletion makes room for it.
//! - `run`: [`run`], the loop that feeds them from the informers and binds, one pod
//!   at a time (kube-scheduler's `scheduleOne`). Start here.
//! - `event_handlers`: the informers' changes of nodes, pods and budgets, and the
//!   profiles' updates, into the cache and the queue (kube-scheduler's
//!   `eventhandlers.go`).
//! - `binder`: the binding cycle: binds beside the loop, their outcome, and the pods
//!   waiting at Permit.
//! - [`volume_binding`]: VolumeBinding, for pods with claims: the nodes their volumes
//!   allow, and the claims' node selected before the bind.
//! - `status`: what the scheduler writes about a pod it could not place: its
//!   PodScheduled condition and nomination, and its preemption victims' deletion.
//! - this module: the configuration and the types the binary passes in.
//!
//! Each plugin component runs in a [`trellis_plugin_host::SchedulerSession`] of the
//! scheduler's own: the component keeps its view of the cluster between cycles, the
//! pod crosses once per cycle, and Filter and Score take batches of nodes.

mod binder;
pub mod cache;
pub mod cycle;
mod event_handlers;
pub mod metrics;
pub mod preemption;
pub mod queue;
mod run;
mod status;
pub mod volume_binding;

use std::collections::HashMap;
use std::sync::Arc;

use trellis_client::events::EventRecorder;
use trellis_client::informer::SharedInformers;
use trellis_plugin_host::{Plugin, PluginHost};

pub use cycle::{Decision, Profile};
pub use metrics::SchedulerMetrics;
pub use queue::QueueSettings;
pub use run::run;

/// kube-scheduler's default plugins as one component of the `scheduler` world, built
/// from `plugins/scheduler/default-plugins`.
pub const DEFAULT_PLUGINS: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/default-plugins.wasm"));

/// A component of the scheduler world that does no work (`plugins/fixtures/
/// scheduler-empty`): `trellis bench scheduler` times it on the default plugins'
/// calls to tell the WASM boundary's cost from the plugins' own work.
pub const EMPTY_PLUGIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/scheduler-empty.wasm"));

/// The profile name of pods that name no scheduler.
pub const DEFAULT_SCHEDULER: &str = "default-scheduler";

/// One plugin component of a profile, and the configuration its `plugins` call
/// gets.
#[derive(Clone, Debug)]
pub struct Component {
    pub plugin: Arc<Plugin>,
    pub configuration: String,
    /// Score weights that replace the plugins' own, by plugin name.
    pub weights: HashMap<String, u32>,
    /// A failure of the component (trap, deadline, memory, an error status) fails the
    /// cycle (`false`), or leaves the component out of it (`true`: `Ignore`).
    pub ignore_failures: bool,
}

/// A change of the profiles, as Plugin objects of kind `scheduler` come and go.
#[derive(Debug)]
pub enum Update {
    /// Adds a component to a profile (made with the default components if new), or
    /// replaces the one of the same plugin name; its session starts at the next cycle.
    Set {
        profile: String,
        component: Component,
    },
    /// Removes the component of this plugin name from every profile.
    Remove { name: String },
}

/// How the scheduler runs.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Profiles by `schedulerName`; pods for other schedulers are left alone.
    pub profiles: Vec<(String, Vec<Component>)>,
    /// The components a profile made by an [`Update`] starts with (the default
    /// plugins).
    pub defaults: Vec<Component>,
    /// `percentageOfNodesToScore`: 0 for kube-scheduler's adaptive default.
    pub percentage_of_nodes_to_score: u32,
    pub queue: QueueSettings,
}

/// What the scheduler runs with, beside its configuration.
pub struct Parts {
    /// The plugin host the components were loaded in.
    pub host: Arc<PluginHost>,
    /// The scheduler's own client (`system:kube-scheduler`).
    pub client: kube::Client,
    pub informers: SharedInformers,
    pub events: EventRecorder,
    pub metrics: SchedulerMetrics,
}

impl std::fmt::Debug for Parts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parts").finish_non_exhaustive()
    }
}
