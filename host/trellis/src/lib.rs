//! The components of `trellis` as a library: the controller manager and the scheduler
//! of `trellis controllers|scheduler` and `trellis up`, so that the end-to-end tests
//! run them in their own process as the binary does (`src/main.rs` holds the rest of
//! the binary).
//!
//! # Layout
//! - [`components`]: the component runtime (leader election, metrics, which loops
//!   run) and `trellis controllers`.
//! - [`setup`]: what the components run with and share (informers, the controllers'
//!   and the scheduler's setups, credentials), and how a built-in controller starts.
//! - [`plugin_controllers`]: controllers declared as `Plugin` objects, and which of
//!   them replace a built-in.
//! - [`scheduler`]: `trellis scheduler`; [`scheduling`]: the scheduler's work, with
//!   its `Plugin` objects.
//! - [`plugins`]: what both follow Plugin objects with: an informer feeding a
//!   `trellis_plugins` follower.
//! - [`flags`]: parsers the subcommands' flags share.
//!
//! The modules form layers, without circles: `flags`, `plugins` and `setup` at the
//! bottom; `plugin_controllers` and `scheduling` on them; `components` and
//! `scheduler` (the commands) on top.

pub mod components;
pub mod flags;
pub mod metrics_server;
pub mod plugin_controllers;
pub mod plugins;
pub mod scheduler;
pub mod scheduling;
pub mod setup;
