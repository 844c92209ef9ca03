//! Cross-crate and end-to-end tests of Trellis, in one binary (one link, one run).
//!
//! # Layout
//! - `apiserver`: the API server end to end, driven by the real kubectl (tables,
//!   apply, selectors, conflicts, validation, finalizers, namespaces, watch, paging,
//!   the status subresource, authentication and authorization).
//! - `store`: the store conformance suite on both backends, the embedded backend's
//!   own checks (bad files, limits, reopen) and the crash test.

mod apiserver;
mod store;
