//! The StatefulSet controller, as Kubernetes' behaves: pods with stable names and
//! claims, made and removed in order.
//!
//! - Pods are `<set>-<ordinal>` for the ordinals `spec.ordinals.start ..
//!   start + replicas`, each with `hostname` its name and `subdomain` the set's
//!   `serviceName` (so the headless Service gives it a stable DNS name), the labels
//!   `statefulset.kubernetes.io/pod-name`, `apps.kubernetes.io/pod-index` and
//!   `controller-revision-hash` (its revision's name), owned by the set.
//! - Each `volumeClaimTemplates` entry becomes a PersistentVolumeClaim
//!   `<template>-<set>-<ordinal>`, made before the pod and mounted by it in place of
//!   the template's volume of that name; deleting the pod keeps it. Its
//!   `persistentVolumeClaimRetentionPolicy` is kept as ownerReferences that the
//!   garbage collector follows: `whenDeleted: Delete` owns the claims by the set,
//!   `whenScaled: Delete` owns a scaled-down pod's claims by that pod.
//! - `OrderedReady` (the default) makes pods one at a time in ordinal order, each
//!   once the one before is Running and Ready (and available for `minReadySeconds`),
//!   removes them from the highest ordinal one at a time, and halts while a pod is
//!   unhealthy; `Parallel` makes and removes all at once.
//! - Templates are kept as ControllerRevisions ([`revision`]); `RollingUpdate`
//!   replaces pods of an old revision from the highest ordinal down to
//!   `partition`, one at a time once the pods above are healthy, or with
//!   `maxUnavailable` set, while fewer than that many of the set's pods are
//!   unavailable (Kubernetes' `MaxUnavailableStatefulSet` behaviour); `OnDelete`
//!   makes a deleted pod anew from the set's template and replaces nothing itself.
//! - A pod that failed or succeeded is deleted and made again.
//! - The status (`replicas`, `readyReplicas`, `currentReplicas`, `updatedReplicas`,
//!   `availableReplicas`, `currentRevision`, `updateRevision`,
//!   `observedGeneration`, `collisionCount`) is patched when it changes; the
//!   current revision becomes the update revision once every pod is updated and
//!   ready.
//!
//! Pods that match the selector, have no controller and are named as one of the
//! set's are adopted, as are revisions of the selector without a controller; the
//! set's pods that no longer match are released.

pub mod revision;

use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{
    Action, EventType, ObjectKey, PatchType, Reconcile, Write, cache, client, events, owned, time,
};

use revision::{POD_REVISION_LABEL, Revisions};

pub const POD_NAME_LABEL: &str = "statefulset.kubernetes.io/pod-name";
pub const POD_INDEX_LABEL: &str = "apps.kubernetes.io/pod-index";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatefulSets {}

fn pods() -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: "pods".into(),
    }
}

fn claims() -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: "persistentvolumeclaims".into(),
    }
}

fn str_of<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    path.iter()
        .fold(v, |v, k| &v[k])
        .as_str()
        .unwrap_or_default()
}

/// A pod as the controller reads it.
pub mod pod {
    use serde_json::Value;
    use trellis_plugin::controller::time;

    pub fn name(p: &Value) -> &str {
        p["metadata"]["name"].as_str().unwrap_or_default()
    }

    fn phase(p: &Value) -> &str {
        p["status"]["phase"].as_str().unwrap_or_default()
    }

    pub fn is_finished(p: &Value) -> bool {
        matches!(phase(p), "Failed" | "Succeeded")
    }

    pub fn is_pending(p: &Value) -> bool {
        matches!(phase(p), "Pending" | "")
    }

    pub fn is_terminating(p: &Value) -> bool {
        !p["metadata"]["deletionTimestamp"].is_null()
    }

    fn ready_condition(p: &Value) -> Option<&Value> {
        p["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Ready")
    }

    pub fn is_running_and_ready(p: &Value) -> bool {
        phase(p) == "Running" && ready_condition(p).is_some_and(|c| c["status"] == "True")
    }

