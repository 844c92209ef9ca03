//! The Endpoints controller, as Kubernetes' behaves: each Service with a selector has
//! an Endpoints object of the same name listing the pods it selects that have an
//! address: the ready ones in `addresses`, the others in `notReadyAddresses` (all in
//! `addresses` with `publishNotReadyAddresses`), grouped by the ports they resolve
//! the Service's ports to (a named `targetPort` is looked up in each pod's
//! containers). Pods being deleted or finished are left out. A Service without a
//! selector keeps the Endpoints its owner writes.
//!
//! Configured `{"write": "endpointslices"}`, the same component is the EndpointSlice
//! controller: the same addresses as `discovery.k8s.io/v1` EndpointSlices labelled
//! `kubernetes.io/service-name`, one per set of resolved ports, owned by the Service.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{Action, ObjectKey, Reconcile, Write, cache, client, owned};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoints {
    /// What it writes: `endpoints` (the default) or `endpointslices`.
    #[serde(default)]
    write: Target,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    #[default]
    Endpoints,
    EndpointSlices,
}

pub const SERVICE_NAME: &str = "kubernetes.io/service-name";
const MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";

fn slices() -> GroupVersionResource {
    GroupVersionResource {
        group: "discovery.k8s.io".into(),
        version: "v1".into(),
        resource: "endpointslices".into(),
    }
}

/// The EndpointSlices a Service's subsets make, by name: one per set of ports (a
/// Service with no address gets one with no endpoints, as Kubernetes keeps).
pub fn slices_of(service: &Value, subsets: &[Value]) -> BTreeMap<String, Value> {
    use std::hash::{Hash, Hasher};
    let name = service["metadata"]["name"].as_str().unwrap_or_default();
    let endpoint = |address: &Value, ready: bool| {
        let mut e = json!({
            "addresses": [address["ip"]],
            "conditions": {"ready": ready, "serving": ready, "terminating": false},
            "targetRef": address["targetRef"],
        });
        if let Some(node) = address["nodeName"].as_str() {
            e["nodeName"] = json!(node);
        }
        e
    };
    let mut out = BTreeMap::new();
    let groups: Vec<Value> = if subsets.is_empty() {
        vec![json!({})]
    } else {
        subsets.to_vec()
    };
    for subset in groups {
        let ports = subset["ports"].clone();
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        ports.to_string().hash(&mut hasher);
        let slice_name = format!("{name}-{:08x}", hasher.finish() as u32);
        let mut endpoints: Vec<Value> = Vec::new();
        for a in subset["addresses"].as_array().into_iter().flatten() {
            endpoints.push(endpoint(a, true));
        }
        for a in subset["notReadyAddresses"].as_array().into_iter().flatten() {
            endpoints.push(endpoint(a, false));
        }
        let mut slice = json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": slice_name,
                "labels": {SERVICE_NAME: name, MANAGED_BY: "endpointslice-controller.k8s.io"},
                "ownerReferences": [owned::controller_reference("v1", "Service", service)],
            },
            "addressType": "IPv4",
            "endpoints": endpoints,
        });
        if ports.is_array() {
            slice["ports"] = ports;
        }
        out.insert(slice_name, slice);
    }
    out
}

/// Writes the slices `wanted` against those that exist; the writes it takes.
fn slice_writes(key: &ObjectKey, wanted: BTreeMap<String, Value>) -> Result<Vec<Write>, String> {
    let selector = format!("{SERVICE_NAME}={}", key.name);
    let existing: Vec<Value> = cache::list_as(&slices(), key.namespace.as_deref(), &selector)?;
    let mut writes = Vec::new();
    for current in &existing {
        let name = current["metadata"]["name"].as_str().unwrap_or_default();
        if !wanted.contains_key(name) {
            writes.push(Write::Delete {
                resource: slices(),
                namespace: key.namespace.clone(),
                name: name.to_owned(),
                propagation: None,
                uid: current["metadata"]["uid"].as_str().map(str::to_owned),
            });
        }
    }
    for (name, mut slice) in wanted {
        let current = existing
            .iter()
            .find(|c| c["metadata"]["name"] == name.as_str());
        match current {
            Some(c) if c["endpoints"] == slice["endpoints"] && c["ports"] == slice["ports"] => {}
            Some(c) => {
                slice["metadata"]["resourceVersion"] = c["metadata"]["resourceVersion"].clone();
                writes.push(Write::Update {
                    resource: slices(),
                    namespace: key.namespace.clone(),
                    object: slice,
                    status: false,
                });
            }
            None => writes.push(Write::Create {
                resource: slices(),
                namespace: key.namespace.clone(),
                object: slice,
            }),
        }
    }
    Ok(writes)
}

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
        if self.write == Target::EndpointSlices {
            let writes = slice_writes(key, slices_of(&service, &subsets))?;
            for result in client::batch(writes)? {
                match result {
                    Ok(_) => {}
                    Err(e) if e.is_not_found() || e.is_already_exists() => {}
                    Err(e) if e.is_namespace_terminating() => {}
                    Err(e) => return Err(format!("write EndpointSlices of {}: {e}", key.name)),
                }
            }
            return Ok(Action::Done);
        }
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
            Err(e) if e.is_namespace_terminating() => Ok(Action::Done),
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
    fn slices_carry_the_same_addresses_with_their_conditions() {
        let service = json!({"metadata": {"name": "web", "uid": "s"},
                             "spec": {"ports": [{"name": "web", "port": 80, "targetPort": "http"}]}});
        let pods = [pod("a", "10.0.0.1", true), pod("c", "10.0.0.3", false)];
        let slices = slices_of(&service, &subsets(&service, &pods));
        assert_eq!(slices.len(), 1);
        let slice = slices.values().next().unwrap();
        assert_eq!(slice["metadata"]["labels"][SERVICE_NAME], "web");
        assert_eq!(slice["ports"][0]["port"], 8080);
        let ready: Vec<bool> = slice["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["conditions"]["ready"].as_bool().unwrap())
            .collect();
        assert_eq!(ready, [true, false]);
        // No address: one slice with no endpoints.
        let empty = slices_of(&service, &[]);
        assert_eq!(empty.values().next().unwrap()["endpoints"], json!([]));
    }

    #[test]
    fn publish_not_ready_addresses_lists_every_pod_as_an_address() {
        let service = json!({"spec": {"publishNotReadyAddresses": true, "ports": [{"port": 80, "targetPort": 9090}]}});
        let s = subsets(&service, &[pod("c", "10.0.0.3", false)]);
        assert_eq!(s[0]["addresses"][0]["ip"], "10.0.0.3");
        assert_eq!(s[0]["ports"][0]["port"], 9090);
    }
}
