//! The agent's Node and Lease: registration with what the machine has, the Lease
//! renewed every `lease_renew`, and the Node's status written when it changes and every
//! `status_report` (Kubernetes' node status and lease reporting).

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    DaemonEndpoint, Node, NodeAddress, NodeCondition, NodeDaemonEndpoints, NodeRuntimeHandler,
    NodeRuntimeHandlerFeatures, NodeStatus, NodeSystemInfo,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference, Time};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tracing::{info, warn};
use trellis_api::Shutdown;

use crate::Context;

/// The pods a node takes, as the kubelet's default `maxPods`.
const MAX_PODS: u32 = 110;
const LEASE_NAMESPACE: &str = "kube-node-lease";
/// The version a Node reports for its agent: the Kubernetes API it serves, and Trellis'.
pub const AGENT_VERSION: &str = concat!("v1.33.0-trellis.", env!("CARGO_PKG_VERSION"));

/// Creates the Node, or brings an existing one (an agent restarted, a node re-joined)
/// up to date.
pub async fn register(ctx: &Context) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let name = &ctx.config.node_name;
    let node = Node {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some(labels(ctx)),
            ..Default::default()
        },
        spec: None,
        // Written once the Lease exists: a Node that reports a status has its Lease.
        status: None,
    };
    match nodes.create(&PostParams::default(), &node).await {
        Ok(_) => info!(node = %name, "node registered"),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let labels = json!({"metadata": {"labels": labels(ctx)}});
            nodes
                .patch(name, &PatchParams::default(), &Patch::Merge(&labels))
                .await
                .map_err(|e| anyhow::anyhow!("update the labels of node {name}: {e}"))?;
            info!(node = %name, "node registered again");
        }
        Err(e) => return Err(anyhow::anyhow!("register node {name}: {e}")),
    }
    // The Lease first: a Node whose status says Ready has its Lease.
    renew_lease(ctx).await?;
    // A create does not take the status: it is written as the agent's own.
    write_status(ctx).await?;
    Ok(())
}

/// Renews the Lease, and writes the Node's status every `status_report`, until
/// `stopped`. A failed renewal is retried at the next tick: the node lifecycle
/// controller allows several.
pub async fn heartbeat(ctx: Arc<Context>, stopped: Shutdown) {
    let mut lease = tokio::time::interval_at(
        tokio::time::Instant::now() + ctx.config.lease_renew + ctx.config.lease_offset,
        ctx.config.lease_renew,
    );
    let mut report = tokio::time::interval(ctx.config.status_report);
    report.tick().await;
    // The eviction manager reads the signals and holds the conditions (soft
    // thresholds, grace and transition periods): a change is written at once. What the
    // Node shows is not known here (the manager may have changed the conditions since
    // the status was first written): the first look writes them. A node without
    // thresholds (a hollow one) has none to write.
    let mut conditions = ctx.eviction.watch_conditions();
    let mut reported = None;
    if ctx.config.eviction_hard.is_some() {
        conditions.mark_changed();
    } else {
        reported = Some(pressure(&ctx));
    }
    loop {
        tokio::select! {
            Ok(()) = conditions.changed() => {
                let now = pressure(&ctx);
                if Some(now) != reported {
                    info!(node = %ctx.config.node_name, pressure = ?now, "the node's pressure changed");
                    match write_status(&ctx).await {
                        Ok(()) => reported = Some(now),
                        Err(e) => warn!(error = %e, "write the node status"),
                    }
                }
            }
            _ = lease.tick() => {
                if let Err(e) = renew_lease(&ctx).await {
                    warn!(error = %e, "renew the node lease");
                }
            }
            _ = report.tick() => {
                if let Err(e) = write_status(&ctx).await {
                    warn!(error = %e, "write the node status");
                }
            }
            _ = stopped.wait() => return,
        }
    }
}

