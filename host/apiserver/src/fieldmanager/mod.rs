//! Who owns which field: managed fields, server-side apply's merge, patches, and the
//! merge keys of the built-in kinds' lists.
//!
//! # Layout
//! - [`managed_fields`]: field sets and `metadata.managedFields`.
//! - [`apply`]: the apply merge and the field manager of every write.
//! - [`patch`]: JSON merge and strategic merge patches.
//! - [`merge_keys`]: how the built-in kinds' lists merge, for apply, strategic merge
//!   patches and the OpenAPI schemas.

pub mod apply;
pub mod managed_fields;
pub mod merge_keys;
pub mod patch;
