//! The Endpoints and EndpointSlice controllers, as Kubernetes 1.30's behave: each
//! Service with a selector (and not of type ExternalName) lists the pods it selects
//! that have an IPv4 address.
//!
//! Configured `{}` (or `{"write": "endpoints"}`), the component is the Endpoints
//! controller: one v1 Endpoints named after the Service ([`endpoints`]). Configured
//! `{"write": "endpointslices"}`, it is the EndpointSlice controller: the same pods
//! as `discovery.k8s.io/v1` EndpointSlices ([`slices`]), with each endpoint's
//! conditions, node, zone (from the Node's `topology.kubernetes.io/zone`, when the
//! controller watches nodes) and hostname ([`pods`]). Either writes only what
//! changed, compared with its cache.
//!
//! # Layout
//! - [`pods`]: what one pod contributes: ports resolved per pod, conditions, hostname.
//! - [`endpoints`]: the v1 Endpoints' subsets.
//! - [`slices`]: the EndpointSlice reconciler: port groups, slices of at most
//!   `maxEndpointsPerSlice` endpoints, the fewest writes.

pub mod endpoints;
pub mod pods;
pub mod slices;

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{Action, ObjectKey, Reconcile, Write, cache, client, owned};

pub use slices::{CONTROLLER_NAME, MANAGED_BY, SERVICE_NAME};

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Endpoints {
    /// What it writes: `endpoints` (the default) or `endpointslices`.
    #[serde(default)]
    write: Target,
    /// The most endpoints one slice holds (kube-controller-manager's
    /// `--max-endpoints-per-slice`, 100 by default).
    #[serde(default = "default_max_endpoints")]
    max_endpoints_per_slice: usize,
}

fn default_max_endpoints() -> usize {
    100
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    #[default]
    Endpoints,
    EndpointSlices,
}

fn slices_resource() -> GroupVersionResource {
    GroupVersionResource {
        group: "discovery.k8s.io".into(),
        version: "v1".into(),
        resource: "endpointslices".into(),
    }
}

fn core(resource: &str) -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: resource.into(),
    }
}

/// The latest change the endpoints show: the Service's creation or a pod's readiness
/// turning (the `endpoints.kubernetes.io/last-change-trigger-time` annotation).
fn trigger_time<'a>(service: &'a Value, pods: &'a [Value]) -> Option<&'a str> {
    pods.iter()
        .filter_map(pods::trigger_time)
        .chain(service["metadata"]["creationTimestamp"].as_str())
        .filter_map(|t| Some((trellis_plugin::controller::time::parse(t)?, t)))
        .max()
        .map(|(_, t)| t)
}

impl Endpoints {
    /// Writes the Service's EndpointSlices; pods on a Node the cache does not hold are
    /// left out and the Service tried again, as Kubernetes does (unless
    /// `publishNotReadyAddresses`).
    fn reconcile_slices(
        &self,
        key: &ObjectKey,
        service: &Value,
        pods: &[Value],
    ) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let publish_all = service["spec"]["publishNotReadyAddresses"] == true;
        // Nodes by name, looked up once; `None` when nodes are not watched.
        let mut nodes: BTreeMap<&str, Option<Value>> = BTreeMap::new();
        let mut nodes_known = true;
        let mut missing = Vec::new();
        let mut wanted: BTreeMap<String, (Value, slices::Wanted)> = BTreeMap::new();
        for pod in pods {
            if !pods::listed(pod, true) {
                continue;
            }
            let node_name = pod["spec"]["nodeName"].as_str().unwrap_or_default();
            let node = match nodes.get(node_name) {
                Some(n) => n.clone(),
                None if node_name.is_empty() || !nodes_known => None,
                None => {
                    let n = match cache::get(&core("nodes"), None, node_name) {
                        Ok(n) => n,
                        // A controller declared without nodes lists no zones.
                        Err(_) => {
                            nodes_known = false;
                            None
                        }
                    };
                    nodes.insert(node_name, n.clone());
                    n
                }
            };
            if nodes_known && !node_name.is_empty() && node.is_none() && !publish_all {
                missing.push(format!(
                    "{}: Node {node_name} Not Found",
                    pod["metadata"]["name"].as_str().unwrap_or_default()
                ));
                continue;
            }
            let Some(endpoint) = pods::slice_endpoint(pod, service, node.as_ref()) else {
                continue;
            };
            let ports = Value::Array(pods::slice_ports(service, pod));
            wanted
                .entry(slices::ports_key(&ports))
                .or_insert_with(|| (ports, BTreeMap::new()))
                .1
                .insert(slices::identity(&endpoint), endpoint);
        }
        let selector = format!("{SERVICE_NAME}={},{MANAGED_BY}={CONTROLLER_NAME}", key.name);
        let existing: Vec<Value> = cache::list_as(&slices_resource(), ns, &selector)?;
        let plan = slices::reconcile(
            service,
            wanted,
            &existing,
            self.max_endpoints_per_slice,
            trigger_time(service, pods),
        );
        let mut writes = Vec::new();
        for slice in plan.delete {
            writes.push(Write::Delete {
                resource: slices_resource(),
                namespace: key.namespace.clone(),
                name: slice["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                propagation: None,
                uid: slice["metadata"]["uid"].as_str().map(str::to_owned),
            });
        }
        for object in plan.update {
            writes.push(Write::Update {
                resource: slices_resource(),
                namespace: key.namespace.clone(),
                object,
                status: false,
            });
        }
        for object in plan.create {
            writes.push(Write::Create {
                resource: slices_resource(),
                namespace: key.namespace.clone(),
                object,
            });
        }
        if !writes.is_empty() {
            for result in client::batch(writes)? {
                match result {
                    Ok(_) => {}
                    Err(e) if e.is_not_found() || e.is_namespace_terminating() => {}
                    Err(e) => return Err(format!("write EndpointSlices of {}: {e}", key.name)),
                }
            }
        }
        if !missing.is_empty() {
            return Err(format!(
                "skipping pods of Service {}: {}",
                key.name,
                missing.join(", ")
            ));
        }
        Ok(Action::Done)
    }

