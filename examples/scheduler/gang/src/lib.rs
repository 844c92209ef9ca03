//! gang: co-scheduling. The pods of a group are bound together, or none is: a pod
//! of a group waits at Permit (holding its node) until `min-member` pods of its
//! group have a node, bound or waiting; the one that completes the group is allowed
//! and releases the others. A waiting pod whose wait runs out is given up: it goes
//! back to the queue and its node is freed (each pod by its own deadline, not the
//! group at once as the scheduler-plugins project's Coscheduling does).
//!
//! A pod joins a group with two labels: `pod-group.trellis.dev/name: NAME` and
//! `pod-group.trellis.dev/min-member: "N"`. Pods without them are allowed at once.
//!
//! Configuration: `{"waitSeconds": 30}` (default 60, as the scheduler-plugins
//! project's Coscheduling waits).

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use trellis_plugin::scheduler::{
    Cluster, ClusterEvent, NodeInfo, Permit, Plugin, PodInfo, Points, Status,
};

pub const GROUP: &str = "pod-group.trellis.dev/name";
pub const MIN_MEMBER: &str = "pod-group.trellis.dev/min-member";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Configuration {
    #[serde(default = "sixty")]
    wait_seconds: u64,
}

fn sixty() -> u64 {
    60
}

/// A pod's group and the group's size, from its labels.
fn group_of(pod: &PodInfo) -> Result<Option<(String, usize)>, String> {
    let Some(labels) = pod.labels() else {
        return Ok(None);
    };
    let Some(name) = labels.get(GROUP) else {
        return Ok(None);
    };
    let min = labels
        .get(MIN_MEMBER)
        .ok_or_else(|| format!("label {MIN_MEMBER} is required with {GROUP}"))?;
    let min = min
        .parse::<usize>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("label {MIN_MEMBER}: {min:?} is not a positive number"))?;
    Ok(Some((format!("{}/{name}", pod.namespace()), min)))
}

pub struct Gang {
    wait_ms: u64,
    /// Pods waiting at Permit, by group.
    waiting: BTreeMap<String, BTreeSet<String>>,
    /// Waiting pods allowed since the host last asked.
    released: Vec<String>,
    /// Pods of the cycle's group that have a node, counted in PreFilter.
    members: usize,
}

impl Gang {
    /// Pods of `group` that have a node: bound, assumed, or waiting here (the host
    /// holds a waiting pod's node, so its view has it).
    fn placed(&self, group: &str, cluster: &Cluster) -> usize {
        cluster
            .pods()
            .filter(|(_, p)| matches!(group_of(p), Ok(Some((g, _))) if g == group))
            .count()
    }
}

impl Plugin for Gang {
    fn name(&self) -> &'static str {
        "Gang"
    }

    fn points(&self) -> Points {
        Points {
            pre_filter: true,
            // Reserve (a no-op) so a pod given up is unreserved here and leaves its
            // group's waiting set.
            reserve: true,
            permit: true,
            ..Points::default()
        }
    }

    fn events(&self) -> Vec<ClusterEvent> {
        // A group given up is tried again when a member may have arrived, a node
        // comes, or a pod leaves.
        vec![
            ClusterEvent::unscheduled_pod_added(),
            ClusterEvent::node_added_or_changed(),
            ClusterEvent::pod_deleted(),
        ]
    }

    fn pre_filter(
        &mut self,
        pod: &PodInfo,
        cluster: &Cluster,
    ) -> trellis_plugin::scheduler::PreFilterResult {
        match group_of(pod) {
            Err(e) => Status::unresolvable(e).into(),
            Ok(None) => Status::skip().into(),
            Ok(Some((group, _))) => {
                self.members = self.placed(&group, cluster);
                Status::success().into()
            }
        }
    }

    fn permit(&mut self, pod: &PodInfo, _node: &NodeInfo) -> Permit {
        let Ok(Some((group, min))) = group_of(pod) else {
            return Permit::Allow;
        };
        let waiting = self.waiting.entry(group.clone()).or_default();
        // This pod and those placed before it (which include the waiting ones).
        if self.members + 1 >= min {
            self.released.extend(std::mem::take(waiting));
            self.waiting.remove(&group);
            return Permit::Allow;
        }
        waiting.insert(pod.uid.clone());
        Permit::Wait(self.wait_ms)
    }

    fn unreserve(&mut self, pod: &PodInfo, _node: &NodeInfo) {
        if let Ok(Some((group, _))) = group_of(pod)
            && let Some(waiting) = self.waiting.get_mut(&group)
        {
            waiting.remove(&pod.uid);
            if waiting.is_empty() {
                self.waiting.remove(&group);
            }
        }
    }

    fn allowed(&mut self) -> Vec<String> {
        std::mem::take(&mut self.released)
    }
}