/// Gives the runtime the Node's `spec.podCIDR` (from the node IPAM controller) by
/// `UpdateRuntimeConfig`, again whenever it changes, as the kubelet does; and asks
/// the runtime whether its network is ready (`Status`'s `NetworkReady`) then and
/// every `network_check`, into `ctx.network_ready`, which pods on their own network
/// wait for. The runtime's default network needs the pod CIDR; an operator's network
/// (its conflist in the runtime's config dir) needs none. Runs until `stopped`.
pub async fn pod_network(ctx: Arc<Context>, stopped: Shutdown) {
    use futures::StreamExt as _;
    use kube::runtime::{WatchStreamExt as _, watcher};
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let config =
        watcher::Config::default().fields(&format!("metadata.name={}", ctx.config.node_name));
    let mut seen = watcher(nodes, config)
        .default_backoff()
        .applied_objects()
        .boxed();
    let mut given: Option<String> = None;
    let mut check = tokio::time::interval(ctx.config.network_check);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let node = tokio::select! {
            node = seen.next() => node,
            _ = check.tick() => {
                check_network(&ctx).await;
                continue;
            }
            _ = stopped.wait() => return,
        };
        let node = match node {
            Some(Ok(node)) => node,
            Some(Err(e)) => {
                warn!(error = %e, "watch the node for its pod CIDR");
                continue;
            }
            None => return,
        };
        let Some(cidr) = node.spec.and_then(|s| s.pod_cidr).filter(|c| !c.is_empty()) else {
            continue;
        };
        if given.as_ref() == Some(&cidr) {
            continue;
        }
        // Retried until the runtime takes it: pods may wait for it.
        loop {
            let mut runtime = ctx.cri.runtime.clone();
            let request = k8s_cri::v1::UpdateRuntimeConfigRequest {
                runtime_config: Some(k8s_cri::v1::RuntimeConfig {
                    network_config: Some(k8s_cri::v1::NetworkConfig {
                        pod_cidr: cidr.clone(),
                    }),
                }),
            };
            match runtime.update_runtime_config(request).await {
                Ok(_) => break,
                Err(e) => {
                    warn!(pod_cidr = %cidr, error = %e.message(), "give the runtime the pod CIDR");
                    tokio::select! {
                        _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                        _ = stopped.wait() => return,
                    }
                }
            }
        }
        info!(node = %ctx.config.node_name, pod_cidr = %cidr, "the runtime has the node's pod CIDR");
        given = Some(cidr);
        // At once: pods waiting for the default network need not wait for the period.
        check_network(&ctx).await;
    }
}

/// Sets `ctx.network_ready` from the runtime's `NetworkReady` condition (none is not
/// ready, as for the kubelet); a runtime that does not answer changes nothing.
async fn check_network(ctx: &Context) {
    let mut runtime = ctx.cri.runtime.clone();
    let status = match runtime
        .status(k8s_cri::v1::StatusRequest { verbose: false })
        .await
    {
        Ok(status) => status.into_inner(),
        Err(e) => {
            warn!(error = %e.message(), "ask the runtime whether its network is ready");
            return;
        }
    };
    let network = status
        .status
        .iter()
        .flat_map(|s| &s.conditions)
        .find(|c| c.r#type == "NetworkReady");
    let ready = network.is_some_and(|c| c.status);
    ctx.network_ready.send_if_modified(|was| {
        if *was == ready {
            return false;
        }
        *was = ready;
        if ready {
            info!(node = %ctx.config.node_name, "the runtime's network is ready");
        } else {
            let (reason, message) =
                network.map_or(("", ""), |c| (c.reason.as_str(), c.message.as_str()));
            info!(node = %ctx.config.node_name, %reason, %message, "container runtime network not ready");
        }
        true
    });
}

fn labels(ctx: &Context) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        (
            "kubernetes.io/hostname".to_owned(),
            ctx.config.node_name.clone(),
        ),
        ("kubernetes.io/os".to_owned(), "linux".to_owned()),
        ("kubernetes.io/arch".to_owned(), arch().to_owned()),
        ("beta.kubernetes.io/os".to_owned(), "linux".to_owned()),
        ("beta.kubernetes.io/arch".to_owned(), arch().to_owned()),
    ]);
    // Trellis' RuntimeClasses select nodes by these: a pod lands where its handler is.
    for handler in &ctx.config.handlers {
        if !handler.is_empty() {
            labels.insert(format!("handler.trellis.dev/{handler}"), "true".into());
        }
    }
    labels.extend(ctx.config.labels.iter().cloned());
    labels
}

/// Go's names of the architecture, as Kubernetes labels nodes.
fn arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

async fn write_status(ctx: &Context) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let status = json!({"status": status(ctx).await});
    nodes
        .patch_status(
            &ctx.config.node_name,
            &PatchParams::default(),
            &Patch::Merge(&status),
        )
        .await
        .map_err(|e| anyhow::anyhow!("write the status of node {}: {e}", ctx.config.node_name))?;
    Ok(())
}

