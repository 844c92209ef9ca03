//! The paths: each served resource's collection, object and subresource paths, with
//! the operations its verbs allow, their parameters, bodies and replies, and the
//! `x-kubernetes-group-version-kind` through which `kubectl explain` finds a kind.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};
use trellis_api::registry::{ResourceInfo, Subresource};

use super::catalog::{Catalog, GVK_EXTENSION, Gvk, collect_refs, schema_name, schema_ref};
use super::render::{Spec, render};

pub(super) const ACTION_EXTENSION: &str = "x-kubernetes-action";

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

/// `api/v1` or `apis/apps/v1`: the path of a group-version, as the v3 index keys it.
pub fn api_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
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
pub(super) struct PathItem {
    path_params: Vec<Param>,
    operations: Vec<Operation>,
}

impl PathItem {
    pub(super) fn render(&self, spec: Spec) -> Value {
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
pub(super) fn referenced_schemas(paths: &BTreeMap<String, PathItem>) -> Vec<String> {
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
pub(super) fn paths(catalog: &Catalog, resources: &[&ResourceInfo]) -> BTreeMap<String, PathItem> {
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
