//! Which resources exist and how they are served: group, version, kind, plural,
//! scope, verbs, short names, categories and subresources, for discovery, routing,
//! storage keys and authorization alike. Custom resources add entries at run time.

use std::sync::Arc;

/// The verbs of a full read-write resource, in discovery's order.
pub const ALL_VERBS: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

/// A subresource served under `…/{name}/{subresource}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Subresource {
    /// `status`: writes only `.status`; the main resource never writes it.
    Status,
    /// `scale`: an `autoscaling/v1` `Scale` view of `.spec.replicas`.
    Scale,
    /// `pods/binding`: assigns a pod to a node.
    Binding,
    /// `pods/log`.
    Log,
    /// `pods/exec`: a command run in a pod's container, its streams over a WebSocket
    /// (`v5.channel.k8s.io`) the API server relays to the node.
    Exec,
    /// `pods/portforward`: connections to a pod's ports, over SPDY or a WebSocket the
    /// API server passes on to the node.
    PortForward,
    /// `serviceaccounts/token`: a TokenRequest for the account.
    Token,
    /// `pods/eviction`: a `policy/v1` Eviction, a delete that keeps the pod's
    /// PodDisruptionBudget.
    Eviction,
    /// `namespaces/finalize`: replaces a namespace's `spec.finalizers` (and only
    /// those), what a namespace controller writes once it has emptied the namespace.
    Finalize,
    /// `certificatesigningrequests/approval`: writes only the Approved and Denied
    /// conditions of `.status` (`kubectl certificate approve|deny`).
    Approval,
    /// `nodes/proxy`: a request passed on to the node's agent, the path after
    /// `proxy/` (`/api/v1/nodes/N/proxy/stats/summary`).
    Proxy,
}

impl Subresource {
    pub fn name(self) -> &'static str {
        match self {
            Subresource::Status => "status",
            Subresource::Scale => "scale",
            Subresource::Binding => "binding",
            Subresource::Log => "log",
            Subresource::Exec => "exec",
            Subresource::PortForward => "portforward",
            Subresource::Token => "token",
            Subresource::Finalize => "finalize",
            Subresource::Eviction => "eviction",
            Subresource::Approval => "approval",
            Subresource::Proxy => "proxy",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            Subresource::Status,
            Subresource::Scale,
            Subresource::Binding,
            Subresource::Log,
            Subresource::Exec,
            Subresource::PortForward,
            Subresource::Token,
            Subresource::Finalize,
            Subresource::Eviction,
            Subresource::Approval,
            Subresource::Proxy,
        ]
        .into_iter()
        .find(|r| r.name() == s)
    }
}

/// One served resource.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceInfo {
    /// `""` for the core group.
    pub group: String,
    pub version: String,
    pub kind: String,
    /// The path segment: `pods`, `deployments`.
    pub plural: String,
    pub singular: String,
    pub namespaced: bool,
    pub verbs: Vec<String>,
    pub short_names: Vec<String>,
    pub categories: Vec<String>,
    pub subresources: Vec<Subresource>,
    /// A custom resource's `additionalPrinterColumns`, for `kubectl get`; `None` for
    /// built-in kinds (their own columns) and CRDs that declare none (NAME and AGE).
    pub printer_columns: Option<Arc<[PrinterColumn]>>,
}

/// A column a CRD declares for `kubectl get` (`additionalPrinterColumns`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrinterColumn {
    pub name: String,
    /// `integer`, `number`, `string`, `boolean` or `date`.
    pub kind: String,
    pub format: String,
    pub description: String,
    /// 0 is shown by default; higher only with `-o wide`.
    pub priority: i64,
    /// Where the value is, in kubectl's JSONPath without braces: `.spec.replicas`.
    pub json_path: String,
}

impl ResourceInfo {
    /// `v1` or `apps/v1`: the `apiVersion` of objects of this resource.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }

    /// `pods` or `deployments.apps`: the name used in messages and RBAC.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.clone()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    pub fn has(&self, sub: Subresource) -> bool {
        self.subresources.contains(&sub)
    }

    pub fn allows(&self, verb: &str) -> bool {
        self.verbs.iter().any(|v| v == verb)
    }

    /// The store prefix of every object of this resource.
    pub fn prefix(&self) -> String {
        let group = if self.group.is_empty() {
            "core"
        } else {
            self.group.as_str()
        };
        format!("/registry/{group}/{}/", self.plural)
    }

    /// The store prefix of one namespace's objects (all objects if not namespaced or
    /// `namespace` is `None`).
    pub fn namespace_prefix(&self, namespace: Option<&str>) -> String {
        match namespace.filter(|_| self.namespaced) {
            Some(ns) => format!("{}{ns}/", self.prefix()),
            None => self.prefix(),
        }
    }

    /// The store key of one object.
    pub fn key(&self, namespace: Option<&str>, name: &str) -> String {
        format!("{}{name}", self.namespace_prefix(namespace))
    }
}

