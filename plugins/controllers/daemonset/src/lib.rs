//! The DaemonSet controller, as Kubernetes' daemon set controller behaves: one pod
//! of the DaemonSet's template on every node it should run on.
//!
//! - A node runs the pod when the template's `nodeName`, `nodeSelector` and required
//!   node affinity fit it and its NoSchedule/NoExecute taints are tolerated; a pod
//!   already there stays through a NoSchedule taint, goes on a NoExecute one
//!   ([`fit`]). Pods get the tolerations Kubernetes adds (not-ready and
//!   unreachable NoExecute, disk/memory/pid pressure and unschedulable NoSchedule,
//!   network-unavailable for host-network pods) and a required node affinity that
//!   names their node by `metadata.name`: the scheduler places them.
//! - Pods matching the selector without a controller are adopted, owned pods that
//!   no longer match are released; a failed pod is deleted (with a back-off per
//!   node: `failedPodBackoffSeconds` doubling to `failedPodMaxBackoffSeconds`) and
//!   replaced; extra pods on a node go, the oldest stays; pods pinned to a node that
//!   is gone are deleted.
//! - Each template has a ControllerRevision `<ds>-<hash>` ([`history`]); pods carry
//!   its `controller-revision-hash` label (and `pod-template-generation` from the
//!   `deprecated.daemonset.template.generation` annotation). A pod is up to date when
//!   either matches, so a rollback to an earlier template restarts nothing.
//! - RollingUpdate replaces old pods within `maxUnavailable`, or with `maxSurge`
//!   starts the new pod first and deletes the old one once the new is available
//!   ([`update`]); OnDelete only replaces pods someone deleted.
//! - The status (`desiredNumberScheduled`, `currentNumberScheduled`,
//!   `numberMisscheduled`, `numberReady`, `updatedNumberScheduled`,
//!   `numberAvailable`, `numberUnavailable`, `observedGeneration`) is patched when it
//!   changes.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{
    Action, EventType, ObjectKey, Reconcile, Write, cache, client, events, owned, time,
};

pub mod fit;
pub mod history;
pub mod update;

use fit::Node;
use history::HASH_LABEL;

/// The most pods created or deleted in one pass (Kubernetes' `burstReplicas`).
const BURST: usize = 250;
const GENERATION_ANNOTATION: &str = "deprecated.daemonset.template.generation";
const GENERATION_LABEL: &str = "pod-template-generation";

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DaemonSets {
    /// The first wait before a failed pod on a node is replaced again.
    #[serde(default = "default_backoff")]
    pub failed_pod_backoff_seconds: f64,
    /// The longest such wait.
    #[serde(default = "default_max_backoff")]
    pub failed_pod_max_backoff_seconds: f64,
}

fn default_backoff() -> f64 {
    1.0
}

fn default_max_backoff() -> f64 {
    900.0
}

pub(crate) fn daemonsets() -> GroupVersionResource {
    GroupVersionResource {
        group: "apps".into(),
        version: "v1".into(),
        resource: "daemonsets".into(),
    }
}

fn pods() -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: "pods".into(),
    }
}

fn nodes() -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: "nodes".into(),
    }
}

/// What the controller reads of a pod.
#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Pod {
    pub metadata: PodMeta,
    pub spec: Value,
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
pub struct PodStatus {
    pub phase: Option<String>,
    pub conditions: Vec<Value>,
}

impl Pod {
    fn controller_uid(&self) -> Option<&str> {
        self.metadata
            .owner_references
            .iter()
            .find(|r| r["controller"] == true)
            .and_then(|r| r["uid"].as_str())
    }

    fn scheduled(&self) -> bool {
        self.spec["nodeName"]
            .as_str()
            .is_some_and(|n| !n.is_empty())
    }

    pub fn is_ready(&self) -> bool {
        self.status
            .conditions
            .iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    }

    /// Ready for `min_ready` seconds at `now`; `Err(wait)` when ready but not yet
    /// for long enough.
    pub fn available(&self, min_ready: i64, now: i64) -> Result<bool, Duration> {
        if !self.is_ready() {
            return Ok(false);
        }
        if min_ready <= 0 {
            return Ok(true);
        }
        let since = self
            .status
            .conditions
            .iter()
            .find(|c| c["type"] == "Ready")
            .and_then(|c| c["lastTransitionTime"].as_str())
            .and_then(time::parse);
        match since {
            Some(s) if s + min_ready > now => Err(Duration::from_secs(
                u64::try_from(s + min_ready - now).unwrap_or(1),
            )),
            _ => Ok(true),
        }
    }

