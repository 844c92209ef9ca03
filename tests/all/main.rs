//! Cross-crate and end-to-end tests of Trellis, in one binary (one link, one run).
//!
//! # Layout
//! - `store`: the store conformance suite on both backends, the embedded backend's
//!   own checks (bad files, limits, reopen) and the crash test.

mod store;
