//! The node lifecycle controller, as Kubernetes' behaves, for one Node per key.
//!
//! - A node is heard from through its Lease in `kube-node-lease` (renewed by its agent)
//!   and the heartbeat of its `Ready` condition. When neither is newer than the grace
//!   period (`gracePeriodSeconds`, 50 s by default), its `Ready`, `MemoryPressure`,
//!   `DiskPressure` and `PIDPressure` conditions become `Unknown` (reason
//!   `NodeStatusUnknown`).
//! - Taints follow `Ready`: `Unknown` gets `node.kubernetes.io/unreachable`, `False`
//!   gets `node.kubernetes.io/not-ready`, each NoSchedule and NoExecute; `True` has
//!   neither.
//! - Taints follow the pressure conditions too (Kubernetes' `TaintNodesByCondition`):
//!   `MemoryPressure`, `DiskPressure` and `PIDPressure` True get
//!   `node.kubernetes.io/memory-pressure`, `disk-pressure` and `pid-pressure`
//!   NoSchedule, removed once the condition is no longer True, so the scheduler sends
//!   the node no new pods while its agent evicts.
//! - The pods of a node that is not ready get `Ready` False.
//! - Taint-based eviction: a pod on a node with a NoExecute taint it does not tolerate
//!   is deleted; one that tolerates it for `tolerationSeconds` is deleted that long
//!   after the taint was added (the `DefaultTolerationSeconds` admission gives every
//!   pod 300 s); one that tolerates it without a limit stays. At most
//!   `evictionsPerPass` pods go per pass, the rest a moment later.
//! - A node is looked at again when its grace period would run out, and while it is
//!   not ready every `recheckSeconds`, for pods that arrive or whose time is up.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{
    Action, EventType, ObjectKey, PatchType, Reconcile, Write, cache, client, events, time,
};

pub const UNREACHABLE: &str = "node.kubernetes.io/unreachable";
pub const NOT_READY: &str = "node.kubernetes.io/not-ready";
const LEASES_NAMESPACE: &str = "kube-node-lease";
/// The NoSchedule taint of each pressure condition, while it is True.
pub const PRESSURE_TAINTS: [(&str, &str); 3] = [
    ("MemoryPressure", "node.kubernetes.io/memory-pressure"),
    ("DiskPressure", "node.kubernetes.io/disk-pressure"),
    ("PIDPressure", "node.kubernetes.io/pid-pressure"),
];

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NodeLifecycle {
    #[serde(default = "default_grace")]
    grace_period_seconds: i64,
    #[serde(default = "default_recheck")]
    recheck_seconds: u64,
    #[serde(default = "default_evictions")]
    evictions_per_pass: usize,
}

fn default_grace() -> i64 {
    50
}

fn default_recheck() -> u64 {
    5
}

fn default_evictions() -> usize {
    100
}

fn gvr(group: &str, resource: &str) -> GroupVersionResource {
    GroupVersionResource {
        group: group.into(),
        version: "v1".into(),
        resource: resource.into(),
    }
}

fn condition<'a>(obj: &'a Value, kind: &str) -> Option<&'a Value> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
}

/// Whether `toleration` tolerates the NoExecute taint `key`, and for how long
/// (`Some(None)`: for ever).
pub fn toleration_for(tolerations: &Value, key: &str) -> Option<Option<i64>> {
    tolerations.as_array()?.iter().find_map(|t| {
        let effect_ok = t["effect"]
            .as_str()
            .is_none_or(|e| e.is_empty() || e == "NoExecute");
        let key_ok = match t["key"].as_str() {
            None | Some("") => t["operator"] == "Exists",
            Some(k) => k == key,
        };
        (effect_ok && key_ok).then(|| t["tolerationSeconds"].as_i64())
    })
}

