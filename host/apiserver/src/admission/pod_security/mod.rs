//! `PodSecurity`: Kubernetes' Pod Security admission, built in. Each namespace is held
//! to the Pod Security Standards (`privileged`, `baseline`, `restricted`, see
//! [`policy`]) its labels name, in three modes:
//!
//! - `pod-security.kubernetes.io/enforce`: a pod that violates the level is refused
//!   (403, `pods "x" is forbidden: violates PodSecurity "baseline:latest": …`);
//! - `…/warn`: the request gets a `Warning` (`would violate PodSecurity …`), which
//!   kubectl prints;
//! - `…/audit`: the request's audit line gets `pod-security.kubernetes.io/audit-violations`.
//!
//! Each mode's `…-version` label (`v1.x` or `latest`) pins the checks of that
//! Kubernetes release. A namespace without labels gets the cluster's defaults
//! ([`Config`], from `--pod-security-config`). Pods are evaluated on create and on
//! updates that can change what they run; pod controllers' templates (Deployment,
//! Job, …) are warned about and audited, never refused, as in Kubernetes. Raising a
//! namespace's `enforce` level warns about the pods already in it that would not be
//! admitted now.
//!
//! A `process` container with `privileged: true` runs as a host process, so it is
//! what `baseline` forbids; the checks apply whatever the pod's RuntimeClass, unless
//! the configuration exempts that class.

pub mod config;
pub mod policy;

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;
use trellis_api::ApiError;
use trellis_api::registry::ResourceInfo;
use trellis_api::status::StatusCause;
use trellis_store::Store;

pub use config::{Config, Exemptions, Policy};
pub use policy::{Level, LevelVersion, Version};

use super::chain::{Admission, Attributes};
use crate::object::Object;
use crate::storage::lister::Lister;
use crate::storage::watch_cache::WatchCache;

/// The prefix of the namespace labels and audit annotations.
const PREFIX: &str = "pod-security.kubernetes.io/";

/// The most pods a namespace's new enforce level is checked against, and how long
/// that may take, as Kubernetes bounds it.
const MAX_PODS_TO_CHECK: usize = 3000;
const POD_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Pod subresources whose writes cannot change what a pod runs.
const IGNORED_POD_SUBRESOURCES: &[&str] = &[
    "exec",
    "attach",
    "binding",
    "eviction",
    "log",
    "portforward",
    "proxy",
    "status",
];

#[derive(Debug)]
pub struct PodSecurity {
    config: Config,
    namespaces: Lister,
    pods: Lister,
}

impl PodSecurity {
    pub fn new(config: Config) -> Self {
        Self {
            config,
            namespaces: Lister::new("", "namespaces"),
            pods: Lister::new("", "pods"),
        }
    }

    /// The policy of a namespace with `labels`, and the errors of labels that do not
    /// parse. As in Kubernetes, a bad enforce level is evaluated as `restricted`, a bad
    /// audit or warn level as `privileged` (they fail open), a bad version as `latest`.
    pub fn policy_for(&self, labels: Option<&Value>) -> (Policy, Vec<StatusCause>) {
        let mut policy = self.config.defaults;
        let mut errors = Vec::new();
        let label = |mode: &str| {
            labels
                .and_then(|l| l.get(format!("{PREFIX}{mode}")))
                .and_then(Value::as_str)
        };
        let modes: [(&str, &mut LevelVersion, Level); 3] = [
            ("enforce", &mut policy.enforce, Level::Restricted),
            ("audit", &mut policy.audit, Level::Privileged),
            ("warn", &mut policy.warn, Level::Privileged),
        ];
        for (mode, lv, on_error) in modes {
            if let Some(value) = label(mode) {
                lv.level = Level::parse(value).unwrap_or_else(|e| {
                    errors.push(label_error(mode, value, &e));
                    on_error
                });
            }
            let version_label = format!("{mode}-version");
            if let Some(value) = label(&version_label) {
                lv.version = Version::parse(value).unwrap_or_else(|e| {
                    errors.push(label_error(&version_label, value, &e));
                    Version::Latest
                });
            }
        }
        (policy, errors)
    }

    async fn namespace_labels(&self, namespace: &str) -> Result<Option<Value>, ApiError> {
        let key = format!("{}{namespace}", self.namespaces.resource_prefix());
        let ns = self.namespaces.get(&key).await.map_err(|e| {
            tracing::warn!(%namespace, error = %e, "reading the pod's namespace failed");
            ApiError::internal(format!("failed to lookup namespace {namespace}"))
        })?;
        Ok(ns.and_then(|ns| ns.get("metadata")?.get("labels").cloned()))
    }

