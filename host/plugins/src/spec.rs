//! The `Plugin` object (`trellis.dev/v1`): its spec as a plugin author writes it, the
//! CRD that serves it, and how its match rules select requests.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1 as metav1;
use serde::Deserialize;
use serde_json::{Value, json};
use trellis_api::registry::ResourceInfo;
use trellis_api::selector::LabelSelector;
use trellis_plugin_host::{PluginKind, PluginSpec};

pub const GROUP: &str = "trellis.dev";
pub const PLURAL: &str = "plugins";
pub const VERSION: &str = "v1";
/// The label of the Plugin objects that stand for the controllers bundled with the
/// binary (`"true"`); their module is `builtin:NAME`.
pub const BUILTIN_LABEL: &str = "trellis.dev/builtin";
/// The module scheme of a bundled controller: `builtin:replicaset`.
pub const BUILTIN_SCHEME: &str = "builtin:";

/// Whether a Plugin object is the entry of a bundled controller: labelled so, with a
/// `builtin:` module. Its controller runs under the bootstrap RBAC roles.
pub fn is_builtin_entry(meta: &Value, spec: &Value) -> bool {
    meta["labels"][BUILTIN_LABEL] == "true"
        && spec["module"]["url"]
            .as_str()
            .is_some_and(|u| u.starts_with(BUILTIN_SCHEME))
}

/// Longest deadline a plugin may ask for: a request waits for every plugin.
const MAX_TIMEOUT_MS: u64 = 30_000;
/// Longest deadline of one reconcile: it waits on writes, not on a client.
const MAX_RECONCILE_MS: u64 = 300_000;
/// Largest memory cap a plugin may ask for (the host's pool is sized for it).
pub const MAX_MEMORY_MIB: u64 = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailurePolicy {
    Fail,
    Ignore,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Doc {
    kind: String,
    module: Option<ModuleDoc>,
    #[serde(default)]
    configuration: Option<Value>,
    #[serde(default)]
    rules: Vec<Rule>,
    #[serde(default)]
    namespace_selector: Option<metav1::LabelSelector>,
    #[serde(default)]
    object_selector: Option<metav1::LabelSelector>,
    #[serde(default)]
    order: i32,
    #[serde(default)]
    failure_policy: Option<String>,
    #[serde(default)]
    timeout_ms: Option<u64>,
    #[serde(default, rename = "memoryLimitMiB")]
    memory_limit_mib: Option<u64>,
    #[serde(default)]
    capabilities: Capabilities,
    #[serde(default)]
    controller: Option<ControllerDoc>,
    #[serde(default)]
    scheduler: Option<SchedulerDoc>,
}

/// `spec.scheduler`: where a scheduler plugin joins the scheduler.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SchedulerDoc {
    /// The profile (`schedulerName` of the pods it schedules); a new name makes a new
    /// profile with the default plugins and this one.
    #[serde(default = "default_profile")]
    pub profile: String,
    /// Score weights by plugin name, replacing the plugins' own.
    #[serde(default)]
    pub weights: std::collections::BTreeMap<String, u32>,
}

fn default_profile() -> String {
    "default-scheduler".into()
}

impl Default for SchedulerDoc {
    fn default() -> Self {
        Self {
            profile: default_profile(),
            weights: Default::default(),
        }
    }
}

/// A resource as a controller names it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResourceRef {
    #[serde(default)]
    pub group: String,
    pub version: String,
    pub resource: String,
}

/// `spec.controller`: what a controller plugin reconciles, owns, and may do.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ControllerDoc {
    /// The primary resource: each of its objects is a key.
    #[serde(rename = "for")]
    pub primary: ResourceRef,
    /// Resources whose objects it owns (a change of one reconciles its controller).
    #[serde(default)]
    pub owns: Vec<ResourceRef>,
    /// Other resources it reads, each with how a change maps to primary keys.
    #[serde(default)]
    pub watches: Vec<WatchDoc>,
    /// Keys reconciled at once.
    #[serde(default = "default_workers")]
    pub workers: usize,
    /// Every primary object is reconciled again this often (0: never).
    #[serde(default)]
    pub resync_seconds: u64,
    /// The RBAC rules (`rbac.authorization.k8s.io/v1` PolicyRules) its writes are
    /// held to: the server grants them to its ServiceAccount.
    #[serde(default)]
    pub rules: Vec<Value>,
}

