//! The PersistentVolume binder: claims bound to volumes, as Kubernetes' persistent
//! volume controller (`pkg/controller/volume/persistentvolume`) does it.
//!
//! Each claim is reconciled (and every claim again when a volume changes, so that a
//! new volume finds the claim waiting for it):
//! - a claim that names a volume (`spec.volumeName`) is bound to it when the volume
//!   is free or already names the claim;
//! - otherwise the smallest Available volume that fits (class, access modes,
//!   capacity, volume mode, the claim's selector) is bound to it, or a volume already
//!   pre-bound to it (`claimRef`, as a provisioner writes it);
//! - a claim of a `WaitForFirstConsumer` class whose node is not chosen yet takes
//!   only a volume pre-bound to it (the scheduler chooses its node first);
//! - none fits: the claim stays Pending, waiting for its first consumer (a class of
//!   `WaitForFirstConsumer` whose claim has no selected node yet) or for the class'
//!   provisioner, whose name the claim is annotated with;
//! - a volume whose claim is gone (or is another claim of the same name) is
//!   Released, and deleted when its reclaim policy is Delete.
//!
//! A binding is written in Kubernetes' order: the volume's `claimRef` first, then its
//! phase, then the claim's `volumeName` and annotations, then the claim's phase; a
//! reconcile that finds half a binding completes it.
//!
//! Left out: the `kubernetes.io/pvc-protection` finalizers, volume resizing, the
//! Recycle reclaim policy (deprecated), data sources.

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::owned::selector_matches;
use trellis_plugin::controller::{
    Action, EventType, ObjectKey, PatchType, Propagation, Reconcile, Write, cache, client, events,
};
use trellis_plugin::quantity::Quantity;

/// Annotations of Kubernetes' binder, which kubectl and other controllers read.
pub const BIND_COMPLETED: &str = "pv.kubernetes.io/bind-completed";
pub const BOUND_BY_CONTROLLER: &str = "pv.kubernetes.io/bound-by-controller";
pub const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
pub const STORAGE_PROVISIONER: &str = "volume.kubernetes.io/storage-provisioner";
pub const BETA_STORAGE_PROVISIONER: &str = "volume.beta.kubernetes.io/storage-provisioner";
/// A class whose volumes are only made by hand.
const NO_PROVISIONER: &str = "kubernetes.io/no-provisioner";

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PersistentvolumeBinder {}

fn gvr(group: &str, resource: &str) -> GroupVersionResource {
    GroupVersionResource {
        group: group.into(),
        version: "v1".into(),
        resource: resource.into(),
    }
}

fn claims() -> GroupVersionResource {
    gvr("", "persistentvolumeclaims")
}

fn volumes() -> GroupVersionResource {
    gvr("", "persistentvolumes")
}

fn classes() -> GroupVersionResource {
    gvr("storage.k8s.io", "storageclasses")
}

fn str_of<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

/// The class a claim asks for: `spec.storageClassName`, or the beta annotation
/// older clients write; "" is no class.
pub fn claim_class(claim: &Value) -> &str {
    match claim["spec"]["storageClassName"].as_str() {
        Some(class) => class,
        None => str_of(
            claim,
            "/metadata/annotations/volume.beta.kubernetes.io~1storage-class",
        ),
    }
}

fn volume_class(volume: &Value) -> &str {
    match volume["spec"]["storageClassName"].as_str() {
        Some(class) => class,
        None => str_of(
            volume,
            "/metadata/annotations/volume.beta.kubernetes.io~1storage-class",
        ),
    }
}

