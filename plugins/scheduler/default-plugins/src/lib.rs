//! The default scheduler plugins, as kube-scheduler's default profile has them, in
//! one component: they share one parsed view of the cluster, and the host asks all
//! of them in one call per extension point.
//!
//! The configuration may leave plugins out, weigh scores otherwise, and give
//! NodeResourcesFit kube-scheduler's arguments (see [`node_resources_fit`]):
//! `{"disabled": ["InterPodAffinity"], "weights": {"NodeResourcesFit": 2},
//! "nodeResourcesFit": {"scoringStrategy": {"type": "MostAllocated"}}}`.
//!
//! # Layout
//! One module per plugin, named as kube-scheduler names it, in its order ([`all`]):
//! - [`node_unschedulable`], [`node_name`], [`taint_toleration`], [`node_affinity`],
//!   [`node_ports`]: filters on the node alone;
//! - [`node_resources_fit`], [`node_resources_balanced_allocation`]: requests
//!   against allocatable;
//! - [`pod_topology_spread`], [`inter_pod_affinity`]: the pods already placed, counted
//!   per topology domain once per cycle;
//! - [`labels`]: label selectors, shared by the plugins that match labels.
//!
//! The volume plugins (VolumeBinding, NodeVolumeLimits, VolumeZone, ...) and
//! ImageLocality are not here.

use std::collections::BTreeMap;

use serde::Deserialize;
use trellis_plugin::scheduler::{ClusterEvent, Plugin};

mod inter_pod_affinity;
mod labels;
mod node_affinity;
mod node_name;
mod node_ports;
mod node_resources_balanced_allocation;
mod node_resources_fit;
mod node_unschedulable;
mod pod_topology_spread;
mod taint_toleration;

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Configuration {
    /// Plugins left out, by name.
    disabled: Vec<String>,
    /// Score weights other than each plugin's default.
    weights: BTreeMap<String, u32>,
    /// NodeResourcesFit's arguments (`NodeResourcesFitArgs`).
    node_resources_fit: Option<node_resources_fit::Args>,
}

/// A kind of event on `resource` that may make a rejected pod schedulable.
pub(crate) fn event(resource: &str, add: bool, update: bool, delete: bool) -> ClusterEvent {
    ClusterEvent {
        resource: resource.to_owned(),
        add,
        update,
        delete,
    }
}

/// Wraps a plugin with the weight the configuration gives it.
struct Weighted {
    inner: Box<dyn Plugin>,
    weight: u32,
}

impl Plugin for Weighted {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn points(&self) -> trellis_plugin::scheduler::Points {
        self.inner.points()
    }
    fn weight(&self) -> u32 {
        self.weight
    }
    fn events(&self) -> Vec<trellis_plugin::scheduler::ClusterEvent> {
        self.inner.events()
    }
    fn pre_filter(
        &mut self,
        pod: &trellis_plugin::scheduler::PodInfo,
        cluster: &trellis_plugin::scheduler::Cluster,
    ) -> trellis_plugin::scheduler::PreFilterResult {
        self.inner.pre_filter(pod, cluster)
    }
    fn filter(
        &self,
        pod: &trellis_plugin::scheduler::PodInfo,
        node: &trellis_plugin::scheduler::NodeInfo,
        cluster: &trellis_plugin::scheduler::Cluster,
    ) -> trellis_plugin::scheduler::Status {
        self.inner.filter(pod, node, cluster)
    }
    fn pre_score(
        &mut self,
        pod: &trellis_plugin::scheduler::PodInfo,
        nodes: &[&trellis_plugin::scheduler::NodeInfo],
        cluster: &trellis_plugin::scheduler::Cluster,
    ) -> trellis_plugin::scheduler::Status {
        self.inner.pre_score(pod, nodes, cluster)
    }
    fn score(
        &self,
        pod: &trellis_plugin::scheduler::PodInfo,
        node: &trellis_plugin::scheduler::NodeInfo,
        cluster: &trellis_plugin::scheduler::Cluster,
    ) -> Result<i64, String> {
        self.inner.score(pod, node, cluster)
    }
    fn normalize(&self, scores: &mut [i64]) {
        self.inner.normalize(scores)
    }
}

/// Every default plugin, in kube-scheduler's order, with its default arguments.
pub fn all() -> Vec<Box<dyn Plugin>> {
    with_fit(node_resources_fit::NodeResourcesFit::default())
}

fn with_fit(fit: node_resources_fit::NodeResourcesFit) -> Vec<Box<dyn Plugin>> {
    vec![
        Box::new(node_unschedulable::NodeUnschedulable),
        Box::new(node_name::NodeName),
        Box::new(taint_toleration::TaintToleration),
        Box::new(node_affinity::NodeAffinity),
        Box::new(node_ports::NodePorts),
        Box::new(fit),
        Box::new(pod_topology_spread::PodTopologySpread::default()),
        Box::new(inter_pod_affinity::InterPodAffinity::default()),
        Box::new(node_resources_balanced_allocation::NodeResourcesBalancedAllocation::default()),
    ]
}

/// The plugins the configuration keeps, with its weights.
pub fn build(configuration: &str) -> Result<Vec<Box<dyn Plugin>>, String> {
    let config: Configuration = if configuration.trim().is_empty() {
        Configuration::default()
    } else {
        serde_json::from_str(configuration).map_err(|e| format!("configuration: {e}"))?
    };
    let fit =
        node_resources_fit::NodeResourcesFit::new(config.node_resources_fit.unwrap_or_default())
            .map_err(|e| format!("configuration: {e}"))?;
    let plugins = with_fit(fit);
    for name in config.disabled.iter().chain(config.weights.keys()) {
        if !plugins.iter().any(|p| p.name() == name) {
            return Err(format!("configuration: no plugin {name:?}"));
        }
    }
    Ok(plugins
        .into_iter()
        .filter(|p| !config.disabled.iter().any(|d| d == p.name()))
        .map(|p| -> Box<dyn Plugin> {
            match config.weights.get(p.name()) {
                Some(&weight) => Box::new(Weighted { inner: p, weight }),
                None => p,
            }
        })
        .collect())
}

