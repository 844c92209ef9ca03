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

use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{
    Action, ApiError, EventType, ObjectKey, PatchType, Propagation, Reconcile, Write, cache,
    client, events, owned, time,
};

pub const REVISION: &str = "deployment.kubernetes.io/revision";
const REVISION_HISTORY: &str = "deployment.kubernetes.io/revision-history";
const DESIRED_REPLICAS: &str = "deployment.kubernetes.io/desired-replicas";
const MAX_REPLICAS: &str = "deployment.kubernetes.io/max-replicas";
pub const HASH_LABEL: &str = "pod-template-hash";
/// Annotations of the Deployment not copied to its ReplicaSets.
const NOT_COPIED: [&str; 5] = [
    "kubectl.kubernetes.io/last-applied-configuration",
    REVISION,
    REVISION_HISTORY,
    DESIRED_REPLICAS,
    MAX_REPLICAS,
];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deployments {}

fn replicasets() -> GroupVersionResource {
    GroupVersionResource {
        group: "apps".into(),
        version: "v1".into(),
        resource: "replicasets".into(),
    }
}

/// FNV-1a, 32 bits.
fn fnv32a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

/// The hash of a template (and collision count) as the label value Kubernetes uses:
/// the decimal digits mapped onto consonants and digits that spell no words.
pub fn template_hash(template: &Value, collision_count: Option<i64>) -> String {
    const ALPHANUMS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    // serde_json's maps are sorted: the same template always hashes the same.
    let mut text = template.to_string();
    if let Some(c) = collision_count {
        text.push_str(&c.to_string());
    }
    fnv32a(text.as_bytes())
        .to_string()
        .bytes()
        .map(|b| char::from(ALPHANUMS[usize::from(b) % ALPHANUMS.len()]))
        .collect()
}

/// Whether two templates are the same but for `pod-template-hash`.
pub fn same_template(a: &Value, b: &Value) -> bool {
    let strip = |t: &Value| {
        let mut t = t.clone();
        if let Some(labels) = t["metadata"]["labels"].as_object_mut() {
            labels.remove(HASH_LABEL);
        }
        t
    };
    strip(a) == strip(b)
}

/// A count or a percentage of `total` (`"25%"`), rounded up or down.
pub fn scaled(value: &Value, total: i64, round_up: bool) -> Result<i64, String> {
    match value {
        Value::Null => Ok(0),
        Value::Number(n) => n.as_i64().ok_or_else(|| format!("{n}: not an integer")),
        Value::String(s) => {
            let pct: i64 = s
                .strip_suffix('%')
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("{s:?}: not a count or a percentage"))?;
            let x = pct * total;
            Ok(if round_up { (x + 99) / 100 } else { x / 100 })
        }
        other => Err(format!("{other}: not a count or a percentage")),
    }
}

/// The Deployment's `(maxSurge, maxUnavailable)` as counts; both 0 would never
/// progress, so unavailability is then 1, as Kubernetes resolves them.
pub fn fenceposts(d: &Value) -> Result<(i64, i64), String> {
    let rolling = &d["spec"]["strategy"]["rollingUpdate"];
    let replicas = replicas_of(d);
    let default = json!("25%");
    let surge = rolling.get("maxSurge").unwrap_or(&default);
    let unavailable = rolling.get("maxUnavailable").unwrap_or(&default);
    let surge = scaled(surge, replicas, true).map_err(|e| format!("maxSurge: {e}"))?;
    let unavailable =
        scaled(unavailable, replicas, false).map_err(|e| format!("maxUnavailable: {e}"))?;
    Ok(if surge == 0 && unavailable == 0 {
        (0, 1)
    } else {
        (surge, unavailable.min(replicas))
    })
}

fn replicas_of(d: &Value) -> i64 {
    d["spec"]["replicas"].as_i64().unwrap_or(1)
}

fn is_rolling(d: &Value) -> bool {
    d["spec"]["strategy"]["type"].as_str() != Some("Recreate")
}