fn storage(v: &Value) -> Option<i64> {
    v.as_str()
        .and_then(|q| Quantity::parse(q).ok())
        .map(|q| q.value())
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

fn volume_mode(v: &Value) -> &str {
    v["spec"]["volumeMode"].as_str().unwrap_or("Filesystem")
}

/// Whether the volume's claimRef names this claim (by uid when it has one: a
/// provisioner pre-binds by name and uid, an administrator by name alone).
fn names_claim(volume: &Value, claim: &Value) -> bool {
    let r = &volume["spec"]["claimRef"];
    if r.is_null() {
        return false;
    }
    let same_name =
        r["namespace"] == claim["metadata"]["namespace"] && r["name"] == claim["metadata"]["name"];
    let uid = r["uid"].as_str().unwrap_or("");
    same_name && (uid.is_empty() || claim["metadata"]["uid"] == uid)
}

/// Why `volume` cannot hold `claim`, or `None` when it fits (class, access modes,
/// capacity, volume mode, selector), as the binder's `findMatchingVolume`.
pub fn mismatch(volume: &Value, claim: &Value) -> Option<&'static str> {
    if volume_class(volume) != claim_class(claim) {
        return Some("storage class");
    }
    let modes = strings(&volume["spec"]["accessModes"]);
    if !strings(&claim["spec"]["accessModes"])
        .iter()
        .all(|m| modes.contains(m))
    {
        return Some("access modes");
    }
    let wanted = storage(&claim["spec"]["resources"]["requests"]["storage"]).unwrap_or(0);
    let has = storage(&volume["spec"]["capacity"]["storage"]).unwrap_or(0);
    if has < wanted {
        return Some("capacity");
    }
    if volume_mode(volume) != volume_mode(claim) {
        return Some("volume mode");
    }
    let selector = &claim["spec"]["selector"];
    if !selector.is_null() && !selector_matches(selector, &volume["metadata"]["labels"]) {
        return Some("selector");
    }
    None
}

/// The volume to bind a claim without `volumeName` to: one pre-bound to it, else the
/// smallest free one that fits (ties by name, so the choice is stable).
pub fn find_volume<'a>(volumes: &'a [Value], claim: &Value) -> Option<&'a Value> {
    if let Some(pre) = volumes
        .iter()
        .find(|v| names_claim(v, claim) && v["metadata"]["deletionTimestamp"].is_null())
    {
        return Some(pre);
    }
    volumes
        .iter()
        .filter(|v| {
            v["spec"]["claimRef"].is_null()
                && v["metadata"]["deletionTimestamp"].is_null()
                && matches!(
                    v["status"]["phase"].as_str(),
                    None | Some("Available" | "Pending")
                )
                && mismatch(v, claim).is_none()
        })
        .min_by_key(|v| {
            (
                storage(&v["spec"]["capacity"]["storage"]).unwrap_or(0),
                v["metadata"]["name"].as_str().unwrap_or("").to_owned(),
            )
        })
}

