//! A backend's discovery in the forms this server's own takes: its group in `/apis`
//! and `/apis/{group}`, and its `APIResourceList` turned into aggregated discovery's
//! `APIVersionDiscovery` (resources with their subresources nested), as
//! kube-aggregator's discovery manager merges its backends'.

use serde_json::{Value, json};

/// The `APIVersionDiscovery` of a backend's `APIResourceList`; `current` is whether
/// the backend passed its last check (`freshness` `Current`, else `Stale`).
pub fn version_discovery(version: &str, list: &Value, current: bool) -> Value {
    let entries: Vec<&Value> = list["resources"].as_array().into_iter().flatten().collect();
    let mut resources: Vec<Value> = Vec::new();
    for entry in entries.iter().filter(|e| !name_of(e).contains('/')) {
        let name = name_of(entry);
        let mut resource = json!({
            "resource": name,
            "responseKind": {"group": "", "version": "", "kind": entry["kind"]},
            "scope": if entry["namespaced"].as_bool().unwrap_or(false) { "Namespaced" } else { "Cluster" },
            "singularResource": entry["singularName"].as_str().filter(|s| !s.is_empty())
                .map_or_else(|| entry["kind"].as_str().unwrap_or_default().to_lowercase(), str::to_owned),
            "verbs": entry["verbs"],
        });
        for field in ["shortNames", "categories"] {
            if entry[field].as_array().is_some_and(|a| !a.is_empty()) {
                resource[field] = entry[field].clone();
            }
        }
        let subresources: Vec<Value> = entries
            .iter()
            .filter_map(|e| {
                let sub = name_of(e).strip_prefix(name)?.strip_prefix('/')?;
                Some(json!({
                    "subresource": sub,
                    "responseKind": {
                        "group": e["group"].as_str().unwrap_or_default(),
                        "version": e["version"].as_str().unwrap_or_default(),
                        "kind": e["kind"],
                    },
                    "verbs": e["verbs"],
                }))
            })
            .collect();
        if !subresources.is_empty() {
            resource["subresources"] = Value::Array(subresources);
        }
        resources.push(resource);
    }
    json!({
        "version": version,
        "resources": resources,
        "freshness": if current { "Current" } else { "Stale" },
    })
}

fn name_of(entry: &Value) -> &str {
    entry["name"].as_str().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resource_list_nests_subresources_and_names_scope() {
        let list = json!({
            "kind": "APIResourceList", "groupVersion": "metrics.k8s.io/v1beta1",
            "resources": [
                {"name": "nodes", "singularName": "", "namespaced": false, "kind": "NodeMetrics", "verbs": ["get", "list"]},
                {"name": "pods", "singularName": "", "namespaced": true, "kind": "PodMetrics", "verbs": ["get", "list"]},
                {"name": "pods/status", "singularName": "", "namespaced": true, "kind": "PodMetrics", "verbs": ["get"]},
            ],
        });
        let doc = version_discovery("v1beta1", &list, false);
        assert_eq!(doc["freshness"], "Stale");
        let resources = doc["resources"].as_array().unwrap();
        assert_eq!(resources.len(), 2);
        assert_eq!(resources[0]["scope"], "Cluster");
        assert_eq!(resources[0]["singularResource"], "nodemetrics");
        assert_eq!(resources[1]["scope"], "Namespaced");
        assert_eq!(resources[1]["subresources"][0]["subresource"], "status");
    }
}
