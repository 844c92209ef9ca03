//! Authorization: RBAC with Kubernetes' semantics, and the bootstrap roles.
//!
//! A request is allowed if any rule of a role bound to the user allows it:
//! ClusterRoleBindings grant their ClusterRole everywhere, RoleBindings grant their
//! Role or ClusterRole in their own namespace. Members of `system:masters` are allowed
//! everything without a lookup, as in Kubernetes. Role aggregation is not served.
//!
//! Bindings and roles are read through [`RbacReader`]: from the watch cache, as
//! Kubernetes' authorizer reads its informers, except right after this server wrote one
//! of them, until the cache has seen that write (a binding a client just created
//! applies to its next request).

use serde_json::{Value, json};
use std::sync::Arc;
use trellis_api::user::groups;
use trellis_api::{ApiError, UserInfo};

use trellis_api::registry::ResourceInfo;
use trellis_store::Store;

use crate::object::{self, Object};
use crate::storage::lister::Lister;
use crate::storage::watch_cache::WatchCache;

/// The RBAC objects, read through listers of the watch cache, and an index of what
/// each subject is granted, rebuilt when an RBAC object changes.
#[derive(Debug)]
pub struct RbacReader {
    roles: Lister,
    role_bindings: Lister,
    cluster_roles: Lister,
    cluster_role_bindings: Lister,
    cache: std::sync::OnceLock<Arc<WatchCache>>,
    index: std::sync::RwLock<Option<Arc<Index>>>,
    /// Held while the index is rebuilt: one rebuild at a time.
    rebuild: tokio::sync::Mutex<()>,
}

/// Every binding's grant, by the subject it names: a check looks up the user's name
/// and groups instead of walking every binding.
#[derive(Debug, Default)]
struct Index {
    /// The latest change of any RBAC resource the index was built after.
    generation: trellis_store::Revision,
    users: std::collections::HashMap<String, Vec<Grant>>,
    groups: std::collections::HashMap<String, Vec<Grant>>,
}

/// A role bound to a subject: everywhere (a ClusterRoleBinding, `namespace` empty) or
/// in one namespace.
#[derive(Debug)]
struct Grant {
    namespace: String,
    role: Arc<Object>,
}

impl Index {
    /// Whether a role granted to `user` in `namespace` (or everywhere) has a rule that
    /// `allows`.
    fn allows(&self, user: &UserInfo, namespace: &str, allows: &impl Fn(&Value) -> bool) -> bool {
        let grants = self
            .users
            .get(&user.name)
            .into_iter()
            .chain(user.groups.iter().filter_map(|g| self.groups.get(g)))
            .flatten();
        for grant in grants {
            if (grant.namespace.is_empty() || grant.namespace == namespace)
                && rules(&grant.role).iter().any(allows)
            {
                return true;
            }
        }
        false
    }
}

impl Default for RbacReader {
    fn default() -> Self {
        const GROUP: &str = "rbac.authorization.k8s.io";
        Self {
            roles: Lister::new(GROUP, "roles"),
            role_bindings: Lister::new(GROUP, "rolebindings"),
            cluster_roles: Lister::new(GROUP, "clusterroles"),
            cluster_role_bindings: Lister::new(GROUP, "clusterrolebindings"),
            cache: std::sync::OnceLock::new(),
            index: std::sync::RwLock::new(None),
            rebuild: tokio::sync::Mutex::new(()),
        }
    }
}

impl RbacReader {
    fn listers(&self) -> [&Lister; 4] {
        [
            &self.roles,
            &self.role_bindings,
            &self.cluster_roles,
            &self.cluster_role_bindings,
        ]
    }

    pub fn init(&self, store: &Arc<dyn Store>, cache: &Arc<WatchCache>) {
        for lister in self.listers() {
            lister.init(store, cache);
        }
        let _ = self.cache.set(cache.clone());
    }