trellis_plugin::scheduler!(build);

/// Builders of the views the plugins' table tests start from.
#[cfg(test)]
pub(crate) mod testing {
    use serde_json::{Value, json};
    use trellis_plugin::scheduler::{Change, Framework, Plugin, PodInfo};

    pub fn framework(plugins: Vec<Box<dyn Plugin>>) -> Framework {
        Framework::new(plugins)
    }

    /// A node numbered `id`; a missing name is `node-ID`.
    pub fn node(id: u32, mut node: Value) -> Change {
        node["apiVersion"] = json!("v1");
        node["kind"] = json!("Node");
        if node["metadata"]["name"].is_null() {
            node["metadata"]["name"] = json!(format!("node-{id}"));
        }
        Change::NodeUpsert {
            node: id,
            object: node.to_string(),
        }
    }

    /// A pod to schedule; a missing name is `p`, a missing spec has no containers.
    pub fn pod(mut pod: Value) -> PodInfo {
        if pod["metadata"]["name"].is_null() {
            pod["metadata"]["name"] = json!("p");
        }
        if pod["metadata"]["uid"].is_null() {
            let uid = format!(
                "uid-{}",
                pod["metadata"]["name"].as_str().unwrap_or_default()
            );
            pod["metadata"]["uid"] = json!(uid);
        }
        if pod["spec"].is_null() {
            pod["spec"] = json!({"containers": []});
        }
        PodInfo::from_json(&pod.to_string()).expect("a pod")
    }

    /// A pod placed on node `id`.
    pub fn placed(id: u32, pod: Value) -> Change {
        let info = self::pod(pod);
        Change::PodUpsert {
            uid: info.uid.clone(),
            node: id,
            object: serde_json::to_string(&info.pod).expect("a pod"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{framework, node, pod};
    use serde_json::json;

    #[test]
    fn the_default_plugins_together_give_each_rejection_its_reason() {
        let mut fw = framework(all());
        let allocatable = json!({"cpu": "4", "memory": "8Gi", "pods": "110"});
        let labelled = |id: u32, zone: &str, spec: serde_json::Value| {
            node(
                id,
                json!({"metadata": {"labels": {"topology.kubernetes.io/zone": zone}},
                "spec": spec, "status": {"allocatable": allocatable}}),
            )
        };
        fw.update([
            labelled(
                0,
                "a",
                json!({"taints": [{"key": "k", "value": "v", "effect": "NoSchedule"}]}),
            ),
            node(
                1,
                json!({"metadata": {"labels": {"topology.kubernetes.io/zone": "a"}},
                "status": {"allocatable": {"cpu": "1", "memory": "8Gi", "pods": "110"}}}),
            ),
            labelled(2, "b", json!({})),
            labelled(3, "a", json!({})),
        ]);
        let p = || {
            pod(
                json!({"spec": {"nodeSelector": {"topology.kubernetes.io/zone": "a"},
                "containers": [{"name": "c", "resources": {"requests": {"cpu": "2"}}}]}}),
            )
        };
        assert_eq!(fw.schedule(p()), Ok("node-3".to_owned()));
        fw.update([trellis_plugin::scheduler::Change::NodeRemove(3)]);
        assert_eq!(
            fw.schedule(p()),
            Err(vec![
                ("Insufficient cpu".to_owned(), 1),
                (
                    "node(s) didn't match Pod's node affinity/selector".to_owned(),
                    1
                ),
                ("node(s) had untolerated taint {k: v}".to_owned(), 1),
            ])
        );
    }

    #[test]
    fn plugins_come_in_kube_schedulers_order() {
        let names: Vec<_> = all().iter().map(|p| p.name()).collect();
        assert_eq!(
            names,
            [
                "NodeUnschedulable",
                "NodeName",
                "TaintToleration",
                "NodeAffinity",
                "NodePorts",
                "NodeResourcesFit",
                "PodTopologySpread",
                "InterPodAffinity",
                "NodeResourcesBalancedAllocation",
            ]
        );
        let weights: Vec<_> = all().iter().map(|p| p.weight()).collect();
        assert_eq!(weights, [1, 1, 3, 2, 1, 1, 2, 2, 1]);
    }

    #[test]
    fn configuration_picks_plugins_weights_and_fit_arguments() {
        let plugins = build(
            r#"{"disabled": ["InterPodAffinity"], "weights": {"NodeResourcesFit": 5},
            "nodeResourcesFit": {"scoringStrategy": {"type": "MostAllocated"}}}"#,
        )
        .expect("a valid configuration");
        assert_eq!(plugins.len(), all().len() - 1);
        assert!(plugins.iter().all(|p| p.name() != "InterPodAffinity"));
        let fit = plugins.iter().find(|p| p.name() == "NodeResourcesFit");
        assert_eq!(fit.map(|p| p.weight()), Some(5));
        assert!(build(r#"{"nodeResourcesFit": {"scoringStrategy": {"type": "Spread"}}}"#).is_err());
        assert!(build(r#"{"nodeResourcesFit": {"scoringStrategy": {"resources": [{"name": "cpu", "weight": 0}, {"name": "memory", "weight": 200}]}}}"#).is_err());
        assert!(build(r#"{"disabled": ["ImageLocality"]}"#).is_err());
    }
}
