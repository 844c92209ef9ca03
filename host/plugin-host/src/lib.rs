//! The WASM plugin host: it compiles, links, pools and calls plugin components of
//! five kinds, each a WIT world: mutating and validating admission, initializers,
//! controllers and scheduler plugins. Every plugin is bounded: a deadline on every
//! call (the engines' epochs), a cap on its linear memory, and a share of the host's
//! instance slots.
//!
//! Start with [`PluginHost::new`] and [`PluginHost::load`], then the calls on
//! [`Plugin`]: [`Plugin::admit`], [`Plugin::initialize`], [`Plugin::reconcile`] (a
//! controller, loaded with [`PluginHost::load_controller`]), and
//! [`Plugin::scheduler_session`] for a scheduler plugin. A failed load is a
//! [`LoadError`] (the last good version keeps serving); a failed call a
//! [`PluginError`], whose message names the plugin, its kind and the digest serving.
//!
//! Code comes in two tiers ([`Tier`]): a new module serves at once from Winch's
//! baseline code while Cranelift optimizes it on a background thread, and moves to
//! the optimized code when it is ready ([`Compilers`]). Optimized code is cached on
//! disk by content digest, and plugins of the same module share one copy.
//!
//! # Layout
//! From the bottom up; a module uses only those above it in this list.
//! - `bindings`: the generated bindings, one module per WIT package version.
//! - `error`: [`LoadError`] and [`PluginError`]; `grants`: what a plugin may be
//!   granted ([`ClusterReader`], [`ControllerHost`]); `state`: what each instance's
//!   store holds; `stdio`: guest output into the log.
//! - `imports`: the host's side of the imports, one file per WIT interface.
//! - `world`: each kind of plugin as a WIT world (the `World` trait), in every
//!   contract version the host serves, and the calls into it.
//! - `compiler`: an engine per [`Tier`] with a linker per world, and the disk cache;
//!   `epoch`: the ticker behind deadlines; `call_threads`: the host's own threads,
//!   where guest code runs while callers await it; `pool`: the instance slots the
//!   plugins share; `metrics`: per-plugin counters.
//! - `plugin`: [`Plugin`], one loaded plugin, its code and its idle instances.
//! - `engine`: [`PluginHost`], the engines and loading, and the move to optimized
//!   code.
//! - `calls`: the calls into admission, initializer and controller plugins;
//!   `session`: a scheduler plugin's [`SchedulerSession`].
//! - [`review`]: Kubernetes `AdmissionReview` JSON to and from the contract's records.
//!
//! The contract itself is under `wit/`; docs/wit.md describes it and its versions.

mod bindings;
mod call_threads;
mod calls;
mod compiler;
mod engine;
mod epoch;
mod error;
mod grants;
mod imports;
mod metrics;
mod plugin;
mod pool;
pub mod review;
mod session;
mod state;
mod stdio;
#[cfg(test)]
mod testing;
mod world;

pub use bindings::admission::exports::trellis::admission::handler::{
    AdmissionRequest, AdmissionResponse,
};
pub use bindings::initializer::exports::trellis::initializer::handler::InitializeRequest;
pub use bindings::types::{GroupVersionKind, GroupVersionResource, Operation, Status, UserInfo};
pub use compiler::Tier;
pub use engine::{Compilers, HostConfig, PluginHost};
pub use error::{LoadError, LoadErrorReason, PluginError, PluginErrorKind};
pub use grants::{ClusterReader, ControllerHost};
pub use imports::controller::{
    Action, ApiError, Cause, CreateRequest, DeleteRequest, EventType, ObjectKey, PatchRequest,
    PatchType, Propagation, ServedResource, UpdateRequest, Write,
};
pub use metrics::PluginMetrics;
pub use plugin::{Plugin, PluginSpec, render_metrics};
pub use session::SchedulerSession;
/// `sha256:<hex>` of a module's bytes: how a plugin version is named, as OCI names
/// content.
pub use trellis_oci::digest_of;
/// The `scheduler` world's types, as a [`SchedulerSession`]'s calls take and return
/// them.
pub mod scheduler {
    pub use crate::bindings::scheduler::trellis::scheduler::types::*;
}
pub use world::PluginKind;
