//! The documents as kubectl reads them: every kind, `$ref`, path and operation.

use std::collections::BTreeSet;

use k8s_openapi::schemars::JsonSchema;
use serde_json::{Value, json};
use trellis_api::registry::builtins;

use super::catalog::{GVK_EXTENSION, V2_REF_PREFIX, V3_REF_PREFIX, subschemas};
use super::document::{Fnv1a128, group_versions};
use super::paths::ACTION_EXTENSION;
use super::*;

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
    assert!(v3_document(&resources, "networking.k8s.io", "v1").is_none());
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
    let patch = &v2["paths"]["/apis/apps/v1/namespaces/{namespace}/deployments/{name}"]["patch"];
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
