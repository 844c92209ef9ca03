//! ControllerRevisions of a StatefulSet (Kubernetes' `history` package): each holds
//! a template as the patch that puts it back (`{"spec": {"template": {...,
//! "$patch": "replace"}}}`, what `kubectl rollout undo` applies), is named
//! `<set>-<hash>` and numbered; the current and update revisions are found or made
//! from them, and the oldest unused beyond the history limit go.

use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{ApiError, Write, cache, client, owned};

/// The label that holds a revision's hash.
pub const HASH_LABEL: &str = "controller.kubernetes.io/hash";
/// The label that names a pod's revision (the revision's name).
pub const POD_REVISION_LABEL: &str = "controller-revision-hash";

pub fn controllerrevisions() -> GroupVersionResource {
    GroupVersionResource {
        group: "apps".into(),
        version: "v1".into(),
        resource: "controllerrevisions".into(),
    }
}

/// FNV-1, 32 bits (Go's `fnv.New32`, which the revision hash uses).
fn fnv32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |h, b| {
        h.wrapping_mul(0x0100_0193) ^ u32::from(*b)
    })
}

/// The hash of a revision's data and collision count, spelled as Kubernetes'
/// `rand.SafeEncodeString` spells it: digits mapped to letters and digits that make
/// no words.
pub fn hash(data: &Value, collision_count: i64) -> String {
    const ALPHANUMS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut text = data.to_string();
    text.push_str(&collision_count.to_string());
    fnv32(text.as_bytes())
        .to_string()
        .bytes()
        .map(|b| char::from(ALPHANUMS[usize::from(b) % ALPHANUMS.len()]))
        .collect()
}

/// The patch a revision holds for the set's template.
pub fn data_of(set: &Value) -> Value {
    let mut template = set["spec"]["template"].clone();
    if template.is_object() {
        template["$patch"] = json!("replace");
    }
    json!({"spec": {"template": template}})
}

/// The template a revision holds.
pub fn template_of(revision: &Value) -> Value {
    let mut template = revision["data"]["spec"]["template"].clone();
    if let Some(t) = template.as_object_mut() {
        t.remove("$patch");
    }
    template
}

pub fn number(revision: &Value) -> i64 {
    revision["revision"].as_i64().unwrap_or(0)
}

pub fn name(revision: &Value) -> &str {
    revision["metadata"]["name"].as_str().unwrap_or_default()
}

/// What the pass works with: the revisions (oldest first), the current and the
/// update revision's names, and the collision count.
pub struct Revisions {
    pub all: Vec<Value>,
    pub current: Value,
    pub update: Value,
    pub collision_count: i64,
}

/// Finds or makes the revision of the set's template (the update revision) and
/// finds the current one (`status.currentRevision`, or the update revision when
/// there is none), as Kubernetes' `getStatefulSetRevisions`.
pub fn resolve(
    set: &Value,
    namespace: Option<&str>,
    mut all: Vec<Value>,
) -> Result<Revisions, String> {
    all.sort_by_key(number);
    let mut collision_count = set["status"]["collisionCount"].as_i64().unwrap_or(0);
    let data = data_of(set);
    let next = all.last().map_or(0, number) + 1;
    // An equal revision is reused: the latest as it is, an older one (a rollback)
    // renumbered as the newest.
    let equal = all.iter().rposition(|r| r["data"] == data);
    let update = match equal {
        Some(i) if i + 1 == all.len() => all[i].clone(),
        Some(i) => {
            let mut renumbered = all[i].clone();
            renumbered["revision"] = json!(next);
            let written = client::write(Write::Update {
                resource: controllerrevisions(),
                namespace: namespace.map(str::to_owned),
                object: renumbered,
                status: false,
            })
            .map_err(|e| format!("renumber revision {}: {e}", name(&all[i])))?;
            all.remove(i);
            all.push(written.clone());
            written
        }
        None => {
            let set_name = set["metadata"]["name"].as_str().unwrap_or_default();
            loop {
                let h = hash(&data, collision_count);
                let rev_name = format!("{set_name}-{h}");
                let mut labels = set["spec"]["template"]["metadata"]["labels"].clone();
                if !labels.is_object() {
                    labels = json!({});
                }
                labels[HASH_LABEL] = json!(h);
                let revision = json!({
                    "apiVersion": "apps/v1",
                    "kind": "ControllerRevision",
                    "metadata": {
                        "name": rev_name,
                        "labels": labels,
                        "ownerReferences": [owned::controller_reference("apps/v1", "StatefulSet", set)],
                    },
                    "data": data,
                    "revision": next,
                });
                match client::create(&controllerrevisions(), namespace, revision) {
                    Ok(created) => {
                        all.push(created.clone());
                        break created;
                    }
                    Err(e) if e.is_already_exists() => {
                        // The same template made before the cache heard of it is
                        // that revision; another one is a hash collision.
                        let existing = existing(namespace, &rev_name)?;
                        if existing.as_ref().is_some_and(|r| r["data"] == data) {
                            let existing = existing.unwrap_or_default();
                            all.push(existing.clone());
                            break existing;
                        }
                        collision_count += 1;
                    }
                    Err(e) => return Err(format!("create revision {rev_name}: {e}")),
                }
            }
        }
    };
    let current = set["status"]["currentRevision"]
        .as_str()
        .and_then(|c| all.iter().find(|r| name(r) == c))
        .cloned()
        .unwrap_or_else(|| update.clone());
    Ok(Revisions {
        all,
        current,
        update,
        collision_count,
    })
}