    /// The index of grants as of the cache's current RBAC objects; `None` while the
    /// cache has not seen an RBAC write of this server (the caller reads the objects
    /// through the listers, which go to the store until then).
    async fn index(&self) -> Result<Option<Arc<Index>>, ApiError> {
        let Some(cache) = self.cache.get() else {
            return Ok(None);
        };
        if !self.listers().iter().all(|l| l.cache_current()) {
            return Ok(None);
        }
        let generation = self
            .listers()
            .iter()
            .map(|l| cache.last_change(&l.resource_prefix()))
            .max()
            .unwrap_or(0);
        let current = || {
            self.index
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .filter(|index| index.generation == generation)
                .cloned()
        };
        if let Some(index) = current() {
            return Ok(Some(index));
        }
        let _one = self.rebuild.lock().await;
        if let Some(index) = current() {
            return Ok(Some(index));
        }
        let mut index = Index {
            generation,
            ..Index::default()
        };
        let cluster = self
            .cluster_role_bindings
            .list_all()
            .await
            .map_err(read_error)?;
        let namespaced = self.role_bindings.list_all().await.map_err(read_error)?;
        let bindings =
            cluster
                .into_iter()
                .map(|b| (b, String::new()))
                .chain(namespaced.into_iter().map(|b| {
                    let ns = object::meta_str(&b, "namespace")
                        .unwrap_or_default()
                        .to_owned();
                    (b, ns)
                }));
        for (binding, namespace) in bindings {
            let Some(role_ref) = binding.get("roleRef") else {
                continue;
            };
            let Some(role) = role_of(self, role_ref, &namespace).await? else {
                continue;
            };
            for subject in binding
                .get("subjects")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let name = subject.get("name").and_then(Value::as_str).unwrap_or("");
                let grant = Grant {
                    namespace: namespace.clone(),
                    role: role.clone(),
                };
                match subject.get("kind").and_then(Value::as_str) {
                    Some("User") => index.users.entry(name.to_owned()).or_default().push(grant),
                    Some("Group") => index.groups.entry(name.to_owned()).or_default().push(grant),
                    Some("ServiceAccount") => {
                        let ns = subject
                            .get("namespace")
                            .and_then(Value::as_str)
                            .filter(|n| !n.is_empty())
                            .unwrap_or(&namespace);
                        index
                            .users
                            .entry(format!("system:serviceaccount:{ns}:{name}"))
                            .or_default()
                            .push(grant);
                    }
                    _ => {}
                }
            }
        }
        let index = Arc::new(index);
        *self.index.write().unwrap_or_else(|e| e.into_inner()) = Some(index.clone());
        Ok(Some(index))
    }

    /// After a write through this server: reads of that resource wait for the cache to
    /// see it.
    pub async fn written(&self, resource: &ResourceInfo) {
        for lister in self.listers() {
            if lister.lists(resource) {
                lister.written().await;
            }
        }
    }
}

/// What is being asked, in RBAC's terms.
#[derive(Clone, Debug)]
pub struct Attributes<'a> {
    pub verb: &'a str,
    pub group: &'a str,
    /// The resource, with `/subresource` when there is one.
    pub resource: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
}

fn contains(list: Option<&Value>, want: &str) -> bool {
    list.and_then(Value::as_array).is_some_and(|l| {
        l.iter()
            .filter_map(Value::as_str)
            .any(|v| v == "*" || v == want)
    })
}

/// Whether a rule's `resources` cover `resource` (`res` or `res/sub`): `*`, the exact
/// name, `res/*` for every subresource of `res`, or `*/sub` for `sub` of everything.
fn resource_matches(rule: &Value, resource: &str) -> bool {
    let Some(list) = rule.get("resources").and_then(Value::as_array) else {
        return false;
    };
    let sub = resource.split_once('/');
    list.iter().filter_map(Value::as_str).any(|entry| {
        entry == "*"
            || entry == resource
            || sub.is_some_and(|(res, sub)| {
                entry == format!("{res}/*") || entry == format!("*/{sub}")
            })
    })
}

/// Whether one PolicyRule allows the request.
pub fn rule_allows(rule: &Value, a: &Attributes<'_>) -> bool {
    let names = rule.get("resourceNames").and_then(Value::as_array);
    let name_ok = names.is_none_or(|n| n.is_empty())
        || (!a.name.is_empty() && contains(rule.get("resourceNames"), a.name));
    contains(rule.get("verbs"), a.verb)
        && contains(rule.get("apiGroups"), a.group)
        && resource_matches(rule, a.resource)
        && name_ok
}

/// Whether a binding's subjects include the user.
pub fn subject_matches(subject: &Value, user: &UserInfo, binding_namespace: &str) -> bool {
    let name = subject.get("name").and_then(Value::as_str).unwrap_or("");
    match subject.get("kind").and_then(Value::as_str) {
        Some("User") => name == user.name,
        Some("Group") => user.in_group(name),
        Some("ServiceAccount") => {
            let ns = subject
                .get("namespace")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .unwrap_or(binding_namespace);
            user.name == format!("system:serviceaccount:{ns}:{name}")
        }
        _ => false,
    }
}

fn read_error(e: trellis_store::Error) -> ApiError {
    ApiError::internal(format!("read RBAC objects: {e}"))
}