    fn hash(&self) -> Option<&str> {
        self.metadata.labels[HASH_LABEL].as_str()
    }

    /// Of the current template: its revision's hash, or (pods made before it had
    /// one) its template generation (`IsPodUpdated`).
    pub fn is_updated(&self, hash: &str, generation: Option<&str>) -> bool {
        let by_generation =
            generation.is_some_and(|g| self.metadata.labels[GENERATION_LABEL].as_str() == Some(g));
        (!hash.is_empty() && self.hash() == Some(hash)) || by_generation
    }
}

/// Scheduled pods first, then the oldest (Kubernetes' `podByCreationTimestampAndPhase`).
fn oldest_first(pods: &mut [&Pod]) {
    pods.sort_by(|a, b| {
        b.scheduled()
            .cmp(&a.scheduled())
            .then(
                a.metadata
                    .creation_timestamp
                    .cmp(&b.metadata.creation_timestamp),
            )
            .then(a.metadata.name.cmp(&b.metadata.name))
    });
}

/// The back-off of failed pods, per DaemonSet and node: `(wait, since)` in
/// milliseconds. Kept in memory as Kubernetes keeps it: a restart forgets it.
static BACKOFF: Mutex<BTreeMap<String, (u64, u64)>> = Mutex::new(BTreeMap::new());

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl DaemonSets {
    /// `Err(wait)` while the node's last failed pod is in back-off; otherwise records
    /// this failure (the next wait doubles) and allows the delete.
    fn failed_pod_backoff(&self, key: &str, now: u64) -> Result<(), Duration> {
        let first = (self.failed_pod_backoff_seconds * 1000.0) as u64;
        let max = (self.failed_pod_max_backoff_seconds * 1000.0) as u64;
        let mut table = BACKOFF.lock().unwrap_or_else(|e| e.into_inner());
        // Entries idle for twice the longest wait are forgotten (Kubernetes' GC).
        table.retain(|_, (_, since)| now.saturating_sub(*since) < 2 * max.max(1));
        match table.get_mut(key) {
            Some((wait, since)) if now < *since + *wait => {
                Err(Duration::from_millis(*since + *wait - now))
            }
            Some((wait, since)) => {
                *wait = (*wait * 2).min(max);
                *since = now;
                Ok(())
            }
            None => {
                table.insert(key.to_owned(), (first.min(max), now));
                Ok(())
            }
        }
    }
}

/// The pods the controller writes in one pass, and when to look again.
#[derive(Default)]
pub struct Plan {
    pub create_on: Vec<String>,
    pub delete: Vec<(String, String)>,
    pub recheck: Option<Duration>,
}

impl Plan {
    fn recheck_in(&mut self, wait: Duration) {
        self.recheck = Some(self.recheck.map_or(wait, |r| r.min(wait)));
    }
}

/// What a pass reads of one DaemonSet.
pub struct View<'a> {
    pub ds: &'a Value,
    pub nodes: &'a [Node],
    /// Live (not terminating) pods by the node they are on or pinned to.
    pub by_node: BTreeMap<String, Vec<&'a Pod>>,
    pub hash: String,
    pub generation: Option<String>,
    pub now: i64,
}

impl View<'_> {
    fn template_spec(&self) -> Value {
        let mut spec = self.ds["spec"]["template"]["spec"].clone();
        fit::add_daemon_tolerations(&mut spec);
        spec
    }

    fn min_ready(&self) -> i64 {
        self.ds["spec"]["minReadySeconds"].as_i64().unwrap_or(0)
    }

    fn surging(&self) -> bool {
        self.rolling()
            && update::counts(self.ds, 1)
                .map(|(surge, _)| surge > 0)
                .unwrap_or(false)
    }

    fn rolling(&self) -> bool {
        self.ds["spec"]["updateStrategy"]["type"].as_str() != Some("OnDelete")
    }
}

