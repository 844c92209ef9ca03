//! A fake CRI runtime for hollow nodes (Kubernetes' kubemark uses one the same way):
//! the real `RuntimeService` and `ImageService` over gRPC, answered from an in-memory
//! map. Every image is present and a pull is instant; a container runs from its
//! `StartContainer` (after [`FakeConfig::start_delay`]) until it is stopped, and runs
//! nothing. One [`FakeRuntime`] serves one node: a node agent lists every container of
//! its runtime, so runtimes are never shared between nodes.
//!
//! [`connect`] serves a runtime on an in-memory stream and returns the [`Client`] an
//! agent takes, with no socket and no thread: a few tens of KB per node.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::image_service_server::{ImageService, ImageServiceServer};
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::runtime_service_server::{RuntimeService, RuntimeServiceServer};
use k8s_cri::v1::*;
use tokio::sync::{broadcast, watch};
use tonic::transport::{Endpoint, Uri};
use tonic::{Request, Response, Status};

use crate::Client;
use crate::service::{no_container, selects};

type Reply<T> = Result<Response<T>, Status>;
type EventStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<ContainerEventResponse, Status>> + Send>>;

/// What a fake runtime reports and how its containers behave.
#[derive(Clone, Debug)]
pub struct FakeConfig {
    /// The runtime handlers it reports in `Status` (and accepts in `RunPodSandbox`).
    pub handlers: Vec<String>,
    /// How long `StartContainer` takes before the container is running.
    pub start_delay: Duration,
    /// The IP every sandbox reports (the node's).
    pub node_ip: String,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            handlers: vec![crate::WASMTIME.into(), crate::PROCESS.into()],
            start_delay: Duration::ZERO,
            node_ip: "127.0.0.1".into(),
        }
    }
}

struct Sandbox {
    id: String,
    metadata: Option<PodSandboxMetadata>,
    labels: HashMap<String, String>,
    annotations: HashMap<String, String>,
    handler: String,
    state: i32,
    created_at: i64,
}

struct FakeContainer {
    id: String,
    sandbox_id: String,
    metadata: Option<ContainerMetadata>,
    image: Option<ImageSpec>,
    labels: HashMap<String, String>,
    annotations: HashMap<String, String>,
    log_path: String,
    state: i32,
    created_at: i64,
    started_at: i64,
    finished_at: i64,
    exit_code: i32,
    reason: String,
}

impl FakeContainer {
    fn listed(&self) -> Container {
        let image_ref = self.image_ref();
        Container {
            id: self.id.clone(),
            pod_sandbox_id: self.sandbox_id.clone(),
            metadata: self.metadata.clone(),
            image: self.image.clone(),
            image_ref: image_ref.clone(),
            state: self.state,
            created_at: self.created_at,
            labels: self.labels.clone(),
            annotations: self.annotations.clone(),
            image_id: image_ref,
        }
    }

    fn status(&self) -> ContainerStatus {
        let image_ref = self.image_ref();
        ContainerStatus {
            id: self.id.clone(),
            metadata: self.metadata.clone(),
            state: self.state,
            created_at: self.created_at,
            started_at: self.started_at,
            finished_at: self.finished_at,
            exit_code: self.exit_code,
            image: self.image.clone(),
            image_ref: image_ref.clone(),
            reason: self.reason.clone(),
            labels: self.labels.clone(),
            annotations: self.annotations.clone(),
            log_path: self.log_path.clone(),
            image_id: image_ref,
            ..Default::default()
        }
    }

    fn image_ref(&self) -> String {
        self.image
            .as_ref()
            .map(|i| image_id(&i.image))
            .unwrap_or_default()
    }
}

#[derive(Default)]
struct Tables {
    sandboxes: HashMap<String, Sandbox>,
    containers: HashMap<String, FakeContainer>,
    next_id: u64,
}

