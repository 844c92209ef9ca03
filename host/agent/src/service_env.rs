//! The Services a container learns of through its environment, as the kubelet sets
//! them (`getServiceEnvVarMap` and `envvars.FromServices`): `{SVC}_SERVICE_HOST`,
//! `{SVC}_SERVICE_PORT` (the first port) and `{SVC}_SERVICE_PORT_{NAME}` (named
//! ports), and Docker's link variables `{SVC}_PORT`, `{SVC}_PORT_{PORT}_{PROTO}` and its
//! `_PROTO`, `_PORT` and `_ADDR`.
//!
//! Every pod gets them for the `kubernetes` Service of namespace `default` (where
//! in-cluster clients find the API: `KUBERNETES_SERVICE_HOST` and
//! `KUBERNETES_SERVICE_PORT`), and, unless its `enableServiceLinks` is false, for every
//! Service of its own namespace. Services without a ClusterIP (headless, ExternalName)
//! give none. A container's own variables win over these.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::Api;

use crate::Context;

/// The namespace of the Services every pod gets (the kubelet's master namespace).
const MASTER_NAMESPACE: &str = "default";
/// ... and their names.
const MASTER_SERVICES: &[&str] = &["kubernetes"];

/// How long a container's start waits for the node's first list of Services; the
/// kubelet refuses to build the environment before it, as this does after the wait.
const SERVICES_SYNC_TIMEOUT: Duration = Duration::from_secs(10);

/// The service variables of `pod`'s containers, from the node's shared Service
/// informer; the error is the container's `CreateContainerConfigError` message.
pub async fn for_pod(ctx: &Context, pod: &Pod) -> Result<Vec<(String, Vec<u8>)>, String> {
    let informer = ctx.informers.informer::<Service>(
        Api::all(ctx.client.clone()),
        kube::runtime::watcher::Config::default(),
    );
    if tokio::time::timeout(SERVICES_SYNC_TIMEOUT, informer.wait_synced())
        .await
        .is_err()
    {
        return Err(
            "services have not yet been read at least once, cannot construct envvars".into(),
        );
    }
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let links = pod
        .spec
        .as_ref()
        .and_then(|s| s.enable_service_links)
        .unwrap_or(true);
    Ok(variables(&informer.list(), namespace, links)
        .into_iter()
        .map(|(name, value)| (name, value.into_bytes()))
        .collect())
}

/// The variables of the Services among `services` that a pod of `namespace` sees,
/// sorted by name.
pub fn variables(
    services: &[Arc<Service>],
    namespace: &str,
    enable_service_links: bool,
) -> BTreeMap<String, String> {
    let mut chosen: BTreeMap<&str, &Service> = BTreeMap::new();
    for service in services {
        if cluster_ip(service).is_none() {
            continue;
        }
        let name = service.metadata.name.as_deref().unwrap_or_default();
        let ns = service.metadata.namespace.as_deref().unwrap_or_default();
        // As the kubelet: a master Service does not replace a namespace's own of the
        // same name, and a namespace's own replaces it.
        if ns == MASTER_NAMESPACE && MASTER_SERVICES.contains(&name) {
            chosen.entry(name).or_insert(service);
        } else if ns == namespace && enable_service_links {
            chosen.insert(name, service);
        }
    }
    let mut out = BTreeMap::new();
    for service in chosen.values() {
        for (name, value) in of_service(service) {
            out.insert(name, value);
        }
    }
    out
}

fn cluster_ip(service: &Service) -> Option<&str> {
    service
        .spec
        .as_ref()
        .and_then(|s| s.cluster_ip.as_deref())
        .filter(|ip| !ip.is_empty() && *ip != "None")
}