    fn reconcile_endpoints(
        &self,
        key: &ObjectKey,
        service: &Value,
        pods: &[Value],
    ) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let mut subsets = endpoints::subsets(service, pods);
        let truncated = endpoints::truncate(&mut subsets);
        let labels = endpoints::labels(service);
        let existing = cache::get(&core("endpoints"), ns, &key.name)?;
        let mut wanted = json!({
            "apiVersion": "v1",
            "kind": "Endpoints",
            "metadata": {
                "name": key.name,
                "labels": labels,
                "ownerReferences": [owned::controller_reference("v1", "Service", service)],
            },
        });
        // No address: no subsets at all, as Kubernetes writes it.
        if !subsets.is_empty() {
            wanted["subsets"] = Value::Array(subsets.clone());
        }
        let write = match existing {
            Some(current)
                if endpoints::same_subsets(&current["subsets"], &subsets)
                    && current["metadata"]["annotations"][endpoints::OVER_CAPACITY].is_string()
                        == truncated
                    && current["metadata"]["labels"]
                        .as_object()
                        .cloned()
                        .unwrap_or_default()
                        == labels.as_object().cloned().unwrap_or_default() =>
            {
                return Ok(Action::Done);
            }
            Some(current) => {
                wanted["metadata"]["resourceVersion"] =
                    current["metadata"]["resourceVersion"].clone();
                let mut annotations = current["metadata"]["annotations"]
                    .as_object()
                    .cloned()
                    .unwrap_or_default();
                match trigger_time(service, pods) {
                    Some(t) => annotations.insert(slices::TRIGGER_TIME.into(), json!(t)),
                    None => annotations.remove(slices::TRIGGER_TIME),
                };
                match truncated {
                    true => annotations.insert(endpoints::OVER_CAPACITY.into(), json!("truncated")),
                    false => annotations.remove(endpoints::OVER_CAPACITY),
                };
                wanted["metadata"]["annotations"] = Value::Object(annotations);
                Write::Update {
                    resource: core("endpoints"),
                    namespace: key.namespace.clone(),
                    object: wanted,
                    status: false,
                }
            }
            None => {
                let mut annotations = serde_json::Map::new();
                if let Some(t) = trigger_time(service, pods) {
                    annotations.insert(slices::TRIGGER_TIME.into(), json!(t));
                }
                if truncated {
                    annotations.insert(endpoints::OVER_CAPACITY.into(), json!("truncated"));
                }
                wanted["metadata"]["annotations"] = Value::Object(annotations);
                Write::Create {
                    resource: core("endpoints"),
                    namespace: key.namespace.clone(),
                    object: wanted,
                }
            }
        };
        match client::write(write) {
            Ok(_) => Ok(Action::Done),
            Err(e) if e.is_namespace_terminating() => Ok(Action::Done),
            Err(e) => Err(format!("write Endpoints {}: {e}", key.name)),
        }
    }
}

impl Reconcile for Endpoints {
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let Some(service) = cache::get(&key.resource, ns, &key.name)? else {
            // Deleted: what it had goes with it (the garbage collector, by owner).
            return Ok(Action::Done);
        };
        // ExternalName Services have no endpoints; Services without a selector keep
        // what their owner writes (the API server's `kubernetes`, a user's).
        if service["spec"]["type"] == "ExternalName" {
            return Ok(Action::Done);
        }
        let Some(selector) = service["spec"]["selector"]
            .as_object()
            .filter(|s| !s.is_empty())
        else {
            return Ok(Action::Done);
        };
        let selector = owned::selector_string(&json!({"matchLabels": selector}))?;
        let pods: Vec<Value> = cache::list_as(&core("pods"), ns, &selector)?;
        match self.write {
            Target::EndpointSlices => self.reconcile_slices(key, &service, &pods),
            Target::Endpoints => self.reconcile_endpoints(key, &service, &pods),
        }
    }
}

trellis_plugin::controller!(Endpoints);
