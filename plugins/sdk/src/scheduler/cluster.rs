//! The cluster as a component's plugins see it (kube-scheduler's snapshot and its
//! listers): the host's changes applied to nodes by number and the pods on them.

use std::collections::{BTreeSet, HashMap};

use k8s_openapi::api::core::v1::Node;

use super::types::{NodeId, NodeInfo, PodInfo};

/// A change of the cluster, as the host sends it.
#[derive(Clone, Debug)]
pub enum Change {
    NodeUpsert {
        node: NodeId,
        object: String,
    },
    NodeRemove(NodeId),
    PodUpsert {
        uid: String,
        node: NodeId,
        object: String,
    },
    PodRemove(String),
}

/// The cluster as a component's plugins see it: nodes by number, and the pods on
/// them.
#[derive(Clone, Debug, Default)]
pub struct Cluster {
    nodes: Vec<Option<NodeInfo>>,
    pub(super) pods: HashMap<String, (NodeId, PodInfo)>,
    /// The uids of the pods with pod affinity or anti-affinity terms: what
    /// InterPodAffinity must look at for a pod without terms of its own, without a
    /// pass over every pod (kube-scheduler's `PodsWithAffinity`).
    with_affinity: BTreeSet<String>,
}

impl Cluster {
    /// Applies one change. An object that does not parse is left out, and named.
    pub fn apply(&mut self, change: Change) -> Result<(), String> {
        match change {
            Change::NodeUpsert { node: id, object } => {
                let node: Node = serde_json::from_str(&object)
                    .map_err(|e| format!("node {id} is not a Node: {e}"))?;
                let i = id as usize;
                if self.nodes.len() <= i {
                    self.nodes.resize(i + 1, None);
                }
                let mut info = NodeInfo::new(id, node);
                // The pods stay across a node's changes.
                if let Some(old) = self.nodes[i].take() {
                    for uid in &old.pods {
                        if let Some((_, pod)) = self.pods.get(uid) {
                            info.place(pod);
                        }
                    }
                }
                self.nodes[i] = Some(info);
            }
            Change::NodeRemove(id) => {
                if let Some(slot) = self.nodes.get_mut(id as usize) {
                    *slot = None;
                }
            }
            Change::PodUpsert { uid, node, object } => {
                let pod = PodInfo::from_json(&object)?;
                self.remove_pod(&uid);
                self.place_parsed(uid, node, pod);
            }
            Change::PodRemove(uid) => self.remove_pod(&uid),
        }
        Ok(())
    }

    /// Puts back a pod taken out (preemption's dry run), parsed already.
    pub(super) fn place_parsed(&mut self, uid: String, node: NodeId, pod: PodInfo) {
        if let Some(Some(n)) = self.nodes.get_mut(node as usize) {
            n.place(&pod);
        }
        if pod.has_pod_affinity() {
            self.with_affinity.insert(uid.clone());
        }
        self.pods.insert(uid, (node, pod));
    }

    pub(super) fn remove_pod(&mut self, uid: &str) {
        self.with_affinity.remove(uid);
        if let Some((node, pod)) = self.pods.remove(uid)
            && let Some(Some(n)) = self.nodes.get_mut(node as usize)
        {
            n.unplace(&pod);
        }
    }

    pub fn node(&self, id: NodeId) -> Option<&NodeInfo> {
        self.nodes.get(id as usize).and_then(Option::as_ref)
    }

    /// Every node.
    pub fn nodes(&self) -> impl Iterator<Item = &NodeInfo> {
        self.nodes.iter().flatten()
    }

    /// A pod on a node, by uid.
    pub fn pod(&self, uid: &str) -> Option<&PodInfo> {
        self.pods.get(uid).map(|(_, p)| p)
    }

    /// Every pod on a node, with its node.
    pub fn pods(&self) -> impl Iterator<Item = (NodeId, &PodInfo)> {
        self.pods.values().map(|(n, p)| (*n, p))
    }

    /// Every pod on a node that has pod affinity or anti-affinity terms, with its node.
    pub fn pods_with_affinity(&self) -> impl Iterator<Item = (NodeId, &PodInfo)> {
        self.with_affinity
            .iter()
            .filter_map(|uid| self.pods.get(uid).map(|(n, p)| (*n, p)))
    }

    /// The pods on `node`.
    pub fn pods_on<'a>(&'a self, node: &'a NodeInfo) -> impl Iterator<Item = &'a PodInfo> {
        node.pods.iter().filter_map(|uid| self.pod(uid))
    }
}
