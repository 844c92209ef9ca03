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

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

use k8s_openapi::schemars::generate::SchemaSettings;
use k8s_openapi::schemars::{JsonSchema, SchemaGenerator};
use k8s_openapi::{ListableResource, Resource};
use serde_json::{Map, Value, json};
use trellis_api::registry::{ResourceInfo, Subresource};

/// Where `$ref`s point in the catalog and in the v3 documents.
const V3_REF_PREFIX: &str = "#/components/schemas/";
/// Where `$ref`s point in the v2 document.
const V2_REF_PREFIX: &str = "#/definitions/";
const GVK_EXTENSION: &str = "x-kubernetes-group-version-kind";
const ACTION_EXTENSION: &str = "x-kubernetes-action";

/// The patch media types the server accepts.
const PATCH_MEDIA_TYPES: &[&str] = &[
    "application/apply-patch+yaml",
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
];
/// The patch media types the v3 documents advertise: all but strategic merge patch,
/// which kubectl would otherwise compute from schemas that lack patch merge keys (lists
/// of containers would be sent whole instead of merged by name).
pub const V3_PATCH_MEDIA_TYPES: &[&str] = &[
    "application/apply-patch+yaml",
    "application/json-patch+json",
    "application/merge-patch+json",
];
/// The media types object bodies may come in.
const BODY_MEDIA_TYPES: &[&str] = &["application/json", "application/yaml"];

/// A kind as `x-kubernetes-group-version-kind` names it; the group is `""` for core.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Gvk {
    group: String,
    version: String,
    kind: String,
}

impl Gvk {
    fn new(group: &str, version: &str, kind: &str) -> Self {
        Gvk {
            group: group.to_owned(),
            version: version.to_owned(),
            kind: kind.to_owned(),
        }
    }

    fn of<T: Resource>() -> Self {
        Gvk::new(T::GROUP, T::VERSION, T::KIND)
    }

    fn of_list<T: ListableResource>() -> Self {
        Gvk::new(T::GROUP, T::VERSION, T::LIST_KIND)
    }

    fn to_value(&self) -> Value {
        json!({ "group": self.group, "version": self.version, "kind": self.kind })
    }
}

fn schema_name<T: JsonSchema>() -> String {
    T::schema_name().into_owned()
}

fn schema_ref(name: &str) -> Value {
    json!({ "$ref": format!("{V3_REF_PREFIX}{name}") })
}

/// The schemas the documents draw from, by Kubernetes' dotted name, and which schema
/// describes each kind.
///
/// [`Catalog::builtin`] holds the built-in kinds; custom resources join a clone through
/// [`Catalog::insert_custom_kind`]. Served resources without a schema get a permissive
/// one (any fields) so that their paths, and `fieldValidation`, are still published.
#[derive(Clone, Debug, Default)]
pub struct Catalog {
    /// Schemas with `$ref`s of the form `#/components/schemas/<name>`, as `k8s-openapi`
    /// gives them (a `$ref` may carry a sibling `description`), plus kind extensions.
    schemas: BTreeMap<String, Value>,
    /// The schema of each kind, list kinds included.
    kinds: BTreeMap<Gvk, String>,
}

impl Catalog {
    /// The built-in kinds of [`trellis_api::registry::builtins`], their lists, and the
    /// kinds requests and responses use (`Status`, `DeleteOptions`, `autoscaling/v1`
    /// `Scale`, `Binding`), generated on first use.
    pub fn builtin() -> &'static Catalog {
        static BUILTIN: OnceLock<Catalog> = OnceLock::new();
        BUILTIN.get_or_init(builtin_catalog)
    }

    /// Adds a custom resource's kind and list kind from its CRD's `openAPIV3Schema`,
    /// named as Kubernetes names them (`com.example.stable.v1.CronTab` for the group
    /// `stable.example.com`). `apiVersion`, `kind` and `metadata` (an `ObjectMeta`) are
    /// filled in where the schema leaves them out.
    pub fn insert_custom_kind(&mut self, resource: &ResourceInfo, open_api_v3_schema: Value) {
        let name = custom_schema_name(&resource.group, &resource.version, &resource.kind);
        let mut schema = match open_api_v3_schema {
            Value::Object(m) => m,
            _ => Map::new(),
        };
        schema
            .entry("type")
            .or_insert_with(|| Value::from("object"));
        let properties = schema
            .entry("properties")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(properties) = properties {
            for field in ["apiVersion", "kind"] {
                properties
                    .entry(field)
                    .or_insert_with(|| json!({ "type": "string" }));
            }
            let object_meta =
                schema_name::<k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>();
            properties.insert("metadata".to_owned(), schema_ref(&object_meta));
        }
        let schema = Value::Object(schema);
        let list = list_schema(&name, &resource.kind, &resource.list_kind(), &schema);
        let gvk = Gvk::new(&resource.group, &resource.version, &resource.kind);
        let list_gvk = Gvk::new(&resource.group, &resource.version, &resource.list_kind());
        self.insert_kind(gvk, name.clone(), schema);
        let list_name =
            custom_schema_name(&resource.group, &resource.version, &resource.list_kind());
        self.insert_kind(list_gvk, list_name, list);
    }

    fn insert_kind(&mut self, gvk: Gvk, name: String, mut schema: Value) {
        if let Value::Object(m) = &mut schema {
            m.insert(GVK_EXTENSION.to_owned(), json!([gvk.to_value()]));
        }
        self.schemas.insert(name.clone(), schema);
        self.kinds.insert(gvk, name);
    }

    fn kind_schema(&self, group: &str, version: &str, kind: &str) -> Option<&str> {
        self.kinds
            .get(&Gvk::new(group, version, kind))
            .map(String::as_str)
    }

    /// This catalog, or a copy with a permissive schema for each served kind it lacks.
    fn covering(&self, resources: &[&ResourceInfo]) -> Cow<'_, Catalog> {
        let missing: Vec<&&ResourceInfo> = resources
            .iter()
            .filter(|r| self.kind_schema(&r.group, &r.version, &r.kind).is_none())
            .collect();
        if missing.is_empty() {
            return Cow::Borrowed(self);
        }
        let mut copy = self.clone();
        for r in missing {
            copy.insert_custom_kind(
                r,
                json!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true }),
            );
        }
        Cow::Owned(copy)
    }

    /// `roots` and every schema they reference, directly or not.
    fn closure(&self, roots: impl IntoIterator<Item = String>) -> BTreeMap<&str, &Value> {
        let mut out = BTreeMap::new();
        let mut pending: Vec<String> = roots.into_iter().collect();
        while let Some(name) = pending.pop() {
            let Some((key, schema)) = self.schemas.get_key_value(&name) else {
                continue;
            };
            if out.insert(key.as_str(), schema).is_none() {
                collect_refs(schema, &mut pending);
            }
        }
        out
    }

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
struct Fnv1a128(u128);

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

