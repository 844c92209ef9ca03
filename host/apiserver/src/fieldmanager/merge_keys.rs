//! How the lists of the built-in kinds merge: one table for both kinds of merge that
//! need it. The Go types carry this in tags (`patchStrategy`/`patchMergeKey` for
//! strategic merge patches, `+listType`/`+listMapKey` for server-side apply); the
//! `k8s-openapi` schemas carry neither, so it is written down here.
//!
//! - [`crate::endpoints::openapi`] adds the strategic merge columns to the schemas of
//!   `/openapi/v2`, from which kubectl computes `apply`'s patch.
//! - [`crate::fieldmanager::patch`] merges the lists of strategic merge patches by their strategies
//!   and merge keys.
//! - [`crate::fieldmanager::managed_fields`] reads the list types to key the elements of field sets
//!   for server-side apply.
//!
//! The two keys differ for some lists: a container's ports are one strategic merge
//! element per `containerPort`, but one server-side apply element per `containerPort`
//! and `protocol`.

/// How server-side apply identifies the elements of a list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListKind {
    /// Replaced as a whole.
    Atomic,
    /// Scalars, each its own element.
    Set,
    /// Objects keyed by these fields.
    Map(&'static [&'static str]),
}

/// One list (or, for `retainKeys`, struct) field of a built-in schema.
#[derive(Clone, Copy, Debug)]
pub struct MergeRule {
    /// The OpenAPI v2 definition that holds the field.
    pub schema: &'static str,
    /// The property.
    pub field: &'static str,
    /// `x-kubernetes-patch-strategy`.
    pub patch_strategy: &'static str,
    /// `x-kubernetes-patch-merge-key`; empty for lists of scalars and structs.
    pub patch_merge_key: &'static str,
    /// The list's type for server-side apply.
    pub list: ListKind,
}

const fn rule(
    schema: &'static str,
    field: &'static str,
    patch_strategy: &'static str,
    patch_merge_key: &'static str,
    list: ListKind,
) -> MergeRule {
    MergeRule {
        schema,
        field,
        patch_strategy,
        patch_merge_key,
        list,
    }
}

const META: &str = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta";
const POD_SPEC: &str = "io.k8s.api.core.v1.PodSpec";
const CONTAINER: &str = "io.k8s.api.core.v1.Container";
const EPHEMERAL: &str = "io.k8s.api.core.v1.EphemeralContainer";
const NAME: ListKind = ListKind::Map(&["name"]);
const TYPE: ListKind = ListKind::Map(&["type"]);
const IP: ListKind = ListKind::Map(&["ip"]);

