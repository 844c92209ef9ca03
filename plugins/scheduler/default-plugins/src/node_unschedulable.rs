//! NodeUnschedulable: a cordoned node (`spec.unschedulable`) takes only pods that
//! tolerate `node.kubernetes.io/unschedulable:NoSchedule`.

use trellis_plugin::scheduler::{Cluster, NodeInfo, Plugin, PodInfo, Points, Status};

pub struct NodeUnschedulable;

const TAINT: &str = "node.kubernetes.io/unschedulable";

impl Plugin for NodeUnschedulable {
    fn name(&self) -> &'static str {
        "NodeUnschedulable"
    }

    fn points(&self) -> Points {
        Points {
            filter: true,
            ..Points::default()
        }
    }

    fn filter(&self, pod: &PodInfo, node: &NodeInfo, _: &Cluster) -> Status {
        let cordoned = node
            .node
            .spec
            .as_ref()
            .and_then(|s| s.unschedulable)
            .unwrap_or(false);
        if !cordoned {
            return Status::success();
        }
        let tolerated = pod
            .spec()
            .and_then(|s| s.tolerations.as_ref())
            .is_some_and(|ts| {
                ts.iter().any(|t| {
                    let key_ok = match t.key.as_deref() {
                        None | Some("") => t.operator.as_deref() == Some("Exists"),
                        Some(k) => k == TAINT,
                    };
                    let effect_ok =
                        matches!(t.effect.as_deref(), None | Some("") | Some("NoSchedule"));
                    key_ok && effect_ok
                })
            });
        if tolerated {
            Status::success()
        } else {
            Status::unresolvable("node(s) were unschedulable")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{node, pod};
    use serde_json::json;

    #[test]
    fn a_cordoned_node_takes_only_pods_that_tolerate_it() {
        let mut fw = crate::testing::framework(vec![Box::new(NodeUnschedulable)]);
        fw.update([node(
            0,
            json!({"metadata": {"name": "a"}, "spec": {"unschedulable": true}}),
        )]);
        assert_eq!(
            fw.schedule(pod(json!({}))),
            Err(vec![("node(s) were unschedulable".to_owned(), 1)])
        );
        let tolerant = pod(json!({"spec": {"containers": [], "tolerations": [
            {"key": TAINT, "operator": "Exists", "effect": "NoSchedule"}]}}));
        assert_eq!(fw.schedule(tolerant), Ok("a".to_owned()));
    }
}
