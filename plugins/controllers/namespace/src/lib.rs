//! The namespace controller, as Kubernetes' behaves: a namespace being deleted (it
//! has a `deletionTimestamp` and the `kubernetes` finalizer in `spec.finalizers`) is
//! emptied of every namespaced object, of every resource the API server serves; what
//! has finalizers is waited for; then the finalizer comes off through
//! `namespaces/NAME/finalize` and the API server removes the namespace.
//!
//! Its state is the cluster's: a controller that restarts halfway finds the
//! namespace still terminating and goes on. The status carries the conditions
//! Kubernetes reports (`NamespaceDeletionDiscoveryFailure`,
//! `NamespaceDeletionGroupVersionParsingFailure`, `NamespaceDeletionContentFailure`,
//! `NamespaceContentRemaining`, `NamespaceFinalizersRemaining`). The host brings the
//! key back whenever something in the namespace is removed or loses a finalizer.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::controller::{
    Action, ObjectKey, PatchType, Propagation, Reconcile, Write, cache, client, time,
};

pub const FINALIZER: &str = "kubernetes";

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Namespaces {
    /// How soon a namespace that waits on content is looked at again, besides the
    /// removals that bring it back.
    #[serde(default = "default_recheck")]
    recheck_seconds: u64,
}

fn default_recheck() -> u64 {
    15
}

/// What is left in a namespace after a pass.
#[derive(Debug, Default)]
pub struct Remaining {
    /// Objects per resource (`configmaps`, `widgets.example.com`).
    pub by_resource: BTreeMap<String, usize>,
    /// Objects held by each finalizer.
    pub by_finalizer: BTreeMap<String, usize>,
    /// Deletes that failed.
    pub failures: Vec<String>,
}

fn condition(kind: &str, failing: bool, reason: &str, message: &str, now: &str) -> Value {
    json!({
        "type": kind,
        "status": if failing { "True" } else { "False" },
        "reason": reason,
        "message": message,
        "lastTransitionTime": now,
    })
}