/// `api/v1` or `apis/apps/v1`: the path of a group-version, as the v3 index keys it.
pub fn api_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

/// Kubernetes' schema name for a custom kind: the group reversed, then version and kind.
fn custom_schema_name(group: &str, version: &str, kind: &str) -> String {
    let mut parts: Vec<&str> = group.split('.').filter(|p| !p.is_empty()).collect();
    parts.reverse();
    parts.push(version);
    parts.push(kind);
    parts.join(".")
}

fn group_versions(resources: &[ResourceInfo]) -> BTreeSet<(&str, &str)> {
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

/// A list kind's schema: `items` of the item kind and the usual list metadata.
fn list_schema(item: &str, kind: &str, list_kind: &str, item_schema: &Value) -> Value {
    let type_field = |field: &str| {
        item_schema
            .pointer(&format!("/properties/{field}"))
            .cloned()
            .unwrap_or_else(|| json!({ "type": "string" }))
    };
    let list_meta = schema_name::<k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta>();
    let mut metadata = schema_ref(&list_meta);
    metadata["description"] = Value::from("Standard list metadata.");
    json!({
        "description": format!("{list_kind} is a list of {kind} objects."),
        "type": "object",
        "properties": {
            "apiVersion": type_field("apiVersion"),
            "kind": type_field("kind"),
            "items": {
                "description": format!("The {kind} objects of the list."),
                "type": "array",
                "items": schema_ref(item),
            },
            "metadata": metadata,
        },
        "required": ["items"],
    })
}

/// Collects the built-in schemas through one generator, so that each type is generated
/// once and referenced by name everywhere else.
struct Builder {
    generator: SchemaGenerator,
    kinds: Vec<(Gvk, String)>,
    /// List kinds: the list's kind, its schema name, and its items' kind and schema.
    lists: Vec<(Gvk, String, String, String)>,
}

impl Builder {
    fn new() -> Self {
        let settings = SchemaSettings::openapi3().with(|s| {
            // Documents are rendered from the schemas as `k8s-openapi` writes them;
            // schemars' OpenAPI transforms would also fold `$ref` siblings for v2.
            s.transforms = Vec::new();
            s.meta_schema = None;
        });
        Builder {
            generator: settings.into_generator(),
            kinds: Vec::new(),
            lists: Vec::new(),
        }
    }

    /// A schema that is not one kind of one group-version.
    fn schema<T: JsonSchema>(&mut self) -> String {
        self.generator.subschema_for::<T>();
        schema_name::<T>()
    }

    fn kind<T: Resource + JsonSchema>(&mut self) -> String {
        let name = self.schema::<T>();
        self.kinds.push((Gvk::of::<T>(), name.clone()));
        name
    }

    /// A kind and its list kind, named as Kubernetes names it (`…v1.PodList`).
    fn listable<T: ListableResource + JsonSchema>(&mut self) {
        let item = self.kind::<T>();
        let list = match item.strip_suffix(T::KIND) {
            Some(prefix) => format!("{prefix}{}", T::LIST_KIND),
            None => format!("{item}List"),
        };
        self.lists
            .push((Gvk::of_list::<T>(), list, item, T::KIND.to_owned()));
    }

    fn finish(mut self) -> Catalog {
        self.schema::<k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta>();
        let mut catalog = Catalog {
            schemas: self.generator.take_definitions(false).into_iter().collect(),
            kinds: BTreeMap::new(),
        };
        for (gvk, name) in self.kinds {
            if let Some(schema) = catalog.schemas.remove(&name) {
                catalog.insert_kind(gvk, name, schema);
            }
        }
        for (gvk, name, item, item_kind) in self.lists {
            if let Some(item_schema) = catalog.schemas.get(&item) {
                let list = list_schema(&item, &item_kind, &gvk.kind, item_schema);
                catalog.insert_kind(gvk, name, list);
            }
        }
        catalog
    }
}

fn builtin_catalog() -> Catalog {
    use k8s_openapi::api::{
        apps, authentication, authorization, autoscaling, certificates, coordination, core, rbac,
    };
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1 as apiextensions;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;

    let mut b = Builder::new();
    b.listable::<core::v1::ConfigMap>();
    b.listable::<core::v1::Endpoints>();
    b.listable::<core::v1::Event>();
    b.listable::<core::v1::LimitRange>();
    b.listable::<core::v1::ResourceQuota>();
    b.listable::<core::v1::Namespace>();
    b.listable::<core::v1::Node>();
    b.listable::<core::v1::Pod>();
    b.listable::<core::v1::Secret>();
    b.listable::<core::v1::ServiceAccount>();
    b.listable::<core::v1::Service>();
    b.listable::<apps::v1::Deployment>();
    b.listable::<apps::v1::ReplicaSet>();
    b.listable::<coordination::v1::Lease>();
    b.listable::<certificates::v1::CertificateSigningRequest>();
    b.listable::<rbac::v1::Role>();
    b.listable::<rbac::v1::ClusterRole>();
    b.listable::<rbac::v1::RoleBinding>();
    b.listable::<rbac::v1::ClusterRoleBinding>();
    b.listable::<apiextensions::CustomResourceDefinition>();
    b.kind::<authentication::v1::SelfSubjectReview>();
    b.kind::<authorization::v1::SelfSubjectAccessReview>();
    b.kind::<authorization::v1::SelfSubjectRulesReview>();
    b.kind::<core::v1::Binding>();
    b.kind::<autoscaling::v1::Scale>();
    b.kind::<meta::Status>();
    b.schema::<meta::DeleteOptions>();
    b.schema::<meta::Patch>();
    b.finish()
}

/// Keywords whose value is a schema.
const SCHEMA_KEYWORDS: &[&str] = &["items", "additionalProperties", "not"];
/// Keywords whose value is a list of schemas.
const SCHEMA_LIST_KEYWORDS: &[&str] = &["allOf", "oneOf", "anyOf"];
/// Keywords whose value maps names to schemas.
const SCHEMA_MAP_KEYWORDS: &[&str] = &["properties", "patternProperties"];

/// The subschemas of `schema`, one level down: where a `$ref` may sit. Everything else
/// in a schema (`enum`, `default`, `example`, extensions) is data, even when it looks
/// like a schema.
fn subschemas(schema: &Map<String, Value>) -> impl Iterator<Item = &Value> {
    schema.iter().flat_map(|(k, v)| {
        let k = k.as_str();
        let children: Box<dyn Iterator<Item = &Value>> = if SCHEMA_KEYWORDS.contains(&k) {
            Box::new(std::iter::once(v))
        } else if SCHEMA_LIST_KEYWORDS.contains(&k) {
            Box::new(v.as_array().into_iter().flatten())
        } else if SCHEMA_MAP_KEYWORDS.contains(&k) {
            Box::new(v.as_object().into_iter().flat_map(Map::values))
        } else {
            Box::new(std::iter::empty())
        };
        children
    })
}

/// Every `$ref` target in `schema`, as schema names.
fn collect_refs(schema: &Value, out: &mut Vec<String>) {
    let Value::Object(m) = schema else { return };
    if let Some(name) = m
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix(V3_REF_PREFIX))
    {
        out.push(name.to_owned());
    }
    subschemas(m).for_each(|s| collect_refs(s, out));
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Spec {
    V2,
    V3,
}

/// One catalog schema as a v3 `components.schemas` or v2 `definitions` entry.
fn render_definition(name: &str, schema: &Value, spec: Spec, delete_options: &[Gvk]) -> Value {
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::DeleteOptions;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    let mut out = render(schema, spec);
    let Value::Object(m) = &mut out else {
        return out;
    };
    add_patch_strategies(name, m);
    // The two "int or string" types: schemars gives only the extension; OpenAPI
    // readers want a type too, spelled as Kubernetes spells it in each version.
    if name == IntOrString::schema_name() {
        m.insert("format".to_owned(), Value::from("int-or-string"));
        match spec {
            Spec::V3 => {
                m.insert(
                    "oneOf".to_owned(),
                    json!([{ "type": "integer" }, { "type": "string" }]),
                );
            }
            Spec::V2 => {
                m.insert("type".to_owned(), Value::from("string"));
            }
        }
    } else if name == Quantity::schema_name() {
        match spec {
            Spec::V3 => {
                m.insert(
                    "oneOf".to_owned(),
                    json!([{ "type": "string" }, { "type": "number" }]),
                );
            }
            Spec::V2 => {
                m.insert("type".to_owned(), Value::from("string"));
            }
        }
    } else if name == DeleteOptions::schema_name() {
        let kinds: Vec<Value> = delete_options.iter().map(Gvk::to_value).collect();
        m.insert(GVK_EXTENSION.to_owned(), Value::Array(kinds));
    }
    out
}

/// Adds the built-in kinds' patch strategies and merge keys ([`crate::fieldmanager::merge_keys`]) to
/// schema `name`. kubectl reads them from `/openapi/v2` when it computes a strategic
/// merge patch from it; without them every list would be replaced whole.
fn add_patch_strategies(name: &str, schema: &mut Map<String, Value>) {
    let Some(Value::Object(properties)) = schema.get_mut("properties") else {
        return;
    };
    for rule in crate::fieldmanager::merge_keys::of_schema(name) {
        let Some(Value::Object(property)) = properties.get_mut(rule.field) else {
            continue;
        };
        property.insert(
            "x-kubernetes-patch-strategy".into(),
            Value::from(rule.patch_strategy),
        );
        if !rule.patch_merge_key.is_empty() {
            property.insert(
                "x-kubernetes-patch-merge-key".into(),
                Value::from(rule.patch_merge_key),
            );
        }
    }
}

/// A catalog schema in the dialect of `spec`: v3 wraps a `$ref` that has siblings in
/// `allOf` (OpenAPI 3.0 ignores a `$ref`'s siblings); v2 points `$ref`s at
/// `#/definitions/` and drops `oneOf` and `anyOf`, which Swagger 2.0 lacks.
fn render(schema: &Value, spec: Spec) -> Value {
    let Value::Object(m) = schema else {
        return schema.clone();
    };
    let mut out = Map::with_capacity(m.len());
    for (k, v) in m {
        let key = k.as_str();
        let rendered = match (key, spec) {
            ("$ref", Spec::V2) => v
                .as_str()
                .map(|r| Value::from(r.replacen(V3_REF_PREFIX, V2_REF_PREFIX, 1)))
                .unwrap_or_else(|| v.clone()),
            ("$ref", Spec::V3) if m.len() > 1 => {
                out.insert("allOf".to_owned(), json!([{ "$ref": v }]));
                continue;
            }
            ("oneOf" | "anyOf", Spec::V2) => continue,
            _ if SCHEMA_KEYWORDS.contains(&key) => render(v, spec),
            _ if SCHEMA_LIST_KEYWORDS.contains(&key) => match v {
                Value::Array(items) => items.iter().map(|s| render(s, spec)).collect(),
                other => other.clone(),
            },
            _ if SCHEMA_MAP_KEYWORDS.contains(&key) => match v {
                Value::Object(named) => Value::Object(
                    named
                        .iter()
                        .map(|(name, s)| (name.clone(), render(s, spec)))
                        .collect(),
                ),
                other => other.clone(),
            },
            _ => v.clone(),
        };
        out.insert(k.clone(), rendered);
    }
    Value::Object(out)
}

/// A query or path parameter.
#[derive(Clone, Copy, Debug)]
struct Param {
    name: &'static str,
    /// `string`, `boolean` or `integer`.
    ty: &'static str,
    about: &'static str,
}

const fn param(name: &'static str, ty: &'static str, about: &'static str) -> Param {
    Param { name, ty, about }
}

impl Param {
    fn render(&self, location: &str, spec: Spec) -> Value {
        let mut p = json!({
            "name": self.name,
            "in": location,
            "description": self.about,
        });
        if location == "path" {
            p["required"] = Value::Bool(true);
        }
        match spec {
            Spec::V3 => p["schema"] = json!({ "type": self.ty }),
            Spec::V2 => p["type"] = Value::from(self.ty),
        }
        p
    }
}

const NAME: Param = param("name", "string", "The object's name.");
const NAMESPACE: Param = param("namespace", "string", "The object's namespace.");
const PRETTY: Param = param("pretty", "string", "Indent the output.");
const DRY_RUN: Param = param(
    "dryRun",
    "string",
    "`All` processes the request without persisting anything.",
);
const FIELD_MANAGER: Param = param(
    "fieldManager",
    "string",
    "The name of the actor making the change.",
);
const FIELD_VALIDATION: Param = param(
    "fieldValidation",
    "string",
    "What to do with unknown or duplicate fields in the body: `Ignore` drops \
            them, `Warn` drops them with a warning, `Strict` refuses the request.",
);
const FORCE: Param = param(
    "force",
    "boolean",
    "Take over fields other managers own (apply patches only).",
);
const GRACE_PERIOD_SECONDS: Param = param(
    "gracePeriodSeconds",
    "integer",
    "Seconds before the object is deleted.",
);
const PROPAGATION_POLICY: Param = param(
    "propagationPolicy",
    "string",
    "Whether and how dependents are deleted: `Orphan`, `Background` or \
            `Foreground`.",
);
const LIST_PARAMS: &[Param] = &[
    param(
        "allowWatchBookmarks",
        "boolean",
        "Ask for BOOKMARK events in a watch.",
    ),
    param(
        "continue",
        "string",
        "The token of the next page, from the previous page's metadata.",
    ),
    param(
        "fieldSelector",
        "string",
        "Only objects whose fields match.",
    ),
    param(
        "labelSelector",
        "string",
        "Only objects whose labels match.",
    ),
    param(
        "limit",
        "integer",
        "The most objects to return in one page.",
    ),
    param(
        "resourceVersion",
        "string",
        "The revision to read at or watch from.",
    ),
    param(
        "resourceVersionMatch",
        "string",
        "How `resourceVersion` applies: `Exact` or `NotOlderThan`.",
    ),
    param(
        "sendInitialEvents",
        "boolean",
        "Start a watch with the current objects.",
    ),
    param(
        "timeoutSeconds",
        "integer",
        "End the list or watch after this many seconds.",
    ),
    param("watch", "boolean", "Stream changes instead of listing."),
];
const LOG_PARAMS: &[Param] = &[
    param("container", "string", "The container whose log to read."),
    param("follow", "boolean", "Stream the log as it grows."),
    param(
        "previous",
        "boolean",
        "The log of the previous instance of the container.",
    ),
    param("tailLines", "integer", "Only the last lines."),
    param("timestamps", "boolean", "Prefix each line with its time."),
];

/// What an operation takes as its body.
#[derive(Clone, Debug)]
enum Body {
    /// An object of the named schema, as JSON or YAML.
    Object(String),
    /// A patch, in any of the accepted patch formats.
    Patch,
    /// Optional `DeleteOptions`.
    DeleteOptions,
}

/// What a successful operation answers.
#[derive(Clone, Debug)]
enum Reply {
    /// An object of the named schema.
    Object(String),
    /// Plain text (logs).
    Text,
}

#[derive(Clone, Debug)]
struct Operation {
    method: &'static str,
    action: &'static str,
    id: String,
    description: String,
    gvk: Gvk,
    params: Vec<Param>,
    body: Option<Body>,
    reply: Reply,
    /// Further success codes with the same reply (`201` for creates, `202` for deletes).
    also: &'static [&'static str],
}

