//! The CRI `RuntimeService` and `ImageService` on [`Runtime`]: requests checked and
//! answered from the records, containers started and stopped through their handler's
//! module. Kubernetes' idempotency rules hold: stopping a stopped container, removing
//! an unknown container or sandbox, removing an absent image all succeed.

use std::collections::HashMap;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use k8s_cri::v1::image_service_server::ImageService;
use k8s_cri::v1::runtime_service_server::RuntimeService;
use k8s_cri::v1::*;
use tonic::{Request, Response, Status};

use crate::Runtime;
use crate::handler::Handler;
use crate::record::{ContainerRecord, ImageKind, ImageRecord, SandboxRecord, now_ns, state_name};
use crate::state::{Container, Exit};

type Reply<T> = Result<Response<T>, Status>;
type EventStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<ContainerEventResponse, Status>> + Send>>;

impl Runtime {
    /// The handler a sandbox asking for `name` gets.
    fn handler(&self, name: &str) -> Result<String, Status> {
        match name {
            "" => self
                .handlers
                .first()
                .map(|(h, _)| h.clone())
                .ok_or_else(|| Status::failed_precondition("this node has no runtime handler")),
            name if self.handlers.iter().any(|(h, _)| h == name) => Ok(name.to_string()),
            name => Err(Status::invalid_argument(format!(
                "no runtime handler {name:?} on this node (it has: {})",
                self.handlers().join(", ")
            ))),
        }
    }

    /// The handler named `name`.
    fn handler_named(&self, name: &str) -> Result<&Arc<dyn Handler>, Status> {
        self.handlers
            .iter()
            .find(|(h, _)| h == name)
            .map(|(_, handler)| handler)
            .ok_or_else(|| Status::failed_precondition(format!("no runtime handler {name:?}")))
    }

