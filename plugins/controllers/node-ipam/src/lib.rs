//! The node IPAM controller, as Kubernetes' range allocator behaves
//! (kube-controller-manager's `--allocate-node-cidrs`), for one Node per key.
//!
//! - The cluster CIDRs (`clusterCIDRs`, `["10.42.0.0/16"]` by default; a dual-stack
//!   cluster names one range per family) are cut into node ranges of
//!   `nodeCIDRMaskSize` (24 for IPv4 by default) and `nodeCIDRMaskSizeIPv6` (64 by
//!   default; `nodeCIDRMaskSize` applies to an IPv6-only cluster).
//! - A Node without `spec.podCIDR` gets the lowest free range of each cluster CIDR,
//!   in `spec.podCIDR` (the first) and `spec.podCIDRs`.
//! - A Node that has one keeps it, and its ranges count as used, whoever set them;
//!   one outside the cluster CIDRs is left alone and told in an event.
//! - Which ranges are used is counted from the Nodes at every allocation, so a
//!   deleted Node's range is free once it is gone and nothing is lost in a restart.
//!   The cache may not show a range given a moment ago: a Node the cache shows with
//!   none is read from the API server before its range is counted free. The host runs
//!   one allocation at a time (one worker), so two Nodes never get one range.
//! - When a cluster CIDR has no free range left, the Node gets an event
//!   `CIDRNotAvailable` and is tried again later.

pub mod cidr;

use std::collections::BTreeSet;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::controller::{
    Action, EventType, ObjectKey, PatchType, Reconcile, cache, client, events,
};

use crate::cidr::{Cidr, CidrSet};

/// How soon a Node that found no free range tries again: a deleted Node frees one
/// without reconciling the others.
const RETRY_WHEN_FULL: Duration = Duration::from_secs(10);

/// Patches of a Node tried in one reconcile when its status changed in between.
const CONFLICT_ATTEMPTS: u32 = 5;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeIpam {
    /// `--cluster-cidr`: the ranges node ranges are cut from, one per family.
    #[serde(rename = "clusterCIDRs", default = "default_cluster_cidrs")]
    cluster_cidrs: Vec<String>,
    /// `--node-cidr-mask-size`: the prefix length of an IPv4 node range (24 when
    /// unset), and of an IPv6 one in an IPv6-only cluster (64 when unset).
    #[serde(rename = "nodeCIDRMaskSize", default)]
    node_cidr_mask_size: Option<u8>,
    /// `--node-cidr-mask-size-ipv6`: the prefix length of an IPv6 node range.
    #[serde(rename = "nodeCIDRMaskSizeIPv6", default)]
    node_cidr_mask_size_ipv6: Option<u8>,
}

fn default_cluster_cidrs() -> Vec<String> {
    vec!["10.42.0.0/16".into()]
}