    /// Running and ready for `min_ready` seconds at `now`; `Err(wait)` when ready
    /// but not yet for long enough.
    pub fn available(p: &Value, min_ready: i64, now: i64) -> Result<bool, std::time::Duration> {
        if !is_running_and_ready(p) {
            return Ok(false);
        }
        if min_ready <= 0 {
            return Ok(true);
        }
        let since = ready_condition(p)
            .and_then(|c| c["lastTransitionTime"].as_str())
            .and_then(time::parse);
        match since {
            Some(s) if s + min_ready > now => Err(std::time::Duration::from_secs(
                u64::try_from(s + min_ready - now).unwrap_or(1),
            )),
            _ => Ok(true),
        }
    }

    /// Ready and not being deleted.
    pub fn is_healthy(p: &Value) -> bool {
        is_running_and_ready(p) && !is_terminating(p)
    }

    pub fn revision(p: &Value) -> &str {
        p["metadata"]["labels"][super::POD_REVISION_LABEL]
            .as_str()
            .unwrap_or_default()
    }
}

/// The ordinal of a pod named `<set>-<ordinal>`; `None` for any other name.
pub fn ordinal(set_name: &str, pod_name: &str) -> Option<i64> {
    let (parent, n) = pod_name.rsplit_once('-')?;
    if parent != set_name || n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

/// The first ordinal (`spec.ordinals.start`, 0).
fn start_ordinal(set: &Value) -> i64 {
    set["spec"]["ordinals"]["start"].as_i64().unwrap_or(0)
}

fn replicas_of(set: &Value) -> i64 {
    set["spec"]["replicas"].as_i64().unwrap_or(1).max(0)
}

fn claim_name(template: &Value, set_name: &str, ordinal: i64) -> String {
    format!(
        "{}-{set_name}-{ordinal}",
        str_of(template, &["metadata", "name"])
    )
}

fn claim_templates(set: &Value) -> impl Iterator<Item = &Value> {
    set["spec"]["volumeClaimTemplates"]
        .as_array()
        .into_iter()
        .flatten()
}

/// The pod of `ordinal` made from `template` (the template of `revision_name`).
pub fn new_pod(set: &Value, template: &Value, revision_name: &str, ordinal: i64) -> Value {
    let set_name = str_of(set, &["metadata", "name"]);
    let name = format!("{set_name}-{ordinal}");
    let mut labels = template["metadata"]["labels"].clone();
    if !labels.is_object() {
        labels = json!({});
    }
    labels[POD_NAME_LABEL] = json!(name);
    labels[POD_INDEX_LABEL] = json!(ordinal.to_string());
    labels[POD_REVISION_LABEL] = json!(revision_name);
    let mut metadata = json!({
        "name": name,
        "labels": labels,
        "ownerReferences": [owned::controller_reference("apps/v1", "StatefulSet", set)],
    });
    for field in ["annotations", "finalizers"] {
        if let Some(v) = template["metadata"].get(field).filter(|v| !v.is_null()) {
            metadata[field] = v.clone();
        }
    }
    let mut spec = template["spec"].clone();
    if !spec.is_object() {
        spec = json!({});
    }
    spec["hostname"] = json!(name);
    if let Some(service) = set["spec"]["serviceName"]
        .as_str()
        .filter(|s| !s.is_empty())
    {
        spec["subdomain"] = json!(service);
    }
    // Each claim template's volume replaces the template's volume of that name.
    let mut volumes: Vec<Value> = spec["volumes"].as_array().cloned().unwrap_or_default();
    for t in claim_templates(set) {
        let volume_name = str_of(t, &["metadata", "name"]);
        volumes.retain(|v| v["name"] != volume_name);
        volumes.push(json!({
            "name": volume_name,
            "persistentVolumeClaim": {"claimName": claim_name(t, set_name, ordinal)},
        }));
    }
    if !volumes.is_empty() {
        spec["volumes"] = Value::Array(volumes);
    }
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})
}

/// The claims of the pod of `ordinal`: each template named for the pod, labelled
/// with the set's `matchLabels` too.
pub fn pod_claims(set: &Value, ordinal: i64) -> Vec<Value> {
    let set_name = str_of(set, &["metadata", "name"]);
    claim_templates(set)
        .map(|t| {
            let mut claim = t.clone();
            claim["apiVersion"] = json!("v1");
            claim["kind"] = json!("PersistentVolumeClaim");
            let mut metadata = json!({"name": claim_name(t, set_name, ordinal)});
            let mut labels = t["metadata"]["labels"].clone();
            if !labels.is_object() {
                labels = json!({});
            }
            for (k, v) in set["spec"]["selector"]["matchLabels"]
                .as_object()
                .into_iter()
                .flatten()
            {
                labels[k] = v.clone();
            }
            if labels.as_object().is_some_and(|l| !l.is_empty()) {
                metadata["labels"] = labels;
            }
            if let Some(a) = t["metadata"].get("annotations").filter(|a| !a.is_null()) {
                metadata["annotations"] = a.clone();
            }
            claim["metadata"] = metadata;
            if let Some(s) = claim.as_object_mut() {
                s.remove("status");
            }
            claim
        })
        .collect()
}

