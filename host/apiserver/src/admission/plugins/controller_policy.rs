//! The RBAC rules a controller Plugin is granted (as Kubernetes' bootstrap policy
//! grants each built-in controller its own role): a ClusterRole and its binding to the
//! controller's ServiceAccount, owned by the Plugin.

use serde_json::{Value, json};
use tracing::{info, warn};
use trellis_plugins::spec;

use super::PluginManager;
use crate::object::now_timestamp;

impl PluginManager {
    /// Grants a controller plugin the RBAC rules its spec declares: a ClusterRole
    /// `trellis:controller:NAME` bound to its ServiceAccount `kube-system/NAME`, both
    /// owned by the Plugin (the garbage collector removes them with it). Written by
    /// the server itself: whoever may create Plugin objects may grant this much.
    pub(super) async fn grant_controller(&self, name: &str, meta: &Value, spec: &Value) {
        let parsed = match spec::parse(name, spec) {
            Ok(parsed) => parsed,
            Err(e) => {
                warn!(plugin = %name, "controller plugin not granted its rules: {e}");
                return;
            }
        };
        let Some(controller) = parsed.controller else {
            return;
        };
        // A bundled controller's entry: its bootstrap role grants what it needs.
        if spec::is_builtin_entry(meta, spec) {
            return;
        }
        let role = format!("trellis:controller:{name}");
        let owner = json!([{
            "apiVersion": format!("{}/{}", spec::GROUP, spec::VERSION),
            "kind": "Plugin",
            "name": name,
            "uid": meta["uid"],
        }]);
        // It records events, as every controller does.
        let mut rules = controller.rules.clone();
        rules.push(json!({"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch", "update"]}));
        let objects = [
            (
                format!("{}clusterroles/{role}", crate::authorization::rbac::RBAC),
                json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                       "metadata": {"name": role, "labels": {"trellis.dev/plugin": name}, "ownerReferences": owner},
                       "rules": rules}),
            ),
            (
                format!(
                    "{}clusterrolebindings/{role}",
                    crate::authorization::rbac::RBAC
                ),
                json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                       "metadata": {"name": role, "labels": {"trellis.dev/plugin": name}, "ownerReferences": owner},
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                       "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": "kube-system"}]}),
            ),
        ];
        for (key, mut obj) in objects {
            let result = match self.store.get(&key).await {
                Ok(Some(kv)) => {
                    let mut stored: Value = serde_json::from_slice(&kv.value).unwrap_or_default();
                    let same = ["rules", "roleRef", "subjects"]
                        .iter()
                        .all(|f| stored.get(*f) == obj.get(*f))
                        && stored["metadata"]["ownerReferences"]
                            == obj["metadata"]["ownerReferences"];
                    if same {
                        continue;
                    }
                    for field in ["rules", "roleRef", "subjects"] {
                        if let Some(v) = obj.get(field) {
                            stored[field] = v.clone();
                        }
                    }
                    stored["metadata"]["ownerReferences"] =
                        obj["metadata"]["ownerReferences"].take();
                    self.store
                        .update(
                            &key,
                            bytes::Bytes::from(stored.to_string()),
                            Some(kv.mod_revision),
                        )
                        .await
                        .map(|_| ())
                }
                Ok(None) => {
                    obj["metadata"]["uid"] = uuid::Uuid::new_v4().to_string().into();
                    obj["metadata"]["creationTimestamp"] = now_timestamp().into();
                    self.store
                        .create(&key, bytes::Bytes::from(obj.to_string()))
                        .await
                        .map(|_| ())
                }
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                warn!(plugin = %name, key, error = %e, "granting a controller plugin its rules failed");
            }
        }
        info!(plugin = %name, role, "controller plugin granted its rules");
    }
}