impl Tables {
    /// Ids unique within the runtime; 16 hex digits, as short as is readable.
    fn new_id(&mut self) -> String {
        self.next_id += 1;
        format!("{:016x}", self.next_id)
    }
}

/// One node's fake runtime.
pub struct FakeRuntime {
    config: FakeConfig,
    tables: Mutex<Tables>,
    /// Container events, for `GetContainerEvents`; created with the first reader so
    /// an idle node keeps no buffer.
    events: Mutex<Option<broadcast::Sender<ContainerEventResponse>>>,
    /// Bumped at every container state change: what an agent may wait on instead of
    /// relisting.
    changed: watch::Sender<u64>,
}

impl std::fmt::Debug for FakeRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeRuntime")
            .field("handlers", &self.config.handlers)
            .finish_non_exhaustive()
    }
}

impl FakeRuntime {
    pub fn new(config: FakeConfig) -> Arc<Self> {
        Arc::new(Self {
            config,
            tables: Mutex::default(),
            events: Mutex::default(),
            changed: watch::channel(0).0,
        })
    }

    fn tables(&self) -> MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The containers it holds, whatever their state.
    pub fn container_count(&self) -> usize {
        self.tables().containers.len()
    }

    /// The sandboxes it holds, whatever their state.
    pub fn sandbox_count(&self) -> usize {
        self.tables().sandboxes.len()
    }

    /// A receiver that changes whenever a container changes state.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn event(&self, c: &FakeContainer, kind: ContainerEventType) {
        self.changed.send_modify(|n| *n += 1);
        let events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = events.as_ref().filter(|tx| tx.receiver_count() > 0) {
            let _ = tx.send(ContainerEventResponse {
                container_id: c.id.clone(),
                container_event_type: kind as i32,
                created_at: now_ns(),
                pod_sandbox_status: None,
                containers_statuses: vec![c.status()],
            });
        }
    }

    /// Stops container `id` if it runs; `false` when there is no such container.
    fn stop(&self, tables: &mut Tables, id: &str) -> bool {
        let Some(c) = tables.containers.get_mut(id) else {
            return false;
        };
        if c.state == ContainerState::ContainerRunning as i32
            || c.state == ContainerState::ContainerCreated as i32
        {
            c.state = ContainerState::ContainerExited as i32;
            c.finished_at = now_ns();
            // What a container killed by its stop reports (SIGKILL's 128 + 9).
            c.exit_code = 137;
            c.reason = "Error".into();
            self.event(c, ContainerEventType::ContainerStoppedEvent);
        }
        true
    }

    fn remove(&self, tables: &mut Tables, id: &str) {
        self.stop(tables, id);
        if let Some(c) = tables.containers.remove(id) {
            self.event(&c, ContainerEventType::ContainerDeletedEvent);
        }
    }

    fn containers_of(tables: &Tables, sandbox: &str) -> Vec<String> {
        tables
            .containers
            .values()
            .filter(|c| c.sandbox_id == sandbox)
            .map(|c| c.id.clone())
            .collect()
    }

    fn sandbox_status(&self, s: &Sandbox) -> PodSandboxStatus {
        PodSandboxStatus {
            id: s.id.clone(),
            metadata: s.metadata.clone(),
            state: s.state,
            created_at: s.created_at,
            network: Some(PodSandboxNetworkStatus {
                ip: self.config.node_ip.clone(),
                additional_ips: Vec::new(),
            }),
            labels: s.labels.clone(),
            annotations: s.annotations.clone(),
            runtime_handler: s.handler.clone(),
            ..Default::default()
        }
    }
}

/// The id an image has: every image is present, named by itself.
fn image_id(name: &str) -> String {
    format!("fake://{name}")
}

fn now_ns() -> i64 {
    jiff::Timestamp::now().as_nanosecond() as i64
}

fn unsupported(what: &str) -> Status {
    Status::unimplemented(format!("a hollow node's runtime has no {what}"))
}

