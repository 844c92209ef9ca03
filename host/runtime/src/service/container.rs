//! A container's lifecycle: `CreateContainer` makes its record, `StartContainer` has
//! its sandbox's handler run it, `StopContainer` and `RemoveContainer` end it; its
//! status, stats, log and `ExecSync`.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use k8s_cri::v1::*;
use tonic::{Request, Response, Status};

use super::{Reply, new_id, no_container, selects};
use crate::record::{ContainerRecord, ImageKind, now_ns, state_name};
use crate::state::{Container, Exit};
use crate::{Runtime, cgroup};

/// `CreateContainer`: a CREATED record in a ready sandbox whose handler runs the image.
pub(super) async fn create(
    runtime: &Runtime,
    request: Request<CreateContainerRequest>,
) -> Reply<CreateContainerResponse> {
    let request = request.into_inner();
    let mut config = request
        .config
        .ok_or_else(|| Status::invalid_argument("CreateContainer needs a container config"))?;
    let image_name = config
        .image
        .as_ref()
        .map(|i| i.image.as_str())
        .unwrap_or_default();
    let image = runtime.images.get(image_name).ok_or_else(|| {
        Status::not_found(format!("image {image_name:?} not present: pull it first"))
    })?;
    let mut tables = runtime.state.tables();
    let sandbox = tables
        .sandboxes
        .get(&request.pod_sandbox_id)
        .ok_or_else(|| Status::not_found(format!("no sandbox {}", request.pod_sandbox_id)))?;
    if sandbox.state != PodSandboxState::SandboxReady as i32 {
        return Err(Status::failed_precondition(format!(
            "sandbox {} is not ready",
            sandbox.id
        )));
    }
    if !runtime.handler_named(&sandbox.handler)?.runs(image.kind) {
        let what = match image.kind {
            ImageKind::Wasm => "a WebAssembly component",
            ImageKind::Process => "a native executable",
            ImageKind::Hollow => "a hollow node's",
        };
        return Err(Status::invalid_argument(format!(
            "image {image_name:?} is {what}, which the {:?} runtime handler runs; sandbox {} has the {:?} handler",
            image.kind.handler(),
            sandbox.id,
            sandbox.handler
        )));
    }
    if image.kind == ImageKind::Wasm {
        // A component is given directories: the kubelet's hosts file, a file at
        // /etc/hosts, is for programs that read /etc.
        config
            .mounts
            .retain(|m| m.container_path != "/etc/hosts" || Path::new(&m.host_path).is_dir());
    }
    if image.kind == ImageKind::Process {
        // Checked now, so a mount the process could not get fails the creation and
        // says which; made when it starts.
        crate::pod_files::binds(&config.mounts, sandbox.files.as_deref()).map_err(|message| {
            Status::invalid_argument(format!(
                "container {:?}: {message}",
                container_name(&config)
            ))
        })?;
    }
    let raw_env = crate::env_bytes(&config)?;
    if image.kind == ImageKind::Wasm
        && let Some((name, _)) = raw_env.first()
    {
        return Err(Status::invalid_argument(format!(
            "environment variable {name} is not valid UTF-8: a WebAssembly component's environment holds UTF-8 strings only (wasi:cli/environment)"
        )));
    }
    let log_path = match config.log_path.as_str() {
        "" => None,
        relative => {
            let path = Path::new(&sandbox.config.log_directory).join(relative);
            if !path.is_absolute() {
                return Err(Status::invalid_argument(format!(
                    "the log path {} is not absolute (the sandbox's log_directory is {:?})",
                    path.display(),
                    sandbox.config.log_directory
                )));
            }
            Some(path)
        }
    };
    let record = ContainerRecord {
        id: new_id(),
        sandbox_id: sandbox.id.clone(),
        config,
        image_id: image.id.clone(),
        kind: image.kind,
        handler: sandbox.handler.clone(),
        program: image.path.clone(),
        log_path,
        state: ContainerState::ContainerCreated as i32,
        created_at: now_ns(),
        started_at: 0,
        finished_at: 0,
        exit_code: 0,
        reason: String::new(),
        message: String::new(),
        pid: None,
        pid_start: None,
        netns: sandbox.netns.clone(),
    };
    runtime.state.store().save_container(&record);
    runtime
        .state
        .event(&record, ContainerEventType::ContainerCreatedEvent);
    let id = record.id.clone();
    tables
        .containers
        .insert(id.clone(), Container { record, live: None });
    Ok(Response::new(CreateContainerResponse { container_id: id }))
}

