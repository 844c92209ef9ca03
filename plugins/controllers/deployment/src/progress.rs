//! The Deployment's status (Kubernetes' `progress.go` and the status half of
//! `sync.go`): the counts, and the `Available` and `Progressing` conditions with the
//! progress deadline, after which it asks to be called again.

use std::time::Duration;

use serde_json::{Value, json};
use trellis_plugin::controller::{Action, client, time};

use crate::Pass;
use crate::util::{fenceposts, is_rolling};

impl Pass<'_> {
    fn counts(&self) -> Counts {
        let new = self.new.as_ref();
        let total: i64 = self.all().map(|s| s.replicas).sum();
        let available: i64 = self.all().map(|s| s.available).sum();
        Counts {
            replicas: self.all().map(|s| s.status_replicas).sum(),
            updated: new.map_or(0, |n| n.status_replicas),
            ready: self.all().map(|s| s.ready).sum(),
            available,
            unavailable: (total.max(self.replicas()) - available).max(0),
        }
    }

    /// All pods updated and available, no old ones left, and this generation seen.
    pub(crate) fn is_complete(&self) -> bool {
        let c = self.counts();
        let r = self.replicas();
        c.updated == r && c.replicas == r && c.available == r
    }

    pub(crate) fn progressing_condition(&self) -> Option<&Value> {
        self.d["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Progressing")
    }

    /// Computes and writes the status; when a rollout is under way with a deadline,
    /// asks to be called again when the deadline would pass.
    pub(crate) fn sync_status(self) -> Result<Action, String> {
        let c = self.counts();
        let now = time::now();
        let stamp = time::format(now);
        let old = &self.d["status"];
        let mut conditions: Vec<Value> = old["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|c| {
                c["type"] != "Available"
                    && c["type"] != "Progressing"
                    && c["type"] != "ReplicaFailure"
            })
            .collect();
        let previous = |kind: &str| {
            old["conditions"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["type"] == kind))
                .cloned()
        };
        let condition = |kind: &str, status: &str, reason: &str, message: String| {
            let before = previous(kind);
            let same = before
                .as_ref()
                .is_some_and(|b| b["status"] == status && b["reason"] == reason);
            let transition = before
                .as_ref()
                .filter(|b| b["status"] == status)
                .and_then(|b| b["lastTransitionTime"].as_str())
                .map_or_else(|| stamp.clone(), str::to_owned);
            let update = if same {
                before
                    .as_ref()
                    .and_then(|b| b["lastUpdateTime"].as_str())
                    .map_or_else(|| stamp.clone(), str::to_owned)
            } else {
                stamp.clone()
            };
            json!({
                "type": kind,
                "status": status,
                "lastUpdateTime": update,
                "lastTransitionTime": transition,
                "reason": reason,
                "message": message,
            })
        };
        let (_, max_unavailable) = if is_rolling(&self.d) {
            fenceposts(&self.d)?
        } else {
            (0, 0)
        };
        conditions.push(if c.available >= self.replicas() - max_unavailable {
            condition(
                "Available",
                "True",
                "MinimumReplicasAvailable",
                "Deployment has minimum availability.".into(),
            )
        } else {
            condition(
                "Available",
                "False",
                "MinimumReplicasUnavailable",
                "Deployment does not have minimum availability.".into(),
            )
        });
        let new_name = self.new.as_ref().map(|n| n.name.clone());
        let deadline = self.d["spec"]["progressDeadlineSeconds"].as_i64();
        let complete = self.is_complete();
        let moved = c.updated > old["updatedReplicas"].as_i64().unwrap_or(0)
            || c.ready > old["readyReplicas"].as_i64().unwrap_or(0)
            || c.available > old["availableReplicas"].as_i64().unwrap_or(0)
            || c.replicas - c.updated
                < old["replicas"].as_i64().unwrap_or(0)
                    - old["updatedReplicas"].as_i64().unwrap_or(0);
        let mut again = None;
        let progressing = if self.d["spec"]["paused"] == true {
            Some(condition(
                "Progressing",
                "Unknown",
                "DeploymentPaused",
                "Deployment is paused".into(),
            ))
        } else if let Some(name) = &new_name {
            if complete {
                Some(condition(
                    "Progressing",
                    "True",
                    "NewReplicaSetAvailable",
                    format!("ReplicaSet {name:?} has successfully progressed."),
                ))
            } else if let Some((reason, message)) = &self.progressing {
                Some(condition("Progressing", "True", reason, message.clone()))
            } else if moved {
                Some(condition(
                    "Progressing",
                    "True",
                    "ReplicaSetUpdated",
                    format!("ReplicaSet {name:?} is progressing."),
                ))
            } else {
                let since = previous("Progressing")
                    .and_then(|p| p["lastUpdateTime"].as_str().and_then(time::parse));
                match (deadline, since) {
                    (Some(limit), Some(since)) if since + limit <= now => Some(condition(
                        "Progressing",
                        "False",
                        "ProgressDeadlineExceeded",
                        format!("ReplicaSet {name:?} has timed out progressing."),
                    )),
                    (Some(limit), Some(since)) => {
                        again = Some(Duration::from_secs(
                            u64::try_from(since + limit - now).unwrap_or(1).max(1),
                        ));
                        previous("Progressing")
                    }
                    _ => previous("Progressing"),
                }
            }
        } else {
            previous("Progressing")
        };
        if let Some(p) = progressing {
            if !complete
                && p["status"] == "True"
                && let Some(limit) = deadline
            {
                again.get_or_insert(Duration::from_secs(u64::try_from(limit).unwrap_or(1)));
            }
            conditions.push(p);
        }
        if let Some(failure) = self.new.as_ref().and_then(|n| {
            n.object["status"]["conditions"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["type"] == "ReplicaFailure").cloned())
        }) {
            conditions.push(failure);
        }
        let mut status = json!({
            "observedGeneration": self.d["metadata"]["generation"],
            "replicas": c.replicas,
            "updatedReplicas": c.updated,
            "readyReplicas": c.ready,
            "availableReplicas": c.available,
            "unavailableReplicas": c.unavailable,
            "conditions": conditions,
        });
        if let Some(count) = old.get("collisionCount").filter(|v| !v.is_null()) {
            status["collisionCount"] = count.clone();
        }
        // Zero counts are left out, as Kubernetes writes them; a merge patch clears
        // them with null.
        let mut patch = status.clone();
        for field in [
            "replicas",
            "updatedReplicas",
            "readyReplicas",
            "availableReplicas",
            "unavailableReplicas",
        ] {
            if status[field] == 0 {
                status.as_object_mut().map(|s| s.remove(field));
                patch[field] = Value::Null;
            }
        }
        let unchanged = [
            "observedGeneration",
            "replicas",
            "updatedReplicas",
            "readyReplicas",
            "availableReplicas",
            "unavailableReplicas",
            "conditions",
        ]
        .iter()
        .all(|f| old.get(f).unwrap_or(&Value::Null) == status.get(f).unwrap_or(&Value::Null));
        if !unchanged {
            client::patch_status(&self.key.resource, self.ns(), &self.key.name, patch)
                .map_err(|e| format!("update the status: {e}"))?;
        }
        Ok(again.map_or(Action::Done, Action::RequeueAfter))
    }
}

struct Counts {
    replicas: i64,
    updated: i64,
    ready: i64,
    available: i64,
    unavailable: i64,
}
