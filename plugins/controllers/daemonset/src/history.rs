//! A DaemonSet's ControllerRevisions (Kubernetes' `constructHistory`, `snapshot`,
//! `cleanupHistory`): one per template it has had, named `<ds>-<hash>`, whose
//! `data` is the patch that puts that template back (what `kubectl rollout undo`
//! applies), numbered by `revision`.

use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{Write, cache, client, owned};

pub const HASH_LABEL: &str = "controller-revision-hash";

pub fn revisions() -> GroupVersionResource {
    GroupVersionResource {
        group: "apps".into(),
        version: "v1".into(),
        resource: "controllerrevisions".into(),
    }
}

/// FNV-1a, 32 bits.
fn fnv32a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

/// The hash of a template and collision count, spelled as Kubernetes' `ComputeHash`
/// spells it (digits mapped onto letters and digits that make no words).
pub fn template_hash(template: &Value, collision_count: Option<i64>) -> String {
    const ALPHANUMS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    // serde_json's maps are sorted: the same template always hashes the same.
    let mut text = template.to_string();
    if let Some(c) = collision_count {
        text.push_str(&c.to_string());
    }
    fnv32a(text.as_bytes())
        .to_string()
        .bytes()
        .map(|b| char::from(ALPHANUMS[usize::from(b) % ALPHANUMS.len()]))
        .collect()
}

/// The patch that replaces the DaemonSet's template by its current one.
pub fn patch_of(ds: &Value) -> Value {
    let mut template = ds["spec"]["template"].clone();
    if let Some(t) = template.as_object_mut() {
        t.insert("$patch".into(), json!("replace"));
    }
    json!({"spec": {"template": template}})
}

/// The revision name: the DaemonSet's name, shortened so the whole stays a valid
/// name, then the hash.
fn revision_name(ds_name: &str, hash: &str) -> String {
    let prefix: String = ds_name.chars().take(223).collect();
    format!("{prefix}-{hash}")
}

/// What [`construct`] found: the current revision's hash and the old revisions.
pub struct History {
    pub hash: String,
    pub old: Vec<Value>,
}

fn revision_number(r: &Value) -> i64 {
    r["revision"].as_i64().unwrap_or(0)
}

/// Finds (or makes) the revision of the DaemonSet's current template, adopting
/// matching orphans, giving the current one the highest number. `Err` after bumping
/// the collision count, when another object already has the name the hash gives.
pub fn construct(ds: &Value, selector: &Value, selector_string: &str) -> Result<History, String> {
    let ns = ds["metadata"]["namespace"].as_str();
    let uid = ds["metadata"]["uid"].as_str().unwrap_or_default();
    let reference = owned::controller_reference("apps/v1", "DaemonSet", ds);
    let mut ours: Vec<Value> = Vec::new();
    let mut adopt = Vec::new();
    for r in cache::list_as::<Value>(&revisions(), ns, selector_string)? {
        match owned::controller_of(&r) {
            Some(c) if c["uid"] == uid => ours.push(r),
            Some(_) => {}
            None if r["metadata"]["deletionTimestamp"].is_null() => {
                adopt.push(owned::adopt(&revisions(), ns, &r, reference.clone()));
                ours.push(r);
            }
            None => {}
        }
    }
    for r in cache::owned_by_as::<Value>(&revisions(), uid)? {
        if owned::is_controlled_by(&r, uid)
            && !owned::selector_matches(selector, &r["metadata"]["labels"])
        {
            adopt.push(owned::release(&revisions(), ns, &r, uid));
        }
    }
    if !adopt.is_empty() {
        for result in client::batch(adopt)? {
            match result {
                Ok(_) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(format!("claim a controller revision: {e}")),
            }
        }
    }

    let patch = patch_of(ds);
    let max = ours.iter().map(revision_number).max().unwrap_or(0);
    let (mut current, old): (Vec<Value>, Vec<Value>) =
        ours.into_iter().partition(|r| r["data"] == patch);
    // Duplicates of the current template (Kubernetes' dedupCurHistories): the one
    // with the highest number stays.
    current.sort_by_key(|r| std::cmp::Reverse(revision_number(r)));
    let mut writes = Vec::new();
    for dup in current.iter().skip(1) {
        writes.push(Write::Delete {
            resource: revisions(),
            namespace: ns.map(str::to_owned),
            name: dup.metadata_name(),
            propagation: None,
            uid: dup["metadata"]["uid"].as_str().map(str::to_owned),
        });
    }
    if !writes.is_empty() {
        for result in client::batch(writes)? {
            match result {
                Ok(_) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(format!("delete a duplicate revision: {e}")),
            }
        }
    }
    let hash = match current.into_iter().next() {
        Some(cur) => {
            let hash = cur["metadata"]["labels"][HASH_LABEL]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            // A rollback to an old template: its revision becomes the newest.
            if revision_number(&cur) < max {
                renumber(ns, &cur, max + 1)?;
            }
            hash
        }
        None => snapshot(ds, &patch, max + 1)?,
    };
    Ok(History { hash, old })
}

