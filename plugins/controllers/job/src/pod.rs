//! What the Job controller reads of its pods: their outcome, when they finished,
//! their completion index, and how a pod failure policy judges a failure.

use serde::Deserialize;
use serde_json::Value;
use trellis_plugin::controller::time;

/// The finalizer that keeps a Job's pod until the controller has counted it.
pub const TRACKING_FINALIZER: &str = "batch.kubernetes.io/job-tracking";
/// The annotation and label that carry an Indexed Job's pod's index.
pub const INDEX_KEY: &str = "batch.kubernetes.io/job-completion-index";
/// The annotation of an index's pod that counts the index's earlier failures
/// (with `backoffLimitPerIndex`).
pub const FAILURE_COUNT_KEY: &str = "batch.kubernetes.io/job-index-failure-count";

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Pod {
    pub metadata: Meta,
    pub spec: Spec,
    pub status: Status,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Meta {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub annotations: Value,
    pub finalizers: Vec<String>,
    pub owner_references: Vec<Value>,
    pub deletion_timestamp: Option<String>,
    pub creation_timestamp: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Spec {
    pub node_name: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Status {
    pub phase: Option<String>,
    pub conditions: Vec<Condition>,
    pub container_statuses: Vec<ContainerStatus>,
    pub init_container_statuses: Vec<ContainerStatus>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    pub last_transition_time: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ContainerStatus {
    pub name: String,
    pub restart_count: i64,
    pub state: Value,
}

/// What a finished pod counts as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed,
}

impl Pod {
    pub fn is_controlled_by(&self, uid: &str) -> bool {
        self.metadata
            .owner_references
            .iter()
            .any(|r| r["controller"] == true && r["uid"] == uid)
    }

    pub fn has_finalizer(&self) -> bool {
        self.metadata
            .finalizers
            .iter()
            .any(|f| f == TRACKING_FINALIZER)
    }

    pub fn phase(&self) -> &str {
        self.status.phase.as_deref().unwrap_or_default()
    }

    pub fn is_terminal(&self) -> bool {
        matches!(self.phase(), "Succeeded" | "Failed")
    }

    pub fn is_terminating(&self) -> bool {
        self.metadata.deletion_timestamp.is_some() && !self.is_terminal()
    }

    /// Neither finished nor being deleted: what `status.active` counts.
    pub fn is_active(&self) -> bool {
        !self.is_terminal() && self.metadata.deletion_timestamp.is_none()
    }

    pub fn is_ready(&self) -> bool {
        self.status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    }

    /// What the pod counts as once finished: a pod deleted before it finished is a
    /// failure, unless the Job has a pod failure policy, which waits for the pod's
    /// final phase (Kubernetes' `podReplacementPolicy` defaults).
    pub fn outcome(&self, waits_for_terminal: bool) -> Option<Outcome> {
        match self.phase() {
            "Succeeded" => Some(Outcome::Succeeded),
            "Failed" => Some(Outcome::Failed),
            _ if self.metadata.deletion_timestamp.is_some() && !waits_for_terminal => {
                Some(Outcome::Failed)
            }
            _ => None,
        }
    }

    /// Its completion index, when it has a valid one.
    pub fn index(&self) -> Option<u64> {
        self.metadata.annotations[INDEX_KEY]
            .as_str()
            .and_then(|s| s.parse().ok())
    }

    /// The failures of its index before it (`backoffLimitPerIndex`).
    pub fn failure_count(&self) -> u64 {
        self.metadata.annotations[FAILURE_COUNT_KEY]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }

    /// When it finished, in seconds since the epoch: its containers' last finish, or
    /// when it stopped being ready, or `now` (the kubelet wrote no times).
    pub fn finished_at(&self, now: i64) -> i64 {
        let containers = self
            .status
            .container_statuses
            .iter()
            .filter_map(|c| c.state["terminated"]["finishedAt"].as_str())
            .filter_map(time::parse)
            .max();
        containers
            .or_else(|| {
                self.status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == "Ready")
                    .and_then(|c| c.last_transition_time.as_deref())
                    .and_then(time::parse)
            })
            .unwrap_or(now)
    }

    /// Restarts of all its containers: what a Job with `restartPolicy: OnFailure`
    /// charges against its back-off limit.
    pub fn restarts(&self) -> i64 {
        self.status
            .container_statuses
            .iter()
            .chain(&self.status.init_container_statuses)
            .map(|c| c.restart_count)
            .sum()
    }
}

/// What a matching rule of a pod failure policy does with a failed pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Judgement {
    /// Fails the Job, with the message of its condition.
    FailJob(String),
    /// Not counted against the back-off limit.
    Ignore,
    /// Fails the pod's index (`backoffLimitPerIndex`).
    FailIndex,
    /// Counted, as without a policy.
    Count,
}

/// The first rule of `policy` (`spec.podFailurePolicy`) that matches the failed
/// `pod`, as Kubernetes' `matchPodFailurePolicy`: exit codes of containers that
/// terminated with a non-zero code, or pod conditions.
pub fn judge(policy: &Value, pod: &Pod) -> Judgement {
    let rules = policy["rules"].as_array().into_iter().flatten().enumerate();
    for (i, rule) in rules {
        let action = rule["action"].as_str().unwrap_or_default();
        let matched = if rule["onExitCodes"].is_object() {
            matching_container(&rule["onExitCodes"], pod).map(|(name, code)| {
                format!(
                    "Container {name} for pod {}/{} failed with exit code {code} matching {action} rule at index {i}",
                    pod.metadata.namespace, pod.metadata.name
                )
            })
        } else {
            rule["onPodConditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| {
                    let want = p["status"].as_str().unwrap_or("True");
                    pod.status
                        .conditions
                        .iter()
                        .any(|c| p["type"] == c.type_.as_str() && c.status == want)
                })
                .map(|p| {
                    format!(
                        "Pod {}/{} has condition {} matching {action} rule at index {i}",
                        pod.metadata.namespace,
                        pod.metadata.name,
                        p["type"].as_str().unwrap_or_default()
                    )
                })
        };
        let Some(message) = matched else { continue };
        return match action {
            "FailJob" => Judgement::FailJob(message),
            "Ignore" => Judgement::Ignore,
            "FailIndex" => Judgement::FailIndex,
            _ => Judgement::Count,
        };
    }
    Judgement::Count
}

