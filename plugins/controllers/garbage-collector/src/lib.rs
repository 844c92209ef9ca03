//! The garbage collector, as Kubernetes' behaves, over the graph of
//! `metadata.ownerReferences`. The host runs it for every resource it can list,
//! watch and delete (events excepted); each key is one object, reconciled when it
//! changes, when one of its owners changes, and when one of its owners is deleted.
//!
//! - An object whose owners are all gone is deleted (background: its own dependents
//!   follow the same way). An owner counts as gone when the API server itself, not
//!   only the cache, has no object of that name with that uid. References to owners
//!   that are gone while others remain are removed instead.
//! - An object being deleted with the `orphan` finalizer (`--cascade=orphan`) first
//!   has the references to it removed from its dependents, then loses the finalizer.
//! - An object being deleted with the `foregroundDeletion` finalizer has its
//!   dependents deleted (those that block their owner's deletion in the foreground
//!   too), and loses the finalizer once none that blocks is left.
//! - A cluster-scoped object cannot be owned by a namespaced one: such a reference is
//!   reported in an event (`OwnerRefInvalidNamespace`) and left alone.

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{
    Action, EventType, ObjectKey, PatchType, Propagation, Reconcile, Write, cache, client, events,
    owned,
};

pub const ORPHAN: &str = "orphan";
pub const FOREGROUND: &str = "foregroundDeletion";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GarbageCollector {}

fn meta_str<'a>(obj: &'a Value, field: &str) -> &'a str {
    obj["metadata"][field].as_str().unwrap_or_default()
}

