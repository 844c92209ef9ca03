//! Write Trellis plugins in Rust.
//!
//! A plugin is a type that derives `Deserialize` (its configuration, from the Plugin
//! object's `spec.configuration`) and implements the trait of its kind, one of five;
//! one macro then exports it as a WebAssembly component of the matching WIT world
//! (four worlds: both kinds of admission plugin share the `admission` world):
//!
//! | kind                 | trait          | export macro          | WIT world      |
//! |----------------------|----------------|-----------------------|----------------|
//! | validating admission | [`Validate`]   | [`validating!`]       | `admission`    |
//! | mutating admission   | [`Mutate`]     | [`mutating!`]         | `admission`    |
//! | initializer          | [`Initialize`] | [`initializer!`]      | `initializer`  |
//! | controller           | [`controller::Reconcile`] | [`controller!`] | `controller` |
//! | scheduler            | [`scheduler::Plugin`] | [`scheduler!`] | `scheduler` |
//!
//! ```
//! use serde::Deserialize;
//! use trellis_plugin::{Request, Status, Validate, Verdict};
//!
//! #[derive(Deserialize)]
//! struct RequireTeam {
//!     label: String,
//! }
//!
//! impl Validate for RequireTeam {
//!     fn validate(&self, req: &Request) -> Result<Verdict, Status> {
//!         Ok(match req.label(&self.label) {
//!             Some(_) => Verdict::allow(),
//!             None => Verdict::deny(format!("{} needs the label {}", req.display_name(), self.label)),
//!         })
//!     }
//! }
//!
//! trellis_plugin::validating!(RequireTeam);
//! ```
//!
//! The request and answer types are plain Rust, and the host's imports go through
//! [`imports::Host`], so the same logic runs natively under [`testing`]: build a request
//! from an object, run the plugin, assert on its verdict or on the patched object.
//! The macros emit the WIT glue only when compiling for `wasm32`.
//!
//! # Layout
//! - [`plugin`]: the traits, and the generic code the export macros call.
//! - [`request`]: [`Request`] and friends; `object_as::<T>()` decodes into any
//!   `Deserialize` type, e.g. the `k8s-openapi` types re-exported as [`k8s`], and
//!   `spec_as::<T>()` decodes the spec alone.
//! - [`verdict`]: [`Verdict`] and [`Status`].
//! - [`patch`]: the RFC 6902 [`Patch`] builder, [`pointer!`], and `Patch::diff`.
//! - [`log`], [`cluster`]: the host's imports.
//! - [`scheduler`](mod@scheduler): the [`scheduler::Plugin`] trait and the scheduling framework.
//! - [`controller`](mod@controller): the [`controller::Reconcile`] trait and the controller world's
//!   imports (informer caches, writes, events).
//! - [`imports`]: the guest side of the host's imports: the indirection between
//!   those imports and whoever serves them (the WIT imports, or the test harness).
//! - [`testing`]: the native harness.
//! - `export`: the export macros, one file per world (`export/admission.rs`,
//!   `initializer.rs`, `controller.rs`, `scheduler.rs`), and the glue they share.

pub mod cluster;
pub mod controller;
mod export;
pub mod imports;
pub mod log;
pub mod patch;
pub mod plugin;
pub mod request;
#[cfg(feature = "k8s-openapi")]
pub mod scheduler;
pub mod testing;
pub mod verdict;

/// Resource quantities (`500m`, `1Gi`), exact, as the host parses and writes them.
pub use trellis_quantity as quantity;

#[cfg(feature = "k8s-openapi")]
pub use k8s_openapi as k8s;
pub use patch::{Patch, PatchOp, Pointer};
pub use plugin::{Initialize, Mutate, Validate};
pub use request::{
    GroupVersionKind, GroupVersionResource, InitializeRequest, Operation, Request, UserInfo,
};
pub use serde_json::{self, Value, json};
pub use verdict::{Status, Verdict};

#[doc(hidden)]
pub use export::__private;