/// The taints of ours a node whose `Ready` is `ready` should carry.
pub fn wanted_taints(ready: &str) -> Option<&'static str> {
    match ready {
        "Unknown" => Some(UNREACHABLE),
        "False" => Some(NOT_READY),
        _ => None,
    }
}

impl Reconcile for NodeLifecycle {
    fn check_configuration(&self) -> Result<(), String> {
        if self.grace_period_seconds <= 0 {
            return Err("gracePeriodSeconds: must be positive".into());
        }
        if self.recheck_seconds == 0 {
            return Err("recheckSeconds: must be positive".into());
        }
        Ok(())
    }

    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let Some(node) = cache::get(&key.resource, None, &key.name)? else {
            return Ok(Action::Done);
        };
        let now = time::now();
        let lease = cache::get(
            &gvr("coordination.k8s.io", "leases"),
            Some(LEASES_NAMESPACE),
            &key.name,
        )?;
        let renewed = lease
            .as_ref()
            .and_then(|l| l["spec"]["renewTime"].as_str())
            .and_then(time::parse);
        let ready_condition = condition(&node, "Ready");
        let heartbeat = ready_condition
            .and_then(|c| c["lastHeartbeatTime"].as_str())
            .and_then(time::parse);
        let created = node["metadata"]["creationTimestamp"]
            .as_str()
            .and_then(time::parse)
            .unwrap_or(now);
        let heard = renewed.max(heartbeat).unwrap_or(created);
        let expires = heard + self.grace_period_seconds;
        let mut ready = ready_condition
            .and_then(|c| c["status"].as_str())
            .unwrap_or("Unknown")
            .to_owned();
        let expired = expires <= now;
        if expired && ready != "Unknown" {
            self.mark_unknown(key, &node, now)?;
            ready = "Unknown".into();
        }
        let taints_changed = sync_taints(key, &node, &ready, now)?;
        if ready == "True" {
            // Looked at again when it would lapse.
            let wait = u64::try_from(expires - now).unwrap_or(0).max(1);
            return Ok(Action::RequeueAfter(Duration::from_secs(wait)));
        }
        let node = if taints_changed {
            cache::get(&key.resource, None, &key.name)?.unwrap_or(node)
        } else {
            node
        };
        let next = self.evict(key, &node, now, &ready)?;
        let recheck = Duration::from_secs(self.recheck_seconds);
        Ok(Action::RequeueAfter(
            next.map_or(recheck, |n| n.min(recheck)),
        ))
    }
}

impl NodeLifecycle {
    /// The node's conditions become Unknown: its agent stopped reporting.
    fn mark_unknown(&self, key: &ObjectKey, node: &Value, now: i64) -> Result<(), String> {
        let stamp = time::format(now);
        let mut conditions: Vec<Value> = node["status"]["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for kind in ["Ready", "MemoryPressure", "DiskPressure", "PIDPressure"] {
            let unknown = json!({
                "type": kind,
                "status": "Unknown",
                "reason": "NodeStatusUnknown",
                "message": "Kubelet stopped posting node status.",
                "lastTransitionTime": stamp,
            });
            match conditions.iter_mut().find(|c| c["type"] == kind) {
                Some(c) => {
                    let heartbeat = c["lastHeartbeatTime"].clone();
                    *c = unknown;
                    if !heartbeat.is_null() {
                        c["lastHeartbeatTime"] = heartbeat;
                    }
                }
                None => conditions.push(unknown),
            }
        }
        client::patch(
            &key.resource,
            None,
            &key.name,
            PatchType::Merge,
            json!({"status": {"conditions": conditions}}),
            true,
        )
        .map_err(|e| format!("mark node {} unknown: {e}", key.name))?;
        events::record(
            node,
            EventType::Normal,
            "NodeNotReady",
            &format!("Node {} status is now: NodeNotReady", key.name),
        );
        Ok(())
    }

