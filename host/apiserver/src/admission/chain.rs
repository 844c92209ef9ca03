//! The chains themselves: what a step is told, the admission and initializer traits,
//! and the ordered list of steps a write runs through.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::{Value, json};
use trellis_api::registry::ResourceInfo;
use trellis_api::{ApiError, UserInfo};
use trellis_store::Store;

use crate::object::{Object, metadata, metadata_mut};
use crate::storage::watch_cache::WatchCache;

/// What an admission step or initializer is told about a request.
#[derive(Clone, Debug)]
pub struct Attributes<'a> {
    pub resource: &'a ResourceInfo,
    /// `CREATE`, `UPDATE` or `DELETE`.
    pub operation: &'static str,
    pub namespace: Option<&'a str>,
    pub name: &'a str,
    pub subresource: Option<&'a str>,
    pub user: &'a UserInfo,
    pub dry_run: bool,
}

impl Attributes<'_> {
    /// Whether the request creates an object of the core resource `plural` itself
    /// (not a subresource of one).
    pub fn creates_core(&self, plural: &str) -> bool {
        self.operation == "CREATE"
            && self.resource.group.is_empty()
            && self.resource.plural == plural
            && self.subresource.is_none()
    }
}

/// One admission step.
#[async_trait]
pub trait Admission: Send + Sync + std::fmt::Debug {
    fn name(&self) -> &str;

    /// May change `obj`; an error refuses the request.
    async fn mutate(
        &self,
        _attrs: &Attributes<'_>,
        _obj: &mut Object,
        _old: Option<&Object>,
    ) -> Result<(), ApiError> {
        Ok(())
    }

    /// May refuse the request, not change it.
    async fn validate(
        &self,
        _attrs: &Attributes<'_>,
        _obj: &Object,
        _old: Option<&Object>,
    ) -> Result<(), ApiError> {
        Ok(())
    }

    /// Called once as the server starts, with the store the step may read and the
    /// watch cache (as Kubernetes hands its admission plugins their clients and
    /// informers).
    fn init(&self, _store: &Arc<dyn Store>, _cache: &Arc<WatchCache>) {}

    /// Called once the server's state exists (it holds the chain, so a step keeps it
    /// weakly): for namespace selectors, the resources served, and status writes.
    fn attach(&self, _cluster: &Arc<dyn super::Cluster>) {}

    /// Called after a write through the API succeeded: `verb` (`create`, `update`,
    /// `patch`, `delete`, `deletecollection`) of `resource` in `namespace`.
    async fn written(&self, _resource: &ResourceInfo, _verb: &str, _namespace: Option<&str>) {}

    /// Called when a create this step admitted failed afterwards (the store refused
    /// it, or a later check did): whatever the step accounted for `key` must be undone.
    async fn aborted(&self, _resource: &ResourceInfo, _key: &str, _namespace: Option<&str>) {}
}

/// One initializer.
#[async_trait]
pub trait Initializer: Send + Sync + std::fmt::Debug {
    /// The name recorded in `metadata.initializers.pending`.
    fn name(&self) -> &str;

    /// Whether new objects of this resource wait for this initializer.
    fn applies_to(&self, resource: &ResourceInfo) -> bool;

    /// Returns the initialized object, or why it cannot be initialized. The chain
    /// removes the initializer's name from the pending list itself.
    async fn initialize(&self, resource: &ResourceInfo, obj: Object) -> Result<Object, String>;
}

/// Initializers that come and go while the server runs (plugins); asked afresh for
/// every create.
pub trait InitializerSource: Send + Sync + std::fmt::Debug {
    fn initializers(&self) -> Vec<Arc<dyn Initializer>>;
}

/// The name of the quota step, which every other step runs before.
pub const RESOURCE_QUOTA: &str = "ResourceQuota";

/// The configured chains, in order.
#[derive(Clone, Debug, Default)]
pub struct Chains {
    pub admission: Vec<Arc<dyn Admission>>,
    pub initializers: Vec<Arc<dyn Initializer>>,
    /// Consulted after `initializers`.
    pub initializer_sources: Vec<Arc<dyn InitializerSource>>,
}

impl Chains {
    /// Adds a step at the end of the chain, but before `ResourceQuota`: as in
    /// Kubernetes, quota runs last, so a step after it can never refuse a write whose
    /// usage was already charged.
    pub fn add(&mut self, step: Arc<dyn Admission>) {
        let at = self
            .admission
            .iter()
            .position(|s| s.name() == RESOURCE_QUOTA)
            .unwrap_or(self.admission.len());
        self.admission.insert(at, step);
    }

    /// Hands every step the store and the cache; see [`Admission::init`].
    pub fn init(&self, store: &Arc<dyn Store>, cache: &Arc<WatchCache>) {
        for step in &self.admission {
            step.init(store, cache);
        }
    }

    /// Hands every step the server's state; see [`Admission::attach`].
    pub fn attach(&self, cluster: &Arc<dyn super::Cluster>) {
        for step in &self.admission {
            step.attach(cluster);
        }
    }

