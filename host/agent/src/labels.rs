//! The labels and annotations the agent puts on sandboxes and containers, named as the
//! kubelet names them (its `labels.go`). By the labels it finds a pod's sandboxes and
//! containers again after a restart; the annotations tell the runtime a container's
//! restart count and ports.

use std::collections::HashMap;

use k8s_openapi::api::core::v1::{Container, Pod};
use serde_json::{Value, json};

pub const POD_UID: &str = "io.kubernetes.pod.uid";
pub const POD_NAME: &str = "io.kubernetes.pod.name";
pub const POD_NAMESPACE: &str = "io.kubernetes.pod.namespace";
pub const CONTAINER_NAME: &str = "io.kubernetes.container.name";

/// The run a container is (its attempt).
pub const CONTAINER_RESTART_COUNT: &str = "io.kubernetes.container.restartCount";
/// The container's ports, a JSON list of `ContainerPort`: Trellis' runtime serves a
/// `wasi:http` component on the first.
pub const CONTAINER_PORTS: &str = "io.kubernetes.container.ports";

/// A sandbox's labels: the pod's own, and those that name the pod.
pub fn sandbox_labels(pod: &Pod, uid: &str) -> HashMap<String, String> {
    let meta = &pod.metadata;
    let mut labels: HashMap<String, String> = meta
        .labels
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    labels.insert(POD_UID.into(), uid.to_owned());
    labels.insert(POD_NAME.into(), meta.name.clone().unwrap_or_default());
    labels.insert(
        POD_NAMESPACE.into(),
        meta.namespace.clone().unwrap_or_default(),
    );
    labels
}

/// A container's labels: its pod, and its name in the pod.
pub fn container_labels(pod: &Pod, uid: &str, container: &Container) -> HashMap<String, String> {
    let meta = &pod.metadata;
    [
        (POD_UID, uid.to_owned()),
        (POD_NAME, meta.name.clone().unwrap_or_default()),
        (POD_NAMESPACE, meta.namespace.clone().unwrap_or_default()),
        (CONTAINER_NAME, container.name.clone()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// A container's annotations, as the kubelet writes them: its restart count and its
/// ports.
pub fn container_annotations(container: &Container, attempt: u32) -> HashMap<String, String> {
    let mut out = HashMap::from([(CONTAINER_RESTART_COUNT.to_owned(), attempt.to_string())]);
    if let Some(ports) = container.ports.as_ref().filter(|p| !p.is_empty()) {
        let list: Vec<Value> = ports
            .iter()
            .map(|p| {
                json!({"name": p.name, "containerPort": p.container_port,
                       "protocol": p.protocol.as_deref().unwrap_or("TCP")})
            })
            .collect();
        out.insert(CONTAINER_PORTS.into(), Value::Array(list).to_string());
    }
    out
}
