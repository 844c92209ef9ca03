//! A pod sandbox's lifecycle: `RunPodSandbox` makes its record and, when the pod has
//! a network of its own, its network namespace connected by CNI; for native
//! processes, its UTS namespace (hostname set) unless it is on the node's network and
//! its IPC namespace unless it asks for the node's; and its /etc files (`pod_files`); `StopPodSandbox` stops its
//! containers and tears its network down, `RemovePodSandbox` removes them and the
//! rest. A sandbox on the node's network (host network, or no pod CIDR yet) reports
//! the node's IP.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_cri::v1::*;
use tonic::{Request, Response, Status};

use super::{Reply, container, new_id, selects};
use crate::network::netns;
use crate::record::{SandboxRecord, now_ns};
use crate::state::Tables;
use crate::{Runtime, cgroup, namespaces, pod_files};

/// `RunPodSandbox`: a ready sandbox with the runtime handler it asks for (or the first).
pub(super) async fn run(
    runtime: &Runtime,
    request: Request<RunPodSandboxRequest>,
) -> Reply<RunPodSandboxResponse> {
    let request = request.into_inner();
    let config = request
        .config
        .ok_or_else(|| Status::invalid_argument("RunPodSandbox needs a sandbox config"))?;
    let handler = runtime.handler(&request.runtime_handler)?;
    let id = new_id();
    let (netns, ips) = if runtime.network.wanted(&config) {
        let attached = runtime.network.attach(&id, &config).await?;
        (attached.netns, attached.ips)
    } else {
        (None, Vec::new())
    };
    let own = match runtime.make_own(&id, &config, &handler).await {
        Ok(own) => own,
        Err(e) => {
            if (netns.is_some() || !ips.is_empty())
                && let Err(detached) = runtime.network.detach(&id, netns.as_deref()).await
            {
                tracing::warn!(sandbox = %id, "failed to {}", detached.message());
            }
            return Err(e);
        }
    };
    let record = SandboxRecord {
        id,
        config,
        handler,
        state: PodSandboxState::SandboxReady as i32,
        created_at: now_ns(),
        netns,
        ips,
        uts: own.uts,
        ipc: own.ipc,
        files: own.files,
    };
    runtime.state.store().save_sandbox(&record);
    runtime.state.add_cgroup_parent(&record);
    let id = record.id.clone();
    tracing::info!(sandbox = %id, handler = %record.handler, ips = ?record.ips, "sandbox ready");
    runtime.state.tables().sandboxes.insert(id.clone(), record);
    Ok(Response::new(RunPodSandboxResponse { pod_sandbox_id: id }))
}