/// A watched resource and its mapping (`owner`, `namespace` or `name`).
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WatchDoc {
    #[serde(default)]
    pub group: String,
    pub version: String,
    pub resource: String,
    pub map: String,
}

fn default_workers() -> usize {
    2
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModuleDoc {
    pub url: String,
    #[serde(default)]
    pub sha256: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Capabilities {
    #[serde(default)]
    cluster_read: bool,
}

/// One rule, as in admission webhooks: a request matches when every list matches.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rule {
    #[serde(default)]
    pub operations: Vec<String>,
    #[serde(default)]
    pub api_groups: Vec<String>,
    #[serde(default)]
    pub api_versions: Vec<String>,
    #[serde(default)]
    pub resources: Vec<String>,
    /// `Cluster`, `Namespaced` or `*` (the default).
    #[serde(default)]
    pub scope: Option<String>,
}

/// A Plugin's spec, checked.
#[derive(Clone, Debug)]
pub struct Parsed {
    pub spec: PluginSpec,
    pub module: Option<ModuleDoc>,
    pub rules: Vec<Rule>,
    pub namespace_selector: Option<LabelSelector>,
    pub object_selector: Option<LabelSelector>,
    pub order: i32,
    pub failure_policy: FailurePolicy,
    pub cluster_read: bool,
    /// `spec.controller`, for a plugin of kind `controller`.
    pub controller: Option<ControllerDoc>,
    /// `spec.scheduler` (or its defaults), for a plugin of kind `scheduler`.
    pub scheduler: Option<SchedulerDoc>,
}

/// Reads a Plugin's `spec`; the error names the field.
pub fn parse(name: &str, spec: &Value) -> Result<Parsed, String> {
    let doc: Doc = serde_json::from_value(spec.clone()).map_err(|e| format!("spec: {e}"))?;
    let kind = match doc.kind.to_ascii_lowercase().as_str() {
        "mutating" => PluginKind::Mutating,
        "validating" => PluginKind::Validating,
        "initializer" => PluginKind::Initializer,
        "controller" => PluginKind::Controller,
        "scheduler" => PluginKind::Scheduler,
        other => {
            return Err(format!(
                "spec.kind: Unsupported value: {other:?}: supported values: \"mutating\", \"validating\", \"initializer\", \"controller\", \"scheduler\""
            ));
        }
    };
    let scheduler = match (&doc.scheduler, kind == PluginKind::Scheduler) {
        (Some(_), false) => {
            return Err("spec.scheduler: Forbidden: only for plugins of kind scheduler".into());
        }
        (Some(s), true) => Some(s.clone()),
        (None, true) => Some(SchedulerDoc::default()),
        (None, false) => None,
    };
    if let Some(s) = &scheduler {
        if s.profile.is_empty() {
            return Err("spec.scheduler.profile: Required value".into());
        }
        for (name, weight) in &s.weights {
            if !(1..=100).contains(weight) {
                return Err(format!(
                    "spec.scheduler.weights[{name}]: Invalid value: {weight}: must be between 1 and 100"
                ));
            }
        }
    }
    let controller = kind == PluginKind::Controller;
    match (&doc.controller, controller) {
        (None, true) => {
            return Err("spec.controller: Required value: a controller plugin names the resource it reconciles".into());
        }
        (Some(_), false) => {
            return Err("spec.controller: Forbidden: only for plugins of kind controller".into());
        }
        (Some(c), true) => {
            if c.primary.resource.is_empty() || c.primary.version.is_empty() {
                return Err("spec.controller.for: Required value: version and resource".into());
            }
            for (i, w) in c.watches.iter().enumerate() {
                if !matches!(
                    w.map.as_str(),
                    "owner" | "namespace" | "name" | "cache" | "selector" | "namespaced" | "all"
                ) {
                    return Err(format!(
                        "spec.controller.watches[{i}].map: Unsupported value: {:?}: supported values: \"owner\", \"namespace\", \"name\", \"cache\", \"selector\", \"namespaced\", \"all\"",
                        w.map
                    ));
                }
            }
            if c.workers == 0 || c.workers > 64 {
                return Err(format!(
                    "spec.controller.workers: Invalid value: {}: must be between 1 and 64",
                    c.workers
                ));
            }
        }
        (None, false) => {}
    }
    let failure_policy = match doc.failure_policy.as_deref() {
        None | Some("Fail") => FailurePolicy::Fail,
        Some("Ignore") => FailurePolicy::Ignore,
        Some(other) => {
            return Err(format!(
                "spec.failurePolicy: Unsupported value: {other:?}: supported values: \"Fail\", \"Ignore\""
            ));
        }
    };
    if matches!(kind, PluginKind::Mutating | PluginKind::Validating) && doc.rules.is_empty() {
        return Err(
            "spec.rules: Required value: an admission plugin needs at least one rule".into(),
        );
    }
    for (i, rule) in doc.rules.iter().enumerate() {
        for op in &rule.operations {
            if !matches!(
                op.as_str(),
                "CREATE" | "UPDATE" | "DELETE" | "CONNECT" | "*"
            ) {
                return Err(format!(
                    "spec.rules[{i}].operations: Unsupported value: {op:?}: supported values: \"CREATE\", \"UPDATE\", \"DELETE\", \"CONNECT\", \"*\""
                ));
            }
        }
    }
    let (default_ms, max_ms) = if controller {
        (10_000, MAX_RECONCILE_MS)
    } else if kind == PluginKind::Scheduler {
        // A call filters or scores a batch of up to thousands of nodes.
        (1_000, MAX_TIMEOUT_MS)
    } else {
        (100, MAX_TIMEOUT_MS)
    };
    let timeout_ms = doc.timeout_ms.unwrap_or(default_ms);
    if timeout_ms == 0 || timeout_ms > max_ms {
        return Err(format!(
            "spec.timeoutMs: Invalid value: {timeout_ms}: must be between 1 and {max_ms}"
        ));
    }
    let memory = doc.memory_limit_mib.unwrap_or(64);
    if memory == 0 || memory > MAX_MEMORY_MIB {
        return Err(format!(
            "spec.memoryLimitMiB: Invalid value: {memory}: must be between 1 and {MAX_MEMORY_MIB}"
        ));
    }
    let selector = |field: &str, s: &Option<metav1::LabelSelector>| {
        s.as_ref()
            .map(LabelSelector::from_k8s)
            .transpose()
            .map_err(|e| format!("spec.{field}: {e}"))
    };
    let configuration = match &doc.configuration {
        Some(v) if !v.is_null() => v.to_string(),
        _ => "{}".to_owned(),
    };
    let mut spec = PluginSpec::new(name, kind);
    spec.configuration = configuration;
    spec.timeout = Duration::from_millis(timeout_ms);
    spec.memory_limit = usize::try_from(memory << 20).unwrap_or(usize::MAX);
    Ok(Parsed {
        spec,
        module: doc.module,
        rules: doc.rules,
        namespace_selector: selector("namespaceSelector", &doc.namespace_selector)?,
        object_selector: selector("objectSelector", &doc.object_selector)?,
        order: doc.order,
        failure_policy,
        cluster_read: doc.capabilities.cluster_read,
        controller: doc.controller,
        scheduler,
    })
}

fn listed(list: &[String], value: &str) -> bool {
    list.iter().any(|v| v == "*" || v == value)
}

impl Parsed {
    /// Whether a request on `res` (and subresource) with `operation` matches a rule.
    pub fn matches_request(
        &self,
        res: &ResourceInfo,
        subresource: Option<&str>,
        operation: &str,
    ) -> bool {
        // Plugins never judge Plugin objects: a broken plugin must stay removable.
        if res.group == GROUP && res.plural == PLURAL {
            return false;
        }
        let resource = match subresource {
            Some(sub) => format!("{}/{sub}", res.plural),
            None => res.plural.clone(),
        };
        self.rules.iter().any(|rule| {
            let resource_ok = rule.resources.iter().any(|r| {
                r == "*/*"
                    || *r == resource
                    || (r == "*" && subresource.is_none())
                    || r.strip_prefix("*/").is_some_and(|s| Some(s) == subresource)
                    || r.strip_suffix("/*")
                        .is_some_and(|p| p == res.plural && subresource.is_some())
            });
            let scope_ok = match rule.scope.as_deref() {
                Some("Cluster") => !res.namespaced,
                Some("Namespaced") => res.namespaced,
                _ => true,
            };
            resource_ok
                && scope_ok
                && listed(&rule.operations, operation)
                && listed(&rule.api_groups, &res.group)
                && listed(&rule.api_versions, &res.version)
        })
    }

    /// Whether the object (or, for a delete, the old one) passes the object selector.
    pub fn matches_object(&self, obj: Option<&Value>, old: Option<&Value>) -> bool {
        let Some(selector) = &self.object_selector else {
            return true;
        };
        [obj, old]
            .into_iter()
            .flatten()
            .any(|o| selector.matches_object(o))
    }

    /// An initializer applies to creates of resources its rules name (all of them
    /// when it has none).
    pub fn initializes(&self, res: &ResourceInfo) -> bool {
        if res.group == GROUP && res.plural == PLURAL {
            return false;
        }
        self.rules.is_empty() || self.matches_request(res, None, "CREATE")
    }
}

/// The CustomResourceDefinition that serves `plugins.trellis.dev`, installed at
/// startup so Plugin objects are validated, listed and watched like any other.
pub fn crd() -> Value {
    let string_list = json!({"type": "array", "items": {"type": "string"}});
    let selector = json!({
        "type": "object",
        "properties": {
            "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
            "matchExpressions": {"type": "array", "items": {
                "type": "object",
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"type": "string", "enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": string_list,
                },
            }},
        },
    });
    let resource_ref = json!({
        "type": "object",
        "required": ["version", "resource"],
        "properties": {
            "group": {"type": "string"},
            "version": {"type": "string"},
            "resource": {"type": "string"},
        },
    });
    let condition = json!({
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": {"type": "string"},
            "status": {"type": "string"},
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer"},
        },
    });
    let spec_schema = json!({
        "type": "object",
        "required": ["kind", "module"],
        "properties": {
            "kind": {"type": "string", "enum": ["mutating", "validating", "initializer", "controller", "scheduler"],
                     "description": "Which chain the plugin joins, `controller` for one the controller manager runs, or `scheduler` for one the scheduler runs."},
            "module": {
                "type": "object",
                "required": ["url"],
                "description": "Where the component comes from: file://, https:// (with sha256), oci://, or builtin:NAME for a controller bundled with Trellis.",
                "properties": {
                    "url": {"type": "string"},
                    "sha256": {"type": "string", "description": "Hex digest the module must have: required for https://; for oci://, the digest of the artifact's WebAssembly layer."},
                },
            },
            "configuration": {"type": "object", "x-kubernetes-preserve-unknown-fields": true,
                              "description": "Handed to the plugin as JSON; the plugin checks it at load."},
            "rules": {"type": "array", "items": {
                "type": "object",
                "properties": {
                    "operations": string_list,
                    "apiGroups": string_list,
                    "apiVersions": string_list,
                    "resources": string_list,
                    "scope": {"type": "string", "enum": ["Cluster", "Namespaced", "*"]},
                },
            }},
            "namespaceSelector": selector,
            "objectSelector": selector,
            "order": {"type": "integer", "description": "Lower runs first; ties by name."},
            "failurePolicy": {"type": "string", "enum": ["Fail", "Ignore"]},
            "timeoutMs": {"type": "integer", "minimum": 1, "maximum": MAX_RECONCILE_MS,
                          "description": "Deadline of one call: at most 30000 for admission and initializers, 300000 for a reconcile."},
            "controller": {
                "type": "object",
                "required": ["for"],
                "description": "For kind controller: what it reconciles and owns, and the RBAC rules its writes are held to.",
                "properties": {
                    "for": resource_ref,
                    "owns": {"type": "array", "items": resource_ref},
                    "watches": {"type": "array", "items": {
                        "type": "object",
                        "required": ["version", "resource", "map"],
                        "properties": {
                            "group": {"type": "string"},
                            "version": {"type": "string"},
                            "resource": {"type": "string"},
                            "map": {"type": "string", "enum": ["owner", "namespace", "name", "cache", "selector", "namespaced", "all"],
                                    "description": "owner: the owners of the primary's kind; namespace: the primary named as the object's namespace; name: the primary of the same name; cache: none, only read; selector: the primaries in its namespace whose spec.selector selects it; namespaced: every primary in its namespace; all: every primary of every namespace."},
                        },
                    }},
                    "workers": {"type": "integer", "minimum": 1, "maximum": 64},
                    "resyncSeconds": {"type": "integer", "minimum": 0},
                    "rules": {"type": "array", "items": {
                        "type": "object",
                        "properties": {
                            "apiGroups": string_list,
                            "resources": string_list,
                            "resourceNames": string_list,
                            "verbs": string_list,
                        },
                    }},
                },
            },
            "scheduler": {
                "type": "object",
                "description": "For kind scheduler: the profile it joins and score weights.",
                "properties": {
                    "profile": {"type": "string", "description": "The schedulerName of the pods it schedules (default-scheduler)."},
                    "weights": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 1, "maximum": 100}},
                },
            },
            "memoryLimitMiB": {"type": "integer", "minimum": 1, "maximum": MAX_MEMORY_MIB},
            "capabilities": {"type": "object", "properties": {
                "clusterRead": {"type": "boolean"},
            }},
        },
    });
    let status_schema = json!({
        "type": "object",
        "properties": {
            "conditions": {"type": "array", "items": condition},
            "digest": {"type": "string"},
            "tier": {"type": "string", "enum": ["baseline", "optimized"]},
            "observedGeneration": {"type": "integer"},
            "calls": {"type": "integer"},
            "denials": {"type": "integer"},
            "errors": {"type": "integer"},
            "timeouts": {"type": "integer"},
        },
    });
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{PLURAL}.{GROUP}")},
        "spec": {
            "group": GROUP,
            "scope": "Cluster",
            "names": {
                "plural": PLURAL,
                "singular": "plugin",
                "kind": "Plugin",
                "listKind": "PluginList",
                "shortNames": ["plg"],
                "categories": ["trellis"],
            },
            "versions": [{
                "name": "v1",
                "served": true,
                "storage": true,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Kind", "type": "string", "jsonPath": ".spec.kind"},
                    {"name": "Failure-Policy", "type": "string", "jsonPath": ".spec.failurePolicy"},
                    {"name": "Loaded", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Loaded\")].status"},
                    {"name": "Digest", "type": "string", "priority": 1, "jsonPath": ".status.digest"},
                    {"name": "Tier", "type": "string", "priority": 1, "jsonPath": ".status.tier"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A WebAssembly plugin: in the API server's admission or initializer chain, or a controller.",
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema,
                        "status": status_schema,
                    },
                }},
            }],
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_api::registry::builtins;

    fn res(group: &str, plural: &str) -> ResourceInfo {
        builtins()
            .into_iter()
            .find(|r| r.group == group && r.plural == plural)
            .unwrap()
    }

    #[test]
    fn rules_select_like_webhook_rules() {
        let p = parse(
            "p",
            &json!({"kind": "validating", "module": {"url": "file:///x.wasm"},
                    "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}]}),
        )
        .unwrap();
        let pods = res("", "pods");
        assert!(p.matches_request(&pods, None, "CREATE"));
        assert!(!p.matches_request(&pods, None, "UPDATE"));
        assert!(!p.matches_request(&pods, Some("status"), "CREATE"));
        assert!(!p.matches_request(&res("apps", "deployments"), None, "CREATE"));
        assert_eq!(p.failure_policy, FailurePolicy::Fail);
        assert_eq!(p.spec.timeout, Duration::from_millis(100));

        let all = parse(
            "q",
            &json!({"kind": "mutating", "module": {"url": "file:///x.wasm"}, "failurePolicy": "Ignore",
                    "rules": [{"operations": ["*"], "apiGroups": ["*"], "apiVersions": ["*"], "resources": ["*/*"]}]}),
        )
        .unwrap();
        assert!(all.matches_request(&pods, Some("status"), "UPDATE"));
        let mut plugins = pods.clone();
        plugins.group = GROUP.into();
        plugins.plural = PLURAL.into();
        assert!(!all.matches_request(&plugins, None, "CREATE"));
    }

    #[test]
    fn bad_specs_name_the_field() {
        let bad = |spec: Value| parse("p", &spec).unwrap_err();
        assert!(bad(json!({"kind": "sorting", "module": {"url": "x"}})).starts_with("spec.kind"));
        assert!(
            bad(json!({"kind": "validating", "module": {"url": "x"}})).starts_with("spec.rules")
        );
        assert!(
            bad(json!({"kind": "initializer", "module": {"url": "x"}, "timeoutMs": 0}))
                .starts_with("spec.timeoutMs")
        );
        assert!(
            bad(json!({"kind": "initializer", "module": {"url": "x"}, "failurePolicy": "Maybe"}))
                .starts_with("spec.failurePolicy")
        );
    }
}