impl Operation {
    fn render(&self, spec: Spec) -> Value {
        let mut params: Vec<Value> = self
            .params
            .iter()
            .map(|p| p.render("query", spec))
            .collect();
        let mut op = Map::new();
        op.insert("operationId".to_owned(), Value::from(self.id.clone()));
        op.insert(
            "description".to_owned(),
            Value::from(self.description.clone()),
        );
        let mut responses = Map::new();
        for code in std::iter::once(&"200").chain(self.also) {
            let description = match *code {
                "200" => "OK",
                "201" => "Created",
                _ => "Accepted",
            };
            responses.insert((*code).to_owned(), self.reply(description, spec));
        }
        responses.insert("401".to_owned(), json!({ "description": "Unauthorized" }));
        match spec {
            Spec::V3 => {
                if let Some(body) = &self.body {
                    op.insert("requestBody".to_owned(), body_v3(body));
                }
            }
            Spec::V2 => {
                let consumes: Vec<&str> = match &self.body {
                    Some(Body::Patch) => PATCH_MEDIA_TYPES.to_vec(),
                    _ => vec!["*/*"],
                };
                op.insert("consumes".to_owned(), json!(consumes));
                let produces = match self.reply {
                    Reply::Object(_) => "application/json",
                    Reply::Text => "text/plain",
                };
                op.insert("produces".to_owned(), json!([produces]));
                op.insert("schemes".to_owned(), json!(["https"]));
                if let Some(body) = &self.body {
                    let (schema, required) = body_schema(body);
                    params.push(json!({
                        "name": "body",
                        "in": "body",
                        "required": required,
                        "schema": render(&schema, Spec::V2),
                    }));
                }
            }
        }
        op.insert("parameters".to_owned(), Value::Array(params));
        op.insert("responses".to_owned(), Value::Object(responses));
        op.insert(ACTION_EXTENSION.to_owned(), Value::from(self.action));
        op.insert(GVK_EXTENSION.to_owned(), self.gvk.to_value());
        Value::Object(op)
    }

