//! A pod's sandbox (the kubelet's `kuberuntime_sandbox.go`): the configuration the
//! runtime is given for it, finding the pod's ready one, making one, and stopping a
//! pod's sandboxes with their containers ([`kill_pod`]).

use std::path::Path;

use k8s_cri::v1 as cri;
use k8s_openapi::api::core::v1::Pod;
use tracing::warn;
use trellis_client::events::EventType;

use crate::labels::{self, POD_UID};
use crate::paths::pod_logs_dir;
use crate::spec;
use crate::{Context, cgroups, dns, hosts};

/// The sandbox of pod `uid` with the node's default DNS settings (no cluster DNS,
/// `cluster.local`, the node's `/etc/resolv.conf`): see [`pod_sandbox_config`].
#[cfg(test)]
pub fn sandbox_config(
    root: &Path,
    pod: &Pod,
    uid: &str,
    own_network: bool,
) -> cri::PodSandboxConfig {
    let settings = dns::Settings {
        cluster_dns: &[],
        cluster_domain: "cluster.local",
        resolv_conf: Some(Path::new("/etc/resolv.conf")),
        node_ip: std::net::Ipv4Addr::LOCALHOST.into(),
    };
    pod_sandbox_config(root, &settings, pod, uid, own_network)
}

/// The sandbox of pod `uid` on this node, with the node's DNS settings.
pub fn sandbox_config_of(
    ctx: &Context,
    pod: &Pod,
    uid: &str,
    own_network: bool,
) -> cri::PodSandboxConfig {
    let config = &ctx.config;
    let settings = dns::Settings {
        cluster_dns: &config.cluster_dns,
        cluster_domain: &config.cluster_domain,
        resolv_conf: config.resolv_conf.as_deref(),
        node_ip: config.node_ip,
    };
    let mut sandbox = pod_sandbox_config(&config.root, &settings, pod, uid, own_network);
    if let Some(parent) = ctx.cgroups.pod_cgroup(pod, uid)
        && let Some(linux) = sandbox.linux.as_mut()
    {
        linux.cgroup_parent = parent;
    }
    sandbox
}

/// Tells what is wrong with the DNS configuration pod `pod`'s new sandbox gets, as
/// Warning events of the pod (the kubelet's `MissingClusterDNS`, `DNSConfigForming`).
pub fn record_dns_warnings(ctx: &Context, pod: &Pod) {
    let config = &ctx.config;
    let settings = dns::Settings {
        cluster_dns: &config.cluster_dns,
        cluster_domain: &config.cluster_domain,
        resolv_conf: config.resolv_conf.as_deref(),
        node_ip: config.node_ip,
    };
    for warning in dns::pod_dns(&settings, pod).1 {
        ctx.events
            .record(pod, EventType::Warning, warning.reason, &warning.message);
    }
}

/// The sandbox of pod `uid`: its labels name the pod, its containers' logs go under
/// `root/logs`; with `own_network` it is on the pod's network with the containers'
/// `hostPort`s mapped and its hostname (the pod's name or `spec.hostname`, the FQDN
/// with `setHostnameAsFQDN`), else it shares the node's network and hostname; its IPC
/// namespace is the node's with `hostIPC`; its DNS configuration follows `dnsPolicy`
/// and `dnsConfig` ([`dns`]).
pub fn pod_sandbox_config(
    root: &Path,
    settings: &dns::Settings,
    pod: &Pod,
    uid: &str,
    own_network: bool,
) -> cri::PodSandboxConfig {
    let hostname = if own_network {
        // A FQDN too long for the kernel: the short name, which always fits.
        hosts::kernel_hostname(pod, settings.cluster_domain)
            .unwrap_or_else(|_| hosts::hostname_and_domain(pod, settings.cluster_domain).0)
    } else {
        String::new()
    };
    let (dns_config, _) = dns::pod_dns(settings, pod);
    let meta = &pod.metadata;
    let name = meta.name.clone().unwrap_or_default();
    let namespace = meta.namespace.clone().unwrap_or_default();
    let log_directory = pod_logs_dir(&root.join("logs"), &namespace, &name, uid);
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name,
            uid: uid.to_owned(),
            namespace,
            attempt: 0,
        }),
        hostname,
        dns_config: Some(dns_config),
        log_directory: log_directory.to_string_lossy().into_owned(),
        labels: labels::sandbox_labels(pod, uid),
        annotations: meta
            .annotations
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect(),
        linux: Some(cri::LinuxPodSandboxConfig {
            security_context: Some(sandbox_security_context(pod, own_network)),
            // The pod's limits as a whole, which its cgroup is made with.
            resources: Some(cgroups::pod_resources(pod)),
            ..Default::default()
        }),
        port_mappings: if own_network {
            port_mappings(pod)
        } else {
            Vec::new()
        },
        ..Default::default()
    }
}

