//! The EndpointSlices of a Service, as Kubernetes' EndpointSlice reconciler keeps
//! them: the Service's endpoints grouped by the ports they resolve to, each group in
//! slices of at most `max_endpoints` endpoints. Existing slices are kept where they
//! still hold the right endpoints: a changed endpoint updates only the slice it is
//! in, new endpoints fill slices that are written anyway before any other, and a
//! slice written only because it must go is reused (renamed into) for a new one. A
//! Service with no endpoint keeps one empty slice (no ports, no endpoints).

use std::collections::BTreeMap;

use serde_json::{Value, json};
use trellis_plugin::controller::owned;

pub const SERVICE_NAME: &str = "kubernetes.io/service-name";
pub const MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";
/// The value of `MANAGED_BY` on the slices this controller writes (and only reads).
pub const CONTROLLER_NAME: &str = "endpointslice-controller.k8s.io";
const HEADLESS: &str = "service.kubernetes.io/headless";
pub const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// What the reconcile writes: whole slices, the creates with `generateName`.
#[derive(Debug, Default)]
pub struct Plan {
    pub create: Vec<Value>,
    pub update: Vec<Value>,
    pub delete: Vec<Value>,
}

/// Endpoints wanted for one set of ports, by identity.
pub type Wanted = BTreeMap<String, Value>;

/// The identity of an endpoint across reconciles (Kubernetes' endpoint hash): its
/// addresses, hostname and the pod it is.
pub fn identity(endpoint: &Value) -> String {
    let mut addresses: Vec<&str> = endpoint["addresses"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    addresses.sort_unstable();
    // Addresses as sortable numbers where they are IPv4, so slices fill in address order.
    let addresses: Vec<String> = addresses
        .iter()
        .map(|a| match a.parse::<std::net::Ipv4Addr>() {
            Ok(ip) => format!("{:010}", u32::from(ip)),
            Err(_) => (*a).to_owned(),
        })
        .collect();
    format!(
        "{}|{}|{}/{}",
        addresses.join(","),
        endpoint["hostname"].as_str().unwrap_or_default(),
        endpoint["targetRef"]["namespace"]
            .as_str()
            .unwrap_or_default(),
        endpoint["targetRef"]["name"].as_str().unwrap_or_default(),
    )
}

/// The key of a set of ports, whatever the order of each port's fields; a missing
/// list is the empty one.
pub fn ports_key(ports: &Value) -> String {
    let ports: Vec<Value> = ports
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| json!([p["name"], p["port"], p["protocol"], p["appProtocol"]]))
        .collect();
    Value::Array(ports).to_string()
}

/// The fields of an endpoint this controller sets, for comparing what is stored
/// with what is wanted (the API server may add defaults of its own).
fn comparable(endpoint: &Value) -> Value {
    let r = &endpoint["targetRef"];
    json!([
        endpoint["addresses"],
        endpoint["conditions"]["ready"],
        endpoint["conditions"]["serving"],
        endpoint["conditions"]["terminating"],
        endpoint["nodeName"],
        endpoint["zone"],
        endpoint["hostname"],
        [r["kind"], r["namespace"], r["name"], r["uid"]],
    ])
}

/// The labels a slice of `service` carries: the Service's own, then the service name,
/// the manager, and the headless mark for a Service without a cluster IP.
pub fn labels(service: &Value) -> Value {
    let mut labels = serde_json::Map::new();
    for (k, v) in service["metadata"]["labels"]
        .as_object()
        .into_iter()
        .flatten()
    {
        if k != SERVICE_NAME && k != MANAGED_BY && k != HEADLESS {
            labels.insert(k.clone(), v.clone());
        }
    }
    labels.insert(SERVICE_NAME.into(), service["metadata"]["name"].clone());
    labels.insert(MANAGED_BY.into(), json!(CONTROLLER_NAME));
    if service["spec"]["clusterIP"] == "None" {
        labels.insert(HEADLESS.into(), json!(""));
    }
    Value::Object(labels)
}

fn owned_by(slice: &Value, service: &Value) -> bool {
    let uid = service["metadata"]["uid"].as_str().unwrap_or_default();
    owned::is_controlled_by(slice, uid)
}