fn claim_ref(claim: &Value) -> Value {
    json!({
        "kind": "PersistentVolumeClaim",
        "apiVersion": "v1",
        "namespace": claim["metadata"]["namespace"],
        "name": claim["metadata"]["name"],
        "uid": claim["metadata"]["uid"],
        "resourceVersion": claim["metadata"]["resourceVersion"],
    })
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl PersistentvolumeBinder {
    /// Releases the volumes whose claim is gone; deletes those whose policy says so.
    fn release_orphans(&self, key: &ObjectKey, claim: Option<&Value>) -> Result<(), String> {
        let namespace = key.namespace.as_deref().unwrap_or("");
        let all: Vec<Value> = cache::list_as(&volumes(), None, "")?;
        for volume in &all {
            let r = &volume["spec"]["claimRef"];
            if r["namespace"] != namespace || r["name"] != key.name.as_str() {
                continue;
            }
            let uid = r["uid"].as_str().unwrap_or("");
            let orphaned = match claim {
                None => !uid.is_empty(),
                Some(c) => !uid.is_empty() && c["metadata"]["uid"] != uid,
            };
            if !orphaned || !volume["metadata"]["deletionTimestamp"].is_null() {
                continue;
            }
            let name = str_of(volume, "/metadata/name");
            // The claim may only be missing from a cache that lags: ask the server.
            if let Some(live) = client::read(&claims(), Some(namespace), &key.name).map_err(err)?
                && live["metadata"]["uid"] == uid
            {
                continue;
            }
            let policy = volume["spec"]["persistentVolumeReclaimPolicy"]
                .as_str()
                .unwrap_or("Retain");
            if volume["status"]["phase"] != "Released" {
                client::patch_status(&volumes(), None, name, json!({"phase": "Released"}))
                    .map_err(err)?;
            }
            if policy == "Delete" {
                let written = client::write(Write::Delete {
                    resource: volumes(),
                    namespace: None,
                    name: name.to_owned(),
                    propagation: Some(Propagation::Background),
                    uid: volume["metadata"]["uid"].as_str().map(str::to_owned),
                });
                match written {
                    Ok(_) => {}
                    Err(e) if e.is_not_found() => {}
                    Err(e) => return Err(e.to_string()),
                }
                events::record(
                    volume,
                    EventType::Normal,
                    "VolumeDelete",
                    &format!("the volume's claim {namespace}/{} is gone", key.name),
                );
            }
        }
        Ok(())
    }

    /// Binds `volume` to `claim`, each step skipped when already written.
    fn bind(&self, volume: &Value, claim: &Value) -> Result<(), String> {
        let namespace = str_of(claim, "/metadata/namespace");
        let claim_name = str_of(claim, "/metadata/name");
        let volume_name = str_of(volume, "/metadata/name");
        let mut volume = volume.clone();
        if !names_claim(&volume, claim) || volume["spec"]["claimRef"]["uid"].is_null() {
            let mut patch = json!({"spec": {"claimRef": claim_ref(claim)}});
            if volume["spec"]["claimRef"].is_null() {
                patch["metadata"] = json!({"annotations": {BOUND_BY_CONTROLLER: "yes"}});
            }
            // The resourceVersion read makes a second binder's write conflict.
            patch["metadata"]["resourceVersion"] = volume["metadata"]["resourceVersion"].clone();
            volume = client::patch(
                &volumes(),
                None,
                volume_name,
                PatchType::Merge,
                patch,
                false,
            )
            .map_err(err)?;
        }
        if volume["status"]["phase"] != "Bound" {
            client::patch_status(&volumes(), None, volume_name, json!({"phase": "Bound"}))
                .map_err(err)?;
        }
        let annotations = &claim["metadata"]["annotations"];
        if claim["spec"]["volumeName"] != volume_name || annotations[BIND_COMPLETED] != "yes" {
            let mut patch = json!({
                "metadata": {"annotations": {BIND_COMPLETED: "yes"}},
                "spec": {"volumeName": volume_name},
            });
            if claim["spec"]["volumeName"].is_null() {
                patch["metadata"]["annotations"][BOUND_BY_CONTROLLER] = "yes".into();
            }
            client::patch(
                &claims(),
                Some(namespace),
                claim_name,
                PatchType::Merge,
                patch,
                false,
            )
            .map_err(err)?;
        }
        if claim["status"]["phase"] != "Bound" {
            client::patch_status(
                &claims(),
                Some(namespace),
                claim_name,
                json!({
                    "phase": "Bound",
                    "accessModes": volume["spec"]["accessModes"],
                    "capacity": volume["spec"]["capacity"],
                }),
            )
            .map_err(err)?;
        }
        Ok(())
    }

    /// Whether the claim's class binds on the first consumer and no node is chosen yet.
    fn waits_for_consumer(&self, claim: &Value) -> Result<bool, String> {
        let class_name = claim_class(claim);
        if class_name.is_empty() || !claim["metadata"]["annotations"][SELECTED_NODE].is_null() {
            return Ok(false);
        }
        Ok(cache::get(&classes(), None, class_name)?
            .is_some_and(|c| c["volumeBindingMode"] == "WaitForFirstConsumer"))
    }

    fn set_claim_phase(&self, claim: &Value, phase: &str) -> Result<(), String> {
        if claim["status"]["phase"] == phase {
            return Ok(());
        }
        client::patch_status(
            &claims(),
            claim["metadata"]["namespace"].as_str(),
            str_of(claim, "/metadata/name"),
            json!({"phase": phase}),
        )
        .map_err(err)?;
        Ok(())
    }

    /// No volume fits: the claim waits for its consumer or its provisioner.
    fn wait_for_volume(&self, claim: &Value) -> Result<(), String> {
        let class_name = claim_class(claim);
        let class = if class_name.is_empty() {
            None
        } else {
            cache::get(&classes(), None, class_name)?
        };
        let provisioner = class
            .as_ref()
            .and_then(|c| c["provisioner"].as_str())
            .filter(|p| *p != NO_PROVISIONER);
        let annotations = &claim["metadata"]["annotations"];
        let waits_for_consumer = class
            .as_ref()
            .is_some_and(|c| c["volumeBindingMode"] == "WaitForFirstConsumer")
            && annotations[SELECTED_NODE].is_null();
        if waits_for_consumer {
            if claim["status"]["phase"] != "Pending" {
                events::record(
                    claim,
                    EventType::Normal,
                    "WaitForFirstConsumer",
                    "waiting for first consumer to be created before binding",
                );
            }
        } else if let Some(provisioner) = provisioner {
            if annotations[STORAGE_PROVISIONER] != provisioner {
                client::patch(
                    &claims(),
                    claim["metadata"]["namespace"].as_str(),
                    str_of(claim, "/metadata/name"),
                    PatchType::Merge,
                    json!({"metadata": {"annotations": {
                        STORAGE_PROVISIONER: provisioner,
                        BETA_STORAGE_PROVISIONER: provisioner,
                    }}}),
                    false,
                )
                .map_err(err)?;
                events::record(
                    claim,
                    EventType::Normal,
                    "ExternalProvisioning",
                    &format!(
                        "Waiting for a volume to be created either by the external provisioner '{provisioner}' or manually by the system administrator. If volume creation is delayed, please verify that the provisioner is running and correctly registered."
                    ),
                );
            }
        } else if claim["status"]["phase"] != "Pending" {
            let why = if class_name.is_empty() || class.is_some() {
                "no persistent volumes available for this claim and no storage class is set"
                    .to_owned()
            } else {
                format!("storageclass.storage.k8s.io \"{class_name}\" not found")
            };
            events::record(claim, EventType::Warning, "ProvisioningFailed", &why);
        }
        self.set_claim_phase(claim, "Pending")
    }
}

impl Reconcile for PersistentvolumeBinder {
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let claim = cache::get(&claims(), key.namespace.as_deref(), &key.name)?;
        self.release_orphans(key, claim.as_ref())?;
        let Some(claim) = claim else {
            return Ok(Action::Done);
        };
        if !claim["metadata"]["deletionTimestamp"].is_null() {
            return Ok(Action::Done);
        }
        let all: Vec<Value> = cache::list_as(&volumes(), None, "")?;
        match claim["spec"]["volumeName"]
            .as_str()
            .filter(|n| !n.is_empty())
        {
            Some(name) => {
                let Some(volume) = all.iter().find(|v| v["metadata"]["name"] == name) else {
                    // Its volume is gone: Lost once it was bound, else still Pending.
                    let phase = if claim["status"]["phase"] == "Bound" {
                        events::record(
                            &claim,
                            EventType::Warning,
                            "ClaimLost",
                            "Bound claim has lost reference to PersistentVolume. Data on the volume is lost!",
                        );
                        "Lost"
                    } else {
                        "Pending"
                    };
                    self.set_claim_phase(&claim, phase)?;
                    return Ok(Action::Done);
                };
                if volume["spec"]["claimRef"].is_null() || names_claim(volume, &claim) {
                    self.bind(volume, &claim)?;
                } else {
                    // The volume is another claim's: this one waits.
                    self.set_claim_phase(&claim, "Pending")?;
                }
            }
            None => {
                // A claim waiting for its first consumer takes only a volume made
                // for it: the scheduler, not the binder, picks where it goes.
                let delayed = self.waits_for_consumer(&claim)?;
                let found =
                    find_volume(&all, &claim).filter(|v| !delayed || names_claim(v, &claim));
                match found {
                    Some(volume) => self.bind(volume, &claim)?,
                    None => self.wait_for_volume(&claim)?,
                }
            }
        }
        // Volumes nobody claims are Available, as the binder's volume loop keeps them.
        for volume in &all {
            if volume["spec"]["claimRef"].is_null()
                && volume["metadata"]["deletionTimestamp"].is_null()
                && matches!(volume["status"]["phase"].as_str(), None | Some("Pending"))
            {
                client::patch_status(
                    &volumes(),
                    None,
                    str_of(volume, "/metadata/name"),
                    json!({"phase": "Available"}),
                )
                .map_err(err)?;
            }
        }
        Ok(Action::Done)
    }
}

