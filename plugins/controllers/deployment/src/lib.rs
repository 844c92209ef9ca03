//! The Deployment controller, as Kubernetes' behaves: a Deployment's template is
//! rolled out through ReplicaSets it owns.
//!
//! - The new ReplicaSet is the one whose template equals the Deployment's (ignoring
//!   `pod-template-hash`); it is created as `NAME-HASH` when missing, the hash being
//!   the template's (and `status.collisionCount`'s) FNV-1a hash. Its revision
//!   (`deployment.kubernetes.io/revision`) is one more than the highest of the old
//!   ones, which `kubectl rollout history|undo` read.
//! - `RollingUpdate` scales the new set up within `maxSurge` and the old ones down
//!   within `maxUnavailable` (counts or percentages, 25 % by default; surge rounds up,
//!   unavailability down, and both 0 means 1 unavailable); `Recreate` scales the old
//!   sets to 0 and waits until their pods are gone before it scales the new one.
//! - A change of `spec.replicas` mid-rollout scales the active sets proportionally.
//! - A paused Deployment is only scaled. Old sets beyond `revisionHistoryLimit` are
//!   deleted once a rollout completes.
//! - The status (replicas, updated, ready, available, unavailable, observedGeneration,
//!   collisionCount) and the `Available` and `Progressing` conditions, including
//!   `ProgressDeadlineExceeded` after `progressDeadlineSeconds`, are those `kubectl
//!   rollout status` reads.
//!
//! # Layout
//! - `lib.rs` (Kubernetes' `deployment_controller.go`): the reconcile, which claims
//!   the sets and picks the strategy, and `Pass`, one reconcile's context.
//! - `sync`: the new set and its revision, scaling, and the history's cleanup.
//! - `rolling`, `recreate`: the two strategies.
//! - `progress`: the status and its conditions.
//! - `util`: annotations, the template hash, fenceposts, and [`Set`].

use serde::Deserialize;
use serde_json::Value;
use trellis_plugin::controller::{
    Action, EventType, ObjectKey, Reconcile, cache, client, events, owned,
};

mod progress;
mod recreate;
mod rolling;
mod sync;
mod util;

pub use util::{HASH_LABEL, REVISION, Set, fenceposts, same_template, scaled, template_hash};
use util::{is_rolling, replicas_of, replicasets};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deployments {}

/// One pass's context: the Deployment, its sets, and what it decided.
struct Pass<'a> {
    key: &'a ObjectKey,
    d: Value,
    new: Option<Set>,
    old: Vec<Set>,
    /// The Progressing condition this pass sets, if any (reason, message).
    progressing: Option<(&'static str, String)>,
}

impl Reconcile for Deployments {
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let Some(d) = cache::get(&key.resource, ns, &key.name)? else {
            return Ok(Action::Done);
        };
        let selector = &d["spec"]["selector"];
        if owned::selector_is_empty(selector) {
            events::record(
                &d,
                EventType::Warning,
                "SelectingAll",
                "This deployment is selecting all pods. A non-empty selector is required.",
            );
            return Ok(Action::Done);
        }
        let sets = claim(key, &d)?;
        let template = &d["spec"]["template"];
        let mut matching: Vec<&Value> = sets
            .iter()
            .filter(|rs| same_template(&rs["spec"]["template"], template))
            .collect();
        matching.sort_by_key(|rs| rs["metadata"]["creationTimestamp"].as_str());
        let new_uid = matching
            .first()
            .map(|rs| rs["metadata"]["uid"].clone())
            .unwrap_or(Value::Null);
        let (new, old): (Vec<Set>, Vec<Set>) = sets
            .into_iter()
            .map(Set::new)
            .partition(|s| !new_uid.is_null() && s.object["metadata"]["uid"] == new_uid);
        let mut pass = Pass {
            key,
            d,
            new: new.into_iter().next(),
            old,
            progressing: None,
        };
        if !pass.d["metadata"]["deletionTimestamp"].is_null() {
            return pass.sync_status();
        }
        let paused = pass.d["spec"]["paused"] == true;
        // Recreate makes its new set only once the old pods are gone (see `recreate`).
        pass.sync_revision(!paused && is_rolling(&pass.d))?;
        if paused || pass.is_scaling_event() {
            pass.scale()?;
            if paused {
                pass.cleanup()?;
            }
            return pass.sync_status();
        }
        if is_rolling(&pass.d) {
            pass.rolling()
        } else {
            pass.recreate()
        }
    }
}

