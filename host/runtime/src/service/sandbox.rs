//! A pod sandbox's lifecycle: `RunPodSandbox` makes its record and, when the pod has
//! a network of its own, its network namespace connected by CNI; `StopPodSandbox`
//! stops its containers and tears its network down, `RemovePodSandbox` removes them
//! and it. A sandbox on the node's network (host network, or no pod CIDR yet) reports
//! the node's IP.

use std::collections::HashMap;
use std::time::Duration;

use k8s_cri::v1::*;
use tonic::{Request, Response, Status};

use super::{Reply, new_id, selects};
use crate::Runtime;
use crate::record::{SandboxRecord, now_ns};

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
    let record = SandboxRecord {
        id,
        config,
        handler,
        state: PodSandboxState::SandboxReady as i32,
        created_at: now_ns(),
        netns,
        ips,
    };
    runtime.state.store().save_sandbox(&record);
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
    if runtime.state.tables().sandboxes.remove(&id).is_some() {
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

impl Runtime {
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
                        ipc: node,
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
