//! NodePorts: a pod asking for host ports fits only nodes where no pod holds the same
//! port and protocol on the same address; `0.0.0.0` (or no address) binds every
//! address and so conflicts with any.

use trellis_plugin::scheduler::{
    Cluster, ClusterEvent, HostPort, NodeInfo, Plugin, PodInfo, Points, PreFilterResult, Status,
};

pub struct NodePorts;

const REASON: &str = "node(s) didn't have free ports for the requested pod ports";
const ANY_ADDRESS: &str = "0.0.0.0";

/// An address and protocol as the scheduler compares them: empty is `0.0.0.0`, `TCP`.
fn sanitized(p: &HostPort) -> (&str, &str) {
    let ip = if p.ip.is_empty() { ANY_ADDRESS } else { &p.ip };
    let protocol = if p.protocol.is_empty() {
        "TCP"
    } else {
        &p.protocol
    };
    (ip, protocol)
}

/// Whether `wanted` clashes with a port in use (`HostPortInfo.CheckConflict`).
fn conflicts(wanted: &HostPort, node: &NodeInfo) -> bool {
    let (ip, protocol) = sanitized(wanted);
    node.used_ports.keys().any(|used| {
        let (used_ip, used_protocol) = sanitized(used);
        used.port == wanted.port
            && used_protocol == protocol
            && (ip == ANY_ADDRESS || used_ip == ANY_ADDRESS || used_ip == ip)
    })
}

impl Plugin for NodePorts {
    fn name(&self) -> &'static str {
        "NodePorts"
    }

    fn points(&self) -> Points {
        Points {
            pre_filter: true,
            filter: true,
            ..Points::default()
        }
    }

    fn events(&self) -> Vec<ClusterEvent> {
        vec![
            ClusterEvent::pod_deleted(),
            ClusterEvent::node_added_or_changed(),
        ]
    }

    fn pre_filter(&mut self, pod: &PodInfo, _: &Cluster) -> PreFilterResult {
        if pod.host_ports.is_empty() {
            Status::skip().into()
        } else {
            Status::success().into()
        }
    }

    fn filter(&self, pod: &PodInfo, node: &NodeInfo, _: &Cluster) -> Status {
        if pod.host_ports.iter().any(|p| conflicts(p, node)) {
            Status::unschedulable(REASON)
        } else {
            Status::success()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{framework, node, placed, pod};
    use serde_json::{Value, json};

    fn with_ports(name: &str, ports: Value) -> Value {
        json!({"metadata": {"name": name}, "spec": {"containers": [{"name": "c", "ports": ports}]}})
    }

    #[test]
    fn host_ports_conflict_by_port_protocol_and_address() {
        let cases = [
            // (in use, wanted, fits)
            (
                json!({"containerPort": 80, "hostPort": 8080}),
                json!({"containerPort": 80, "hostPort": 8080}),
                false,
            ),
            (
                json!({"containerPort": 80, "hostPort": 8080}),
                json!({"containerPort": 80, "hostPort": 8081}),
                true,
            ),
            (
                json!({"containerPort": 80, "hostPort": 8080, "protocol": "UDP"}),
                json!({"containerPort": 80, "hostPort": 8080}),
                true,
            ),
            (
                json!({"containerPort": 80, "hostPort": 8080, "hostIP": "10.0.0.1"}),
                json!({"containerPort": 80, "hostPort": 8080, "hostIP": "10.0.0.2"}),
                true,
            ),
            (
                json!({"containerPort": 80, "hostPort": 8080, "hostIP": "10.0.0.1"}),
                json!({"containerPort": 80, "hostPort": 8080}),
                false,
            ),
            (
                json!({"containerPort": 80, "hostPort": 8080}),
                json!({"containerPort": 80, "hostPort": 8080, "hostIP": "10.0.0.2"}),
                false,
            ),
            // A container port without a host port holds nothing on the node.
            (
                json!({"containerPort": 80}),
                json!({"containerPort": 80, "hostPort": 80}),
                true,
            ),
        ];
        for (used, wanted, fits) in cases {
            let mut fw = framework(vec![Box::new(NodePorts)]);
            fw.update([
                node(0, json!({})),
                placed(0, with_ports("old", json!([used.clone()]))),
            ]);
            let want = if fits {
                Ok("node-0".to_owned())
            } else {
                Err(vec![(REASON.to_owned(), 1)])
            };
            assert_eq!(
                fw.schedule(pod(with_ports("p", json!([wanted.clone()])))),
                want,
                "{used} {wanted}"
            );
        }
    }

    #[test]
    fn a_pod_without_host_ports_skips_the_filter() {
        let mut fw = framework(vec![Box::new(NodePorts)]);
        fw.update([node(0, json!({}))]);
        assert_eq!(fw.cycle(pod(json!({})))[0].1.status, Status::skip());
    }
}
