//! The API server: Kubernetes' REST API over the store, so that kubectl, the official
//! client libraries and kube-rs work against Trellis unchanged.
//!
//! Start with [`server::start`], then [`routes`] (the request chain) and [`handlers`]
//! (the verbs).
//!
//! # Layout
//! - [`server`]: credentials on first start, the HTTPS listener, graceful stop.
//! - [`routes`]: authentication, authorization, path parsing, dispatch.
//! - [`rbac`]: RBAC authorization and the bootstrap roles; [`node_authz`]: what
//!   a node's credentials may reach.
//! - [`admission`]: the admission and initializer chains; [`limit_ranger`] and
//!   [`quota`]: the built-in LimitRanger and ResourceQuota steps, which read through
//!   [`lister`] (the watch cache, fenced by this server's writes); [`plugins`]: the
//!   WASM plugins in the chains (Plugin objects, the plugins directory, hot reload).
//! - [`metrics`]: `/metrics`; [`audit`]: the audit log.
//! - [`request`]: what a request asks for (resource, verb, query, formats).
//! - [`handlers`]: get, list, create, update, patch, delete, deletecollection.
//! - [`watch`]: client watches; [`watch_cache`]: the one store watch they share.
//! - [`typed`]: built-in kinds through their `k8s-openapi` types, defaults, validation.
//! - [`crd`]: custom resources from CRDs: registry entries, schema validation, pruning.
//! - [`subresources`]: `scale` and `pods/binding`; [`reviews`]: self-subject access,
//!   rules and identity reviews (`kubectl auth can-i`, `kubectl auth whoami`).
//! - [`patch`]: merge and strategic merge patches; [`table`]: `kubectl get` tables.
//! - [`managed_fields`]: field sets and `metadata.managedFields`; [`apply`]:
//!   server-side apply and the field manager of every write; [`merge_keys`]: how the
//!   built-in kinds' lists merge, for both apply and the OpenAPI schemas.
//! - [`discovery`]: `/api`, `/apis`, resource lists, `/version`; [`openapi`]: the
//!   OpenAPI v2 and v3 documents; [`openapi_proto`]: the v2 document in protobuf.
//! - [`object`]: object metadata helpers; [`response`]: errors as `Status`.
//! - [`protobuf`]: protobuf request bodies read into JSON.
//! - [`pki`], [`tls`], [`tokens`], [`kubeconfig`]: the cluster CA, certificates,
//!   TLS, bearer tokens and the admin kubeconfig; [`sa_token`]: ServiceAccount tokens.
//! - [`state`]: what handlers share; the initial namespaces; namespace cleanup.
//! - [`warnings`]: `Warning` headers collected while a request is handled.

pub mod admission;
pub mod apply;
pub mod audit;
pub mod crd;
pub mod discovery;
mod fuzz;
pub mod handlers;
pub mod kubeconfig;
pub mod limit_ranger;
pub mod lister;
pub mod managed_fields;
pub mod merge_keys;
pub mod metrics;
pub mod node_authz;
pub mod object;
pub mod openapi;
pub mod openapi_proto;
pub mod patch;
pub mod pki;
pub mod plugins;
pub mod protobuf;
pub mod quota;
pub mod rbac;
pub mod request;
pub mod response;
pub mod reviews;
pub mod routes;
pub mod sa_token;
pub mod server;
pub mod state;
pub mod subresources;
pub mod table;
pub mod tls;
pub mod tokens;
pub mod typed;
pub mod warnings;
pub mod watch;
pub mod watch_cache;

pub use server::{Config, Server, start};
