//! ResourceQuota: built-in admission that keeps a namespace within its quotas, and
//! the accounting that keeps each quota's `status.hard` and `status.used` current.
//!
//! What an object counts for and which objects a quota's scopes select are the rules
//! of `trellis-quota` (`host/quota`), which the ResourceQuota controller counts by
//! too: `pods` not `Succeeded` or `Failed`, `configmaps`, `secrets`, `services`,
//! `resourcequotas`, the pods' compute resources, `count/<resource>[.<group>]`, and
//! the scopes `Terminating`, `NotTerminating`, `BestEffort`, `NotBestEffort`,
//! `PriorityClass` and `CrossNamespacePodAffinity`. A scoped quota charges pods only.
//!
//! - A create is charged as Kubernetes charges it: under the namespace's lock, the
//!   new object's usage is added to each matching quota's `status.used` with a
//!   compare-and-swap write, and the create is refused with 403 (`exceeded quota: …`)
//!   when a hard limit would be passed. Creates in one namespace are serialized, so
//!   concurrent creates never pass a quota.
//! - After any other write to a counted resource (deletes, finalizers removed, pods
//!   finishing) and after writes of a quota, its usage is recounted from the store.
//!   The recount includes creates that were charged and not yet stored; their
//!   reservations end when the create succeeds, or after [`RESERVATION_TTL`] (a
//!   create that failed after it was charged).
//!
//! The lock is the server's own: API servers sharing a store each serialize their own
//! creates, and their compare-and-swap writes keep `status.used` consistent.
//!
//! Which quotas a namespace has is read through a [`Lister`] (the watch cache, or the
//! store while the cache has not yet seen a quota written through this server), so a
//! namespace without quotas costs no store read and no lock. Once there is one, the
//! charge reads the quotas and writes their usage on the store, as above.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Map, Value};
use tokio::time::Instant;
use trellis_api::ApiError;
use trellis_api::quantity::Quantity;
use trellis_api::registry::ResourceInfo;
use trellis_quota::{
    Usage, add, amounts, counted_resources, plural_and_group, selects, to_json, usage_of,
};
use trellis_store::{ListRequest, Revision, Store};

use crate::admission::chain::{Admission, Attributes};
use crate::admission::{Cluster, StatusTarget};
use crate::object::{Object, meta_str};
use crate::storage::lister::Lister;
use crate::storage::watch_cache::{WatchCache, decode_stored};

/// The field manager of the usage the server writes (Kubernetes' quota controller
/// writes as `kube-controller-manager`).
const MANAGER: &str = "resourcequota-controller";

/// How long a charged create may take to appear in the store before its charge is
/// dropped from recounts: longer than a create waits for its initializers.
pub const RESERVATION_TTL: Duration = Duration::from_secs(60);

/// A charged create not yet seen in the store.
#[derive(Debug)]
struct Reservation {
    key: String,
    usage: Usage,
    /// The quotas (by name) whose scopes selected the object.
    quotas: Vec<String>,
    expires: Instant,
}

/// The ResourceQuota admission step.
#[derive(Debug)]
pub struct ResourceQuota {
    store: OnceLock<Arc<dyn Store>>,
    /// Weak: the server's state holds the chain that holds this step.
    cluster: OnceLock<std::sync::Weak<dyn Cluster>>,
    /// Whether a namespace has quotas at all; the charge itself reads the store.
    quotas: Lister,
    /// Per namespace: the lock that serializes its charges and recounts, and the
    /// reservations it holds.
    namespaces: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Vec<Reservation>>>>>,
}

impl Default for ResourceQuota {
    fn default() -> Self {
        Self {
            store: OnceLock::new(),
            cluster: OnceLock::new(),
            quotas: Lister::new("", "resourcequotas"),
            namespaces: Mutex::default(),
        }
    }
}

fn quotas_prefix(namespace: &str) -> String {
    format!("/registry/core/resourcequotas/{namespace}/")
}

/// The store prefix of `resource` (`pods`, `deployments.apps`) in `namespace`.
fn objects_prefix(resource: &str, namespace: &str) -> String {
    let (plural, group) = resource.split_once('.').unwrap_or((resource, "core"));
    format!("/registry/{group}/{plural}/{namespace}/")
}