async fn renew_lease(ctx: &Context) -> anyhow::Result<()> {
    let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), LEASE_NAMESPACE);
    let name = &ctx.config.node_name;
    let now = MicroTime(jiff::Timestamp::now());
    let renew = json!({"spec": {"holderIdentity": name, "renewTime": now,
        "leaseDurationSeconds": ctx.config.lease_duration.as_secs()}});
    match leases
        .patch(name, &PatchParams::default(), &Patch::Merge(&renew))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => {
            let nodes: Api<Node> = Api::all(ctx.client.clone());
            let uid = nodes
                .get(name)
                .await
                .map_err(|e| anyhow::anyhow!("read node {name}: {e}"))?
                .metadata
                .uid;
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(LEASE_NAMESPACE.into()),
                    // Deleted with its Node by the garbage collector.
                    owner_references: uid.map(|uid| {
                        vec![OwnerReference {
                            api_version: "v1".into(),
                            kind: "Node".into(),
                            name: name.clone(),
                            uid,
                            ..Default::default()
                        }]
                    }),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(name.clone()),
                    lease_duration_seconds: Some(ctx.config.lease_duration.as_secs() as i32),
                    renew_time: Some(now),
                    ..Default::default()
                }),
            };
            leases
                .create(&PostParams::default(), &lease)
                .await
                .map_err(|e| anyhow::anyhow!("create the lease of node {name}: {e}"))?;
            Ok(())
        }
        Err(e) => Err(anyhow::anyhow!("renew the lease of node {name}: {e}")),
    }
}

/// The pressure conditions that hold now.
/// The pressure conditions as the eviction manager holds them (none when it does not
/// run: `eviction_hard` is `None`).
fn pressure(ctx: &Context) -> crate::pressure::Pressure {
    ctx.eviction.conditions()
}

async fn status(ctx: &Context) -> NodeStatus {
    let (cpus, memory) = ctx.config.capacity.unwrap_or_else(machine_capacity);
    let storage = storage_capacity(&ctx.config);
    let mut capacity = BTreeMap::from([
        ("cpu".to_owned(), Quantity(cpus.to_string())),
        ("memory".to_owned(), bytes(memory as i64)),
        ("pods".to_owned(), Quantity(MAX_PODS.to_string())),
    ]);
    if let Some(storage) = storage {
        capacity.insert("ephemeral-storage".into(), bytes(storage as i64));
    }
    let allocatable = allocatable(&ctx.config, (cpus, memory), storage);
    let mut allocatable_list = BTreeMap::from([
        ("cpu".to_owned(), milli_cpu(allocatable.cpu_milli)),
        ("memory".to_owned(), bytes(allocatable.memory)),
        ("pods".to_owned(), Quantity(MAX_PODS.to_string())),
    ]);
    if let Some(storage) = allocatable.ephemeral_storage {
        allocatable_list.insert("ephemeral-storage".into(), bytes(storage));
    }
    let pressure = pressure(ctx);
    let now = Time(jiff::Timestamp::now());
    let condition = |kind: &str, status: &str, reason: &str, message: &str| NodeCondition {
        type_: kind.into(),
        status: status.into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        last_heartbeat_time: Some(now.clone()),
        last_transition_time: Some(now.clone()),
    };
    let mut runtime = ctx.cri.runtime.clone();
    let version = runtime
        .version(k8s_cri::v1::VersionRequest::default())
        .await
        .map(|v| {
            let v = v.into_inner();
            format!("{}://{}", v.runtime_name, v.runtime_version)
        })
        .unwrap_or_else(|_| "unknown://".into());
    NodeStatus {
        allocatable: Some(allocatable_list),
        capacity: Some(capacity),
        addresses: Some(vec![
            NodeAddress {
                type_: "InternalIP".into(),
                address: ctx.config.node_ip.to_string(),
            },
            NodeAddress {
                type_: "Hostname".into(),
                address: ctx.config.node_name.clone(),
            },
        ]),
        conditions: Some(vec![
            if pressure.memory {
                condition(
                    "MemoryPressure",
                    "True",
                    "KubeletHasInsufficientMemory",
                    "kubelet has insufficient memory available",
                )
            } else {
                condition(
                    "MemoryPressure",
                    "False",
                    "KubeletHasSufficientMemory",
                    "kubelet has sufficient memory available",
                )
            },
            if pressure.disk {
                condition(
                    "DiskPressure",
                    "True",
                    "KubeletHasDiskPressure",
                    "kubelet has disk pressure",
                )
            } else {
                condition(
                    "DiskPressure",
                    "False",
                    "KubeletHasNoDiskPressure",
                    "kubelet has no disk pressure",
                )
            },
            if pressure.pid {
                condition(
                    "PIDPressure",
                    "True",
                    "KubeletHasInsufficientPID",
                    "kubelet has insufficient PID available",
                )
            } else {
                condition(
                    "PIDPressure",
                    "False",
                    "KubeletHasSufficientPID",
                    "kubelet has sufficient PID available",
                )
            },
            condition(
                "Ready",
                "True",
                "KubeletReady",
                "kubelet is posting ready status",
            ),
        ]),
        node_info: Some(NodeSystemInfo {
            architecture: arch().into(),
            boot_id: read_trimmed("/proc/sys/kernel/random/boot_id"),
            container_runtime_version: version,
            kernel_version: read_trimmed("/proc/sys/kernel/osrelease"),
            kube_proxy_version: String::new(),
            kubelet_version: AGENT_VERSION.into(),
            machine_id: read_trimmed("/etc/machine-id"),
            operating_system: "linux".into(),
            os_image: os_image(),
            system_uuid: read_trimmed("/sys/class/dmi/id/product_uuid"),
            ..Default::default()
        }),
        daemon_endpoints: Some(NodeDaemonEndpoints {
            kubelet_endpoint: Some(DaemonEndpoint {
                port: i32::from(ctx.port.load(std::sync::atomic::Ordering::Relaxed)),
            }),
        }),
        runtime_handlers: Some(
            ctx.config
                .handlers
                .iter()
                .map(|name| NodeRuntimeHandler {
                    name: Some(name.clone()),
                    features: Some(NodeRuntimeHandlerFeatures::default()),
                })
                .collect(),
        ),
        ..Default::default()
    }
}