impl DaemonSets {
    /// Kubernetes' `podsShouldBeOnNode` over every node: where pods are missing,
    /// which go (failed, surplus, misplaced).
    fn manage(&self, view: &View, ds_key: &str, plan: &mut Plan, failed: &mut Vec<String>) {
        let spec = view.template_spec();
        let surge = view.surging();
        let now = now_ms();
        for node in view.nodes {
            let name = &node.metadata.name;
            let (should_run, should_continue) = fit::should_run(&spec, node);
            let pods = view.by_node.get(name).map(Vec::as_slice).unwrap_or(&[]);
            if should_run && pods.is_empty() {
                plan.create_on.push(name.clone());
                continue;
            }
            if !should_continue {
                for p in pods {
                    plan.delete
                        .push((p.metadata.name.clone(), p.metadata.uid.clone()));
                }
                continue;
            }
            let mut running: Vec<&Pod> = Vec::new();
            for p in pods {
                match p.status.phase.as_deref() {
                    Some("Failed") => {
                        match self.failed_pod_backoff(&format!("{ds_key}/{name}"), now) {
                            Err(wait) => plan.recheck_in(wait),
                            Ok(()) => {
                                failed.push(format!(
                                    "Found failed daemon pod {}/{} on node {name}, will try to kill it",
                                    view.ds["metadata"]["namespace"].as_str().unwrap_or_default(),
                                    p.metadata.name
                                ));
                                plan.delete
                                    .push((p.metadata.name.clone(), p.metadata.uid.clone()));
                            }
                        }
                    }
                    Some("Succeeded") => {
                        plan.delete
                            .push((p.metadata.name.clone(), p.metadata.uid.clone()));
                    }
                    _ => running.push(p),
                }
            }
            oldest_first(&mut running);
            if !surge {
                for p in running.iter().skip(1) {
                    plan.delete
                        .push((p.metadata.name.clone(), p.metadata.uid.clone()));
                }
                continue;
            }
            if running.is_empty() {
                if should_run
                    && pods
                        .iter()
                        .all(|p| p.status.phase.as_deref() != Some("Failed"))
                {
                    plan.create_on.push(name.clone());
                }
                continue;
            }
            // Surging: an old and a new pod may share a node while the new one is
            // not yet available; every other pod goes.
            let (mut oldest_new, mut oldest_old) = (None, None);
            for p in &running {
                let slot = if p.is_updated(&view.hash, view.generation.as_deref()) {
                    &mut oldest_new
                } else {
                    &mut oldest_old
                };
                if slot.is_none() {
                    *slot = Some(*p);
                } else {
                    plan.delete
                        .push((p.metadata.name.clone(), p.metadata.uid.clone()));
                }
            }
            if let (Some(new), Some(old)) = (oldest_new, oldest_old) {
                let new_available = new.available(view.min_ready(), view.now);
                if let Err(wait) = new_available {
                    plan.recheck_in(wait);
                }
                if !old.is_ready() || new_available == Ok(true) {
                    plan.delete
                        .push((old.metadata.name.clone(), old.metadata.uid.clone()));
                }
            }
        }
    }
}

/// The pod the template describes for `node`, owned by the DaemonSet.
pub fn pod_for(
    ds: &Value,
    spec: &Value,
    hash: &str,
    generation: Option<&str>,
    node: &str,
) -> Value {
    let template = &ds["spec"]["template"];
    let name = ds["metadata"]["name"].as_str().unwrap_or_default();
    let mut metadata = json!({
        "generateName": format!("{name}-"),
        "ownerReferences": [owned::controller_reference("apps/v1", "DaemonSet", ds)],
    });
    for field in ["labels", "annotations", "finalizers"] {
        if let Some(v) = template["metadata"].get(field).filter(|v| !v.is_null()) {
            metadata[field] = v.clone();
        }
    }
    if !metadata["labels"].is_object() {
        metadata["labels"] = json!({});
    }
    if let Some(g) = generation {
        metadata["labels"][GENERATION_LABEL] = json!(g);
    }
    if !hash.is_empty() {
        metadata["labels"][HASH_LABEL] = json!(hash);
    }
    let mut spec = spec.clone();
    fit::pin_to_node(&mut spec, node);
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})
}

