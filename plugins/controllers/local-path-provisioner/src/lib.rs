//! The local-path provisioner: a claim of a class whose provisioner is
//! [`PROVISIONER`] gets a directory on the node its first pod was scheduled to, as
//! k3s' local-path provisioner does.
//!
//! Once the scheduler has chosen a node for the claim's pod (the
//! `volume.kubernetes.io/selected-node` annotation, written at its PreBind), the
//! claim gets a PersistentVolume `pvc-<claim uid>`: a `hostPath` directory
//! `<root>/pvc-<claim uid>` that the node's agent creates when a pod mounts it, a
//! required node affinity on that node, the class' reclaim policy, and a `claimRef`
//! naming the claim so that the binder binds the two. `<root>` is the node's
//! [`ROOT_ANNOTATION`] (its agent's data directory), else the configuration's
//! `path`. Removing the volume is the binder's part (reclaim policy Delete) and the
//! node's (its directory).
//!
//! Left out: k3s' ConfigMap of paths per node, helper pods, `Immediate` classes
//! (there is no node to choose before a pod: the claim stays Pending with an event,
//! as k3s' does).

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{Action, EventType, ObjectKey, Reconcile, cache, client, events};

/// The provisioner's name, as StorageClasses name it.
pub const PROVISIONER: &str = "trellis.dev/local-path";
/// The Node annotation where the node's agent keeps its local-path volumes.
pub const ROOT_ANNOTATION: &str = "trellis.dev/local-path-root";
const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";

fn default_path() -> String {
    "/var/lib/trellis/storage".into()
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LocalPathProvisioner {
    /// Where volumes live on nodes that do not say (k3s: `--default-local-storage-path`).
    #[serde(default = "default_path")]
    path: String,
}

fn gvr(group: &str, resource: &str) -> GroupVersionResource {
    GroupVersionResource {
        group: group.into(),
        version: "v1".into(),
        resource: resource.into(),
    }
}

fn str_of<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

/// The volume `claim` gets on `node`.
pub fn volume_for(claim: &Value, class: &Value, node: &Value, default_root: &str) -> Value {
    let name = format!("pvc-{}", str_of(claim, "/metadata/uid"));
    let node_name = str_of(node, "/metadata/name");
    let root = node["metadata"]["annotations"][ROOT_ANNOTATION]
        .as_str()
        .unwrap_or(default_root)
        .trim_end_matches('/');
    // The node's hostname label, as k3s' provisioner pins its volumes; its name for a
    // node without one.
    let hostname = node["metadata"]["labels"]["kubernetes.io/hostname"]
        .as_str()
        .unwrap_or(node_name);
    let access_modes = match &claim["spec"]["accessModes"] {
        Value::Array(modes) if !modes.is_empty() => Value::Array(modes.clone()),
        _ => json!(["ReadWriteOnce"]),
    };
    let mut volume = json!({
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": name,
            "annotations": {PROVISIONED_BY: PROVISIONER},
        },
        "spec": {
            "capacity": {"storage": claim["spec"]["resources"]["requests"]["storage"]},
            "accessModes": access_modes,
            "persistentVolumeReclaimPolicy": class["reclaimPolicy"].as_str().unwrap_or("Delete"),
            "storageClassName": class["metadata"]["name"],
            "volumeMode": claim["spec"]["volumeMode"].as_str().unwrap_or("Filesystem"),
            "hostPath": {"path": format!("{root}/{name}"), "type": "DirectoryOrCreate"},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [hostname]}
            ]}]}},
            "claimRef": {
                "kind": "PersistentVolumeClaim",
                "apiVersion": "v1",
                "namespace": claim["metadata"]["namespace"],
                "name": claim["metadata"]["name"],
                "uid": claim["metadata"]["uid"],
                "resourceVersion": claim["metadata"]["resourceVersion"],
            },
        },
    });
    if class["mountOptions"].is_array() {
        volume["spec"]["mountOptions"] = class["mountOptions"].clone();
    }
    volume
}