#[tonic::async_trait]
impl RuntimeService for FakeRuntime {
    async fn version(&self, _: Request<VersionRequest>) -> Reply<VersionResponse> {
        Ok(Response::new(VersionResponse {
            version: "0.1.0".into(),
            runtime_name: "fake".into(),
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
        let handler = request.runtime_handler;
        if !handler.is_empty() && !self.config.handlers.contains(&handler) {
            return Err(Status::invalid_argument(format!(
                "no runtime handler {handler:?} on this node (it has: {})",
                self.config.handlers.join(", ")
            )));
        }
        let mut tables = self.tables();
        let id = tables.new_id();
        tables.sandboxes.insert(
            id.clone(),
            Sandbox {
                id: id.clone(),
                metadata: config.metadata,
                labels: config.labels,
                annotations: config.annotations,
                handler,
                state: PodSandboxState::SandboxReady as i32,
                created_at: now_ns(),
            },
        );
        Ok(Response::new(RunPodSandboxResponse { pod_sandbox_id: id }))
    }

    async fn stop_pod_sandbox(
        &self,
        request: Request<StopPodSandboxRequest>,
    ) -> Reply<StopPodSandboxResponse> {
        let id = request.into_inner().pod_sandbox_id;
        let mut tables = self.tables();
        for container in Self::containers_of(&tables, &id) {
            self.stop(&mut tables, &container);
        }
        if let Some(s) = tables.sandboxes.get_mut(&id) {
            s.state = PodSandboxState::SandboxNotready as i32;
        }
        Ok(Response::new(StopPodSandboxResponse {}))
    }

    async fn remove_pod_sandbox(
        &self,
        request: Request<RemovePodSandboxRequest>,
    ) -> Reply<RemovePodSandboxResponse> {
        let id = request.into_inner().pod_sandbox_id;
        let mut tables = self.tables();
        for container in Self::containers_of(&tables, &id) {
            self.remove(&mut tables, &container);
        }
        tables.sandboxes.remove(&id);
        Ok(Response::new(RemovePodSandboxResponse {}))
    }

    async fn pod_sandbox_status(
        &self,
        request: Request<PodSandboxStatusRequest>,
    ) -> Reply<PodSandboxStatusResponse> {
        let id = request.into_inner().pod_sandbox_id;
        let tables = self.tables();
        let sandbox = tables
            .sandboxes
            .get(&id)
            .ok_or_else(|| Status::not_found(format!("no sandbox {id}")))?;
        Ok(Response::new(PodSandboxStatusResponse {
            status: Some(self.sandbox_status(sandbox)),
            info: HashMap::new(),
            containers_statuses: tables
                .containers
                .values()
                .filter(|c| c.sandbox_id == id)
                .map(FakeContainer::status)
                .collect(),
            timestamp: now_ns(),
        }))
    }

    async fn list_pod_sandbox(
        &self,
        request: Request<ListPodSandboxRequest>,
    ) -> Reply<ListPodSandboxResponse> {
        let filter = request.into_inner().filter.unwrap_or_default();
        let tables = self.tables();
        let items = tables
            .sandboxes
            .values()
            .filter(|s| filter.id.is_empty() || s.id == filter.id)
            .filter(|s| filter.state.is_none_or(|f| f.state == s.state))
            .filter(|s| selects(&filter.label_selector, &s.labels))
            .map(|s| PodSandbox {
                id: s.id.clone(),
                metadata: s.metadata.clone(),
                state: s.state,
                created_at: s.created_at,
                labels: s.labels.clone(),
                annotations: s.annotations.clone(),
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
        let mut tables = self.tables();
        if !tables.sandboxes.contains_key(&request.pod_sandbox_id) {
            return Err(Status::not_found(format!(
                "no sandbox {}",
                request.pod_sandbox_id
            )));
        }
        let id = tables.new_id();
        let container = FakeContainer {
            id: id.clone(),
            sandbox_id: request.pod_sandbox_id,
            metadata: config.metadata,
            image: config.image,
            labels: config.labels,
            annotations: config.annotations,
            log_path: config.log_path,
            state: ContainerState::ContainerCreated as i32,
            created_at: now_ns(),
            started_at: 0,
            finished_at: 0,
            exit_code: 0,
            reason: String::new(),
        };
        self.event(&container, ContainerEventType::ContainerCreatedEvent);
        tables.containers.insert(id.clone(), container);
        Ok(Response::new(CreateContainerResponse { container_id: id }))
    }

    async fn start_container(
        &self,
        request: Request<StartContainerRequest>,
    ) -> Reply<StartContainerResponse> {
        let id = request.into_inner().container_id;
        if !self.config.start_delay.is_zero() {
            tokio::time::sleep(self.config.start_delay).await;
        }
        let mut tables = self.tables();
        let c = tables
            .containers
            .get_mut(&id)
            .ok_or_else(|| no_container(&id))?;
        if c.state != ContainerState::ContainerCreated as i32 {
            return Err(Status::failed_precondition(format!(
                "container {id} is not CREATED"
            )));
        }
        c.state = ContainerState::ContainerRunning as i32;
        c.started_at = now_ns();
        self.event(c, ContainerEventType::ContainerStartedEvent);
        Ok(Response::new(StartContainerResponse {}))
    }

    async fn stop_container(
        &self,
        request: Request<StopContainerRequest>,
    ) -> Reply<StopContainerResponse> {
        let id = request.into_inner().container_id;
        if !self.stop(&mut self.tables(), &id) {
            return Err(no_container(&id));
        }
        Ok(Response::new(StopContainerResponse {}))
    }

    async fn remove_container(
        &self,
        request: Request<RemoveContainerRequest>,
    ) -> Reply<RemoveContainerResponse> {
        let id = request.into_inner().container_id;
        self.remove(&mut self.tables(), &id);
        Ok(Response::new(RemoveContainerResponse {}))
    }

    async fn list_containers(
        &self,
        request: Request<ListContainersRequest>,
    ) -> Reply<ListContainersResponse> {
        let filter = request.into_inner().filter.unwrap_or_default();
        let tables = self.tables();
        let containers = tables
            .containers
            .values()
            .filter(|c| filter.id.is_empty() || c.id == filter.id)
            .filter(|c| filter.pod_sandbox_id.is_empty() || c.sandbox_id == filter.pod_sandbox_id)
            .filter(|c| filter.state.is_none_or(|f| f.state == c.state))
            .filter(|c| selects(&filter.label_selector, &c.labels))
            .map(FakeContainer::listed)
            .collect();
        Ok(Response::new(ListContainersResponse { containers }))
    }

    async fn container_status(
        &self,
        request: Request<ContainerStatusRequest>,
    ) -> Reply<ContainerStatusResponse> {
        let id = request.into_inner().container_id;
        let tables = self.tables();
        let c = tables
            .containers
            .get(&id)
            .ok_or_else(|| no_container(&id))?;
        Ok(Response::new(ContainerStatusResponse {
            status: Some(c.status()),
            info: HashMap::new(),
        }))
    }

    async fn update_container_resources(
        &self,
        _: Request<UpdateContainerResourcesRequest>,
    ) -> Reply<UpdateContainerResourcesResponse> {
        Ok(Response::new(UpdateContainerResourcesResponse {}))
    }

    async fn reopen_container_log(
        &self,
        _: Request<ReopenContainerLogRequest>,
    ) -> Reply<ReopenContainerLogResponse> {
        Ok(Response::new(ReopenContainerLogResponse {}))
    }

    async fn exec_sync(&self, _: Request<ExecSyncRequest>) -> Reply<ExecSyncResponse> {
        // Probes that exec succeed: a hollow container is always healthy.
        Ok(Response::new(ExecSyncResponse {
            stdout: Vec::new(),
            stderr: Vec::new(),
            exit_code: 0,
        }))
    }

    async fn exec(&self, _: Request<ExecRequest>) -> Reply<ExecResponse> {
        Err(unsupported("exec"))
    }

    async fn attach(&self, _: Request<AttachRequest>) -> Reply<AttachResponse> {
        Err(unsupported("attach"))
    }

    async fn port_forward(&self, _: Request<PortForwardRequest>) -> Reply<PortForwardResponse> {
        Err(unsupported("port forwarding"))
    }

    async fn container_stats(
        &self,
        _: Request<ContainerStatsRequest>,
    ) -> Reply<ContainerStatsResponse> {
        Ok(Response::new(ContainerStatsResponse { stats: None }))
    }

    async fn list_container_stats(
        &self,
        _: Request<ListContainerStatsRequest>,
    ) -> Reply<ListContainerStatsResponse> {
        Ok(Response::new(ListContainerStatsResponse::default()))
    }

    async fn pod_sandbox_stats(
        &self,
        _: Request<PodSandboxStatsRequest>,
    ) -> Reply<PodSandboxStatsResponse> {
        Ok(Response::new(PodSandboxStatsResponse { stats: None }))
    }

    async fn list_pod_sandbox_stats(
        &self,
        _: Request<ListPodSandboxStatsRequest>,
    ) -> Reply<ListPodSandboxStatsResponse> {
        Ok(Response::new(ListPodSandboxStatsResponse::default()))
    }

    async fn update_runtime_config(
        &self,
        _: Request<UpdateRuntimeConfigRequest>,
    ) -> Reply<UpdateRuntimeConfigResponse> {
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
                .config
                .handlers
                .iter()
                .map(|name| RuntimeHandler {
                    name: name.clone(),
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
        Err(unsupported("checkpoints"))
    }

    type GetContainerEventsStream = EventStream;

    async fn get_container_events(
        &self,
        _: Request<GetEventsRequest>,
    ) -> Reply<Self::GetContainerEventsStream> {
        let events = self
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(|| broadcast::channel(256).0)
            .subscribe();
        let stream = futures::stream::unfold(events, |mut events| async move {
            loop {
                match events.recv().await {
                    Ok(event) => return Some((Ok(event), events)),
                    // A reader too slow for the backlog relists, as CRI allows.
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return None,
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
        Err(unsupported("cgroup driver"))
    }
}

#[tonic::async_trait]
impl ImageService for FakeRuntime {
    async fn list_images(&self, request: Request<ListImagesRequest>) -> Reply<ListImagesResponse> {
        // Every image is present, but only those asked for by name can be listed.
        let images = request
            .into_inner()
            .filter
            .and_then(|f| f.image)
            .map(|i| vec![image(&i.image)])
            .unwrap_or_default();
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
            image: Some(image(&name)),
            info: HashMap::new(),
        }))
    }

    async fn pull_image(&self, request: Request<PullImageRequest>) -> Reply<PullImageResponse> {
        let name = request
            .into_inner()
            .image
            .map(|i| i.image)
            .unwrap_or_default();
        Ok(Response::new(PullImageResponse {
            image_ref: image_id(&name),
        }))
    }

    async fn remove_image(&self, _: Request<RemoveImageRequest>) -> Reply<RemoveImageResponse> {
        Ok(Response::new(RemoveImageResponse {}))
    }

    async fn image_fs_info(&self, _: Request<ImageFsInfoRequest>) -> Reply<ImageFsInfoResponse> {
        Ok(Response::new(ImageFsInfoResponse::default()))
    }
}

fn image(name: &str) -> Image {
    Image {
        id: image_id(name),
        repo_tags: vec![name.to_owned()],
        repo_digests: Vec::new(),
        size: 0,
        uid: None,
        username: String::new(),
        spec: Some(ImageSpec {
            image: name.to_owned(),
            ..Default::default()
        }),
        pinned: false,
    }
}

/// Bytes an in-memory stream buffers each way: CRI messages of a hollow node are small.
const STREAM_BUFFER: usize = 64 << 10;

/// Serves `runtime` on an in-memory stream and returns a client of it: the same gRPC
/// an agent speaks to a runtime on a socket, for the price of one HTTP/2 connection in
/// memory. The connection ends when the client and its clones are dropped.
pub async fn connect(runtime: Arc<FakeRuntime>) -> Result<Client, tonic::transport::Error> {
    let routes = tonic::service::Routes::new(RuntimeServiceServer::from_arc(runtime.clone()))
        .add_service(ImageServiceServer::from_arc(runtime));
    // The endpoint dials once: the connector hands over the stream's client half and
    // serves the other.
    let channel = Endpoint::from_static("http://fake.runtime")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let routes = routes.clone();
            async move {
                let (client, server) = tokio::io::duplex(STREAM_BUFFER);
                tokio::spawn(async move {
                    let service = TowerToHyperService::new(routes);
                    if let Err(e) = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(server), service)
                        .await
                    {
                        tracing::debug!(error = %e, "a fake runtime's connection ended");
                    }
                });
                Ok::<_, std::io::Error>(TokioIo::new(client))
            }
        }))
        .await?;
    Ok(Client {
        runtime: RuntimeServiceClient::new(channel.clone()),
        images: ImageServiceClient::new(channel),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox_config(uid: &str) -> PodSandboxConfig {
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: "p".into(),
                uid: uid.into(),
                namespace: "default".into(),
                attempt: 0,
            }),
            labels: [("io.kubernetes.pod.uid".to_owned(), uid.to_owned())].into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn containers_run_until_stopped_and_go_with_their_sandbox() {
        let runtime = FakeRuntime::new(FakeConfig::default());
        let mut changed = runtime.subscribe();
        let client = connect(runtime.clone()).await.unwrap();
        let mut cri = client.runtime.clone();
        let status = cri
            .status(StatusRequest::default())
            .await
            .unwrap()
            .into_inner();
        let handlers: Vec<_> = status
            .runtime_handlers
            .iter()
            .map(|h| h.name.as_str())
            .collect();
        assert_eq!(handlers, ["wasmtime", "process"]);
        let err = cri
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(sandbox_config("u1")),
                runtime_handler: "gvisor".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        let sandbox = cri
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(sandbox_config("u1")),
                runtime_handler: "process".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .pod_sandbox_id;
        let mut images = client.images.clone();
        let pulled = images
            .pull_image(PullImageRequest {
                image: Some(ImageSpec {
                    image: "nginx:1".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(pulled.image_ref, "fake://nginx:1");
        let id = cri
            .create_container(CreateContainerRequest {
                pod_sandbox_id: sandbox.clone(),
                config: Some(ContainerConfig {
                    metadata: Some(ContainerMetadata {
                        name: "c".into(),
                        attempt: 0,
                    }),
                    image: Some(ImageSpec {
                        image: "nginx:1".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                sandbox_config: None,
            })
            .await
            .unwrap()
            .into_inner()
            .container_id;
        cri.start_container(StartContainerRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap();
        assert!(changed.has_changed().unwrap());
        changed.mark_unchanged();
        let status = cri
            .container_status(ContainerStatusRequest {
                container_id: id.clone(),
                verbose: false,
            })
            .await
            .unwrap()
            .into_inner()
            .status
            .unwrap();
        assert_eq!(status.state, ContainerState::ContainerRunning as i32);
        assert!(status.started_at > 0);
        cri.stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: sandbox.clone(),
        })
        .await
        .unwrap();
        assert!(changed.has_changed().unwrap());
        let listed = cri
            .list_containers(ListContainersRequest { filter: None })
            .await
            .unwrap()
            .into_inner()
            .containers;
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].state, ContainerState::ContainerExited as i32);
        cri.remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: sandbox,
        })
        .await
        .unwrap();
        assert_eq!(runtime.container_count(), 0);
        assert_eq!(runtime.sandbox_count(), 0);
    }
}
