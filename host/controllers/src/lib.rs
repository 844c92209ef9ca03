//! The controller manager of Trellis: runs controllers that are WebAssembly components
//! of the `controller` world (`wit/controller`), as kube-controller-manager runs its
//! loops.
//!
//! Start with [`Manager::start`]: it resolves the controller's resources through
//! discovery, reads them through the process's shared informers, loads the plugin with
//! its imports served by an [`imports::KubeHost`], maps every change to a key of the
//! primary resource, and runs workers that call `reconcile` from a rate-limited work
//! queue.
//!
//! # Layout
//! - `config`: [`ControllerConfig`], what a controller is: its primary, owned and
//!   watched resources ([`Watch`]), and how a change maps to keys ([`Mapping`]).
//! - `manager`: [`Manager`], which loads a controller ([`Loaded`]) then runs it
//!   ([`Running`]).
//! - `discovery`: resources resolved through discovery, and those served later that
//!   join a running controller of every resource.
//! - `handler`: what feeds the work queue: a change of a primary, owned or watched
//!   object mapped to keys, the garbage collector's feed, the resync.
//! - `worker`: the workers that take keys and call `reconcile`.
//! - `expectations`: a key waits until the caches show its last reconcile's writes.
//! - [`imports`]: the controller world's imports: cache reads from the informers,
//!   writes through the API server under the controller's identity, events.
//! - `cache` and `key`, the vocabulary the others share: the resources a controller
//!   reads with their informers and the owner index over them; a work queue's
//!   [`Key`] and the keys of resources and cached objects.
//! - [`bundled`]: the built-in controllers, built from `plugins/controllers` and
//!   included in the binary.

pub mod bundled;
mod cache;
mod config;
mod discovery;
mod expectations;
mod handler;
pub mod imports;
mod key;
mod manager;
mod worker;

pub use config::{ControllerConfig, Mapping, Watch};
pub use key::Key;
pub use manager::{Loaded, Manager, Running, RunningPlugins};
