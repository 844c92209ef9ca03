//! The scheduler's cache: the nodes, numbered as the plugins' views number them, and
//! the pods on them, bound or assumed. Every change is also kept as a
//! [`Change`] for the plugins' views, which [`cycle`](crate::cycle) sends before the next
//! cycle; a new view (a new plugin session) gets [`Cache::snapshot`] instead.
//!
//! A pod is *assumed* on its node as soon as the scheduler chose it, before the bind
//! is written, so the next cycle counts it; the bind's arrival through the watch
//! confirms it, and a failed bind forgets it.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use trellis_api::selector::LabelSelector;
use trellis_plugin_host::scheduler::{Change, NodeUpsert, PodUpsert};

pub type NodeId = u32;

struct NodeEntry {
    id: NodeId,
    /// The informer's object (shared, not copied).
    node: Arc<Node>,
}

struct PodEntry {
    node: String,
    /// The pod as last sent (the informer's object, or the assumed copy): a later
    /// version that differs only where no plugin looks is not sent again.
    pod: Arc<Pod>,
    assumed: bool,
}

/// The nodes and the pods on them; JSON is made only for what is sent, so the cache
/// holds no copy of what the informers hold.
#[derive(Default)]
pub struct Cache {
    nodes: HashMap<String, NodeEntry>,
    /// Node names by number; `None` for a free number.
    names: Vec<Option<String>>,
    free: Vec<NodeId>,
    /// Pods on nodes, by uid.
    pods: HashMap<String, PodEntry>,
    /// Changes not yet sent to the plugins.
    pending: Vec<Change>,
    /// How many pods on nodes have each priority: whether a preemption can find any
    /// victim at all, without a pass over the pods.
    priorities: std::collections::BTreeMap<i32, usize>,
    /// PodDisruptionBudgets by `namespace/name`: preemption spares the pods they
    /// protect where it can.
    budgets: HashMap<String, Budget>,
}

/// What preemption reads of a PodDisruptionBudget.
#[derive(Clone, Debug)]
pub struct Budget {
    pub namespace: String,
    /// `None`: selects nothing (a null selector, or one that does not parse).
    pub selector: Option<LabelSelector>,
    /// `status.disruptionsAllowed`.
    pub allowed: i32,
}

impl Budget {
    pub fn from_object(pdb: &PodDisruptionBudget) -> Self {
        let spec = pdb.spec.as_ref();
        Self {
            namespace: pdb.metadata.namespace.clone().unwrap_or_default(),
            selector: spec
                .and_then(|s| s.selector.as_ref())
                .and_then(|s| LabelSelector::from_k8s(s).ok()),
            allowed: pdb.status.as_ref().map_or(0, |s| s.disruptions_allowed),
        }
    }

    /// Whether the budget protects `pod`.
    pub fn covers(&self, pod: &Pod) -> bool {
        let none = std::collections::BTreeMap::new();
        pod.metadata.namespace.as_deref() == Some(self.namespace.as_str())
            && self
                .selector
                .as_ref()
                .is_some_and(|s| s.matches_map(pod.metadata.labels.as_ref().unwrap_or(&none)))
    }
}

fn priority_of(pod: &Pod) -> i32 {
    pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)
}

/// A pod as the plugins get it: without its managedFields, which no plugin reads and
/// which are most of a pod's JSON (to copy into the guest and to parse there).
pub fn pod_json(pod: &Pod) -> String {
    without_managed_fields(pod, |p| &mut p.metadata)
}

/// A node as the plugins get it, as [`pod_json`].
fn node_json(node: &Node) -> String {
    without_managed_fields(node, |n| &mut n.metadata)
}

/// The informers' objects carry none already (`trellis_client::informer` trims
/// them): those are written as they are, without a copy.
fn without_managed_fields<T: Clone + serde::Serialize + kube::Resource>(
    obj: &T,
    meta: impl Fn(&mut T) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> String {
    if obj.meta().managed_fields.is_none() {
        return serde_json::to_string(obj).unwrap_or_default();
    }
    let mut obj = obj.clone();
    meta(&mut obj).managed_fields = None;
    serde_json::to_string(&obj).unwrap_or_default()
}

/// What the plugins read of a pod on a node: a change elsewhere (its status
/// conditions, its resourceVersion) is not sent to them again.
type Placement<'a> = (
    Option<&'a k8s_openapi::api::core::v1::PodSpec>,
    Option<&'a std::collections::BTreeMap<String, String>>,
    Option<&'a str>,
);

fn placement_of(pod: &Pod) -> Placement<'_> {
    (
        pod.spec.as_ref(),
        pod.metadata.labels.as_ref(),
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
    )
}

