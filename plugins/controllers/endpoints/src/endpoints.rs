//! The v1 Endpoints of a Service, as Kubernetes' endpoints controller writes them:
//! one object named after the Service, its pods grouped into subsets by the ports
//! they resolve to, ready pods in `addresses` and the others in `notReadyAddresses`
//! (every pod in `addresses` with `publishNotReadyAddresses`, which also keeps
//! terminating pods listed). Beyond 1000 addresses it is truncated and annotated
//! `endpoints.kubernetes.io/over-capacity: truncated`; the slices list them all.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::pods;

/// The label Kubernetes puts on the Endpoints of a headless Service.
const HEADLESS: &str = "service.kubernetes.io/headless";

/// The subsets a Service's selected pods make, in a stable order.
pub fn subsets(service: &Value, pods: &[Value]) -> Vec<Value> {
    let publish_all = service["spec"]["publishNotReadyAddresses"] == true;
    let headless_without_ports = service["spec"]["clusterIP"] == "None"
        && service["spec"]["ports"]
            .as_array()
            .is_none_or(Vec::is_empty);
    // Pods by the ports they resolve to: the ports, ready and not ready addresses.
    type Subset = (Vec<Value>, Vec<Value>, Vec<Value>);
    let mut groups: BTreeMap<String, Subset> = BTreeMap::new();
    for pod in pods {
        if !pods::listed(pod, publish_all) {
            continue;
        }
        let ports = pods::subset_ports(&pods::slice_ports(service, pod));
        // A pod that resolves none of the Service's ports is not an endpoint, except
        // of a headless Service that names no port.
        if ports.is_empty() && !headless_without_ports {
            continue;
        }
        let mut address = json!({
            "ip": pods::ipv4(pod),
            "targetRef": pods::target_ref(pod),
        });
        if let Some(hostname) = pods::hostname(pod, service) {
            address["hostname"] = json!(hostname);
        }
        if let Some(node) = pod["spec"]["nodeName"].as_str().filter(|n| !n.is_empty()) {
            address["nodeName"] = json!(node);
        }
        let group = groups
            .entry(Value::Array(ports.clone()).to_string())
            .or_insert_with(|| (ports, Vec::new(), Vec::new()));
        if publish_all || pods::is_ready(pod) {
            group.1.push(address);
        } else {
            group.2.push(address);
        }
    }
    groups
        .into_values()
        .map(|(ports, mut ready, mut not_ready)| {
            let by_ip = |a: &Value, b: &Value| {
                let ip = |v: &Value| {
                    v["ip"]
                        .as_str()
                        .and_then(|s| s.parse::<std::net::Ipv4Addr>().ok())
                };
                (ip(a), a["targetRef"]["uid"].as_str())
                    .cmp(&(ip(b), b["targetRef"]["uid"].as_str()))
            };
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

/// The most addresses one Endpoints holds (Kubernetes' `maxCapacity`): beyond, it
/// is truncated and annotated, and readers are pointed to the EndpointSlices.
pub const MAX_CAPACITY: usize = 1000;
/// The annotation a truncated Endpoints carries (`truncated`).
pub const OVER_CAPACITY: &str = "endpoints.kubernetes.io/over-capacity";

/// Cuts `subsets` to [`MAX_CAPACITY`] addresses as Kubernetes' `truncateEndpoints`:
/// ready addresses are kept before not-ready ones, and what each subset keeps is in
/// proportion to its size. Whether it cut anything.
pub fn truncate(subsets: &mut [Value]) -> bool {
    let count = |s: &Value, field: &str| s[field].as_array().map_or(0, Vec::len);
    let ready: usize = subsets.iter().map(|s| count(s, "addresses")).sum();
    let not_ready: usize = subsets.iter().map(|s| count(s, "notReadyAddresses")).sum();
    if ready + not_ready <= MAX_CAPACITY {
        return false;
    }
    let truncate_ready = ready > MAX_CAPACITY;
    let (max, total, field) = if truncate_ready {
        (MAX_CAPACITY, ready, "addresses")
    } else {
        (MAX_CAPACITY - ready, not_ready, "notReadyAddresses")
    };
    let mut can_be_added = max;
    for subset in subsets.iter_mut() {
        let allowed = (count(subset, field) * max)
            .div_ceil(total)
            .min(can_be_added);
        if truncate_ready && let Some(map) = subset.as_object_mut() {
            map.remove("notReadyAddresses");
        }
        if let Some(list) = subset[field].as_array_mut() {
            list.truncate(allowed);
        }
        can_be_added -= allowed;
    }
    true
}

/// The labels of a Service's Endpoints: the Service's, and the headless mark.
pub fn labels(service: &Value) -> Value {
    let mut labels = service["metadata"]["labels"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    labels.remove(HEADLESS);
    if service["spec"]["clusterIP"] == "None" {
        labels.insert(HEADLESS.into(), json!(""));
    }
    Value::Object(labels)
}

/// The subsets are the same: stored ones without any count as none.
pub fn same_subsets(current: &Value, wanted: &[Value]) -> bool {
    match current.as_array() {
        Some(c) => c.as_slice() == wanted,
        None => wanted.is_empty(),
    }
}

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
        let service = json!({"metadata": {"name": "web", "namespace": "ns"},
                             "spec": {"ports": [{"name": "web", "port": 80, "targetPort": "http", "protocol": "TCP"}]}});
        let mut terminating = pod("e", "10.0.0.5", true);
        terminating["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        let mut named = pod("f", "10.0.0.10", true);
        named["spec"]["hostname"] = json!("f");
        named["spec"]["subdomain"] = json!("web");
        let pods = [
            pod("b", "10.0.0.2", true),
            named,
            pod("a", "10.0.0.1", true),
            pod("c", "10.0.0.3", false),
            pod("d", "", true),
            terminating,
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
        // In address order (10.0.0.10 after 10.0.0.2); the terminating pod left out.
        assert_eq!(ips, ["10.0.0.1", "10.0.0.2", "10.0.0.10"]);
        assert_eq!(s[0]["addresses"][2]["hostname"], "f");
        assert_eq!(s[0]["addresses"][0]["nodeName"], "n1");
        assert_eq!(s[0]["notReadyAddresses"][0]["targetRef"]["name"], "c");
    }

    #[test]
    fn more_than_a_thousand_addresses_are_cut_ready_ones_first() {
        let addresses = |n: usize| {
            Value::Array(
                (0..n)
                    .map(|i| json!({"ip": format!("10.0.{}.{}", i / 250, i % 250)}))
                    .collect(),
            )
        };
        let mut subsets = vec![
            json!({"addresses": addresses(600), "notReadyAddresses": addresses(10)}),
            json!({"addresses": addresses(300), "notReadyAddresses": addresses(190)}),
        ];
        assert!(truncate(&mut subsets));
        let n = |s: &Value, f: &str| s[f].as_array().map_or(0, Vec::len);
        assert_eq!(
            (n(&subsets[0], "addresses"), n(&subsets[1], "addresses")),
            (600, 300)
        );
        // 100 not-ready places left, shared 10:190 and rounded up.
        assert_eq!(
            n(&subsets[0], "notReadyAddresses") + n(&subsets[1], "notReadyAddresses"),
            100
        );
        assert_eq!(n(&subsets[0], "notReadyAddresses"), 5);
        let mut small = vec![json!({"addresses": addresses(3)})];
        assert!(!truncate(&mut small));
    }

    #[test]
    fn publish_not_ready_addresses_lists_every_pod_as_an_address() {
        let service = json!({"spec": {"publishNotReadyAddresses": true, "ports": [{"port": 80, "targetPort": 9090}]}});
        let s = subsets(&service, &[pod("c", "10.0.0.3", false)]);
        assert_eq!(s[0]["addresses"][0]["ip"], "10.0.0.3");
        assert_eq!(s[0]["ports"][0]["port"], 9090);
        assert!(s[0]["ports"][0].get("name").is_none());
    }
}
