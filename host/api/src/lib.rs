//! Trellis' API vocabulary, shared by the API server, the client and the controllers.
//! No I/O: types and pure functions only, and the shutdown signal every component shares.
//!
//! Start with [`registry`] (which resources exist and how they are served), then
//! [`status`] (every error a client sees) and [`selector`] (label and field selectors).
//!
//! # Layout
//! - [`registry`]: the built-in resources: group, version, kind, plural, scope, verbs,
//!   short names, subresources.
//! - [`status`]: [`ApiError`], which becomes a Kubernetes `Status` at the server's edge.
//! - [`selector`]: label and field selectors: parsing and matching.
//! - [`user`]: who is asking: [`UserInfo`].
//! - [`quantity`]: exact resource quantities (`500m`, `1Gi`) for limits and quotas.
//! - [`shutdown`]: [`Shutdown`], the signal that tells a component's tasks to stop,
//!   and [`Stop`], which gives it.

pub use trellis_quantity as quantity;
pub mod registry;
pub mod selector;
pub mod shutdown;
pub mod status;
pub mod user;

pub use shutdown::{Shutdown, Stop};
pub use status::ApiError;
pub use user::UserInfo;