/// `StartContainer`: a CREATED container run by its handler; one that fails to start has exited.
pub(super) async fn start(
    runtime: &Runtime,
    request: Request<StartContainerRequest>,
) -> Reply<StartContainerResponse> {
    let id = request.into_inner().container_id;
    let record = {
        let tables = runtime.state.tables();
        let container = tables
            .containers
            .get(&id)
            .ok_or_else(|| no_container(&id))?;
        if container.record.state != ContainerState::ContainerCreated as i32 {
            return Err(Status::failed_precondition(format!(
                "container {id} is {}, not CREATED",
                state_name(container.record.state)
            )));
        }
        container.record.clone()
    };
    if let Err(status) = runtime.launch(record).await {
        // As containerd does: a container that failed to start has exited.
        runtime.state.finish(
            &id,
            Exit {
                code: 128,
                reason: "StartError",
                message: status.message().to_string(),
            },
        );
        return Err(status);
    }
    Ok(Response::new(StartContainerResponse {}))
}

/// `StopContainer`: its handler stops it, giving it the request's timeout.
pub(super) async fn stop(
    runtime: &Runtime,
    request: Request<StopContainerRequest>,
) -> Reply<StopContainerResponse> {
    let request = request.into_inner();
    let timeout = Duration::from_secs(request.timeout.max(0).unsigned_abs());
    runtime.stop(&request.container_id, timeout).await?;
    Ok(Response::new(StopContainerResponse {}))
}

/// `RemoveContainer`: stopped at once, then its record removed.
pub(super) async fn remove(
    runtime: &Runtime,
    request: Request<RemoveContainerRequest>,
) -> Reply<RemoveContainerResponse> {
    let id = request.into_inner().container_id;
    match runtime.stop(&id, Duration::ZERO).await {
        Ok(()) => runtime.remove_record(&id),
        Err(e) if e.code() == tonic::Code::NotFound => {}
        Err(e) => return Err(e),
    }
    Ok(Response::new(RemoveContainerResponse {}))
}

/// `ListContainers`: the containers its filter selects.
pub(super) async fn list(
    runtime: &Runtime,
    request: Request<ListContainersRequest>,
) -> Reply<ListContainersResponse> {
    let filter = request.into_inner().filter.unwrap_or_default();
    let tables = runtime.state.tables();
    let containers = tables
        .containers
        .values()
        .map(|c| &c.record)
        .filter(|r| filter.id.is_empty() || r.id == filter.id)
        .filter(|r| filter.pod_sandbox_id.is_empty() || r.sandbox_id == filter.pod_sandbox_id)
        .filter(|r| filter.state.is_none_or(|f| f.state == r.state))
        .filter(|r| selects(&filter.label_selector, &r.config.labels))
        .map(|r| k8s_cri::v1::Container {
            id: r.id.clone(),
            pod_sandbox_id: r.sandbox_id.clone(),
            metadata: r.config.metadata.clone(),
            image: r.config.image.clone(),
            image_ref: r.image_id.clone(),
            state: r.state,
            created_at: r.created_at,
            labels: r.config.labels.clone(),
            annotations: r.config.annotations.clone(),
            image_id: r.image_id.clone(),
        })
        .collect();
    Ok(Response::new(ListContainersResponse { containers }))
}

/// `ContainerStatus`.
pub(super) async fn status(
    runtime: &Runtime,
    request: Request<ContainerStatusRequest>,
) -> Reply<ContainerStatusResponse> {
    let request = request.into_inner();
    let id = request.container_id;
    let tables = runtime.state.tables();
    let container = tables
        .containers
        .get(&id)
        .ok_or_else(|| no_container(&id))?;
    let mut status = container.record.status();
    let mut info = HashMap::new();
    // As containerd's verbose status: the process's pid (and here its /proc start
    // time), by which a client on the node enters the container's namespaces.
    if request.verbose
        && let Some(pid) = container.record.pid.filter(|_| container.live.is_some())
    {
        info.insert(
            "info".to_owned(),
            serde_json::json!({"pid": pid, "pidStart": container.record.pid_start}).to_string(),
        );
    }
    drop(tables);
    // As containerd reports it: the registry's digest of the image when it came
    // from one (`REPO@sha256:…`), else the image's id.
    if let Some(image) = runtime.images.get(&status.image_ref) {
        let repo = status
            .image
            .as_ref()
            .map(|i| {
                i.image
                    .split(['@', ':'])
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            })
            .unwrap_or_default();
        if let Some(digest) = image
            .digests
            .iter()
            .find(|d| d.starts_with(&format!("{repo}@")))
            .or(image.digests.first())
        {
            status.image_ref = digest.clone();
        }
    }
    Ok(Response::new(ContainerStatusResponse {
        status: Some(status),
        info,
    }))
}