    /// Deletes the pods the node's NoExecute taints no longer let stay, and sets the
    /// others not ready; when the next one's time is up.
    fn evict(
        &self,
        key: &ObjectKey,
        node: &Value,
        now: i64,
        ready: &str,
    ) -> Result<Option<Duration>, String> {
        let taints: Vec<(String, i64)> = node["spec"]["taints"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|t| t["effect"] == "NoExecute")
            .map(|t| {
                let added = t["timeAdded"].as_str().and_then(time::parse).unwrap_or(now);
                (t["key"].as_str().unwrap_or_default().to_owned(), added)
            })
            .collect();
        let pods: Vec<Value> = cache::list_as(&gvr("", "pods"), None, "")?
            .into_iter()
            .filter(|p: &Value| {
                p["spec"]["nodeName"] == key.name.as_str()
                    && p["metadata"]["deletionTimestamp"].is_null()
            })
            .collect();
        let mut writes = Vec::new();
        let mut next: Option<Duration> = None;
        for pod in &pods {
            let name = pod["metadata"]["name"].as_str().unwrap_or_default();
            let namespace = pod["metadata"]["namespace"].as_str().map(str::to_owned);
            // The earliest time any taint it does not tolerate for ever evicts it.
            let evict_at = taints
                .iter()
                .filter_map(|(taint, added)| {
                    match toleration_for(&pod["spec"]["tolerations"], taint) {
                        None => Some(*added),
                        Some(None) => None,
                        Some(Some(seconds)) => Some(added + seconds.max(0)),
                    }
                })
                .min();
            match evict_at {
                Some(at) if at <= now => {
                    if writes.len() < self.evictions_per_pass {
                        writes.push(Write::Delete {
                            resource: gvr("", "pods"),
                            namespace,
                            name: name.to_owned(),
                            propagation: None,
                            uid: pod["metadata"]["uid"].as_str().map(str::to_owned),
                        });
                    } else {
                        next = Some(Duration::from_secs(1));
                    }
                    continue;
                }
                Some(at) => {
                    let wait = Duration::from_secs(u64::try_from(at - now).unwrap_or(1).max(1));
                    next = Some(next.map_or(wait, |n| n.min(wait)));
                }
                None => {}
            }
            let pod_ready = condition(pod, "Ready").and_then(|c| c["status"].as_str());
            if pod_ready != Some("False") && ready != "True" {
                let mut conditions: Vec<Value> = pod["status"]["conditions"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|c| c["type"] != "Ready")
                    .collect();
                conditions.push(json!({
                    "type": "Ready",
                    "status": "False",
                    "lastTransitionTime": time::format(now),
                }));
                writes.push(Write::Patch {
                    resource: gvr("", "pods"),
                    namespace,
                    name: name.to_owned(),
                    patch_type: PatchType::Merge,
                    patch: json!({"status": {"conditions": conditions}}),
                    status: true,
                    force: false,
                });
            }
        }
        let mut failures = Vec::new();
        for (write, result) in writes.iter().zip(client::batch(writes.clone())?) {
            match (write, result) {
                // Told on the pod, in its namespace, as Kubernetes' taint manager
                // does: where `kubectl describe pod` looks (by its uid too).
                (
                    Write::Delete {
                        namespace,
                        name,
                        uid,
                        ..
                    },
                    Ok(_),
                ) => {
                    let namespace = namespace.as_deref().unwrap_or_default();
                    events::record(
                        &json!({"apiVersion": "v1", "kind": "Pod",
                            "metadata": {"namespace": namespace, "name": name, "uid": uid}}),
                        EventType::Normal,
                        "TaintManagerEviction",
                        &format!("Marking for deletion Pod {namespace}/{name}"),
                    )
                }
                (_, Err(e)) if e.is_not_found() || e.code == 409 => {}
                (_, Err(e)) => failures.push(e.to_string()),
                _ => {}
            }
        }
        if !failures.is_empty() {
            return Err(failures.join("; "));
        }
        Ok(next)
    }
}