/// The sandbox's security context (the kubelet's `generatePodSandboxLinuxConfig`): the
/// pod's user, group and supplemental groups (with its `fsGroup`), its namespaces, and
/// privileged when any container is (a runtime refuses a privileged container in a
/// sandbox that is not).
fn sandbox_security_context(pod: &Pod, own_network: bool) -> cri::LinuxSandboxSecurityContext {
    let spec = pod.spec.as_ref();
    let pod_sc = spec.and_then(|s| s.security_context.as_ref());
    let privileged = spec.is_some_and(|s| {
        s.containers
            .iter()
            .chain(s.init_containers.iter().flatten())
            .any(|c| {
                c.security_context
                    .as_ref()
                    .and_then(|sc| sc.privileged)
                    .unwrap_or(false)
            })
    });
    let mut supplemental_groups = Vec::new();
    if let Some(p) = pod_sc {
        supplemental_groups.extend(p.fs_group);
        supplemental_groups.extend(p.supplemental_groups.iter().flatten());
    }
    cri::LinuxSandboxSecurityContext {
        namespace_options: Some(namespace_options(pod, own_network)),
        run_as_user: pod_sc
            .and_then(|p| p.run_as_user)
            .map(|value| cri::Int64Value { value }),
        run_as_group: pod_sc
            .and_then(|p| p.run_as_group)
            .map(|value| cri::Int64Value { value }),
        supplemental_groups,
        privileged,
        ..Default::default()
    }
}

/// The namespaces of the pod's containers (the kubelet's `NamespacesForPod`): the
/// pod's network on its own network, else the node's; the node's PID namespace with
/// `hostPID`, one for the pod with `shareProcessNamespace`, else one per container;
/// the node's IPC namespace with `hostIPC`, else the pod's.
pub fn namespace_options(pod: &Pod, own_network: bool) -> cri::NamespaceOption {
    let spec = pod.spec.as_ref();
    let host_ipc = spec.and_then(|s| s.host_ipc).unwrap_or(false);
    let host_pid = spec.and_then(|s| s.host_pid).unwrap_or(false);
    let share_pid = spec
        .and_then(|s| s.share_process_namespace)
        .unwrap_or(false);
    cri::NamespaceOption {
        network: if own_network {
            cri::NamespaceMode::Pod
        } else {
            cri::NamespaceMode::Node
        } as i32,
        pid: if host_pid {
            cri::NamespaceMode::Node
        } else if share_pid {
            cri::NamespaceMode::Pod
        } else {
            cri::NamespaceMode::Container
        } as i32,
        ipc: if host_ipc {
            cri::NamespaceMode::Node
        } else {
            cri::NamespaceMode::Pod
        } as i32,
        ..Default::default()
    }
}

/// The `hostPort`s of the pod's containers, as the runtime maps them (the kubelet's
/// `makePortMappings`, without the ports no host port is asked for).
fn port_mappings(pod: &Pod) -> Vec<cri::PortMapping> {
    let Some(spec) = &pod.spec else {
        return Vec::new();
    };
    spec.containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .filter(|p| p.host_port.is_some_and(|h| h > 0))
        .map(|p| cri::PortMapping {
            protocol: match p.protocol.as_deref() {
                Some("UDP") => cri::Protocol::Udp,
                Some("SCTP") => cri::Protocol::Sctp,
                _ => cri::Protocol::Tcp,
            } as i32,
            container_port: p.container_port,
            host_port: p.host_port.unwrap_or_default(),
            host_ip: p.host_ip.clone().unwrap_or_default(),
        })
        .collect()
}

/// The IPs the runtime gave sandbox `id` on its pod's network, the first one first;
/// empty when it has none (on the node's network); `Err` is the runtime's message.
pub async fn sandbox_ips(ctx: &Context, id: &str) -> Result<Vec<String>, String> {
    let mut runtime = ctx.cri.runtime.clone();
    let status = runtime
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: id.to_owned(),
            verbose: false,
        })
        .await
        .map_err(|e| e.message().to_owned())?
        .into_inner();
    let Some(network) = status.status.and_then(|s| s.network) else {
        return Ok(Vec::new());
    };
    Ok(std::iter::once(network.ip)
        .chain(network.additional_ips.into_iter().map(|ip| ip.ip))
        .filter(|ip| !ip.is_empty())
        .collect())
}

