//! VolumeBinding, kube-scheduler's plugin for pods with PersistentVolumeClaims, in
//! the host (it reads claims, volumes and classes, which the plugins' world does not
//! carry):
//! - PreFilter ([`Volumes::nodes_for`]): every claim must exist and not be being
//!   deleted; a bound claim's volume must exist, and its `nodeAffinity` narrows the
//!   nodes (a local volume lives on one node); an unbound claim must be of a
//!   `WaitForFirstConsumer` class (a claim of another class waits for the binder:
//!   "unbound immediate PersistentVolumeClaims"); one whose node was already
//!   selected keeps that node.
//! - PreBind ([`pre_bind`], in the binding task): each unbound claim of a
//!   `WaitForFirstConsumer` class is annotated `volume.kubernetes.io/selected-node`
//!   with the chosen node, for its provisioner, and the pod is bound only once all
//!   its claims are (within [`BIND_TIMEOUT`]).
//!
//! Left out: static volumes considered for delayed claims (a `WaitForFirstConsumer`
//! claim is provisioned, not matched here; the binder still binds a fitting static
//! volume first), CSI capacity, generic ephemeral volumes' claims.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Node, NodeSelector, NodeSelectorRequirement, PersistentVolume, PersistentVolumeClaim, Pod,
};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use serde_json::json;
use tokio::sync::mpsc;
use trellis_client::informer::{Change, Informer, SharedInformers};

use crate::cache::{Cache, NodeId};
use crate::queue::{Action, Event};

/// The annotation that tells a claim's provisioner where its first pod goes.
pub const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
/// The name pods rejected here are rejected by.
pub const PLUGIN: &str = "VolumeBinding";
/// How long a bind waits for its pod's claims to be bound (kube-scheduler's
/// `bindTimeoutSeconds`); then the pod is scheduled again.
pub const BIND_TIMEOUT: Duration = Duration::from_secs(600);

/// The claims, volumes and classes the scheduler reads, from informers.
pub(crate) struct Volumes {
    claims: Arc<Informer<PersistentVolumeClaim>>,
    volumes: Arc<Informer<PersistentVolume>>,
    classes: Arc<Informer<StorageClass>>,
}

/// The claims a pod's volumes name, in its namespace.
fn claim_names(pod: &Pod) -> Vec<&str> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter_map(|v| v.persistent_volume_claim.as_ref())
        .map(|c| c.claim_name.as_str())
        .collect()
}

fn bound_volume(claim: &PersistentVolumeClaim) -> Option<&str> {
    claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .filter(|v| !v.is_empty())
}

fn class_name(claim: &PersistentVolumeClaim) -> &str {
    claim
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.as_deref())
        .unwrap_or("")
}

fn waits_for_consumer(class: Option<&StorageClass>) -> bool {
    class.and_then(|c| c.volume_binding_mode.as_deref()) == Some("WaitForFirstConsumer")
}

impl Volumes {
    /// Starts the informers (without waiting for them: only pods with claims read
    /// them).
    pub(crate) fn new(client: &kube::Client, informers: &SharedInformers) -> Self {
        Self {
            claims: informers.informer(Api::all(client.clone()), watcher::Config::default()),
            volumes: informers.informer(Api::all(client.clone()), watcher::Config::default()),
            classes: informers.informer(Api::all(client.clone()), watcher::Config::default()),
        }
    }

    /// The changes of claims, volumes and classes, as the queue's events: a pod this
    /// plugin rejected tries again on one (a claim created, bound, its volume made).
    pub(crate) fn events(&self) -> mpsc::UnboundedReceiver<Event> {
        let (tx, rx) = mpsc::unbounded_channel();
        forward(
            self.claims.subscribe(),
            "persistentvolumeclaims",
            tx.clone(),
        );
        forward(self.volumes.subscribe(), "persistentvolumes", tx.clone());
        forward(self.classes.subscribe(), "storageclasses", tx);
        rx
    }

    /// The events a pod rejected here waits for.
    pub(crate) fn interests() -> HashSet<Event> {
        [
            "persistentvolumeclaims",
            "persistentvolumes",
            "storageclasses",
            "nodes",
        ]
        .into_iter()
        .flat_map(|resource| {
            [Action::Add, Action::Update].map(|action| Event {
                resource: resource.to_owned(),
                action,
            })
        })
        .collect()
    }

    /// The nodes the pod's claims allow (`None`: any), or why none can be.
    pub(crate) fn nodes_for(
        &self,
        pod: &Pod,
        cache: &Cache,
    ) -> Result<Option<HashSet<NodeId>>, String> {
        let names = claim_names(pod);
        if names.is_empty() {
            return Ok(None);
        }
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        let mut affinities: Vec<NodeSelector> = Vec::new();
        let mut selected: Option<String> = None;
        for name in names {
            let claim = self
                .claims
                .get(&format!("{namespace}/{name}"))
                .ok_or_else(|| format!("persistentvolumeclaim \"{name}\" not found"))?;
            if claim.metadata.deletion_timestamp.is_some() {
                return Err(format!("persistentvolumeclaim \"{name}\" is being deleted"));
            }
            match bound_volume(&claim) {
                Some(volume_name) => {
                    let volume = self
                        .volumes
                        .get(volume_name)
                        .ok_or_else(|| "pvc(s) bound to non-existent pv(s)".to_owned())?;
                    if let Some(required) = volume
                        .spec
                        .as_ref()
                        .and_then(|s| s.node_affinity.as_ref())
                        .and_then(|a| a.required.clone())
                    {
                        affinities.push(required);
                    }
                }
                None => {
                    let class = self.classes.get(class_name(&claim));
                    if !waits_for_consumer(class.as_deref()) {
                        return Err("pod has unbound immediate PersistentVolumeClaims".into());
                    }
                    if let Some(node) = claim
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(SELECTED_NODE))
                    {
                        selected = Some(node.clone());
                    }
                }
            }
        }
        if affinities.is_empty() && selected.is_none() {
            return Ok(None);
        }
        Ok(Some(
            cache
                .node_ids()
                .into_iter()
                .filter(|id| {
                    cache.node(*id).is_some_and(|node| {
                        let name = node.metadata.name.as_deref().unwrap_or("");
                        selected.as_deref().is_none_or(|s| s == name)
                            && affinities.iter().all(|a| selector_matches(a, node))
                    })
                })
                .collect(),
        ))
    }
}

