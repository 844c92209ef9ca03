//! The CRI `RuntimeService` on [`Runtime`]: each call of a sandbox's or a container's
//! lifecycle answered by `sandbox` or `container`, the runtime's own here.

use std::collections::HashMap;
use std::pin::Pin;

use k8s_cri::v1::runtime_service_server::RuntimeService;
use k8s_cri::v1::*;
use tonic::{Request, Response, Status};

use super::{Reply, container, sandbox};
use crate::Runtime;

type EventStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<ContainerEventResponse, Status>> + Send>>;

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
        sandbox::run(self, request).await
    }

    async fn stop_pod_sandbox(
        &self,
        request: Request<StopPodSandboxRequest>,
    ) -> Reply<StopPodSandboxResponse> {
        sandbox::stop(self, request).await
    }

    async fn remove_pod_sandbox(
        &self,
        request: Request<RemovePodSandboxRequest>,
    ) -> Reply<RemovePodSandboxResponse> {
        sandbox::remove(self, request).await
    }

    async fn pod_sandbox_status(
        &self,
        request: Request<PodSandboxStatusRequest>,
    ) -> Reply<PodSandboxStatusResponse> {
        sandbox::status(self, request).await
    }

    async fn list_pod_sandbox(
        &self,
        request: Request<ListPodSandboxRequest>,
    ) -> Reply<ListPodSandboxResponse> {
        sandbox::list(self, request).await
    }

    async fn create_container(
        &self,
        request: Request<CreateContainerRequest>,
    ) -> Reply<CreateContainerResponse> {
        container::create(self, request).await
    }

    async fn start_container(
        &self,
        request: Request<StartContainerRequest>,
    ) -> Reply<StartContainerResponse> {
        container::start(self, request).await
    }

    async fn stop_container(
        &self,
        request: Request<StopContainerRequest>,
    ) -> Reply<StopContainerResponse> {
        container::stop(self, request).await
    }

    async fn remove_container(
        &self,
        request: Request<RemoveContainerRequest>,
    ) -> Reply<RemoveContainerResponse> {
        container::remove(self, request).await
    }

    async fn list_containers(
        &self,
        request: Request<ListContainersRequest>,
    ) -> Reply<ListContainersResponse> {
        container::list(self, request).await
    }

    async fn container_status(
        &self,
        request: Request<ContainerStatusRequest>,
    ) -> Reply<ContainerStatusResponse> {
        container::status(self, request).await
    }

    async fn update_container_resources(
        &self,
        request: Request<UpdateContainerResourcesRequest>,
    ) -> Reply<UpdateContainerResourcesResponse> {
        container::update_resources(self, request).await
    }

    async fn reopen_container_log(
        &self,
        request: Request<ReopenContainerLogRequest>,
    ) -> Reply<ReopenContainerLogResponse> {
        container::reopen_log(self, request).await
    }

    async fn exec_sync(&self, request: Request<ExecSyncRequest>) -> Reply<ExecSyncResponse> {
        container::exec_sync(self, request).await
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
            "port forwarding is not supported by this runtime yet",
        ))
    }

    async fn container_stats(
        &self,
        request: Request<ContainerStatsRequest>,
    ) -> Reply<ContainerStatsResponse> {
        container::stats(self, request).await
    }

    async fn list_container_stats(
        &self,
        request: Request<ListContainerStatsRequest>,
    ) -> Reply<ListContainerStatsResponse> {
        container::list_stats(self, request).await
    }

    async fn pod_sandbox_stats(
        &self,
        request: Request<PodSandboxStatsRequest>,
    ) -> Reply<PodSandboxStatsResponse> {
        sandbox::stats(self, request).await
    }

    async fn list_pod_sandbox_stats(
        &self,
        request: Request<ListPodSandboxStatsRequest>,
    ) -> Reply<ListPodSandboxStatsResponse> {
        sandbox::list_stats(self, request).await
    }

    async fn update_runtime_config(
        &self,
        request: Request<UpdateRuntimeConfigRequest>,
    ) -> Reply<UpdateRuntimeConfigResponse> {
        // The only setting is the node's pod CIDR, from which pods get their IPs.
        let pod_cidr = request
            .into_inner()
            .runtime_config
            .and_then(|c| c.network_config)
            .map(|n| n.pod_cidr)
            .unwrap_or_default();
        self.network.set_pod_cidr(&pod_cidr)?;
        Ok(Response::new(UpdateRuntimeConfigResponse {}))
    }

    async fn status(&self, _: Request<StatusRequest>) -> Reply<StatusResponse> {
        let condition = |kind: &str| RuntimeCondition {
            r#type: kind.into(),
            status: true,
            reason: String::new(),
            message: String::new(),
        };
        // What the kubelet waits for before it makes a sandbox on the pod's network:
        // a pod CIDR, or an operator's network that needs none.
        let network = match self.network.ready() {
            Ok(()) => condition("NetworkReady"),
            Err(message) => RuntimeCondition {
                reason: "NetworkPluginNotReady".into(),
                message: format!("Network plugin returns error: {message}"),
                status: false,
                ..condition("NetworkReady")
            },
        };
        Ok(Response::new(StatusResponse {
            status: Some(RuntimeStatus {
                conditions: vec![condition("RuntimeReady"), network],
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
        // Cgroups are made as files under their parents' paths, as containerd's
        // cgroupfs driver does; the agent names its pod cgroups the same way.
        Ok(Response::new(RuntimeConfigResponse {
            linux: Some(LinuxRuntimeConfiguration {
                cgroup_driver: CgroupDriver::Cgroupfs as i32,
            }),
        }))
    }
}