trellis_plugin::controller!(PersistentvolumeBinder);

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_plugin::testing::ControllerHarness;

    fn claim(name: &str, class: Option<&str>, size: &str) -> Value {
        let mut c = json!({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"), "resourceVersion": "1"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}},
        });
        if let Some(class) = class {
            c["spec"]["storageClassName"] = class.into();
        }
        c
    }

    fn volume(name: &str, class: &str, size: &str) -> Value {
        json!({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": name, "uid": format!("uid-{name}"), "resourceVersion": "1"},
            "spec": {"accessModes": ["ReadWriteOnce", "ReadOnlyMany"], "capacity": {"storage": size},
                     "storageClassName": class, "persistentVolumeReclaimPolicy": "Retain",
                     "hostPath": {"path": format!("/tmp/{name}")}},
            "status": {"phase": "Available"},
        })
    }

    #[test]
    fn a_claim_binds_the_smallest_volume_that_fits() {
        let h = ControllerHarness::new()
            .with_object(claims(), claim("data", Some("manual"), "1Gi"))
            .with_object(volumes(), volume("small", "manual", "500Mi"))
            .with_object(volumes(), volume("big", "manual", "10Gi"))
            .with_object(volumes(), volume("fit", "manual", "2Gi"))
            .with_object(volumes(), volume("other-class", "fast", "1Gi"));
        assert_eq!(
            h.reconcile::<PersistentvolumeBinder>(&claims(), Some("ns"), "data"),
            Ok(Action::Done)
        );
        let pv = h.object(&volumes(), None, "fit").unwrap();
        assert_eq!(pv["spec"]["claimRef"]["name"], "data");
        assert_eq!(pv["spec"]["claimRef"]["uid"], "uid-data");
        assert_eq!(pv["metadata"]["annotations"][BOUND_BY_CONTROLLER], "yes");
        assert_eq!(pv["status"]["phase"], "Bound");
        let pvc = h.object(&claims(), Some("ns"), "data").unwrap();
        assert_eq!(pvc["spec"]["volumeName"], "fit");
        assert_eq!(pvc["metadata"]["annotations"][BIND_COMPLETED], "yes");
        assert_eq!(pvc["status"]["phase"], "Bound");
        assert_eq!(pvc["status"]["capacity"]["storage"], "2Gi");
        assert!(h.object(&volumes(), None, "big").unwrap()["spec"]["claimRef"].is_null());
    }

    #[test]
    fn a_claim_without_a_fitting_volume_waits_for_its_provisioner_or_consumer() {
        let class = |name: &str, mode: &str| json!({"metadata": {"name": name}, "provisioner": "trellis.dev/local-path", "volumeBindingMode": mode});
        let h = ControllerHarness::new()
            .with_object(classes(), class("later", "WaitForFirstConsumer"))
            .with_object(classes(), class("now", "Immediate"))
            .with_object(claims(), claim("a", Some("later"), "1Gi"))
            .with_object(claims(), claim("b", Some("now"), "1Gi"));
        h.reconcile::<PersistentvolumeBinder>(&claims(), Some("ns"), "a")
            .unwrap();
        h.reconcile::<PersistentvolumeBinder>(&claims(), Some("ns"), "b")
            .unwrap();
        let a = h.object(&claims(), Some("ns"), "a").unwrap();
        assert_eq!(a["status"]["phase"], "Pending");
        assert!(a["metadata"]["annotations"][STORAGE_PROVISIONER].is_null());
        let b = h.object(&claims(), Some("ns"), "b").unwrap();
        assert_eq!(
            b["metadata"]["annotations"][STORAGE_PROVISIONER],
            "trellis.dev/local-path"
        );
        let reasons: Vec<String> = h.events().into_iter().map(|(r, _)| r).collect();
        assert_eq!(reasons, ["WaitForFirstConsumer", "ExternalProvisioning"]);
    }

    #[test]
    fn a_volume_pre_bound_by_its_provisioner_is_bound_whatever_else_fits() {
        let mut provisioned = volume("pvc-uid-data", "local-path", "1Gi");
        provisioned["spec"]["claimRef"] =
            json!({"namespace": "ns", "name": "data", "uid": "uid-data"});
        let h = ControllerHarness::new()
            .with_object(claims(), claim("data", Some("local-path"), "1Gi"))
            .with_object(volumes(), volume("a-static", "local-path", "1Gi"))
            .with_object(volumes(), provisioned);
        h.reconcile::<PersistentvolumeBinder>(&claims(), Some("ns"), "data")
            .unwrap();
        let pvc = h.object(&claims(), Some("ns"), "data").unwrap();
        assert_eq!(pvc["spec"]["volumeName"], "pvc-uid-data");
        // The claim named no volume: the controller chose (Kubernetes' mark); the
        // volume named its claim already.
        assert_eq!(pvc["metadata"]["annotations"][BOUND_BY_CONTROLLER], "yes");
        let pv = h.object(&volumes(), None, "pvc-uid-data").unwrap();
        assert!(pv["metadata"]["annotations"][BOUND_BY_CONTROLLER].is_null());
        assert_eq!(pv["status"]["phase"], "Bound");
    }

    #[test]
    fn a_claim_waiting_for_its_first_consumer_takes_no_static_volume_yet() {
        let h = ControllerHarness::new()
            .with_object(
                classes(),
                json!({"metadata": {"name": "local"}, "provisioner": "kubernetes.io/no-provisioner",
                       "volumeBindingMode": "WaitForFirstConsumer"}),
            )
            .with_object(claims(), claim("data", Some("local"), "1Gi"))
            .with_object(volumes(), volume("disk", "local", "1Gi"));
        h.reconcile::<PersistentvolumeBinder>(&claims(), Some("ns"), "data")
            .unwrap();
        assert!(h.object(&volumes(), None, "disk").unwrap()["spec"]["claimRef"].is_null());
        let pvc = h.object(&claims(), Some("ns"), "data").unwrap();
        assert_eq!(pvc["status"]["phase"], "Pending");
    }

    #[test]
    fn a_selector_and_access_modes_narrow_the_volumes() {
        let mut c = claim("data", Some("manual"), "1Gi");
        c["spec"]["selector"] = json!({"matchLabels": {"disk": "ssd"}});
        let mut labelled = volume("ssd", "manual", "5Gi");
        labelled["metadata"]["labels"] = json!({"disk": "ssd"});
        assert_eq!(
            mismatch(&volume("plain", "manual", "1Gi"), &c),
            Some("selector")
        );
        assert_eq!(mismatch(&labelled, &c), None);
        c["spec"]["accessModes"] = json!(["ReadWriteMany"]);
        assert_eq!(mismatch(&labelled, &c), Some("access modes"));
    }

    #[test]
    fn a_volume_whose_claim_is_gone_is_released_or_deleted_by_its_policy() {
        let bound = |name: &str, policy: &str| {
            let mut v = volume(name, "manual", "1Gi");
            v["spec"]["claimRef"] = json!({"namespace": "ns", "name": "gone", "uid": "uid-gone"});
            v["spec"]["persistentVolumeReclaimPolicy"] = policy.into();
            v["status"]["phase"] = "Bound".into();
            v
        };
        let h = ControllerHarness::new()
            .with_object(volumes(), bound("kept", "Retain"))
            .with_object(volumes(), bound("dropped", "Delete"));
        h.reconcile::<PersistentvolumeBinder>(&claims(), Some("ns"), "gone")
            .unwrap();
        assert_eq!(
            h.object(&volumes(), None, "kept").unwrap()["status"]["phase"],
            "Released"
        );
        assert!(h.object(&volumes(), None, "dropped").is_none());
    }
}