/// The Deployment's ReplicaSets: those it controls, plus orphans matching its
/// selector (adopted), minus those that stopped matching (released).
fn claim(key: &ObjectKey, d: &Value) -> Result<Vec<Value>, String> {
    let ns = key.namespace.as_deref();
    let uid = d["metadata"]["uid"].as_str().unwrap_or_default();
    let selector = &d["spec"]["selector"];
    let deleting = !d["metadata"]["deletionTimestamp"].is_null();
    let mut mine = Vec::new();
    let mut writes = Vec::new();
    let matching: Vec<Value> =
        cache::list_as(&replicasets(), ns, &owned::selector_string(selector)?)?;
    for rs in matching {
        match owned::controller_of(&rs).map(|r| r["uid"].clone()) {
            Some(c) if c == uid => mine.push(rs),
            Some(_) => {}
            None if !deleting && rs["metadata"]["deletionTimestamp"].is_null() => {
                writes.push(owned::adopt(
                    &replicasets(),
                    ns,
                    &rs,
                    owned::controller_reference("apps/v1", "Deployment", d),
                ));
                mine.push(rs);
            }
            None => {}
        }
    }
    let owned_sets: Vec<Value> = cache::owned_by_as(&replicasets(), uid)?;
    for rs in owned_sets {
        if owned::is_controlled_by(&rs, uid)
            && !owned::selector_matches(selector, &rs["metadata"]["labels"])
        {
            writes.push(owned::release(&replicasets(), ns, &rs, uid));
        }
    }
    if !writes.is_empty() {
        for result in client::batch(writes)? {
            match result {
                Ok(_) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(format!("claim a ReplicaSet: {e}")),
            }
        }
    }
    Ok(mine)
}

impl Pass<'_> {
    fn ns(&self) -> Option<&str> {
        self.key.namespace.as_deref()
    }

    fn replicas(&self) -> i64 {
        replicas_of(&self.d)
    }

    fn all(&self) -> impl Iterator<Item = &Set> {
        self.new.iter().chain(&self.old)
    }

    fn max_surge(&self) -> Result<i64, String> {
        if is_rolling(&self.d) {
            Ok(fenceposts(&self.d)?.0)
        } else {
            Ok(0)
        }
    }

    fn sets(&self) -> Vec<Which> {
        self.new
            .iter()
            .map(|_| Which::New)
            .chain((0..self.old.len()).map(Which::Old))
            .collect()
    }

    fn get(&self, w: Which) -> &Set {
        match w {
            Which::New => self.new.as_ref().expect("the new set"),
            Which::Old(i) => &self.old[i],
        }
    }

    fn latest_old(&self) -> Option<Which> {
        (0..self.old.len())
            .max_by(|a, b| self.old[*a].created.cmp(&self.old[*b].created))
            .map(Which::Old)
    }
}

/// One of a pass's sets: the new one, or an old one by its index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Which {
    New,
    Old(usize),
}

trellis_plugin::controller!(Deployments);

#[cfg(test)]
mod tests {
    use serde_json::json;
    use trellis_plugin::GroupVersionResource;
    use trellis_plugin::controller::Write;
    use trellis_plugin::testing::ControllerHarness;

    use super::*;
    use crate::util::{DESIRED_REPLICAS, MAX_REPLICAS};

    fn deployments() -> GroupVersionResource {
        GroupVersionResource {
            group: "apps".into(),
            version: "v1".into(),
            resource: "deployments".into(),
        }
    }

    fn template(image: &str) -> Value {
        json!({"metadata": {"labels": {"app": "web"}},
               "spec": {"containers": [{"name": "c", "image": image}]}})
    }