    fn exempt_namespace(&self, namespace: &str) -> bool {
        !namespace.is_empty()
            && self
                .config
                .exemptions
                .namespaces
                .iter()
                .any(|n| n == namespace)
    }

    fn exempt_user(&self, user: &str) -> bool {
        !user.is_empty() && self.config.exemptions.usernames.iter().any(|u| u == user)
    }

    fn exempt_runtime_class(&self, spec: &Value) -> bool {
        spec.get("runtimeClassName")
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty())
            .is_some_and(|c| {
                self.config
                    .exemptions
                    .runtime_classes
                    .iter()
                    .any(|r| r == c)
            })
    }

    async fn validate_namespace(
        &self,
        attrs: &Attributes<'_>,
        ns: &Object,
        old: Option<&Object>,
    ) -> Result<(), ApiError> {
        if attrs.subresource.is_some() {
            return Ok(());
        }
        let labels = |o: &Object| o.get("metadata").and_then(|m| m.get("labels")).cloned();
        let (new_policy, new_errors) = self.policy_for(labels(ns).as_ref());
        let invalid =
            |errors: Vec<StatusCause>| Err(ApiError::invalid("", "Namespace", attrs.name, errors));
        let Some(old) = old.filter(|_| attrs.operation == "UPDATE") else {
            return if new_errors.is_empty() {
                Ok(())
            } else {
                invalid(new_errors)
            };
        };
        let (old_policy, old_errors) = self.policy_for(labels(old).as_ref());
        if !new_errors.is_empty() && new_errors != old_errors {
            return invalid(new_errors);
        }
        // As Kubernetes: only a stricter (or re-versioned) enforce level makes the
        // namespace's pods worth a look.
        let (new, old) = (new_policy.enforce, old_policy.enforce);
        if new == old
            || new.level == Level::Privileged
            || (new.version == old.version && new.level <= old.level)
            || self.exempt_namespace(attrs.name)
        {
            return Ok(());
        }
        for warning in self.evaluate_pods_in_namespace(attrs.name, new).await {
            crate::warnings::add(warning);
        }
        Ok(())
    }

    /// Kubernetes' `EvaluatePodsInNamespace`: the warnings for the pods of
    /// `namespace` that `enforce` would refuse, grouped by what they violate, one pod
    /// per controller first, bounded in count and time.
    async fn evaluate_pods_in_namespace(
        &self,
        namespace: &str,
        enforce: LevelVersion,
    ) -> Vec<String> {
        let pods = match self.pods.list(namespace).await {
            Ok(pods) => pods,
            Err(e) => {
                tracing::warn!(%namespace, error = %e, "listing pods for a new enforce level failed");
                return vec![
                    "failed to list pods while checking new PodSecurity enforce level".into(),
                ];
            }
        };
        let started = tokio::time::Instant::now();
        let mut first = Vec::new();
        let mut replicas = Vec::new();
        let mut controllers = std::collections::HashSet::new();
        for pod in &pods {
            let spec = pod.get("spec").unwrap_or(&Value::Null);
            if self.exempt_runtime_class(spec) {
                continue;
            }
            match controller_uid(pod) {
                Some(uid) if controllers.contains(&uid) => replicas.push(pod),
                Some(uid) => {
                    controllers.insert(uid);
                    first.push(pod);
                }
                None => first.push(pod),
            }
        }
        first.extend(replicas);
        let total = first.len();
        let mut checked = total.min(MAX_PODS_TO_CHECK);
        let mut order: Vec<String> = Vec::new();
        let mut counts: HashMap<String, (String, usize)> = HashMap::new();
        for (i, pod) in first.iter().take(MAX_PODS_TO_CHECK).enumerate() {
            let result = policy::evaluate(
                enforce,
                pod.get("metadata").unwrap_or(&Value::Null),
                pod.get("spec").unwrap_or(&Value::Null),
            );
            if !result.allowed() {
                let name = crate::object::meta_str(pod, "name")
                    .unwrap_or("")
                    .to_owned();
                let warning = result.reasons();
                match counts.get_mut(&warning) {
                    Some((first_name, count)) => {
                        if name < *first_name {
                            *first_name = name;
                        }
                        *count += 1;
                    }
                    None => {
                        order.push(warning.clone());
                        counts.insert(warning, (name, 1));
                    }
                }
            }
            if started.elapsed() > POD_CHECK_TIMEOUT {
                checked = i + 1;
                break;
            }
        }
        let mut warnings = Vec::new();
        if checked < total {
            warnings.push(format!(
                "new PodSecurity enforce level only checked against the first {checked} of {total} existing pods"
            ));
        }
        if !order.is_empty() {
            warnings.push(format!(
                "existing pods in namespace {namespace:?} violate the new PodSecurity enforce level \"{enforce}\""
            ));
        }
        let mut pod_warnings: Vec<String> = order
            .into_iter()
            .map(|warning| {
                let (name, count) = &counts[&warning];
                match count {
                    1 => format!("{name}: {warning}"),
                    2 => format!("{name} (and 1 other pod): {warning}"),
                    n => format!("{name} (and {} other pods): {warning}", n - 1),
                }
            })
            .collect();
        pod_warnings.sort();
        warnings.extend(pod_warnings);
        warnings
    }

    async fn validate_pod(
        &self,
        attrs: &Attributes<'_>,
        pod: &Object,
        old: Option<&Object>,
    ) -> Result<(), ApiError> {
        if attrs
            .subresource
            .is_some_and(|s| IGNORED_POD_SUBRESOURCES.contains(&s))
        {
            return Ok(());
        }
        let namespace = attrs.namespace.unwrap_or("");
        if self.exempt_namespace(namespace) {
            crate::warnings::annotate(format!("{PREFIX}exempt"), "namespace");
            return Ok(());
        }
        if self.exempt_user(&attrs.user.name) {
            crate::warnings::annotate(format!("{PREFIX}exempt"), "user");
            return Ok(());
        }
        let (policy, errors) = self.policy_for(self.namespace_labels(namespace).await?.as_ref());
        if errors.is_empty()
            && [policy.enforce, policy.warn, policy.audit]
                .iter()
                .all(|lv| lv.level == Level::Privileged)
        {
            crate::warnings::annotate(
                format!("{PREFIX}enforce-policy"),
                LevelVersion::new(Level::Privileged, Version::Latest).to_string(),
            );
            return Ok(());
        }
        if let Some(old) = old.filter(|_| attrs.operation == "UPDATE")
            && !significant_pod_update(pod, old)
        {
            return Ok(());
        }
        let metadata = pod.get("metadata").unwrap_or(&Value::Null);
        let spec = pod.get("spec").unwrap_or(&Value::Null);
        self.evaluate(attrs, policy, &errors, metadata, spec, true)
    }

    async fn validate_controller(
        &self,
        attrs: &Attributes<'_>,
        obj: &Object,
    ) -> Result<(), ApiError> {
        if attrs.subresource.is_some() {
            return Ok(());
        }
        let namespace = attrs.namespace.unwrap_or("");
        if self.exempt_namespace(namespace) {
            crate::warnings::annotate(format!("{PREFIX}exempt"), "namespace");
            return Ok(());
        }
        if self.exempt_user(&attrs.user.name) {
            crate::warnings::annotate(format!("{PREFIX}exempt"), "user");
            return Ok(());
        }
        // A template is never refused: a failed lookup is only audited.
        let labels = match self.namespace_labels(namespace).await {
            Ok(labels) => labels,
            Err(_) => {
                crate::warnings::annotate(
                    format!("{PREFIX}error"),
                    format!("failed to lookup namespace {namespace}"),
                );
                return Ok(());
            }
        };
        let (policy, errors) = self.policy_for(labels.as_ref());
        if errors.is_empty()
            && policy.warn.level == Level::Privileged
            && policy.audit.level == Level::Privileged
        {
            return Ok(());
        }
        let Some(template) = pod_template(attrs.resource, obj) else {
            return Ok(());
        };
        let metadata = template.get("metadata").unwrap_or(&Value::Null);
        let spec = template.get("spec").unwrap_or(&Value::Null);
        self.evaluate(attrs, policy, &errors, metadata, spec, false)
    }

    /// Kubernetes' `EvaluatePod`: the refusal when `enforce` and the pod violates
    /// the enforce level; else the warning, and in any case the audit annotations.
    fn evaluate(
        &self,
        attrs: &Attributes<'_>,
        policy: Policy,
        errors: &[StatusCause],
        metadata: &Value,
        spec: &Value,
        enforce: bool,
    ) -> Result<(), ApiError> {
        if self.exempt_runtime_class(spec) {
            crate::warnings::annotate(format!("{PREFIX}exempt"), "runtimeClass");
            return Ok(());
        }
        if !errors.is_empty() {
            let listed: Vec<String> = errors
                .iter()
                .map(|c| format!("{}: {}", c.field, c.message))
                .collect();
            crate::warnings::annotate(
                format!("{PREFIX}error"),
                format!("Failed to parse policy: {}", listed.join(", ")),
            );
        }
        let mut results: HashMap<LevelVersion, policy::Evaluation> = HashMap::new();
        let mut result_for = |lv: LevelVersion| {
            results
                .entry(lv)
                .or_insert_with(|| policy::evaluate(lv, metadata, spec))
                .clone()
        };
        let mut refusal = None;
        if enforce {
            crate::warnings::annotate(
                format!("{PREFIX}enforce-policy"),
                policy.enforce.to_string(),
            );
            let result = result_for(policy.enforce);
            if !result.allowed() {
                refusal = Some(ApiError::admission_forbidden(
                    &attrs.resource.group,
                    &attrs.resource.plural,
                    attrs.name,
                    &format!(
                        "violates PodSecurity \"{}\": {}",
                        policy.enforce,
                        result.details()
                    ),
                ));
            }
        }
        let audit = result_for(policy.audit);
        if !audit.allowed() {
            crate::warnings::annotate(
                format!("{PREFIX}audit-violations"),
                format!(
                    "would violate PodSecurity \"{}\": {}",
                    policy.audit,
                    audit.details()
                ),
            );
        }
        if let Some(refusal) = refusal {
            // No warning on a request that is refused anyway.
            return Err(refusal);
        }
        let warn = result_for(policy.warn);
        if !warn.allowed() {
            crate::warnings::add(format!(
                "would violate PodSecurity \"{}\": {}",
                policy.warn,
                warn.details()
            ));
        }
        Ok(())
    }
}