impl Reconcile for LocalPathProvisioner {
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let Some(claim) = cache::get(&key.resource, key.namespace.as_deref(), &key.name)? else {
            return Ok(Action::Done);
        };
        if !claim["metadata"]["deletionTimestamp"].is_null()
            || claim["spec"]["volumeName"]
                .as_str()
                .is_some_and(|v| !v.is_empty())
        {
            return Ok(Action::Done);
        }
        let class_name = claim["spec"]["storageClassName"].as_str().unwrap_or("");
        let Some(class) = cache::get(&gvr("storage.k8s.io", "storageclasses"), None, class_name)?
        else {
            return Ok(Action::Done);
        };
        if class["provisioner"] != PROVISIONER {
            return Ok(Action::Done);
        }
        let volumes = gvr("", "persistentvolumes");
        let name = format!("pvc-{}", str_of(&claim, "/metadata/uid"));
        if cache::get(&volumes, None, &name)?.is_some() {
            return Ok(Action::Done);
        }
        let Some(node_name) = claim["metadata"]["annotations"][SELECTED_NODE].as_str() else {
            if class["volumeBindingMode"] != "WaitForFirstConsumer"
                && claim["status"]["phase"] != "Lost"
            {
                events::record(
                    &claim,
                    EventType::Warning,
                    "ProvisioningFailed",
                    &format!(
                        "failed to provision volume with StorageClass \"{class_name}\": configuration error, no node was specified"
                    ),
                );
            }
            return Ok(Action::Done);
        };
        let Some(node) = cache::get(&gvr("", "nodes"), None, node_name)? else {
            events::record(
                &claim,
                EventType::Warning,
                "ProvisioningFailed",
                &format!("failed to provision volume: node \"{node_name}\" not found"),
            );
            return Ok(Action::Done);
        };
        events::record(
            &claim,
            EventType::Normal,
            "Provisioning",
            &format!(
                "External provisioner is provisioning volume for claim \"{}/{}\"",
                key.namespace.as_deref().unwrap_or(""),
                key.name
            ),
        );
        let volume = volume_for(&claim, &class, &node, &self.path);
        match client::create(&volumes, None, volume) {
            Ok(_) => {}
            Err(e) if e.is_already_exists() => return Ok(Action::Done),
            Err(e) => {
                events::record(
                    &claim,
                    EventType::Warning,
                    "ProvisioningFailed",
                    &format!("failed to provision volume with StorageClass \"{class_name}\": {e}"),
                );
                return Err(e.to_string());
            }
        }
        events::record(
            &claim,
            EventType::Normal,
            "ProvisioningSucceeded",
            &format!("Successfully provisioned volume {name}"),
        );
        Ok(Action::Done)
    }
}

trellis_plugin::controller!(LocalPathProvisioner);

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_plugin::testing::ControllerHarness;

    fn claims() -> GroupVersionResource {
        gvr("", "persistentvolumeclaims")
    }

    fn harness(selected: Option<&str>) -> ControllerHarness {
        let mut claim = json!({
            "metadata": {"name": "data", "namespace": "ns", "uid": "u1"},
            "spec": {"storageClassName": "local-path", "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "1Gi"}}},
        });
        if let Some(node) = selected {
            claim["metadata"]["annotations"] = json!({SELECTED_NODE: node});
        }
        ControllerHarness::new()
            .with_object(
                gvr("storage.k8s.io", "storageclasses"),
                json!({"metadata": {"name": "local-path"}, "provisioner": PROVISIONER,
                       "reclaimPolicy": "Delete", "volumeBindingMode": "WaitForFirstConsumer"}),
            )
            .with_object(
                gvr("", "nodes"),
                json!({"metadata": {"name": "n1", "labels": {"kubernetes.io/hostname": "host-1"},
                                    "annotations": {ROOT_ANNOTATION: "/data/n1/storage/"}}}),
            )
            .with_object(claims(), claim)
    }

    #[test]
    fn a_claim_gets_a_directory_on_its_selected_node() {
        let h = harness(Some("n1"));
        h.reconcile::<LocalPathProvisioner>(&claims(), Some("ns"), "data")
            .unwrap();
        let pv = h
            .object(&gvr("", "persistentvolumes"), None, "pvc-u1")
            .unwrap();
        assert_eq!(pv["spec"]["hostPath"]["path"], "/data/n1/storage/pvc-u1");
        assert_eq!(pv["spec"]["claimRef"]["uid"], "u1");
        assert_eq!(pv["spec"]["capacity"]["storage"], "1Gi");
        assert_eq!(pv["spec"]["persistentVolumeReclaimPolicy"], "Delete");
        assert_eq!(pv["spec"]["storageClassName"], "local-path");
        assert_eq!(
            pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
                [0],
            "host-1"
        );
        let reasons: Vec<String> = h.events().into_iter().map(|(r, _)| r).collect();
        assert_eq!(reasons, ["Provisioning", "ProvisioningSucceeded"]);
        // Once made, not made again.
        h.reconcile::<LocalPathProvisioner>(&claims(), Some("ns"), "data")
            .unwrap();
        assert_eq!(h.writes().len(), 1);
    }

    #[test]
    fn a_claim_waits_for_its_first_consumer() {
        let h = harness(None);
        h.reconcile::<LocalPathProvisioner>(&claims(), Some("ns"), "data")
            .unwrap();
        assert!(h.writes().is_empty());
        assert!(h.events().is_empty());
    }
}