/// Whether a pod on a node still holds its resources (kube-scheduler drops pods that
/// finished).
fn holds_node(pod: &Pod) -> bool {
    !matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

impl Cache {
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// The numbers of every node, in number order.
    pub fn node_ids(&self) -> Vec<NodeId> {
        self.names
            .iter()
            .enumerate()
            .filter(|(_, n)| n.is_some())
            .map(|(i, _)| i as NodeId)
            .collect()
    }

    pub fn node_name(&self, id: NodeId) -> Option<&str> {
        self.names.get(id as usize).and_then(|n| n.as_deref())
    }

    /// The Node numbered `id`.
    pub fn node(&self, id: NodeId) -> Option<&Arc<Node>> {
        self.nodes.get(self.node_name(id)?).map(|e| &e.node)
    }

    pub fn upsert_node(&mut self, node: &Arc<Node>) {
        let Some(name) = node.metadata.name.clone() else {
            return;
        };
        if let Some(entry) = self.nodes.get_mut(&name) {
            entry.node = node.clone();
            self.pending.push(Change::NodeUpsert(NodeUpsert {
                node: entry.id,
                object: node_json(node),
            }));
            return;
        }
        let id = self.free.pop().unwrap_or(self.names.len() as NodeId);
        if self.names.len() <= id as usize {
            self.names.resize(id as usize + 1, None);
        }
        self.names[id as usize] = Some(name.clone());
        self.pending.push(Change::NodeUpsert(NodeUpsert {
            node: id,
            object: node_json(node),
        }));
        // Pods that arrived before their node join it now.
        for (uid, p) in &self.pods {
            if p.node == name {
                self.pending.push(Change::PodUpsert(PodUpsert {
                    uid: uid.clone(),
                    node: id,
                    object: pod_json(&p.pod),
                }));
            }
        }
        self.nodes.insert(
            name,
            NodeEntry {
                id,
                node: node.clone(),
            },
        );
    }

    pub fn remove_node(&mut self, name: &str) {
        let Some(entry) = self.nodes.remove(name) else {
            return;
        };
        let on: Vec<String> = self
            .pods
            .iter()
            .filter(|(_, p)| p.node == name)
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in on {
            self.pending.push(Change::PodRemove(uid));
        }
        self.pending.push(Change::NodeRemove(entry.id));
        self.names[entry.id as usize] = None;
        self.free.push(entry.id);
    }

    /// A pod the watch shows on a node (or no longer: finished pods leave).
    pub fn upsert_pod(&mut self, pod: &Arc<Pod>) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        if node.is_empty() || !holds_node(pod) {
            self.remove_pod(&uid);
            return;
        }
        // The bind of a pod this scheduler assumed arrives: the plugins have it.
        if let Some(entry) = self.pods.get_mut(&uid)
            && entry.node == node
            && placement_of(&entry.pod) == placement_of(pod)
        {
            entry.assumed = false;
            entry.pod = pod.clone();
            return;
        }
        self.place(uid, node, pod.clone(), false);
    }

    fn place(&mut self, uid: String, node: String, pod: Arc<Pod>, assumed: bool) {
        if let Some(old) = self.pods.get(&uid)
            && old.node != node
        {
            self.remove_pod(&uid);
        }
        // A pod on a node the cache has not seen yet is sent with the node.
        if let Some(n) = self.nodes.get(&node) {
            self.pending.push(Change::PodUpsert(PodUpsert {
                uid: uid.clone(),
                node: n.id,
                object: pod_json(&pod),
            }));
        }
        if let Some(old) = self.pods.insert(
            uid,
            PodEntry {
                node,
                pod: pod.clone(),
                assumed,
            },
        ) {
            self.uncount(&old.pod);
        }
        *self.priorities.entry(priority_of(&pod)).or_default() += 1;
    }

    fn uncount(&mut self, pod: &Pod) {
        let p = priority_of(pod);
        if let Some(n) = self.priorities.get_mut(&p) {
            *n -= 1;
            if *n == 0 {
                self.priorities.remove(&p);
            }
        }
    }

    /// Whether any pod on a node has a priority below `priority`.
    pub fn has_pods_below(&self, priority: i32) -> bool {
        self.priorities
            .first_key_value()
            .is_some_and(|(lowest, _)| *lowest < priority)
    }

    pub fn remove_pod(&mut self, uid: &str) {
        let Some(p) = self.pods.remove(uid) else {
            return;
        };
        self.uncount(&p.pod);
        if self.nodes.contains_key(&p.node) {
            self.pending.push(Change::PodRemove(uid.to_owned()));
        }
    }

    pub fn set_budget(&mut self, key: String, budget: Budget) {
        self.budgets.insert(key, budget);
    }

    pub fn remove_budget(&mut self, key: &str) {
        self.budgets.remove(key);
    }

    /// Splits `victims` (in their order) into those whose eviction would break a
    /// PodDisruptionBudget and those it would not, counting each budget down as
    /// kube-scheduler's `filterPodsWithPDBViolation` does.
    pub fn split_by_budgets(&self, victims: Vec<Arc<Pod>>) -> (Vec<Arc<Pod>>, Vec<Arc<Pod>>) {
        if self.budgets.is_empty() {
            return (Vec::new(), victims);
        }
        let mut left: HashMap<&str, i32> = self
            .budgets
            .iter()
            .map(|(k, b)| (k.as_str(), b.allowed))
            .collect();
        let (mut violating, mut fine) = (Vec::new(), Vec::new());
        for pod in victims {
            let mut breaks = false;
            for (key, budget) in &self.budgets {
                if budget.covers(&pod)
                    && let Some(n) = left.get_mut(key.as_str())
                {
                    *n -= 1;
                    breaks |= *n < 0;
                }
            }
            if breaks {
                violating.push(pod);
            } else {
                fine.push(pod);
            }
        }
        (violating, fine)
    }

    /// The pod is assumed on `node` while it is bound.
    pub fn assume(&mut self, pod: &Pod, node: &str) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        let mut bound = pod.clone();
        bound.metadata.managed_fields = None;
        bound.spec.get_or_insert_default().node_name = Some(node.to_owned());
        self.place(uid, node.to_owned(), Arc::new(bound), true);
    }

    /// A failed bind: the assumed pod leaves its node.
    pub fn forget(&mut self, uid: &str) {
        if self.pods.get(uid).is_some_and(|p| p.assumed) {
            self.remove_pod(uid);
        }
    }

    /// The pods on each node, by node name.
    pub fn pods_by_node(&self) -> HashMap<&str, Vec<Arc<Pod>>> {
        let mut out: HashMap<&str, Vec<Arc<Pod>>> = HashMap::new();
        for p in self.pods.values() {
            out.entry(p.node.as_str()).or_default().push(p.pod.clone());
        }
        out
    }

    /// Whether a pod is assumed or bound on a node.
    pub fn has_pod(&self, uid: &str) -> bool {
        self.pods.contains_key(uid)
    }

    /// The changes since the last call.
    pub fn take_pending(&mut self) -> Vec<Change> {
        std::mem::take(&mut self.pending)
    }

    /// The whole cluster as changes, for a new view.
    pub fn snapshot(&self) -> Vec<Change> {
        let mut out = Vec::with_capacity(self.nodes.len() + self.pods.len());
        for entry in self.nodes.values() {
            out.push(Change::NodeUpsert(NodeUpsert {
                node: entry.id,
                object: node_json(&entry.node),
            }));
        }
        for (uid, p) in &self.pods {
            if let Some(n) = self.nodes.get(&p.node) {
                out.push(Change::PodUpsert(PodUpsert {
                    uid: uid.clone(),
                    node: n.id,
                    object: pod_json(&p.pod),
                }));
            }
        }
        out
    }
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("nodes", &self.nodes.len())
            .field("pods", &self.pods.len())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str) -> Arc<Node> {
        Arc::new(serde_json::from_value(json!({"metadata": {"name": name}})).unwrap())
    }

    fn pod(uid: &str, node: &str) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({"metadata": {"name": uid, "uid": uid},
                                          "spec": {"containers": [], "nodeName": node}}))
            .unwrap(),
        )
    }

    fn kinds(changes: &[Change]) -> Vec<String> {
        changes
            .iter()
            .map(|c| match c {
                Change::NodeUpsert(n) => format!("node+{}", n.node),
                Change::NodeRemove(n) => format!("node-{n}"),
                Change::PodUpsert(p) => format!("pod+{}@{}", p.uid, p.node),
                Change::PodRemove(uid) => format!("pod-{uid}"),
            })
            .collect()
    }

    #[test]
    fn numbers_are_reused_only_after_the_removal_and_pods_follow_their_node() {
        let mut c = Cache::default();
        c.upsert_node(&node("a"));
        c.upsert_node(&node("b"));
        c.upsert_pod(&pod("p1", "b"));
        // A pod of a node not yet seen waits for it.
        c.upsert_pod(&pod("p2", "c"));
        assert_eq!(kinds(&c.take_pending()), ["node+0", "node+1", "pod+p1@1"]);
        // Both pods have priority 0: a pod of priority 1 could preempt, one of 0 not.
        assert!(c.has_pods_below(1) && !c.has_pods_below(0));
        c.remove_node("b");
        c.upsert_node(&node("c"));
        assert_eq!(
            kinds(&c.take_pending()),
            ["pod-p1", "node-1", "node+1", "pod+p2@1"]
        );
        assert_eq!(c.node_name(1), Some("c"));
        assert_eq!(c.node_ids(), [0, 1]);
    }

    #[test]
    fn an_assumed_pod_is_forgotten_but_a_bound_one_is_not() {
        let mut c = Cache::default();
        c.upsert_node(&node("a"));
        let mut unbound = (*pod("p", "")).clone();
        unbound.spec.as_mut().unwrap().node_name = None;
        c.assume(&unbound, "a");
        c.forget("p");
        assert!(!c.has_pod("p"));
        c.assume(&unbound, "a");
        c.upsert_pod(&pod("p", "a"));
        c.forget("p");
        assert!(c.has_pod("p"));
        // The bind's arrival changed nothing the plugins read: not sent again.
        assert_eq!(
            kinds(&c.take_pending()),
            ["node+0", "pod+p@0", "pod-p", "pod+p@0"]
        );
        let mut labelled = (*pod("p", "a")).clone();
        labelled.metadata.labels = Some([("app".to_owned(), "x".to_owned())].into());
        c.upsert_pod(&Arc::new(labelled));
        assert_eq!(kinds(&c.take_pending()), ["pod+p@0"]);
    }
}
