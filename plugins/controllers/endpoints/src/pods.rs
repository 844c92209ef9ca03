//! What one pod contributes to a Service: whether it is listed at all, the ports it
//! resolves the Service's ports to, and its endpoint (conditions, node, zone,
//! hostname, target), as Kubernetes' `endpointslice` utilities compute them.

use serde_json::{Value, json};

/// The label of a Node that names its zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// The pod's Ready condition says True.
pub fn is_ready(pod: &Value) -> bool {
    pod["status"]["conditions"].as_array().is_some_and(|cs| {
        cs.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

/// Being deleted: a deletionTimestamp is set (its finalizers or grace period hold it).
pub fn is_terminating(pod: &Value) -> bool {
    !pod["metadata"]["deletionTimestamp"].is_null()
}

/// The pod's IPv4 address (the slices' `addressType`), from `podIPs` or `podIP`.
pub fn ipv4(pod: &Value) -> Option<&str> {
    let status = &pod["status"];
    status["podIPs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["ip"].as_str())
        .chain(status["podIP"].as_str())
        .find(|ip| ip.parse::<std::net::Ipv4Addr>().is_ok())
}

/// Kubernetes' `ShouldPodBeInEndpoints`: not finished, with an address, and not
/// being deleted unless `include_terminating`.
pub fn listed(pod: &Value, include_terminating: bool) -> bool {
    !matches!(
        pod["status"]["phase"].as_str(),
        Some("Succeeded" | "Failed")
    ) && ipv4(pod).is_some()
        && (include_terminating || !is_terminating(pod))
}

/// The pod's hostname is published for the Service: it names one (`spec.hostname`)
/// and its `spec.subdomain` is the Service, in the same namespace.
pub fn hostname<'a>(pod: &'a Value, service: &Value) -> Option<&'a str> {
    let hostname = pod["spec"]["hostname"].as_str().filter(|h| !h.is_empty())?;
    (pod["spec"]["subdomain"] == service["metadata"]["name"]
        && pod["metadata"]["namespace"] == service["metadata"]["namespace"])
        .then_some(hostname)
}

/// The number a Service port reaches on `pod` (Kubernetes' `FindPort`): a number as
/// is; a name looked up among the containers' ports of the same protocol, then the
/// sidecars' (init containers that keep running); `None` when no container has it.
pub fn find_port(service_port: &Value, pod: &Value) -> Option<i64> {
    let protocol = service_port["protocol"].as_str().unwrap_or("TCP");
    match &service_port["targetPort"] {
        Value::Number(n) => n.as_i64(),
        Value::String(name) => {
            let spec = &pod["spec"];
            let sidecars = spec["initContainers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|c| c["restartPolicy"] == "Always");
            spec["containers"]
                .as_array()
                .into_iter()
                .flatten()
                .chain(sidecars)
                .flat_map(|c| c["ports"].as_array().into_iter().flatten())
                .find(|p| {
                    p["name"] == name.as_str()
                        && p["protocol"].as_str().unwrap_or("TCP") == protocol
                })?["containerPort"]
                .as_i64()
        }
        _ => service_port["port"].as_i64(),
    }
}

/// The pod's ports for the Service, in the Service's order, as an EndpointSlice lists
/// them (`name` always, `""` for an unnamed port); a port the pod cannot resolve is
/// left out.
pub fn slice_ports(service: &Value, pod: &Value) -> Vec<Value> {
    service["spec"]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            let mut port = json!({
                "name": p["name"].as_str().unwrap_or_default(),
                "port": find_port(p, pod)?,
                "protocol": p["protocol"].as_str().unwrap_or("TCP"),
            });
            if let Some(app) = p["appProtocol"].as_str() {
                port["appProtocol"] = json!(app);
            }
            Some(port)
        })
        .collect()
}

/// The same ports as an Endpoints subset lists them (an empty name left out).
pub fn subset_ports(slice_ports: &[Value]) -> Vec<Value> {
    slice_ports
        .iter()
        .map(|p| {
            let mut p = p.clone();
            if p["name"] == ""
                && let Some(map) = p.as_object_mut()
            {
                map.remove("name");
            }
            p
        })
        .collect()
}

/// The reference to the pod an endpoint carries.
pub fn target_ref(pod: &Value) -> Value {
    json!({
        "kind": "Pod",
        "namespace": pod["metadata"]["namespace"],
        "name": pod["metadata"]["name"],
        "uid": pod["metadata"]["uid"],
    })
}

/// The pod's endpoint in an EndpointSlice (Kubernetes' `podToEndpoint`): serving is
/// its readiness; ready is that unless it is terminating, and always with
/// `publishNotReadyAddresses`; `zone` is its Node's, when the Node is known.
pub fn slice_endpoint(pod: &Value, service: &Value, node: Option<&Value>) -> Option<Value> {
    let serving = is_ready(pod);
    let terminating = is_terminating(pod);
    let ready = service["spec"]["publishNotReadyAddresses"] == true || (serving && !terminating);
    let mut endpoint = json!({
        "addresses": [ipv4(pod)?],
        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
        "targetRef": target_ref(pod),
    });
    if let Some(node) = pod["spec"]["nodeName"].as_str().filter(|n| !n.is_empty()) {
        endpoint["nodeName"] = json!(node);
    }
    if let Some(zone) = node
        .and_then(|n| n["metadata"]["labels"][ZONE_LABEL].as_str())
        .filter(|z| !z.is_empty())
    {
        endpoint["zone"] = json!(zone);
    }
    if let Some(hostname) = hostname(pod, service) {
        endpoint["hostname"] = json!(hostname);
    }
    Some(endpoint)
}

/// When the pod last changed in a way endpoints show: its Ready condition's last
/// transition (Kubernetes' `getPodTriggerTime`).
pub fn trigger_time(pod: &Value) -> Option<&str> {
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Ready")?["lastTransitionTime"]
        .as_str()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_ports_resolve_by_name_and_protocol_including_sidecars() {
        let pod = json!({"spec": {
            "containers": [{"ports": [{"name": "dns", "containerPort": 53, "protocol": "UDP"},
                                      {"name": "dns", "containerPort": 5353, "protocol": "TCP"}]}],
            "initContainers": [
                {"restartPolicy": "Always", "ports": [{"name": "metrics", "containerPort": 9100}]},
                {"ports": [{"name": "setup", "containerPort": 1}]}]}});
        let port = |target: Value, protocol: &str| {
            find_port(
                &json!({"port": 80, "targetPort": target, "protocol": protocol}),
                &pod,
            )
        };
        assert_eq!(port(json!("dns"), "UDP"), Some(53));
        assert_eq!(port(json!("dns"), "TCP"), Some(5353));
        assert_eq!(port(json!("metrics"), "TCP"), Some(9100));
        assert_eq!(port(json!("setup"), "TCP"), None);
        assert_eq!(port(json!(8080), "TCP"), Some(8080));
    }

    #[test]
    fn a_terminating_pod_serves_as_it_is_ready_but_is_not_ready() {
        let service = json!({"metadata": {"name": "web", "namespace": "ns"}, "spec": {}});
        let pod = json!({
            "metadata": {"name": "a", "namespace": "ns", "uid": "u", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"nodeName": "n1", "hostname": "a", "subdomain": "web"},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}});
        let node = json!({"metadata": {"labels": {ZONE_LABEL: "z1"}}});
        let e = slice_endpoint(&pod, &service, Some(&node)).unwrap();
        assert_eq!(
            e["conditions"],
            json!({"ready": false, "serving": true, "terminating": true})
        );
        assert_eq!(e["zone"], "z1");
        assert_eq!(e["hostname"], "a");
        assert_eq!(e["nodeName"], "n1");
        assert!(listed(&pod, true));
        assert!(!listed(&pod, false));
        let published = json!({"metadata": {"name": "other", "namespace": "ns"},
                               "spec": {"publishNotReadyAddresses": true}});
        let e = slice_endpoint(&pod, &published, None).unwrap();
        assert_eq!(e["conditions"]["ready"], true);
        assert!(e.get("hostname").is_none() && e.get("zone").is_none());
    }
}