/// `StopPodSandbox`: its containers stopped at once, the sandbox not ready.
pub(super) async fn stop(
    runtime: &Runtime,
    request: Request<StopPodSandboxRequest>,
) -> Reply<StopPodSandboxResponse> {
    let id = request.into_inner().pod_sandbox_id;
    for container in runtime.container_ids_of(&id) {
        match runtime.stop(&container, Duration::ZERO).await {
            Ok(()) => {}
            // Removed meanwhile: nothing left to stop.
            Err(e) if e.code() == tonic::Code::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    runtime.detach(&id).await?;
    let mut tables = runtime.state.tables();
    if let Some(sandbox) = tables.sandboxes.get_mut(&id) {
        sandbox.state = PodSandboxState::SandboxNotready as i32;
        runtime.state.store().save_sandbox(sandbox);
    }
    Ok(Response::new(StopPodSandboxResponse {}))
}

/// `RemovePodSandbox`: its containers stopped and removed, then its record.
pub(super) async fn remove(
    runtime: &Runtime,
    request: Request<RemovePodSandboxRequest>,
) -> Reply<RemovePodSandboxResponse> {
    let id = request.into_inner().pod_sandbox_id;
    for container in runtime.container_ids_of(&id) {
        match runtime.stop(&container, Duration::ZERO).await {
            Ok(()) => runtime.remove_record(&container),
            Err(e) if e.code() == tonic::Code::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    runtime.detach(&id).await?;
    runtime.remove_own(&id).await?;
    let removed = runtime.state.tables().sandboxes.remove(&id);
    if let Some(sandbox) = removed {
        // The pod's cgroup is the agent's to remove; the runtime's own is its.
        if sandbox.handler == crate::PROCESS
            && cgroup::owns_parent(&sandbox)
            && let Some(parent) = cgroup::of_sandbox(&sandbox)
        {
            cgroup::remove(&parent);
        }
        runtime.state.forget_cgroup_parent(&id);
        runtime.state.forget_sample(&id);
        runtime.state.store().delete_sandbox(&id);
    }
    Ok(Response::new(RemovePodSandboxResponse {}))
}

/// `PodSandboxStatus`, with its containers' statuses.
pub(super) async fn status(
    runtime: &Runtime,
    request: Request<PodSandboxStatusRequest>,
) -> Reply<PodSandboxStatusResponse> {
    let id = request.into_inner().pod_sandbox_id;
    let tables = runtime.state.tables();
    let sandbox = tables
        .sandboxes
        .get(&id)
        .ok_or_else(|| Status::not_found(format!("no sandbox {id}")))?;
    let containers_statuses = tables
        .containers
        .values()
        .filter(|c| c.record.sandbox_id == id)
        .map(|c| c.record.status())
        .collect();
    Ok(Response::new(PodSandboxStatusResponse {
        status: Some(runtime.sandbox_status(sandbox)),
        info: HashMap::new(),
        containers_statuses,
        timestamp: now_ns(),
    }))
}

/// `ListPodSandbox`: the sandboxes its filter selects.
pub(super) async fn list(
    runtime: &Runtime,
    request: Request<ListPodSandboxRequest>,
) -> Reply<ListPodSandboxResponse> {
    let filter = request.into_inner().filter.unwrap_or_default();
    let tables = runtime.state.tables();
    let items = tables
        .sandboxes
        .values()
        .filter(|s| filter.id.is_empty() || s.id == filter.id)
        .filter(|s| filter.state.is_none_or(|f| f.state == s.state))
        .filter(|s| selects(&filter.label_selector, &s.config.labels))
        .map(|s| PodSandbox {
            id: s.id.clone(),
            metadata: s.config.metadata.clone(),
            state: s.state,
            created_at: s.created_at,
            labels: s.config.labels.clone(),
            annotations: s.config.annotations.clone(),
            runtime_handler: s.handler.clone(),
        })
        .collect();
    Ok(Response::new(ListPodSandboxResponse { items }))
}

/// `PodSandboxStats`.
pub(super) async fn stats(
    runtime: &Runtime,
    request: Request<PodSandboxStatsRequest>,
) -> Reply<PodSandboxStatsResponse> {
    let id = request.into_inner().pod_sandbox_id;
    let tables = runtime.state.tables();
    let sandbox = tables
        .sandboxes
        .get(&id)
        .ok_or_else(|| Status::not_found(format!("no sandbox {id}")))?;
    Ok(Response::new(PodSandboxStatsResponse {
        stats: Some(runtime.sandbox_stats(&tables, sandbox)),
    }))
}

/// `ListPodSandboxStats`: the ready sandboxes its filter selects.
pub(super) async fn list_stats(
    runtime: &Runtime,
    request: Request<ListPodSandboxStatsRequest>,
) -> Reply<ListPodSandboxStatsResponse> {
    let filter = request.into_inner().filter.unwrap_or_default();
    let tables = runtime.state.tables();
    let ready = PodSandboxState::SandboxReady as i32;
    let stats = tables
        .sandboxes
        .values()
        .filter(|s| s.state == ready)
        .filter(|s| filter.id.is_empty() || s.id == filter.id)
        .filter(|s| selects(&filter.label_selector, &s.config.labels))
        .map(|s| runtime.sandbox_stats(&tables, s))
        .collect();
    Ok(Response::new(ListPodSandboxStatsResponse { stats }))
}

/// What a sandbox has of its own besides its network.
#[derive(Default)]
struct Own {
    uts: Option<PathBuf>,
    ipc: Option<PathBuf>,
    files: Option<PathBuf>,
}

impl Runtime {
    /// The runtime's root, where it keeps files; none for a runtime that keeps none
    /// (a hollow node's), whose sandboxes get no namespaces or files.
    fn files_root(&self) -> Option<PathBuf> {
        self.state.store().root().map(Path::to_path_buf)
    }

    /// Makes sandbox `id`'s UTS namespace (hostname set: it is on the pod's network,
    /// and a host-network pod shares the node's, as in Kubernetes) and IPC namespace
    /// (unless it asks for the node's) when its `handler` runs native processes (a
    /// WebAssembly component has no hostname or System V IPC to keep apart), and
    /// writes its /etc files; on a failure, nothing is left.
    async fn make_own(
        &self,
        id: &str,
        config: &PodSandboxConfig,
        handler: &str,
    ) -> Result<Own, Status> {
        let Some(root) = self.files_root() else {
            return Ok(Own::default());
        };
        let options = config
            .linux
            .as_ref()
            .and_then(|linux| linux.security_context.as_ref())
            .and_then(|security| security.namespace_options.clone())
            .unwrap_or_default();
        let node = NamespaceMode::Node as i32;
        let native = handler == crate::PROCESS;
        let pod_hostname = options.network != node;
        let uts = (native && options.network != node).then(|| namespaces::uts_pin(&root, id));
        let ipc = (native && options.ipc != node).then(|| namespaces::ipc_pin(&root, id));
        let files = pod_files::sandbox_dir(&root, id);
        let own = Own {
            uts: uts.clone(),
            ipc: ipc.clone(),
            files: Some(files.clone()),
        };
        let config = config.clone();
        let made = tokio::task::spawn_blocking(move || {
            let hostname = match config.hostname.as_str() {
                "" => config
                    .metadata
                    .as_ref()
                    .map(|m| m.name.clone())
                    .unwrap_or_default(),
                name => name.to_owned(),
            };
            pod_files::write(&files, &config, pod_hostname)
                .map_err(|e| format!("cannot write the sandbox's files: {e}"))?;
            namespaces::create(
                uts.as_deref().map(|pin| (pin, hostname.as_str())),
                ipc.as_deref(),
            )
            .map_err(|e| format!("cannot make the pod's UTS and IPC namespaces: {e}"))
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        if let Err(message) = made {
            let _ = self.remove_own(id).await;
            return Err(Status::internal(format!("sandbox {id}: {message}")));
        }
        Ok(own)
    }

    /// Removes sandbox `id`'s UTS and IPC namespaces and its files, whether or not it
    /// still has a record; what is gone already is not an error.
    async fn remove_own(&self, id: &str) -> Result<(), Status> {
        let Some(root) = self.files_root() else {
            return Ok(());
        };
        let id = id.to_owned();
        tokio::task::spawn_blocking(move || {
            netns::remove(&namespaces::uts_pin(&root, &id))?;
            netns::remove(&namespaces::ipc_pin(&root, &id))?;
            pod_files::remove(&pod_files::sandbox_dir(&root, &id))
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(|e| {
            Status::internal(format!(
                "cannot remove the sandbox's namespaces and files: {e}"
            ))
        })
    }

    /// Tears down sandbox `id`'s network, if it has one of its own; again is a no-op.
    async fn detach(&self, id: &str) -> Result<(), Status> {
        let network = self
            .state
            .tables()
            .sandboxes
            .get(id)
            .filter(|s| !s.ips.is_empty() || s.netns.is_some())
            .map(|s| s.netns.clone());
        match network {
            Some(netns) => self.network.detach(id, netns.as_deref()).await,
            None => Ok(()),
        }
    }

    /// A sandbox's use: its cgroup's when its containers are processes in one (the
    /// pod's cgroup, or the runtime's for the sandbox), else the sum of its running
    /// containers'; its network's from the namespace of one of its processes.
    fn sandbox_stats(&self, tables: &Tables, sandbox: &SandboxRecord) -> PodSandboxStats {
        let now = now_ns();
        let running: Vec<_> = tables
            .containers
            .values()
            .filter(|c| c.record.sandbox_id == sandbox.id && c.live.is_some())
            .collect();
        let containers: Vec<ContainerStats> = running.iter().map(|c| self.stats_of(c)).collect();
        let measured = (sandbox.handler == crate::PROCESS)
            .then(|| cgroup::of_sandbox(sandbox))
            .flatten()
            .and_then(|cgroup| cgroup.stats().ok());
        let (cpu, memory, process) = match measured {
            Some(m) => (
                Some(container::cpu_usage(
                    &self.state,
                    &sandbox.id,
                    now,
                    m.cpu_usage_ns,
                )),
                Some(container::memory_usage(now, &m, None)),
                Some(ProcessUsage {
                    timestamp: now,
                    process_count: Some(UInt64Value { value: m.pids }),
                }),
            ),
            None => {
                let sum = |f: fn(&ContainerStats) -> Option<u64>| -> Option<u64> {
                    containers.iter().filter_map(f).reduce(|a, b| a + b)
                };
                let cpu = sum(|c| {
                    c.cpu
                        .as_ref()?
                        .usage_core_nano_seconds
                        .as_ref()
                        .map(|v| v.value)
                })
                .map(|ns| container::cpu_usage(&self.state, &sandbox.id, now, ns));
                let memory_of = |f: fn(&MemoryUsage) -> Option<&UInt64Value>| {
                    containers
                        .iter()
                        .filter_map(|c| f(c.memory.as_ref()?).map(|v| v.value))
                        .reduce(|a, b| a + b)
                        .map(|value| UInt64Value { value })
                };
                let memory = containers
                    .iter()
                    .any(|c| c.memory.is_some())
                    .then(|| MemoryUsage {
                        timestamp: now,
                        working_set_bytes: memory_of(|m| m.working_set_bytes.as_ref()),
                        usage_bytes: memory_of(|m| m.usage_bytes.as_ref()),
                        rss_bytes: memory_of(|m| m.rss_bytes.as_ref()),
                        page_faults: memory_of(|m| m.page_faults.as_ref()),
                        major_page_faults: memory_of(|m| m.major_page_faults.as_ref()),
                        available_bytes: None,
                    });
                (cpu, memory, None)
            }
        };
        let network = sandbox
            .netns
            .as_ref()
            .and(running.iter().find_map(|c| c.record.pid))
            .and_then(|pid| network_usage(pid, now));
        PodSandboxStats {
            attributes: Some(PodSandboxAttributes {
                id: sandbox.id.clone(),
                metadata: sandbox.config.metadata.clone(),
                labels: sandbox.config.labels.clone(),
                annotations: sandbox.config.annotations.clone(),
            }),
            linux: Some(LinuxPodSandboxStats {
                cpu,
                memory,
                network,
                process,
                containers,
            }),
            windows: None,
        }
    }

    fn sandbox_status(&self, sandbox: &SandboxRecord) -> PodSandboxStatus {
        let node = NamespaceMode::Node as i32;
        let network = if sandbox.netns.is_some() || !sandbox.ips.is_empty() {
            NamespaceMode::Pod as i32
        } else {
            node
        };
        let (ip, additional_ips) = match sandbox.ips.split_first() {
            Some((first, rest)) => (
                first.to_string(),
                rest.iter().map(|ip| PodIp { ip: ip.to_string() }).collect(),
            ),
            None => (self.node_ip.to_string(), Vec::new()),
        };
        PodSandboxStatus {
            id: sandbox.id.clone(),
            metadata: sandbox.config.metadata.clone(),
            state: sandbox.state,
            created_at: sandbox.created_at,
            network: Some(PodSandboxNetworkStatus { ip, additional_ips }),
            linux: Some(LinuxPodSandboxStatus {
                namespaces: Some(Namespace {
                    options: Some(NamespaceOption {
                        network,
                        pid: node,
                        ipc: if sandbox.ipc.is_some() {
                            NamespaceMode::Pod as i32
                        } else {
                            node
                        },
                        ..Default::default()
                    }),
                }),
            }),
            labels: sandbox.config.labels.clone(),
            annotations: sandbox.config.annotations.clone(),
            runtime_handler: sandbox.handler.clone(),
        }
    }
}

/// The interfaces of the network namespace process `pid` is in, from its
/// `/proc/<pid>/net/dev`; `eth0`, the pod's CNI interface, is the default.
fn network_usage(pid: i32, now: i64) -> Option<NetworkUsage> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).ok()?;
    let interfaces: Vec<NetworkInterfaceUsage> = parse_net_dev(&text)
        .into_iter()
        .filter(|i| i.name != "lo")
        .collect();
    Some(NetworkUsage {
        timestamp: now,
        default_interface: interfaces.iter().find(|i| i.name == "eth0").cloned(),
        interfaces,
    })
}

/// `/proc/net/dev`: two header lines, then `name: rx_bytes packets errs … (8 fields)
/// tx_bytes packets errs …`.
fn parse_net_dev(text: &str) -> Vec<NetworkInterfaceUsage> {
    text.lines()
        .skip(2)
        .filter_map(|line| {
            let (name, counters) = line.split_once(':')?;
            let n: Vec<u64> = counters
                .split_whitespace()
                .filter_map(|v| v.parse().ok())
                .collect();
            let value = |i: usize| n.get(i).map(|&value| UInt64Value { value });
            Some(NetworkInterfaceUsage {
                name: name.trim().to_owned(),
                rx_bytes: value(0),
                rx_errors: value(2),
                tx_bytes: value(8),
                tx_errors: value(10),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_dev_parses() {
        let text = "Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:     100       1    0    0    0     0          0         0      100       1    0    0    0     0       0          0
  eth0:    5000      40    2    0    0     0          0         0     3000      30    1    0    0     0       0          0
";
        let interfaces = parse_net_dev(text);
        assert_eq!(interfaces.len(), 2);
        let eth0 = &interfaces[1];
        assert_eq!(eth0.name, "eth0");
        assert_eq!(eth0.rx_bytes.as_ref().map(|v| v.value), Some(5000));
        assert_eq!(eth0.rx_errors.as_ref().map(|v| v.value), Some(2));
        assert_eq!(eth0.tx_bytes.as_ref().map(|v| v.value), Some(3000));
        assert_eq!(eth0.tx_errors.as_ref().map(|v| v.value), Some(1));
    }
}
