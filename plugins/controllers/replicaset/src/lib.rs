//! The ReplicaSet controller, as Kubernetes' behaves: for each ReplicaSet it keeps
//! `spec.replicas` active pods made from its template, owned by it.
//!
//! - Pods matching the selector with no controller are adopted, owned pods that no
//!   longer match are released (both by strategic merge patches on
//!   `ownerReferences`); a ReplicaSet being deleted adopts nothing and manages nothing.
//! - Missing pods are created in slow-start batches (1, 2, 4, …; at most 500 a pass),
//!   each batch one host call the host runs concurrently; a batch with a failure stops
//!   the pass and sets the `ReplicaFailure` condition.
//! - Surplus pods are deleted in Kubernetes' order: unscheduled before scheduled,
//!   pending before unknown before running, not ready before ready, pods on nodes
//!   crowded with this set's pods first, ready for less time first, more restarts
//!   first, newer first.
//! - The status (`replicas`, `fullyLabeledReplicas`, `readyReplicas`,
//!   `availableReplicas`, `observedGeneration`, `conditions`) is patched when it
//!   changes; a pod that is ready but not yet for `minReadySeconds` brings the key
//!   back when it becomes available.
//!
//! Configured with `{"kind": "ReplicationController"}` it is Kubernetes' replication
//! manager, which is this controller run on `v1` ReplicationControllers: their
//! selector is a plain map of labels, their status has the same fields, and their
//! pods are owned as `v1` `ReplicationController`.
//!
//! The cache may lag behind the pass's own writes; the host holds the key back until
//! its informers have seen them (the host's expectations), so a pass never creates a
//! pod twice.

use std::collections::HashMap;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{
    Action, EventType, ObjectKey, Reconcile, Write, cache, client, events, owned, time,
};

/// The most pods created or deleted in one pass (Kubernetes' `burstReplicas`).
const BURST: usize = 500;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSets {
    /// What it controls.
    #[serde(default)]
    pub kind: Kind,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
pub enum Kind {
    #[default]
    ReplicaSet,
    ReplicationController,
}

impl Kind {
    /// `(apiVersion, kind)` of the owner references it writes.
    fn owner(self) -> (&'static str, &'static str) {
        match self {
            Kind::ReplicaSet => ("apps/v1", "ReplicaSet"),
            Kind::ReplicationController => ("v1", "ReplicationController"),
        }
    }

    /// The object's selector as a label selector: a replication controller's is a
    /// map of labels, which is a selector's `matchLabels`.
    fn selector(self, object: &Value) -> Value {
        let selector = &object["spec"]["selector"];
        match self {
            Kind::ReplicaSet => selector.clone(),
            Kind::ReplicationController if selector.is_object() => {
                json!({ "matchLabels": selector })
            }
            Kind::ReplicationController => json!({}),
        }
    }
}

fn pods() -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: "pods".into(),
    }
}