/// `ReopenContainerLog`: a running container's log file opened again (after a rotation).
pub(super) async fn reopen_log(
    runtime: &Runtime,
    request: Request<ReopenContainerLogRequest>,
) -> Reply<ReopenContainerLogResponse> {
    let id = request.into_inner().container_id;
    let log = {
        let tables = runtime.state.tables();
        let container = tables
            .containers
            .get(&id)
            .ok_or_else(|| no_container(&id))?;
        let live = container
            .live
            .as_ref()
            .ok_or_else(|| Status::failed_precondition(format!("container {id} is not running")))?;
        live.log.clone()
    };
    if let Some(log) = log {
        log.reopen()
            .map_err(|e| Status::internal(format!("cannot reopen the log: {e}")))?;
    }
    Ok(Response::new(ReopenContainerLogResponse {}))
}

/// `ExecSync`, through the container's handler.
pub(super) async fn exec_sync(
    runtime: &Runtime,
    request: Request<ExecSyncRequest>,
) -> Reply<ExecSyncResponse> {
    let request = request.into_inner();
    let id = &request.container_id;
    let record = {
        let tables = runtime.state.tables();
        let container = tables.containers.get(id).ok_or_else(|| no_container(id))?;
        container.record.clone()
    };
    let timeout = Duration::from_secs(request.timeout.max(0).unsigned_abs());
    let response = runtime
        .handler_named(record.handler())?
        .exec_sync(&record, &request.cmd, timeout)
        .await?;
    Ok(Response::new(response))
}

/// `ContainerStats`.
pub(super) async fn stats(
    runtime: &Runtime,
    request: Request<ContainerStatsRequest>,
) -> Reply<ContainerStatsResponse> {
    let id = request.into_inner().container_id;
    let tables = runtime.state.tables();
    let container = tables
        .containers
        .get(&id)
        .ok_or_else(|| no_container(&id))?;
    Ok(Response::new(ContainerStatsResponse {
        stats: Some(runtime.stats_of(container)),
    }))
}

/// `ListContainerStats`: the running containers its filter selects.
pub(super) async fn list_stats(
    runtime: &Runtime,
    request: Request<ListContainerStatsRequest>,
) -> Reply<ListContainerStatsResponse> {
    let filter = request.into_inner().filter.unwrap_or_default();
    let tables = runtime.state.tables();
    let stats = tables
        .containers
        .values()
        .filter(|c| c.live.is_some())
        .filter(|c| filter.id.is_empty() || c.record.id == filter.id)
        .filter(|c| {
            filter.pod_sandbox_id.is_empty() || c.record.sandbox_id == filter.pod_sandbox_id
        })
        .filter(|c| selects(&filter.label_selector, &c.record.config.labels))
        .map(|c| runtime.stats_of(c))
        .collect();
    Ok(Response::new(ListContainerStatsResponse { stats }))
}

/// `UpdateContainerResources`: the container's new resources kept in its record (its
/// status reports them) and, for a process container, applied to its cgroup.
pub(super) async fn update_resources(
    runtime: &Runtime,
    request: Request<UpdateContainerResourcesRequest>,
) -> Reply<UpdateContainerResourcesResponse> {
    let request = request.into_inner();
    let id = &request.container_id;
    let Some(resources) = request.linux else {
        return Ok(Response::new(UpdateContainerResourcesResponse {}));
    };
    let mut tables = runtime.state.tables();
    let container = tables
        .containers
        .get_mut(id)
        .ok_or_else(|| no_container(id))?;
    let record = &mut container.record;
    if record.kind == ImageKind::Process
        && let Some(cgroup) =
            cgroup::container(&runtime.state.cgroup_parent(&record.sandbox_id), id)
    {
        cgroup.set(&cgroup::limits(&resources)).map_err(|e| {
            Status::internal(format!(
                "container {id}: cannot update its cgroup {}: {e}",
                cgroup.path()
            ))
        })?;
    }
    record
        .config
        .linux
        .get_or_insert_with(Default::default)
        .resources = Some(resources);
    runtime.state.store().save_container(record);
    Ok(Response::new(UpdateContainerResourcesResponse {}))
}