/// The component's plugins from its configuration.
pub fn build(configuration: &str) -> Result<Vec<Box<dyn Plugin>>, String> {
    let config: Configuration = if configuration.trim().is_empty() {
        Configuration { wait_seconds: 60 }
    } else {
        serde_json::from_str(configuration).map_err(|e| format!("configuration: {e}"))?
    };
    if config.wait_seconds == 0 {
        return Err("configuration: waitSeconds: Invalid value: 0: must be positive".into());
    }
    Ok(vec![Box::new(Gang {
        wait_ms: config.wait_seconds.saturating_mul(1000),
        waiting: BTreeMap::new(),
        released: Vec::new(),
        members: 0,
    })])
}

trellis_plugin::scheduler!(build);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use trellis_plugin::scheduler::{Change, Framework};

    fn node(id: u32) -> Change {
        Change::NodeUpsert {
            node: id,
            object: json!({"metadata": {"name": format!("n{id}")},
                "status": {"allocatable": {"pods": "10"}}})
            .to_string(),
        }
    }

    fn member(name: &str, min: &str) -> serde_json::Value {
        json!({"metadata": {"name": name, "namespace": "ns", "uid": name,
            "labels": {GROUP: "g", MIN_MEMBER: min}}, "spec": {"containers": []}})
    }

    /// One cycle up to Permit on node 0; then the pod is in the view as the host
    /// holds its node.
    fn permit(fw: &mut Framework, pod: serde_json::Value) -> Permit {
        let uid = pod["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        fw.cycle(PodInfo::new(serde_json::from_value(pod.clone()).unwrap()));
        assert!(fw.reserve(0).is_success());
        let verdict = fw.permit(0);
        fw.update([Change::PodUpsert {
            uid,
            node: 0,
            object: pod.to_string(),
        }]);
        verdict
    }

    #[test]
    fn a_group_waits_until_its_last_member_then_all_are_allowed() {
        let mut fw = Framework::new(build(r#"{"waitSeconds": 5}"#).unwrap());
        fw.update([node(0)]);
        assert_eq!(permit(&mut fw, member("a", "3")), Permit::Wait(5000));
        assert_eq!(permit(&mut fw, member("b", "3")), Permit::Wait(5000));
        assert!(fw.allowed().is_empty());
        assert_eq!(permit(&mut fw, member("c", "3")), Permit::Allow);
        let mut allowed = fw.allowed();
        allowed.sort();
        assert_eq!(allowed, ["a", "b"]);
        assert!(fw.allowed().is_empty(), "told once");
    }

    #[test]
    fn a_member_given_up_no_longer_counts() {
        let mut fw = Framework::new(build("{}").unwrap());
        fw.update([node(0)]);
        assert_eq!(permit(&mut fw, member("a", "2")), Permit::Wait(60_000));
        // The wait ran out: the host unreserves it and takes it off its node.
        fw.unreserve("a", 0);
        fw.update([Change::PodRemove("a".into())]);
        assert_eq!(permit(&mut fw, member("b", "2")), Permit::Wait(60_000));
        assert!(fw.allowed().is_empty());
    }

    #[test]
    fn pods_outside_groups_pass_and_bad_labels_are_refused() {
        let mut fw = Framework::new(build("{}").unwrap());
        fw.update([node(0)]);
        let plain = json!({"metadata": {"name": "p", "uid": "p"}, "spec": {"containers": []}});
        assert_eq!(permit(&mut fw, plain), Permit::Allow);
        let bad = json!({"metadata": {"name": "q", "uid": "q", "labels": {GROUP: "g"}},
            "spec": {"containers": []}});
        let results = fw.cycle(PodInfo::new(serde_json::from_value(bad).unwrap()));
        assert!(
            results[0].1.status.reasons[0].contains(MIN_MEMBER),
            "{results:?}"
        );
        assert!(build(r#"{"waitSeconds": 0}"#).is_err());
    }
}
