//! A pod's containers in the runtime (the kubelet's `kuberuntime_container.go`): the
//! configuration a container is created with, and what the runtime says of the
//! containers of a sandbox.

use std::collections::HashMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use k8s_cri::v1 as cri;
use k8s_openapi::api::core::v1::{Container, Pod};
use serde_json::Value;
use trellis_runtime::ENV_BYTES;

use crate::labels;
use crate::spec::{self, Sources};
use crate::status::{Observed, State};
use crate::{Context, hosts};

/// The configuration of run `attempt` of `container`: its command and arguments with
/// the environment's references expanded, environment, mounts (making the pod's volumes
/// the first time `volumes` is asked for, and the pod's hosts file at `/etc/hosts`
/// unless it mounts one), labels and annotations, log file and memory limit.
pub async fn container_config(
    ctx: &Context,
    uid: &str,
    pod: &Pod,
    container: &Container,
    attempt: u32,
    volumes: &mut Option<HashMap<String, std::path::PathBuf>>,
    sources: &mut Sources,
) -> Result<cri::ContainerConfig, spec::ConfigError> {
    if volumes.is_none() {
        *volumes = Some(spec::volumes(ctx, pod, sources).await?);
    }
    let mut mounts = spec::mounts(container, volumes.as_ref().unwrap_or(&HashMap::new()))?;
    if !mounts.iter().any(|m| m.container_path == ETC_HOSTS) {
        mounts.push(hosts_mount(ctx, uid, pod)?);
    }
    let env = spec::environment(ctx, pod, container, sources).await?;
    // CRI's arguments are strings: a reference to a value that is not UTF-8 is
    // passed as its closest string.
    let expand = |list: &Option<Vec<String>>| -> Vec<String> {
        list.iter()
            .flatten()
            .map(|s| String::from_utf8_lossy(&spec::expand(s, &env)).into_owned())
            .collect()
    };
    let (command, args) = (expand(&container.command), expand(&container.args));
    let mut annotations = labels::container_annotations(container, attempt);
    let envs = cri_environment(ctx, container, env, &mut annotations)?;
    let memory_limit = container
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("memory"))
        .and_then(|q| q.0.parse::<trellis_quantity::Quantity>().ok())
        .map(|q| q.value())
        .unwrap_or(0);
    Ok(cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: container.name.clone(),
            attempt,
        }),
        image: Some(cri::ImageSpec {
            image: container.image.clone().unwrap_or_default(),
            ..Default::default()
        }),
        command,
        args,
        working_dir: container.working_dir.clone().unwrap_or_default(),
        envs,
        mounts,
        labels: labels::container_labels(pod, uid, container),
        annotations,
        log_path: format!("{}/{attempt}.log", container.name),
        linux: Some(cri::LinuxContainerConfig {
            resources: Some(cri::LinuxContainerResources {
                memory_limit_in_bytes: memory_limit,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// Where a container finds its pod's hosts file.
const ETC_HOSTS: &str = "/etc/hosts";

/// The pod's managed hosts file (written again, as the kubelet does for each
/// container, with the pod's IPs as they are now) mounted at `/etc/hosts`.
fn hosts_mount(ctx: &Context, uid: &str, pod: &Pod) -> Result<cri::Mount, spec::ConfigError> {
    let path = hosts::hosts_path(&spec::pod_dir(ctx, uid));
    hosts::ensure_hosts_file(
        &path,
        pod,
        &spec::pod_ips(ctx, pod),
        spec::own_network(ctx.config.pod_network, pod),
        &ctx.config.cluster_domain,
        std::path::Path::new(ETC_HOSTS),
    )
    .map_err(|e| spec::ConfigError(format!("cannot write the pod's hosts file: {e}")))?;
    Ok(cri::Mount {
        container_path: ETC_HOSTS.to_owned(),
        host_path: path.to_string_lossy().into_owned(),
        readonly: false,
        ..Default::default()
    })
}

/// The environment as CRI carries it. Its values are protobuf strings, which this
/// client can only send as UTF-8: a value that is not (a Secret's bytes) goes to
/// Trellis' runtime in [`ENV_BYTES`] instead, as the kubelet's bytes reach
/// containerd; another runtime cannot be given it unchanged, so the container
/// fails with the reason rather than get a different value.
fn cri_environment(
    ctx: &Context,
    container: &Container,
    env: spec::Environment,
    annotations: &mut HashMap<String, String>,
) -> Result<Vec<cri::KeyValue>, spec::ConfigError> {
    let mut raw = serde_json::Map::new();
    let mut envs = Vec::with_capacity(env.len());
    for (key, value) in env {
        let value = match String::from_utf8(value) {
            Ok(value) => value,
            Err(e) if ctx.runtime_name == "trellis" => {
                raw.insert(key.clone(), BASE64.encode(e.as_bytes()).into());
                String::new()
            }
            Err(_) => {
                return Err(spec::ConfigError(format!(
                    "environment variable {key} of container {:?} is not valid UTF-8, which the {} runtime cannot be given over CRI",
                    container.name, ctx.runtime_name
                )));
            }
        };
        envs.push(cri::KeyValue { key, value });
    }
    if !raw.is_empty() {
        annotations.insert(ENV_BYTES.to_owned(), Value::Object(raw).to_string());
    }
    Ok(envs)
}

/// The sandbox's containers, by container name, newest first.
pub async fn observe(
    ctx: &Context,
    sandbox: &str,
) -> anyhow::Result<HashMap<String, Vec<Observed>>> {
    let mut runtime = ctx.cri.runtime.clone();
    let listed = runtime
        .list_containers(cri::ListContainersRequest {
            filter: Some(cri::ContainerFilter {
                pod_sandbox_id: sandbox.to_owned(),
                ..Default::default()
            }),
        })
        .await
        .map_err(|e| anyhow::anyhow!("list containers: {}", e.message()))?
        .into_inner();
    let mut by_name: HashMap<String, Vec<cri::Container>> = HashMap::new();
    for c in listed.containers {
        let name = c
            .metadata
            .as_ref()
            .map(|m| m.name.clone())
            .unwrap_or_default();
        by_name.entry(name).or_default().push(c);
    }
    let mut out = HashMap::new();
    for (name, mut list) in by_name {
        list.sort_by_key(|c| {
            std::cmp::Reverse((
                c.metadata.as_ref().map(|m| m.attempt).unwrap_or(0),
                c.created_at,
            ))
        });
        let mut seen = Vec::new();
        for (i, c) in list.iter().enumerate() {
            if i >= 2 {
                // Older runs than the previous one: their logs are no longer asked for.
                let _ = runtime
                    .remove_container(cri::RemoveContainerRequest {
                        container_id: c.id.clone(),
                    })
                    .await;
                continue;
            }
            let status = runtime
                .container_status(cri::ContainerStatusRequest {
                    container_id: c.id.clone(),
                    verbose: false,
                })
                .await
                .map_err(|e| anyhow::anyhow!("container status: {}", e.message()))?
                .into_inner()
                .status
                .unwrap_or_default();
            let attempt = c.metadata.as_ref().map(|m| m.attempt).unwrap_or(0);
            seen.push(observed(c.id.clone(), attempt, status));
        }
        out.insert(name, seen);
    }
    Ok(out)
}

/// A container as the agent reads it, from the runtime's status of it.
pub fn observed(id: String, attempt: u32, status: cri::ContainerStatus) -> Observed {
    Observed {
        id,
        attempt,
        state: State::from_cri(status.state),
        exit_code: status.exit_code,
        reason: status.reason,
        message: status.message,
        created_at: status.created_at,
        started_at: status.started_at,
        finished_at: status.finished_at,
        image_ref: status.image_ref,
    }
}