/// The ID of pod `uid`'s ready sandbox, if it has one; `Err` is the runtime's message.
pub async fn ready_sandbox(ctx: &Context, uid: &str) -> Result<Option<String>, String> {
    let mut runtime = ctx.cri.runtime.clone();
    let listed = runtime
        .list_pod_sandbox(cri::ListPodSandboxRequest {
            filter: Some(cri::PodSandboxFilter {
                label_selector: [(POD_UID.to_owned(), uid.to_owned())].into(),
                ..Default::default()
            }),
        })
        .await
        .map_err(|e| e.message().to_owned())?
        .into_inner();
    Ok(listed
        .items
        .iter()
        .find(|s| s.state == cri::PodSandboxState::SandboxReady as i32)
        .map(|s| s.id.clone()))
}

/// Makes the pod's cgroup (its `cgroup_parent`) when pods get one, then a sandbox of
/// `config` with `handler`, and returns its ID; `Err` is the
/// runtime's message.
pub async fn run_sandbox(
    ctx: &Context,
    config: &cri::PodSandboxConfig,
    handler: &str,
) -> Result<String, String> {
    // The pod's cgroup first: the runtime makes the sandbox's and containers' below it.
    if let Some(linux) = config
        .linux
        .as_ref()
        .filter(|l| !l.cgroup_parent.is_empty())
        && ctx.cgroups.enabled()
    {
        let resources = linux.resources.clone().unwrap_or_default();
        ctx.cgroups
            .create(&linux.cgroup_parent, &resources)
            .map_err(|e| format!("make the pod's cgroup {}: {e}", linux.cgroup_parent))?;
    }
    let mut runtime = ctx.cri.runtime.clone();
    Ok(runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: handler.to_owned(),
        })
        .await
        .map_err(|e| e.message().to_owned())?
        .into_inner()
        .pod_sandbox_id)
}

