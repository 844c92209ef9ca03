//! The disruption controller, as Kubernetes' behaves: each PodDisruptionBudget's
//! status says how many of its pods may be disrupted now (`disruptionsAllowed`),
//! which preemption and evictions read.
//!
//! - The budget's pods are those of its namespace its selector matches (an empty
//!   selector matches all of them, as in `policy/v1`).
//! - `minAvailable` as a number: the pods expected are the pods found, and that many
//!   must be healthy. `minAvailable` as a percentage, or `maxUnavailable`: the pods
//!   expected are the replicas their controllers ask for (a Deployment's, else a
//!   ReplicaSet's; a ReplicationController's; a StatefulSet's), each controller
//!   counted once; percentages round up.
//! - Healthy: Ready and not being deleted. `disruptionsAllowed` is the healthy
//!   beyond those desired, never below 0; the `DisruptionAllowed` condition says
//!   whether it is above 0 (`SufficientPods`, `InsufficientPods`).
//! - A budget whose pods have no controller while it needs their scale says why
//!   in a `SyncFailed` condition and a `NoControllers` event, and allows nothing.
//! - `disruptedPods` (written by the API server's eviction) keeps the pods evicted
//!   but not yet being deleted, for two minutes at most; they do not count as
//!   healthy meanwhile, so two evictions never spend the same disruption.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{
    Action, EventType, ObjectKey, Reconcile, cache, client, events, owned, time,
};

/// How long an eviction's entry in `disruptedPods` waits for its pod's deletion to
/// show (Kubernetes' `DeletionTimeout`).
const DELETION_TIMEOUT: i64 = 120;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Disruption {}

fn gvr(group: &str, resource: &str) -> GroupVersionResource {
    GroupVersionResource {
        group: group.into(),
        version: "v1".into(),
        resource: resource.into(),
    }
}

/// What the controller reads of a pod.
#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct Pod {
    metadata: Meta,
    status: PodStatus,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct Meta {
    name: String,
    owner_references: Vec<Value>,
    deletion_timestamp: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PodStatus {
    conditions: Vec<Value>,
}

impl Pod {
    fn is_healthy(&self) -> bool {
        self.metadata.deletion_timestamp.is_none()
            && self
                .status
                .conditions
                .iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
    }

    fn controller(&self) -> Option<&Value> {
        self.metadata
            .owner_references
            .iter()
            .find(|r| r["controller"] == true)
    }
}

/// An `IntOrString` count: a number, or a percentage of `total` rounded up.
fn scaled(value: &Value, total: i64) -> Result<i64, String> {
    if let Some(n) = value.as_i64() {
        return Ok(n);
    }
    let text = value.as_str().unwrap_or_default();
    let percent: i64 = text
        .strip_suffix('%')
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| format!("{value}: not a number or a percentage"))?;
    Ok((percent * total + 99) / 100)
}

/// The replicas the pods' controllers ask for, each controller once: a
/// ReplicaSet's Deployment if it has one, else the ReplicaSet.
fn expected_scale(namespace: &str, pods: &[Pod]) -> Result<i64, String> {
    let mut scales: BTreeMap<String, i64> = BTreeMap::new();
    for pod in pods {
        let Some(owner) = pod.controller() else {
            return Err(format!(
                "found no controller for pod {:?}",
                pod.metadata.name
            ));
        };
        let (kind, name) = (
            owner["kind"].as_str().unwrap_or_default(),
            owner["name"].as_str().unwrap_or_default(),
        );
        let uid = owner["uid"].as_str().unwrap_or_default().to_owned();
        if scales.contains_key(&uid) {
            continue;
        }
        let (uid, replicas) = match kind {
            "ReplicaSet" => {
                let rs = cache::get(&gvr("apps", "replicasets"), Some(namespace), name)?
                    .ok_or_else(|| format!("replicaset {name:?} not found"))?;
                let deployment = rs["metadata"]["ownerReferences"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|r| r["controller"] == true && r["kind"] == "Deployment")
                    .and_then(|r| r["name"].as_str())
                    .map(|d| cache::get(&gvr("apps", "deployments"), Some(namespace), d))
                    .transpose()?
                    .flatten();
                match deployment {
                    Some(d) => (
                        d["metadata"]["uid"].as_str().unwrap_or_default().to_owned(),
                        d["spec"]["replicas"].as_i64().unwrap_or(1),
                    ),
                    None => (uid, rs["spec"]["replicas"].as_i64().unwrap_or(1)),
                }
            }
            "StatefulSet" | "Deployment" | "ReplicationController" => {
                let resource = match kind {
                    "StatefulSet" => gvr("apps", "statefulsets"),
                    "Deployment" => gvr("apps", "deployments"),
                    _ => gvr("", "replicationcontrollers"),
                };
                // The controller of that name must be the one the pod names (a
                // new object of an old name is not its controller).
                let owner = cache::get(&resource, Some(namespace), name)?
                    .filter(|o| o["metadata"]["uid"].as_str() == Some(uid.as_str()))
                    .ok_or_else(|| format!("{} {name:?} not found", kind.to_lowercase()))?;
                (uid, owner["spec"]["replicas"].as_i64().unwrap_or(1))
            }
            other => {
                return Err(format!(
                    "pod {:?}: controller kind {other} has no scale",
                    pod.metadata.name
                ));
            }
        };
        scales.insert(uid, replicas);
    }
    Ok(scales.values().sum())
}