fn label_error(mode: &str, value: &str, detail: &str) -> StatusCause {
    StatusCause::invalid(format!("metadata.labels[{PREFIX}{mode}]"), value, detail)
}

fn controller_uid(pod: &Object) -> Option<String> {
    pod.get("metadata")?
        .get("ownerReferences")?
        .as_array()?
        .iter()
        .find(|r| r.get("controller").and_then(Value::as_bool) == Some(true))?
        .get("uid")?
        .as_str()
        .map(str::to_owned)
}

/// The pod template of a pod controller, as Kubernetes' `DefaultPodSpecExtractor`
/// finds it; `None` for other resources (and a controller without one).
fn pod_template<'a>(resource: &ResourceInfo, obj: &'a Object) -> Option<&'a Value> {
    let template = match (resource.group.as_str(), resource.plural.as_str()) {
        ("", "podtemplates") => obj.get("template")?,
        ("batch", "cronjobs") => obj
            .get("spec")?
            .get("jobTemplate")?
            .get("spec")?
            .get("template")?,
        ("", "replicationcontrollers")
        | ("apps", "replicasets" | "deployments" | "statefulsets" | "daemonsets")
        | ("batch", "jobs") => obj.get("spec")?.get("template")?,
        _ => return None,
    };
    (!template.is_null()).then_some(template)
}

