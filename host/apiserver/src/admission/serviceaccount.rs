//! `ServiceAccount`: pods without a service account get the namespace's `default` one,
//! and, as Kubernetes' admission plugin mounts it, a projected volume
//! `kube-api-access-<random>` at `/var/run/secrets/kubernetes.io/serviceaccount` holding
//! a token of the account (`token`), the cluster CA (`ca.crt`, from the namespace's
//! `kube-root-ca.crt` ConfigMap) and the namespace (`namespace`): what in-cluster
//! clients read.
//!
//! Kubernetes refuses a pod whose account does not exist, and its kubelet holds a pod
//! until the namespace's `kube-root-ca.crt` exists. Here a pod is admitted without the
//! volume while either is missing: a cluster without the ServiceAccount controller or
//! the root CA publisher has neither, and its pods would otherwise wait for ever.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::{Value, json};
use trellis_api::ApiError;
use trellis_api::registry::ResourceInfo;
use trellis_store::Store;

use super::chain::{Admission, Attributes};
use crate::object::Object;
use crate::storage::lister::Lister;
use crate::storage::watch_cache::WatchCache;

/// Where containers find the account's credentials.
pub const TOKEN_MOUNT_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The ConfigMap of every namespace that holds the cluster CA.
const ROOT_CA_CONFIG_MAP: &str = "kube-root-ca.crt";

/// The prefix of the volume's name (Kubernetes' `ServiceAccountVolumeName`).
const VOLUME_PREFIX: &str = "kube-api-access-";

/// The token's lifetime Kubernetes asks for this volume (an hour and seven seconds,
/// which tells its token apart from others).
const TOKEN_EXPIRATION_SECONDS: i64 = 3607;

/// Pods without a service account get the namespace's `default` one, and the
/// account's token mounted in every container.
#[derive(Debug)]
pub struct ServiceAccountDefault {
    accounts: Lister,
    /// For the namespaces' `kube-root-ca.crt`.
    config_maps: Lister,
}

impl Default for ServiceAccountDefault {
    fn default() -> Self {
        Self {
            accounts: Lister::new("", "serviceaccounts"),
            config_maps: Lister::new("", "configmaps"),
        }
    }
}

#[async_trait]
impl Admission for ServiceAccountDefault {
    fn name(&self) -> &str {
        "ServiceAccount"
    }

    fn init(&self, store: &Arc<dyn Store>, cache: &Arc<WatchCache>) {
        self.accounts.init(store, cache);
        self.config_maps.init(store, cache);
    }

    async fn written(&self, resource: &ResourceInfo, _verb: &str, _namespace: Option<&str>) {
        for lister in [&self.accounts, &self.config_maps] {
            if lister.lists(resource) {
                lister.written().await;
            }
        }
    }

    async fn mutate(
        &self,
        attrs: &Attributes<'_>,
        obj: &mut Object,
        _old: Option<&Object>,
    ) -> Result<(), ApiError> {
        if !attrs.creates_core("pods") {
            return Ok(());
        }
        let mirror = obj
            .get("metadata")
            .and_then(|m| m.get("annotations"))
            .and_then(|a| a.get("kubernetes.io/config.mirror"))
            .is_some();
        let Some(Value::Object(spec)) = obj.get_mut("spec") else {
            return Ok(());
        };
        let empty = spec
            .get("serviceAccountName")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty);
        if empty {
            spec.insert("serviceAccountName".into(), "default".into());
            spec.insert("serviceAccount".into(), "default".into());
        }
        if mirror || spec.get("automountServiceAccountToken") == Some(&Value::Bool(false)) {
            return Ok(());
        }
        let account = spec
            .get("serviceAccountName")
            .and_then(Value::as_str)
            .unwrap_or("default");
        let namespace = attrs.namespace.unwrap_or("default");
        let key = format!("/registry/core/serviceaccounts/{namespace}/{account}");
        let Some(found) = self.accounts.get(&key).await.map_err(|e| {
            ApiError::internal(format!(
                "error looking up service account {namespace}/{account}: {e}"
            ))
        })?
        else {
            return Ok(());
        };
        // The pod's own word wins over the account's.
        if spec.get("automountServiceAccountToken") != Some(&Value::Bool(true))
            && found.get("automountServiceAccountToken") == Some(&Value::Bool(false))
        {
            return Ok(());
        }
        let ca = format!("/registry/core/configmaps/{namespace}/{ROOT_CA_CONFIG_MAP}");
        if self
            .config_maps
            .get(&ca)
            .await
            .map_err(|e| ApiError::internal(format!("error looking up {ca}: {e}")))?
            .is_none()
        {
            return Ok(());
        }
        mount_token(spec);
        Ok(())
    }
}