impl Runtime {
    /// Stops container `id` (see `StopContainer`); `Ok` when it is not running.
    pub(super) async fn stop(&self, id: &str, timeout: Duration) -> Result<(), Status> {
        let (handler, how, exited) = {
            let tables = self.state.tables();
            let container = tables.containers.get(id).ok_or_else(|| no_container(id))?;
            let Some(live) = &container.live else {
                return Ok(());
            };
            let handler = self.handler_named(container.record.handler())?.clone();
            (handler, live.stop.clone(), live.exited.subscribe())
        };
        tracing::info!(container = %id, ?timeout, "stopping container");
        handler.stop(&self.state, id, how, timeout, exited).await
    }

    pub(super) fn container_ids_of(&self, sandbox: &str) -> Vec<String> {
        self.state
            .tables()
            .containers
            .values()
            .filter(|c| c.record.sandbox_id == sandbox)
            .map(|c| c.record.id.clone())
            .collect()
    }

    /// Removes container `id`'s record and its cgroup (killing what its process left
    /// running there).
    pub(super) fn remove_record(&self, id: &str) {
        let removed = self.state.tables().containers.remove(id);
        if let Some(container) = removed {
            let record = &container.record;
            if record.kind == ImageKind::Process
                && let Some(cgroup) =
                    cgroup::container(&self.state.cgroup_parent(&record.sandbox_id), id)
            {
                cgroup::remove(&cgroup);
            }
            self.state.forget_sample(id);
            self.state.store().delete_container(id);
            self.state
                .event(record, ContainerEventType::ContainerDeletedEvent);
        }
    }

    /// Starts a container whose record was just taken as CREATED.
    async fn launch(&self, record: ContainerRecord) -> Result<(), Status> {
        let handler = self.handler_named(record.handler())?;
        let prepared = handler.prepare(&record).await?;
        let resources = record
            .config
            .linux
            .as_ref()
            .and_then(|l| l.resources.as_ref());
        // Made before the process starts, so that it joins it before it runs.
        let cgroup = match record.kind {
            ImageKind::Process => cgroup::for_container(
                &self.state.cgroup_parent(&record.sandbox_id),
                &record.id,
                resources,
            )?,
            _ => None,
        };
        let mut tables = self.state.tables();
        let container = tables
            .containers
            .get_mut(&record.id)
            .ok_or_else(|| no_container(&record.id))?;
        if container.record.state != ContainerState::ContainerCreated as i32 {
            return Err(Status::failed_precondition(format!(
                "container {} was started meanwhile",
                record.id
            )));
        }
        let started = handler.start(&self.state, &record, prepared)?;
        if let Some(pid) = started.pid {
            join(cgroup.as_ref(), pid);
            if let Some(adj) = resources.map(|r| r.oom_score_adj).filter(|a| *a != 0) {
                cgroup::set_oom_score_adj(pid, adj);
            }
        }
        let record = &mut container.record;
        record.state = ContainerState::ContainerRunning as i32;
        record.started_at = now_ns();
        record.pid = started.pid;
        record.pid_start = started.pid_start;
        container.live = Some(started.live);
        self.state.store().save_container(record);
        self.state
            .event(record, ContainerEventType::ContainerStartedEvent);
        tracing::info!(container = %record.id, pid = ?started.pid, "container started");
        Ok(())
    }