/// `(expectedPods, desiredHealthy)` of a budget over its pods.
fn expectations(namespace: &str, spec: &Value, pods: &[Pod]) -> Result<(i64, i64), String> {
    if let Some(max) = spec.get("maxUnavailable").filter(|v| !v.is_null()) {
        let expected = expected_scale(namespace, pods)?;
        let max = scaled(max, expected)?;
        return Ok((expected, (expected - max).max(0)));
    }
    match spec.get("minAvailable").filter(|v| !v.is_null()) {
        Some(min) if min.is_i64() => Ok((pods.len() as i64, min.as_i64().unwrap_or(0))),
        Some(min) => {
            let expected = expected_scale(namespace, pods)?;
            Ok((expected, scaled(min, expected)?))
        }
        // Neither: Kubernetes defaults minAvailable to 1.
        None => Ok((pods.len() as i64, 1)),
    }
}

/// The `DisruptionAllowed` condition, keeping its transition time while its
/// status holds.
fn condition(old: &Value, status: &str, reason: &str, message: &str) -> Value {
    let previous = old["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "DisruptionAllowed");
    let since = previous
        .filter(|c| c["status"] == status)
        .and_then(|c| c["lastTransitionTime"].as_str())
        .map_or_else(|| time::format(time::now()), str::to_owned);
    json!({"type": "DisruptionAllowed", "status": status, "reason": reason,
        "message": message, "lastTransitionTime": since})
}

impl Reconcile for Disruption {
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let Some(pdb) = cache::get(&key.resource, ns, &key.name)? else {
            return Ok(Action::Done);
        };
        let namespace = ns.unwrap_or_default();
        let selector = &pdb["spec"]["selector"];
        // policy/v1: a null selector selects nothing, an empty one everything.
        let pods: Vec<Pod> = if selector.is_null() {
            Vec::new()
        } else {
            cache::list_as(&gvr("", "pods"), ns, &owned::selector_string(selector)?)?
        };
        let old = &pdb["status"];
        let generation = pdb["metadata"]["generation"].clone();
        // Evicted pods whose deletion has not shown yet, until the timeout.
        let now = time::now();
        let mut disrupted = serde_json::Map::new();
        let mut recheck: Option<i64> = None;
        for (name, at) in old["disruptedPods"].as_object().into_iter().flatten() {
            let Some(since) = at.as_str().and_then(time::parse) else {
                continue;
            };
            let pending = pods
                .iter()
                .any(|p| p.metadata.name == *name && p.metadata.deletion_timestamp.is_none());
            if pending && since + DELETION_TIMEOUT > now {
                disrupted.insert(name.clone(), at.clone());
                let left = since + DELETION_TIMEOUT - now;
                recheck = Some(recheck.map_or(left, |r| r.min(left)));
            }
        }
        let healthy = pods
            .iter()
            .filter(|p| p.is_healthy() && !disrupted.contains_key(&p.metadata.name))
            .count() as i64;
        let status = match expectations(namespace, &pdb["spec"], &pods) {
            Ok((expected, desired)) => {
                let allowed = if expected > 0 {
                    (healthy - desired).max(0)
                } else {
                    0
                };
                let (state, reason) = if allowed > 0 {
                    ("True", "SufficientPods")
                } else {
                    ("False", "InsufficientPods")
                };
                json!({"observedGeneration": generation, "disruptionsAllowed": allowed,
                    "currentHealthy": healthy, "desiredHealthy": desired,
                    "expectedPods": expected, "disruptedPods": disrupted,
                    "conditions": [condition(old, state, reason, "")]})
            }
            Err(message) => {
                if old["conditions"][0]["reason"] != "SyncFailed" {
                    events::record(&pdb, EventType::Warning, "NoControllers", &message);
                }
                json!({"observedGeneration": generation, "disruptionsAllowed": 0,
                    "currentHealthy": healthy, "desiredHealthy": 0, "expectedPods": 0,
                    "conditions": [condition(old, "False", "SyncFailed", &message)]})
            }
        };
        if status != *old {
            // A merge patch keeps the keys it does not name: the dropped entries of
            // disruptedPods are named null.
            let mut patch = status;
            for name in old["disruptedPods"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, _)| k)
            {
                if !disrupted.contains_key(name) {
                    patch["disruptedPods"][name] = Value::Null;
                }
            }
            // Pinned to the budget this pass read: an eviction that spent a
            // disruption since makes the write conflict (and the key come back),
            // rather than be overwritten, so no disruption is spent twice.
            match client::patch(
                &key.resource,
                ns,
                &key.name,
                trellis_plugin::controller::PatchType::Merge,
                json!({"metadata": {"resourceVersion": pdb["metadata"]["resourceVersion"]},
                    "status": patch}),
                true,
            ) {
                Ok(_) => {}
                // Deleted meanwhile: nothing left to report on.
                Err(e) if e.is_not_found() => return Ok(Action::Done),
                Err(e) => return Err(format!("update the status: {e}")),
            }
        }
        Ok(recheck.map_or(Action::Done, |secs| {
            Action::RequeueAfter(std::time::Duration::from_secs(secs.max(1) as u64))
        }))
    }
}