/// The conditions Kubernetes reports on a namespace being deleted.
pub fn conditions(remaining: &Remaining, now: &str) -> Vec<Value> {
    let listed = |m: &BTreeMap<String, usize>, what: &str| {
        m.iter()
            .map(|(k, n)| format!("{k} has {n} {what}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    vec![
        condition(
            "NamespaceDeletionDiscoveryFailure",
            false,
            "ResourcesDiscovered",
            "All resources successfully discovered",
            now,
        ),
        condition(
            "NamespaceDeletionGroupVersionParsingFailure",
            false,
            "ParsedGroupVersions",
            "All legacy kube types successfully parsed",
            now,
        ),
        if remaining.failures.is_empty() {
            condition(
                "NamespaceDeletionContentFailure",
                false,
                "ContentDeleted",
                "All content successfully deleted, may be waiting on finalization",
                now,
            )
        } else {
            condition(
                "NamespaceDeletionContentFailure",
                true,
                "ContentDeletionFailed",
                &format!(
                    "Failed to delete all resource types, {} remaining: {}",
                    remaining.failures.len(),
                    remaining.failures.join(", ")
                ),
                now,
            )
        },
        if remaining.by_resource.is_empty() {
            condition(
                "NamespaceContentRemaining",
                false,
                "ContentRemoved",
                "All content successfully removed",
                now,
            )
        } else {
            condition(
                "NamespaceContentRemaining",
                true,
                "SomeResourcesRemain",
                &format!(
                    "Some resources are remaining: {}",
                    listed(&remaining.by_resource, "resource instances")
                ),
                now,
            )
        },
        if remaining.by_finalizer.is_empty() {
            condition(
                "NamespaceFinalizersRemaining",
                false,
                "ContentHasNoFinalizers",
                "All content-preserving finalizers finished",
                now,
            )
        } else {
            condition(
                "NamespaceFinalizersRemaining",
                true,
                "SomeFinalizersRemain",
                &format!(
                    "Some content in the namespace has finalizers remaining: {}",
                    listed(&remaining.by_finalizer, "resource instances").replace(" has ", " in ")
                ),
                now,
            )
        },
    ]
}

/// The conditions as they were, with the transition times kept where the status
/// did not change.
fn keep_transitions(previous: &Value, mut fresh: Vec<Value>) -> Vec<Value> {
    for c in &mut fresh {
        let before = previous
            .as_array()
            .and_then(|p| p.iter().find(|p| p["type"] == c["type"]));
        if let Some(before) = before
            && before["status"] == c["status"]
        {
            c["lastTransitionTime"] = before["lastTransitionTime"].clone();
        }
    }
    fresh
}

impl Reconcile for Namespaces {
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let Some(namespace) = cache::get(&key.resource, None, &key.name)? else {
            return Ok(Action::Done);
        };
        let finalizers: Vec<&str> = namespace["spec"]["finalizers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        if namespace["metadata"]["deletionTimestamp"].is_null() || !finalizers.contains(&FINALIZER)
        {
            return Ok(Action::Done);
        }
        let remaining = empty(&key.name)?;
        let now = time::format(time::now());
        let fresh = keep_transitions(
            &namespace["status"]["conditions"],
            conditions(&remaining, &now),
        );
        // The namespace as last written: the finalize below is held to its version.
        let mut current = namespace.clone();
        if fresh
            != namespace["status"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        {
            current = match client::patch(
                &key.resource,
                None,
                &key.name,
                PatchType::Merge,
                json!({"status": {"conditions": fresh}}),
                true,
            ) {
                Ok(written) => written,
                Err(e) if e.is_not_found() => return Ok(Action::Done),
                Err(e) => return Err(format!("update the status: {e}")),
            };
        }
        if !remaining.by_resource.is_empty() || !remaining.failures.is_empty() {
            return Ok(Action::RequeueAfter(Duration::from_secs(
                self.recheck_seconds,
            )));
        }
        // Empty: the finalizer comes off, and the API server removes the namespace.
        current["spec"]["finalizers"] = json!(
            finalizers
                .iter()
                .filter(|f| **f != FINALIZER)
                .collect::<Vec<_>>()
        );
        match client::update_subresource(&key.resource, None, &current, "finalize") {
            Ok(_) => Ok(Action::Done),
            Err(e) if e.is_not_found() => Ok(Action::Done),
            Err(e) => Err(format!("finalize the namespace: {e}")),
        }
    }
}

/// Deletes what is in the namespace; what is left.
fn empty(namespace: &str) -> Result<Remaining, String> {
    let mut remaining = Remaining::default();
    let mut writes = Vec::new();
    let mut names = Vec::new();
    for served in cache::resources().into_iter().filter(|r| r.namespaced) {
        let objects: Vec<Value> = cache::list_as(&served.resource, Some(namespace), "")?;
        let label = if served.resource.group.is_empty() {
            served.resource.resource.clone()
        } else {
            format!("{}.{}", served.resource.resource, served.resource.group)
        };
        for obj in objects {
            if !obj["metadata"]["deletionTimestamp"].is_null() {
                // Marked already: waiting on its finalizers.
                count(&mut remaining, &label, &obj);
                continue;
            }
            names.push(label.clone());
            writes.push(Write::Delete {
                resource: served.resource.clone(),
                namespace: Some(namespace.to_owned()),
                name: obj["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                propagation: Some(Propagation::Background),
                uid: obj["metadata"]["uid"].as_str().map(str::to_owned),
            });
        }
    }
    for (result, label) in client::batch(writes)?.into_iter().zip(names) {
        match result {
            // Held by finalizers: marked, and waited for.
            Ok(obj) if !obj["metadata"]["deletionTimestamp"].is_null() => {
                count(&mut remaining, &label, &obj);
            }
            Ok(_) => {}
            Err(e) if e.is_not_found() || e.code == 409 => {}
            Err(e) => {
                *remaining.by_resource.entry(label.clone()).or_default() += 1;
                remaining.failures.push(format!("{label}: {}", e.message));
            }
        }
    }
    Ok(remaining)
}

fn count(remaining: &mut Remaining, label: &str, obj: &Value) {
    *remaining.by_resource.entry(label.to_owned()).or_default() += 1;
    for f in obj["metadata"]["finalizers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        *remaining.by_finalizer.entry(f.to_owned()).or_default() += 1;
    }
}

trellis_plugin::controller!(Namespaces);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_say_what_remains_as_kubernetes_says_it() {
        let mut remaining = Remaining::default();
        remaining.by_resource.insert("configmaps".into(), 2);
        remaining.by_finalizer.insert("example.com/hold".into(), 1);
        let c = conditions(&remaining, "2026-01-01T00:00:00Z");
        let find = |t: &str| c.iter().find(|c| c["type"] == t).unwrap();
        assert_eq!(find("NamespaceContentRemaining")["status"], "True");
        assert_eq!(
            find("NamespaceContentRemaining")["message"],
            "Some resources are remaining: configmaps has 2 resource instances"
        );
        assert_eq!(
            find("NamespaceFinalizersRemaining")["message"],
            "Some content in the namespace has finalizers remaining: example.com/hold in 1 resource instances"
        );
        assert_eq!(find("NamespaceDeletionContentFailure")["status"], "False");
        let done = conditions(&Remaining::default(), "t");
        assert!(done.iter().all(|c| c["status"] == "False"));
    }

    #[test]
    fn transition_times_stay_while_a_status_does_not_change() {
        let before = json!([{"type": "NamespaceContentRemaining", "status": "True", "lastTransitionTime": "old"}]);
        let fresh = vec![condition(
            "NamespaceContentRemaining",
            true,
            "r",
            "m",
            "new",
        )];
        assert_eq!(
            keep_transitions(&before, fresh)[0]["lastTransitionTime"],
            "old"
        );
    }
}