/// Stops pod `uid`'s containers (SIGTERM, `grace` seconds, then SIGKILL) and its
/// sandboxes (the kubelet's `killPod`), telling each stop as a `Killing` event of `pod`; with `remove`, removes them, the pod's cgroup and the pod's files too.
pub async fn kill_pod(ctx: &Context, uid: &str, pod: Option<&Pod>, grace: i64, remove: bool) {
    let mut runtime = ctx.cri.runtime.clone();
    let Ok(listed) = runtime
        .list_pod_sandbox(cri::ListPodSandboxRequest {
            filter: Some(cri::PodSandboxFilter {
                label_selector: [(POD_UID.to_owned(), uid.to_owned())].into(),
                ..Default::default()
            }),
        })
        .await
    else {
        return;
    };
    for sandbox in listed.into_inner().items {
        if let Ok(containers) = runtime
            .list_containers(cri::ListContainersRequest {
                filter: Some(cri::ContainerFilter {
                    pod_sandbox_id: sandbox.id.clone(),
                    state: Some(cri::ContainerStateValue {
                        state: cri::ContainerState::ContainerRunning as i32,
                    }),
                    ..Default::default()
                }),
            })
            .await
        {
            let stops = containers.into_inner().containers.into_iter().map(|c| {
                let mut runtime = runtime.clone();
                let name = c
                    .metadata
                    .as_ref()
                    .map(|m| m.name.clone())
                    .unwrap_or_default();
                if let Some(pod) = pod {
                    ctx.events.record(
                        pod,
                        EventType::Normal,
                        "Killing",
                        &format!("Stopping container {name}"),
                    );
                }
                async move {
                    let _ = runtime
                        .stop_container(cri::StopContainerRequest {
                            container_id: c.id,
                            timeout: grace,
                        })
                        .await;
                }
            });
            futures::future::join_all(stops).await;
        }
        if sandbox.state == cri::PodSandboxState::SandboxReady as i32 {
            let _ = runtime
                .stop_pod_sandbox(cri::StopPodSandboxRequest {
                    pod_sandbox_id: sandbox.id.clone(),
                })
                .await;
        }
        if remove {
            let _ = runtime
                .remove_pod_sandbox(cri::RemovePodSandboxRequest {
                    pod_sandbox_id: sandbox.id.clone(),
                })
                .await;
        }
    }
    if remove {
        // Once its sandboxes are gone nothing in the pod's cgroup is the pod's.
        ctx.cgroups.remove(uid).await;
        let dir = spec::pod_dir(ctx, uid);
        if let Err(e) = std::fs::remove_dir_all(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            warn!(dir = %dir.display(), error = %e, "remove the pod's files");
        }
        if let Some(pod) = pod {
            let meta = &pod.metadata;
            let dir = pod_logs_dir(
                &ctx.config.root.join("logs"),
                meta.namespace.as_deref().unwrap_or_default(),
                meta.name.as_deref().unwrap_or_default(),
                uid,
            );
            if let Err(e) = std::fs::remove_dir_all(&dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                warn!(dir = %dir.display(), error = %e, "remove the pod's logs");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "default", "uid": "u"},
            "spec": spec,
        }))
        .unwrap()
    }

    fn network(config: &cri::PodSandboxConfig) -> i32 {
        config
            .linux
            .as_ref()
            .and_then(|l| l.security_context.as_ref())
            .and_then(|s| s.namespace_options.as_ref())
            .map(|o| o.network)
            .unwrap()
    }

    #[test]
    fn a_pod_on_its_own_network_gets_its_host_ports_mapped() {
        let web = pod(serde_json::json!({"containers": [
            {"name": "a", "ports": [{"containerPort": 8080, "hostPort": 80, "hostIP": "127.0.0.1"},
                {"containerPort": 9090}]},
            {"name": "b", "ports": [{"containerPort": 53, "hostPort": 5353, "protocol": "UDP"}]},
        ]}));
        assert!(crate::spec::own_network(true, &web));
        assert!(!crate::spec::own_network(false, &web));
        let config = sandbox_config(Path::new("/r"), &web, "u", true);
        assert_eq!(network(&config), cri::NamespaceMode::Pod as i32);
        assert_eq!(
            config.port_mappings,
            [
                cri::PortMapping {
                    protocol: cri::Protocol::Tcp as i32,
                    container_port: 8080,
                    host_port: 80,
                    host_ip: "127.0.0.1".into(),
                },
                cri::PortMapping {
                    protocol: cri::Protocol::Udp as i32,
                    container_port: 53,
                    host_port: 5353,
                    host_ip: String::new(),
                },
            ]
        );
        // Without a network of its own: the node's, and no mappings (as before).
        let config = sandbox_config(Path::new("/r"), &web, "u", false);
        assert_eq!(network(&config), cri::NamespaceMode::Node as i32);
        assert!(config.port_mappings.is_empty());
    }

    #[test]
    fn the_sandbox_carries_the_pods_hostname_dns_and_ipc_mode() {
        let web = pod(serde_json::json!({"hostname": "db", "subdomain": "backend",
            "setHostnameAsFQDN": true, "dnsPolicy": "None",
            "dnsConfig": {"nameservers": ["10.9.9.9"], "searches": ["x.example"]},
            "containers": [{"name": "a"}]}));
        let config = sandbox_config(Path::new("/r"), &web, "u", true);
        assert_eq!(config.hostname, "db.backend.default.svc.cluster.local");
        let dns = config.dns_config.unwrap();
        assert_eq!(
            (dns.servers, dns.searches),
            (vec!["10.9.9.9".to_owned()], vec!["x.example".to_owned()])
        );
        let options = config
            .linux
            .unwrap()
            .security_context
            .unwrap()
            .namespace_options
            .unwrap();
        assert_eq!(options.ipc, cri::NamespaceMode::Pod as i32);
        // On the node's network: the node's hostname (none given) and, with hostIPC, its IPC.
        let host = pod(
            serde_json::json!({"hostNetwork": true, "hostIPC": true, "containers": [{"name": "a"}]}),
        );
        let config = sandbox_config(Path::new("/r"), &host, "u", false);
        assert_eq!(config.hostname, "");
        let options = config
            .linux
            .unwrap()
            .security_context
            .unwrap()
            .namespace_options
            .unwrap();
        assert_eq!(options.ipc, cri::NamespaceMode::Node as i32);
    }

    #[test]
    fn the_sandbox_carries_the_pods_user_groups_privilege_and_limits() {
        let p = pod(serde_json::json!({
            "securityContext": {"runAsUser": 1234, "runAsGroup": 2345, "fsGroup": 4567,
                "supplementalGroups": [3456]},
            "containers": [
                {"name": "a", "resources": {"limits": {"cpu": "200m", "memory": "64Mi"}}},
                {"name": "b", "securityContext": {"privileged": true},
                    "resources": {"limits": {"cpu": "100m", "memory": "32Mi"}}}]}));
        let linux = sandbox_config(Path::new("/r"), &p, "u", true)
            .linux
            .unwrap();
        let sc = linux.security_context.unwrap();
        assert_eq!(sc.run_as_user.map(|u| u.value), Some(1234));
        assert_eq!(sc.run_as_group.map(|g| g.value), Some(2345));
        assert_eq!(sc.supplemental_groups, [4567, 3456]);
        assert!(sc.privileged);
        // Guaranteed: the pod's cgroup is limited to its containers' sum.
        let r = linux.resources.unwrap();
        assert_eq!((r.cpu_quota, r.cpu_period), (30_000, 100_000));
        assert_eq!(r.memory_limit_in_bytes, 96 << 20);
        // Made by the agent only when pods get cgroups: not here.
        assert_eq!(linux.cgroup_parent, "");
    }

    #[test]
    fn a_host_network_pod_stays_on_the_node_network() {
        let host = pod(serde_json::json!({"hostNetwork": true, "containers": [{"name": "a"}]}));
        assert!(!crate::spec::own_network(true, &host));
    }
}
