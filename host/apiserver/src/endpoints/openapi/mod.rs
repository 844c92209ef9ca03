//! The OpenAPI documents kubectl downloads: the v3 index (`GET /openapi/v3`), one
//! OpenAPI 3.0 document per group-version (`GET /openapi/v3/apis/apps/v1`), and a
//! Swagger 2.0 document (`GET /openapi/v2`) for older clients.
//!
//! Schemas are never written by hand: they come from the `k8s-openapi` types'
//! `schemars` implementations, which already name each type by Kubernetes' dotted name
//! (`io.k8s.api.apps.v1.Deployment`). A [`Catalog`] holds them, with every `$ref` as
//! `#/components/schemas/<name>`, and knows which schema describes which kind. A
//! document takes what its operations reference, and everything that references in
//! turn, and renders it for OpenAPI v3 or Swagger 2.0.
//!
//! What kubectl reads here:
//! - `kubectl explain` finds a resource's kind through the `x-kubernetes-group-version-kind`
//!   of the operations on its collection or object path, then the schema carrying the
//!   same kind in its own `x-kubernetes-group-version-kind` list, and walks `properties`,
//!   `$ref` and `allOf` from there.
//! - Before `apply`/`create`/`replace`, kubectl checks whether a kind's PATCH operation
//!   takes the `fieldValidation` query parameter. When it does, validation is left to the
//!   server (`fieldValidation=Strict`).
//! - `kubectl apply` computes its strategic merge patch from the v3 schemas only when the
//!   PATCH operation lists `application/strategic-merge-patch+json`. The v3 documents
//!   leave that media type out ([`V3_PATCH_MEDIA_TYPES`]), so kubectl turns to the v2
//!   document, whose schemas carry the built-in kinds' merge keys and strategies
//!   ([`crate::fieldmanager::merge_keys`]; the `k8s-openapi` schemas have none).
//!
//! # Layout
//! - [`catalog`]: which kinds and schemas exist ([`Catalog`]).
//! - [`paths`]: each resource's paths and operations.
//! - [`render`]: a schema as v2 or v3 writes it.
//! - [`document`]: the v3 documents and their index, the v2 document.
//! - [`proto`]: the v2 document in protobuf.

pub mod catalog;
pub mod document;
pub mod paths;
pub mod proto;
pub mod render;
#[cfg(test)]
mod tests;

pub use catalog::Catalog;
pub use document::{content_hash, v2_document, v3_document, v3_documents, v3_index, v3_index_of};
pub use paths::{V3_PATCH_MEDIA_TYPES, api_path};