trellis_plugin::controller!(Disruption);

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_plugin::testing::ControllerHarness;

    fn pod(name: &str, ready: bool, owner: Option<(&str, &str)>) -> Value {
        let mut pod = json!({"metadata": {"name": name, "namespace": "ns", "labels": {"app": "web"}},
            "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}});
        if let Some((kind, name)) = owner {
            pod["metadata"]["ownerReferences"] = json!([{"kind": kind, "name": name, "uid": format!("{name}-uid"), "controller": true}]);
        }
        pod
    }

    fn budget(spec: Value) -> Value {
        let mut spec = spec;
        spec["selector"] = json!({"matchLabels": {"app": "web"}});
        json!({"metadata": {"name": "b", "namespace": "ns", "generation": 2}, "spec": spec})
    }

    fn status(harness: &ControllerHarness) -> Value {
        harness
            .object(&gvr("policy", "poddisruptionbudgets"), Some("ns"), "b")
            .unwrap()["status"]
            .clone()
    }

    fn run(spec: Value, pods: Vec<Value>, extra: Vec<(GroupVersionResource, Value)>) -> Value {
        let mut harness = ControllerHarness::new()
            .with_object(gvr("policy", "poddisruptionbudgets"), budget(spec));
        for p in pods {
            harness = harness.with_object(gvr("", "pods"), p);
        }
        for (r, o) in extra {
            harness = harness.with_object(r, o);
        }
        harness
            .reconcile::<Disruption>(&gvr("policy", "poddisruptionbudgets"), Some("ns"), "b")
            .unwrap();
        status(&harness)
    }

    #[test]
    fn min_available_as_a_number_counts_the_pods_found() {
        let s = run(
            json!({"minAvailable": 2}),
            vec![
                pod("a", true, None),
                pod("b", true, None),
                pod("c", true, None),
                pod("d", false, None),
            ],
            vec![],
        );
        assert_eq!(s["expectedPods"], 4);
        assert_eq!(s["currentHealthy"], 3);
        assert_eq!(s["desiredHealthy"], 2);
        assert_eq!(s["disruptionsAllowed"], 1);
        assert_eq!(s["observedGeneration"], 2);
        assert_eq!(s["conditions"][0]["reason"], "SufficientPods");
    }

    #[test]
    fn max_unavailable_uses_the_deployments_scale_and_rounds_up() {
        let rs = json!({"metadata": {"name": "web-1", "namespace": "ns", "ownerReferences":
            [{"kind": "Deployment", "name": "web", "uid": "web-uid", "controller": true}]},
            "spec": {"replicas": 3}});
        let deployment = json!({"metadata": {"name": "web", "namespace": "ns", "uid": "web-uid"},
            "spec": {"replicas": 4}});
        let extra = vec![
            (gvr("apps", "replicasets"), rs),
            (gvr("apps", "deployments"), deployment),
        ];
        let pods = vec![
            pod("a", true, Some(("ReplicaSet", "web-1"))),
            pod("b", true, Some(("ReplicaSet", "web-1"))),
            pod("c", true, Some(("ReplicaSet", "web-1"))),
        ];
        // 25 % of 4 is 1: 3 desired, 3 healthy, nothing to spare.
        let s = run(json!({"maxUnavailable": "25%"}), pods, extra);
        assert_eq!(s["expectedPods"], 4);
        assert_eq!(s["desiredHealthy"], 3);
        assert_eq!(s["disruptionsAllowed"], 0);
        assert_eq!(s["conditions"][0]["status"], "False");
        assert_eq!(s["conditions"][0]["reason"], "InsufficientPods");
    }

    #[test]
    fn the_scale_of_statefulsets_and_replication_controllers_counts_once_each() {
        let sts = json!({"metadata": {"name": "db", "namespace": "ns", "uid": "db-uid"},
            "spec": {"replicas": 3}});
        let rc = json!({"metadata": {"name": "old", "namespace": "ns", "uid": "old-uid"},
            "spec": {"replicas": 5}});
        let extra = vec![
            (gvr("apps", "statefulsets"), sts),
            (gvr("", "replicationcontrollers"), rc),
        ];
        let pods = vec![
            pod("db-0", true, Some(("StatefulSet", "db"))),
            pod("db-1", true, Some(("StatefulSet", "db"))),
            pod("old-a", true, Some(("ReplicationController", "old"))),
        ];
        let s = run(json!({"maxUnavailable": 1}), pods, extra);
        assert_eq!(s["expectedPods"], 8);
        assert_eq!(s["desiredHealthy"], 7);
        assert_eq!(s["disruptionsAllowed"], 0);
    }

    #[test]
    fn a_controller_of_the_name_but_another_uid_is_not_the_pods() {
        let sts = json!({"metadata": {"name": "db", "namespace": "ns", "uid": "new-uid"},
            "spec": {"replicas": 3}});
        let pods = vec![pod("db-0", true, Some(("StatefulSet", "db")))];
        let s = run(
            json!({"maxUnavailable": 1}),
            pods,
            vec![(gvr("apps", "statefulsets"), sts)],
        );
        assert_eq!(s["disruptionsAllowed"], 0);
        assert_eq!(s["conditions"][0]["reason"], "SyncFailed");
    }

    #[test]
    fn an_evicted_pod_not_yet_deleting_is_not_healthy_until_the_timeout() {
        let mut harness = ControllerHarness::new();
        let mut pdb = budget(json!({"minAvailable": 1}));
        pdb["status"] = json!({"disruptedPods": {
            "a": time::format(time::now() - 10),
            "b": time::format(time::now() - 10),
            "c": time::format(time::now() - 600),
        }});
        harness = harness.with_object(gvr("policy", "poddisruptionbudgets"), pdb);
        let mut deleting = pod("b", true, None);
        deleting["metadata"]["deletionTimestamp"] = json!(time::format(time::now()));
        for p in [pod("a", true, None), deleting, pod("c", true, None)] {
            harness = harness.with_object(gvr("", "pods"), p);
        }
        let action = harness
            .reconcile::<Disruption>(&gvr("policy", "poddisruptionbudgets"), Some("ns"), "b")
            .unwrap();
        let s = status(&harness);
        // a: evicted 10 s ago, still there: kept, not healthy. b: being deleted, so
        // neither healthy nor kept. c: past the timeout, healthy again.
        assert_eq!(s["disruptedPods"].as_object().unwrap().len(), 1, "{s}");
        assert!(s["disruptedPods"].get("a").is_some());
        assert_eq!(s["currentHealthy"], 1);
        assert_eq!(s["disruptionsAllowed"], 0);
        assert!(matches!(action, Action::RequeueAfter(d) if d.as_secs() <= 110));
    }

    #[test]
    fn a_percentage_without_controllers_fails_and_allows_nothing() {
        let s = run(
            json!({"minAvailable": "50%"}),
            vec![pod("a", true, None)],
            vec![],
        );
        assert_eq!(s["disruptionsAllowed"], 0);
        assert_eq!(s["conditions"][0]["reason"], "SyncFailed");
        assert!(
            s["conditions"][0]["message"]
                .as_str()
                .unwrap()
                .contains("no controller")
        );
    }
}