/// A new slice of `service` for `ports` (none: the empty slice), named by the API
/// server from `<service>-`.
fn new_slice(service: &Value, ports: Option<&Value>) -> Value {
    let name = service["metadata"]["name"].as_str().unwrap_or_default();
    // Kubernetes' prefix, unless the Service's name would not make a valid one.
    let prefix = if name.len() <= 252 {
        format!("{name}-")
    } else {
        "slice-".to_owned()
    };
    let mut slice = json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "generateName": prefix,
            "namespace": service["metadata"]["namespace"],
            "labels": labels(service),
            "ownerReferences": [owned::controller_reference("v1", "Service", service)],
        },
        "addressType": "IPv4",
        "endpoints": [],
    });
    if let Some(ports) = ports.filter(|p| p.as_array().is_some_and(|a| !a.is_empty())) {
        slice["ports"] = ports.clone();
    }
    slice
}

fn len(slice: &Value) -> usize {
    slice["endpoints"].as_array().map_or(0, Vec::len)
}

fn push(slice: &mut Value, endpoint: Value) {
    if let Some(eps) = slice["endpoints"].as_array_mut() {
        eps.push(endpoint);
    } else {
        slice["endpoints"] = json!([endpoint]);
    }
}

/// What to write so that `existing` (the slices labelled with the Service's name and
/// this controller as manager) hold `wanted`: endpoints by ports key, each with its
/// ports.
pub fn reconcile(
    service: &Value,
    wanted: BTreeMap<String, (Value, Wanted)>,
    existing: &[Value],
    max_endpoints: usize,
    trigger_time: Option<&str>,
) -> Plan {
    let max_endpoints = max_endpoints.max(1);
    let mut plan = Plan::default();
    let want_labels = labels(service);
    // Slices of another Service of this name (deleted and made again), or of another
    // address type, go.
    let mut by_ports: BTreeMap<String, Vec<&Value>> = BTreeMap::new();
    for slice in existing {
        if owned_by(slice, service) && slice["addressType"] == "IPv4" {
            by_ports
                .entry(ports_key(&slice["ports"]))
                .or_default()
                .push(slice);
        } else {
            plan.delete.push(slice.clone());
        }
    }
    let mut wanted = wanted;
    // Port sets no longer wanted: their slices go.
    for (key, slices) in &by_ports {
        if !wanted.contains_key(key) {
            plan.delete.extend(slices.iter().map(|s| (*s).clone()));
        }
    }
    for (key, (ports, mut endpoints)) in std::mem::take(&mut wanted) {
        let slices = by_ports.remove(&key).unwrap_or_default();
        let mut to_update: Vec<Value> = Vec::new();
        let mut unchanged: Vec<Value> = Vec::new();
        for slice in slices {
            let mut kept = Vec::new();
            let mut changed = false;
            for endpoint in slice["endpoints"].as_array().into_iter().flatten() {
                match endpoints.remove(&identity(endpoint)) {
                    Some(want) => {
                        changed |= comparable(endpoint) != comparable(&want);
                        kept.push(want);
                    }
                    None => changed = true,
                }
            }
            let mut slice = slice.clone();
            if changed && kept.is_empty() {
                plan.delete.push(slice);
                continue;
            }
            let relabel = slice["metadata"]["labels"] != want_labels;
            slice["endpoints"] = Value::Array(kept);
            if changed || relabel {
                slice["metadata"]["labels"] = want_labels.clone();
                to_update.push(slice);
            } else {
                unchanged.push(slice);
            }
        }
        // New endpoints go first into slices written anyway, the fullest first.
        let mut remaining = endpoints.into_values();
        let mut next = remaining.next();
        to_update.sort_by_key(|s| std::cmp::Reverse(len(s)));
        for slice in &mut to_update {
            while len(slice) < max_endpoints {
                match next.take() {
                    Some(e) => {
                        push(slice, e);
                        next = remaining.next();
                    }
                    None => break,
                }
            }
        }
        // Then into new slices, or, for a remainder smaller than a slice, into the
        // fullest unchanged slice that has room for all of it.
        let mut rest: Vec<Value> = next.into_iter().chain(remaining).collect();
        while !rest.is_empty() {
            let fill = (rest.len() < max_endpoints)
                .then(|| {
                    unchanged
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| len(s) + rest.len() <= max_endpoints)
                        .max_by_key(|(_, s)| len(s))
                        .map(|(i, _)| i)
                })
                .flatten();
            let (mut slice, is_new) = match fill {
                Some(i) => (unchanged.swap_remove(i), false),
                None => (new_slice(service, Some(&ports)), true),
            };
            let room = max_endpoints - len(&slice);
            for e in rest.drain(..room.min(rest.len())) {
                push(&mut slice, e);
            }
            if is_new {
                plan.create.push(slice);
            } else {
                to_update.push(slice);
            }
        }
        plan.update.extend(to_update);
    }
    // Port sets that exist but are no longer wanted were deleted above; with nothing
    // left, the Service keeps one empty slice.
    if existing.len() == plan.delete.len() && plan.create.is_empty() {
        let placeholder = new_slice(service, None);
        let is_placeholder =
            |s: &Value| len(s) == 0 && ports_key(&s["ports"]) == "[]" && owned_by(s, service);
        if plan.delete.len() == 1 && is_placeholder(&plan.delete[0]) {
            plan.delete.clear();
        } else {
            plan.create.push(placeholder);
        }
    }
    // A slice that goes gives its name to a slice that comes: one update for two writes.
    let mut i = 0;
    while i < plan.delete.len() && !plan.create.is_empty() {
        let gone = &plan.delete[i];
        if gone["addressType"] == "IPv4" && owned_by(gone, service) {
            let gone = plan.delete.remove(i);
            let mut slice = plan.create.pop().unwrap_or_default();
            if let Some(meta) = slice["metadata"].as_object_mut() {
                meta.remove("generateName");
            }
            slice["metadata"]["name"] = gone["metadata"]["name"].clone();
            slice["metadata"]["resourceVersion"] = gone["metadata"]["resourceVersion"].clone();
            if let Some(a) = gone["metadata"]["annotations"].as_object() {
                slice["metadata"]["annotations"] = Value::Object(a.clone());
            }
            plan.update.push(slice);
        } else {
            i += 1;
        }
    }
    for slice in plan.create.iter_mut().chain(plan.update.iter_mut()) {
        set_trigger_time(slice, trigger_time);
    }
    plan
}