    fn reply(&self, description: &str, spec: Spec) -> Value {
        let (media_type, schema) = match &self.reply {
            Reply::Object(name) => ("application/json", schema_ref(name)),
            Reply::Text => ("text/plain", json!({ "type": "string" })),
        };
        match spec {
            Spec::V3 => json!({
                "description": description,
                "content": { media_type: { "schema": schema } },
            }),
            Spec::V2 => json!({
                "description": description,
                "schema": render(&schema, Spec::V2),
            }),
        }
    }
}

/// A body's schema and whether it is required.
fn body_schema(body: &Body) -> (Value, bool) {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, Patch};
    match body {
        Body::Object(name) => (schema_ref(name), true),
        Body::Patch => (schema_ref(&schema_name::<Patch>()), true),
        Body::DeleteOptions => (schema_ref(&schema_name::<DeleteOptions>()), false),
    }
}

fn body_v3(body: &Body) -> Value {
    let (schema, required) = body_schema(body);
    let media_types: &[&str] = match body {
        Body::Object(_) => BODY_MEDIA_TYPES,
        Body::Patch => V3_PATCH_MEDIA_TYPES,
        Body::DeleteOptions => &["application/json"],
    };
    let content: Map<String, Value> = media_types
        .iter()
        .map(|t| ((*t).to_owned(), json!({ "schema": schema })))
        .collect();
    json!({ "content": content, "required": required })
}

/// The operations on one path, and the parameters they share.
#[derive(Clone, Debug, Default)]
struct PathItem {
    path_params: Vec<Param>,
    operations: Vec<Operation>,
}

impl PathItem {
    fn render(&self, spec: Spec) -> Value {
        let mut item = Map::new();
        for op in &self.operations {
            item.insert(op.method.to_owned(), op.render(spec));
        }
        let mut params: Vec<Value> = self
            .path_params
            .iter()
            .map(|p| p.render("path", spec))
            .collect();
        params.push(PRETTY.render("query", spec));
        item.insert("parameters".to_owned(), Value::Array(params));
        Value::Object(item)
    }
}

/// The schema names operations refer to, in bodies and replies.
fn referenced_schemas(paths: &BTreeMap<String, PathItem>) -> Vec<String> {
    let mut names = Vec::new();
    for op in paths.values().flat_map(|p| &p.operations) {
        if let Some(body) = &op.body {
            collect_refs(&body_schema(body).0, &mut names);
        }
        if let Reply::Object(name) = &op.reply {
            names.push(name.clone());
        }
    }
    names
}

/// `CoreV1`, `AppsV1`, `RbacAuthorizationV1`: a group-version as operation ids spell it.
fn group_version_word(r: &ResourceInfo) -> String {
    let group: String = if r.group.is_empty() {
        "Core".to_owned()
    } else {
        r.group
            .trim_end_matches(".k8s.io")
            .split(['.', '-'])
            .map(capitalized)
            .collect()
    };
    format!("{group}{}", capitalized(&r.version))
}

