//! The components of `trellis` as a library: the controller manager and the scheduler
//! of `trellis controllers|scheduler` and `trellis up`, so that the end-to-end tests
//! run them in their own process as the binary does (`src/main.rs` holds the rest of
//! the binary).
//!
//! # Layout
//! - [`components`]: leader election, metrics and the loops of each component; the
//!   built-in controllers.
//! - [`plugin_controllers`]: controllers declared as `Plugin` objects, and which of
//!   them replace a built-in.
//! - [`scheduler`]: the scheduler component and its `Plugin` objects.
//! - [`plugins`]: what both follow Plugin objects with: an informer feeding a
//!   `trellis_plugins` follower.
//! - [`flags`]: parsers the subcommands' flags share.

pub mod components;
pub mod flags;
pub mod plugin_controllers;
pub mod plugins;
pub mod scheduler;
