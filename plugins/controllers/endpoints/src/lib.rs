//! The Endpoints controller, as Kubernetes' behaves: each Service with a selector has
//! an Endpoints object of the same name listing the pods it selects that have an
//! address: the ready ones in `addresses`, the others in `notReadyAddresses` (all in
//! `addresses` with `publishNotReadyAddresses`), grouped by the ports they resolve
//! the Service's ports to (a named `targetPort` is looked up in each pod's
//! containers). Pods being deleted or finished are left out. A Service without a
//! selector keeps the Endpoints its owner writes.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{Action, ObjectKey, Reconcile, Write, cache, client, owned};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoints {}

fn gvr(resource: &str) -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: resource.into(),
    }
}

/// The port a Service port reaches on `pod`, or `None` when a named port is missing.
pub fn resolve_port(service_port: &Value, pod: &Value) -> Option<Value> {
    let target = &service_port["targetPort"];
    let number = match target {
        Value::Number(n) => n.as_i64()?,
        Value::String(name) => pod["spec"]["containers"]
            .as_array()?
            .iter()
            .flat_map(|c| c["ports"].as_array().into_iter().flatten())
            .find(|p| p["name"] == name.as_str())?["containerPort"]
            .as_i64()?,
        _ => service_port["port"].as_i64()?,
    };
    let mut port = json!({
        "port": number,
        "protocol": service_port["protocol"].as_str().unwrap_or("TCP"),
    });
    if let Some(name) = service_port["name"].as_str().filter(|n| !n.is_empty()) {
        port["name"] = json!(name);
    }
    Some(port)
}