/// `envvars.FromServices` for one Service.
fn of_service(service: &Service) -> Vec<(String, String)> {
    let Some(ip) = cluster_ip(service) else {
        return Vec::new();
    };
    let ports = service
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_deref())
        .unwrap_or_default();
    let Some(first) = ports.first() else {
        return Vec::new();
    };
    let prefix = env_name(service.metadata.name.as_deref().unwrap_or_default());
    let mut out = vec![
        (format!("{prefix}_SERVICE_HOST"), ip.to_owned()),
        (format!("{prefix}_SERVICE_PORT"), first.port.to_string()),
    ];
    for port in ports {
        if let Some(name) = port.name.as_deref().filter(|n| !n.is_empty()) {
            out.push((
                format!("{prefix}_SERVICE_PORT_{}", env_name(name)),
                port.port.to_string(),
            ));
        }
    }
    // Docker's link variables; the first port also gets the bare `{SVC}_PORT`.
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_owned()
    };
    for (i, port) in ports.iter().enumerate() {
        let protocol = port.protocol.as_deref().unwrap_or("TCP");
        let lower = protocol.to_ascii_lowercase();
        let url = format!("{lower}://{host}:{}", port.port);
        if i == 0 {
            out.push((format!("{prefix}_PORT"), url.clone()));
        }
        let port_prefix = format!(
            "{prefix}_PORT_{}_{}",
            port.port,
            protocol.to_ascii_uppercase()
        );
        out.push((format!("{port_prefix}_PROTO"), lower));
        out.push((format!("{port_prefix}_PORT"), port.port.to_string()));
        out.push((format!("{port_prefix}_ADDR"), ip.to_owned()));
        out.push((port_prefix, url));
    }
    out
}

/// The kubelet's `makeEnvVariableName`: upper case, `-` as `_`.
fn env_name(name: &str) -> String {
    name.replace('-', "_").to_ascii_uppercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(ns: &str, name: &str, ip: &str, ports: serde_json::Value) -> Arc<Service> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": ns},
                "spec": {"clusterIP": ip, "ports": ports},
            }))
            .unwrap(),
        )
    }

    fn kubernetes() -> Arc<Service> {
        service(
            "default",
            "kubernetes",
            "10.43.0.1",
            serde_json::json!([{"name": "https", "port": 443, "protocol": "TCP"}]),
        )
    }

    #[test]
    fn every_pod_gets_the_kubernetes_service_as_the_kubelet_sets_it() {
        let vars = variables(&[kubernetes()], "apps", false);
        let expected: BTreeMap<String, String> = [
            ("KUBERNETES_SERVICE_HOST", "10.43.0.1"),
            ("KUBERNETES_SERVICE_PORT", "443"),
            ("KUBERNETES_SERVICE_PORT_HTTPS", "443"),
            ("KUBERNETES_PORT", "tcp://10.43.0.1:443"),
            ("KUBERNETES_PORT_443_TCP", "tcp://10.43.0.1:443"),
            ("KUBERNETES_PORT_443_TCP_PROTO", "tcp"),
            ("KUBERNETES_PORT_443_TCP_PORT", "443"),
            ("KUBERNETES_PORT_443_TCP_ADDR", "10.43.0.1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(vars, expected);
    }

    #[test]
    fn service_links_name_the_namespaces_services_only() {
        let services = [
            kubernetes(),
            service(
                "apps",
                "my-db",
                "10.43.5.6",
                serde_json::json!([
                    {"port": 5432, "protocol": "TCP"},
                    {"name": "metrics-udp", "port": 9000, "protocol": "UDP"},
                ]),
            ),
            service(
                "apps",
                "headless",
                "None",
                serde_json::json!([{"port": 80}]),
            ),
            service(
                "other",
                "web",
                "10.43.7.7",
                serde_json::json!([{"port": 80}]),
            ),
        ];
        let vars = variables(&services, "apps", true);
        assert_eq!(vars["MY_DB_SERVICE_HOST"], "10.43.5.6");
        assert_eq!(vars["MY_DB_SERVICE_PORT"], "5432");
        assert_eq!(vars["MY_DB_SERVICE_PORT_METRICS_UDP"], "9000");
        assert_eq!(vars["MY_DB_PORT"], "tcp://10.43.5.6:5432");
        assert_eq!(vars["MY_DB_PORT_9000_UDP"], "udp://10.43.5.6:9000");
        assert_eq!(vars["MY_DB_PORT_9000_UDP_PROTO"], "udp");
        assert!(vars.contains_key("KUBERNETES_SERVICE_HOST"));
        assert!(!vars.keys().any(|k| k.starts_with("HEADLESS_")));
        assert!(!vars.keys().any(|k| k.starts_with("WEB_")));
        let without = variables(&services, "apps", false);
        assert!(!without.keys().any(|k| k.starts_with("MY_DB_")));
        assert!(without.contains_key("KUBERNETES_SERVICE_HOST"));
    }
}