pub(crate) const RBAC: &str = "/registry/rbac.authorization.k8s.io/";

/// The role a binding's `roleRef` names, shared with the cache (its rules are read in
/// place, not copied, on every check).
async fn role_of(
    rbac: &RbacReader,
    role_ref: &Value,
    namespace: &str,
) -> Result<Option<Arc<Object>>, ApiError> {
    let name = role_ref.get("name").and_then(Value::as_str).unwrap_or("");
    let role = match role_ref.get("kind").and_then(Value::as_str) {
        Some("ClusterRole") => rbac
            .cluster_roles
            .get(&format!("{RBAC}clusterroles/{name}"))
            .await
            .map_err(read_error)?,
        Some("Role") if !namespace.is_empty() => rbac
            .roles
            .get(&format!("{RBAC}roles/{namespace}/{name}"))
            .await
            .map_err(read_error)?,
        _ => None,
    };
    Ok(role)
}

/// A role's rules.
fn rules(role: &Object) -> &[Value] {
    role.get("rules")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// The bindings that may grant something in `namespace`: every ClusterRoleBinding,
/// and the namespace's RoleBindings, each with the namespace it grants in.
async fn bindings(
    rbac: &RbacReader,
    namespace: &str,
) -> Result<Vec<(Arc<Object>, String)>, ApiError> {
    let mut bindings: Vec<(Arc<Object>, String)> = rbac
        .cluster_role_bindings
        .list_all()
        .await
        .map_err(read_error)?
        .into_iter()
        .map(|b| (b, String::new()))
        .collect();
    if !namespace.is_empty() {
        bindings.extend(
            rbac.role_bindings
                .list(namespace)
                .await
                .map_err(read_error)?
                .into_iter()
                .map(|b| (b, namespace.to_owned())),
        );
    }
    Ok(bindings)
}

/// Allows the request or explains the refusal.
pub async fn authorize(
    rbac: &RbacReader,
    user: &UserInfo,
    a: &Attributes<'_>,
) -> Result<(), ApiError> {
    if user.in_group(groups::MASTERS)
        || any_rule(rbac, user, a.namespace, |rule| rule_allows(rule, a)).await?
    {
        return Ok(());
    }
    Err(ApiError::forbidden(
        &user.name,
        a.verb,
        a.group,
        a.resource,
        a.namespace,
        a.name,
    ))
}

/// Allows a request for a non-resource URL (`/metrics`, `/api`, `/openapi/v2`) when a
/// ClusterRole bound to the user has a `nonResourceURLs` rule for it, or explains the
/// refusal as kube-apiserver does.
pub async fn authorize_non_resource(
    rbac: &RbacReader,
    user: &UserInfo,
    verb: &str,
    path: &str,
) -> Result<(), ApiError> {
    // Only cluster-wide bindings grant non-resource URLs.
    if user.in_group(groups::MASTERS)
        || any_rule(rbac, user, "", |rule| {
            non_resource_rule_allows(rule, verb, path)
        })
        .await?
    {
        return Ok(());
    }
    Err(ApiError::new(
        403,
        trellis_api::status::Reason::Forbidden,
        format!(
            "forbidden: User \"{}\" cannot {verb} path \"{path}\"",
            user.name
        ),
    ))
}

/// Whether a rule of a role bound to `user` (cluster-wide, or in `namespace`) passes
/// `allows`.
async fn any_rule(
    rbac: &RbacReader,
    user: &UserInfo,
    namespace: &str,
    allows: impl Fn(&Value) -> bool,
) -> Result<bool, ApiError> {
    if let Some(index) = rbac.index().await? {
        return Ok(index.allows(user, namespace, &allows));
    }
    for (binding, namespace) in bindings(rbac, namespace).await? {
        let bound = binding
            .get("subjects")
            .and_then(Value::as_array)
            .is_some_and(|s| s.iter().any(|s| subject_matches(s, user, &namespace)));
        let Some(role_ref) = binding.get("roleRef").filter(|_| bound) else {
            continue;
        };
        if role_of(rbac, role_ref, &namespace)
            .await?
            .is_some_and(|role| rules(&role).iter().any(&allows))
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Every rule granted to `user` in `namespace` (cluster-wide grants included), as
/// SelfSubjectRulesReviews list them. Unlike [`authorize`], `system:masters` gets no
/// shortcut here: its rules are those of the roles bound to it (`cluster-admin`).
pub async fn rules_for(
    rbac: &RbacReader,
    user: &UserInfo,
    namespace: &str,
) -> Result<Vec<Value>, ApiError> {
    let mut granted = Vec::new();
    for (binding, binding_namespace) in bindings(rbac, namespace).await? {
        let bound = binding
            .get("subjects")
            .and_then(Value::as_array)
            .is_some_and(|s| {
                s.iter()
                    .any(|s| subject_matches(s, user, &binding_namespace))
            });
        if let (true, Some(role_ref)) = (bound, binding.get("roleRef"))
            && let Some(role) = role_of(rbac, role_ref, &binding_namespace).await?
        {
            granted.extend(rules(&role).iter().cloned());
        }
    }
    Ok(granted)
}

/// Whether one rule allows `verb` on a non-resource URL (`/healthz`, `/api/*`).
pub fn non_resource_rule_allows(rule: &Value, verb: &str, path: &str) -> bool {
    let urls = rule.get("nonResourceURLs").and_then(Value::as_array);
    contains(rule.get("verbs"), verb)
        && urls.is_some_and(|urls| {
            urls.iter().filter_map(Value::as_str).any(|u| {
                u == "*" || u == path || u.strip_suffix('*').is_some_and(|p| path.starts_with(p))
            })
        })
}

/// The group of every bootstrap token's user.
const BOOTSTRAPPERS: &str = crate::authentication::bootstrap_token::BOOTSTRAPPERS;

/// The roles and bindings every cluster starts with.
pub fn bootstrap_objects() -> Vec<(String, Value)> {
    let cluster_role = |name: &str, rules: Value| {
        (
            format!("{RBAC}clusterroles/{name}"),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                   "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"}},
                   "rules": rules}),
        )
    };
    let binding = |name: &str, role: &str, subject: Value| {
        (
            format!("{RBAC}clusterrolebindings/{name}"),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                   "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"}},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                   "subjects": [subject]}),
        )
    };
    let read = json!(["get", "list", "watch"]);
    // As Kubernetes' aggregated view, edit and admin roles: each holds the one before
    // it (this cluster has no aggregation controller, so the rules are spelled out).
    let metrics_rule =
        json!({"apiGroups": ["metrics.k8s.io"], "resources": ["pods", "nodes"], "verbs": read});
    let view_rules = vec![
        json!({"apiGroups": ["", "apps", "coordination.k8s.io"], "resources": ["pods", "pods/log", "pods/status", "configmaps", "endpoints", "events", "limitranges", "namespaces", "namespaces/status", "persistentvolumeclaims", "persistentvolumeclaims/status", "resourcequotas", "resourcequotas/status", "services", "services/status", "serviceaccounts", "controllerrevisions", "daemonsets", "daemonsets/status", "deployments", "deployments/scale", "deployments/status", "replicasets", "replicasets/scale", "replicasets/status", "replicationcontrollers", "replicationcontrollers/scale", "replicationcontrollers/status", "statefulsets", "statefulsets/scale", "statefulsets/status", "leases"], "verbs": read}),
        json!({"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers", "horizontalpodautoscalers/status"], "verbs": read}),
        json!({"apiGroups": ["batch"], "resources": ["cronjobs", "cronjobs/status", "jobs", "jobs/status"], "verbs": read}),
        json!({"apiGroups": ["policy"], "resources": ["poddisruptionbudgets", "poddisruptionbudgets/status"], "verbs": read}),
        metrics_rule.clone(),
    ];
    let mut edit_rules = view_rules.clone();
    edit_rules.extend([
        json!({"apiGroups": ["", "apps", "coordination.k8s.io"], "resources": ["pods", "pods/log", "pods/exec", "pods/portforward", "pods/eviction", "configmaps", "secrets", "endpoints", "events", "persistentvolumeclaims", "services", "serviceaccounts", "daemonsets", "deployments", "deployments/scale", "replicasets", "replicasets/scale", "replicationcontrollers", "replicationcontrollers/scale", "statefulsets", "statefulsets/scale", "leases"], "verbs": ["*"]}),
        json!({"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"], "verbs": ["*"]}),
        json!({"apiGroups": ["batch"], "resources": ["cronjobs", "jobs"], "verbs": ["*"]}),
        json!({"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["*"]}),
    ]);
    let mut admin_rules = edit_rules.clone();
    admin_rules.extend([
        json!({"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"], "verbs": ["*"]}),
        json!({"apiGroups": ["authorization.k8s.io"], "resources": ["localsubjectaccessreviews"], "verbs": ["create"]}),
    ]);
    let group = |name: &str| json!({"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": name});
    let user =
        |name: &str| json!({"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": name});
    let mut objects = vec![
        cluster_role(
            "cluster-admin",
            json!([{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}, {"nonResourceURLs": ["*"], "verbs": ["*"]}]),
        ),
        binding("cluster-admin", "cluster-admin", group(groups::MASTERS)),
        // What every authenticated user may ask about itself, as Kubernetes'
        // `system:basic-user`: `kubectl auth can-i` and `kubectl auth whoami`.
        cluster_role(
            "system:basic-user",
            json!([
                {"apiGroups": ["authorization.k8s.io"], "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"], "verbs": ["create"]},
                {"apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"], "verbs": ["create"]}
            ]),
        ),
        binding(
            "system:basic-user",
            "system:basic-user",
            group(groups::AUTHENTICATED),
        ),
        // Discovery and OpenAPI for every authenticated user, health and version for
        // everyone, `/metrics` for monitoring: Kubernetes' non-resource roles.
        cluster_role(
            "system:discovery",
            json!([{"nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez", "/openapi", "/openapi/*", "/readyz", "/swagger-2.0.0.pb-v1", "/version", "/version/"], "verbs": ["get"]}]),
        ),
        binding(
            "system:discovery",
            "system:discovery",
            group(groups::AUTHENTICATED),
        ),
        cluster_role(
            "system:public-info-viewer",
            json!([{"nonResourceURLs": ["/healthz", "/livez", "/readyz", "/version", "/version/"], "verbs": ["get"]}]),
        ),
        binding(
            "system:public-info-viewer",
            "system:public-info-viewer",
            group(groups::AUTHENTICATED),
        ),
        cluster_role(
            "system:monitoring",
            json!([{"nonResourceURLs": ["/healthz", "/healthz/*", "/livez", "/livez/*", "/metrics", "/metrics/slis", "/readyz", "/readyz/*"], "verbs": ["get"]}]),
        ),
        binding(
            "system:monitoring",
            "system:monitoring",
            group("system:monitoring"),
        ),
        cluster_role("view", json!(view_rules.clone())),
        cluster_role("edit", json!(edit_rules.clone())),
        cluster_role("admin", json!(admin_rules)),
        // Resource metrics for whoever may view, edit or administer a namespace, as
        // metrics-server's aggregated role (aggregated into view, edit and admin here
        // by listing its rule in them).
        (
            format!("{RBAC}clusterroles/system:aggregated-metrics-reader"),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                   "metadata": {"name": "system:aggregated-metrics-reader", "labels": {
                       "kubernetes.io/bootstrapping": "rbac-defaults",
                       "rbac.authorization.k8s.io/aggregate-to-view": "true",
                       "rbac.authorization.k8s.io/aggregate-to-edit": "true",
                       "rbac.authorization.k8s.io/aggregate-to-admin": "true"}},
                   "rules": [metrics_rule.clone()]}),
        ),
        // As Kubernetes' bootstrap roles: each component may take its own Lease only.
        cluster_role(
            "system:kube-scheduler",
            json!([
                {"apiGroups": [""], "resources": ["pods", "nodes", "namespaces"], "verbs": read},
                {"apiGroups": [""], "resources": ["pods/binding", "bindings"], "verbs": ["create"]},
                {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch", "update"]},
                // Preemption deletes its victims.
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["delete"]},
                // Preemption spares what PodDisruptionBudgets protect, where it can.
                {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": read},
                {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch", "update"]},
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["kube-scheduler"], "verbs": ["get", "update"]},
                // Its plugins, as Plugin objects of kind scheduler, and their status.
                {"apiGroups": ["trellis.dev"], "resources": ["plugins"], "verbs": read},
                {"apiGroups": ["trellis.dev"], "resources": ["plugins/status"], "verbs": ["patch", "update"]},
                {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
                {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]}
            ]),
        ),
        binding(
            "system:kube-scheduler",
            "system:kube-scheduler",
            user("system:kube-scheduler"),
        ),
        // The controller manager itself reads everything (the garbage collector and
        // quota need it) and runs its own Lease and events; each controller writes as
        // its own ServiceAccount, bound to `system:controller:NAME`.
        cluster_role(
            "system:kube-controller-manager",
            json!([
                {"apiGroups": ["*"], "resources": ["*"], "verbs": ["list", "watch"]},
                {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch", "update"]},
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["kube-controller-manager"], "verbs": ["get", "update"]},
                {"apiGroups": [""], "resources": ["secrets", "serviceaccounts"], "verbs": ["create", "get", "update"]},
                {"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"]},
                {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
                {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]},
                // It reports on the controller plugins it runs.
                {"apiGroups": ["trellis.dev"], "resources": ["plugins/status"], "verbs": ["patch", "update"]}
            ]),
        ),
        binding(
            "system:kube-controller-manager",
            "system:kube-controller-manager",
            user("system:kube-controller-manager"),
        ),
        // TLS bootstrap, with Kubernetes' (and kubeadm's) names: a bootstrap token may
        // ask for a node certificate, and the approver lets it have one; a node may ask
        // to renew its own.
        cluster_role(
            "system:node-bootstrapper",
            json!([{"apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests"], "verbs": ["create", "get", "list", "watch"]}]),
        ),
        binding(
            "kubeadm:kubelet-bootstrap",
            "system:node-bootstrapper",
            group(BOOTSTRAPPERS),
        ),
        cluster_role(
            "system:certificates.k8s.io:certificatesigningrequests:nodeclient",
            json!([{"apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests/nodeclient"], "verbs": ["create"]}]),
        ),
        binding(
            "kubeadm:node-autoapprove-bootstrap",
            "system:certificates.k8s.io:certificatesigningrequests:nodeclient",
            group(BOOTSTRAPPERS),
        ),
        cluster_role(
            "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient",
            json!([{"apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests/selfnodeclient"], "verbs": ["create"]}]),
        ),
        binding(
            "kubeadm:node-autoapprove-certificate-rotation",
            "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient",
            group(groups::NODES),
        ),
        // What an extension API server binds its account to, as Kubernetes' bootstrap
        // policy has it: delegated authentication and authorization, and the
        // front proxy's CA and names in the authentication ConfigMap.
        cluster_role(
            "system:auth-delegator",
            json!([
                {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
                {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]}
            ]),
        ),
        (
            format!("{RBAC}roles/kube-system/extension-apiserver-authentication-reader"),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": {"name": "extension-apiserver-authentication-reader", "namespace": "kube-system",
                                "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"}},
                   "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                              "resourceNames": ["extension-apiserver-authentication"], "verbs": ["get", "list", "watch"]}]}),
        ),
    ];
    // The built-in controllers, each as its ServiceAccount in kube-system bound to
    // `system:controller:NAME`, with Kubernetes' rules; status and annotations are
    // written with patches here, hence `patch` where Kubernetes has `update` only.
    let events = json!({"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch", "update"]});
    let controllers = [
        (
            "disruption-controller",
            json!([
                {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets/status"], "verbs": ["update", "patch"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["apps"], "resources": ["replicasets", "deployments", "statefulsets"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["replicationcontrollers"], "verbs": ["get", "list", "watch"]},
                // The scale of any other owner of pods, as Kubernetes' finders.
                {"apiGroups": ["*"], "resources": ["*/scale"], "verbs": ["get"]},
                events,
            ]),
        ),
        (
            "replicaset-controller",
            json!([
                {"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["get", "list", "watch", "update", "patch"]},
                {"apiGroups": ["apps"], "resources": ["replicasets/status", "replicasets/finalizers"], "verbs": ["update", "patch"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "create", "delete", "patch"]},
                events,
            ]),
        ),
        (
            "replication-controller",
            json!([
                {"apiGroups": [""], "resources": ["replicationcontrollers"], "verbs": ["get", "list", "watch", "update", "patch"]},
                {"apiGroups": [""], "resources": ["replicationcontrollers/status", "replicationcontrollers/finalizers"], "verbs": ["update", "patch"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "patch", "create", "delete"]},
                events,
            ]),
        ),
        (
            "deployment-controller",
            json!([
                {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list", "watch", "update", "patch"]},
                {"apiGroups": ["apps"], "resources": ["deployments/status", "deployments/finalizers"], "verbs": ["update", "patch"]},
                {"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "update", "watch"]},
                events,
            ]),
        ),
        (
            "endpoint-controller",
            json!([
                {"apiGroups": [""], "resources": ["services", "pods"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["endpoints"], "verbs": ["create", "update", "delete", "get", "list", "watch"]},
                events,
            ]),
        ),
        (
            "endpointslice-controller",
            json!([
                {"apiGroups": [""], "resources": ["services", "pods", "nodes"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["create", "update", "delete", "get", "list", "watch"]},
                events,
            ]),
        ),
        (
            "namespace-controller",
            json!([
                {"apiGroups": ["*"], "resources": ["*"], "verbs": ["get", "list", "watch", "delete", "deletecollection"]},
                {"apiGroups": [""], "resources": ["namespaces/finalize", "namespaces/status"], "verbs": ["update", "patch"]},
                events,
            ]),
        ),
        (
            "node-controller",
            json!([
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "update", "patch", "delete"]},
                {"apiGroups": [""], "resources": ["nodes/status", "pods/status"], "verbs": ["patch", "update"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "delete"]},
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "list", "watch"]},
                events,
            ]),
        ),
        (
            // Quotas may count anything (`count/<resource>`), hence every list and
            // watch, as Kubernetes grants; `get` for the read before a status write.
            "resourcequota-controller",
            json!([
                {"apiGroups": ["*"], "resources": ["*"], "verbs": ["list", "watch"]},
                {"apiGroups": [""], "resources": ["resourcequotas", "resourcequotas/status"], "verbs": ["get"]},
                {"apiGroups": [""], "resources": ["resourcequotas/status"], "verbs": ["update"]},
                events,
            ]),
        ),
        (
            "service-account-controller",
            json!([
                {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["create"]},
                events,
            ]),
        ),
        (
            "root-ca-cert-publisher",
            json!([
                {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create", "update", "patch"]},
                events,
            ]),
        ),
        (
            "daemon-set-controller",
            json!([
                {"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["apps"], "resources": ["daemonsets/status", "daemonsets/finalizers"], "verbs": ["update", "patch"]},
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "create", "delete", "patch"]},
                {"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["create"]},
                {"apiGroups": ["apps"], "resources": ["controllerrevisions"], "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]},
                events,
            ]),
        ),
        (
            "statefulset-controller",
            json!([
                {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["apps"], "resources": ["statefulsets/status", "statefulsets/finalizers"], "verbs": ["update", "patch"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete", "update", "patch"]},
                {"apiGroups": ["apps"], "resources": ["controllerrevisions"], "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]},
                // Claims from volumeClaimTemplates, and their retention policy's owner
                // references and deletes.
                {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
                events,
            ]),
        ),
        (
            "job-controller",
            json!([
                {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "update", "patch"]},
                {"apiGroups": ["batch"], "resources": ["jobs/status", "jobs/finalizers"], "verbs": ["update", "patch"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "create", "delete", "patch"]},
                events,
            ]),
        ),
        (
            "cronjob-controller",
            json!([
                {"apiGroups": ["batch"], "resources": ["cronjobs"], "verbs": ["get", "list", "watch", "update", "patch"]},
                {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "create", "update", "delete", "patch"]},
                {"apiGroups": ["batch"], "resources": ["cronjobs/status", "cronjobs/finalizers"], "verbs": ["update", "patch"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "delete"]},
                events,
            ]),
        ),
        (
            "ttl-after-finished-controller",
            json!([
                {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "delete"]},
                events,
            ]),
        ),
        (
            "horizontal-pod-autoscaler",
            json!([
                {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers/status"], "verbs": ["update", "patch"]},
                // The target's scale, whatever its kind.
                {"apiGroups": ["*"], "resources": ["*/scale"], "verbs": ["get", "update"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
                {"apiGroups": ["metrics.k8s.io"], "resources": ["pods"], "verbs": ["get", "list"]},
                {"apiGroups": ["custom.metrics.k8s.io", "external.metrics.k8s.io"], "resources": ["*"], "verbs": ["get", "list"]},
                events,
            ]),
        ),
        (
            "persistent-volume-binder",
            json!([
                {"apiGroups": [""], "resources": ["persistentvolumes"], "verbs": ["create", "delete", "get", "list", "update", "patch", "watch"]},
                {"apiGroups": [""], "resources": ["persistentvolumes/status"], "verbs": ["update", "patch"]},
                {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "list", "update", "patch", "watch"]},
                {"apiGroups": [""], "resources": ["persistentvolumeclaims/status"], "verbs": ["update", "patch"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "delete"]},
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]},
                {"apiGroups": ["storage.k8s.io"], "resources": ["storageclasses"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["events"], "verbs": ["watch"]},
                events,
            ]),
        ),
        (
            // As rancher's local-path-provisioner: volumes made for claims of its
            // class on the node the scheduler chose.
            "local-path-provisioner",
            json!([
                {"apiGroups": [""], "resources": ["persistentvolumes"], "verbs": ["create", "delete", "get", "list", "watch", "update", "patch"]},
                {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "list", "watch", "update", "patch"]},
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["storage.k8s.io"], "resources": ["storageclasses"], "verbs": ["get", "list", "watch"]},
                events,
            ]),
        ),
        (
            "generic-garbage-collector",
            json!([
                {"apiGroups": ["*"], "resources": ["*"], "verbs": ["get", "list", "watch", "patch", "update", "delete"]},
                events,
            ]),
        ),
    ];
    for (name, rules) in controllers {
        let role = format!("system:controller:{name}");
        objects.push(cluster_role(&role, rules));
        objects.push(binding(
            &role,
            &role,
            json!({"kind": "ServiceAccount", "name": name, "namespace": "kube-system"}),
        ));
    }
    objects
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs<'a>(
        verb: &'a str,
        group: &'a str,
        resource: &'a str,
        namespace: &'a str,
        name: &'a str,
    ) -> Attributes<'a> {
        Attributes {
            verb,
            group,
            resource,
            namespace,
            name,
        }
    }

    #[test]
    fn rules_match_verbs_groups_resources_and_names() {
        let rule =
            json!({"apiGroups": [""], "resources": ["pods", "pods/log"], "verbs": ["get", "list"]});
        assert!(rule_allows(
            &rule,
            &attrs("get", "", "pods", "default", "p")
        ));
        assert!(rule_allows(
            &rule,
            &attrs("get", "", "pods/log", "default", "p")
        ));
        assert!(!rule_allows(
            &rule,
            &attrs("delete", "", "pods", "default", "p")
        ));
        assert!(!rule_allows(
            &rule,
            &attrs("get", "apps", "pods", "default", "p")
        ));
        assert!(!rule_allows(
            &rule,
            &attrs("get", "", "pods/status", "default", "p")
        ));
        let named =
            json!({"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"], "resourceNames": ["a"]});
        assert!(rule_allows(
            &named,
            &attrs("update", "apps", "deployments", "x", "a")
        ));
        assert!(!rule_allows(
            &named,
            &attrs("update", "apps", "deployments", "x", "b")
        ));
        assert!(!rule_allows(
            &named,
            &attrs("list", "apps", "deployments", "x", "")
        ));
    }

    #[test]
    fn bootstrap_roles_cover_the_workloads() {
        let objects = bootstrap_objects();
        let role = |name: &str| {
            let key = format!("{RBAC}clusterroles/{name}");
            let (_, role) = objects.iter().find(|(k, _)| *k == key).expect(name);
            role["rules"].as_array().unwrap().clone()
        };
        let allows = |name: &str, verb, group, resource| {
            role(name)
                .iter()
                .any(|r| rule_allows(r, &attrs(verb, group, resource, "ns", "x")))
        };
        let hpa = "system:controller:horizontal-pod-autoscaler";
        assert!(allows(hpa, "update", "apps", "statefulsets/scale"));
        assert!(allows(hpa, "list", "metrics.k8s.io", "pods"));
        assert!(!allows(hpa, "update", "apps", "statefulsets"));
        let sts = "system:controller:statefulset-controller";
        assert!(allows(sts, "create", "", "persistentvolumeclaims"));
        assert!(allows(sts, "patch", "apps", "statefulsets/status"));
        let provisioner = "system:controller:local-path-provisioner";
        assert!(allows(provisioner, "create", "", "persistentvolumes"));
        assert!(!allows(provisioner, "delete", "", "persistentvolumeclaims"));
        assert!(allows("view", "list", "batch", "cronjobs"));
        assert!(allows("view", "get", "metrics.k8s.io", "pods"));
        assert!(!allows("view", "create", "batch", "jobs"));
        assert!(allows("edit", "create", "batch", "jobs"));
        assert!(allows("edit", "update", "apps", "statefulsets/scale"));
        assert!(!allows(
            "edit",
            "create",
            "rbac.authorization.k8s.io",
            "rolebindings"
        ));
        assert!(allows(
            "admin",
            "create",
            "rbac.authorization.k8s.io",
            "rolebindings"
        ));
        assert!(allows(
            "admin",
            "delete",
            "autoscaling",
            "horizontalpodautoscalers"
        ));
    }

    #[test]
    fn subjects_match_users_groups_and_service_accounts() {
        let bob = UserInfo::new("bob", ["dev"]);
        assert!(subject_matches(
            &json!({"kind": "User", "name": "bob"}),
            &bob,
            ""
        ));
        assert!(subject_matches(
            &json!({"kind": "Group", "name": "dev"}),
            &bob,
            ""
        ));
        assert!(!subject_matches(
            &json!({"kind": "Group", "name": "ops"}),
            &bob,
            ""
        ));
        let sa = UserInfo::new("system:serviceaccount:team:builder", Vec::<String>::new());
        assert!(subject_matches(
            &json!({"kind": "ServiceAccount", "name": "builder"}),
            &sa,
            "team"
        ));
        assert!(!subject_matches(
            &json!({"kind": "ServiceAccount", "name": "builder"}),
            &sa,
            "other"
        ));
    }
}