    fn deployment(replicas: i64, image: &str, strategy: Value) -> Value {
        json!({"metadata": {"name": "web", "namespace": "ns", "uid": "d-uid", "generation": 2},
               "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
                        "template": template(image), "strategy": strategy}})
    }

    /// A ReplicaSet of the Deployment for `image`, with its pods all available.
    fn set(name: &str, image: &str, replicas: i64, revision: i64, annotations: Value) -> Value {
        let mut t = template(image);
        t["metadata"]["labels"][HASH_LABEL] = json!(name);
        let mut annotations = annotations;
        annotations[REVISION] = json!(revision.to_string());
        json!({"metadata": {"name": name, "namespace": "ns", "uid": format!("{name}-uid"),
                            "labels": {"app": "web"}, "annotations": annotations,
                            "creationTimestamp": format!("2026-01-0{revision}T00:00:00Z"),
                            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                "name": "web", "uid": "d-uid", "controller": true}]},
               "spec": {"replicas": replicas, "template": t},
               "status": {"replicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas}})
    }

    fn replicas_of_set(h: &ControllerHarness, name: &str) -> i64 {
        h.object(&replicasets(), Some("ns"), name).unwrap()["spec"]["replicas"]
            .as_i64()
            .unwrap()
    }

    #[test]
    fn recreate_scales_the_old_set_to_zero_and_waits_for_its_pods_before_the_new() {
        let h = ControllerHarness::new()
            .with_object(
                deployments(),
                deployment(3, "v2", json!({"type": "Recreate"})),
            )
            .with_object(replicasets(), set("old", "v1", 3, 1, json!({})));
        h.reconcile::<Deployments>(&deployments(), Some("ns"), "web")
            .unwrap();
        assert_eq!(replicas_of_set(&h, "old"), 0);
        let sets = h
            .writes()
            .iter()
            .filter(|w| matches!(w, Write::Create { .. }))
            .count();
        assert_eq!(sets, 0, "a new set before the old pods are gone");
        // Its pods gone (status replicas 0): now the new set, at full size.
        let mut old = h.object(&replicasets(), Some("ns"), "old").unwrap();
        old["status"] = json!({"replicas": 0});
        let h = h.with_object(replicasets(), old);
        h.reconcile::<Deployments>(&deployments(), Some("ns"), "web")
            .unwrap();
        let created = h
            .writes()
            .into_iter()
            .find_map(|w| match w {
                Write::Create { object, .. } => Some(object),
                _ => None,
            })
            .expect("the new set");
        assert_eq!(created["spec"]["replicas"], 3);
        assert_eq!(created["metadata"]["annotations"][REVISION], "2");
    }

    #[test]
    fn a_resize_mid_rollout_is_shared_in_proportion() {
        let sized = json!({DESIRED_REPLICAS: "10", MAX_REPLICAS: "13"});
        let strategy = json!({"type": "RollingUpdate",
                              "rollingUpdate": {"maxSurge": 3, "maxUnavailable": 2}});
        let h = ControllerHarness::new()
            .with_object(deployments(), deployment(20, "v2", strategy))
            .with_object(replicasets(), set("old", "v1", 8, 1, sized.clone()))
            .with_object(replicasets(), set("new", "v2", 5, 2, sized));
        h.reconcile::<Deployments>(&deployments(), Some("ns"), "web")
            .unwrap();
        let (old, new) = (replicas_of_set(&h, "old"), replicas_of_set(&h, "new"));
        // 13 pods for a Deployment of 10 (+3) become 23 for 20 (+3), in proportion.
        assert_eq!(old + new, 23, "old {old}, new {new}");
        assert_eq!((old, new), (14, 9));
    }

    #[test]
    fn a_paused_deployment_gets_no_new_set_and_says_it_is_paused() {
        let mut d = deployment(3, "v2", json!({"type": "RollingUpdate"}));
        d["spec"]["paused"] = json!(true);
        let h = ControllerHarness::new()
            .with_object(deployments(), d)
            .with_object(
                replicasets(),
                set("old", "v1", 3, 1, json!({DESIRED_REPLICAS: "3"})),
            );
        h.reconcile::<Deployments>(&deployments(), Some("ns"), "web")
            .unwrap();
        assert!(!h.writes().iter().any(|w| matches!(w, Write::Create { .. })));
        let d = h.object(&deployments(), Some("ns"), "web").unwrap();
        let progressing = d["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Progressing")
            .unwrap()
            .clone();
        assert_eq!(progressing["reason"], "DeploymentPaused");
        assert_eq!(progressing["status"], "Unknown");
    }
}
