//! The objects every cluster starts with, created on each start when missing and
//! brought up to date when an older version wrote them (kube-apiserver's post-start
//! hooks): the bootstrap RBAC roles, the system PriorityClasses, the RuntimeClasses of
//! Trellis' handlers, the default StorageClass (`local-path`) and the scheduler's
//! rights to volumes, the initial namespaces, and the CRD and built-in objects of
//! `plugins.trellis.dev`.

use bytes::Bytes;
use serde_json::{Value, json};

use crate::registry::crd;
use crate::state::AppState;

/// The namespaces every cluster starts with.
pub const INITIAL_NAMESPACES: &[&str] =
    &["default", "kube-system", "kube-public", "kube-node-lease"];

impl AppState {
    /// Creates the initial namespaces and the bootstrap RBAC roles if missing.
    pub async fn bootstrap(&self) -> anyhow::Result<()> {
        for (key, mut obj) in crate::authorization::rbac::bootstrap_objects() {
            obj["metadata"]["uid"] = uuid::Uuid::new_v4().to_string().into();
            obj["metadata"]["creationTimestamp"] = crate::object::now_timestamp().into();
            match self.store.create(&key, Bytes::from(obj.to_string())).await {
                Ok(_) => {}
                Err(trellis_store::Error::AlreadyExists { .. }) => {
                    self.reconcile_bootstrap_role(&key, &obj).await?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        // Kubernetes' two system classes, which system components' pods name.
        let classes = self.resource("scheduling.k8s.io", "v1", "priorityclasses")?;
        for (name, value, description) in [
            (
                "system-node-critical",
                2_000_001_000,
                "Used for system critical pods that must not be moved from their current node.",
            ),
            (
                "system-cluster-critical",
                2_000_000_000,
                "Used for system critical pods that must run in the cluster, but can be moved to another node if necessary.",
            ),
        ] {
            let obj = json!({
                "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": name, "uid": uuid::Uuid::new_v4().to_string(),
                             "creationTimestamp": crate::object::now_timestamp()},
                "value": value,
                "description": description,
                "preemptionPolicy": "PreemptLowerPriority",
            });
            match self
                .store
                .create(&classes.key(None, name), Bytes::from(obj.to_string()))
                .await
            {
                Ok(_) | Err(trellis_store::Error::AlreadyExists { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        // The handlers every Trellis node has: pods name them as RuntimeClasses.
        let runtime_classes = self.resource("node.k8s.io", "v1", "runtimeclasses")?;
        for name in ["wasmtime", "process"] {
            let obj = json!({
                "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                "metadata": {"name": name, "uid": uuid::Uuid::new_v4().to_string(),
                             "creationTimestamp": crate::object::now_timestamp()},
                "handler": name,
                // Only nodes whose agent reports the handler (it labels its Node so).
                "scheduling": {"nodeSelector": {format!("handler.trellis.dev/{name}"): "true"}},
            });
            match self
                .store
                .create(
                    &runtime_classes.key(None, name),
                    Bytes::from(obj.to_string()),
                )
                .await
            {
                Ok(_) | Err(trellis_store::Error::AlreadyExists { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        // The default StorageClass, as k3s ships its local-path one: claims that name
        // no class get node-local directories from the bundled provisioner.
        if let Ok(storage_classes) = self.resource("storage.k8s.io", "v1", "storageclasses") {
            let obj = json!({
                "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
                "metadata": {"name": "local-path", "uid": uuid::Uuid::new_v4().to_string(),
                             "creationTimestamp": crate::object::now_timestamp(),
                             "annotations": {
                                 crate::admission::default_storage_class::IS_DEFAULT_CLASS: "true"
                             }},
                "provisioner": "trellis.dev/local-path",
                "reclaimPolicy": "Delete",
                "volumeBindingMode": "WaitForFirstConsumer",
            });
            match self
                .store
                .create(
                    &storage_classes.key(None, "local-path"),
                    Bytes::from(obj.to_string()),
                )
                .await
            {
                Ok(_) | Err(trellis_store::Error::AlreadyExists { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        // Kubernetes' system:volume-scheduler role, bound to the scheduler: its
        // VolumeBinding reads claims, volumes and classes, and selects a claim's node.
        let rbac = crate::authorization::rbac::RBAC;
        let labels = json!({"kubernetes.io/bootstrapping": "rbac-defaults"});
        for (key, obj) in [
            (
                format!("{rbac}clusterroles/system:volume-scheduler"),
                json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": "system:volume-scheduler", "labels": labels},
                "rules": [
                    {"apiGroups": [""], "resources": ["persistentvolumes", "persistentvolumeclaims"],
                     "verbs": ["get", "list", "patch", "update", "watch"]},
                    {"apiGroups": ["storage.k8s.io"], "resources": ["storageclasses"],
                     "verbs": ["get", "list", "watch"]},
                ]}),
            ),
            (
                format!("{rbac}clusterrolebindings/system:volume-scheduler"),
                json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                       "metadata": {"name": "system:volume-scheduler", "labels": labels},
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                   "name": "system:volume-scheduler"},
                       "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                     "name": "system:kube-scheduler"}]}),
            ),
        ] {
            let mut obj = obj;
            obj["metadata"]["uid"] = uuid::Uuid::new_v4().to_string().into();
            obj["metadata"]["creationTimestamp"] = crate::object::now_timestamp().into();
            match self.store.create(&key, Bytes::from(obj.to_string())).await {
                Ok(_) => {}
                Err(trellis_store::Error::AlreadyExists { .. }) => {
                    self.reconcile_bootstrap_role(&key, &obj).await?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let namespaces = self.resource("", "v1", "namespaces")?;
        for ns in INITIAL_NAMESPACES {
            let obj = json!({
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": ns, "uid": uuid::Uuid::new_v4().to_string(),
                             "creationTimestamp": crate::object::now_timestamp(),
                             "labels": {"kubernetes.io/metadata.name": ns}},
                "spec": {"finalizers": ["kubernetes"]},
                "status": {"phase": "Active"},
            });
            match self
                .store
                .create(&namespaces.key(None, ns), Bytes::from(obj.to_string()))
                .await
            {
                Ok(_) | Err(trellis_store::Error::AlreadyExists { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Brings a bootstrap role or binding of an older version up to this one's, as
    /// kube-apiserver reconciles its defaults at start: rules, role and subjects are
    /// replaced, unless the object no longer carries the bootstrapping label (an
    /// administrator took it over).
    async fn reconcile_bootstrap_role(&self, key: &str, wanted: &Value) -> anyhow::Result<()> {
        let Some(kv) = self.store.get(key).await? else {
            return Ok(());
        };
        let mut stored: Value = serde_json::from_slice(&kv.value)?;
        if stored["metadata"]["labels"]["kubernetes.io/bootstrapping"] != "rbac-defaults" {
            return Ok(());
        }
        let fields = ["rules", "roleRef", "subjects"];
        if fields.iter().all(|f| stored.get(*f) == wanted.get(*f)) {
            return Ok(());
        }
        for field in fields {
            if let Some(v) = wanted.get(field) {
                stored[field] = v.clone();
            }
        }
        match self
            .store
            .update(key, Bytes::from(stored.to_string()), Some(kv.mod_revision))
            .await
        {
            // Another server of the same version did it first.
            Ok(_) | Err(trellis_store::Error::Conflict { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Creates the Plugin objects of the built-in controllers, and brings those still
    /// marked built-in up to date; one an administrator took over (its label or
    /// module changed) is left alone, as bootstrap roles are.
    pub async fn publish_builtin_plugins(&self, plugins: &[Value]) -> anyhow::Result<()> {
        use trellis_plugins::spec;
        let resource = self.resource(spec::GROUP, spec::VERSION, spec::PLURAL)?;
        for wanted in plugins {
            let name = wanted["metadata"]["name"].as_str().unwrap_or_default();
            let key = resource.key(None, name);
            match self.store.get(&key).await? {
                Some(kv) => {
                    let mut stored: Value = serde_json::from_slice(&kv.value)?;
                    let still_builtin = stored["metadata"]["labels"][spec::BUILTIN_LABEL] == "true"
                        && stored["spec"]["module"] == wanted["spec"]["module"];
                    if !still_builtin || stored["spec"] == wanted["spec"] {
                        continue;
                    }
                    stored["spec"] = wanted["spec"].clone();
                    let generation = stored["metadata"]["generation"].as_i64().unwrap_or(1);
                    stored["metadata"]["generation"] = (generation + 1).into();
                    match self
                        .store
                        .update(&key, Bytes::from(stored.to_string()), Some(kv.mod_revision))
                        .await
                    {
                        Ok(_) | Err(trellis_store::Error::Conflict { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                None => {
                    let mut obj = wanted.clone();
                    obj["metadata"]["uid"] = uuid::Uuid::new_v4().to_string().into();
                    obj["metadata"]["creationTimestamp"] = crate::object::now_timestamp().into();
                    obj["metadata"]["generation"] = 1.into();
                    match self.store.create(&key, Bytes::from(obj.to_string())).await {
                        Ok(_) | Err(trellis_store::Error::AlreadyExists { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
        Ok(())
    }

    /// Creates (or brings up to date) the CRD serving `plugins.trellis.dev`.
    pub async fn install_plugin_crd(&self) -> anyhow::Result<()> {
        let mut crd = trellis_plugins::spec::crd();
        let name = crd["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let crds = self.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")?;
        let key = crds.key(None, &name);
        let existing = self.store.get(&key).await?;
        match existing {
            Some(kv) => {
                let mut stored: serde_json::Value = serde_json::from_slice(&kv.value)?;
                if stored["spec"] != crd["spec"] {
                    stored["spec"] = crd["spec"].take();
                    let generation = stored["metadata"]["generation"].as_i64().unwrap_or(1);
                    stored["metadata"]["generation"] = (generation + 1).into();
                    if let Some(obj) = stored.as_object() {
                        stored["status"] = crd::established_status(obj);
                    }
                    self.store
                        .update(&key, Bytes::from(stored.to_string()), Some(kv.mod_revision))
                        .await?;
                }
            }
            None => {
                crd["metadata"]["uid"] = uuid::Uuid::new_v4().to_string().into();
                crd["metadata"]["creationTimestamp"] = crate::object::now_timestamp().into();
                crd["metadata"]["generation"] = 1.into();
                if let Some(obj) = crd.as_object() {
                    crd["status"] = crd::established_status(obj);
                }
                match self.store.create(&key, Bytes::from(crd.to_string())).await {
                    Ok(_) | Err(trellis_store::Error::AlreadyExists { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        self.refresh_custom_resources().await
    }
}
