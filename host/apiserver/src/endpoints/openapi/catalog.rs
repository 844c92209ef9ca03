//! The catalog: which kinds and schemas exist. The built-in kinds' schemas come from
//! the `k8s-openapi` types' `schemars` implementations, generated once; custom
//! resources join a copy from their CRDs. Every `$ref` in it points at
//! `#/components/schemas/<name>`; [`super::render`] rewrites them for each version.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::OnceLock;

use k8s_openapi::schemars::generate::SchemaSettings;
use k8s_openapi::schemars::{JsonSchema, SchemaGenerator};
use k8s_openapi::{ListableResource, Resource};
use serde_json::{Map, Value, json};
use trellis_api::registry::ResourceInfo;

/// Where `$ref`s point in the catalog and in the v3 documents.
pub(super) const V3_REF_PREFIX: &str = "#/components/schemas/";
/// Where `$ref`s point in the v2 document.
pub(super) const V2_REF_PREFIX: &str = "#/definitions/";
pub(super) const GVK_EXTENSION: &str = "x-kubernetes-group-version-kind";

/// A kind as `x-kubernetes-group-version-kind` names it; the group is `""` for core.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Gvk {
    pub(super) group: String,
    pub(super) version: String,
    pub(super) kind: String,
}

impl Gvk {
    pub(super) fn new(group: &str, version: &str, kind: &str) -> Self {
        Gvk {
            group: group.to_owned(),
            version: version.to_owned(),
            kind: kind.to_owned(),
        }
    }

    pub(super) fn of<T: Resource>() -> Self {
        Gvk::new(T::GROUP, T::VERSION, T::KIND)
    }

    fn of_list<T: ListableResource>() -> Self {
        Gvk::new(T::GROUP, T::VERSION, T::LIST_KIND)
    }

    pub(super) fn to_value(&self) -> Value {
        json!({ "group": self.group, "version": self.version, "kind": self.kind })
    }
}

pub(super) fn schema_name<T: JsonSchema>() -> String {
    T::schema_name().into_owned()
}

pub(super) fn schema_ref(name: &str) -> Value {
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
    pub(super) schemas: BTreeMap<String, Value>,
    /// The schema of each kind, list kinds included.
    pub(super) kinds: BTreeMap<Gvk, String>,
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

    pub(super) fn kind_schema(&self, group: &str, version: &str, kind: &str) -> Option<&str> {
        self.kinds
            .get(&Gvk::new(group, version, kind))
            .map(String::as_str)
    }

    /// This catalog, or a copy with a permissive schema for each served kind it lacks.
    pub(super) fn covering(&self, resources: &[&ResourceInfo]) -> Cow<'_, Catalog> {
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
    pub(super) fn closure(
        &self,
        roots: impl IntoIterator<Item = String>,
    ) -> BTreeMap<&str, &Value> {
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
}

/// Kubernetes' schema name for a custom kind: the group reversed, then version and kind.
fn custom_schema_name(group: &str, version: &str, kind: &str) -> String {
    let mut parts: Vec<&str> = group.split('.').filter(|p| !p.is_empty()).collect();
    parts.reverse();
    parts.push(version);
    parts.push(kind);
    parts.join(".")
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
        apps, authentication, authorization, autoscaling, batch, certificates, coordination, core,
        discovery, node, policy, rbac, scheduling, storage,
    };
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1 as apiextensions;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;
    use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1 as apiregistration;

    let mut b = Builder::new();
    b.listable::<core::v1::ConfigMap>();
    b.listable::<core::v1::Endpoints>();
    b.listable::<core::v1::Event>();
    b.listable::<core::v1::LimitRange>();
    b.listable::<core::v1::ResourceQuota>();
    b.listable::<core::v1::ReplicationController>();
    b.listable::<core::v1::Namespace>();
    b.listable::<core::v1::Node>();
    b.listable::<core::v1::Pod>();
    b.listable::<core::v1::Secret>();
    b.listable::<core::v1::ServiceAccount>();
    b.listable::<core::v1::Service>();
    b.listable::<apps::v1::Deployment>();
    b.listable::<apps::v1::ReplicaSet>();
    b.listable::<apps::v1::DaemonSet>();
    b.listable::<apps::v1::StatefulSet>();
    b.listable::<apps::v1::ControllerRevision>();
    b.listable::<batch::v1::Job>();
    b.listable::<batch::v1::CronJob>();
    b.listable::<core::v1::PersistentVolumeClaim>();
    b.listable::<core::v1::PersistentVolume>();
    b.listable::<storage::v1::StorageClass>();
    // Both served versions of the autoscaler: kubectl explains and applies either.
    b.listable::<autoscaling::v2::HorizontalPodAutoscaler>();
    b.listable::<autoscaling::v1::HorizontalPodAutoscaler>();
    b.listable::<apiregistration::APIService>();
    b.listable::<discovery::v1::EndpointSlice>();
    b.listable::<policy::v1::PodDisruptionBudget>();
    b.listable::<node::v1::RuntimeClass>();
    b.listable::<scheduling::v1::PriorityClass>();
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
pub(super) const SCHEMA_KEYWORDS: &[&str] = &["items", "additionalProperties", "not"];
/// Keywords whose value is a list of schemas.
pub(super) const SCHEMA_LIST_KEYWORDS: &[&str] = &["allOf", "oneOf", "anyOf"];
/// Keywords whose value maps names to schemas.
pub(super) const SCHEMA_MAP_KEYWORDS: &[&str] = &["properties", "patternProperties"];

/// The subschemas of `schema`, one level down: where a `$ref` may sit. Everything else
/// in a schema (`enum`, `default`, `example`, extensions) is data, even when it looks
/// like a schema.
pub(super) fn subschemas(schema: &Map<String, Value>) -> impl Iterator<Item = &Value> {
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
pub(super) fn collect_refs(schema: &Value, out: &mut Vec<String>) {
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