/// `a=1,b=2`, sorted, as Kubernetes prints resource lists in quota messages.
fn pretty(list: &Usage) -> String {
    list.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn store_failed(e: trellis_store::Error) -> ApiError {
    ApiError::internal(format!("reading or writing resource quotas: {e}"))
}

impl ResourceQuota {
    fn store(&self) -> Option<&Arc<dyn Store>> {
        self.store.get()
    }

    fn namespace_lock(&self, namespace: &str) -> Arc<tokio::sync::Mutex<Vec<Reservation>>> {
        self.namespaces
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(namespace.to_owned())
            .or_default()
            .clone()
    }

    async fn quotas(
        store: &dyn Store,
        namespace: &str,
    ) -> Result<Vec<(Object, Revision)>, ApiError> {
        let page = store
            .list(ListRequest::prefix(quotas_prefix(namespace)))
            .await
            .map_err(store_failed)?;
        Ok(page
            .kvs
            .iter()
            .filter_map(|kv| Some((decode_stored(&kv.value, kv.mod_revision)?, kv.mod_revision)))
            .collect())
    }

    /// The usage of `quota`'s resources in `namespace`, counted from the store (the
    /// objects its scopes select), plus the reservations of creates not yet stored
    /// (expired ones are dropped).
    async fn count(
        store: &dyn Store,
        namespace: &str,
        quota: &Object,
        reservations: &mut Vec<Reservation>,
    ) -> Result<Usage, ApiError> {
        let names: Vec<String> = amounts(quota, "spec", "hard").into_keys().collect();
        let quota_name = meta_str(quota, "name").unwrap_or_default();
        let mut used: Usage = names.iter().map(|n| (n.clone(), Quantity::ZERO)).collect();
        let mut stored_keys = std::collections::HashSet::new();
        for resource in counted_resources(&names) {
            let prefix = objects_prefix(resource, namespace);
            let page = store
                .list(ListRequest::prefix(&prefix))
                .await
                .map_err(store_failed)?;
            let (plural, group) = plural_and_group(resource);
            for kv in &page.kvs {
                stored_keys.insert(kv.key.clone());
                let Some(obj) = decode_stored(&kv.value, kv.mod_revision) else {
                    continue;
                };
                if !selects(quota, group, plural, &obj) {
                    continue;
                }
                add(&mut used, &usage_of(group, plural, &obj));
            }
        }
        let now = Instant::now();
        reservations.retain(|r| r.expires > now && !stored_keys.contains(&r.key));
        for r in reservations
            .iter()
            .filter(|r| r.quotas.iter().any(|q| q == quota_name))
        {
            add(&mut used, &r.usage);
        }
        Ok(used)
    }

    /// Writes `status` of a quota when it differs, through the registry's status path
    /// (validation, managedFields), and only over the version `rev` that was counted:
    /// `false` when another writer came first (the caller counts again).
    async fn write_status(
        &self,
        quota: Object,
        rev: Revision,
        hard: &Usage,
        used: &Usage,
    ) -> Result<bool, ApiError> {
        let status = Map::from_iter([
            ("hard".to_owned(), to_json(hard)),
            ("used".to_owned(), to_json(used)),
        ]);
        if quota.get("status").and_then(Value::as_object) == Some(&status) {
            return Ok(true);
        }
        let Some(cluster) = self.cluster.get().and_then(std::sync::Weak::upgrade) else {
            return Err(ApiError::internal(
                "the quota step is not attached to the server",
            ));
        };
        let target = StatusTarget {
            group: String::new(),
            version: "v1".into(),
            plural: "resourcequotas".into(),
            namespace: meta_str(&quota, "namespace").map(str::to_owned),
            name: meta_str(&quota, "name").unwrap_or_default().to_owned(),
            uid: meta_str(&quota, "uid").map(str::to_owned),
            manager: MANAGER,
        };
        let counted = rev.to_string();
        let mut change = |stored: &Object, out: &mut Map<String, Value>| {
            if meta_str(stored, "resourceVersion") != Some(counted.as_str()) {
                return Err(ApiError::conflict(
                    "",
                    "resourcequotas",
                    &target.name,
                    ApiError::MODIFIED,
                ));
            }
            out.clone_from(&status);
            Ok(())
        };
        match cluster.write_status(&target, &mut change).await {
            Ok(written) => Ok(written.is_some()),
            Err(e) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Whether `namespace` has no quota.
    async fn unlimited(&self, namespace: &str) -> Result<bool, ApiError> {
        self.quotas.is_empty(namespace).await.map_err(store_failed)
    }

    /// Recounts every quota of `namespace` from the store and writes their status.
    pub async fn recount(&self, namespace: &str) -> Result<(), ApiError> {
        let Some(store) = self.store() else {
            return Ok(());
        };
        if self.unlimited(namespace).await? {
            return Ok(());
        }
        let lock = self.namespace_lock(namespace);
        let mut reservations = lock.lock().await;
        for _ in 0..4 {
            let quotas = Self::quotas(store.as_ref(), namespace).await?;
            let mut all_written = true;
            for (quota, rev) in quotas {
                let hard = amounts(&quota, "spec", "hard");
                let used =
                    Self::count(store.as_ref(), namespace, &quota, &mut reservations).await?;
                all_written &= self.write_status(quota, rev, &hard, &used).await?;
            }
            if all_written {
                break;
            }
        }
        Ok(())
    }

    /// A create charged to `namespace` failed after its charge: its reservation ends and
    /// the quotas are recounted, so that their usage converges at once rather than when
    /// the reservation expires.
    async fn abandon(&self, namespace: &str, key: &str) -> Result<(), ApiError> {
        let lock = self
            .namespaces
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(namespace)
            .cloned();
        if let Some(lock) = lock {
            lock.lock().await.retain(|r| r.key != key);
        }
        self.recount(namespace).await
    }

    /// Ends the reservations of `namespace` whose objects are now stored.
    async fn settle(&self, namespace: &str) -> Result<(), ApiError> {
        let Some(store) = self.store() else {
            return Ok(());
        };
        // Only namespaces that were charged hold reservations.
        let Some(lock) = self
            .namespaces
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(namespace)
            .cloned()
        else {
            return Ok(());
        };
        let mut reservations = lock.lock().await;
        let mut kept = Vec::with_capacity(reservations.len());
        for r in reservations.drain(..) {
            if r.expires > Instant::now()
                && store.get(&r.key).await.map_err(store_failed)?.is_none()
            {
                kept.push(r);
            }
        }
        *reservations = kept;
        Ok(())
    }

    /// Charges a create of `obj` to the quotas of `namespace`, or refuses it.
    async fn charge(
        &self,
        attrs: &Attributes<'_>,
        namespace: &str,
        obj: &Object,
    ) -> Result<(), ApiError> {
        let Some(store) = self.store() else {
            return Ok(());
        };
        // Most namespaces have no quota: they cost a read of the cache and no lock.
        if self.unlimited(namespace).await? {
            return Ok(());
        }
        let usage = usage_of(&attrs.resource.group, &attrs.resource.plural, obj);
        let refuse = |reason: String| {
            ApiError::admission_forbidden(
                &attrs.resource.group,
                &attrs.resource.plural,
                attrs.name,
                &reason,
            )
        };
        let lock = self.namespace_lock(namespace);
        let mut reservations = lock.lock().await;
        // A create that will fail as AlreadyExists is not charged.
        let key = attrs.resource.key(Some(namespace), attrs.name);
        if store.get(&key).await.map_err(store_failed)?.is_some() {
            return Ok(());
        }
        for _ in 0..8 {
            let quotas = Self::quotas(store.as_ref(), namespace).await?;
            if quotas.is_empty() {
                return Ok(());
            }
            let mut charged = Vec::new();
            let mut selected = Vec::new();
            for (quota, rev) in &quotas {
                if !selects(quota, &attrs.resource.group, &attrs.resource.plural, obj) {
                    continue;
                }
                let quota_name = meta_str(quota, "name").unwrap_or_default().to_owned();
                selected.push(quota_name.clone());
                let hard = amounts(quota, "spec", "hard");
                let status_current = amounts(quota, "status", "hard") == hard
                    && quota.get("status").and_then(|s| s.get("used")).is_some();
                let mut used = if status_current {
                    amounts(quota, "status", "used")
                } else {
                    Self::count(store.as_ref(), namespace, quota, &mut reservations).await?
                };
                // Compute quotas need pods to say what they use.
                if attrs.resource.group.is_empty() && attrs.resource.plural == "pods" {
                    let compute = |k: &str| {
                        matches!(k, "cpu" | "memory")
                            || k.strip_prefix("requests.")
                                .or_else(|| k.strip_prefix("limits."))
                                .is_some_and(|r| matches!(r, "cpu" | "memory"))
                    };
                    let missing: Vec<&str> = hard
                        .keys()
                        .filter(|k| compute(k) && !usage.contains_key(*k))
                        .map(String::as_str)
                        .collect();
                    if !missing.is_empty() && usage.contains_key("pods") {
                        return Err(refuse(format!(
                            "failed quota: {quota_name}: must specify {}",
                            missing.join(",")
                        )));
                    }
                }
                let mut exceeded = Vec::new();
                for (name, limit) in &hard {
                    let Some(delta) = usage.get(name) else {
                        continue;
                    };
                    let current = used.get(name).copied().unwrap_or_default();
                    if current.saturating_add(*delta) > *limit {
                        exceeded.push(name.clone());
                    }
                    used.insert(name.clone(), current.saturating_add(*delta));
                }
                if !exceeded.is_empty() {
                    let mask = |list: &Usage| -> Usage {
                        exceeded
                            .iter()
                            .map(|k| (k.clone(), list.get(k).copied().unwrap_or_default()))
                            .collect()
                    };
                    let before: Usage = exceeded
                        .iter()
                        .map(|k| {
                            let after = used.get(k).copied().unwrap_or_default();
                            let delta = usage.get(k).copied().unwrap_or_default();
                            (k.clone(), after.saturating_sub(delta))
                        })
                        .collect();
                    return Err(refuse(format!(
                        "exceeded quota: {quota_name}, requested: {}, used: {}, limited: {}",
                        pretty(&mask(&usage)),
                        pretty(&before),
                        pretty(&mask(&hard)),
                    )));
                }
                if hard.keys().any(|k| usage.contains_key(k)) || !status_current {
                    charged.push((quota.clone(), *rev, hard, used));
                }
            }
            if attrs.dry_run {
                return Ok(());
            }
            let mut all_written = true;
            for (quota, rev, hard, used) in charged {
                if !self.write_status(quota, rev, &hard, &used).await? {
                    all_written = false;
                    break;
                }
            }
            if all_written {
                reservations.push(Reservation {
                    key,
                    usage,
                    quotas: selected,
                    expires: Instant::now() + RESERVATION_TTL,
                });
                return Ok(());
            }
            // Another server (or a status write) changed a quota: charge again.
        }
        Err(ApiError::conflict(
            "",
            "resourcequotas",
            namespace,
            "too many concurrent changes to the namespace's quotas; try again",
        ))
    }
}

#[async_trait]
impl Admission for ResourceQuota {
    fn name(&self) -> &str {
        crate::admission::chain::RESOURCE_QUOTA
    }

    fn init(&self, store: &Arc<dyn Store>, cache: &Arc<WatchCache>) {
        let _ = self.store.set(store.clone());
        self.quotas.init(store, cache);
    }

    fn attach(&self, cluster: &Arc<dyn Cluster>) {
        let _ = self.cluster.set(Arc::downgrade(cluster));
    }

    async fn validate(
        &self,
        attrs: &Attributes<'_>,
        obj: &Object,
        _old: Option<&Object>,
    ) -> Result<(), ApiError> {
        match (attrs.operation, attrs.namespace, attrs.subresource) {
            ("CREATE", Some(namespace), None) => self.charge(attrs, namespace, obj).await,
            _ => Ok(()),
        }
    }

    async fn aborted(&self, _resource: &ResourceInfo, key: &str, namespace: Option<&str>) {
        let Some(namespace) = namespace else {
            return;
        };
        if let Err(e) = self.abandon(namespace, key).await {
            tracing::warn!(namespace, error = %e.message, "recounting resource quotas failed");
        }
    }

    async fn written(&self, resource: &ResourceInfo, verb: &str, namespace: Option<&str>) {
        let Some(namespace) = namespace else {
            return;
        };
        let is_quota = self.quotas.lists(resource);
        if is_quota {
            // Before the recount below, which must find a quota just created.
            self.quotas.written().await;
        }
        // Creates were charged already: their reservations end now that they are
        // stored. Everything else may change what is used.
        let done = if verb == "create" && !is_quota {
            self.settle(namespace).await
        } else {
            self.recount(namespace).await
        };
        if let Err(e) = done {
            tracing::warn!(namespace, error = %e.message, "recounting resource quotas failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resources_map_to_store_prefixes_and_usage_prints_sorted() {
        assert_eq!(
            objects_prefix("deployments.apps", "ns"),
            "/registry/apps/deployments/ns/"
        );
        assert_eq!(objects_prefix("pods", "ns"), "/registry/core/pods/ns/");
        let q = |s: &str| Quantity::parse(s).unwrap();
        let usage = Usage::from([("requests.cpu".into(), q("500m")), ("pods".into(), q("1"))]);
        assert_eq!(pretty(&usage), "pods=1,requests.cpu=500m");
    }
}