fn existing(namespace: Option<&str>, name: &str) -> Result<Option<Value>, String> {
    client::read(&controllerrevisions(), namespace, name).map_err(|e: ApiError| e.to_string())
}

/// Deletes the oldest revisions beyond `spec.revisionHistoryLimit` (10) that neither
/// the current nor the update revision is and no pod runs.
pub fn truncate(
    set: &Value,
    namespace: Option<&str>,
    revisions: &Revisions,
    live: &[&str],
) -> Result<(), String> {
    let limit = set["spec"]["revisionHistoryLimit"].as_i64().unwrap_or(10);
    let unused: Vec<&Value> = revisions
        .all
        .iter()
        .filter(|r| {
            let n = name(r);
            n != name(&revisions.current) && n != name(&revisions.update) && !live.contains(&n)
        })
        .collect();
    let surplus = unused
        .len()
        .saturating_sub(usize::try_from(limit.max(0)).unwrap_or(0));
    if surplus == 0 {
        return Ok(());
    }
    let writes = unused[..surplus]
        .iter()
        .map(|r| Write::Delete {
            resource: controllerrevisions(),
            namespace: namespace.map(str::to_owned),
            name: name(r).to_owned(),
            propagation: None,
            uid: r["metadata"]["uid"].as_str().map(str::to_owned),
        })
        .collect();
    for result in client::batch(writes)? {
        match result {
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(format!("delete a revision: {e}")),
        }
    }
    Ok(())
}

/// The set's revisions, from the cache: those it controls, and those its selector
/// matches that have no controller, which it adopts (as Kubernetes'
/// `ClaimControllerRevisions`).
pub fn claimed(set: &Value, namespace: Option<&str>) -> Result<Vec<Value>, String> {
    let uid = set["metadata"]["uid"].as_str().unwrap_or_default();
    let mut mine: Vec<Value> = cache::owned_by_as::<Value>(&controllerrevisions(), uid)?
        .into_iter()
        .filter(|r| owned::is_controlled_by(r, uid))
        .collect();
    if !set["metadata"]["deletionTimestamp"].is_null() {
        return Ok(mine);
    }
    let selector = owned::selector_string(&set["spec"]["selector"])?;
    let orphans: Vec<Value> =
        cache::list_as::<Value>(&controllerrevisions(), namespace, &selector)?
            .into_iter()
            .filter(|r| {
                owned::controller_of(r).is_none() && r["metadata"]["deletionTimestamp"].is_null()
            })
            .collect();
    if orphans.is_empty() {
        return Ok(mine);
    }
    let writes = orphans
        .iter()
        .map(|r| {
            owned::adopt(
                &controllerrevisions(),
                namespace,
                r,
                owned::controller_reference("apps/v1", "StatefulSet", set),
            )
        })
        .collect();
    for result in client::batch(writes)? {
        match result {
            Ok(adopted) => mine.push(adopted),
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(format!("adopt a revision: {e}")),
        }
    }
    Ok(mine)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_revision_holds_the_template_as_a_replacing_patch() {
        let set = json!({"spec": {"template": {"metadata": {"labels": {"a": "b"}}, "spec": {}}}});
        let data = data_of(&set);
        assert_eq!(data["spec"]["template"]["$patch"], "replace");
        assert_eq!(
            template_of(&json!({ "data": data })),
            set["spec"]["template"]
        );
    }

    #[test]
    fn the_hash_changes_with_the_data_and_the_collision_count() {
        let a = json!({"spec": {"template": {"x": 1}}});
        let b = json!({"spec": {"template": {"x": 2}}});
        assert_eq!(hash(&a, 0), hash(&a, 0));
        assert_ne!(hash(&a, 0), hash(&b, 0));
        assert_ne!(hash(&a, 0), hash(&a, 1));
        assert!(
            hash(&a, 0)
                .bytes()
                .all(|c| b"bcdfghjklmnpqrstvwxz2456789".contains(&c))
        );
    }
}