/// The pressure taints a node whose conditions are these should carry.
pub fn wanted_pressure_taints(node: &Value) -> Vec<&'static str> {
    PRESSURE_TAINTS
        .iter()
        .filter(|(kind, _)| condition(node, kind).is_some_and(|c| c["status"] == "True"))
        .map(|(_, taint)| *taint)
        .collect()
}

/// Puts the node's taints in line with its readiness and pressure conditions;
/// whether it changed them.
fn sync_taints(key: &ObjectKey, node: &Value, ready: &str, now: i64) -> Result<bool, String> {
    let current: Vec<Value> = node["spec"]["taints"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let wanted = wanted_taints(ready);
    let pressure = wanted_pressure_taints(node);
    let ours = |t: &Value| t["key"] == UNREACHABLE || t["key"] == NOT_READY;
    let is_pressure = |t: &Value| PRESSURE_TAINTS.iter().any(|(_, k)| t["key"] == *k);
    let mut taints: Vec<Value> = current
        .iter()
        .filter(|t| !ours(t) || Some(t["key"].as_str().unwrap_or_default()) == wanted)
        .filter(|t| {
            !is_pressure(t)
                || (t["effect"] == "NoSchedule" && pressure.iter().any(|k| t["key"] == *k))
        })
        .cloned()
        .collect();
    for key_name in &pressure {
        let present = taints
            .iter()
            .any(|t| t["key"] == *key_name && t["effect"] == "NoSchedule");
        if !present {
            // As Kubernetes' NoSchedule taints: no timeAdded (it is for NoExecute).
            taints.push(json!({"key": key_name, "effect": "NoSchedule"}));
        }
    }
    if let Some(key_name) = wanted {
        for effect in ["NoSchedule", "NoExecute"] {
            let present = taints
                .iter()
                .any(|t| t["key"] == key_name && t["effect"] == effect);
            if !present {
                let mut taint = json!({"key": key_name, "effect": effect});
                if effect == "NoExecute" {
                    taint["timeAdded"] = json!(time::format(now));
                }
                taints.push(taint);
            }
        }
    }
    if taints == current {
        return Ok(false);
    }
    let taints = if taints.is_empty() {
        Value::Null
    } else {
        Value::Array(taints)
    };
    client::patch(
        &key.resource,
        None,
        &key.name,
        PatchType::Merge,
        json!({"spec": {"taints": taints}}),
        false,
    )
    .map_err(|e| format!("taint node {}: {e}", key.name))?;
    Ok(true)
}

trellis_plugin::controller!(NodeLifecycle);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tolerations_say_how_long_a_pod_stays() {
        let t = json!([
            {"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
            {"key": NOT_READY, "operator": "Exists"},
        ]);
        assert_eq!(toleration_for(&t, UNREACHABLE), Some(Some(30)));
        assert_eq!(toleration_for(&t, NOT_READY), Some(None));
        assert_eq!(toleration_for(&t, "other"), None);
        assert_eq!(
            toleration_for(&json!([{"operator": "Exists"}]), "any"),
            Some(None)
        );
        assert_eq!(toleration_for(&Value::Null, UNREACHABLE), None);
    }

    #[test]
    fn pressure_conditions_that_are_true_want_their_taints() {
        let node = json!({"status": {"conditions": [
            {"type": "MemoryPressure", "status": "True"},
            {"type": "DiskPressure", "status": "False"},
            {"type": "PIDPressure", "status": "Unknown"},
        ]}});
        assert_eq!(
            wanted_pressure_taints(&node),
            ["node.kubernetes.io/memory-pressure"]
        );
        assert!(wanted_pressure_taints(&json!({})).is_empty());
    }

    #[test]
    fn taints_follow_readiness() {
        assert_eq!(wanted_taints("Unknown"), Some(UNREACHABLE));
        assert_eq!(wanted_taints("False"), Some(NOT_READY));
        assert_eq!(wanted_taints("True"), None);
    }
}