fn capitalized(word: &str) -> String {
    let mut chars = word.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// The paths of `resources`, with their operations as the resources' verbs allow.
fn paths(catalog: &Catalog, resources: &[&ResourceInfo]) -> BTreeMap<String, PathItem> {
    let mut paths = BTreeMap::new();
    for r in resources {
        if let Some(resource) = ResourcePaths::new(catalog, r) {
            resource.add_to(&mut paths);
        }
    }
    paths
}

const WRITE_PARAMS: &[Param] = &[DRY_RUN, FIELD_MANAGER, FIELD_VALIDATION];
const PATCH_PARAMS: &[Param] = &[DRY_RUN, FIELD_MANAGER, FIELD_VALIDATION, FORCE];
const DELETE_PARAMS: &[Param] = &[DRY_RUN, GRACE_PERIOD_SECONDS, PROPAGATION_POLICY];

/// One resource's paths: its collection, all namespaces' collection, the object and
/// its subresources.
struct ResourcePaths<'a> {
    r: &'a ResourceInfo,
    gvk: Gvk,
    kind_schema: String,
    list_schema: String,
    /// `/api/v1` or `/apis/apps/v1`.
    base: String,
    /// `…/namespaces/{namespace}/pods` or `…/nodes`.
    collection: String,
    /// The collection's path parameters: `namespace`, or none.
    scope: Vec<Param>,
    /// `CoreV1Namespaced`: what operation ids put between verb and kind.
    id_middle: String,
}

impl<'a> ResourcePaths<'a> {
    fn new(catalog: &Catalog, r: &'a ResourceInfo) -> Option<Self> {
        let kind_schema = catalog.kind_schema(&r.group, &r.version, &r.kind)?;
        let list_schema = catalog
            .kind_schema(&r.group, &r.version, &r.list_kind())
            .unwrap_or(kind_schema);
        let base = format!("/{}", api_path(&r.group, &r.version));
        let (collection, scope) = if r.namespaced {
            let path = format!("{base}/namespaces/{{namespace}}/{}", r.plural);
            (path, vec![NAMESPACE])
        } else {
            (format!("{base}/{}", r.plural), Vec::new())
        };
        let namespaced = if r.namespaced { "Namespaced" } else { "" };
        Some(ResourcePaths {
            gvk: Gvk::new(&r.group, &r.version, &r.kind),
            kind_schema: kind_schema.to_owned(),
            list_schema: list_schema.to_owned(),
            id_middle: format!("{}{namespaced}", group_version_word(r)),
            base,
            collection,
            scope,
            r,
        })
    }

    fn object(&self) -> String {
        format!("{}/{{name}}", self.collection)
    }

    fn object_params(&self) -> Vec<Param> {
        self.scope.iter().copied().chain([NAME]).collect()
    }

    /// An operation on this resource with defaults for the rest: no parameters, no
    /// body, the kind as reply.
    fn op(&self, method: &'static str, action: &'static str, id: String) -> Operation {
        Operation {
            method,
            action,
            id,
            description: String::new(),
            gvk: self.gvk.clone(),
            params: Vec::new(),
            body: None,
            reply: Reply::Object(self.kind_schema.clone()),
            also: &[],
        }
    }

    fn id(&self, verb: &str, suffix: &str) -> String {
        format!("{verb}{}{}{suffix}", self.id_middle, self.r.kind)
    }

    fn add_to(&self, paths: &mut BTreeMap<String, PathItem>) {
        let r = self.r;
        let mut add = |path: String, path_params: Vec<Param>, operations: Vec<Operation>| {
            if !operations.is_empty() {
                let item = PathItem {
                    path_params,
                    operations,
                };
                paths.insert(path, item);
            }
        };
        add(
            self.collection.clone(),
            self.scope.clone(),
            self.collection_ops(),
        );
        if r.namespaced && r.allows("list") {
            let id = format!("list{}{}ForAllNamespaces", group_version_word(r), r.kind);
            let op = Operation {
                description: format!("list or watch {} objects of all namespaces", r.kind),
                params: LIST_PARAMS.to_vec(),
                reply: Reply::Object(self.list_schema.clone()),
                ..self.op("get", "list", id)
            };
            add(format!("{}/{}", self.base, r.plural), Vec::new(), vec![op]);
        }
        let object = self.object();
        add(object.clone(), self.object_params(), self.object_ops(""));
        if r.has(Subresource::Status) {
            add(
                format!("{object}/status"),
                self.object_params(),
                self.object_ops("Status"),
            );
        }
        if r.has(Subresource::Approval) {
            add(
                format!("{object}/approval"),
                self.object_params(),
                self.object_ops("Approval"),
            );
        }
        if r.has(Subresource::Scale) {
            add(
                format!("{object}/scale"),
                self.object_params(),
                self.object_ops("Scale"),
            );
        }
        if r.has(Subresource::Binding) {
            use k8s_openapi::api::core::v1::Binding;
            let binding = schema_name::<Binding>();
            let op = Operation {
                description: format!("bind the specified {} to a node", r.kind),
                gvk: Gvk::of::<Binding>(),
                params: WRITE_PARAMS.to_vec(),
                body: Some(Body::Object(binding.clone())),
                reply: Reply::Object(binding),
                also: &["201", "202"],
                ..self.op("post", "post", self.id("create", "Binding"))
            };
            add(format!("{object}/binding"), self.object_params(), vec![op]);
        }
        if r.has(Subresource::Finalize) {
            let op = Operation {
                description: format!("replace finalize of the specified {}", r.kind),
                params: WRITE_PARAMS.to_vec(),
                body: Some(Body::Object(self.kind_schema.clone())),
                also: &["201"],
                ..self.op("put", "put", self.id("replace", "Finalize"))
            };
            add(format!("{object}/finalize"), self.object_params(), vec![op]);
        }
        if r.has(Subresource::Log) {
            let op = Operation {
                description: format!("read the log of the specified {}", r.kind),
                params: LOG_PARAMS.to_vec(),
                reply: Reply::Text,
                ..self.op("get", "get", self.id("read", "Log"))
            };
            add(format!("{object}/log"), self.object_params(), vec![op]);
        }
    }