/// Resources kept from pods (`--kube-reserved`, `--system-reserved`), in the
/// kubelet's form `cpu=100m,memory=256Mi,pid=1000,ephemeral-storage=1Gi`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reserved {
    pub cpu_milli: i64,
    /// Bytes.
    pub memory: i64,
    pub pid: i64,
    /// Bytes.
    pub ephemeral_storage: i64,
}

impl std::str::FromStr for Reserved {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut reserved = Reserved::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, value) = item
                .split_once('=')
                .ok_or_else(|| format!("{item:?}: expected RESOURCE=QUANTITY"))?;
            let q = trellis_quantity::Quantity::parse(value.trim())
                .map_err(|e| format!("{item:?}: quantity: {e}"))?;
            if q.milli_value() < 0 {
                return Err(format!("{item:?}: a reservation is not negative"));
            }
            match name.trim() {
                "cpu" => reserved.cpu_milli = q.milli_value(),
                "memory" => reserved.memory = q.value(),
                "pid" => reserved.pid = q.value(),
                "ephemeral-storage" => reserved.ephemeral_storage = q.value(),
                other => {
                    return Err(format!(
                        "unknown resource {other:?} (cpu, memory, pid, ephemeral-storage)"
                    ));
                }
            }
        }
        Ok(reserved)
    }
}

/// What of the node pods may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocatable {
    pub cpu_milli: i64,
    pub memory: i64,
    pub ephemeral_storage: Option<i64>,
}

/// The node's allocatable, as the kubelet's: its capacity less `--kube-reserved`,
/// `--system-reserved` and the hard eviction threshold (memory and the node's
/// filesystem: pods that went past it would be evicted), never below zero.
pub fn allocatable(
    config: &crate::AgentConfig,
    (cpus, memory): (u64, u64),
    storage: Option<u64>,
) -> Allocatable {
    let (kube, system) = (&config.kube_reserved, &config.system_reserved);
    let threshold = |t: Option<crate::pressure::Threshold>, capacity: u64| match t {
        Some(crate::pressure::Threshold::Amount(n)) => n as i64,
        Some(crate::pressure::Threshold::Share(share)) => (share * capacity as f64) as i64,
        None => 0,
    };
    let hard = config.eviction_hard.as_ref();
    let memory_threshold = threshold(hard.and_then(|t| t.memory_available), memory);
    Allocatable {
        cpu_milli: (cpus as i64 * 1000 - kube.cpu_milli - system.cpu_milli).max(0),
        memory: (memory as i64 - kube.memory - system.memory - memory_threshold).max(0),
        ephemeral_storage: storage.map(|total| {
            let t = threshold(hard.and_then(|t| t.nodefs_available), total);
            (total as i64 - kube.ephemeral_storage - system.ephemeral_storage - t).max(0)
        }),
    }
}