/// A plain ownerReference (neither controller nor blocking), as the retention
/// policy puts on claims.
fn plain_reference(api_version: &str, kind: &str, owner: &Value) -> Value {
    json!({
        "apiVersion": api_version,
        "kind": kind,
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
    })
}

/// The owners a claim of the pod of `ordinal` should have by the retention policy:
/// `(by the set, by the pod)`, as Kubernetes' `updateClaimOwnerRefForSetAndPod`.
pub fn retention_owners(set: &Value, ordinal: i64) -> (bool, bool) {
    let policy = &set["spec"]["persistentVolumeClaimRetentionPolicy"];
    let delete = |f: &str| policy[f] == "Delete";
    let start = start_ordinal(set);
    let scaled_down = ordinal < start || ordinal >= start + replicas_of(set);
    match (delete("whenScaled"), delete("whenDeleted")) {
        (false, false) => (false, false),
        (false, true) => (true, false),
        (true, false) => (false, scaled_down),
        (true, true) => (!scaled_down, scaled_down),
    }
}

/// The ownerReferences `claim` should have; `None` when it has them already.
fn retention_references(claim: &Value, set: &Value, pod: &Value, ordinal: i64) -> Option<Value> {
    let (by_set, by_pod) = retention_owners(set, ordinal);
    let refs: Vec<Value> = claim["metadata"]["ownerReferences"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let set_uid = &set["metadata"]["uid"];
    let pod_uid = &pod["metadata"]["uid"];
    let has = |uid: &Value| refs.iter().any(|r| &r["uid"] == uid);
    let want_pod = by_pod && !pod_uid.is_null();
    if has(set_uid) == by_set && has(pod_uid) == want_pod {
        return None;
    }
    let mut new: Vec<Value> = refs
        .into_iter()
        .filter(|r| &r["uid"] != set_uid && &r["uid"] != pod_uid)
        .collect();
    if by_set {
        new.push(plain_reference("apps/v1", "StatefulSet", set));
    }
    if want_pod {
        new.push(plain_reference("v1", "Pod", pod));
    }
    Some(Value::Array(new))
}

/// What one pass writes of the status.
#[derive(Default)]
struct Counts {
    replicas: i64,
    ready: i64,
    available: i64,
    current: i64,
    updated: i64,
}

struct Pass<'a> {
    key: &'a ObjectKey,
    set: &'a Value,
    set_name: &'a str,
    revisions: Revisions,
    counts: Counts,
    recheck: Option<Duration>,
    failures: Vec<String>,
}

