//! The WASM plugin host: wasmtime [`Engine`](wasmtime::Engine)s shared by every
//! plugin (Cranelift, and Winch while a new module's optimized code compiles: see
//! [`Compilers`]), optimized components cached on disk by content digest, an
//! [`InstancePre`](wasmtime::component::InstancePre) per plugin, pooled instances,
//! and a deadline and a memory cap on every call.
//!
//! - [`PluginHost`] owns the engines, their linkers (WASI with nothing granted, plus
//!   the contract's `log` and `cluster` imports), the background compiler thread and
//!   the epoch ticker thread.
//! - [`Plugin`] is one loaded plugin: [`Plugin::admit`] and [`Plugin::initialize`] call
//!   it; failures come back as [`PluginError`], whose message names the plugin, its
//!   kind and the digest serving.
//! - `pool` shares the engine's instance slots among the plugins: idle instances
//!   per plugin, and calls waiting for a free slot within their deadline.
//!
//! The contract itself is `wit/plugin.wit`; docs/wit.md describes it.

mod bindings;
mod host;
mod metrics;
mod plugin;
mod pool;
pub mod review;
mod stdio;

pub use bindings::admission::exports::trellis::plugin::admission_handler::{
    AdmissionRequest, AdmissionResponse,
};
pub use bindings::initializer::exports::trellis::plugin::initializer_handler::InitializeRequest;
pub use bindings::types::{GroupVersionKind, GroupVersionResource, Operation, Status, UserInfo};
pub use host::{Compilers, HostConfig, PluginHost, Tier, digest_of};
pub use metrics::{PluginMetrics, render_metrics};
pub use plugin::{
    ClusterReader, LoadError, LoadErrorReason, Plugin, PluginError, PluginErrorKind, PluginKind,
    PluginSpec,
};