    fn collection_ops(&self) -> Vec<Operation> {
        let r = self.r;
        let mut ops = Vec::new();
        if r.allows("list") {
            ops.push(Operation {
                description: format!("list or watch {} objects", r.kind),
                params: LIST_PARAMS.to_vec(),
                reply: Reply::Object(self.list_schema.clone()),
                ..self.op("get", "list", self.id("list", ""))
            });
        }
        if r.allows("create") {
            ops.push(Operation {
                description: format!("create a {}", r.kind),
                params: WRITE_PARAMS.to_vec(),
                body: Some(Body::Object(self.kind_schema.clone())),
                also: &["201", "202"],
                ..self.op("post", "post", self.id("create", ""))
            });
        }
        if r.allows("deletecollection") {
            let selection = LIST_PARAMS
                .iter()
                .filter(|p| !matches!(p.name, "watch" | "allowWatchBookmarks"));
            ops.push(Operation {
                description: format!("delete a collection of {} objects", r.kind),
                params: selection.chain(DELETE_PARAMS).copied().collect(),
                body: Some(Body::DeleteOptions),
                reply: Reply::Object(status_schema()),
                ..self.op(
                    "delete",
                    "deletecollection",
                    self.id("deleteCollection", ""),
                )
            });
        }
        ops
    }

    /// Reads and writes of the whole object (`view` empty), or of its `Status` or
    /// `Scale` view.
    fn object_ops(&self, view: &str) -> Vec<Operation> {
        use k8s_openapi::api::autoscaling::v1::Scale;
        let r = self.r;
        let (gvk, schema) = match view {
            "Scale" => (Gvk::of::<Scale>(), schema_name::<Scale>()),
            _ => (self.gvk.clone(), self.kind_schema.clone()),
        };
        let what = match view {
            "" => format!("the specified {}", r.kind),
            _ => format!("the {} of the specified {}", view.to_lowercase(), r.kind),
        };
        let op = |method, action, verb| Operation {
            gvk: gvk.clone(),
            reply: Reply::Object(schema.clone()),
            ..self.op(method, action, self.id(verb, view))
        };
        let mut ops = Vec::new();
        if r.allows("get") {
            ops.push(Operation {
                description: format!("read {what}"),
                ..op("get", "get", "read")
            });
        }
        if r.allows("update") {
            ops.push(Operation {
                description: format!("replace {what}"),
                params: WRITE_PARAMS.to_vec(),
                body: Some(Body::Object(schema.clone())),
                also: &["201"],
                ..op("put", "put", "replace")
            });
        }
        if r.allows("patch") {
            ops.push(Operation {
                description: format!("partially update {what}"),
                params: PATCH_PARAMS.to_vec(),
                body: Some(Body::Patch),
                also: &["201"],
                ..op("patch", "patch", "patch")
            });
        }
        if view.is_empty() && r.allows("delete") {
            ops.push(Operation {
                description: format!("delete {what}"),
                params: DELETE_PARAMS.to_vec(),
                body: Some(Body::DeleteOptions),
                reply: Reply::Object(status_schema()),
                also: &["202"],
                ..op("delete", "delete", "delete")
            });
        }
        ops
    }
}

