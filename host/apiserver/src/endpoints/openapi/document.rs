//! The documents: one OpenAPI 3.0 document per served group-version with the index
//! of them (`/openapi/v3`), and one Swagger 2.0 document of everything
//! (`/openapi/v2`). Each holds the [`super::paths`] of its resources and the catalog's
//! schemas those reference, rendered for its version.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value, json};
use trellis_api::registry::ResourceInfo;

use super::catalog::{Catalog, Gvk};
use super::paths::{api_path, paths, referenced_schemas};
use super::render::{Spec, render_definition};

impl Catalog {
    /// The v3 index: each served group-version's document path, with a hash of its
    /// content so that clients can cache it. [`v3_index_of`] gives the same from
    /// documents already generated.
    pub fn v3_index(&self, resources: &[ResourceInfo]) -> Value {
        v3_index_of(&self.v3_documents(resources))
    }

    /// Every served group-version's v3 document, keyed as the v3 index keys them
    /// (`api/v1`, `apis/apps/v1`).
    pub fn v3_documents(&self, resources: &[ResourceInfo]) -> BTreeMap<String, Value> {
        group_versions(resources)
            .into_iter()
            .filter_map(|(group, version)| {
                let document = self.v3_document(resources, group, version)?;
                Some((api_path(group, version), document))
            })
            .collect()
    }

    /// The OpenAPI 3.0 document of one group-version (`""` for core), or `None` if no
    /// resource of it is served.
    pub fn v3_document(
        &self,
        resources: &[ResourceInfo],
        group: &str,
        version: &str,
    ) -> Option<Value> {
        let served: Vec<&ResourceInfo> = resources
            .iter()
            .filter(|r| r.group == group && r.version == version)
            .collect();
        if served.is_empty() {
            return None;
        }
        let catalog = self.covering(&served);
        let paths = paths(&catalog, &served);
        let schemas = catalog.closure(referenced_schemas(&paths));
        let delete_options = delete_options_kinds(resources);
        let schemas: Map<String, Value> = schemas
            .into_iter()
            .map(|(name, schema)| {
                let rendered = render_definition(name, schema, Spec::V3, &delete_options);
                (name.to_owned(), rendered)
            })
            .collect();
        let paths: Map<String, Value> = paths
            .iter()
            .map(|(path, item)| (path.clone(), item.render(Spec::V3)))
            .collect();
        Some(json!({
            "openapi": "3.0.0",
            "info": { "title": "Trellis", "version": env!("CARGO_PKG_VERSION") },
            "paths": paths,
            "components": {
                "schemas": schemas,
                "securitySchemes": {
                    "BearerToken": {
                        "type": "apiKey",
                        "name": "authorization",
                        "in": "header",
                        "description": "Bearer token authentication",
                    },
                },
            },
            "security": [{ "BearerToken": [] }],
        }))
    }

    /// The Swagger 2.0 document of every served resource.
    pub fn v2_document(&self, resources: &[ResourceInfo]) -> Value {
        let served: Vec<&ResourceInfo> = resources.iter().collect();
        let catalog = self.covering(&served);
        let paths = paths(&catalog, &served);
        let delete_options = delete_options_kinds(resources);
        let definitions: Map<String, Value> = catalog
            .closure(referenced_schemas(&paths))
            .into_iter()
            .map(|(name, schema)| {
                let rendered = render_definition(name, schema, Spec::V2, &delete_options);
                (name.to_owned(), rendered)
            })
            .collect();
        let paths: Map<String, Value> = paths
            .iter()
            .map(|(path, item)| (path.clone(), item.render(Spec::V2)))
            .collect();
        json!({
            "swagger": "2.0",
            "info": { "title": "Trellis", "version": env!("CARGO_PKG_VERSION") },
            "paths": paths,
            "definitions": definitions,
            "securityDefinitions": {
                "BearerToken": {
                    "type": "apiKey",
                    "name": "authorization",
                    "in": "header",
                    "description": "Bearer token authentication",
                },
            },
            "security": [{ "BearerToken": [] }],
        })
    }
}

/// [`Catalog::v3_index`] of the built-in catalog.
pub fn v3_index(resources: &[ResourceInfo]) -> Value {
    Catalog::builtin().v3_index(resources)
}

/// [`Catalog::v3_documents`] of the built-in catalog.
pub fn v3_documents(resources: &[ResourceInfo]) -> BTreeMap<String, Value> {
    Catalog::builtin().v3_documents(resources)
}

/// The v3 index of `documents`, as [`v3_documents`] returns them.
pub fn v3_index_of(documents: &BTreeMap<String, Value>) -> Value {
    let paths: Map<String, Value> = documents
        .iter()
        .map(|(path, document)| {
            let url = format!("/openapi/v3/{path}?hash={}", content_hash(document));
            (path.clone(), json!({ "serverRelativeURL": url }))
        })
        .collect();
    json!({ "paths": paths })
}

/// [`Catalog::v3_document`] of the built-in catalog.
pub fn v3_document(resources: &[ResourceInfo], group: &str, version: &str) -> Option<Value> {
    Catalog::builtin().v3_document(resources, group, version)
}

/// [`Catalog::v2_document`] of the built-in catalog.
pub fn v2_document(resources: &[ResourceInfo]) -> Value {
    Catalog::builtin().v2_document(resources)
}

/// The hash the v3 index puts in each document's URL: 128-bit FNV-1a of the document
/// as `serde_json::to_vec` writes it, in hex. Stable across runs and builds, so that
/// clients' caches stay valid until the content changes; the server can compare it
/// with a request's `?hash=` and use it as the `ETag`.
pub fn content_hash(document: &Value) -> String {
    let mut hash = Fnv1a128::default();
    // Writing a `Value` to a sink that cannot fail cannot fail.
    let _ = serde_json::to_writer(&mut hash, document);
    format!("{:032X}", hash.0)
}

/// 128-bit FNV-1a, fed through `io::Write` so that documents are hashed as they are
/// written out rather than serialized into a buffer first.
#[derive(Debug)]
pub(super) struct Fnv1a128(pub(super) u128);

impl Default for Fnv1a128 {
    fn default() -> Self {
        Fnv1a128(0x6c62_272e_07bb_0142_62b8_2175_6295_c58d)
    }
}

impl std::io::Write for Fnv1a128 {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;
        for b in buf {
            self.0 = (self.0 ^ u128::from(*b)).wrapping_mul(PRIME);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub(super) fn group_versions(resources: &[ResourceInfo]) -> BTreeSet<(&str, &str)> {
    resources
        .iter()
        .map(|r| (r.group.as_str(), r.version.as_str()))
        .collect()
}

/// `DeleteOptions` is accepted by every group-version, and says so.
fn delete_options_kinds(resources: &[ResourceInfo]) -> Vec<Gvk> {
    group_versions(resources)
        .into_iter()
        .map(|(group, version)| Gvk::new(group, version, "DeleteOptions"))
        .collect()
}