/// Gives a revision a new number. Kubernetes lets `revision` change (only `data`
/// is immutable); a server that refuses the change (422) gets the revision made
/// again under its name with the new number.
fn renumber(ns: Option<&str>, cur: &Value, revision: i64) -> Result<(), String> {
    let name = cur.metadata_name();
    let patched = client::patch(
        &revisions(),
        ns,
        &name,
        trellis_plugin::controller::PatchType::Merge,
        json!({"revision": revision}),
        false,
    );
    match patched {
        Ok(_) => Ok(()),
        Err(e) if e.code == 422 => {
            client::delete(&revisions(), ns, &name, None)
                .map_err(|e| format!("renumber revision {name}: {e}"))?;
            let mut again = cur.clone();
            let metadata = again["metadata"].as_object_mut().ok_or("no metadata")?;
            metadata.retain(|k, _| {
                matches!(
                    k.as_str(),
                    "name" | "labels" | "annotations" | "ownerReferences"
                )
            });
            again["revision"] = json!(revision);
            client::create(&revisions(), ns, again)
                .map_err(|e| format!("renumber revision {name}: {e}"))?;
            Ok(())
        }
        Err(e) => Err(format!("renumber revision {name}: {e}")),
    }
}

trait Named {
    fn metadata_name(&self) -> String;
}

impl Named for Value {
    fn metadata_name(&self) -> String {
        self["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

/// Creates the revision of the current template; its hash.
fn snapshot(ds: &Value, patch: &Value, revision: i64) -> Result<String, String> {
    let ns = ds["metadata"]["namespace"].as_str();
    let collision_count = ds["status"]["collisionCount"].as_i64();
    let hash = template_hash(&ds["spec"]["template"], collision_count);
    let name = revision_name(ds["metadata"]["name"].as_str().unwrap_or_default(), &hash);
    let mut labels = ds["spec"]["template"]["metadata"]["labels"].clone();
    if !labels.is_object() {
        labels = json!({});
    }
    labels[HASH_LABEL] = json!(hash);
    let mut metadata = json!({
        "name": name,
        "labels": labels,
        "ownerReferences": [owned::controller_reference("apps/v1", "DaemonSet", ds)],
    });
    // The DaemonSet's annotations (its change-cause) are what `rollout history` shows.
    if let Some(a) = ds["metadata"]["annotations"].as_object() {
        let mut a = a.clone();
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
        if !a.is_empty() {
            metadata["annotations"] = Value::Object(a);
        }
    }
    let revision = json!({
        "apiVersion": "apps/v1",
        "kind": "ControllerRevision",
        "metadata": metadata,
        "data": patch,
        "revision": revision,
    });
    match client::create(&revisions(), ns, revision) {
        Ok(_) => Ok(hash),
        Err(e) if e.reason == "AlreadyExists" => {
            // Ours with this very template (the cache had not seen it yet): use it.
            let existing = client::read(&revisions(), ns, &name).map_err(|e| e.to_string())?;
            let uid = ds["metadata"]["uid"].as_str().unwrap_or_default();
            if let Some(existing) = existing
                && owned::is_controlled_by(&existing, uid)
                && existing["data"] == *patch
            {
                return Ok(hash);
            }
            // Someone else's: another hash next time.
            let count = collision_count.unwrap_or(0) + 1;
            client::patch_status(
                &super::daemonsets(),
                ns,
                ds["metadata"]["name"].as_str().unwrap_or_default(),
                json!({"collisionCount": count}),
            )
            .map_err(|e| format!("update the collision count: {e}"))?;
            Err(format!(
                "controller revision {name} exists and is not this DaemonSet's: collision count now {count}"
            ))
        }
        Err(e) => Err(format!("create revision {name}: {e}")),
    }
}

/// Deletes the oldest revisions beyond `revisionHistoryLimit` (default 10) that no
/// live pod still runs.
pub fn cleanup(ds: &Value, old: &[Value], live_hashes: &[&str]) -> Result<(), String> {
    let limit = ds["spec"]["revisionHistoryLimit"]
        .as_i64()
        .unwrap_or(10)
        .max(0) as usize;
    let mut deletable: Vec<&Value> = old
        .iter()
        .filter(|r| {
            let hash = r["metadata"]["labels"][HASH_LABEL]
                .as_str()
                .unwrap_or_default();
            !live_hashes.contains(&hash) && r["metadata"]["deletionTimestamp"].is_null()
        })
        .collect();
    if deletable.len() <= limit {
        return Ok(());
    }
    deletable.sort_by_key(|r| revision_number(r));
    let extra = deletable.len() - limit;
    let writes = deletable[..extra]
        .iter()
        .map(|r| Write::Delete {
            resource: revisions(),
            namespace: ds["metadata"]["namespace"].as_str().map(str::to_owned),
            name: r.metadata_name(),
            propagation: None,
            uid: r["metadata"]["uid"].as_str().map(str::to_owned),
        })
        .collect();
    for result in client::batch(writes)? {
        match result {
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(format!("delete an old revision: {e}")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_patch_replaces_the_template_and_the_hash_is_stable() {
        let ds = json!({"spec": {"template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": []}}}});
        let patch = patch_of(&ds);
        assert_eq!(patch["spec"]["template"]["$patch"], "replace");
        assert_eq!(patch["spec"]["template"]["metadata"]["labels"]["a"], "b");
        let t = &ds["spec"]["template"];
        assert_eq!(template_hash(t, None), template_hash(&t.clone(), None));
        assert_ne!(template_hash(t, None), template_hash(t, Some(1)));
        assert_eq!(revision_name("ds", "abc"), "ds-abc");
        assert_eq!(revision_name(&"x".repeat(300), "h").len(), 225);
    }
}