impl Reconcile for DaemonSets {
    fn check_configuration(&self) -> Result<(), String> {
        if self.failed_pod_backoff_seconds.is_nan() || self.failed_pod_backoff_seconds <= 0.0 {
            return Err("failedPodBackoffSeconds: must be greater than 0".into());
        }
        if self.failed_pod_max_backoff_seconds < self.failed_pod_backoff_seconds {
            return Err(
                "failedPodMaxBackoffSeconds: must be at least failedPodBackoffSeconds".into(),
            );
        }
        Ok(())
    }

    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let Some(ds) = cache::get(&key.resource, ns, &key.name)? else {
            // Deleted: its pods and revisions are the garbage collector's.
            return Ok(Action::Done);
        };
        if !ds["metadata"]["deletionTimestamp"].is_null() {
            return Ok(Action::Done);
        }
        let selector = ds["spec"]["selector"].clone();
        if owned::selector_is_empty(&selector) {
            events::record(
                &ds,
                EventType::Warning,
                "SelectingAll",
                "This daemon set is selecting all pods. A non-empty selector is required.",
            );
            return Ok(Action::Done);
        }
        let selector_string = owned::selector_string(&selector)?;
        let uid = ds["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let node_list: Vec<Node> = cache::list_as(&nodes(), None, "")?;
        let hist = history::construct(&ds, &selector, &selector_string)?;

        // Claim: matching orphans are adopted, ours that no longer match released.
        let reference = owned::controller_reference("apps/v1", "DaemonSet", &ds);
        let matching: Vec<Pod> = cache::list_as(&pods(), ns, &selector_string)?;
        let mut claim = Vec::new();
        let mut mine: Vec<Pod> = Vec::new();
        for pod in matching {
            match pod.controller_uid() {
                Some(c) if c == uid => mine.push(pod),
                Some(_) => {}
                None if pod.metadata.deletion_timestamp.is_none() => {
                    claim.push(owned::adopt(
                        &pods(),
                        ns,
                        &json!({"metadata": {"name": pod.metadata.name, "uid": pod.metadata.uid}}),
                        reference.clone(),
                    ));
                    mine.push(pod);
                }
                None => {}
            }
        }
        for pod in cache::owned_by_as::<Pod>(&pods(), &uid)? {
            if pod.controller_uid() == Some(uid.as_str())
                && !owned::selector_matches(&selector, &pod.metadata.labels)
            {
                claim.push(owned::release(
                    &pods(),
                    ns,
                    &json!({"metadata": {"name": pod.metadata.name, "uid": pod.metadata.uid}}),
                    &uid,
                ));
            }
        }
        if !claim.is_empty() {
            for result in client::batch(claim)? {
                match result {
                    Ok(_) => {}
                    Err(e) if e.is_not_found() => {}
                    Err(e) => return Err(format!("claim a pod: {e}")),
                }
            }
        }

        let mut by_node: BTreeMap<String, Vec<&Pod>> = BTreeMap::new();
        let mut orphaned = Vec::new();
        for pod in mine
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
        {
            match fit::target_node(&pod.spec) {
                Some(n) => by_node.entry(n).or_default().push(pod),
                None => orphaned.push(pod),
            }
        }
        let known: std::collections::HashSet<&str> =
            node_list.iter().map(|n| n.metadata.name.as_str()).collect();
        let view = View {
            ds: &ds,
            nodes: &node_list,
            by_node,
            hash: hist.hash.clone(),
            generation: ds["metadata"]["annotations"][GENERATION_ANNOTATION]
                .as_str()
                .map(str::to_owned),
            now: time::now(),
        };

        let mut plan = Plan::default();
        let mut failed = Vec::new();
        self.manage(
            &view,
            &format!("{}/{}", ns.unwrap_or_default(), key.name),
            &mut plan,
            &mut failed,
        );
        // Pods pinned to no node or to one that is gone never run: they go.
        for p in orphaned {
            plan.delete
                .push((p.metadata.name.clone(), p.metadata.uid.clone()));
        }
        for (node, pods) in &view.by_node {
            if !known.contains(node.as_str()) {
                for p in pods {
                    plan.delete
                        .push((p.metadata.name.clone(), p.metadata.uid.clone()));
                }
            }
        }
        for message in &failed {
            events::record(&ds, EventType::Warning, "FailedDaemonPod", message);
        }
        // The rolling update acts on a settled world: once the pass's own creates
        // and deletes are seen (the host holds the key until they are).
        if plan.create_on.is_empty() && plan.delete.is_empty() && view.rolling() {
            update::rolling_update(&view, &mut plan)?;
        }
        let spec = view.template_spec();
        let failures = sync_pods(&ds, &spec, &view, &plan)?;

        let live: Vec<&str> = mine.iter().filter_map(Pod::hash).collect();
        history::cleanup(&ds, &hist.old, &live)?;

        let (status, recheck) = status_of(&view);
        if let Some(wait) = recheck {
            plan.recheck_in(wait);
        }
        let changed = [
            "desiredNumberScheduled",
            "currentNumberScheduled",
            "numberMisscheduled",
            "numberReady",
            "updatedNumberScheduled",
            "numberAvailable",
            "numberUnavailable",
            "observedGeneration",
        ]
        .iter()
        .any(|f| {
            ds["status"].get(*f).unwrap_or(&Value::Null) != status.get(*f).unwrap_or(&Value::Null)
        });
        if changed {
            client::patch_status(&key.resource, ns, &key.name, status)
                .map_err(|e| format!("update the status: {e}"))?;
        }
        if !failures.is_empty() {
            return Err(failures.join("; "));
        }
        Ok(plan.recheck.map_or(Action::Done, Action::RequeueAfter))
    }
}