fn forward<K: Send + Sync + 'static>(
    mut changes: mpsc::UnboundedReceiver<Change<K>>,
    resource: &'static str,
    tx: mpsc::UnboundedSender<Event>,
) {
    tokio::spawn(async move {
        while let Some(change) = changes.recv().await {
            let action = match change {
                Change::Added(_) => Action::Add,
                Change::Updated { .. } => Action::Update,
                Change::Deleted(_) => Action::Delete,
            };
            let event = Event {
                resource: resource.to_owned(),
                action,
            };
            if tx.send(event).is_err() {
                return;
            }
        }
    });
}

/// Whether `node` satisfies `selector` (its terms ORed, each term's requirements
/// ANDed), as a volume's node affinity is read.
pub fn selector_matches(selector: &NodeSelector, node: &Node) -> bool {
    let labels = node.metadata.labels.as_ref();
    let name = node.metadata.name.as_deref().unwrap_or("");
    selector.node_selector_terms.iter().any(|term| {
        let expressions = term.match_expressions.iter().flatten();
        let fields = term.match_fields.iter().flatten();
        let has_any = term
            .match_expressions
            .as_ref()
            .is_some_and(|e| !e.is_empty())
            || term.match_fields.as_ref().is_some_and(|f| !f.is_empty());
        has_any
            && expressions.into_iter().all(|r| {
                requirement_matches(r, labels.and_then(|l| l.get(&r.key)).map(String::as_str))
            })
            && fields
                .into_iter()
                .all(|r| r.key == "metadata.name" && requirement_matches(r, Some(name)))
    })
}

fn requirement_matches(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => match (
            value.and_then(number),
            values.first().and_then(|s| number(s)),
        ) {
            (Some(v), Some(bound)) => {
                if r.operator == "Gt" {
                    v > bound
                } else {
                    v < bound
                }
            }
            _ => false,
        },
        _ => false,
    }
}

/// PreBind: the pod's unbound claims of `WaitForFirstConsumer` classes learn their
/// node, and the bind waits until every claim of the pod is bound.
pub(crate) async fn pre_bind(client: &kube::Client, pod: &Pod, node: &str) -> Result<(), String> {
    let names = claim_names(pod);
    if names.is_empty() {
        return Ok(());
    }
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    let classes: Api<StorageClass> = Api::all(client.clone());
    let mut waiting = Vec::new();
    for name in names {
        let claim = claims
            .get(name)
            .await
            .map_err(|e| format!("read persistentvolumeclaim {namespace}/{name}: {e}"))?;
        if bound_volume(&claim).is_some() {
            continue;
        }
        let selected = claim
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(SELECTED_NODE));
        if selected.is_none_or(|s| s != node) {
            let class = classes
                .get_opt(class_name(&claim))
                .await
                .map_err(|e| format!("read the class of claim {namespace}/{name}: {e}"))?;
            if waits_for_consumer(class.as_ref()) {
                let patch = json!({"metadata": {"annotations": {SELECTED_NODE: node}}});
                claims
                    .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(|e| format!("select node {node} for claim {namespace}/{name}: {e}"))?;
            }
        }
        waiting.push(name.to_owned());
    }
    for name in waiting {
        let bound = kube::runtime::wait::await_condition(
            claims.clone(),
            &name,
            |claim: Option<&PersistentVolumeClaim>| {
                claim.is_some_and(|c| bound_volume(c).is_some())
            },
        );
        match tokio::time::timeout(BIND_TIMEOUT, bound).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(format!("binding volumes: {e}")),
            Err(_) => return Err("binding volumes: timed out waiting for the condition".into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str, labels: serde_json::Value) -> Node {
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap()
    }

    fn selector(v: serde_json::Value) -> NodeSelector {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_volume_node_affinity_matches_labels_and_fields() {
        let n1 = node("n1", json!({"kubernetes.io/hostname": "n1", "size": "10"}));
        let on_n1 = selector(json!({"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n1"]}]}]}));
        let on_n2 = selector(json!({"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n2"]}]}]}));
        let either = selector(json!({"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]},
            {"matchExpressions": [{"key": "size", "operator": "Gt", "values": ["5"]}]}]}));
        let empty = selector(json!({"nodeSelectorTerms": [{}]}));
        assert!(selector_matches(&on_n1, &n1));
        assert!(!selector_matches(&on_n2, &n1));
        assert!(selector_matches(&either, &n1));
        assert!(!selector_matches(&empty, &n1));
    }
}
