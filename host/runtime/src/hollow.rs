//! The runtime of hollow nodes (Kubernetes' kubemark fakes one the same way): the
//! runtime's own CRI service over a handler whose containers run nothing and over
//! stores that keep nothing on disk, as containerd fakes its stores, not its service.
//! Every image is present and a pull is instant; a container runs from its
//! `StartContainer` (after [`HollowConfig::start_delay`]) until it is stopped. One
//! [`HollowRuntime`] serves one node: a node agent lists every container of its runtime,
//! so runtimes are never shared between nodes.
//!
//! [`connect`] serves a runtime on an in-memory stream and returns the [`Client`] an
//! agent takes, with no socket, no file and no thread: a few tens of KB per node.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::image_service_server::ImageServiceServer;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::runtime_service_server::RuntimeServiceServer;
use k8s_cri::v1::{AuthConfig, ExecSyncResponse, FilesystemUsage};
use tokio::sync::watch;
use tonic::Status;
use tonic::transport::{Endpoint, Uri};

use crate::handler::{Handler, Prepared, Started};
use crate::network::PodNetwork;
use crate::record::{ContainerRecord, ImageKind, ImageRecord};
use crate::state::{Exit, Live, State, Stopper, Tables};
use crate::store::{ImageStore, Memory};
use crate::{Client, Runtime};

/// What a fake runtime reports and how its containers behave.
#[derive(Clone, Debug)]
pub struct HollowConfig {
    /// The runtime handlers it reports in `Status` (and accepts in `RunPodSandbox`).
    pub handlers: Vec<String>,
    /// How long `StartContainer` takes before the container is running.
    pub start_delay: Duration,
    /// The node's IP, which sandboxes on the node's network report; once the node has
    /// a pod CIDR, the others get addresses from it.
    pub node_ip: String,
}

impl Default for HollowConfig {
    fn default() -> Self {
        Self {
            handlers: vec![crate::WASMTIME.into(), crate::PROCESS.into()],
            start_delay: Duration::ZERO,
            node_ip: "127.0.0.1".into(),
        }
    }
}

/// One node's fake runtime: a [`Runtime`] whose every handler is hollow.
#[derive(Debug)]
pub struct HollowRuntime {
    runtime: Arc<Runtime>,
}

impl HollowRuntime {
    pub fn new(config: HollowConfig) -> Arc<Self> {
        let hollow: Arc<dyn Handler> = Arc::new(Hollow {
            start_delay: config.start_delay,
        });
        let runtime = Arc::new(Runtime {
            name: "fake",
            node_ip: config
                .node_ip
                .parse()
                .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            state: State::with(Box::new(Memory), Tables::default()),
            images: Arc::new(HollowImages),
            handlers: config
                .handlers
                .into_iter()
                .map(|name| (name, hollow.clone()))
                .collect(),
            network: PodNetwork::fake(),
        });
        Arc::new(Self { runtime })
    }

    /// The containers it holds, whatever their state.
    pub fn container_count(&self) -> usize {
        self.runtime.container_count()
    }

    /// The sandboxes it holds, whatever their state.
    pub fn sandbox_count(&self) -> usize {
        self.runtime.sandbox_count()
    }

    /// A receiver that changes whenever a container changes state.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.runtime.subscribe()
    }
}

/// The hollow handler: a container is a record; it runs nothing.
struct Hollow {
    start_delay: Duration,
}

#[tonic::async_trait]
impl Handler for Hollow {
    fn runs(&self, _: ImageKind) -> bool {
        true
    }

    async fn prepare(&self, _: &ContainerRecord) -> Result<Prepared, Status> {
        if !self.start_delay.is_zero() {
            tokio::time::sleep(self.start_delay).await;
        }
        // No log: a hollow node writes no file.
        Ok(Prepared::default())
    }

    fn start(&self, _: &Arc<State>, _: &ContainerRecord, _: Prepared) -> Result<Started, Status> {
        Ok(Started {
            live: Live {
                exited: watch::channel(false).0,
                stop: Stopper::Hollow,
                log: None,
                tasks: Vec::new(),
                memory: None,
            },
            pid: None,
            pid_start: None,
        })
    }

    async fn stop(
        &self,
        state: &Arc<State>,
        id: &str,
        _: Stopper,
        _: Duration,
        _: watch::Receiver<bool>,
    ) -> Result<(), Status> {
        // What a container killed by its stop reports (SIGKILL's 128 + 9).
        state.finish(
            id,
            Exit {
                code: 137,
                reason: "Error",
                message: String::new(),
            },
        );
        Ok(())
    }

    fn usage(&self, _: &Live) -> (Option<u64>, Option<u64>) {
        (None, None)
    }

    async fn exec_sync(
        &self,
        _: &ContainerRecord,
        _: &[String],
        _: Duration,
    ) -> Result<ExecSyncResponse, Status> {
        // Probes that exec succeed: a hollow container is always healthy.
        Ok(ExecSyncResponse::default())
    }
}

/// A hollow node's images: every one is present, named by itself, and none is listed.
struct HollowImages;

#[tonic::async_trait]
impl ImageStore for HollowImages {
    fn get(&self, name: &str) -> Option<ImageRecord> {
        let name = name.strip_prefix(IMAGE_ID).unwrap_or(name);
        Some(ImageRecord {
            id: format!("{IMAGE_ID}{name}"),
            tags: vec![name.to_owned()],
            digests: Vec::new(),
            kind: ImageKind::Hollow,
            path: PathBuf::new(),
            size: 0,
        })
    }

    fn list(&self) -> Vec<ImageRecord> {
        Vec::new()
    }

    async fn pull(
        self: Arc<Self>,
        reference: String,
        _: Option<AuthConfig>,
    ) -> Result<String, Status> {
        Ok(format!("{IMAGE_ID}{reference}"))
    }

    fn remove(&self, _: &str) -> Result<(), Status> {
        Ok(())
    }

    fn filesystems(&self) -> Vec<FilesystemUsage> {
        Vec::new()
    }
}

/// What a hollow image's id starts with.
const IMAGE_ID: &str = "fake://";

/// Bytes an in-memory stream buffers each way: CRI messages of a hollow node are small.
const STREAM_BUFFER: usize = 64 << 10;

/// Serves `runtime` on an in-memory stream and returns a client of it: the same gRPC
/// an agent speaks to a runtime on a socket, for the price of one HTTP/2 connection in
/// memory. The connection ends when the client and its clones are dropped.
pub async fn connect(runtime: Arc<HollowRuntime>) -> Result<Client, tonic::transport::Error> {
    let runtime = runtime.runtime.clone();
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
    use k8s_cri::v1::*;

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
        let runtime = HollowRuntime::new(HollowConfig::default());
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
