//! prefer-label: a Score plugin that prefers nodes carrying a label (with a given
//! value, or any), as much as its configured weight says against the default
//! plugins' scores.
//!
//! Configuration: `{"label": "disktype", "value": "ssd", "weight": 5}`; `value`
//! omitted means any value, `weight` defaults to 1 (kube-scheduler's weights are
//! 1..=100).

use serde::Deserialize;
use trellis_plugin::scheduler::{
    Cluster, ClusterEvent, MAX_NODE_SCORE, NodeInfo, Plugin, PodInfo, Points,
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Configuration {
    label: String,
    #[serde(default)]
    value: Option<String>,
    #[serde(default = "one")]
    weight: u32,
}

fn one() -> u32 {
    1
}

pub struct PreferLabel {
    label: String,
    value: Option<String>,
    weight: u32,
}

impl Plugin for PreferLabel {
    fn name(&self) -> &'static str {
        "PreferLabel"
    }

    fn points(&self) -> Points {
        Points {
            score: true,
            ..Points::default()
        }
    }

    fn weight(&self) -> u32 {
        self.weight
    }

    fn events(&self) -> Vec<ClusterEvent> {
        // A Score plugin rejects no pod; nothing to wait for.
        Vec::new()
    }

    fn score(&self, _: &PodInfo, node: &NodeInfo, _: &Cluster) -> Result<i64, String> {
        let found = node.labels().and_then(|l| l.get(&self.label));
        let matches = match (&self.value, found) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(wanted), Some(v)) => wanted == v,
        };
        Ok(if matches { MAX_NODE_SCORE } else { 0 })
    }
}

/// The component's plugins from its configuration.
pub fn build(configuration: &str) -> Result<Vec<Box<dyn Plugin>>, String> {
    let config: Configuration =
        serde_json::from_str(configuration).map_err(|e| format!("configuration: {e}"))?;
    if config.label.is_empty() {
        return Err("configuration: label: Required value".into());
    }
    if !(1..=100).contains(&config.weight) {
        return Err(format!(
            "configuration: weight: Invalid value: {}: must be in 1..=100",
            config.weight
        ));
    }
    Ok(vec![Box::new(PreferLabel {
        label: config.label,
        value: config.value,
        weight: config.weight,
    })])
}

trellis_plugin::scheduler!(build);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use trellis_plugin::scheduler::{Change, Framework, PodInfo};

    fn node(id: u32, labels: serde_json::Value) -> Change {
        Change::NodeUpsert {
            node: id,
            object: json!({"metadata": {"name": format!("n{id}"), "labels": labels}}).to_string(),
        }
    }

    fn pod() -> PodInfo {
        PodInfo::from_json(
            &json!({"metadata": {"name": "p", "uid": "u"}, "spec": {"containers": []}}).to_string(),
        )
        .unwrap()
    }

    #[test]
    fn the_labelled_node_wins() {
        let mut fw = Framework::new(build(r#"{"label": "disktype", "value": "ssd"}"#).unwrap());
        fw.update([
            node(0, json!({"disktype": "hdd"})),
            node(1, json!({"disktype": "ssd"})),
            node(2, json!({})),
        ]);
        assert_eq!(fw.schedule(pod()), Ok("n1".to_owned()));
    }

    #[test]
    fn any_value_counts_when_none_is_given() {
        let mut fw = Framework::new(build(r#"{"label": "gpu"}"#).unwrap());
        fw.update([node(0, json!({})), node(1, json!({"gpu": "a100"}))]);
        assert_eq!(fw.schedule(pod()), Ok("n1".to_owned()));
    }

    #[test]
    fn a_bad_configuration_is_refused_by_name() {
        let err = |c: &str| build(c).err().unwrap_or_default();
        assert!(err(r#"{"label": ""}"#).contains("label: Required value"));
        assert!(err(r#"{"label": "x", "weight": 0}"#).contains("weight: Invalid value: 0"));
        assert!(err(r#"{"lable": "x"}"#).contains("unknown field"));
    }
}