fn status_schema() -> String {
    schema_name::<k8s_openapi::apimachinery::pkg::apis::meta::v1::Status>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_api::registry::builtins;

    fn doc(group: &str, version: &str) -> Value {
        v3_document(&builtins(), group, version).unwrap()
    }

    /// Resolves a local `$ref` (`#/components/schemas/x` or `#/definitions/x`).
    fn resolve<'a>(document: &'a Value, reference: &str) -> Option<&'a Value> {
        document.pointer(reference.strip_prefix('#')?)
    }

    /// Follows `$ref` and single-element `allOf` to the schema they stand for.
    fn deref<'a>(document: &'a Value, mut schema: &'a Value) -> &'a Value {
        loop {
            if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
                schema = resolve(document, r).unwrap();
            } else if let Some([only]) = schema
                .get("allOf")
                .and_then(Value::as_array)
                .map(Vec::as_slice)
            {
                schema = only;
            } else {
                return schema;
            }
        }
    }

    fn schema_of_kind<'a>(
        document: &'a Value,
        group: &str,
        version: &str,
        kind: &str,
    ) -> Option<&'a Value> {
        let wanted = json!({ "group": group, "version": version, "kind": kind });
        document["components"]["schemas"]
            .as_object()?
            .values()
            .find(|s| {
                s[GVK_EXTENSION]
                    .as_array()
                    .is_some_and(|kinds| kinds.contains(&wanted))
            })
    }

    fn all_refs(value: &Value, out: &mut Vec<String>) {
        match value {
            Value::Object(m) => {
                for (k, v) in m {
                    match v {
                        Value::String(s) if k == "$ref" => out.push(s.clone()),
                        _ => all_refs(v, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| all_refs(v, out)),
            _ => {}
        }
    }

    #[test]
    fn every_builtin_kind_and_list_kind_has_a_schema_with_its_group_version_kind() {
        for r in builtins() {
            let document = doc(&r.group, &r.version);
            // Reviews are only created: they have no list kind.
            let list_kind = r.allows("list").then(|| r.list_kind());
            for kind in std::iter::once(r.kind.clone()).chain(list_kind) {
                let schema = schema_of_kind(&document, &r.group, &r.version, &kind)
                    .unwrap_or_else(|| panic!("no schema for {}/{} {kind}", r.group, r.version));
                assert_eq!(schema["type"], "object", "{kind}");
            }
        }
        let core = doc("", "v1");
        assert!(schema_of_kind(&core, "", "v1", "Status").is_some());
        assert!(schema_of_kind(&core, "", "v1", "Binding").is_some());
        assert!(schema_of_kind(&core, "", "v1", "DeleteOptions").is_some());
        assert!(schema_of_kind(&doc("apps", "v1"), "autoscaling", "v1", "Scale").is_some());
    }

    #[test]
    fn every_ref_resolves_inside_its_document() {
        let resources = builtins();
        let mut documents: Vec<Value> = group_versions(&resources)
            .into_iter()
            .map(|(g, v)| doc(g, v))
            .collect();
        documents.push(v2_document(&resources));
        for document in &documents {
            let mut refs = Vec::new();
            all_refs(document, &mut refs);
            assert!(!refs.is_empty());
            let prefix = if document.get("swagger").is_some() {
                V2_REF_PREFIX
            } else {
                V3_REF_PREFIX
            };
            for r in refs {
                assert!(r.starts_with(prefix), "{r}");
                assert!(resolve(document, &r).is_some(), "dangling {r}");
            }
        }
    }

    #[test]
    fn deployment_fields_have_kubernetes_types() {
        let document = doc("apps", "v1");
        let deployment = schema_of_kind(&document, "apps", "v1", "Deployment").unwrap();
        let spec = deref(&document, &deployment["properties"]["spec"]);
        assert_eq!(spec["properties"]["replicas"]["type"], "integer");
        // spec.template keeps its description beside the reference, the v3 way.
        let template = &spec["properties"]["template"];
        assert_eq!(
            template["allOf"][0]["$ref"],
            "#/components/schemas/io.k8s.api.core.v1.PodTemplateSpec"
        );
        assert!(template["description"].is_string());

        let meta = deref(&document, &deployment["properties"]["metadata"]);
        let created = deref(&document, &meta["properties"]["creationTimestamp"]);
        assert_eq!(created["type"], "string");
        assert_eq!(created["format"], "date-time");

        let strategy = deref(&document, &spec["properties"]["strategy"]);
        let rolling = deref(&document, &strategy["properties"]["rollingUpdate"]);
        let max_surge = deref(&document, &rolling["properties"]["maxSurge"]);
        assert_eq!(max_surge["x-kubernetes-int-or-string"], true);
        assert_eq!(max_surge["format"], "int-or-string");
        assert_eq!(
            max_surge["oneOf"],
            json!([{ "type": "integer" }, { "type": "string" }])
        );
    }

    #[test]
    fn quantities_accept_strings_and_numbers() {
        let document = doc("", "v1");
        let quantity =
            &document["components"]["schemas"]["io.k8s.apimachinery.pkg.api.resource.Quantity"];
        assert_eq!(
            quantity["oneOf"],
            json!([{ "type": "string" }, { "type": "number" }])
        );
        let v2 = v2_document(&builtins());
        let quantity = &v2["definitions"]["io.k8s.apimachinery.pkg.api.resource.Quantity"];
        assert_eq!(quantity["type"], "string");
        assert!(quantity.get("oneOf").is_none());
        let int_or_string = &v2["definitions"]["io.k8s.apimachinery.pkg.util.intstr.IntOrString"];
        assert_eq!(int_or_string["type"], "string");
        assert_eq!(int_or_string["format"], "int-or-string");
    }

    #[test]
    fn v3_index_lists_each_group_version_with_its_hash() {
        let resources = builtins();
        let index = v3_index(&resources);
        let paths = index["paths"].as_object().unwrap();
        for (path, group, version) in [
            ("api/v1", "", "v1"),
            ("apis/apps/v1", "apps", "v1"),
            (
                "apis/rbac.authorization.k8s.io/v1",
                "rbac.authorization.k8s.io",
                "v1",
            ),
        ] {
            let url = paths[path]["serverRelativeURL"].as_str().unwrap();
            let hash = content_hash(&doc(group, version));
            assert_eq!(url, format!("/openapi/v3/{path}?hash={hash}"));
        }
        assert_eq!(paths.len(), group_versions(&resources).len());
        assert_eq!(v3_index_of(&v3_documents(&resources)), index);
        // The hash is of the bytes `serde_json::to_vec` writes, as documented.
        let core = doc("", "v1");
        let bytes = serde_json::to_vec(&core).unwrap();
        let mut expected = Fnv1a128::default();
        std::io::Write::write_all(&mut expected, &bytes).unwrap();
        assert_eq!(content_hash(&core), format!("{:032X}", expected.0));
        assert_ne!(
            content_hash(&doc("", "v1")),
            content_hash(&doc("apps", "v1"))
        );
        assert!(v3_document(&resources, "batch", "v1").is_none());
    }

    #[test]
    fn writes_take_field_validation_and_patches_name_their_kind() {
        let document = doc("", "v1");
        let create = &document["paths"]["/api/v1/namespaces/{namespace}/pods"]["post"];
        assert_eq!(create[ACTION_EXTENSION], "post");
        assert_eq!(
            create[GVK_EXTENSION],
            json!({ "group": "", "version": "v1", "kind": "Pod" })
        );
        let names: Vec<&str> = create["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|p| p["name"].as_str())
            .collect();
        for wanted in ["fieldValidation", "dryRun", "fieldManager"] {
            assert!(names.contains(&wanted), "{wanted} missing from {names:?}");
        }
        // `namespaces/finalize` is only replaced.
        let finalize = document["paths"]["/api/v1/namespaces/{name}/finalize"]
            .as_object()
            .unwrap();
        let methods: Vec<&String> = finalize.keys().filter(|k| *k != "parameters").collect();
        assert_eq!(methods, ["put"]);
        assert_eq!(
            finalize["put"]["operationId"],
            "replaceCoreV1NamespaceFinalize"
        );
        // kubectl takes the first PATCH of a kind it meets, so all of them must agree.
        // (Reviews are only created.)
        for r in builtins().into_iter().filter(|r| r.allows("patch")) {
            let document = doc(&r.group, &r.version);
            let patches: Vec<&Value> = document["paths"]
                .as_object()
                .unwrap()
                .values()
                .filter_map(|item| item.get("patch"))
                .filter(|op| op[GVK_EXTENSION]["kind"] == r.kind.as_str())
                .collect();
            assert!(!patches.is_empty(), "no patch for {}", r.kind);
            for op in patches {
                assert!(
                    op["parameters"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|p| p["name"] == "fieldValidation")
                );
                let content = op["requestBody"]["content"].as_object().unwrap();
                assert!(content.contains_key("application/merge-patch+json"));
                assert!(!content.contains_key("application/strategic-merge-patch+json"));
            }
        }
    }

    #[test]
    fn operation_ids_are_unique_within_each_document() {
        let resources = builtins();
        let mut documents: Vec<Value> = v3_documents(&resources).into_values().collect();
        documents.push(v2_document(&resources));
        for document in documents {
            let mut seen = BTreeSet::new();
            for item in document["paths"].as_object().unwrap().values() {
                for (method, op) in item.as_object().unwrap() {
                    if method == "parameters" {
                        continue;
                    }
                    let id = op["operationId"].as_str().unwrap();
                    assert!(seen.insert(id.to_owned()), "{id} twice");
                    assert!(op[ACTION_EXTENSION].is_string(), "{id}");
                }
            }
        }
    }

    #[test]
    fn v2_schemas_carry_the_merge_keys_kubectl_apply_needs() {
        let v2 = v2_document(&builtins());
        let defs = &v2["definitions"];
        let containers = &defs["io.k8s.api.core.v1.PodSpec"]["properties"]["containers"];
        assert_eq!(containers["x-kubernetes-patch-merge-key"], "name");
        assert_eq!(containers["x-kubernetes-patch-strategy"], "merge");
        let ports = &defs["io.k8s.api.core.v1.ServiceSpec"]["properties"]["ports"];
        assert_eq!(ports["x-kubernetes-patch-merge-key"], "port");
        // Every entry names a schema and a property the documents have.
        for crate::fieldmanager::merge_keys::MergeRule { schema, field, .. } in
            crate::fieldmanager::merge_keys::BUILTIN
        {
            assert!(
                defs[*schema]["properties"].get(*field).is_some(),
                "{schema}.{field} is not in the v2 document"
            );
        }
    }

    #[test]
    fn explain_finds_kinds_through_their_paths() {
        // What `kubectl explain` does: the collection or object path's operations name
        // the kind, and the schema with that kind is the one explained. Reviews, which
        // are only created, name it in their POST.
        for r in builtins() {
            let document = doc(&r.group, &r.version);
            let prefix = format!("/{}", api_path(&r.group, &r.version));
            let candidates = [
                format!("{prefix}/{}", r.plural),
                format!("{prefix}/namespaces/{{namespace}}/{}/{{name}}", r.plural),
                format!("{prefix}/{}/{{name}}", r.plural),
            ];
            let gvk = candidates
                .iter()
                .filter_map(|p| document["paths"].get(p))
                .find_map(|item| {
                    item["get"]
                        .get(GVK_EXTENSION)
                        .or(item["post"].get(GVK_EXTENSION))
                })
                .unwrap_or_else(|| panic!("no path for {}", r.plural));
            assert_eq!(gvk["kind"], r.kind.as_str());
        }
    }

    #[test]
    fn schemas_use_only_openapi_3_0_constructs() {
        fn check(schema: &Value, at: &str) {
            let m = schema
                .as_object()
                .unwrap_or_else(|| panic!("{at}: not an object schema: {schema}"));
            for k in ["$defs", "definitions", "const", "prefixItems", "nullable"] {
                assert!(!m.contains_key(k), "{at}: {k}");
            }
            if let Some(t) = m.get("type") {
                assert!(t.is_string(), "{at}: type {t}");
            }
            if m.contains_key("$ref") {
                assert_eq!(m.len(), 1, "{at}: $ref with siblings");
            }
            subschemas(m).for_each(|s| check(s, at));
        }
        for (g, v) in group_versions(&builtins()) {
            let document = doc(g, v);
            for (name, schema) in document["components"]["schemas"].as_object().unwrap() {
                check(schema, name);
            }
        }
    }

    #[test]
    fn v2_document_covers_every_kind_with_definitions_refs() {
        let resources = builtins();
        let v2 = v2_document(&resources);
        assert_eq!(v2["swagger"], "2.0");
        let definitions = v2["definitions"].as_object().unwrap();
        for r in &resources {
            let wanted = json!({ "group": r.group, "version": r.version, "kind": r.kind });
            assert!(
                definitions.values().any(|d| d[GVK_EXTENSION]
                    .as_array()
                    .is_some_and(|k| k.contains(&wanted))),
                "{}",
                r.kind
            );
        }
        let patch =
            &v2["paths"]["/apis/apps/v1/namespaces/{namespace}/deployments/{name}"]["patch"];
        assert_eq!(patch[GVK_EXTENSION]["kind"], "Deployment");
        let body = patch["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["in"] == "body")
            .unwrap();
        assert_eq!(
            body["schema"]["$ref"],
            "#/definitions/io.k8s.apimachinery.pkg.apis.meta.v1.Patch"
        );
        assert!(
            patch["parameters"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == "fieldValidation" && p["type"] == "string")
        );
    }

    /// Kubernetes' name for a `k8s-openapi` type, derived from its Rust path
    /// (`k8s_openapi::v1_33::api::apps::v1::deployment::Deployment`).
    fn dotted_name_from_rust_path(path: &str) -> String {
        let mut segments: Vec<&str> = path
            .split("::")
            .skip(1)
            .filter(|s| !s.starts_with("v1_"))
            .collect();
        let ty = segments.pop().unwrap();
        // The file module the type is defined in.
        if segments
            .last()
            .is_some_and(|m| m.replace('_', "") == ty.to_lowercase())
        {
            segments.pop();
        }
        let root = match segments.first().copied() {
            Some("apiextensions_apiserver") => "apiextensions-apiserver",
            Some("kube_aggregator") => "kube-aggregator",
            Some(other) => other,
            None => "",
        };
        let mut parts = vec!["io", "k8s", root];
        parts.extend(&segments[1..]);
        parts.push(ty);
        parts.join(".")
    }

    #[test]
    fn schema_names_are_kubernetes_names_of_the_rust_types() {
        use k8s_openapi::api::{apps, core};
        use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1 as apiextensions;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;
        fn check<T: JsonSchema>() {
            let derived = dotted_name_from_rust_path(std::any::type_name::<T>());
            assert_eq!(T::schema_name(), derived);
        }
        check::<apps::v1::Deployment>();
        check::<apps::v1::DeploymentSpec>();
        check::<core::v1::PodTemplateSpec>();
        check::<meta::ObjectMeta>();
        check::<apiextensions::CustomResourceDefinition>();
        check::<k8s_openapi::apimachinery::pkg::util::intstr::IntOrString>();
        // Every generated name is a Kubernetes one: no schemars collision suffixes.
        for name in Catalog::builtin().schemas.keys() {
            assert!(name.starts_with("io.k8s."), "{name}");
            let stem = name.trim_end_matches(|c: char| c.is_ascii_digit());
            assert!(
                stem == name || !Catalog::builtin().schemas.contains_key(stem),
                "{name}"
            );
        }
    }

    #[test]
    fn custom_resources_get_paths_and_a_schema_under_their_own_name() {
        let mut resources = builtins();
        let mut widget = resources[0].clone();
        widget.group = "stable.example.com".to_owned();
        widget.kind = "CronTab".to_owned();
        widget.plural = "crontabs".to_owned();
        resources.push(widget.clone());

        // Without a schema: permissive, but still patchable with fieldValidation.
        let document = v3_document(&resources, "stable.example.com", "v1").unwrap();
        let schemas = &document["components"]["schemas"];
        let crontab = &schemas["com.example.stable.v1.CronTab"];
        assert_eq!(crontab["x-kubernetes-preserve-unknown-fields"], true);
        assert_eq!(
            crontab[GVK_EXTENSION],
            json!([{ "group": "stable.example.com", "version": "v1", "kind": "CronTab" }])
        );
        assert!(schemas.get("com.example.stable.v1.CronTabList").is_some());
        let patch = &document["paths"]["/apis/stable.example.com/v1/namespaces/{namespace}/crontabs/{name}"]
            ["patch"];
        assert_eq!(patch[GVK_EXTENSION]["kind"], "CronTab");

        // With its CRD's schema.
        let mut catalog = Catalog::builtin().clone();
        catalog.insert_custom_kind(
            &widget,
            json!({ "type": "object", "properties": { "spec": { "type": "object", "properties": { "cronSpec": { "type": "string" } } } } }),
        );
        let document = catalog
            .v3_document(&resources, "stable.example.com", "v1")
            .unwrap();
        let crontab = &document["components"]["schemas"]["com.example.stable.v1.CronTab"];
        assert_eq!(
            crontab["properties"]["spec"]["properties"]["cronSpec"]["type"],
            "string"
        );
        assert_eq!(
            crontab["properties"]["metadata"]["$ref"],
            "#/components/schemas/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
        );
        assert!(
            document["components"]["schemas"]
                .get("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
                .is_some()
        );
    }
}