/// The merge rules of the built-in kinds.
pub const BUILTIN: &[MergeRule] = &[
    rule(META, "finalizers", "merge", "", ListKind::Set),
    rule(
        META,
        "ownerReferences",
        "merge",
        "uid",
        ListKind::Map(&["uid"]),
    ),
    rule(POD_SPEC, "volumes", "merge,retainKeys", "name", NAME),
    rule(POD_SPEC, "initContainers", "merge", "name", NAME),
    rule(POD_SPEC, "containers", "merge", "name", NAME),
    rule(POD_SPEC, "ephemeralContainers", "merge", "name", NAME),
    rule(POD_SPEC, "imagePullSecrets", "merge", "name", NAME),
    rule(POD_SPEC, "hostAliases", "merge", "ip", IP),
    rule(
        POD_SPEC,
        "topologySpreadConstraints",
        "merge",
        "topologyKey",
        ListKind::Map(&["topologyKey", "whenUnsatisfiable"]),
    ),
    rule(POD_SPEC, "schedulingGates", "merge", "name", NAME),
    rule(POD_SPEC, "resourceClaims", "merge,retainKeys", "name", NAME),
    rule(
        CONTAINER,
        "ports",
        "merge",
        "containerPort",
        ListKind::Map(&["containerPort", "protocol"]),
    ),
    rule(CONTAINER, "env", "merge", "name", NAME),
    rule(
        CONTAINER,
        "volumeMounts",
        "merge",
        "mountPath",
        ListKind::Map(&["mountPath"]),
    ),
    rule(
        CONTAINER,
        "volumeDevices",
        "merge",
        "devicePath",
        ListKind::Map(&["devicePath"]),
    ),
    rule(EPHEMERAL, "env", "merge", "name", NAME),
    rule(
        EPHEMERAL,
        "volumeMounts",
        "merge",
        "mountPath",
        ListKind::Map(&["mountPath"]),
    ),
    rule(
        EPHEMERAL,
        "volumeDevices",
        "merge",
        "devicePath",
        ListKind::Map(&["devicePath"]),
    ),
    rule(
        "io.k8s.api.core.v1.PodStatus",
        "conditions",
        "merge",
        "type",
        TYPE,
    ),
    rule("io.k8s.api.core.v1.PodStatus", "podIPs", "merge", "ip", IP),
    rule("io.k8s.api.core.v1.PodStatus", "hostIPs", "merge", "ip", IP),
    rule(
        "io.k8s.api.core.v1.ServiceSpec",
        "ports",
        "merge",
        "port",
        ListKind::Map(&["port", "protocol"]),
    ),
    rule(
        "io.k8s.api.core.v1.ServiceStatus",
        "conditions",
        "merge",
        "type",
        TYPE,
    ),
    rule(
        "io.k8s.api.core.v1.ServiceAccount",
        "secrets",
        "merge",
        "name",
        NAME,
    ),
    rule(
        "io.k8s.api.core.v1.NodeSpec",
        "podCIDRs",
        "merge",
        "",
        ListKind::Set,
    ),
    rule(
        "io.k8s.api.core.v1.NodeStatus",
        "conditions",
        "merge",
        "type",
        TYPE,
    ),
    rule(
        "io.k8s.api.core.v1.NodeStatus",
        "addresses",
        "merge",
        "type",
        TYPE,
    ),
    rule(
        "io.k8s.api.core.v1.NamespaceStatus",
        "conditions",
        "merge",
        "type",
        TYPE,
    ),
    // A struct, not a list: its fields are cleared when its `type` changes.
    rule(
        "io.k8s.api.apps.v1.DeploymentSpec",
        "strategy",
        "retainKeys",
        "",
        ListKind::Atomic,
    ),
    rule(
        "io.k8s.api.apps.v1.DeploymentStatus",
        "conditions",
        "merge",
        "type",
        TYPE,
    ),
    rule(
        "io.k8s.api.apps.v1.ReplicaSetStatus",
        "conditions",
        "merge",
        "type",
        TYPE,
    ),
];

/// The rule of list `field` whose parent is at `parent`: the field names from the
/// object's root, list elements left out (`["spec", "template", "spec"]`). Patches and
/// field sets do not know the kind they belong to, so a rule's schema is matched by
/// where the path leads: metadata's fields right below `metadata`, containers' fields
/// below a container, status types' below `status`, the Service's `ports` right below
/// `spec`, the rest outside containers.
pub fn rule_at(parent: &[&str], field: &str) -> Option<&'static MergeRule> {
    let in_container = parent
        .iter()
        .any(|f| matches!(*f, "containers" | "initContainers" | "ephemeralContainers"));
    let fits = |schema: &str| match schema.rsplit('.').next().unwrap_or(schema) {
        // Object metadata sits at `metadata` of objects and templates alike; Namespace
        // `spec.finalizers` is not ObjectMeta's.
        "ObjectMeta" => parent.last() == Some(&"metadata"),
        "Container" | "EphemeralContainer" => in_container,
        "ServiceSpec" => parent == ["spec"],
        s if s.ends_with("Status") => parent.first() == Some(&"status"),
        _ => !in_container,
    };
    BUILTIN.iter().find(|r| r.field == field && fits(r.schema))
}

/// The rules of the fields of schema `name`.
pub fn of_schema(name: &str) -> impl Iterator<Item = &'static MergeRule> + '_ {
    BUILTIN.iter().filter(move |r| r.schema == name)
}
