//! The WASM plugin host: wasmtime [`Engine`](wasmtime::Engine)s shared by every
//! plugin (Cranelift, and Winch while a new module's optimized code compiles: see
//! [`Compilers`]), optimized components cached on disk by content digest, an
//! [`InstancePre`](wasmtime::component::InstancePre) per plugin, pooled instances,
//! and a deadline and a memory cap on every call.
//!
//! Start with [`PluginHost::load`] and the calls on [`Plugin`].
//!
//! # Layout
//! - `host`: [`PluginHost`] owns the engines, a linker per world and engine, the
//!   background compiler thread and the epoch ticker thread.
//! - `world`: each kind of plugin as a WIT world (the `World` trait): admission and
//!   initializer, each in every contract version the host serves, and controller.
//! - `plugin`: [`Plugin`] is one loaded plugin: [`Plugin::admit`] and
//!   [`Plugin::initialize`] call it ([`Plugin::reconcile`] a controller, loaded with
//!   [`PluginHost::load_controller`]); failures come back as [`PluginError`], whose
//!   message names the plugin, its kind and the digest serving. Its instance pool and
//!   the call machinery are generic over the world.
//! - `calls`: the host's own threads, where guest code runs while callers await it.
//! - `pool`: shares the engine's instance slots among the plugins: idle instances
//!   per plugin, and calls waiting for a free slot within their deadline.
//! - `bindings`: the generated bindings, one module per WIT package version;
//!   `imports`: the host's side of the shared imports (`log`, `cluster`); `state`:
//!   what each instance's store holds; `stdio`: guest output into the log.
//! - [`review`]: Kubernetes `AdmissionReview` JSON to and from the contract's records.
//! - `metrics`: per-plugin counters, rendered by [`render_metrics`].
//!
//! The contract itself is under `wit/`; docs/wit.md describes it and its versions.

mod bindings;
mod calls;
mod host;
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
pub use host::{Compilers, HostConfig, PluginHost, Tier};
pub use imports::controller::{
    Action, ApiError, Cause, CreateRequest, DeleteRequest, EventType, ObjectKey, PatchRequest,
    PatchType, Propagation, ServedResource, UpdateRequest, Write,
};
pub use imports::{ClusterReader, ControllerHost};
pub use metrics::{PluginMetrics, render_metrics};
pub use plugin::{
    LoadError, LoadErrorReason, Plugin, PluginError, PluginErrorKind, PluginSpec, SchedulerSession,
};
/// `sha256:<hex>` of a module's bytes: how a plugin version is named, as OCI names
/// content.
pub use trellis_oci::digest_of;
/// The `scheduler` world's types, as a [`SchedulerSession`]'s calls take and return
/// them.
pub mod scheduler {
    pub use crate::bindings::scheduler::trellis::scheduler::types::*;
}
pub use world::PluginKind;
