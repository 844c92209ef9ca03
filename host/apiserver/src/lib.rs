//! The API server: Kubernetes' REST API over the store, so that kubectl, the official
//! client libraries and kube-rs work against Trellis unchanged.
//!
//! The folders follow a request through the server, in order:
//!
//! ```text
//! server ─▶ endpoints::dispatch ─▶ authentication ─▶ authorization ─▶ endpoints (parse)
//!        ─▶ registry (the verb) ─▶ admission (mutating, validating, quota)
//!        ─▶ fieldmanager (managed fields) ─▶ storage ─▶ the store
//!        ─▶ storage::watch_cache ─▶ endpoints::watch
//! ```
//!
//! Start with [`server::start`], then [`endpoints::dispatch`] (the request chain) and
//! [`registry`] (the verbs). `docs/apiserver.md` follows one create from socket to
//! watch.
//!
//! # Layout
//! - [`server`]: credentials on first start, PKI, TLS, the listener, graceful stop.
//! - [`endpoints`]: dispatch, request parsing, responses, watch, discovery, OpenAPI,
//!   protobuf, tables.
//! - [`authentication`]: bearer tokens and ServiceAccount tokens (client certificates
//!   are checked by TLS in [`server`]).
//! - [`authorization`]: RBAC, the node authorizer, access reviews.
//! - [`admission`]: the admission and initializer chains, the built-in steps
//!   (LimitRanger, ResourceQuota) and the WASM plugins.
//! - [`registry`]: the generic verbs, built-in and custom resources, subresources,
//!   namespaces.
//! - [`fieldmanager`]: managed fields, server-side apply, patches, merge keys.
//! - [`storage`]: the watch cache and listers.
//! - [`observability`]: metrics and the audit log.
//! - [`certificates`]: the CertificateSigningRequest approver and signer (TLS bootstrap).
//! - [`state`]: what every stage shares (the store, the registry, the caches).
//! - [`inflight`]: the limits on requests in flight; [`bootstrap`]: the objects every
//!   cluster starts with; [`service_reconciler`]: the `kubernetes` and `kube-dns`
//!   Services and the API servers' endpoints.
//! - [`object`]: object metadata helpers; [`warnings`]: `Warning` headers.

pub mod admission;
pub mod aggregator;
pub mod authentication;
pub mod authorization;
pub mod bootstrap;
pub mod certificates;
pub mod endpoints;
pub mod fieldmanager;
mod fuzz;
pub mod inflight;
pub mod kubelet;
pub mod object;
pub mod observability;
pub mod registry;
pub mod server;
pub mod service_reconciler;
pub mod state;
pub mod storage;
pub mod warnings;

pub use server::{Config, Server, start};