    /// A container's attributes and use: a process container's from its cgroup,
    /// another's from its handler; its writable layer, its directory.
    pub(super) fn stats_of(&self, c: &Container) -> ContainerStats {
        let r = &c.record;
        let now = now_ns();
        let mut stats = ContainerStats {
            attributes: Some(ContainerAttributes {
                id: r.id.clone(),
                metadata: r.config.metadata.clone(),
                labels: r.config.labels.clone(),
                annotations: r.config.annotations.clone(),
            }),
            ..Default::default()
        };
        let Some(live) = &c.live else { return stats };
        let measured = match r.kind {
            ImageKind::Process => {
                cgroup::container(&self.state.cgroup_parent(&r.sandbox_id), &r.id)
                    .and_then(|cgroup| cgroup.stats().ok())
            }
            _ => None,
        };
        let limit = r
            .config
            .linux
            .as_ref()
            .and_then(|l| l.resources.as_ref())
            .map(|r| r.memory_limit_in_bytes)
            .and_then(|l| u64::try_from(l).ok())
            .filter(|l| *l > 0);
        let (cpu, memory) = match measured {
            Some(measured) => (
                Some(measured.cpu_usage_ns),
                Some(memory_usage(now, &measured, limit)),
            ),
            None => {
                let Ok(handler) = self.handler_named(r.handler()) else {
                    return stats;
                };
                let (cpu, memory) = handler.usage(live);
                let memory = memory.map(|bytes| MemoryUsage {
                    timestamp: now,
                    working_set_bytes: Some(UInt64Value { value: bytes }),
                    available_bytes: limit.map(|l| UInt64Value {
                        value: l.saturating_sub(bytes),
                    }),
                    usage_bytes: Some(UInt64Value { value: bytes }),
                    rss_bytes: Some(UInt64Value { value: bytes }),
                    ..Default::default()
                });
                (cpu, memory)
            }
        };
        stats.cpu = cpu.map(|ns| cpu_usage(&self.state, &r.id, now, ns));
        stats.memory = memory;
        stats.writable_layer = self.state.store().container_dir(&r.id).map(|dir| {
            let (bytes, inodes) = dir_usage(&dir);
            FilesystemUsage {
                timestamp: now,
                fs_id: Some(FilesystemIdentifier {
                    mountpoint: dir.display().to_string(),
                }),
                used_bytes: Some(UInt64Value { value: bytes }),
                inodes_used: Some(UInt64Value { value: inodes }),
            }
        });
        stats
    }
}

/// Moves `pid` into `cgroup` unless it is in it already (the sandbox's init joined it
/// before running the program): a process that did not join from its start is
/// limited from now on.
fn join(cgroup: Option<&trellis_cgroups::Cgroup>, pid: i32) {
    let Some(cgroup) = cgroup else { return };
    let Ok(pid) = u32::try_from(pid) else { return };
    if cgroup.pids().is_ok_and(|pids| pids.contains(&pid)) {
        return;
    }
    if let Err(e) = cgroup.add_process(pid) {
        tracing::warn!(pid, cgroup = %cgroup.path(), "failed to move a container's process into its cgroup: {e}");
    }
}

/// CPU use at `now`, with the rate since the previous sample of `id`.
pub(super) fn cpu_usage(state: &crate::state::State, id: &str, now: i64, ns: u64) -> CpuUsage {
    CpuUsage {
        timestamp: now,
        usage_core_nano_seconds: Some(UInt64Value { value: ns }),
        usage_nano_cores: state
            .nano_cores(id, now, ns)
            .map(|value| UInt64Value { value }),
    }
}

/// A cgroup's memory as CRI reports it; available is the limit less the working set,
/// as cAdvisor has it.
pub(super) fn memory_usage(
    now: i64,
    s: &trellis_cgroups::Stats,
    limit: Option<u64>,
) -> MemoryUsage {
    MemoryUsage {
        timestamp: now,
        working_set_bytes: Some(UInt64Value {
            value: s.memory_working_set,
        }),
        available_bytes: limit.map(|l| UInt64Value {
            value: l.saturating_sub(s.memory_working_set),
        }),
        usage_bytes: Some(UInt64Value {
            value: s.memory_usage,
        }),
        rss_bytes: Some(UInt64Value {
            value: s.memory_rss,
        }),
        page_faults: Some(UInt64Value {
            value: s.page_faults,
        }),
        major_page_faults: Some(UInt64Value {
            value: s.major_page_faults,
        }),
    }
}

/// Bytes and inodes under `dir` (the container's files: its output pipes, its
/// exec's scratch).
fn dir_usage(dir: &Path) -> (u64, u64) {
    let mut bytes = 0;
    let mut inodes = 0;
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.metadata() else { continue };
            inodes += 1;
            if meta.is_dir() {
                todo.push(entry.path());
            } else {
                bytes += meta.len();
            }
        }
    }
    (bytes, inodes)
}

fn container_name(config: &ContainerConfig) -> &str {
    config
        .metadata
        .as_ref()
        .map(|m| m.name.as_str())
        .unwrap_or_default()
}