#[allow(clippy::too_many_arguments)]
fn resource(
    group: &str,
    kind: &str,
    plural: &str,
    namespaced: bool,
    short_names: &[&str],
    categories: &[&str],
    subresources: &[Subresource],
) -> ResourceInfo {
    ResourceInfo {
        group: group.to_owned(),
        version: "v1".to_owned(),
        kind: kind.to_owned(),
        plural: plural.to_owned(),
        singular: kind.to_lowercase(),
        namespaced,
        verbs: ALL_VERBS.iter().map(|v| (*v).to_owned()).collect(),
        short_names: short_names.iter().map(|s| (*s).to_owned()).collect(),
        categories: categories.iter().map(|s| (*s).to_owned()).collect(),
        subresources: subresources.to_vec(),
        printer_columns: None,
    }
}

/// `resource` served at another version than `v1` (`autoscaling/v2`). Versions of one
/// group and plural share their objects' store keys; the first registered is the
/// group's preferred version in discovery.
fn versioned(version: &str, res: ResourceInfo) -> ResourceInfo {
    ResourceInfo {
        version: version.to_owned(),
        ..res
    }
}

/// A resource that only answers `create` and stores nothing (reviews).
fn create_only(group: &str, kind: &str, plural: &str) -> ResourceInfo {
    ResourceInfo {
        verbs: vec!["create".to_owned()],
        ..resource(group, kind, plural, false, &[], &[], &[])
    }
}

