//! What the server tells its operators: `/metrics` and the audit log.
//!
//! # Layout
//! - [`metrics`]: request, store, watch and plugin metrics.
//! - [`audit`]: the audit log.

pub mod audit;
pub mod metrics;