fn is_pod_controller(resource: &ResourceInfo) -> bool {
    matches!(
        (resource.group.as_str(), resource.plural.as_str()),
        ("", "podtemplates" | "replicationcontrollers")
            | (
                "apps",
                "replicasets" | "deployments" | "statefulsets" | "daemonsets"
            )
            | ("batch", "jobs" | "cronjobs")
    )
}

/// Kubernetes' `isSignificantPodUpdate`: only an update that can change what the pod
/// runs (images, seccomp annotations, containers added) is evaluated; labels, status
/// and the like pass.
fn significant_pod_update(pod: &Object, old: &Object) -> bool {
    let annotation = |o: &Object, key: &str| {
        o.get("metadata")
            .and_then(|m| m.get("annotations"))
            .and_then(|a| a.get(key))
            .cloned()
    };
    const POD_SECCOMP: &str = "seccomp.security.alpha.kubernetes.io/pod";
    if annotation(pod, POD_SECCOMP) != annotation(old, POD_SECCOMP) {
        return true;
    }
    let list = |o: &Object, key: &str| -> Vec<Value> {
        o.get("spec")
            .and_then(|s| s.get(key))
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let container_changed = |c: &Value, o: &Value| {
        let name = c.get("name").and_then(Value::as_str).unwrap_or("");
        let key = format!("container.seccomp.security.alpha.kubernetes.io/{name}");
        c.get("image") != o.get("image") || annotation(pod, &key) != annotation(old, &key)
    };
    for key in ["containers", "initContainers"] {
        let (new, before) = (list(pod, key), list(old, key));
        if new.len() != before.len()
            || new
                .iter()
                .zip(&before)
                .any(|(c, o)| container_changed(c, o))
        {
            return true;
        }
    }
    let before = list(old, "ephemeralContainers");
    list(pod, "ephemeralContainers").iter().any(|c| {
        match before.iter().find(|o| o.get("name") == c.get("name")) {
            None => true,
            Some(o) => container_changed(c, o),
        }
    })
}

#[async_trait]
impl Admission for PodSecurity {
    fn name(&self) -> &str {
        "PodSecurity"
    }

    fn init(&self, store: &Arc<dyn Store>, cache: &Arc<WatchCache>) {
        self.namespaces.init(store, cache);
        self.pods.init(store, cache);
    }

    async fn written(&self, resource: &ResourceInfo, _verb: &str, _namespace: Option<&str>) {
        // A namespace labelled just now holds the next pod created in it.
        if self.namespaces.lists(resource) {
            self.namespaces.written().await;
        }
    }

    async fn validate(
        &self,
        attrs: &Attributes<'_>,
        obj: &Object,
        old: Option<&Object>,
    ) -> Result<(), ApiError> {
        if !matches!(attrs.operation, "CREATE" | "UPDATE") {
            return Ok(());
        }
        let resource = attrs.resource;
        if resource.group.is_empty() && resource.plural == "namespaces" {
            self.validate_namespace(attrs, obj, old).await
        } else if resource.group.is_empty() && resource.plural == "pods" {
            self.validate_pod(attrs, obj, old).await
        } else if is_pod_controller(resource) {
            self.validate_controller(attrs, obj).await
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use trellis_api::UserInfo;

    /// A built-in resource, or one served only when defined (Jobs, CronJobs…) made
    /// from a built-in one.
    fn resource(group: &str, plural: &str) -> ResourceInfo {
        let all = trellis_api::registry::builtins();
        all.iter()
            .find(|r| r.group == group && r.plural == plural)
            .cloned()
            .unwrap_or_else(|| ResourceInfo {
                group: group.into(),
                plural: plural.into(),
                ..all
                    .iter()
                    .find(|r| r.plural == "deployments")
                    .unwrap()
                    .clone()
            })
    }

    fn obj(v: Value) -> Object {
        serde_json::from_value(v).unwrap()
    }

    fn attrs<'a>(
        res: &'a ResourceInfo,
        op: &'static str,
        user: &'a UserInfo,
        name: &'a str,
    ) -> Attributes<'a> {
        Attributes {
            resource: res,
            operation: op,
            namespace: Some("team"),
            name,
            subresource: None,
            user,
            dry_run: false,
        }
    }

    fn privileged_pod() -> Object {
        obj(json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "sh", "image": "file:///bin/sh", "securityContext": {"privileged": true}}
        ]}}))
    }

    #[test]
    fn labels_override_defaults_and_bad_values_are_strict_for_enforce_only() {
        let step = PodSecurity::new(Config::default());
        let (policy, errors) = step.policy_for(None);
        assert_eq!(policy, Config::default().defaults);
        assert!(errors.is_empty());
        let labels = json!({
            "pod-security.kubernetes.io/enforce": "privileged",
            "pod-security.kubernetes.io/warn": "baseline",
            "pod-security.kubernetes.io/warn-version": "v1.25",
        });
        let (policy, _) = step.policy_for(Some(&labels));
        assert_eq!(policy.enforce.level, Level::Privileged);
        assert_eq!(
            policy.warn,
            LevelVersion::new(Level::Baseline, Version::V1(25))
        );
        let bad = json!({
            "pod-security.kubernetes.io/enforce": "none",
            "pod-security.kubernetes.io/audit": "none",
            "pod-security.kubernetes.io/enforce-version": "1.25",
        });
        let (policy, errors) = step.policy_for(Some(&bad));
        assert_eq!(
            policy.enforce,
            LevelVersion::new(Level::Restricted, Version::Latest)
        );
        assert_eq!(policy.audit.level, Level::Privileged);
        assert_eq!(errors.len(), 3);
        assert_eq!(
            errors[0].message,
            "Invalid value: \"none\": must be one of privileged, baseline, restricted"
        );
        assert_eq!(
            errors[0].field,
            "metadata.labels[pod-security.kubernetes.io/enforce]"
        );
    }

    #[tokio::test]
    async fn refuses_a_privileged_pod_under_the_default_baseline() {
        let step = PodSecurity::new(Config::default());
        let (res, user) = (
            resource("", "pods"),
            UserInfo::new("dev", ["system:authenticated"]),
        );
        let err = step
            .validate(&attrs(&res, "CREATE", &user, "p"), &privileged_pod(), None)
            .await
            .unwrap_err();
        assert_eq!(err.code, 403);
        assert_eq!(
            err.message,
            "pods \"p\" is forbidden: violates PodSecurity \"baseline:latest\": privileged (container \"sh\" must not set securityContext.privileged=true)"
        );
        // Kubernetes' own default admits it; so do exempt users and runtime classes.
        let open = PodSecurity::new(Config::privileged());
        assert!(
            open.validate(&attrs(&res, "CREATE", &user, "p"), &privileged_pod(), None)
                .await
                .is_ok()
        );
        let mut config = Config::default();
        config.exemptions.usernames.push("dev".into());
        let exempt = PodSecurity::new(config);
        assert!(
            exempt
                .validate(&attrs(&res, "CREATE", &user, "p"), &privileged_pod(), None)
                .await
                .is_ok()
        );
    }

    #[tokio::test]
    async fn controllers_are_warned_about_never_refused() {
        let step = PodSecurity::new(Config::default());
        let (res, user) = (resource("apps", "deployments"), UserInfo::new("dev", ["g"]));
        let deployment = obj(json!({"spec": {"template": privileged_pod()}}));
        assert!(
            step.validate(&attrs(&res, "CREATE", &user, "d"), &deployment, None)
                .await
                .is_ok()
        );
    }

    #[tokio::test]
    async fn namespaces_with_bad_labels_are_invalid() {
        let step = PodSecurity::new(Config::default());
        let (res, user) = (resource("", "namespaces"), UserInfo::new("admin", ["g"]));
        let ns = obj(
            json!({"metadata": {"name": "team", "labels": {"pod-security.kubernetes.io/enforce": "strict"}}}),
        );
        let err = step
            .validate(&attrs(&res, "CREATE", &user, "team"), &ns, None)
            .await
            .unwrap_err();
        assert_eq!(err.code, 422);
        assert_eq!(
            err.message,
            "Namespace \"team\" is invalid: metadata.labels[pod-security.kubernetes.io/enforce]: Invalid value: \"strict\": must be one of privileged, baseline, restricted"
        );
        // Left as it was by an update that changes something else: accepted.
        assert!(
            step.validate(&attrs(&res, "UPDATE", &user, "team"), &ns, Some(&ns))
                .await
                .is_ok()
        );
    }

    #[test]
    fn only_updates_that_change_what_runs_are_significant() {
        let pod = privileged_pod();
        let mut relabelled = pod.clone();
        relabelled["metadata"]["labels"] = json!({"a": "b"});
        assert!(!significant_pod_update(&relabelled, &pod));
        let mut new_image = pod.clone();
        new_image["spec"]["containers"][0]["image"] = json!("other");
        assert!(significant_pod_update(&new_image, &pod));
        let mut debugged = pod.clone();
        debugged["spec"]["ephemeralContainers"] = json!([{"name": "debug", "image": "x"}]);
        assert!(significant_pod_update(&debugged, &pod));
    }

    #[test]
    fn templates_are_found_where_each_controller_keeps_them() {
        let cron = obj(
            json!({"spec": {"jobTemplate": {"spec": {"template": {"spec": {"hostPID": true}}}}}}),
        );
        assert_eq!(
            pod_template(&resource("batch", "cronjobs"), &cron).unwrap()["spec"]["hostPID"],
            true
        );
        let template = obj(json!({"template": {"spec": {}}}));
        assert!(pod_template(&resource("", "podtemplates"), &template).is_some());
        assert!(pod_template(&resource("", "configmaps"), &template).is_none());
    }
}