/// Creates and deletes what the plan says: creations in slow-start batches (1, 2,
/// 4, …) so a template the API server refuses costs one pod, not one per node.
fn sync_pods(ds: &Value, spec: &Value, view: &View, plan: &Plan) -> Result<Vec<String>, String> {
    let ns = ds["metadata"]["namespace"].as_str().map(str::to_owned);
    let mut failures = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let deletes: Vec<&(String, String)> = plan
        .delete
        .iter()
        .filter(|(name, _)| seen.insert(name.clone()))
        .take(BURST)
        .collect();
    if !deletes.is_empty() {
        let writes = deletes
            .iter()
            .map(|(name, uid)| Write::Delete {
                resource: pods(),
                namespace: ns.clone(),
                name: name.clone(),
                propagation: None,
                uid: Some(uid.clone()),
            })
            .collect();
        for (result, (name, _)) in client::batch(writes)?.into_iter().zip(&deletes) {
            match result {
                Ok(_) => events::record(
                    ds,
                    EventType::Normal,
                    "SuccessfulDelete",
                    &format!("Deleted pod: {name}"),
                ),
                Err(e) if e.is_not_found() => {}
                Err(e) => {
                    events::record(
                        ds,
                        EventType::Warning,
                        "FailedDelete",
                        &format!("Error deleting: {}", e.message),
                    );
                    failures.push(e.to_string());
                }
            }
        }
    }
    let mut nodes = plan.create_on.iter().take(BURST);
    let mut size = 1;
    loop {
        let batch: Vec<&String> = nodes.by_ref().take(size).collect();
        if batch.is_empty() {
            break;
        }
        size *= 2;
        let writes = batch
            .iter()
            .map(|node| Write::Create {
                resource: pods(),
                namespace: ns.clone(),
                object: pod_for(ds, spec, &view.hash, view.generation.as_deref(), node),
            })
            .collect();
        let mut stop = false;
        for result in client::batch(writes)? {
            match result {
                Ok(created) => events::record(
                    ds,
                    EventType::Normal,
                    "SuccessfulCreate",
                    &format!(
                        "Created pod: {}",
                        created["metadata"]["name"].as_str().unwrap_or_default()
                    ),
                ),
                Err(e) if e.is_namespace_terminating() => stop = true,
                Err(e) => {
                    events::record(
                        ds,
                        EventType::Warning,
                        "FailedCreate",
                        &format!("Error creating: {}", e.message),
                    );
                    failures.push(e.to_string());
                    stop = true;
                }
            }
        }
        if stop {
            break;
        }
    }
    Ok(failures)
}

/// The status the pods give the DaemonSet, and when a pod becomes available.
fn status_of(view: &View) -> (Value, Option<Duration>) {
    let spec = view.template_spec();
    let (mut desired, mut current, mut misscheduled, mut ready, mut updated, mut available) =
        (0, 0, 0, 0, 0, 0);
    let mut recheck = None;
    for node in view.nodes {
        let (should_run, _) = fit::should_run(&spec, node);
        let mut pods: Vec<&Pod> = view
            .by_node
            .get(&node.metadata.name)
            .cloned()
            .unwrap_or_default();
        if !should_run {
            if !pods.is_empty() {
                misscheduled += 1;
            }
            continue;
        }
        desired += 1;
        if pods.is_empty() {
            continue;
        }
        current += 1;
        oldest_first(&mut pods);
        let pod = pods[0];
        if pod.is_ready() {
            ready += 1;
            match pod.available(view.min_ready(), view.now) {
                Ok(true) => available += 1,
                Ok(false) => {}
                Err(wait) => recheck = Some(recheck.map_or(wait, |r: Duration| r.min(wait))),
            }
        }
        if pod.is_updated(&view.hash, view.generation.as_deref()) {
            updated += 1;
        }
    }
    let mut status = json!({
        "desiredNumberScheduled": desired,
        "currentNumberScheduled": current,
        "numberMisscheduled": misscheduled,
        "numberReady": ready,
        "observedGeneration": view.ds["metadata"]["generation"],
    });
    // Zero counts of these are omitted, as Kubernetes stores them; a merge patch
    // removes a stored one by naming it null.
    for (field, n) in [
        ("updatedNumberScheduled", updated),
        ("numberAvailable", available),
        ("numberUnavailable", desired - available),
    ] {
        status[field] = if n > 0 { json!(n) } else { Value::Null };
    }
    (status, recheck)
}

trellis_plugin::controller!(DaemonSets);

#[cfg(test)]
mod tests;
