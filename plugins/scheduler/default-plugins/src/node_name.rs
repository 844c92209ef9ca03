//! NodeName: a pod that names its node (`spec.nodeName`) fits only there.

use trellis_plugin::scheduler::{Cluster, NodeInfo, Plugin, PodInfo, Points, Status};

pub struct NodeName;

impl Plugin for NodeName {
    fn name(&self) -> &'static str {
        "NodeName"
    }

    fn points(&self) -> Points {
        Points {
            filter: true,
            ..Points::default()
        }
    }

    fn filter(&self, pod: &PodInfo, node: &NodeInfo, _: &Cluster) -> Status {
        match pod.spec().and_then(|s| s.node_name.as_deref()) {
            Some(name) if !name.is_empty() && name != node.name() => {
                Status::unresolvable("node(s) didn't match the requested node name")
            }
            _ => Status::success(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{node, pod};
    use serde_json::json;

    #[test]
    fn a_pod_naming_its_node_fits_only_there() {
        let mut fw = crate::testing::framework(vec![Box::new(NodeName)]);
        fw.update([
            node(0, json!({"metadata": {"name": "a"}})),
            node(1, json!({"metadata": {"name": "b"}})),
        ]);
        let named = pod(json!({"spec": {"containers": [], "nodeName": "b"}}));
        assert_eq!(fw.schedule(named), Ok("b".to_owned()));
        let elsewhere = pod(json!({"spec": {"containers": [], "nodeName": "c"}}));
        assert_eq!(
            fw.schedule(elsewhere),
            Err(vec![(
                "node(s) didn't match the requested node name".to_owned(),
                2
            )])
        );
    }
}