    /// Stops container `id` (see `StopContainer`); `Ok` when it is not running.
    async fn stop(&self, id: &str, timeout: Duration) -> Result<(), Status> {
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

    /// Starts a container whose record was just taken as CREATED.
    async fn launch(&self, record: ContainerRecord) -> Result<(), Status> {
        let handler = self.handler_named(record.handler())?;
        let prepared = handler.prepare(&record).await?;
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

    fn container_ids_of(&self, sandbox: &str) -> Vec<String> {
        self.state
            .tables()
            .containers
            .values()
            .filter(|c| c.record.sandbox_id == sandbox)
            .map(|c| c.record.id.clone())
            .collect()
    }

    fn remove_record(&self, id: &str) {
        let removed = self.state.tables().containers.remove(id);
        if let Some(container) = removed {
            self.state.store().delete_container(id);
            self.state
                .event(&container.record, ContainerEventType::ContainerDeletedEvent);
        }
    }

    fn sandbox_status(&self, sandbox: &SandboxRecord) -> PodSandboxStatus {
        let node = NamespaceMode::Node as i32;
        PodSandboxStatus {
            id: sandbox.id.clone(),
            metadata: sandbox.config.metadata.clone(),
            state: sandbox.state,
            created_at: sandbox.created_at,
            network: Some(PodSandboxNetworkStatus {
                ip: self.node_ip.to_string(),
                additional_ips: Vec::new(),
            }),
            linux: Some(LinuxPodSandboxStatus {
                namespaces: Some(Namespace {
                    options: Some(NamespaceOption {
                        network: node,
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

#[tonic::async_trait]
impl RuntimeService for Runtime {
    async fn version(&self, _: Request<VersionRequest>) -> Reply<VersionResponse> {
        Ok(Response::new(VersionResponse {
            version: "0.1.0".into(),
            runtime_name: self.name.into(),
            runtime_version: env!("CARGO_PKG_VERSION").into(),
            runtime_api_version: "v1".into(),
        }))
    }

    async fn run_pod_sandbox(
        &self,
        request: Request<RunPodSandboxRequest>,
    ) -> Reply<RunPodSandboxResponse> {
        let request = request.into_inner();
        let config = request
            .config
            .ok_or_else(|| Status::invalid_argument("RunPodSandbox needs a sandbox config"))?;
        let handler = self.handler(&request.runtime_handler)?;
        let record = SandboxRecord {
            id: new_id(),
            config,
            handler,
            state: PodSandboxState::SandboxReady as i32,
            created_at: now_ns(),
        };
        self.state.store().save_sandbox(&record);
        let id = record.id.clone();
        tracing::info!(sandbox = %id, handler = %record.handler, "sandbox ready");
        self.state.tables().sandboxes.insert(id.clone(), record);
        Ok(Response::new(RunPodSandboxResponse { pod_sandbox_id: id }))
    }

    async fn stop_pod_sandbox(
        &self,
        request: Request<StopPodSandboxRequest>,
    ) -> Reply<StopPodSandboxResponse> {
        let id = request.into_inner().pod_sandbox_id;
        for container in self.container_ids_of(&id) {
            match self.stop(&container, Duration::ZERO).await {
                Ok(()) => {}
                // Removed meanwhile: nothing left to stop.
                Err(e) if e.code() == tonic::Code::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        let mut tables = self.state.tables();
        if let Some(sandbox) = tables.sandboxes.get_mut(&id) {
            sandbox.state = PodSandboxState::SandboxNotready as i32;
            self.state.store().save_sandbox(sandbox);
        }
        Ok(Response::new(StopPodSandboxResponse {}))
    }

    async fn remove_pod_sandbox(
        &self,
        request: Request<RemovePodSandboxRequest>,
    ) -> Reply<RemovePodSandboxResponse> {
        let id = request.into_inner().pod_sandbox_id;
        for container in self.container_ids_of(&id) {
            match self.stop(&container, Duration::ZERO).await {
                Ok(()) => self.remove_record(&container),
                Err(e) if e.code() == tonic::Code::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        if self.state.tables().sandboxes.remove(&id).is_some() {
            self.state.store().delete_sandbox(&id);
        }
        Ok(Response::new(RemovePodSandboxResponse {}))
    }

    async fn pod_sandbox_status(
        &self,
        request: Request<PodSandboxStatusRequest>,
    ) -> Reply<PodSandboxStatusResponse> {
        let id = request.into_inner().pod_sandbox_id;
        let tables = self.state.tables();
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
            status: Some(self.sandbox_status(sandbox)),
            info: HashMap::new(),
            containers_statuses,
            timestamp: now_ns(),
        }))
    }

    async fn list_pod_sandbox(
        &self,
        request: Request<ListPodSandboxRequest>,
    ) -> Reply<ListPodSandboxResponse> {
        let filter = request.into_inner().filter.unwrap_or_default();
        let tables = self.state.tables();
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

    async fn create_container(
        &self,
        request: Request<CreateContainerRequest>,
    ) -> Reply<CreateContainerResponse> {
        let request = request.into_inner();
        let config = request
            .config
            .ok_or_else(|| Status::invalid_argument("CreateContainer needs a container config"))?;
        let image_name = config
            .image
            .as_ref()
            .map(|i| i.image.as_str())
            .unwrap_or_default();
        let image = self.images.get(image_name).ok_or_else(|| {
            Status::not_found(format!("image {image_name:?} not present: pull it first"))
        })?;
        let mut tables = self.state.tables();
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
        if !self.handler_named(&sandbox.handler)?.runs(image.kind) {
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
        };
        self.state.store().save_container(&record);
        self.state
            .event(&record, ContainerEventType::ContainerCreatedEvent);
        let id = record.id.clone();
        tables
            .containers
            .insert(id.clone(), Container { record, live: None });
        Ok(Response::new(CreateContainerResponse { container_id: id }))
    }

    async fn start_container(
        &self,
        request: Request<StartContainerRequest>,
    ) -> Reply<StartContainerResponse> {
        let id = request.into_inner().container_id;
        let record = {
            let tables = self.state.tables();
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
        if let Err(status) = self.launch(record).await {
            // As containerd does: a container that failed to start has exited.
            self.state.finish(
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

    async fn stop_container(
        &self,
        request: Request<StopContainerRequest>,
    ) -> Reply<StopContainerResponse> {
        let request = request.into_inner();
        let timeout = Duration::from_secs(request.timeout.max(0).unsigned_abs());
        self.stop(&request.container_id, timeout).await?;
        Ok(Response::new(StopContainerResponse {}))
    }

    async fn remove_container(
        &self,
        request: Request<RemoveContainerRequest>,
    ) -> Reply<RemoveContainerResponse> {
        let id = request.into_inner().container_id;
        match self.stop(&id, Duration::ZERO).await {
            Ok(()) => self.remove_record(&id),
            Err(e) if e.code() == tonic::Code::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(Response::new(RemoveContainerResponse {}))
    }

    async fn list_containers(
        &self,
        request: Request<ListContainersRequest>,
    ) -> Reply<ListContainersResponse> {
        let filter = request.into_inner().filter.unwrap_or_default();
        let tables = self.state.tables();
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

    async fn container_status(
        &self,
        request: Request<ContainerStatusRequest>,
    ) -> Reply<ContainerStatusResponse> {
        let id = request.into_inner().container_id;
        let tables = self.state.tables();
        let container = tables
            .containers
            .get(&id)
            .ok_or_else(|| no_container(&id))?;
        let mut status = container.record.status();
        drop(tables);
        // As containerd reports it: the registry's digest of the image when it came
        // from one (`REPO@sha256:…`), else the image's id.
        if let Some(image) = self.images.get(&status.image_ref) {
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
            info: HashMap::new(),
        }))
    }

    async fn update_container_resources(
        &self,
        _: Request<UpdateContainerResourcesRequest>,
    ) -> Reply<UpdateContainerResourcesResponse> {
        Err(Status::unimplemented(
            "this runtime cannot change a running container's resources yet",
        ))
    }

    async fn reopen_container_log(
        &self,
        request: Request<ReopenContainerLogRequest>,
    ) -> Reply<ReopenContainerLogResponse> {
        let id = request.into_inner().container_id;
        let log = {
            let tables = self.state.tables();
            let container = tables
                .containers
                .get(&id)
                .ok_or_else(|| no_container(&id))?;
            let live = container.live.as_ref().ok_or_else(|| {
                Status::failed_precondition(format!("container {id} is not running"))
            })?;
            live.log.clone()
        };
        if let Some(log) = log {
            log.reopen()
                .map_err(|e| Status::internal(format!("cannot reopen the log: {e}")))?;
        }
        Ok(Response::new(ReopenContainerLogResponse {}))
    }

    async fn exec_sync(&self, request: Request<ExecSyncRequest>) -> Reply<ExecSyncResponse> {
        let request = request.into_inner();
        let id = &request.container_id;
        let record = {
            let tables = self.state.tables();
            let container = tables.containers.get(id).ok_or_else(|| no_container(id))?;
            container.record.clone()
        };
        let timeout = Duration::from_secs(request.timeout.max(0).unsigned_abs());
        let response = self
            .handler_named(record.handler())?
            .exec_sync(&record, &request.cmd, timeout)
            .await?;
        Ok(Response::new(response))
    }

    async fn exec(&self, _: Request<ExecRequest>) -> Reply<ExecResponse> {
        Err(Status::unimplemented(
            "interactive exec is not supported by this runtime yet (ExecSync is)",
        ))
    }

    async fn attach(&self, _: Request<AttachRequest>) -> Reply<AttachResponse> {
        Err(Status::unimplemented(
            "attach is not supported by this runtime yet: read the container's log",
        ))
    }

    async fn port_forward(&self, _: Request<PortForwardRequest>) -> Reply<PortForwardResponse> {
        Err(Status::unimplemented(
            "port forwarding is not supported by this runtime yet (pods are on the host network)",
        ))
    }

    async fn container_stats(
        &self,
        request: Request<ContainerStatsRequest>,
    ) -> Reply<ContainerStatsResponse> {
        let id = request.into_inner().container_id;
        let tables = self.state.tables();
        let container = tables
            .containers
            .get(&id)
            .ok_or_else(|| no_container(&id))?;
        Ok(Response::new(ContainerStatsResponse {
            stats: Some(self.container_stats(container)),
        }))
    }

    async fn list_container_stats(
        &self,
        request: Request<ListContainerStatsRequest>,
    ) -> Reply<ListContainerStatsResponse> {
        let filter = request.into_inner().filter.unwrap_or_default();
        let tables = self.state.tables();
        let stats = tables
            .containers
            .values()
            .filter(|c| c.live.is_some())
            .filter(|c| filter.id.is_empty() || c.record.id == filter.id)
            .filter(|c| {
                filter.pod_sandbox_id.is_empty() || c.record.sandbox_id == filter.pod_sandbox_id
            })
            .filter(|c| selects(&filter.label_selector, &c.record.config.labels))
            .map(|c| self.container_stats(c))
            .collect();
        Ok(Response::new(ListContainerStatsResponse { stats }))
    }

    async fn pod_sandbox_stats(
        &self,
        _: Request<PodSandboxStatsRequest>,
    ) -> Reply<PodSandboxStatsResponse> {
        Err(Status::unimplemented(
            "sandbox stats are not supported by this runtime yet (ContainerStats is)",
        ))
    }

    async fn list_pod_sandbox_stats(
        &self,
        _: Request<ListPodSandboxStatsRequest>,
    ) -> Reply<ListPodSandboxStatsResponse> {
        Err(Status::unimplemented(
            "sandbox stats are not supported by this runtime yet (ListContainerStats is)",
        ))
    }

    async fn update_runtime_config(
        &self,
        _: Request<UpdateRuntimeConfigRequest>,
    ) -> Reply<UpdateRuntimeConfigResponse> {
        // The only setting is the pod CIDR, which host-network sandboxes do not use.
        Ok(Response::new(UpdateRuntimeConfigResponse {}))
    }

    async fn status(&self, _: Request<StatusRequest>) -> Reply<StatusResponse> {
        let condition = |kind: &str| RuntimeCondition {
            r#type: kind.into(),
            status: true,
            reason: String::new(),
            message: String::new(),
        };
        Ok(Response::new(StatusResponse {
            status: Some(RuntimeStatus {
                conditions: vec![condition("RuntimeReady"), condition("NetworkReady")],
            }),
            info: HashMap::new(),
            runtime_handlers: self
                .handlers()
                .into_iter()
                .map(|name| RuntimeHandler {
                    name,
                    features: Some(RuntimeHandlerFeatures::default()),
                })
                .collect(),
            features: Some(RuntimeFeatures::default()),
        }))
    }

    async fn checkpoint_container(
        &self,
        _: Request<CheckpointContainerRequest>,
    ) -> Reply<CheckpointContainerResponse> {
        Err(Status::unimplemented(
            "checkpointing is not supported by this runtime",
        ))
    }

    type GetContainerEventsStream = EventStream;

    async fn get_container_events(
        &self,
        _: Request<GetEventsRequest>,
    ) -> Reply<Self::GetContainerEventsStream> {
        let events = self.state.events();
        let stream = futures::stream::unfold(events, |mut events| async move {
            loop {
                match events.recv().await {
                    Ok(event) => return Some((Ok(event), events)),
                    // A reader too slow for the backlog misses events, as CRI allows:
                    // it relists.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list_metric_descriptors(
        &self,
        _: Request<ListMetricDescriptorsRequest>,
    ) -> Reply<ListMetricDescriptorsResponse> {
        Ok(Response::new(ListMetricDescriptorsResponse::default()))
    }

    async fn list_pod_sandbox_metrics(
        &self,
        _: Request<ListPodSandboxMetricsRequest>,
    ) -> Reply<ListPodSandboxMetricsResponse> {
        Ok(Response::new(ListPodSandboxMetricsResponse::default()))
    }

    async fn runtime_config(
        &self,
        _: Request<RuntimeConfigRequest>,
    ) -> Reply<RuntimeConfigResponse> {
        Err(Status::unimplemented(
            "this runtime uses no cgroups: there is no cgroup driver to report",
        ))
    }
}

#[tonic::async_trait]
impl ImageService for Runtime {
    async fn list_images(&self, request: Request<ListImagesRequest>) -> Reply<ListImagesResponse> {
        let name = request
            .into_inner()
            .filter
            .and_then(|f| f.image)
            .map(|i| i.image)
            .unwrap_or_default();
        // An image named is looked up (a hollow node's are never listed, all present).
        let images = match name.as_str() {
            "" => self.images.list().iter().map(to_image).collect(),
            name => self.images.get(name).iter().map(to_image).collect(),
        };
        Ok(Response::new(ListImagesResponse { images }))
    }

    async fn image_status(
        &self,
        request: Request<ImageStatusRequest>,
    ) -> Reply<ImageStatusResponse> {
        let name = request
            .into_inner()
            .image
            .map(|i| i.image)
            .unwrap_or_default();
        Ok(Response::new(ImageStatusResponse {
            image: self.images.get(&name).as_ref().map(to_image),
            info: HashMap::new(),
        }))
    }

    async fn pull_image(&self, request: Request<PullImageRequest>) -> Reply<PullImageResponse> {
        let request = request.into_inner();
        let reference = request.image.map(|i| i.image).unwrap_or_default();
        let image_ref = self.images.clone().pull(reference, request.auth).await?;
        Ok(Response::new(PullImageResponse { image_ref }))
    }

    async fn remove_image(
        &self,
        request: Request<RemoveImageRequest>,
    ) -> Reply<RemoveImageResponse> {
        let name = request
            .into_inner()
            .image
            .map(|i| i.image)
            .unwrap_or_default();
        self.images.remove(&name)?;
        Ok(Response::new(RemoveImageResponse {}))
    }

    async fn image_fs_info(&self, _: Request<ImageFsInfoRequest>) -> Reply<ImageFsInfoResponse> {
        Ok(Response::new(ImageFsInfoResponse {
            image_filesystems: self.images.filesystems(),
            container_filesystems: Vec::new(),
        }))
    }
}

impl Runtime {
    /// A container's attributes, and what its handler knows of its use.
    fn container_stats(&self, c: &Container) -> ContainerStats {
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
        let Ok(handler) = self.handler_named(r.handler()) else {
            return stats;
        };
        let (cpu, memory) = handler.usage(live);
        stats.cpu = cpu.map(|ns| CpuUsage {
            timestamp: now,
            usage_core_nano_seconds: Some(UInt64Value { value: ns }),
            usage_nano_cores: None,
        });
        stats.memory = memory.map(|bytes| MemoryUsage {
            timestamp: now,
            working_set_bytes: Some(UInt64Value { value: bytes }),
            usage_bytes: Some(UInt64Value { value: bytes }),
            rss_bytes: Some(UInt64Value { value: bytes }),
            ..Default::default()
        });
        stats
    }
}

fn to_image(image: &ImageRecord) -> Image {
    Image {
        id: image.id.clone(),
        repo_tags: image.tags.clone(),
        repo_digests: image.digests.clone(),
        size: image.size,
        uid: None,
        username: String::new(),
        spec: Some(ImageSpec {
            image: image.id.clone(),
            ..Default::default()
        }),
        pinned: false,
    }
}

/// Whether `labels` hold every label of a CRI filter's `selector`.
pub(crate) fn selects(
    selector: &HashMap<String, String>,
    labels: &HashMap<String, String>,
) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

pub(crate) fn no_container(id: &str) -> Status {
    Status::not_found(format!("no container {id}"))
}

/// A new sandbox or container id: 32 hex digits.
fn new_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}