/// The limits of the cgroup all pods share: capacity less the reservations (the
/// kubelet's `--enforce-node-allocatable=pods`, which leaves the eviction threshold
/// in, so that pods reach it and are evicted before the kernel kills them); PIDs
/// only when some are reserved.
pub fn pods_allocatable(config: &crate::AgentConfig) -> crate::cgroups::Allocatable {
    let (cpus, memory) = config.capacity.unwrap_or_else(machine_capacity);
    let (kube, system) = (&config.kube_reserved, &config.system_reserved);
    let reserved_pids = kube.pid + system.pid;
    // The node's PIDs are the kernel's largest one.
    let pid_max = || {
        std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
    };
    crate::cgroups::Allocatable {
        cpu_milli: (cpus as i64 * 1000 - kube.cpu_milli - system.cpu_milli).max(0),
        memory: (memory as i64 - kube.memory - system.memory).max(0),
        pids: (reserved_pids > 0)
            .then(pid_max)
            .flatten()
            .map(|max| (max - reserved_pids).max(0)),
    }
}

/// The node's memory in bytes (its capacity), which a Burstable container's OOM
/// score is weighed against.
pub fn memory_capacity(ctx: &Context) -> u64 {
    match ctx.config.capacity {
        Some((_, memory)) => memory,
        None => {
            static MACHINE: std::sync::OnceLock<(u64, u64)> = std::sync::OnceLock::new();
            MACHINE.get_or_init(machine_capacity).1
        }
    }
}

/// The size of the node's filesystem (the agent's root), its `ephemeral-storage`;
/// `None` when it cannot be read, or for a node whose capacity is given (hollow
/// nodes, whose machine is not theirs).
fn storage_capacity(config: &crate::AgentConfig) -> Option<u64> {
    if config.capacity.is_some() {
        return None;
    }
    let stat = rustix::fs::statvfs(&config.root).ok()?;
    Some(stat.f_blocks.saturating_mul(stat.f_frsize))
}

/// Bytes as the kubelet writes them: in Ki when that is exact.
fn bytes(n: i64) -> Quantity {
    if n % 1024 == 0 {
        Quantity(format!("{}Ki", n / 1024))
    } else {
        Quantity(n.to_string())
    }
}

/// CPUs, whole when they are, else in millicores.
fn milli_cpu(milli: i64) -> Quantity {
    if milli % 1000 == 0 {
        Quantity((milli / 1000).to_string())
    } else {
        Quantity(format!("{milli}m"))
    }
}

/// CPUs and bytes of memory of this machine.
fn machine_capacity() -> (u64, u64) {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get() as u64)
        .unwrap_or(1);
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kib| kib * 1024)
        .unwrap_or(0);
    (cpus, memory)
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn os_image() -> String {
    std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                .map(|v| v.trim_matches('"').to_owned())
        })
        .unwrap_or_else(|| "Linux".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_parse_as_the_kubelets_flags() {
        let r: Reserved = "cpu=100m,memory=256Mi,pid=1000,ephemeral-storage=1Gi"
            .parse()
            .unwrap();
        assert_eq!(
            r,
            Reserved {
                cpu_milli: 100,
                memory: 256 << 20,
                pid: 1000,
                ephemeral_storage: 1 << 30,
            }
        );
        assert!("gpu=1".parse::<Reserved>().is_err());
        assert!("cpu".parse::<Reserved>().is_err());
    }

    #[test]
    fn allocatable_is_capacity_less_reservations_and_the_hard_threshold() {
        let mut config = crate::AgentConfig::new("n", [127, 0, 0, 1].into(), "/r".into());
        config.kube_reserved = "cpu=100m,memory=256Mi".parse().unwrap();
        config.system_reserved = "cpu=400m,memory=256Mi,ephemeral-storage=1Gi"
            .parse()
            .unwrap();
        let a = allocatable(&config, (4, 8 << 30), Some(100 << 30));
        assert_eq!(a.cpu_milli, 3500);
        // 8Gi - 512Mi - 100Mi (memory.available<100Mi).
        assert_eq!(a.memory, (8 << 30) - (512 << 20) - (100 << 20));
        // 100Gi - 1Gi - 10% (nodefs.available<10%).
        assert_eq!(a.ephemeral_storage, Some((99 << 30) - (10 << 30)));
        assert_eq!(milli_cpu(a.cpu_milli).0, "3500m");
        assert_eq!(milli_cpu(4000).0, "4");
        assert_eq!(bytes(a.memory).0, format!("{}Ki", a.memory / 1024));
    }
}
