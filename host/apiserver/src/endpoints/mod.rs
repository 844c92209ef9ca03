//! The HTTP face of the API: the router and dispatch, what a request asks for, the
//! responses and errors, watch streams, discovery, OpenAPI, protobuf bodies and
//! `kubectl get` tables.
//!
//! # Layout
//! - [`dispatch`]: the router; authentication → authorization → a handler.
//! - [`request`]: what a request asks for: its path read as a [`request::RequestInfo`]
//!   (a resource, or discovery, OpenAPI and the other non-resource paths), the verb,
//!   the query options, the body's format.
//! - [`response`]: responses, and every error as a Kubernetes `Status`.
//! - [`watch`]: client watches, served from the watch cache.
//! - [`discovery`]: `/api`, `/apis`, resource lists, `/version`.
//! - [`openapi`]: the OpenAPI v2 and v3 documents, v2 also in protobuf.
//! - [`protobuf`]: protobuf request bodies read into JSON.
//! - [`table`]: `kubectl get` tables.

pub mod conversion;
pub mod discovery;
pub mod dispatch;
pub mod openapi;
pub mod protobuf;
pub mod request;
pub mod response;
pub mod table;
pub mod watch;