/// The built-in resources, in discovery order within each group.
pub fn builtins() -> Vec<ResourceInfo> {
    use Subresource::*;
    vec![
        resource("", "ConfigMap", "configmaps", true, &["cm"], &[], &[]),
        resource("", "Endpoints", "endpoints", true, &["ep"], &[], &[]),
        resource("", "Event", "events", true, &["ev"], &[], &[]),
        resource("", "LimitRange", "limitranges", true, &["limits"], &[], &[]),
        resource(
            "",
            "Namespace",
            "namespaces",
            false,
            &["ns"],
            &[],
            &[Finalize, Status],
        ),
        resource("", "Node", "nodes", false, &["no"], &[], &[Status, Proxy]),
        resource(
            "",
            "PersistentVolumeClaim",
            "persistentvolumeclaims",
            true,
            &["pvc"],
            &[],
            &[Status],
        ),
        resource(
            "",
            "PersistentVolume",
            "persistentvolumes",
            false,
            &["pv"],
            &[],
            &[Status],
        ),
        resource(
            "",
            "Pod",
            "pods",
            true,
            &["po"],
            &["all"],
            &[Status, Binding, Eviction, Log, Exec, PortForward],
        ),
        resource(
            "",
            "ReplicationController",
            "replicationcontrollers",
            true,
            &["rc"],
            &["all"],
            &[Status, Scale],
        ),
        resource(
            "",
            "ResourceQuota",
            "resourcequotas",
            true,
            &["quota"],
            &[],
            &[Status],
        ),
        resource("", "Secret", "secrets", true, &[], &[], &[]),
        resource(
            "",
            "ServiceAccount",
            "serviceaccounts",
            true,
            &["sa"],
            &[],
            &[Token],
        ),
        resource(
            "",
            "Service",
            "services",
            true,
            &["svc"],
            &["all"],
            &[Status],
        ),
        resource(
            "apiregistration.k8s.io",
            "APIService",
            "apiservices",
            false,
            &[],
            &["api-extensions"],
            &[Status],
        ),
        resource(
            "apps",
            "ControllerRevision",
            "controllerrevisions",
            true,
            &[],
            &[],
            &[],
        ),
        resource(
            "apps",
            "DaemonSet",
            "daemonsets",
            true,
            &["ds"],
            &["all"],
            &[Status],
        ),
        resource(
            "apps",
            "Deployment",
            "deployments",
            true,
            &["deploy"],
            &["all"],
            &[Status, Scale],
        ),
        resource(
            "apps",
            "ReplicaSet",
            "replicasets",
            true,
            &["rs"],
            &["all"],
            &[Status, Scale],
        ),
        resource(
            "apps",
            "StatefulSet",
            "statefulsets",
            true,
            &["sts"],
            &["all"],
            &[Status, Scale],
        ),
        // v2 first, the preferred version; v1 is served from v2's objects, converted.
        versioned(
            "v2",
            resource(
                "autoscaling",
                "HorizontalPodAutoscaler",
                "horizontalpodautoscalers",
                true,
                &["hpa"],
                &["all"],
                &[Status],
            ),
        ),
        resource(
            "autoscaling",
            "HorizontalPodAutoscaler",
            "horizontalpodautoscalers",
            true,
            &["hpa"],
            &["all"],
            &[Status],
        ),
        resource(
            "batch",
            "CronJob",
            "cronjobs",
            true,
            &["cj"],
            &["all"],
            &[Status],
        ),
        resource("batch", "Job", "jobs", true, &[], &["all"], &[Status]),
        resource(
            "certificates.k8s.io",
            "CertificateSigningRequest",
            "certificatesigningrequests",
            false,
            &["csr"],
            &[],
            &[Status, Approval],
        ),
        resource(
            "coordination.k8s.io",
            "Lease",
            "leases",
            true,
            &[],
            &[],
            &[],
        ),
        resource(
            "discovery.k8s.io",
            "EndpointSlice",
            "endpointslices",
            true,
            &[],
            &[],
            &[],
        ),
        resource(
            "policy",
            "PodDisruptionBudget",
            "poddisruptionbudgets",
            true,
            &["pdb"],
            &[],
            &[Status],
        ),
        resource(
            "storage.k8s.io",
            "StorageClass",
            "storageclasses",
            false,
            &["sc"],
            &[],
            &[],
        ),
        resource(
            "node.k8s.io",
            "RuntimeClass",
            "runtimeclasses",
            false,
            &[],
            &[],
            &[],
        ),
        resource(
            "scheduling.k8s.io",
            "PriorityClass",
            "priorityclasses",
            false,
            &["pc"],
            &[],
            &[],
        ),
        resource(
            "rbac.authorization.k8s.io",
            "ClusterRoleBinding",
            "clusterrolebindings",
            false,
            &[],
            &[],
            &[],
        ),
        resource(
            "rbac.authorization.k8s.io",
            "ClusterRole",
            "clusterroles",
            false,
            &[],
            &[],
            &[],
        ),
        resource(
            "rbac.authorization.k8s.io",
            "RoleBinding",
            "rolebindings",
            true,
            &[],
            &[],
            &[],
        ),
        resource(
            "rbac.authorization.k8s.io",
            "Role",
            "roles",
            true,
            &[],
            &[],
            &[],
        ),
        create_only(
            "authentication.k8s.io",
            "SelfSubjectReview",
            "selfsubjectreviews",
        ),
        create_only(
            "authorization.k8s.io",
            "SelfSubjectAccessReview",
            "selfsubjectaccessreviews",
        ),
        create_only(
            "authorization.k8s.io",
            "SelfSubjectRulesReview",
            "selfsubjectrulesreviews",
        ),
        create_only(
            "authorization.k8s.io",
            "SubjectAccessReview",
            "subjectaccessreviews",
        ),
        resource(
            "apiextensions.k8s.io",
            "CustomResourceDefinition",
            "customresourcedefinitions",
            false,
            &["crd", "crds"],
            &[],
            &[Status],
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_names_follow_group_and_scope() {
        let all = builtins();
        let pods = all.iter().find(|r| r.plural == "pods").unwrap();
        assert_eq!(pods.api_version(), "v1");
        assert_eq!(
            pods.key(Some("default"), "web"),
            "/registry/core/pods/default/web"
        );
        assert_eq!(pods.namespace_prefix(None), "/registry/core/pods/");
        let deploy = all.iter().find(|r| r.kind == "Deployment").unwrap();
        assert_eq!(deploy.api_version(), "apps/v1");
        assert_eq!(deploy.qualified(), "deployments.apps");
        let nodes = all.iter().find(|r| r.plural == "nodes").unwrap();
        // A namespace given for a cluster-scoped resource is ignored.
        assert_eq!(nodes.key(Some("default"), "n1"), "/registry/core/nodes/n1");
        assert!(pods.has(Subresource::Binding) && !nodes.has(Subresource::Scale));
        let namespaces = all.iter().find(|r| r.plural == "namespaces").unwrap();
        assert!(namespaces.has(Subresource::Finalize) && !pods.has(Subresource::Finalize));
        assert_eq!(Subresource::parse("finalize"), Some(Subresource::Finalize));
        let hpa = all
            .iter()
            .find(|r| r.kind == "HorizontalPodAutoscaler")
            .unwrap();
        assert_eq!(hpa.api_version(), "autoscaling/v2");
        // Every version of a resource keeps its objects under one prefix.
        assert_eq!(
            hpa.prefix(),
            "/registry/autoscaling/horizontalpodautoscalers/"
        );
        let pv = all
            .iter()
            .find(|r| r.plural == "persistentvolumes")
            .unwrap();
        assert!(!pv.namespaced && pv.has(Subresource::Status));
    }

    #[test]
    fn plurals_and_short_names_are_unique() {
        let mut all = builtins();
        // Versions of one resource share its names.
        all.dedup_by(|b, a| a.group == b.group && a.plural == b.plural);
        let mut names: Vec<String> = all.iter().map(|r| r.qualified()).collect();
        names.extend(all.iter().flat_map(|r| r.short_names.clone()));
        let before = names.len();
        names.sort();
        names.dedup();
        assert_eq!(before, names.len());
    }
}
