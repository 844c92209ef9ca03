//! The controller manager of Trellis: runs controllers that are WebAssembly components
//! of the `controller` world (`wit/controller`), as kube-controller-manager runs its
//! loops.
//!
//! Start with [`Manager::start`]: it resolves the controller's resources through
//! discovery, reads them through the process's shared informers, loads the plugin with
//! its imports served by a [`host::KubeHost`], maps every change to a key of the
//! primary resource, and runs workers that call `reconcile` from a rate-limited work
//! queue.
//!
//! # Layout
//! - [`runner`]: [`ControllerConfig`], [`Manager`] (which loads a controller, [`Loaded`],
//!   then runs it, [`Running`]), the key mapping and the workers.
//! - [`bundled`]: the built-in controllers, built from `plugins/controllers` and
//!   included in the binary.
//! - `expectations`: a key waits until the caches show its last reconcile's writes.
//! - [`host`]: the controller world's imports: cache reads from the informers, writes
//!   through the API server under the controller's identity, events.

pub mod bundled;
mod expectations;
pub mod host;
pub mod runner;

pub use runner::{ControllerConfig, Key, Loaded, Manager, Mapping, Running, RunningPlugins, Watch};