fn is_ready(pod: &Value) -> bool {
    pod["status"]["conditions"].as_array().is_some_and(|cs| {
        cs.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

/// One subset being gathered: its ports, its ready and not ready addresses.
type Subset = (Vec<Value>, Vec<Value>, Vec<Value>);

/// The subsets a Service's selected pods make.
pub fn subsets(service: &Value, pods: &[Value]) -> Vec<Value> {
    let publish_all = service["spec"]["publishNotReadyAddresses"] == true;
    let service_ports: Vec<Value> = service["spec"]["ports"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    // Pods by the ports they resolve to: the ports, ready and not ready addresses.
    let mut groups: BTreeMap<String, Subset> = BTreeMap::new();
    for pod in pods {
        let Some(ip) = pod["status"]["podIP"].as_str().filter(|ip| !ip.is_empty()) else {
            continue;
        };
        if !pod["metadata"]["deletionTimestamp"].is_null()
            || matches!(
                pod["status"]["phase"].as_str(),
                Some("Succeeded" | "Failed")
            )
        {
            continue;
        }
        let ports: Vec<Value> = service_ports
            .iter()
            .filter_map(|p| resolve_port(p, pod))
            .collect();
        let mut address = json!({
            "ip": ip,
            "targetRef": {
                "kind": "Pod",
                "namespace": pod["metadata"]["namespace"],
                "name": pod["metadata"]["name"],
                "uid": pod["metadata"]["uid"],
            },
        });
        if let Some(node) = pod["spec"]["nodeName"].as_str() {
            address["nodeName"] = json!(node);
        }
        let group = groups
            .entry(Value::Array(ports.clone()).to_string())
            .or_insert_with(|| (ports, Vec::new(), Vec::new()));
        if publish_all || is_ready(pod) {
            group.1.push(address);
        } else {
            group.2.push(address);
        }
    }
    groups
        .into_values()
        .map(|(ports, mut ready, mut not_ready)| {
            let by_ip = |a: &Value, b: &Value| a["ip"].as_str().cmp(&b["ip"].as_str());
            ready.sort_by(by_ip);
            not_ready.sort_by(by_ip);
            let mut subset = json!({});
            if !ready.is_empty() {
                subset["addresses"] = Value::Array(ready);
            }
            if !not_ready.is_empty() {
                subset["notReadyAddresses"] = Value::Array(not_ready);
            }
            if !ports.is_empty() {
                subset["ports"] = Value::Array(ports);
            }
            subset
        })
        .collect()
}

impl Reconcile for Endpoints {
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let Some(service) = cache::get(&key.resource, ns, &key.name)? else {
            // Deleted: its Endpoints go with it (the garbage collector, by owner).
            return Ok(Action::Done);
        };
        let Some(selector) = service["spec"]["selector"]
            .as_object()
            .filter(|s| !s.is_empty())
        else {
            return Ok(Action::Done);
        };
        let selector = owned::selector_string(&json!({"matchLabels": selector}))?;
        let pods: Vec<Value> = cache::list_as(&gvr("pods"), ns, &selector)?;
        let subsets = subsets(&service, &pods);
        let existing = cache::get(&gvr("endpoints"), ns, &key.name)?;
        let mut wanted = json!({
            "apiVersion": "v1",
            "kind": "Endpoints",
            "metadata": {
                "name": key.name,
                "labels": service["metadata"]["labels"],
                "ownerReferences": [owned::controller_reference("v1", "Service", &service)],
            },
        });
        // No address: no subsets at all, as Kubernetes writes it.
        if !subsets.is_empty() {
            wanted["subsets"] = Value::Array(subsets.clone());
        }
        let write = match existing {
            Some(current)
                if current["subsets"] == wanted["subsets"]
                    || (current["subsets"].as_array().is_none_or(Vec::is_empty)
                        && subsets.is_empty()) =>
            {
                return Ok(Action::Done);
            }
            Some(current) => {
                wanted["metadata"]["resourceVersion"] =
                    current["metadata"]["resourceVersion"].clone();
                Write::Update {
                    resource: gvr("endpoints"),
                    namespace: key.namespace.clone(),
                    object: wanted,
                    status: false,
                }
            }
            None => Write::Create {
                resource: gvr("endpoints"),
                namespace: key.namespace.clone(),
                object: wanted,
            },
        };
        match client::write(write) {
            Ok(_) => Ok(Action::Done),
            Err(e) if e.code == 403 && e.message.contains("being terminated") => Ok(Action::Done),
            Err(e) => Err(format!("write Endpoints {}: {e}", key.name)),
        }
    }
}

trellis_plugin::controller!(Endpoints);

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ip: &str, ready: bool) -> Value {
        json!({"metadata": {"name": name, "namespace": "ns", "uid": format!("u-{name}")},
               "spec": {"nodeName": "n1", "containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}]},
               "status": {"podIP": ip, "phase": "Running",
                          "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}})
    }

    #[test]
    fn ready_and_not_ready_pods_are_listed_apart_with_named_ports_resolved() {
        let service =
            json!({"spec": {"ports": [{"name": "web", "port": 80, "targetPort": "http"}]}});
        let pods = [
            pod("b", "10.0.0.2", true),
            pod("a", "10.0.0.1", true),
            pod("c", "10.0.0.3", false),
            pod("d", "", true),
        ];
        let s = subsets(&service, &pods);
        assert_eq!(s.len(), 1);
        assert_eq!(
            s[0]["ports"],
            json!([{"name": "web", "port": 8080, "protocol": "TCP"}])
        );
        let ips: Vec<&str> = s[0]["addresses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["ip"].as_str().unwrap())
            .collect();
        assert_eq!(ips, ["10.0.0.1", "10.0.0.2"]);
        assert_eq!(s[0]["notReadyAddresses"][0]["targetRef"]["name"], "c");
    }

    #[test]
    fn publish_not_ready_addresses_lists_every_pod_as_an_address() {
        let service = json!({"spec": {"publishNotReadyAddresses": true, "ports": [{"port": 80, "targetPort": 9090}]}});
        let s = subsets(&service, &[pod("c", "10.0.0.3", false)]);
        assert_eq!(s[0]["addresses"][0]["ip"], "10.0.0.3");
        assert_eq!(s[0]["ports"][0]["port"], 9090);
    }
}
