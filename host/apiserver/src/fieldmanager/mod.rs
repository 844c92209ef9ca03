//! Who owns which field: managed fields, server-side apply's merge, patches, and the
//! merge keys of the built-in kinds' lists.
//!
//! # Layout
//! - [`managed_fields`]: field sets and `metadata.managedFields`.
//! - [`field_manager`]: the field manager of every write: who set which fields, recorded
//!   on each create, update and patch.
//! - [`structured_merge`]: server-side apply's merge, its conflicts and forced takeovers.
//! - [`patch`]: JSON merge and strategic merge patches.
//! - [`merge_keys`]: how the built-in kinds' lists merge, for apply, strategic merge
//!   patches and the OpenAPI schemas.

pub mod field_manager;
pub mod managed_fields;
pub mod merge_keys;
pub mod patch;
pub mod structured_merge;