/// Kubernetes' `mountServiceAccountToken`: every container and init container without
/// a mount at [`TOKEN_MOUNT_PATH`] mounts the token volume, which is added if one did.
fn mount_token(spec: &mut serde_json::Map<String, Value>) {
    let existing = spec
        .get("volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|v| v.get("name").and_then(Value::as_str))
        .find(|name| name.starts_with(VOLUME_PREFIX))
        .map(str::to_owned);
    let name = existing
        .clone()
        .unwrap_or_else(|| format!("{VOLUME_PREFIX}{}", crate::object::name_suffix()));
    let mount = json!({"name": name, "readOnly": true, "mountPath": TOKEN_MOUNT_PATH});
    let mut needed = false;
    for field in ["initContainers", "containers"] {
        let Some(Value::Array(containers)) = spec.get_mut(field) else {
            continue;
        };
        for container in containers {
            let Some(container) = container.as_object_mut() else {
                continue;
            };
            let mounts = container
                .entry("volumeMounts")
                .or_insert_with(|| Value::Array(Vec::new()));
            let Some(mounts) = mounts.as_array_mut() else {
                continue;
            };
            if mounts
                .iter()
                .any(|m| m.get("mountPath").and_then(Value::as_str) == Some(TOKEN_MOUNT_PATH))
            {
                continue;
            }
            mounts.push(mount.clone());
            needed = true;
        }
    }
    if existing.is_none() && needed {
        let volume = json!({
            "name": name,
            "projected": {
                "defaultMode": 420,
                "sources": [
                    {"serviceAccountToken": {"expirationSeconds": TOKEN_EXPIRATION_SECONDS,
                                             "path": "token"}},
                    {"configMap": {"name": ROOT_CA_CONFIG_MAP,
                                   "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                    {"downwardAPI": {"items": [{"path": "namespace",
                        "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
                ],
            },
        });
        match spec.get_mut("volumes") {
            Some(Value::Array(volumes)) => volumes.push(volume),
            _ => {
                spec.insert("volumes".into(), Value::Array(vec![volume]));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_container_mounts_the_token_volume_once() {
        let mut spec = json!({
            "initContainers": [{"name": "init"}],
            "containers": [
                {"name": "a"},
                {"name": "own", "volumeMounts": [{"name": "mine", "mountPath": TOKEN_MOUNT_PATH}]},
            ],
        })
        .as_object()
        .cloned()
        .unwrap();
        mount_token(&mut spec);
        let volumes = spec["volumes"].as_array().unwrap();
        assert_eq!(volumes.len(), 1);
        let name = volumes[0]["name"].as_str().unwrap();
        assert!(
            name.starts_with("kube-api-access-") && name.len() == 21,
            "{name}"
        );
        let sources = &volumes[0]["projected"]["sources"];
        assert_eq!(sources[0]["serviceAccountToken"]["expirationSeconds"], 3607);
        assert_eq!(sources[1]["configMap"]["name"], "kube-root-ca.crt");
        assert_eq!(sources[2]["downwardAPI"]["items"][0]["path"], "namespace");
        for container in [&spec["initContainers"][0], &spec["containers"][0]] {
            assert_eq!(
                container["volumeMounts"],
                json!([{"name": name, "readOnly": true, "mountPath": TOKEN_MOUNT_PATH}])
            );
        }
        assert_eq!(
            spec["containers"][1]["volumeMounts"]
                .as_array()
                .unwrap()
                .len(),
            1
        );
        // Admitted again (an update does not pass here, a re-create may): no second volume.
        mount_token(&mut spec);
        assert_eq!(spec["volumes"].as_array().unwrap().len(), 1);
    }
}