/// What the controller reads of a pod: parsing only these fields keeps a pass over
/// a thousand pods cheap.
#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Pod {
    pub metadata: PodMeta,
    pub spec: PodSpec,
    pub status: PodStatus,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PodMeta {
    pub name: String,
    pub uid: String,
    pub labels: Value,
    pub owner_references: Vec<Value>,
    pub deletion_timestamp: Option<String>,
    pub creation_timestamp: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PodSpec {
    pub node_name: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PodStatus {
    pub phase: Option<String>,
    pub conditions: Vec<Condition>,
    pub container_statuses: Vec<ContainerStatus>,
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
    pub restart_count: i64,
}

impl Pod {
    fn controller_uid(&self) -> Option<&str> {
        self.metadata
            .owner_references
            .iter()
            .find(|r| r["controller"] == true)
            .and_then(|r| r["uid"].as_str())
    }

    /// Neither finished nor being deleted.
    pub fn is_active(&self) -> bool {
        !matches!(self.status.phase.as_deref(), Some("Succeeded" | "Failed"))
            && self.metadata.deletion_timestamp.is_none()
    }

    fn ready_condition(&self) -> Option<&Condition> {
        self.status.conditions.iter().find(|c| c.type_ == "Ready")
    }

    pub fn is_ready(&self) -> bool {
        self.ready_condition().is_some_and(|c| c.status == "True")
    }

    /// When the pod became ready, in seconds since the epoch.
    fn ready_since(&self) -> Option<i64> {
        self.ready_condition()
            .filter(|c| c.status == "True")
            .and_then(|c| c.last_transition_time.as_deref())
            .and_then(time::parse)
    }

    /// Ready for at least `min_ready` seconds at `now`; `Err(wait)` when ready but
    /// not yet for long enough.
    pub fn available(&self, min_ready: i64, now: i64) -> Result<bool, Duration> {
        if !self.is_ready() {
            return Ok(false);
        }
        if min_ready <= 0 {
            return Ok(true);
        }
        match self.ready_since() {
            Some(since) if since + min_ready > now => Err(Duration::from_secs(
                u64::try_from(since + min_ready - now).unwrap_or(1),
            )),
            _ => Ok(true),
        }
    }

    fn restarts(&self) -> i64 {
        self.status
            .container_statuses
            .iter()
            .map(|c| c.restart_count)
            .max()
            .unwrap_or(0)
    }
}

/// The order in which surplus pods go, the first to delete first.
pub fn deletion_order(pods: &mut [&Pod]) {
    // Pods of this set per node: a crowded node gives up its pods first.
    let mut per_node: HashMap<&str, usize> = HashMap::new();
    for p in pods.iter() {
        if let Some(node) = p.spec.node_name.as_deref() {
            *per_node.entry(node).or_default() += 1;
        }
    }
    let phase_rank = |p: &Pod| match p.status.phase.as_deref() {
        Some("Pending") => 0,
        Some("Unknown") => 1,
        Some("Running") => 2,
        _ => 0,
    };
    pods.sort_by(|a, b| {
        let scheduled = |p: &Pod| p.spec.node_name.as_deref().is_some_and(|n| !n.is_empty());
        let crowd = |p: &Pod| {
            p.spec
                .node_name
                .as_deref()
                .map_or(0, |n| per_node.get(n).copied().unwrap_or(0))
        };
        scheduled(a)
            .cmp(&scheduled(b))
            .then(phase_rank(a).cmp(&phase_rank(b)))
            .then(a.is_ready().cmp(&b.is_ready()))
            .then(crowd(b).cmp(&crowd(a)))
            // Ready for less time first: a later time sorts first.
            .then(b.ready_since().cmp(&a.ready_since()))
            .then(b.restarts().cmp(&a.restarts()))
            .then(
                b.metadata
                    .creation_timestamp
                    .cmp(&a.metadata.creation_timestamp),
            )
    });
}

/// The batches a slow start creates `n` pods in: 1, 2, 4, … until `n`.
pub fn slow_start_batches(n: usize) -> Vec<usize> {
    let mut batches = Vec::new();
    let (mut left, mut size) = (n, 1);
    while left > 0 {
        let batch = size.min(left);
        batches.push(batch);
        left -= batch;
        size *= 2;
    }
    batches
}

/// The pod the ReplicaSet's template describes, owned by it.
fn pod_from_template(kind: Kind, rs: &Value) -> Value {
    let (api_version, owner_kind) = kind.owner();
    let template = &rs["spec"]["template"];
    let name = rs["metadata"]["name"].as_str().unwrap_or_default();
    let mut metadata = json!({
        "generateName": format!("{name}-"),
        "ownerReferences": [owned::controller_reference(api_version, owner_kind, rs)],
    });
    for field in ["labels", "annotations", "finalizers"] {
        if let Some(v) = template["metadata"].get(field).filter(|v| !v.is_null()) {
            metadata[field] = v.clone();
        }
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": template["spec"],
    })
}

impl Reconcile for ReplicaSets {
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let Some(rs) = cache::get(&key.resource, ns, &key.name)? else {
            // Deleted: what it owned is the garbage collector's.
            return Ok(Action::Done);
        };
        let uid = rs["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let selector = &self.kind.selector(&rs);
        let (api_version, owner_kind) = self.kind.owner();
        let deleting = !rs["metadata"]["deletionTimestamp"].is_null();
        // An empty selector would select the namespace: Kubernetes manages nothing.
        if owned::selector_is_empty(selector) {
            events::record(
                &rs,
                EventType::Warning,
                "SelectingAll",
                "This replica set is selecting all pods. A non-empty selector is required.",
            );
            return Ok(Action::Done);
        }
        let selector_string = owned::selector_string(selector)?;

        // Claim: what matches and has no controller is adopted; what is ours and no
        // longer matches is released.
        let matching: Vec<Pod> = cache::list_as(&pods(), ns, &selector_string)?;
        let ours_by_owner: Vec<Pod> = cache::owned_by_as(&pods(), &uid)?;
        let mut claim = Vec::new();
        let mut mine: Vec<Pod> = Vec::new();
        for pod in matching {
            match pod.controller_uid() {
                Some(c) if c == uid => mine.push(pod),
                Some(_) => {}
                None if !deleting && pod.metadata.deletion_timestamp.is_none() => {
                    claim.push(owned::adopt(
                        &pods(),
                        ns,
                        &json!({"metadata": {"name": pod.metadata.name, "uid": pod.metadata.uid}}),
                        owned::controller_reference(api_version, owner_kind, &rs),
                    ));
                    mine.push(pod);
                }
                None => {}
            }
        }
        for pod in ours_by_owner {
            if pod.controller_uid() == Some(uid.as_str())
                && !owned::selector_matches(selector, &pod.metadata.labels)
            {
                claim.push(owned::release(
                    &pods(),
                    ns,
                    &json!({"metadata": {"name": pod.metadata.name, "uid": pod.metadata.uid}}),
                    &uid,
                ));
            }
        }
        let mut failures = Vec::new();
        if !claim.is_empty() {
            for result in client::batch(claim)? {
                match result {
                    Ok(_) => {}
                    Err(e) if e.is_not_found() => {}
                    Err(e) => failures.push(format!("claim a pod: {e}")),
                }
            }
        }

        let active: Vec<&Pod> = mine.iter().filter(|p| p.is_active()).collect();
        let wanted = rs["spec"]["replicas"].as_u64().unwrap_or(1) as usize;
        let mut create_failure = None;
        if !deleting && failures.is_empty() {
            if active.len() < wanted {
                create_failure =
                    create_pods(self.kind, key, &rs, (wanted - active.len()).min(BURST))?;
            } else if active.len() > wanted {
                let mut surplus = active.clone();
                deletion_order(&mut surplus);
                surplus.truncate((active.len() - wanted).min(BURST));
                failures.extend(delete_pods(key, &rs, &surplus)?);
            }
        }

        let (status, recheck) = status_of(&rs, &mine, create_failure.as_deref());
        if status != rs["status"] {
            client::patch_status(&key.resource, ns, &key.name, status)
                .map_err(|e| format!("update the status: {e}"))?;
        }
        if let Some(e) = create_failure {
            failures.push(e);
        }
        if !failures.is_empty() {
            return Err(failures.join("; "));
        }
        Ok(recheck.map_or(Action::Done, Action::RequeueAfter))
    }
}

/// Creates `n` pods in slow-start batches; the first failure, which ends the pass.
fn create_pods(
    kind: Kind,
    key: &ObjectKey,
    rs: &Value,
    n: usize,
) -> Result<Option<String>, String> {
    let pod = pod_from_template(kind, rs);
    for batch in slow_start_batches(n) {
        let writes = (0..batch)
            .map(|_| Write::Create {
                resource: pods(),
                namespace: key.namespace.clone(),
                object: pod.clone(),
            })
            .collect();
        let mut failure = None;
        let mut terminating = false;
        for result in client::batch(writes)? {
            match result {
                Ok(created) => events::record(
                    rs,
                    EventType::Normal,
                    "SuccessfulCreate",
                    &format!(
                        "Created pod: {}",
                        created["metadata"]["name"].as_str().unwrap_or_default()
                    ),
                ),
                // The namespace is being deleted: nothing more is created, and
                // that is no failure (the namespace controller empties it).
                Err(e) if e.is_namespace_terminating() => {
                    terminating = true;
                }
                Err(e) => {
                    events::record(
                        rs,
                        EventType::Warning,
                        "FailedCreate",
                        &format!("Error creating: {}", e.message),
                    );
                    failure.get_or_insert(e.to_string());
                }
            }
        }
        if terminating {
            return Ok(None);
        }
        if failure.is_some() {
            return Ok(failure);
        }
    }
    Ok(None)
}

fn delete_pods(key: &ObjectKey, rs: &Value, surplus: &[&Pod]) -> Result<Vec<String>, String> {
    let writes = surplus
        .iter()
        .map(|p| Write::Delete {
            resource: pods(),
            namespace: key.namespace.clone(),
            name: p.metadata.name.clone(),
            propagation: None,
            uid: Some(p.metadata.uid.clone()),
        })
        .collect();
    let mut failures = Vec::new();
    for (result, pod) in client::batch(writes)?.into_iter().zip(surplus) {
        match result {
            Ok(_) => events::record(
                rs,
                EventType::Normal,
                "SuccessfulDelete",
                &format!("Deleted pod: {}", pod.metadata.name),
            ),
            Err(e) if e.is_not_found() => {}
            Err(e) => {
                events::record(
                    rs,
                    EventType::Warning,
                    "FailedDelete",
                    &format!("Error deleting: {}", e.message),
                );
                failures.push(e.to_string());
            }
        }
    }
    Ok(failures)
}

/// The status the ReplicaSet's pods give it, and when to look again (a pod that
/// becomes available later).
fn status_of(rs: &Value, mine: &[Pod], create_failure: Option<&str>) -> (Value, Option<Duration>) {
    let template_labels = &rs["spec"]["template"]["metadata"]["labels"];
    let min_ready = rs["spec"]["minReadySeconds"].as_i64().unwrap_or(0);
    let now = time::now();
    let (mut replicas, mut labelled, mut ready, mut available) = (0, 0, 0, 0);
    let mut recheck: Option<Duration> = None;
    for pod in mine.iter().filter(|p| p.is_active()) {
        replicas += 1;
        let all_labels = template_labels
            .as_object()
            .into_iter()
            .flatten()
            .all(|(k, v)| pod.metadata.labels.get(k) == Some(v));
        if all_labels {
            labelled += 1;
        }
        if pod.is_ready() {
            ready += 1;
        }
        match pod.available(min_ready, now) {
            Ok(true) => available += 1,
            Ok(false) => {}
            Err(wait) => recheck = Some(recheck.map_or(wait, |r| r.min(wait))),
        }
    }
    let mut conditions: Vec<Value> = rs["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|c| c["type"] != "ReplicaFailure")
        .collect();
    if let Some(message) = create_failure {
        let previous = rs["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == "ReplicaFailure"));
        let since = previous
            .and_then(|c| c["lastTransitionTime"].as_str())
            .map_or_else(|| time::format(now), str::to_owned);
        conditions.push(json!({
            "type": "ReplicaFailure",
            "status": "True",
            "reason": "FailedCreate",
            "message": message,
            "lastTransitionTime": since,
        }));
    }
    let mut status = json!({
        "replicas": replicas,
        "observedGeneration": rs["metadata"]["generation"],
    });
    // Zero counts are omitted, as Kubernetes stores them.
    for (field, n) in [
        ("fullyLabeledReplicas", labelled),
        ("readyReplicas", ready),
        ("availableReplicas", available),
    ] {
        if n > 0 {
            status[field] = json!(n);
        }
    }
    if !conditions.is_empty() {
        status["conditions"] = Value::Array(conditions);
    }
    // A merge patch only removes what it names as null.
    let mut patch = status.clone();
    for field in [
        "fullyLabeledReplicas",
        "readyReplicas",
        "availableReplicas",
        "conditions",
    ] {
        if patch.get(field).is_none() && !rs["status"][field].is_null() {
            patch[field] = Value::Null;
        }
    }
    // Unchanged: the caller compares the stored status with `status` itself.
    if same_status(&rs["status"], &status) {
        return (rs["status"].clone(), recheck);
    }
    (patch, recheck)
}

/// Whether the stored status already says what `status` says.
fn same_status(stored: &Value, status: &Value) -> bool {
    let fields = [
        "replicas",
        "fullyLabeledReplicas",
        "readyReplicas",
        "availableReplicas",
        "observedGeneration",
        "conditions",
    ];
    fields
        .iter()
        .all(|f| stored.get(f).unwrap_or(&Value::Null) == status.get(f).unwrap_or(&Value::Null))
}

trellis_plugin::controller!(ReplicaSets);

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(v: Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn slow_start_doubles_until_all_are_created() {
        assert_eq!(slow_start_batches(10), vec![1, 2, 4, 3]);
        assert_eq!(slow_start_batches(0), Vec::<usize>::new());
        assert_eq!(slow_start_batches(500).iter().sum::<usize>(), 500);
    }

    #[test]
    fn surplus_pods_go_unscheduled_pending_unready_first_then_newest() {
        let ready = |t: &str| json!([{"type": "Ready", "status": "True", "lastTransitionTime": t}]);
        let pods = [
            pod(
                json!({"metadata": {"name": "running-old", "creationTimestamp": "2026-01-01T00:00:00Z"},
                       "spec": {"nodeName": "n1"}, "status": {"phase": "Running", "conditions": ready("2026-01-01T00:01:00Z")}}),
            ),
            pod(json!({"metadata": {"name": "unscheduled"}, "status": {"phase": "Pending"}})),
            pod(
                json!({"metadata": {"name": "pending"}, "spec": {"nodeName": "n2"}, "status": {"phase": "Pending"}}),
            ),
            pod(
                json!({"metadata": {"name": "running-new", "creationTimestamp": "2026-01-02T00:00:00Z"},
                       "spec": {"nodeName": "n3"}, "status": {"phase": "Running", "conditions": ready("2026-01-02T00:01:00Z")}}),
            ),
            pod(
                json!({"metadata": {"name": "not-ready"}, "spec": {"nodeName": "n4"}, "status": {"phase": "Running"}}),
            ),
        ];
        let mut order: Vec<&Pod> = pods.iter().collect();
        deletion_order(&mut order);
        let names: Vec<&str> = order.iter().map(|p| p.metadata.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "unscheduled",
                "pending",
                "not-ready",
                "running-new",
                "running-old"
            ]
        );
    }

    #[test]
    fn a_pod_is_available_once_ready_for_min_ready_seconds() {
        let p = pod(json!({"status": {"conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}));
        let t = time::parse("2026-01-01T00:00:00Z").unwrap();
        assert_eq!(p.available(0, t), Ok(true));
        assert_eq!(p.available(10, t + 4), Err(Duration::from_secs(6)));
        assert_eq!(p.available(10, t + 10), Ok(true));
        let not_ready =
            pod(json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}));
        assert_eq!(not_ready.available(0, t), Ok(false));
    }

    #[test]
    fn pods_from_the_template_are_owned_and_named_after_the_set() {
        let rs = json!({"metadata": {"name": "web-abc", "uid": "u1"},
            "spec": {"template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "c"}]}}}});
        let p = pod_from_template(Kind::ReplicaSet, &rs);
        assert_eq!(p["metadata"]["generateName"], "web-abc-");
        assert_eq!(p["metadata"]["labels"]["app"], "web");
        assert!(owned::is_controlled_by(&p, "u1"));
        assert_eq!(p["spec"]["containers"][0]["name"], "c");
        assert_eq!(p["metadata"]["ownerReferences"][0]["kind"], "ReplicaSet");
        assert_eq!(p["metadata"]["ownerReferences"][0]["apiVersion"], "apps/v1");
    }

    #[test]
    fn a_replication_controller_selects_by_its_map_and_owns_as_v1() {
        let rc = json!({"metadata": {"name": "web", "uid": "u2"},
            "spec": {"selector": {"app": "web"},
                     "template": {"metadata": {"labels": {"app": "web"}}, "spec": {}}}});
        let kind = Kind::ReplicationController;
        assert_eq!(kind.selector(&rc), json!({"matchLabels": {"app": "web"}}));
        assert!(owned::selector_is_empty(
            &kind.selector(&json!({"spec": {}}))
        ));
        let p = pod_from_template(kind, &rc);
        assert_eq!(
            p["metadata"]["ownerReferences"][0]["kind"],
            "ReplicationController"
        );
        assert_eq!(p["metadata"]["ownerReferences"][0]["apiVersion"], "v1");
        let config: ReplicaSets =
            serde_json::from_str(r#"{"kind": "ReplicationController"}"#).unwrap();
        assert_eq!(config.kind, kind);
    }
}
