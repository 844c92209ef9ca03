//! The client layer of Trellis' components (controllers, scheduler, node agent), as
//! client-go is Kubernetes': built on kube-rs, so every component is an ordinary
//! Kubernetes client of the API server.
//!
//! - [`transport`]: one [`kube::Client`] over a kubeconfig (remote, HTTPS, HTTP/2) or
//!   straight to the API server's router in the same process, with the component's
//!   identity attached in-process.
//! - [`identity`]: the Kubernetes users components act as.
//! - [`informer`]: shared informers: one list+watch per resource and selector per
//!   process, indexed stores, change handlers, `has_synced`.
//! - [`workqueue`]: de-duplicating, rate-limited work queues.
//! - [`leader`]: leader election over Leases.
//! - [`events`]: the event recorder, with repeats aggregated and a rate limit per object.
//! - [`metrics`]: a component's informer, queue and leader metrics, and their endpoint.

pub mod events;
pub mod identity;
pub mod informer;
pub mod leader;
pub mod metrics;
pub mod transport;
pub mod workqueue;

pub use transport::{InProcess, remote, remote_config, remote_with};
