//! Syncing a Deployment's sets (Kubernetes' `sync.go`): the new ReplicaSet found or
//! created with its revision, sets scaled (proportionally on a resize), and old
//! empty sets beyond the history limit deleted.

use serde_json::{Map, Value, json};
use trellis_plugin::controller::{
    ApiError, EventType, PatchType, Propagation, Write, client, events, owned,
};

use crate::util::{
    DESIRED_REPLICAS, HASH_LABEL, MAX_REPLICAS, NOT_COPIED, REVISION, REVISION_HISTORY, Set,
    annotation, is_rolling, replicasets, template_hash,
};
use crate::{Pass, Which};

impl Pass<'_> {
    /// Finds or creates the new ReplicaSet and sets the revisions: the new set's is
    /// one more than the highest old one's, and the Deployment shows it.
    pub(crate) fn sync_revision(&mut self, create: bool) -> Result<(), String> {
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
    pub(crate) fn new_set_replicas(&self, current: i64) -> Result<i64, String> {
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

    pub(crate) fn create_new(&mut self, revision: i64) -> Result<(), String> {
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
    pub(crate) fn scale_set(&mut self, which: Which, to: i64) -> Result<bool, String> {
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
    pub(crate) fn is_scaling_event(&self) -> bool {
        let desired = self.replicas();
        self.all()
            .filter(|s| s.replicas > 0)
            .any(|s| s.annotated(DESIRED_REPLICAS).is_some_and(|d| d != desired))
    }

    /// Sizes the sets for `spec.replicas`: the only active one directly, a saturated
    /// new set by retiring the old ones, several active ones proportionally.
    pub(crate) fn scale(&mut self) -> Result<(), String> {
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

    /// Deletes old, empty sets beyond `revisionHistoryLimit`, oldest first.
    pub(crate) fn cleanup(&mut self) -> Result<(), String> {
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
}