fn set_trigger_time(slice: &mut Value, trigger_time: Option<&str>) {
    if !slice["metadata"]["annotations"].is_object() {
        slice["metadata"]["annotations"] = json!({});
    }
    let annotations = &mut slice["metadata"]["annotations"];
    match trigger_time {
        Some(t) => annotations[TRIGGER_TIME] = json!(t),
        None => {
            if let Some(a) = annotations.as_object_mut() {
                a.remove(TRIGGER_TIME);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service() -> Value {
        json!({"metadata": {"name": "web", "namespace": "ns", "uid": "s1", "labels": {"app": "web"}},
               "spec": {"clusterIP": "10.43.0.5"}})
    }

    fn endpoint(i: u32, ready: bool) -> Value {
        json!({"addresses": [format!("10.0.{}.{}", i / 250, i % 250 + 1)],
               "conditions": {"ready": ready, "serving": ready, "terminating": false},
               "targetRef": {"kind": "Pod", "namespace": "ns", "name": format!("p{i}"), "uid": format!("u{i}")}})
    }

    fn wanted(
        ports: Value,
        eps: impl IntoIterator<Item = Value>,
    ) -> BTreeMap<String, (Value, Wanted)> {
        let eps: Wanted = eps.into_iter().map(|e| (identity(&e), e)).collect();
        BTreeMap::from([(ports_key(&ports), (ports, eps))])
    }

    /// What the API server would store for the plan's writes, named in order.
    fn apply(existing: Vec<Value>, plan: Plan) -> Vec<Value> {
        let gone: Vec<&Value> = plan.delete.iter().map(|s| &s["metadata"]["name"]).collect();
        let updated: BTreeMap<String, Value> = plan
            .update
            .iter()
            .map(|s| {
                (
                    s["metadata"]["name"].as_str().unwrap().to_owned(),
                    s.clone(),
                )
            })
            .collect();
        let mut out: Vec<Value> = existing
            .into_iter()
            .filter(|s| !gone.contains(&&s["metadata"]["name"]))
            .map(|s| {
                updated
                    .get(s["metadata"]["name"].as_str().unwrap())
                    .cloned()
                    .unwrap_or(s)
            })
            .collect();
        for (i, mut s) in plan.create.into_iter().enumerate() {
            s["metadata"]["name"] = json!(format!("web-{}{i}", out.len()));
            out.push(s);
        }
        out
    }

    #[test]
    fn endpoints_split_at_the_limit_and_a_change_rewrites_one_slice() {
        let ports = json!([{"name": "", "port": 8080, "protocol": "TCP"}]);
        let plan = reconcile(
            &service(),
            wanted(ports.clone(), (0..250).map(|i| endpoint(i, true))),
            &[],
            100,
            None,
        );
        assert_eq!(
            plan.create.iter().map(len).collect::<Vec<_>>(),
            [100, 100, 50]
        );
        let stored = apply(vec![], plan);
        assert_eq!(stored[0]["metadata"]["labels"][SERVICE_NAME], "web");
        assert_eq!(stored[0]["metadata"]["labels"]["app"], "web");
        assert_eq!(stored[0]["metadata"]["ownerReferences"][0]["uid"], "s1");

        // The same endpoints again: nothing to write.
        let again = reconcile(
            &service(),
            wanted(ports.clone(), (0..250).map(|i| endpoint(i, true))),
            &stored,
            100,
            None,
        );
        assert!(
            again.create.is_empty() && again.update.is_empty() && again.delete.is_empty(),
            "{again:?}"
        );

        // One endpoint not ready: only its slice is written.
        let flip = reconcile(
            &service(),
            wanted(ports.clone(), (0..250).map(|i| endpoint(i, i != 7))),
            &stored,
            100,
            None,
        );
        assert!(flip.create.is_empty() && flip.delete.is_empty());
        assert_eq!(flip.update.len(), 1);
        assert_eq!(
            flip.update[0]["metadata"]["name"],
            stored[0]["metadata"]["name"]
        );

        // Ten more: into the partly full slice, which has room.
        let more = reconcile(
            &service(),
            wanted(ports.clone(), (0..260).map(|i| endpoint(i, true))),
            &stored,
            100,
            None,
        );
        assert!(more.create.is_empty() && more.delete.is_empty());
        assert_eq!(more.update.len(), 1);
        assert_eq!(len(&more.update[0]), 60);

        // None left: one slice stays, empty and without ports.
        let none = reconcile(&service(), BTreeMap::new(), &stored, 100, None);
        let stored = apply(stored, none);
        assert_eq!(stored.len(), 1);
        assert_eq!(len(&stored[0]), 0);
        assert!(stored[0]["ports"].is_null());
        let again = reconcile(&service(), BTreeMap::new(), &stored, 100, None);
        assert!(
            again.create.is_empty() && again.update.is_empty() && again.delete.is_empty(),
            "{again:?}"
        );

        // Endpoints come back: the empty slice is reused, not replaced.
        let back = reconcile(
            &service(),
            wanted(ports, [endpoint(1, true)]),
            &stored,
            100,
            Some("2026-01-01T00:00:00Z"),
        );
        assert!(back.create.is_empty() && back.delete.is_empty());
        assert_eq!(
            back.update[0]["metadata"]["name"],
            stored[0]["metadata"]["name"]
        );
        assert_eq!(
            back.update[0]["metadata"]["annotations"][TRIGGER_TIME],
            "2026-01-01T00:00:00Z"
        );
    }

    #[test]
    fn slices_of_another_service_of_the_name_go_and_labels_follow_the_service() {
        let ports = json!([{"name": "http", "port": 80, "protocol": "TCP"}]);
        let stored = apply(
            vec![],
            reconcile(
                &service(),
                wanted(ports.clone(), [endpoint(1, true)]),
                &[],
                100,
                None,
            ),
        );
        let mut relabelled = service();
        relabelled["metadata"]["labels"]["tier"] = json!("front");
        let plan = reconcile(
            &relabelled,
            wanted(ports.clone(), [endpoint(1, true)]),
            &stored,
            100,
            None,
        );
        assert_eq!(plan.update.len(), 1);
        assert_eq!(plan.update[0]["metadata"]["labels"]["tier"], "front");

        let mut recreated = service();
        recreated["metadata"]["uid"] = json!("s2");
        let plan = reconcile(
            &recreated,
            wanted(ports, [endpoint(1, true)]),
            &stored,
            100,
            None,
        );
        assert_eq!(plan.delete.len(), 1);
        assert_eq!(plan.create.len(), 1);
        assert_eq!(
            plan.create[0]["metadata"]["ownerReferences"][0]["uid"],
            "s2"
        );
    }
}