impl Pass<'_> {
    fn ns(&self) -> Option<&str> {
        self.key.namespace.as_deref()
    }

    fn current_name(&self) -> &str {
        revision::name(&self.revisions.current)
    }

    fn update_name(&self) -> &str {
        revision::name(&self.revisions.update)
    }

    /// The pod a missing ordinal gets: of the current revision below the
    /// partition of a rolling update, of the update revision otherwise.
    fn pod_for(&self, ordinal: i64) -> Value {
        let strategy = &self.set["spec"]["updateStrategy"];
        let rolling = strategy["type"].as_str().unwrap_or("RollingUpdate") == "RollingUpdate";
        let partition = strategy["rollingUpdate"]["partition"].as_i64().unwrap_or(0);
        if rolling && ordinal < start_ordinal(self.set) + partition {
            let template = revision::template_of(&self.revisions.current);
            new_pod(self.set, &template, self.current_name(), ordinal)
        } else {
            new_pod(
                self.set,
                &self.set["spec"]["template"],
                self.update_name(),
                ordinal,
            )
        }
    }

    fn event(&self, kind: EventType, reason: &str, message: &str) {
        events::record(self.set, kind, reason, message);
    }

    /// Creates the pod's claims the cache does not hold, with the owners the
    /// retention policy gives them. `Err` when one could not be made (or is being
    /// deleted): the pod must wait.
    fn create_missing_claims(&mut self, ordinal: i64) -> Result<(), String> {
        let mut writes = Vec::new();
        for mut claim in pod_claims(self.set, ordinal) {
            let name = str_of(&claim, &["metadata", "name"]).to_owned();
            match cache::get(&claims(), self.ns(), &name)? {
                Some(existing) if pod::is_terminating(&existing) => {
                    return Err(format!(
                        "claim {name} of pod {}-{ordinal} is being deleted",
                        self.set_name
                    ));
                }
                Some(_) => {}
                None => {
                    if retention_owners(self.set, ordinal).0 {
                        claim["metadata"]["ownerReferences"] =
                            json!([plain_reference("apps/v1", "StatefulSet", self.set)]);
                    }
                    writes.push(Write::Create {
                        resource: claims(),
                        namespace: self.key.namespace.clone(),
                        object: claim,
                    });
                }
            }
        }
        if writes.is_empty() {
            return Ok(());
        }
        let pod_name = format!("{}-{ordinal}", self.set_name);
        for result in client::batch(writes)? {
            match result {
                Ok(c) => self.event(
                    EventType::Normal,
                    "SuccessfulCreate",
                    &format!(
                        "create Claim {} Pod {pod_name} in StatefulSet {} success",
                        str_of(&c, &["metadata", "name"]),
                        self.set_name
                    ),
                ),
                Err(e) if e.is_already_exists() => {}
                Err(e) => {
                    self.event(
                        EventType::Warning,
                        "FailedCreate",
                        &format!(
                            "create Claim for Pod {pod_name} in StatefulSet {} failed error: {}",
                            self.set_name, e.message
                        ),
                    );
                    return Err(format!("create a claim of {pod_name}: {e}"));
                }
            }
        }
        Ok(())
    }

    /// Makes the pod of `ordinal` (claims first). `Ok(false)`: not made.
    fn create(&mut self, ordinal: i64) -> Result<bool, String> {
        if let Err(e) = self.create_missing_claims(ordinal) {
            self.failures.push(e);
            return Ok(false);
        }
        let pod = self.pod_for(ordinal);
        let name = pod::name(&pod).to_owned();
        match client::create(&pods(), self.ns(), pod.clone()) {
            Ok(_) => {
                self.event(
                    EventType::Normal,
                    "SuccessfulCreate",
                    &format!(
                        "create Pod {name} in StatefulSet {} successful",
                        self.set_name
                    ),
                );
                self.counts.replicas += 1;
                let rev = pod::revision(&pod);
                if rev == self.current_name() {
                    self.counts.current += 1;
                }
                if rev == self.update_name() {
                    self.counts.updated += 1;
                }
                Ok(true)
            }
            // Its namespace is going: nothing more is made there.
            Err(e) if e.is_namespace_terminating() => Ok(false),
            Err(e) => {
                self.event(
                    EventType::Warning,
                    "FailedCreate",
                    &format!(
                        "create Pod {name} in StatefulSet {} failed error: {}",
                        self.set_name, e.message
                    ),
                );
                self.failures.push(format!("create pod {name}: {e}"));
                Ok(false)
            }
        }
    }

    fn delete(&mut self, p: &Value) -> Result<bool, String> {
        let name = pod::name(p).to_owned();
        let result = client::write(Write::Delete {
            resource: pods(),
            namespace: self.key.namespace.clone(),
            name: name.clone(),
            propagation: None,
            uid: p["metadata"]["uid"].as_str().map(str::to_owned),
        });
        match result {
            Ok(_) => {
                self.event(
                    EventType::Normal,
                    "SuccessfulDelete",
                    &format!(
                        "delete Pod {name} in StatefulSet {} successful",
                        self.set_name
                    ),
                );
                Ok(true)
            }
            Err(e) if e.is_not_found() => Ok(true),
            Err(e) => {
                self.event(
                    EventType::Warning,
                    "FailedDelete",
                    &format!(
                        "delete Pod {name} in StatefulSet {} failed error: {}",
                        self.set_name, e.message
                    ),
                );
                self.failures.push(format!("delete pod {name}: {e}"));
                Ok(false)
            }
        }
    }

    /// Puts the retention policy's owners on the pod's claims.
    fn fix_claim_owners(&mut self, p: &Value, ordinal: i64) -> Result<(), String> {
        let mut writes = Vec::new();
        for claim in pod_claims(self.set, ordinal) {
            let name = str_of(&claim, &["metadata", "name"]);
            let Some(existing) = cache::get(&claims(), self.ns(), name)? else {
                continue;
            };
            if let Some(refs) = retention_references(&existing, self.set, p, ordinal) {
                writes.push(Write::Patch {
                    resource: claims(),
                    namespace: self.key.namespace.clone(),
                    name: name.to_owned(),
                    patch_type: PatchType::Merge,
                    patch: json!({"metadata": {
                        "ownerReferences": refs,
                        "resourceVersion": existing["metadata"]["resourceVersion"],
                    }}),
                    status: false,
                    force: false,
                });
            }
        }
        if writes.is_empty() {
            return Ok(());
        }
        for result in client::batch(writes)? {
            match result {
                Ok(_) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => self
                    .failures
                    .push(format!("update the owners of a claim: {e}")),
            }
        }
        Ok(())
    }

    /// Gives a pod of the set the identity labels it lacks.
    fn fix_identity(&mut self, p: &Value, ordinal: i64) {
        let name = pod::name(p);
        let labels = &p["metadata"]["labels"];
        let index = ordinal.to_string();
        if labels[POD_NAME_LABEL] == name && labels[POD_INDEX_LABEL] == index.as_str() {
            return;
        }
        let patch = json!({"metadata": {"labels": {POD_NAME_LABEL: name, POD_INDEX_LABEL: index}}});
        if let Err(e) = client::patch(&pods(), self.ns(), name, PatchType::Merge, patch, false)
            && !e.is_not_found()
        {
            self.failures
                .push(format!("update the identity of pod {name}: {e}"));
        }
    }
}