fn finalizers(obj: &Value) -> Vec<&str> {
    obj["metadata"]["finalizers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

/// Where an object (with its `apiVersion` and `kind`) is written.
fn resource_of(obj: &Value) -> Option<GroupVersionResource> {
    let api_version = obj["apiVersion"].as_str()?;
    let kind = obj["kind"].as_str()?;
    cache::resource_of(api_version, kind).map(|r| r.resource)
}

fn namespace_of(obj: &Value) -> Option<String> {
    obj["metadata"]["namespace"]
        .as_str()
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
}

/// What became of one owner.
#[derive(Debug, PartialEq, Eq)]
enum Owner {
    /// There, and not being deleted in the foreground.
    Solid,
    /// Being deleted in the foreground, waiting for its dependents.
    Waiting,
    /// Gone, or replaced by another object of the same name.
    Gone,
    /// A reference that cannot be followed (an unknown kind, or a namespaced owner
    /// of a cluster-scoped object): left as it is.
    Unknown,
}

impl Reconcile for GarbageCollector {
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let Some(obj) = cache::get(&key.resource, ns, &key.name)? else {
            return Ok(Action::Done);
        };
        if !obj["metadata"]["deletionTimestamp"].is_null() {
            let held = finalizers(&obj);
            if held.contains(&ORPHAN) {
                return orphan(key, &obj);
            }
            if held.contains(&FOREGROUND) {
                return foreground(key, &obj);
            }
            return Ok(Action::Done);
        }
        let refs = obj["metadata"]["ownerReferences"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if refs.is_empty() {
            return Ok(Action::Done);
        }
        let states: Vec<Owner> = refs
            .iter()
            .map(|r| owner_state(key, &obj, r))
            .collect::<Result<_, _>>()?;
        let gone: Vec<&Value> = refs
            .iter()
            .zip(&states)
            .filter(|(_, s)| **s == Owner::Gone)
            .map(|(r, _)| r)
            .collect();
        if gone.is_empty() {
            return Ok(Action::Done);
        }
        let solid = states
            .iter()
            .any(|s| *s == Owner::Solid || *s == Owner::Unknown);
        let waiting = states.contains(&Owner::Waiting);
        if solid {
            // Only some owners are gone: forget them, keep the object.
            let patch: Vec<Value> = gone
                .iter()
                .map(|r| json!({"$patch": "delete", "uid": r["uid"]}))
                .collect();
            client::patch(
                &key.resource,
                ns,
                &key.name,
                PatchType::Strategic,
                json!({"metadata": {"ownerReferences": patch, "uid": obj["metadata"]["uid"]}}),
                false,
            )
            .map_err(|e| format!("remove dangling owner references: {e}"))?;
            return Ok(Action::Done);
        }
        // Every owner is gone, or some wait for their dependents to go first: then
        // this one goes in the foreground too, so that they wait for its own.
        let propagation = if waiting {
            Propagation::Foreground
        } else {
            Propagation::Background
        };
        delete(&key.resource, key.namespace.clone(), &obj, propagation)
    }
}

/// Deletes `obj` (this very object: its uid is the precondition).
fn delete(
    resource: &GroupVersionResource,
    namespace: Option<String>,
    obj: &Value,
    propagation: Propagation,
) -> Result<Action, String> {
    match client::write(Write::Delete {
        resource: resource.clone(),
        namespace,
        name: meta_str(obj, "name").to_owned(),
        propagation: Some(propagation),
        uid: Some(meta_str(obj, "uid").to_owned()),
    }) {
        Ok(_) => Ok(Action::Done),
        // Gone already, or replaced by an object the precondition protects.
        Err(e) if e.is_not_found() || e.code == 409 => Ok(Action::Done),
        Err(e) => Err(format!("delete {}: {e}", meta_str(obj, "name"))),
    }
}

/// Whether the owner a reference names is there.
fn owner_state(key: &ObjectKey, obj: &Value, reference: &Value) -> Result<Owner, String> {
    let api_version = reference["apiVersion"].as_str().unwrap_or_default();
    let kind = reference["kind"].as_str().unwrap_or_default();
    let name = reference["name"].as_str().unwrap_or_default();
    let uid = reference["uid"].as_str().unwrap_or_default();
    let Some(served) = cache::resource_of(api_version, kind) else {
        return Ok(Owner::Unknown);
    };
    let namespace = match (served.namespaced, key.namespace.as_deref()) {
        (true, Some(ns)) => Some(ns),
        (false, _) => None,
        (true, None) => {
            events::record(
                obj,
                EventType::Warning,
                "OwnerRefInvalidNamespace",
                &format!(
                    "ownerRef [{api_version}/{kind}, namespace: , name: {name}, uid: {uid}] does not exist in namespace \"\""
                ),
            );
            return Ok(Owner::Unknown);
        }
    };
    let state = |owner: &Value| {
        if meta_str(owner, "uid") != uid {
            Owner::Gone
        } else if !owner["metadata"]["deletionTimestamp"].is_null()
            && finalizers(owner).contains(&FOREGROUND)
        {
            Owner::Waiting
        } else {
            Owner::Solid
        }
    };
    if let Some(owner) = cache::get(&served.resource, namespace, name)?
        && meta_str(&owner, "uid") == uid
    {
        return Ok(state(&owner));
    }
    // The cache may not hold an owner created a moment ago: the API server decides.
    match client::read(&served.resource, namespace, name) {
        Ok(Some(owner)) => Ok(state(&owner)),
        Ok(None) => Ok(Owner::Gone),
        Err(e) if e.is_not_found() => Ok(Owner::Gone),
        Err(e) => Err(format!("read owner {kind} {name}: {e}")),
    }
}

/// Removes `finalizer` from `obj`, as long as its finalizers are what was read.
fn remove_finalizer(key: &ObjectKey, obj: &Value, finalizer: &str) -> Result<(), String> {
    let current = &obj["metadata"]["finalizers"];
    let kept: Vec<&str> = finalizers(obj)
        .into_iter()
        .filter(|f| *f != finalizer)
        .collect();
    let patch = json!([
        {"op": "test", "path": "/metadata/finalizers", "value": current},
        {"op": "replace", "path": "/metadata/finalizers", "value": kept},
    ]);
    match client::patch(
        &key.resource,
        key.namespace.as_deref(),
        &key.name,
        PatchType::Json,
        patch,
        false,
    ) {
        Ok(_) => Ok(()),
        Err(e) if e.is_not_found() => Ok(()),
        Err(e) => Err(format!("remove the {finalizer} finalizer: {e}")),
    }
}

/// Orphan deletion: the dependents forget this owner, then it may go.
fn orphan(key: &ObjectKey, obj: &Value) -> Result<Action, String> {
    let uid = meta_str(obj, "uid");
    let mut writes = Vec::new();
    for dependent in cache::dependents(uid)? {
        let Some(resource) = resource_of(&dependent) else {
            continue;
        };
        let namespace = namespace_of(&dependent);
        writes.push(owned::release(
            &resource,
            namespace.as_deref(),
            &dependent,
            uid,
        ));
    }
    for result in client::batch(writes)? {
        match result {
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(format!("orphan a dependent: {e}")),
        }
    }
    remove_finalizer(key, obj, ORPHAN)?;
    Ok(Action::Done)
}

/// Foreground deletion: the dependents go first; the owner waits for those that
/// block it.
fn foreground(key: &ObjectKey, obj: &Value) -> Result<Action, String> {
    let uid = meta_str(obj, "uid");
    let mut blocking = 0;
    let mut writes = Vec::new();
    for dependent in cache::dependents(uid)? {
        let blocks = dependent["metadata"]["ownerReferences"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|r| r["uid"] == uid && r["blockOwnerDeletion"] == true);
        if blocks {
            blocking += 1;
        }
        if !dependent["metadata"]["deletionTimestamp"].is_null() {
            continue;
        }
        let Some(resource) = resource_of(&dependent) else {
            continue;
        };
        writes.push(Write::Delete {
            resource,
            namespace: namespace_of(&dependent),
            name: meta_str(&dependent, "name").to_owned(),
            propagation: Some(if blocks {
                Propagation::Foreground
            } else {
                Propagation::Background
            }),
            uid: Some(meta_str(&dependent, "uid").to_owned()),
        });
    }
    for result in client::batch(writes)? {
        match result {
            Ok(_) => {}
            Err(e) if e.is_not_found() || e.code == 409 => {}
            Err(e) => return Err(format!("delete a dependent: {e}")),
        }
    }
    // Each dependent's deletion brings this key back; the last one lets it go.
    if blocking == 0 {
        remove_finalizer(key, obj, FOREGROUND)?;
    }
    Ok(Action::Done)
}

trellis_plugin::controller!(GarbageCollector);

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_plugin::testing::ControllerHarness;

    fn configmaps() -> GroupVersionResource {
        GroupVersionResource {
            group: String::new(),
            version: "v1".into(),
            resource: "configmaps".into(),
        }
    }

    fn harness() -> ControllerHarness {
        ControllerHarness::new().with_kind("v1", "ConfigMap", configmaps(), true)
    }

    fn reference(name: &str, uid: &str, block: bool) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "name": name, "uid": uid,
               "blockOwnerDeletion": block})
    }

    fn map(name: &str, uid: &str, owners: Value) -> Value {
        json!({"metadata": {"name": name, "namespace": "ns", "uid": uid, "ownerReferences": owners}})
    }

    fn reconcile(h: &ControllerHarness, name: &str) {
        h.reconcile::<GarbageCollector>(&configmaps(), Some("ns"), name)
            .unwrap();
    }

    #[test]
    fn an_object_whose_owners_are_all_gone_is_deleted() {
        let h = harness().with_object(
            configmaps(),
            map("child", "c", json!([reference("ghost", "g", false)])),
        );
        reconcile(&h, "child");
        assert!(h.object(&configmaps(), Some("ns"), "child").is_none());
    }

    #[test]
    fn a_dangling_reference_beside_a_live_owner_is_removed_not_the_object() {
        let h = harness()
            .with_object(configmaps(), map("live", "l", json!([])))
            .with_object(
                configmaps(),
                map(
                    "child",
                    "c",
                    json!([
                        reference("ghost", "g", false),
                        reference("live", "l", false)
                    ]),
                ),
            );
        reconcile(&h, "child");
        assert!(h.object(&configmaps(), Some("ns"), "child").is_some());
        let released = h.writes().into_iter().any(|w| match w {
            Write::Patch { patch, .. } => {
                patch["metadata"]["ownerReferences"][0] == json!({"$patch": "delete", "uid": "g"})
            }
            _ => false,
        });
        assert!(released, "{:?}", h.writes());
    }

    #[test]
    fn orphan_deletion_releases_the_dependents_then_the_finalizer() {
        let mut owner = map("owner", "o", json!([]));
        owner["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        owner["metadata"]["finalizers"] = json!([ORPHAN]);
        let h = harness().with_object(configmaps(), owner).with_object(
            configmaps(),
            map("child", "c", json!([reference("owner", "o", true)])),
        );
        reconcile(&h, "owner");
        assert!(h.object(&configmaps(), Some("ns"), "child").is_some());
        let owner = h.object(&configmaps(), Some("ns"), "owner").unwrap();
        assert_eq!(owner["metadata"]["finalizers"], json!([]));
    }

    #[test]
    fn foreground_deletion_deletes_blocking_dependents_first() {
        let mut owner = map("owner", "o", json!([]));
        owner["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        owner["metadata"]["finalizers"] = json!([FOREGROUND]);
        let h = harness().with_object(configmaps(), owner).with_object(
            configmaps(),
            map("child", "c", json!([reference("owner", "o", true)])),
        );
        reconcile(&h, "owner");
        assert!(h.object(&configmaps(), Some("ns"), "child").is_none());
        // The dependent went in this pass: the owner still waits for it.
        let owner = h.object(&configmaps(), Some("ns"), "owner").unwrap();
        assert_eq!(owner["metadata"]["finalizers"], json!([FOREGROUND]));
        // Its removal brings the owner back: nothing blocks, the finalizer goes.
        reconcile(&h, "owner");
        let owner = h.object(&configmaps(), Some("ns"), "owner").unwrap();
        assert_eq!(owner["metadata"]["finalizers"], json!([]));
    }
}