/// The first container (init containers too) matching an `onExitCodes`
/// requirement: its name and exit code.
fn matching_container(requirement: &Value, pod: &Pod) -> Option<(String, i64)> {
    let values: Vec<i64> = requirement["values"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_i64)
        .collect();
    let name = requirement["containerName"].as_str();
    pod.status
        .container_statuses
        .iter()
        .chain(&pod.status.init_container_statuses)
        .filter(|c| name.is_none_or(|n| n == c.name))
        .find_map(|c| {
            let code = c.state["terminated"]["exitCode"].as_i64()?;
            let listed = values.contains(&code);
            let matches = match requirement["operator"].as_str() {
                Some("In") => listed,
                Some("NotIn") => !listed,
                _ => false,
            };
            (code != 0 && matches).then(|| (c.name.clone(), code))
        })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(v: Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_failure_policy_matches_exit_codes_then_conditions_in_rule_order() {
        let policy = json!({"rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
            {"action": "FailJob", "onExitCodes": {"containerName": "main", "operator": "In", "values": [42]}},
            {"action": "Count", "onExitCodes": {"operator": "NotIn", "values": [1]}},
        ]});
        let failed = |code: i64, conditions: Value| {
            pod(json!({"metadata": {"name": "p", "namespace": "ns"},
                "status": {"phase": "Failed", "conditions": conditions,
                    "containerStatuses": [{"name": "main", "state": {"terminated": {"exitCode": code}}}]}}))
        };
        assert_eq!(
            judge(&policy, &failed(42, json!([]))),
            Judgement::FailJob(
                "Container main for pod ns/p failed with exit code 42 matching FailJob rule at index 1"
                    .into()
            )
        );
        assert_eq!(
            judge(
                &policy,
                &failed(42, json!([{"type": "DisruptionTarget", "status": "True"}]))
            ),
            Judgement::Ignore
        );
        assert_eq!(judge(&policy, &failed(1, json!([]))), Judgement::Count);
        assert_eq!(judge(&json!({}), &failed(42, json!([]))), Judgement::Count);
    }

    #[test]
    fn a_pod_deleted_before_it_finished_is_a_failure_unless_a_policy_waits() {
        let p = pod(
            json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}, "status": {"phase": "Running"}}),
        );
        assert_eq!(p.outcome(false), Some(Outcome::Failed));
        assert_eq!(p.outcome(true), None);
        assert!(p.is_terminating() && !p.is_active());
        let done = pod(json!({"status": {"phase": "Succeeded",
            "containerStatuses": [{"name": "c", "state": {"terminated": {"exitCode": 0, "finishedAt": "2026-01-01T00:00:09Z"}}}]}}));
        assert_eq!(done.outcome(false), Some(Outcome::Succeeded));
        assert_eq!(
            done.finished_at(0),
            time::parse("2026-01-01T00:00:09Z").unwrap()
        );
    }
}