impl Reconcile for StatefulSets {
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let Some(set) = cache::get(&key.resource, ns, &key.name)? else {
            // Deleted: its pods and revisions are the garbage collector's.
            return Ok(Action::Done);
        };
        let uid = str_of(&set, &["metadata", "uid"]).to_owned();
        let set_name = key.name.as_str();
        let selector = &set["spec"]["selector"];
        if owned::selector_is_empty(selector) {
            events::record(
                &set,
                EventType::Warning,
                "SelectingAll",
                "This statefulset is selecting all pods. A non-empty selector is required.",
            );
            return Ok(Action::Done);
        }
        let deleting = !set["metadata"]["deletionTimestamp"].is_null();

        // Claim: a matching pod named as one of the set's, without a controller, is
        // adopted; the set's pods that no longer match are released.
        let matching: Vec<Value> = cache::list_as(&pods(), ns, &owned::selector_string(selector)?)?;
        let mut mine = Vec::new();
        let mut claim = Vec::new();
        for p in matching {
            match owned::controller_of(&p).map(|r| r["uid"].as_str().unwrap_or_default()) {
                Some(c) if c == uid => mine.push(p),
                Some(_) => {}
                None if !deleting
                    && !pod::is_terminating(&p)
                    && ordinal(set_name, pod::name(&p)).is_some() =>
                {
                    claim.push(owned::adopt(
                        &pods(),
                        ns,
                        &p,
                        owned::controller_reference("apps/v1", "StatefulSet", &set),
                    ));
                    mine.push(p);
                }
                None => {}
            }
        }
        let owned_pods: Vec<Value> = cache::owned_by_as(&pods(), &uid)?;
        for p in owned_pods {
            if owned::is_controlled_by(&p, &uid)
                && !owned::selector_matches(selector, &p["metadata"]["labels"])
            {
                claim.push(owned::release(&pods(), ns, &p, &uid));
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
        // Only pods named as the set's are its replicas.
        mine.retain(|p| ordinal(set_name, pod::name(p)).is_some());

        let revisions = revision::resolve(&set, ns, revision::claimed(&set, ns)?)?;
        let mut pass = Pass {
            key,
            set: &set,
            set_name,
            revisions,
            counts: Counts::default(),
            recheck: None,
            failures,
        };

        // The status as the pods stand.
        let min_ready = set["spec"]["minReadySeconds"].as_i64().unwrap_or(0);
        let now = time::now();
        for p in &mine {
            pass.counts.replicas += 1;
            if pod::is_running_and_ready(p) {
                pass.counts.ready += 1;
            }
            match pod::available(p, min_ready, now) {
                Ok(true) => pass.counts.available += 1,
                Ok(false) => {}
                Err(wait) => pass.recheck = Some(pass.recheck.map_or(wait, |r| r.min(wait))),
            }
            if !pod::is_terminating(p) {
                if pod::revision(p) == pass.current_name() {
                    pass.counts.current += 1;
                }
                if pod::revision(p) == pass.update_name() {
                    pass.counts.updated += 1;
                }
            }
        }

        if !deleting && pass.failures.is_empty() {
            sync_pods(&mut pass, &mine, min_ready, now)?;
        }

        let live: Vec<&str> = mine.iter().map(pod::revision).collect();
        revision::truncate(&set, ns, &pass.revisions, &live)?;
        write_status(&pass)?;
        if !pass.failures.is_empty() {
            return Err(pass.failures.join("; "));
        }
        Ok(pass.recheck.map_or(Action::Done, Action::RequeueAfter))
    }
}

/// Makes, replaces and removes pods: Kubernetes' `updateStatefulSet` after the
/// revisions and the status are known.
fn sync_pods(pass: &mut Pass, mine: &[Value], min_ready: i64, now: i64) -> Result<(), String> {
    let set = pass.set;
    let start = start_ordinal(set);
    let end = start + replicas_of(set);
    let monotonic = set["spec"]["podManagementPolicy"].as_str() != Some("Parallel");

    // Replicas by ordinal in range; the others condemned, highest first.
    let mut replicas: Vec<Option<&Value>> = vec![None; usize::try_from(end - start).unwrap_or(0)];
    let mut condemned: Vec<(i64, &Value)> = Vec::new();
    for p in mine {
        let Some(o) = ordinal(pass.set_name, pod::name(p)) else {
            continue;
        };
        if (start..end).contains(&o) {
            replicas[usize::try_from(o - start).unwrap_or(0)] = Some(p);
        } else {
            condemned.push((o, p));
        }
    }
    condemned.sort_by_key(|(o, _)| std::cmp::Reverse(*o));
    // The lowest unhealthy pod, in range first, then among the condemned.
    let first_unhealthy: Option<i64> = replicas
        .iter()
        .enumerate()
        .find(|(_, p)| p.is_none_or(|p| !pod::is_healthy(p)))
        .map(|(i, _)| start + i64::try_from(i).unwrap_or(0))
        .or_else(|| {
            condemned
                .iter()
                .rev()
                .find(|(_, p)| !pod::is_healthy(p))
                .map(|(o, _)| *o)
        });

    for (i, slot) in replicas.iter().enumerate() {
        let o = start + i64::try_from(i).unwrap_or(0);
        match slot {
            None => {
                let made = pass.create(o)?;
                if monotonic || !made {
                    // In order: the next waits for this one to be Running and Ready.
                    if monotonic {
                        return Ok(());
                    }
                }
            }
            Some(p) if pod::is_finished(p) => {
                // Made again once it is gone.
                if !pod::is_terminating(p) {
                    let (kind, reason) = if p["status"]["phase"] == "Failed" {
                        (EventType::Warning, "RecreatingFailedPod")
                    } else {
                        (EventType::Normal, "RecreatingTerminatedPod")
                    };
                    let namespace = pass.ns().unwrap_or_default();
                    pass.event(
                        kind,
                        reason,
                        &format!(
                            "StatefulSet {namespace}/{} is recreating {} Pod {}",
                            pass.set_name,
                            if kind == EventType::Warning {
                                "failed"
                            } else {
                                "terminated"
                            },
                            pod::name(p)
                        ),
                    );
                    pass.delete(p)?;
                }
                if monotonic {
                    return Ok(());
                }
            }
            Some(p) => {
                if pod::is_pending(p)
                    && !pod::is_terminating(p)
                    && let Err(e) = pass.create_missing_claims(o)
                {
                    pass.failures.push(e);
                }
                if monotonic && pod::is_terminating(p) {
                    return Ok(());
                }
                if monotonic && pod::available(p, min_ready, now) != Ok(true) {
                    return Ok(());
                }
                pass.fix_identity(p, o);
                pass.fix_claim_owners(p, o)?;
            }
        }
    }

    for (o, p) in &condemned {
        pass.fix_claim_owners(p, *o)?;
    }
    for (o, p) in &condemned {
        if pod::is_terminating(p) {
            if monotonic {
                return Ok(());
            }
            continue;
        }
        // In order, an unhealthy pod halts the scale down, unless it is the first
        // unhealthy one (which would otherwise never go).
        if monotonic && pod::available(p, min_ready, now) != Ok(true) && first_unhealthy != Some(*o)
        {
            return Ok(());
        }
        pass.delete(p)?;
        if monotonic {
            return Ok(());
        }
    }

    let strategy = &set["spec"]["updateStrategy"];
    if strategy["type"].as_str().unwrap_or("RollingUpdate") != "RollingUpdate" {
        return Ok(());
    }
    // Replace pods of an old revision from the highest ordinal down to the
    // partition, while fewer than maxUnavailable are unavailable.
    let rolling = &strategy["rollingUpdate"];
    let partition = rolling["partition"].as_i64().unwrap_or(0);
    let update = pass.update_name().to_owned();
    let first = usize::try_from(partition.max(0)).unwrap_or(0);
    if rolling["maxUnavailable"].is_null() {
        // One at a time: the highest pod of an old revision goes once every pod
        // above it is healthy.
        for slot in replicas.iter().skip(first).rev() {
            let Some(p) = slot else {
                return Ok(());
            };
            if pod::revision(p) != update && !pod::is_terminating(p) {
                if pass.delete(p)? {
                    pass.counts.current -= 1;
                }
                return Ok(());
            }
            if !pod::is_healthy(p) {
                return Ok(());
            }
        }
        return Ok(());
    }
    let max_unavailable = match &rolling["maxUnavailable"] {
        Value::Number(n) => n.as_i64().unwrap_or(1),
        Value::String(s) => s
            .strip_suffix('%')
            .and_then(|p| p.parse::<i64>().ok())
            .map_or(1, |p| (p * replicas_of(set) + 99) / 100),
        _ => 1,
    }
    .max(1);
    let unavailable = replicas
        .iter()
        .filter(|p| p.is_none_or(|p| !pod::is_healthy(p)))
        .count();
    let mut budget = max_unavailable - i64::try_from(unavailable).unwrap_or(i64::MAX);
    for slot in replicas.iter().skip(first).rev() {
        if budget <= 0 {
            break;
        }
        if let Some(p) = slot
            && pod::revision(p) != update
            && !pod::is_terminating(p)
            && pass.delete(p)?
        {
            pass.counts.current -= 1;
            budget -= 1;
        }
    }
    Ok(())
}

/// Patches the status when it says something new.
fn write_status(pass: &Pass) -> Result<(), String> {
    let set = pass.set;
    let c = &pass.counts;
    let mut current_revision = pass.current_name().to_owned();
    let mut current = c.current;
    let rolling = set["spec"]["updateStrategy"]["type"]
        .as_str()
        .unwrap_or("RollingUpdate")
        == "RollingUpdate";
    // The rolling update is complete: the update revision is the current one.
    if rolling && c.updated == c.replicas && c.ready == c.replicas {
        current = c.updated;
        current_revision = pass.update_name().to_owned();
    }
    let mut status = json!({
        "observedGeneration": set["metadata"]["generation"],
        "replicas": c.replicas,
        "availableReplicas": c.available,
        "currentRevision": current_revision,
        "updateRevision": pass.update_name(),
        "collisionCount": pass.revisions.collision_count,
    });
    // Zero counts are omitted, as Kubernetes stores them.
    for (field, n) in [
        ("readyReplicas", c.ready),
        ("currentReplicas", current),
        ("updatedReplicas", c.updated),
    ] {
        status[field] = if n > 0 { json!(n) } else { Value::Null };
    }
    let stored = &set["status"];
    let same = status
        .as_object()
        .into_iter()
        .flatten()
        .all(|(k, v)| stored.get(k).unwrap_or(&Value::Null) == v);
    if same {
        return Ok(());
    }
    client::patch_status(&pass.key.resource, pass.ns(), &pass.key.name, status)
        .map_err(|e| format!("update the status: {e}"))?;
    Ok(())
}

trellis_plugin::controller!(StatefulSets);

#[cfg(test)]
mod tests;