impl NodeIpam {
    /// The cluster CIDRs cut into node ranges, in the order configured (the order of
    /// a Node's `podCIDRs`).
    pub fn cidr_sets(&self) -> Result<Vec<CidrSet>, String> {
        let clusters = self
            .cluster_cidrs
            .iter()
            .map(|c| Cidr::parse(c).map_err(|e| format!("clusterCIDRs: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        match clusters.as_slice() {
            [] => return Err("clusterCIDRs: at least one range is needed".into()),
            [a, b] if a.is_ipv6() == b.is_ipv6() => {
                return Err(format!(
                    "clusterCIDRs: {a} and {b} are of one family; a dual-stack cluster has \
                     one range per family"
                ));
            }
            [_] | [_, _] => {}
            _ => {
                return Err(
                    "clusterCIDRs: at most two ranges, one IPv4 and one IPv6 (dual-stack)".into(),
                );
            }
        }
        let single_stack = clusters.len() == 1;
        clusters
            .into_iter()
            .map(|cluster| {
                let (field, mask) = match (cluster.is_ipv6(), self.node_cidr_mask_size_ipv6) {
                    (false, _) => ("nodeCIDRMaskSize", self.node_cidr_mask_size.unwrap_or(24)),
                    (true, Some(mask)) => ("nodeCIDRMaskSizeIPv6", mask),
                    (true, None) if single_stack => {
                        ("nodeCIDRMaskSize", self.node_cidr_mask_size.unwrap_or(64))
                    }
                    (true, None) => ("nodeCIDRMaskSizeIPv6", 64),
                };
                CidrSet::new(cluster, mask).map_err(|e| format!("{field}: {e}"))
            })
            .collect()
    }
}

/// A Node's ranges: `spec.podCIDRs`, or else `spec.podCIDR`.
fn pod_cidrs(node: &Value) -> Vec<String> {
    let listed: Vec<String> = node["spec"]["podCIDRs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .filter(|c| !c.is_empty())
        .map(str::to_owned)
        .collect();
    if !listed.is_empty() {
        return listed;
    }
    node["spec"]["podCIDR"]
        .as_str()
        .filter(|c| !c.is_empty())
        .map(|c| vec![c.to_owned()])
        .unwrap_or_default()
}

impl Reconcile for NodeIpam {
    fn check_configuration(&self) -> Result<(), String> {
        self.cidr_sets().map(|_| ())
    }

    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let sets = self.cidr_sets()?;
        // Gone: its range is free, as ranges are counted from the Nodes there are.
        let Some(node) = cache::get(&key.resource, None, &key.name)? else {
            return Ok(Action::Done);
        };
        if !node["metadata"]["deletionTimestamp"].is_null() {
            return Ok(Action::Done);
        }
        let cidrs = pod_cidrs(&node);
        if !cidrs.is_empty() {
            report_outside(&sets, &node, &cidrs);
            return Ok(Action::Done);
        }
        let used = occupied(&sets, key)?;
        let mut chosen = Vec::with_capacity(sets.len());
        for (set, used) in sets.iter().zip(&used) {
            match (0..set.count()).find(|i| !used.contains(i)) {
                Some(index) => chosen.push(set.range(index).to_string()),
                None => {
                    events::record(
                        &node,
                        EventType::Normal,
                        "CIDRNotAvailable",
                        &format!("Node {} status is now: CIDRNotAvailable", key.name),
                    );
                    return Ok(Action::RequeueAfter(RETRY_WHEN_FULL));
                }
            }
        }
        // The patch is made against the Node as the API server has it, so a range
        // set by hand meanwhile is neither overwritten nor counted twice. Its agent
        // writes its status often at first: a conflict is read again at once.
        let mut attempts = 0;
        loop {
            attempts += 1;
            let live = client::read(&key.resource, None, &key.name)
                .map_err(|e| format!("read node {}: {e}", key.name))?;
            let Some(live) = live else {
                return Ok(Action::Done);
            };
            if !pod_cidrs(&live).is_empty() {
                return Ok(Action::Done);
            }
            match client::patch(
                &key.resource,
                None,
                &key.name,
                PatchType::Merge,
                json!({
                    "metadata": {"resourceVersion": live["metadata"]["resourceVersion"]},
                    "spec": {"podCIDR": chosen[0], "podCIDRs": chosen},
                }),
                false,
            ) {
                Ok(_) => break,
                Err(e) if e.code == 409 && attempts < CONFLICT_ATTEMPTS => {}
                Err(e) => {
                    return Err(format!(
                        "set the podCIDRs {chosen:?} of node {}: {e}",
                        key.name
                    ));
                }
            }
        }
        Ok(Action::Done)
    }
}

/// The node ranges of each set the other Nodes hold.
fn occupied(sets: &[CidrSet], key: &ObjectKey) -> Result<Vec<BTreeSet<u32>>, String> {
    let mut used = vec![BTreeSet::new(); sets.len()];
    for other in cache::list_as::<Value>(&key.resource, None, "")? {
        let name = other["metadata"]["name"].as_str().unwrap_or_default();
        if name == key.name {
            continue;
        }
        let mut cidrs = pod_cidrs(&other);
        if cidrs.is_empty() {
            // It may have been given one a moment ago that the cache does not show.
            cidrs = client::read(&key.resource, None, name)
                .map_err(|e| format!("read node {name}: {e}"))?
                .map(|live| pod_cidrs(&live))
                .unwrap_or_default();
        }
        for cidr in cidrs.iter().filter_map(|c| Cidr::parse(c).ok()) {
            for (set, used) in sets.iter().zip(used.iter_mut()) {
                if let Some(indexes) = set.indexes(&cidr) {
                    used.extend(indexes);
                }
            }
        }
    }
    Ok(used)
}

/// Tells in an event of each of the Node's ranges that no cluster CIDR holds: it is
/// left as it is, and takes nothing from the allocator.
fn report_outside(sets: &[CidrSet], node: &Value, cidrs: &[String]) {
    for text in cidrs {
        let inside = Cidr::parse(text)
            .ok()
            .is_some_and(|cidr| sets.iter().any(|s| s.indexes(&cidr).is_some()));
        if !inside {
            let clusters: Vec<String> = sets.iter().map(|s| s.cluster().to_string()).collect();
            events::record(
                node,
                EventType::Warning,
                "PodCIDROutsideClusterCIDR",
                &format!(
                    "podCIDR {text} is not in the cluster CIDRs {}; left as it is",
                    clusters.join(", ")
                ),
            );
        }
    }
}

trellis_plugin::controller!(NodeIpam);

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_plugin::GroupVersionResource;
    use trellis_plugin::controller::with_controller_host;
    use trellis_plugin::testing::ControllerHarness;

    fn nodes() -> GroupVersionResource {
        GroupVersionResource {
            group: String::new(),
            version: "v1".into(),
            resource: "nodes".into(),
        }
    }

    fn node(name: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "resourceVersion": "1"}})
    }

    fn node_with(name: &str, cidr: &str) -> Value {
        let mut n = node(name);
        n["spec"] = json!({"podCIDR": cidr, "podCIDRs": [cidr]});
        n
    }

    fn harness(names: &[&str]) -> ControllerHarness {
        names.iter().fold(ControllerHarness::new(), |h, name| {
            h.with_object(nodes(), node(name))
        })
    }

    fn allocate(h: &ControllerHarness, name: &str) -> Action {
        h.reconcile::<NodeIpam>(&nodes(), None, name).unwrap()
    }

    fn pod_cidr(h: &ControllerHarness, name: &str) -> Value {
        h.object(&nodes(), None, name).unwrap()["spec"]["podCIDR"].clone()
    }

    #[test]
    fn nodes_get_the_lowest_free_range_in_turn() {
        let h = harness(&["a", "b", "c"]);
        for name in ["b", "a", "c"] {
            assert_eq!(allocate(&h, name), Action::Done);
        }
        assert_eq!(pod_cidr(&h, "b"), "10.42.0.0/24");
        assert_eq!(pod_cidr(&h, "a"), "10.42.1.0/24");
        assert_eq!(pod_cidr(&h, "c"), "10.42.2.0/24");
        let a = h.object(&nodes(), None, "a").unwrap();
        assert_eq!(a["spec"]["podCIDRs"], json!(["10.42.1.0/24"]));
        // Already allocated: nothing written again.
        allocate(&h, "a");
        assert_eq!(h.writes().len(), 3);
    }

    #[test]
    fn the_allocator_is_rebuilt_from_the_nodes_after_a_restart() {
        // What a restarted controller finds: ranges given before, with a gap.
        let h = ControllerHarness::new()
            .with_object(nodes(), node_with("a", "10.42.0.0/24"))
            .with_object(nodes(), node_with("b", "10.42.2.0/24"))
            .with_object(nodes(), node("new"))
            .with_object(nodes(), node("newer"));
        allocate(&h, "a");
        allocate(&h, "new");
        allocate(&h, "newer");
        assert_eq!(pod_cidr(&h, "a"), "10.42.0.0/24");
        assert_eq!(pod_cidr(&h, "new"), "10.42.1.0/24");
        assert_eq!(pod_cidr(&h, "newer"), "10.42.3.0/24");
    }

    #[test]
    fn a_deleted_nodes_range_goes_to_the_next_node() {
        let h = harness(&["a", "b"]);
        allocate(&h, "a");
        allocate(&h, "b");
        with_controller_host(std::rc::Rc::new(h.clone()), || {
            client::delete(&nodes(), None, "a", None)
        })
        .unwrap();
        assert_eq!(allocate(&h, "a"), Action::Done);
        let h = h.with_object(nodes(), node("c"));
        allocate(&h, "c");
        assert_eq!(pod_cidr(&h, "c"), "10.42.0.0/24");
    }

    #[test]
    fn a_full_cluster_cidr_gives_an_event_and_a_retry() {
        let h = harness(&["a", "b", "c"])
            .with_configuration(json!({"clusterCIDRs": ["10.42.0.0/23"], "nodeCIDRMaskSize": 24}));
        allocate(&h, "a");
        allocate(&h, "b");
        assert_eq!(allocate(&h, "c"), Action::RequeueAfter(RETRY_WHEN_FULL));
        assert!(pod_cidr(&h, "c").is_null());
        assert_eq!(
            h.events(),
            [(
                "CIDRNotAvailable".to_owned(),
                "Node c status is now: CIDRNotAvailable".to_owned()
            )]
        );
    }

    #[test]
    fn a_range_set_by_hand_is_kept_and_never_given_again() {
        let h = ControllerHarness::new()
            .with_object(nodes(), node_with("manual", "10.42.0.0/24"))
            .with_object(nodes(), node_with("wide", "10.42.2.0/23"))
            .with_object(nodes(), node_with("elsewhere", "192.168.7.0/24"))
            .with_object(nodes(), node("a"))
            .with_object(nodes(), node("b"));
        for name in ["manual", "wide", "elsewhere", "a", "b"] {
            allocate(&h, name);
        }
        assert_eq!(pod_cidr(&h, "manual"), "10.42.0.0/24");
        assert_eq!(pod_cidr(&h, "elsewhere"), "192.168.7.0/24");
        assert_eq!(pod_cidr(&h, "a"), "10.42.1.0/24");
        // 10.42.2.0/23 holds 2 and 3.
        assert_eq!(pod_cidr(&h, "b"), "10.42.4.0/24");
        let events = h.events();
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].0, "PodCIDROutsideClusterCIDR");
        assert!(events[0].1.contains("192.168.7.0/24"), "{events:?}");
    }

    #[test]
    fn dual_stack_nodes_get_one_range_per_family() {
        let h = harness(&["a", "b"])
            .with_configuration(json!({"clusterCIDRs": ["10.42.0.0/16", "fd00:10:42::/56"]}));
        allocate(&h, "a");
        allocate(&h, "b");
        let b = h.object(&nodes(), None, "b").unwrap();
        assert_eq!(b["spec"]["podCIDR"], "10.42.1.0/24");
        assert_eq!(
            b["spec"]["podCIDRs"],
            json!(["10.42.1.0/24", "fd00:10:42:1::/64"])
        );
    }

    fn refused(configuration: Value) -> String {
        ControllerHarness::new()
            .with_object(nodes(), node("a"))
            .with_configuration(configuration)
            .reconcile::<NodeIpam>(&nodes(), None, "a")
            .unwrap_err()
    }

    #[test]
    fn bad_configuration_is_refused_with_what_is_wrong() {
        let e = refused(json!({"clusterCIDRs": ["10.42.0.0"]}));
        assert!(
            e.contains("clusterCIDRs") && e.contains("not a CIDR"),
            "{e}"
        );
        let e = refused(json!({"clusterCIDRs": ["10.42.0.0/16"], "nodeCIDRMaskSize": 16}));
        assert!(
            e.contains("nodeCIDRMaskSize") && e.contains("larger than 16"),
            "{e}"
        );
        let e = refused(json!({"clusterCIDRs": ["10.42.0.0/16", "10.43.0.0/16"]}));
        assert!(e.contains("one range per family"), "{e}");
        let e = refused(json!({"clusterCIDRs": []}));
        assert!(e.contains("at least one"), "{e}");
        let e = refused(json!({"clusterCIDRs": ["fd00::/48"], "nodeCIDRMaskSize": 24}));
        assert!(e.contains("nodeCIDRMaskSize"), "{e}");
        let e = refused(json!({"clusterCIDR": "10.42.0.0/16"}));
        assert!(e.contains("clusterCIDR"), "{e}");
        // The defaults are good.
        NodeIpam::deserialize(json!({}))
            .unwrap()
            .check_configuration()
            .unwrap();
    }
}