/// What the controller reads of a ReplicaSet.
#[derive(Clone, Debug)]
pub struct Set {
    pub object: Value,
    pub name: String,
    pub replicas: i64,
    pub status_replicas: i64,
    pub ready: i64,
    pub available: i64,
    pub revision: i64,
    created: String,
}

impl Set {
    pub fn new(object: Value) -> Self {
        let int = |v: &Value| v.as_i64().unwrap_or(0);
        Self {
            name: object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            replicas: int(&object["spec"]["replicas"]),
            status_replicas: int(&object["status"]["replicas"]),
            ready: int(&object["status"]["readyReplicas"]),
            available: int(&object["status"]["availableReplicas"]),
            revision: annotation(&object, REVISION)
                .and_then(|r| r.parse().ok())
                .unwrap_or(0),
            created: object["metadata"]["creationTimestamp"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            object,
        }
    }

    fn annotated(&self, key: &str) -> Option<i64> {
        annotation(&self.object, key).and_then(|v| v.parse().ok())
    }
}

fn annotation<'a>(obj: &'a Value, key: &str) -> Option<&'a str> {
    obj["metadata"]["annotations"][key].as_str()
}

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

    /// Finds or creates the new ReplicaSet and sets the revisions: the new set's is
    /// one more than the highest old one's, and the Deployment shows it.
    fn sync_revision(&mut self, create: bool) -> Result<(), String> {
        let max_old = self.old.iter().map(|s| s.revision).max().unwrap_or(0);
        let revision = max_old + 1;
        if let Some(new) = self.new.clone() {
            let mut annotations = Map::new();
            if new.revision < revision {
                annotations.insert(REVISION.into(), json!(revision.to_string()));
                // A template rolled back to: its earlier revisions are kept.
                if new.revision > 0 {
                    let history = match annotation(&new.object, REVISION_HISTORY) {
                        Some(h) if !h.is_empty() => format!("{h},{}", new.revision),
                        _ => new.revision.to_string(),
                    };
                    annotations.insert(REVISION_HISTORY.into(), json!(history));
                }
            }
            let min_ready = &self.d["spec"]["minReadySeconds"];
            let mut patch = json!({});
            if !annotations.is_empty() {
                patch["metadata"] = json!({"annotations": annotations});
            }
            if new.object["spec"]["minReadySeconds"].as_i64().unwrap_or(0)
                != min_ready.as_i64().unwrap_or(0)
            {
                patch["spec"] = json!({"minReadySeconds": min_ready});
            }
            if patch != json!({}) {
                let updated = client::patch(
                    &replicasets(),
                    self.ns(),
                    &new.name,
                    PatchType::Merge,
                    patch,
                    false,
                )
                .map_err(|e| format!("update ReplicaSet {}: {e}", new.name))?;
                self.new = Some(Set::new(updated));
            }
            if self.progressing_condition().is_none() {
                self.progressing = Some((
                    "FoundNewReplicaSet",
                    format!("Found new replica set {:?}", new.name),
                ));
            }
        } else if create {
            self.create_new(revision)?;
        }
        let shown = self.new.as_ref().map_or(max_old, |n| n.revision.max(0));
        if shown > 0 && annotation(&self.d, REVISION) != Some(shown.to_string().as_str()) {
            self.d = client::patch(
                &self.key.resource,
                self.ns(),
                &self.key.name,
                PatchType::Merge,
                json!({"metadata": {"annotations": {REVISION: shown.to_string()}}}),
                false,
            )
            .map_err(|e| format!("update the revision: {e}"))?;
        }
        Ok(())
    }

    /// How many pods the new set starts with.
    fn new_set_replicas(&self, current: i64) -> Result<i64, String> {
        if !is_rolling(&self.d) {
            return Ok(self.replicas());
        }
        let total: i64 = self.all().map(|s| s.replicas).sum();
        let most = self.replicas() + self.max_surge()?;
        if total >= most {
            return Ok(current);
        }
        Ok(current + (most - total).min(self.replicas() - current).max(0))
    }

    fn create_new(&mut self, revision: i64) -> Result<(), String> {
        let collisions = self.d["status"]["collisionCount"].as_i64();
        let hash = template_hash(&self.d["spec"]["template"], collisions);
        let name = format!("{}-{hash}", self.key.name);
        let mut template = self.d["spec"]["template"].clone();
        template["metadata"]["labels"][HASH_LABEL] = json!(hash);
        let mut selector = self.d["spec"]["selector"].clone();
        selector["matchLabels"][HASH_LABEL] = json!(hash);
        let mut annotations: Map<String, Value> = self.d["metadata"]["annotations"]
            .as_object()
            .cloned()
            .unwrap_or_default();
        annotations.retain(|k, _| !NOT_COPIED.contains(&k.as_str()));
        annotations.insert(REVISION.into(), json!(revision.to_string()));
        annotations.insert(DESIRED_REPLICAS.into(), json!(self.replicas().to_string()));
        annotations.insert(
            MAX_REPLICAS.into(),
            json!((self.replicas() + self.max_surge()?).to_string()),
        );
        let replicas = self.new_set_replicas(0)?;
        let rs = json!({
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": name,
                "labels": template["metadata"]["labels"],
                "annotations": annotations,
                "ownerReferences": [owned::controller_reference("apps/v1", "Deployment", &self.d)],
            },
            "spec": {
                "replicas": replicas,
                "minReadySeconds": self.d["spec"]["minReadySeconds"].as_i64().unwrap_or(0),
                "selector": selector,
                "template": template,
            },
        });
        match client::create(&replicasets(), self.ns(), rs) {
            Ok(created) => {
                if replicas > 0 {
                    events::record(
                        &self.d,
                        EventType::Normal,
                        "ScalingReplicaSet",
                        &format!("Scaled up replica set {name} from 0 to {replicas}"),
                    );
                }
                self.new = Some(Set::new(created));
                self.progressing = Some((
                    "NewReplicaSetCreated",
                    format!("Created new replica set {name:?}"),
                ));
                Ok(())
            }
            // Its namespace is being deleted: nothing to roll out.
            Err(e) if e.is_namespace_terminating() => Ok(()),
            Err(e) if e.is_already_exists() => {
                // Another template with the same hash: count the collision, so the
                // next pass hashes differently.
                let count = collisions.unwrap_or(0) + 1;
                client::patch(
                    &self.key.resource,
                    self.ns(),
                    &self.key.name,
                    PatchType::Merge,
                    json!({"status": {"collisionCount": count}}),
                    true,
                )
                .map_err(|e| format!("count a hash collision: {e}"))?;
                Err(format!(
                    "ReplicaSet {name} exists with another template: collision count now {count}"
                ))
            }
            Err(e) => {
                events::record(
                    &self.d,
                    EventType::Warning,
                    "FailedCreate",
                    &format!("Failed to create new replica set {name:?}: {}", e.message),
                );
                Err(format!("create ReplicaSet {name}: {e}"))
            }
        }
    }

    /// Scales one set, with the annotations that say for what size of Deployment.
    fn scale_set(&mut self, which: Which, to: i64) -> Result<bool, String> {
        let set = match which {
            Which::New => self.new.as_ref(),
            Which::Old(i) => self.old.get(i),
        }
        .ok_or("no such ReplicaSet")?
        .clone();
        let desired = self.replicas().to_string();
        let max = (self.replicas() + self.max_surge()?).to_string();
        if set.replicas == to
            && annotation(&set.object, DESIRED_REPLICAS) == Some(desired.as_str())
            && annotation(&set.object, MAX_REPLICAS) == Some(max.as_str())
        {
            return Ok(false);
        }
        let updated = client::patch(
            &replicasets(),
            self.ns(),
            &set.name,
            PatchType::Merge,
            json!({
                "metadata": {"annotations": {DESIRED_REPLICAS: desired, MAX_REPLICAS: max}},
                "spec": {"replicas": to},
            }),
            false,
        )
        .map_err(|e: ApiError| format!("scale ReplicaSet {}: {e}", set.name))?;
        if set.replicas != to {
            let verb = if to > set.replicas { "up" } else { "down" };
            events::record(
                &self.d,
                EventType::Normal,
                "ScalingReplicaSet",
                &format!(
                    "Scaled {verb} replica set {} from {} to {to}",
                    set.name, set.replicas
                ),
            );
        }
        let updated = Set::new(updated);
        match which {
            Which::New => self.new = Some(updated),
            Which::Old(i) => self.old[i] = updated,
        }
        Ok(set.replicas != to)
    }

    /// Whether `spec.replicas` changed since the active sets were sized.
    fn is_scaling_event(&self) -> bool {
        let desired = self.replicas();
        self.all()
            .filter(|s| s.replicas > 0)
            .any(|s| s.annotated(DESIRED_REPLICAS).is_some_and(|d| d != desired))
    }

    /// Sizes the sets for `spec.replicas`: the only active one directly, a saturated
    /// new set by retiring the old ones, several active ones proportionally.
    fn scale(&mut self) -> Result<(), String> {
        let active: Vec<Which> = self
            .sets()
            .into_iter()
            .filter(|w| self.get(*w).replicas > 0)
            .collect();
        let only = match active.as_slice() {
            [one] => Some(*one),
            [] => self
                .new
                .as_ref()
                .map(|_| Which::New)
                .or_else(|| self.latest_old()),
            _ => None,
        };
        if let Some(one) = only {
            self.scale_set(one, self.replicas())?;
            return Ok(());
        }
        let saturated = self.new.as_ref().is_some_and(|n| {
            n.replicas == self.replicas()
                && n.annotated(DESIRED_REPLICAS) == Some(self.replicas())
                && n.available >= self.replicas()
        });
        if saturated {
            for i in 0..self.old.len() {
                self.scale_set(Which::Old(i), 0)?;
            }
            return Ok(());
        }
        if !is_rolling(&self.d) {
            return Ok(());
        }
        let total: i64 = active.iter().map(|w| self.get(*w).replicas).sum();
        let allowed = if self.replicas() > 0 {
            self.replicas() + self.max_surge()?
        } else {
            0
        };
        let to_add = allowed - total;
        let mut order = active.clone();
        // Largest first; on a tie the newer when growing, the older when shrinking.
        order.sort_by(|a, b| {
            let (a, b) = (self.get(*a), self.get(*b));
            b.replicas.cmp(&a.replicas).then(if to_add > 0 {
                b.created.cmp(&a.created)
            } else {
                a.created.cmp(&b.created)
            })
        });
        let mut sizes: Vec<(Which, i64)> = Vec::new();
        let mut added = 0;
        for w in &order {
            let set = self.get(*w);
            let share = if to_add == 0 || added == to_add {
                0
            } else {
                let fraction = self.fraction(set)?;
                let left = to_add - added;
                if to_add > 0 {
                    fraction.min(left)
                } else {
                    fraction.max(left)
                }
            };
            added += share;
            sizes.push((*w, set.replicas + share));
        }
        if let Some(first) = sizes.first_mut() {
            first.1 = (first.1 + to_add - added).max(0);
        }
        for (w, size) in sizes {
            self.scale_set(w, size)?;
        }
        Ok(())
    }

    /// The set's share of a resize: its size scaled from the Deployment size it was
    /// sized for to the new one.
    fn fraction(&self, set: &Set) -> Result<i64, String> {
        if self.replicas() == 0 {
            return Ok(-set.replicas);
        }
        let target = self.replicas() + self.max_surge()?;
        let was = set
            .annotated(MAX_REPLICAS)
            .unwrap_or_else(|| self.d["status"]["replicas"].as_i64().unwrap_or(0));
        if was == 0 {
            return Ok(0);
        }
        // Rounded to the nearest, as Kubernetes does.
        let size = (set.replicas * target * 2 + was) / (2 * was);
        Ok(size - set.replicas)
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

    fn rolling(mut self) -> Result<Action, String> {
        // Up: the new set within the surge.
        let Some(new) = self.new.as_ref() else {
            return self.sync_status();
        };
        let (new_replicas, current) = (new.replicas, new.replicas);
        let scaled_up = if new_replicas > self.replicas() {
            self.scale_set(Which::New, self.replicas())?
        } else {
            let target = self.new_set_replicas(current)?;
            self.scale_set(Which::New, target)?
        };
        if scaled_up && self.new.as_ref().is_some_and(|n| n.replicas > current) {
            return self.sync_status();
        }
        // Down: the old sets within the unavailability allowed.
        if self.scale_down_old()? {
            return self.sync_status();
        }
        if self.is_complete() {
            self.cleanup()?;
        }
        self.sync_status()
    }

    /// Scales old sets down as far as `maxUnavailable` allows: their unhealthy pods
    /// first, then available ones, oldest sets first.
    fn scale_down_old(&mut self) -> Result<bool, String> {
        let old_total: i64 = self.old.iter().map(|s| s.replicas).sum();
        if old_total == 0 {
            return Ok(false);
        }
        let all_total: i64 = self.all().map(|s| s.replicas).sum();
        let (_, max_unavailable) = fenceposts(&self.d)?;
        let min_available = self.replicas() - max_unavailable;
        let new_unavailable = self
            .new
            .as_ref()
            .map_or(0, |n| (n.replicas - n.available).max(0));
        let mut budget = all_total - min_available - new_unavailable;
        if budget <= 0 {
            return Ok(false);
        }
        let mut order: Vec<usize> = (0..self.old.len()).collect();
        order.sort_by(|a, b| self.old[*a].created.cmp(&self.old[*b].created));
        let mut scaled = false;
        // Unhealthy pods cost no availability.
        for &i in &order {
            if budget <= 0 {
                break;
            }
            let set = &self.old[i];
            // A status older than the last scale-down may count more available
            // pods than the set now asks for: nothing unhealthy to remove then.
            if set.replicas == 0 || set.available >= set.replicas {
                continue;
            }
            let down = (set.replicas - set.available).min(budget);
            let to = set.replicas - down;
            budget -= down;
            scaled |= self.scale_set(Which::Old(i), to)?;
        }
        // Then available pods, as long as enough stay available.
        let available: i64 = self.all().map(|s| s.available).sum();
        let mut allowed = available - min_available;
        for &i in &order {
            if allowed <= 0 {
                break;
            }
            let set = &self.old[i];
            if set.replicas == 0 {
                continue;
            }
            let down = set.replicas.min(allowed);
            allowed -= down;
            scaled |= self.scale_set(Which::Old(i), set.replicas - down)?;
        }
        Ok(scaled)
    }

    fn recreate(mut self) -> Result<Action, String> {
        let mut scaled = false;
        for i in 0..self.old.len() {
            if self.old[i].replicas > 0 {
                scaled |= self.scale_set(Which::Old(i), 0)?;
            }
        }
        if scaled {
            return self.sync_status();
        }
        // The old pods must be gone before a new one starts.
        if self.old.iter().any(|s| s.status_replicas > 0) {
            return self.sync_status();
        }
        if self.new.is_none() {
            let revision = self.old.iter().map(|s| s.revision).max().unwrap_or(0) + 1;
            self.create_new(revision)?;
        }
        if self.new.is_some() {
            self.scale_set(Which::New, self.replicas())?;
        }
        if self.is_complete() {
            self.cleanup()?;
        }
        self.sync_status()
    }

    /// Deletes old, empty sets beyond `revisionHistoryLimit`, oldest first.
    fn cleanup(&mut self) -> Result<(), String> {
        let Some(limit) = self.d["spec"]["revisionHistoryLimit"].as_i64() else {
            return Ok(());
        };
        let mut empty: Vec<&Set> = self
            .old
            .iter()
            .filter(|s| {
                s.replicas == 0
                    && s.status_replicas == 0
                    && s.object["metadata"]["deletionTimestamp"].is_null()
                    && s.object["status"]["observedGeneration"].as_i64()
                        >= s.object["metadata"]["generation"].as_i64()
            })
            .collect();
        let excess = usize::try_from(i64::try_from(empty.len()).unwrap_or(0) - limit).unwrap_or(0);
        if excess == 0 {
            return Ok(());
        }
        empty.sort_by(|a, b| a.revision.cmp(&b.revision).then(a.created.cmp(&b.created)));
        let writes = empty[..excess]
            .iter()
            .map(|s| Write::Delete {
                resource: replicasets(),
                namespace: self.key.namespace.clone(),
                name: s.name.clone(),
                propagation: Some(Propagation::Background),
                uid: s.object["metadata"]["uid"].as_str().map(str::to_owned),
            })
            .collect();
        for result in client::batch(writes)? {
            match result {
                Ok(_) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(format!("delete an old ReplicaSet: {e}")),
            }
        }
        Ok(())
    }

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
    fn is_complete(&self) -> bool {
        let c = self.counts();
        let r = self.replicas();
        c.updated == r && c.replicas == r && c.available == r
    }

    fn progressing_condition(&self) -> Option<&Value> {
        self.d["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Progressing")
    }

    /// Computes and writes the status; when a rollout is under way with a deadline,
    /// asks to be called again when the deadline would pass.
    fn sync_status(self) -> Result<Action, String> {
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Which {
    New,
    Old(usize),
}

struct Counts {
    replicas: i64,
    updated: i64,
    ready: i64,
    available: i64,
    unavailable: i64,
}

trellis_plugin::controller!(Deployments);

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_plugin::testing::ControllerHarness;

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

    #[test]
    fn surge_rounds_up_and_unavailability_down() {
        let d = |surge: Value, unavailable: Value, replicas: i64| {
            json!({"spec": {"replicas": replicas, "strategy": {"type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}}})
        };
        assert_eq!(
            fenceposts(&d(json!("25%"), json!("25%"), 10)).unwrap(),
            (3, 2)
        );
        assert_eq!(fenceposts(&d(json!(0), json!(0), 10)).unwrap(), (0, 1));
        assert_eq!(fenceposts(&d(json!(2), json!("100%"), 4)).unwrap(), (2, 4));
        assert_eq!(
            fenceposts(&json!({"spec": {"replicas": 1000}})).unwrap(),
            (250, 250)
        );
        assert!(fenceposts(&d(json!("x"), json!(1), 1)).is_err());
    }

    #[test]
    fn the_hash_is_stable_ignores_the_hash_label_and_changes_with_collisions() {
        let t = json!({"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}});
        let h = template_hash(&t, None);
        assert_eq!(h, template_hash(&t.clone(), None));
        assert_ne!(h, template_hash(&t, Some(1)));
        assert!(h.chars().all(|c| "bcdfghjklmnpqrstvwxz2456789".contains(c)));
        let mut labelled = t.clone();
        labelled["metadata"]["labels"][HASH_LABEL] = json!(h);
        assert!(same_template(&labelled, &t));
        let mut other = t.clone();
        other["spec"]["containers"][0]["image"] = json!("j");
        assert!(!same_template(&other, &t));
    }

    #[test]
    fn fnv_matches_its_reference_values() {
        assert_eq!(fnv32a(b""), 0x811c_9dc5);
        assert_eq!(fnv32a(b"a"), 0xe40c_292c);
        assert_eq!(fnv32a(b"foobar"), 0xbf9c_f968);
    }
}
