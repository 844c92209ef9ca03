//! The `Plugin` object (`trellis.dev/v1`): what a declaration says, where its module
//! comes from, and the loop that follows declarations for every world (admission,
//! initializer, controller, scheduler).
//!
//! A plugin is declared by a `Plugin` object, or by a `NAME.yaml` + `NAME.wasm` pair in
//! the API server's plugins directory. Whoever runs a world (the API server for
//! admission and initializer plugins, the controller manager, the scheduler) reads the
//! declaration with [`spec::parse`] and fetches its module with [`source::fetch`];
//! one [`follow::Follower`] per world follows the declarations.
//!
//! # Layout
//! - [`spec`]: the spec as a plugin author writes it, its defaults and limits, the CRD
//!   that serves it, and how match rules select requests.
//! - [`source`]: fetching a module (`file://`, `https://` pinned by digest, `oci://`),
//!   kept by digest in a cache; [`oci`] reads `oci://` references, [`http`] GETs.
//! - [`dir`]: the plugins directory, polled.
//! - [`follow`]: the follow loop: a [`follow::Follower`] takes declarations as they
//!   change and loads each in a task of its own beside the running version; a
//!   [`follow::World`] says how its world loads, installs, removes and reports.
//! - [`object`]: Plugin objects through a Kubernetes client: their resource, the
//!   changes a watch of them makes, and the `Loaded` condition written to them.

pub mod dir;
pub mod follow;
pub mod http;
pub mod object;
pub mod oci;
pub mod source;
pub mod spec;