    /// Tells every step of a write that succeeded; see [`Admission::written`].
    pub async fn written(&self, resource: &ResourceInfo, verb: &str, namespace: Option<&str>) {
        for step in &self.admission {
            step.written(resource, verb, namespace).await;
        }
    }

    /// Tells every step that a create it admitted failed; see [`Admission::aborted`].
    pub async fn aborted(&self, resource: &ResourceInfo, key: &str, namespace: Option<&str>) {
        for step in &self.admission {
            step.aborted(resource, key, namespace).await;
        }
    }

    pub async fn mutate(
        &self,
        attrs: &Attributes<'_>,
        obj: &mut Object,
        old: Option<&Object>,
    ) -> Result<(), ApiError> {
        for step in &self.admission {
            step.mutate(attrs, obj, old).await?;
        }
        Ok(())
    }

    pub async fn validate(
        &self,
        attrs: &Attributes<'_>,
        obj: &Object,
        old: Option<&Object>,
    ) -> Result<(), ApiError> {
        for step in &self.admission {
            step.validate(attrs, obj, old).await?;
        }
        Ok(())
    }

    /// Names of the initializers a new object of `resource` waits for.
    pub fn pending_for(&self, resource: &ResourceInfo) -> Vec<String> {
        self.all_initializers()
            .iter()
            .filter(|i| i.applies_to(resource))
            .map(|i| i.name().to_owned())
            .collect()
    }

    pub fn initializer(&self, name: &str) -> Option<Arc<dyn Initializer>> {
        self.all_initializers()
            .into_iter()
            .find(|i| i.name() == name)
    }

    fn all_initializers(&self) -> Vec<Arc<dyn Initializer>> {
        let mut all = self.initializers.clone();
        for source in &self.initializer_sources {
            all.extend(source.initializers());
        }
        all
    }
}

/// The names in `metadata.initializers.pending`.
pub fn pending(obj: &Object) -> Vec<String> {
    metadata(obj)
        .and_then(|m| m.get("initializers"))
        .and_then(|i| i.get("pending"))
        .and_then(Value::as_array)
        .map(|p| {
            p.iter()
                .filter_map(|e| e.get("name").and_then(Value::as_str))
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

pub fn set_pending(obj: &mut Object, names: &[String]) {
    let meta = metadata_mut(obj);
    if names.is_empty() {
        let keep_result = meta
            .get("initializers")
            .and_then(|i| i.get("result"))
            .cloned();
        match keep_result {
            Some(result) => {
                meta.insert(
                    "initializers".into(),
                    json!({"pending": [], "result": result}),
                );
            }
            None => {
                meta.remove("initializers");
            }
        }
    } else {
        let list: Vec<Value> = names.iter().map(|n| json!({"name": n})).collect();
        meta.insert("initializers".into(), json!({"pending": list}));
    }
}

/// Checks an update of an uninitialized object: the pending list may only lose its
/// first entry (that initializer finishing) or stay as it is.
pub fn check_pending_update(old: &Object, new: &Object) -> Result<(), String> {
    let before = pending(old);
    let after = pending(new);
    if after == before || (!before.is_empty() && after == before[1..]) {
        return Ok(());
    }
    Err(format!(
        "only the first pending initializer ({}) may act, and only by removing itself; pending {before:?} cannot become {after:?}",
        before.first().map(String::as_str).unwrap_or("none")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::serviceaccount::ServiceAccountDefault;

    fn obj(v: Value) -> Object {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn only_the_first_initializer_may_remove_itself() {
        let old =
            obj(json!({"metadata": {"initializers": {"pending": [{"name": "a"}, {"name": "b"}]}}}));
        let first_done = obj(json!({"metadata": {"initializers": {"pending": [{"name": "b"}]}}}));
        let second_done = obj(json!({"metadata": {"initializers": {"pending": [{"name": "a"}]}}}));
        assert!(check_pending_update(&old, &old).is_ok());
        assert!(check_pending_update(&old, &first_done).is_ok());
        assert!(
            check_pending_update(&old, &second_done)
                .unwrap_err()
                .contains("(a)")
        );
        let mut cleared = first_done.clone();
        set_pending(&mut cleared, &[]);
        assert!(pending(&cleared).is_empty() && cleared["metadata"].get("initializers").is_none());
    }

    #[tokio::test]
    async fn pods_get_the_default_service_account() {
        let res = trellis_api::registry::builtins()
            .into_iter()
            .find(|r| r.plural == "pods")
            .unwrap();
        let user = UserInfo::default();
        let attrs = Attributes {
            resource: &res,
            operation: "CREATE",
            namespace: Some("default"),
            name: "p",
            subresource: None,
            user: &user,
            dry_run: false,
        };
        let mut pod = obj(json!({"spec": {"containers": []}}));
        ServiceAccountDefault::default()
            .mutate(&attrs, &mut pod, None)
            .await
            .unwrap();
        assert_eq!(pod["spec"]["serviceAccountName"], "default");
        let mut named = obj(json!({"spec": {"serviceAccountName": "builder"}}));
        ServiceAccountDefault::default()
            .mutate(&attrs, &mut named, None)
            .await
            .unwrap();
        assert_eq!(named["spec"]["serviceAccountName"], "builder");
    }
}
