//! What a plugin implements (kube-scheduler's `framework/interface.go`): the
//! [`Plugin`] trait, its extension points, and the statuses it answers with.

use super::cluster::Cluster;
use super::types::{ClusterEvent, NodeId, NodeInfo, PodInfo};

/// The framework's status codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    Success,
    /// The pod does not fit; preemption may help.
    Unschedulable,
    /// The pod does not fit, and preempting pods would not change that.
    UnschedulableAndUnresolvable,
    /// PreFilter and PreScore: nothing to do for this pod.
    Skip,
    Error,
}

/// A plugin's verdict, with the reasons `kubectl describe` shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub code: Code,
    pub reasons: Vec<String>,
}

impl Status {
    pub fn success() -> Self {
        Self {
            code: Code::Success,
            reasons: Vec::new(),
        }
    }

    pub fn skip() -> Self {
        Self {
            code: Code::Skip,
            reasons: Vec::new(),
        }
    }

    pub fn unschedulable(reason: impl Into<String>) -> Self {
        Self {
            code: Code::Unschedulable,
            reasons: vec![reason.into()],
        }
    }

    pub fn unresolvable(reason: impl Into<String>) -> Self {
        Self {
            code: Code::UnschedulableAndUnresolvable,
            reasons: vec![reason.into()],
        }
    }

    pub fn error(reason: impl Into<String>) -> Self {
        Self {
            code: Code::Error,
            reasons: vec![reason.into()],
        }
    }

    pub fn is_success(&self) -> bool {
        self.code == Code::Success
    }
}

/// The extension points a plugin implements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Points {
    pub pre_filter: bool,
    pub filter: bool,
    pub pre_score: bool,
    pub score: bool,
    pub reserve: bool,
    pub permit: bool,
}

/// What PreFilter says: the status, and the nodes that alone can pass (`None`: all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreFilterResult {
    pub status: Status,
    pub nodes: Option<Vec<NodeId>>,
}

impl From<Status> for PreFilterResult {
    fn from(status: Status) -> Self {
        Self {
            status,
            nodes: None,
        }
    }
}

/// Whether a pod may be bound now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Permit {
    Allow,
    Deny(Status),
    /// Wait this long (ms) for [`Plugin::allowed`] to name it.
    Wait(u64),
}

/// One scheduler plugin. Implement the extension points it has and say which in
/// [`Plugin::points`]; state for the pod being scheduled (computed in PreFilter or
/// PreScore) lives in the plugin itself, since a component schedules one pod at a
/// time.
pub trait Plugin {
    /// As kube-scheduler names it: `NodeResourcesFit`.
    fn name(&self) -> &'static str;
    fn points(&self) -> Points;
    /// The weight of its Score unless the profile gives one.
    fn weight(&self) -> u32 {
        1
    }
    /// Events that may make a pod it rejected schedulable.
    fn events(&self) -> Vec<ClusterEvent> {
        vec![ClusterEvent::node_added_or_changed()]
    }
    fn pre_filter(&mut self, _pod: &PodInfo, _cluster: &Cluster) -> PreFilterResult {
        Status::success().into()
    }
    fn filter(&self, _pod: &PodInfo, _node: &NodeInfo, _cluster: &Cluster) -> Status {
        Status::success()
    }
    /// Before Score, with the nodes that passed; `skip` leaves Score out.
    fn pre_score(&mut self, _pod: &PodInfo, _nodes: &[&NodeInfo], _cluster: &Cluster) -> Status {
        Status::success()
    }
    fn score(&self, _pod: &PodInfo, _node: &NodeInfo, _cluster: &Cluster) -> Result<i64, String> {
        Ok(0)
    }
    /// NormalizeScore: brings the scores of every node to 0..=100.
    fn normalize(&self, _scores: &mut [i64]) {}
    fn reserve(&mut self, _pod: &PodInfo, _node: &NodeInfo) -> Status {
        Status::success()
    }
    fn unreserve(&mut self, _pod: &PodInfo, _node: &NodeInfo) {}
    fn permit(&mut self, _pod: &PodInfo, _node: &NodeInfo) -> Permit {
        Permit::Allow
    }
    /// Pods waiting at its Permit that it now allows.
    fn allowed(&mut self) -> Vec<String> {
        Vec::new()
    }
}

/// The highest score a node can have after NormalizeScore.
pub const MAX_NODE_SCORE: i64 = 100;

/// Scales scores to 0..=MAX_NODE_SCORE by the highest (kube-scheduler's
/// `DefaultNormalizeScore`); `reverse` makes the lowest the best.
pub fn default_normalize(scores: &mut [i64], reverse: bool) {
    let max = scores.iter().copied().max().unwrap_or(0);
    if max == 0 {
        if reverse {
            scores.iter_mut().for_each(|s| *s = MAX_NODE_SCORE);
        }
        return;
    }
    for s in scores.iter_mut() {
        *s = MAX_NODE_SCORE * *s / max;
        if reverse {
            *s = MAX_NODE_SCORE - *s;
        }
    }
}
