//! A pod's containers in the runtime (the kubelet's `kuberuntime_container.go`): the
//! configuration a container is created with, and what the runtime says of the
//! containers of a sandbox.

use std::collections::HashMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use k8s_cri::v1 as cri;
use k8s_openapi::api::core::v1::{Container, Pod, PodSecurityContext, SecurityContext};
use serde_json::Value;
use trellis_runtime::ENV_BYTES;

use crate::labels;
use crate::spec::{self, Sources};
use crate::status::{self, Observed, State};
use crate::{Context, hosts};

/// The configuration of run `attempt` of `container`: its command and arguments with
/// the environment's references expanded, environment, mounts (making the pod's volumes
/// the first time `volumes` is asked for, and the pod's hosts file at `/etc/hosts`
/// unless it mounts one, the pod's `fsGroup` owning its volumes), labels and
/// annotations, log file, and its resources and security context as the kubelet's
/// `generateLinuxContainerConfig` gives them ([`linux_config`]).
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
        let made = spec::volumes(ctx, pod, sources).await?;
        volume_ownership(pod, &made)?;
        *volumes = Some(made);
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
    let image_user = image_user(ctx, container).await;
    let linux = linux_config(
        &Node {
            memory_capacity: crate::node::memory_capacity(ctx),
            seccomp_default: ctx.config.seccomp_default,
            seccomp_root: &ctx.config.root.join("seccomp"),
            pod_network: ctx.config.pod_network,
        },
        pod,
        container,
        image_user,
    )?;
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
        linux: Some(linux),
        ..Default::default()
    })
}

/// What of the node a container's configuration depends on.
#[derive(Clone, Copy, Debug)]
pub struct Node<'a> {
    /// Bytes of memory of the node, against which a Burstable container's memory
    /// request sets its OOM score.
    pub memory_capacity: u64,
    /// The kubelet's `--seccomp-default`: containers whose pod names no seccomp
    /// profile get the runtime's default one rather than none.
    pub seccomp_default: bool,
    /// Where `Localhost` seccomp profiles are found (the kubelet's `<root>/seccomp`).
    pub seccomp_root: &'a std::path::Path,
    /// Whether pods that are not hostNetwork get a network of their own.
    pub pod_network: bool,
}

/// The user an image runs as, as its runtime reports it: a UID, or a name that is not
/// one. Neither when the runtime says nothing (or cannot be asked), which
/// `runAsNonRoot` takes as root, as the kubelet does; a `process` image is nobody's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageUser {
    pub uid: Option<i64>,
    pub username: String,
}

async fn image_user(ctx: &Context, container: &Container) -> ImageUser {
    let mut images = ctx.cri.images.clone();
    let status = images
        .image_status(cri::ImageStatusRequest {
            image: Some(cri::ImageSpec {
                image: container.image.clone().unwrap_or_default(),
                ..Default::default()
            }),
            verbose: false,
        })
        .await;
    match status.ok().and_then(|s| s.into_inner().image) {
        Some(image) => ImageUser {
            uid: image.uid.map(|u| u.value),
            username: image.username,
        },
        None => ImageUser::default(),
    }
}

/// The priority class whose pods the kubelet treats as part of the node (their OOM
/// score is the Guaranteed one whatever their resources).
const NODE_CRITICAL: &str = "system-node-critical";
/// The OOM scores of the kubelet's `qos` package: Guaranteed containers are killed
/// last, BestEffort ones first, Burstable ones in between by their memory request.
const GUARANTEED_OOM_SCORE_ADJ: i64 = -997;
const BEST_EFFORT_OOM_SCORE_ADJ: i64 = 1000;
/// The kubelet's CFS period (µs), the same for every container.
const CPU_PERIOD: u64 = 100_000;
/// What the kubelet masks and makes read-only in `/proc` and `/sys` of a container
/// with the `Default` procMount (`securitycontext.ConvertToRuntimeMaskedPaths`).
const MASKED_PATHS: &[&str] = &[
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];
const READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// The quantity of `resource` in `list`, when it is there.
fn quantity(
    list: Option<
        &std::collections::BTreeMap<
            String,
            k8s_openapi::apimachinery::pkg::api::resource::Quantity,
        >,
    >,
    resource: &str,
) -> Option<trellis_quantity::Quantity> {
    list?.get(resource)?.0.parse().ok()
}

/// The container's resources and security context as the kubelet sends them
/// (`generateLinuxContainerConfig`): CPU shares from its CPU request (its limit when
/// it requests none), CFS quota from its CPU limit, its memory limit, its OOM score
/// by the pod's QoS class; its security context merged with the pod's (the
/// container's wins), the pod's `fsGroup` and supplemental groups, its seccomp
/// profile, the pod's namespaces. A container that must not run as root but would
/// (`runAsNonRoot`) is refused with the kubelet's message.
pub fn linux_config(
    node: &Node,
    pod: &Pod,
    container: &Container,
    image_user: ImageUser,
) -> Result<cri::LinuxContainerConfig, spec::ConfigError> {
    Ok(cri::LinuxContainerConfig {
        resources: Some(resources(node, pod, container)),
        security_context: Some(security_context(node, pod, container, image_user)?),
    })
}

fn resources(node: &Node, pod: &Pod, container: &Container) -> cri::LinuxContainerResources {
    let r = container.resources.as_ref();
    let (requests, limits) = (
        r.and_then(|r| r.requests.as_ref()),
        r.and_then(|r| r.limits.as_ref()),
    );
    let cpu_limit = quantity(limits, "cpu")
        .map(|q| q.milli_value())
        .unwrap_or(0);
    // A request defaults to the limit (the API server sets it so for new pods; the
    // kubelet repeats it for older ones).
    let cpu_request = match quantity(requests, "cpu") {
        Some(q) => q.milli_value(),
        None => cpu_limit,
    };
    let memory_limit = quantity(limits, "memory").map(|q| q.value()).unwrap_or(0);
    cri::LinuxContainerResources {
        cpu_shares: trellis_cgroups::milli_cpu_to_shares(cpu_request) as i64,
        cpu_quota: trellis_cgroups::milli_cpu_to_quota(cpu_limit, CPU_PERIOD),
        cpu_period: CPU_PERIOD as i64,
        memory_limit_in_bytes: memory_limit.max(0),
        oom_score_adj: oom_score_adj(node, pod, container),
        ..Default::default()
    }
}

/// The kubelet's `GetContainerOOMScoreAdjust`.
fn oom_score_adj(node: &Node, pod: &Pod, container: &Container) -> i64 {
    let spec = pod.spec.as_ref();
    if spec.and_then(|s| s.priority_class_name.as_deref()) == Some(NODE_CRITICAL) {
        return GUARANTEED_OOM_SCORE_ADJ;
    }
    match status::qos_class(pod) {
        "Guaranteed" => return GUARANTEED_OOM_SCORE_ADJ,
        "BestEffort" => return BEST_EFFORT_OOM_SCORE_ADJ,
        _ => {}
    }
    let requests = container
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref());
    let request = quantity(requests, "memory").map(|q| q.value()).unwrap_or(0);
    let capacity = node.memory_capacity.max(1) as i128;
    let score = 1000 - (1000 * request as i128) / capacity;
    // Above the Guaranteed containers' score, and below the BestEffort ones'.
    let lowest = i128::from(1000 + GUARANTEED_OOM_SCORE_ADJ);
    if score < lowest {
        return lowest as i64;
    }
    if score == i128::from(BEST_EFFORT_OOM_SCORE_ADJ) {
        return BEST_EFFORT_OOM_SCORE_ADJ - 1;
    }
    score as i64
}

/// The kubelet's `format.Pod`: `name_namespace(uid)`.
fn pod_label(pod: &Pod) -> String {
    format!(
        "{}_{}({})",
        pod.metadata.name.as_deref().unwrap_or_default(),
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.uid.as_deref().unwrap_or_default()
    )
}

/// The container's security context with the pod's settings where it has none of its
/// own (`securitycontext.DetermineEffectiveSecurityContext`).
fn effective(pod_sc: Option<&PodSecurityContext>, container: &Container) -> SecurityContext {
    let mut sc = container.security_context.clone().unwrap_or_default();
    if let Some(p) = pod_sc {
        if sc.run_as_user.is_none() {
            sc.run_as_user = p.run_as_user;
        }
        if sc.run_as_group.is_none() {
            sc.run_as_group = p.run_as_group;
        }
        if sc.run_as_non_root.is_none() {
            sc.run_as_non_root = p.run_as_non_root;
        }
        if sc.se_linux_options.is_none() {
            sc.se_linux_options = p.se_linux_options.clone();
        }
        if sc.seccomp_profile.is_none() {
            sc.seccomp_profile = p.seccomp_profile.clone();
        }
    }
    sc
}

/// The kubelet's `verifyRunAsNonRoot`.
fn verify_run_as_non_root(
    pod: &Pod,
    container: &Container,
    sc: &SecurityContext,
    image_user: &ImageUser,
) -> Result<(), spec::ConfigError> {
    if sc.run_as_non_root != Some(true) {
        return Ok(());
    }
    let who = format!(
        "(pod: \"{}\", container: {})",
        pod_label(pod),
        container.name
    );
    if let Some(uid) = sc.run_as_user {
        if uid == 0 {
            return Err(spec::ConfigError(format!(
                "container's runAsUser breaks non-root policy {who}"
            )));
        }
        return Ok(());
    }
    match image_user {
        ImageUser {
            uid: None,
            username,
        } if !username.is_empty() => Err(spec::ConfigError(format!(
            "container has runAsNonRoot and image has non-numeric user ({username}), cannot verify user is non-root {who}"
        ))),
        // An image that names no user runs as root (the kubelet's `getImageUser`).
        ImageUser {
            uid: Some(0) | None,
            ..
        } => Err(spec::ConfigError(format!(
            "container has runAsNonRoot and image will run as root {who}"
        ))),
        _ => Ok(()),
    }
}

/// The seccomp profile of the container (the kubelet's `getSeccompProfile`): its
/// own, else the pod's, else the runtime's default with `seccomp_default`, else none.
fn seccomp(node: &Node, sc: &SecurityContext) -> cri::SecurityProfile {
    use cri::security_profile::ProfileType;
    let Some(profile) = &sc.seccomp_profile else {
        let profile_type = if node.seccomp_default {
            ProfileType::RuntimeDefault
        } else {
            ProfileType::Unconfined
        };
        return cri::SecurityProfile {
            profile_type: profile_type as i32,
            localhost_ref: String::new(),
        };
    };
    match profile.type_.as_str() {
        "Localhost" => cri::SecurityProfile {
            profile_type: ProfileType::Localhost as i32,
            localhost_ref: node
                .seccomp_root
                .join(profile.localhost_profile.as_deref().unwrap_or_default())
                .to_string_lossy()
                .into_owned(),
        },
        "Unconfined" => cri::SecurityProfile {
            profile_type: ProfileType::Unconfined as i32,
            localhost_ref: String::new(),
        },
        _ => cri::SecurityProfile {
            profile_type: ProfileType::RuntimeDefault as i32,
            localhost_ref: String::new(),
        },
    }
}

/// The kubelet's `determineEffectiveSecurityContext`, with the check of
/// `runAsNonRoot` that comes before it.
fn security_context(
    node: &Node,
    pod: &Pod,
    container: &Container,
    image_user: ImageUser,
) -> Result<cri::LinuxContainerSecurityContext, spec::ConfigError> {
    let pod_spec = pod.spec.as_ref();
    let pod_sc = pod_spec.and_then(|s| s.security_context.as_ref());
    let sc = effective(pod_sc, container);
    verify_run_as_non_root(pod, container, &sc, &image_user)?;
    let mut supplemental_groups = Vec::new();
    if let Some(p) = pod_sc {
        supplemental_groups.extend(p.fs_group);
        supplemental_groups.extend(p.supplemental_groups.iter().flatten());
    }
    // The image's user when the pod names none, as the kubelet does; the runtime then
    // runs a name it knows as that user.
    let (run_as_user, run_as_username) = match sc.run_as_user {
        Some(uid) => (Some(uid), String::new()),
        None => (image_user.uid, image_user.username),
    };
    // `procMount: Unmasked` leaves /proc as it is.
    let unmasked = sc.proc_mount.as_deref() == Some("Unmasked");
    let paths = |list: &[&str]| -> Vec<String> {
        if unmasked {
            Vec::new()
        } else {
            list.iter().map(|p| (*p).to_owned()).collect()
        }
    };
    Ok(cri::LinuxContainerSecurityContext {
        capabilities: sc.capabilities.as_ref().map(|c| cri::Capability {
            add_capabilities: c.add.clone().unwrap_or_default(),
            drop_capabilities: c.drop.clone().unwrap_or_default(),
            ..Default::default()
        }),
        privileged: sc.privileged.unwrap_or(false),
        namespace_options: Some(crate::sandbox::namespace_options(
            pod,
            spec::own_network(node.pod_network, pod),
        )),
        selinux_options: sc.se_linux_options.as_ref().map(|o| cri::SeLinuxOption {
            user: o.user.clone().unwrap_or_default(),
            role: o.role.clone().unwrap_or_default(),
            r#type: o.type_.clone().unwrap_or_default(),
            level: o.level.clone().unwrap_or_default(),
        }),
        run_as_user: run_as_user.map(|value| cri::Int64Value { value }),
        run_as_group: sc.run_as_group.map(|value| cri::Int64Value { value }),
        run_as_username,
        readonly_rootfs: sc.read_only_root_filesystem.unwrap_or(false),
        supplemental_groups,
        // Unset is the kernel's default: a setuid program may still gain privileges.
        no_new_privs: sc.allow_privilege_escalation == Some(false),
        masked_paths: paths(MASKED_PATHS),
        readonly_paths: paths(READONLY_PATHS),
        seccomp: Some(seccomp(node, &sc)),
        ..Default::default()
    })
}

/// Makes the pod's own volumes (emptyDir, configMap, secret, downwardAPI, projected;
/// never a hostPath) usable by its `fsGroup` as the kubelet's `SetVolumeOwnership`
/// does: every file's group is the fsGroup and group-readable (and writable for an
/// emptyDir), directories setgid so what is made in them keeps the group. An
/// emptyDir is open to every user (0777), as the kubelet makes it, so that a container
/// running as any user may write it. `fsGroupChangePolicy: OnRootMismatch` skips a
/// volume whose top directory is already so.
pub fn volume_ownership(
    pod: &Pod,
    volumes: &HashMap<String, std::path::PathBuf>,
) -> Result<(), spec::ConfigError> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(());
    };
    let pod_sc = spec.security_context.as_ref();
    let fs_group = pod_sc.and_then(|s| s.fs_group);
    let on_root_mismatch =
        pod_sc.and_then(|s| s.fs_group_change_policy.as_deref()) == Some("OnRootMismatch");
    for volume in spec.volumes.iter().flatten() {
        let Some(dir) = volumes.get(&volume.name) else {
            continue;
        };
        let io = |e: std::io::Error| spec::ConfigError(format!("volume {:?}: {e}", volume.name));
        let readonly = if volume.empty_dir.is_some() {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(dir).map_err(io)?.permissions().mode();
            if mode & 0o777 != 0o777 {
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o777))
                    .map_err(io)?;
            }
            false
        } else if volume.config_map.is_some()
            || volume.secret.is_some()
            || volume.downward_api.is_some()
            || volume.projected.is_some()
        {
            true
        } else {
            continue;
        };
        let Some(gid) = fs_group else { continue };
        let gid = u32::try_from(gid)
            .map_err(|_| spec::ConfigError(format!("fsGroup {gid} is not a group ID")))?;
        if on_root_mismatch && owned_by(dir, gid, readonly) {
            continue;
        }
        set_ownership(dir, gid, readonly).map_err(io)?;
    }
    Ok(())
}

/// The permission bits the kubelet adds for the fsGroup.
fn group_mask(readonly: bool, dir: bool) -> u32 {
    let mut mask = if readonly { 0o440 } else { 0o660 };
    if dir {
        // setgid and searchable.
        mask |= 0o2000 | 0o110;
    }
    mask
}

/// Whether `dir` already has the fsGroup's group and permissions
/// (the kubelet's `skipPermissionChange`).
fn owned_by(dir: &std::path::Path, gid: u32, readonly: bool) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(meta) = std::fs::metadata(dir) else {
        return false;
    };
    let mask = group_mask(readonly, true);
    meta.gid() == gid && meta.mode() & mask == mask
}

fn set_ownership(path: &std::path::Path, gid: u32, readonly: bool) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let meta = std::fs::symlink_metadata(path)?;
    std::os::unix::fs::lchown(path, None, Some(gid))?;
    // A link is left as it is: what it points to is changed where it is in the volume.
    if meta.file_type().is_symlink() {
        return Ok(());
    }
    let mode = meta.permissions().mode() | group_mask(readonly, meta.is_dir());
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    if meta.is_dir() {
        for entry in std::fs::read_dir(path)? {
            set_ownership(&entry?.path(), gid, readonly)?;
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": spec,
        }))
        .unwrap()
    }

    fn node() -> Node<'static> {
        Node {
            memory_capacity: 4 << 30,
            seccomp_default: true,
            seccomp_root: std::path::Path::new("/var/lib/trellis/seccomp"),
            pod_network: true,
        }
    }

    fn config(p: &Pod, user: ImageUser) -> Result<cri::LinuxContainerConfig, spec::ConfigError> {
        let container = p.spec.as_ref().unwrap().containers[0].clone();
        linux_config(&node(), p, &container, user)
    }

    #[test]
    fn resources_are_the_kubelets() {
        let p = pod(
            serde_json::json!({"containers": [{"name": "c", "resources": {
            "requests": {"cpu": "100m", "memory": "1Gi"},
            "limits": {"cpu": "200m", "memory": "2Gi"}}}]}),
        );
        let r = config(&p, ImageUser::default()).unwrap().resources.unwrap();
        assert_eq!(r.cpu_shares, 102);
        assert_eq!((r.cpu_quota, r.cpu_period), (20_000, 100_000));
        assert_eq!(r.memory_limit_in_bytes, 2 << 30);
        // Burstable: 1000 - 1000 * 1Gi / 4Gi.
        assert_eq!(r.oom_score_adj, 750);
        // A limit alone: the request is the limit (Guaranteed).
        let p = pod(
            serde_json::json!({"containers": [{"name": "c", "resources": {
            "limits": {"cpu": "200m", "memory": "64Mi"}}}]}),
        );
        let r = config(&p, ImageUser::default()).unwrap().resources.unwrap();
        assert_eq!((r.cpu_shares, r.cpu_quota), (204, 20_000));
        assert_eq!(r.oom_score_adj, -997);
        // Nothing asked: the smallest weight, no quota, killed first.
        let p = pod(serde_json::json!({"containers": [{"name": "c"}]}));
        let r = config(&p, ImageUser::default()).unwrap().resources.unwrap();
        assert_eq!(
            (r.cpu_shares, r.cpu_quota, r.memory_limit_in_bytes),
            (2, 0, 0)
        );
        assert_eq!(r.oom_score_adj, 1000);
    }

    #[test]
    fn a_burstable_oom_score_stays_between_the_other_classes() {
        let score = |memory: &str| {
            let p = pod(
                serde_json::json!({"containers": [{"name": "c", "resources": {
                "requests": {"memory": memory}}}]}),
            );
            config(&p, ImageUser::default())
                .unwrap()
                .resources
                .unwrap()
                .oom_score_adj
        };
        assert_eq!(score("8Gi"), 3);
        assert_eq!(score("1"), 999);
    }

    #[test]
    fn the_containers_security_context_wins_over_the_pods() {
        let p = pod(serde_json::json!({
            "securityContext": {"runAsUser": 1000, "runAsGroup": 3000, "fsGroup": 2000,
                "supplementalGroups": [4000], "seccompProfile": {"type": "Unconfined"}},
            "shareProcessNamespace": true,
            "containers": [{"name": "c", "securityContext": {
                "runAsUser": 1234, "allowPrivilegeEscalation": false,
                "readOnlyRootFilesystem": true,
                "capabilities": {"add": ["NET_ADMIN"], "drop": ["ALL"]},
                "seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}}}]}));
        let sc = config(&p, ImageUser::default())
            .unwrap()
            .security_context
            .unwrap();
        assert_eq!(sc.run_as_user.map(|u| u.value), Some(1234));
        assert_eq!(sc.run_as_group.map(|g| g.value), Some(3000));
        assert_eq!(sc.supplemental_groups, [2000, 4000]);
        assert!(sc.no_new_privs && sc.readonly_rootfs && !sc.privileged);
        let caps = sc.capabilities.unwrap();
        assert_eq!(
            (caps.add_capabilities, caps.drop_capabilities),
            (vec!["NET_ADMIN".to_owned()], vec!["ALL".to_owned()])
        );
        let seccomp = sc.seccomp.unwrap();
        assert_eq!(
            seccomp.profile_type,
            cri::security_profile::ProfileType::Localhost as i32
        );
        assert_eq!(seccomp.localhost_ref, "/var/lib/trellis/seccomp/p.json");
        assert_eq!(
            sc.namespace_options.unwrap().pid,
            cri::NamespaceMode::Pod as i32
        );
        assert!(sc.masked_paths.contains(&"/proc/kcore".to_owned()));
    }

    #[test]
    fn a_pod_that_names_no_seccomp_profile_gets_the_runtime_default() {
        let p = pod(serde_json::json!({"containers": [{"name": "c"}]}));
        let sc = config(&p, ImageUser::default())
            .unwrap()
            .security_context
            .unwrap();
        assert_eq!(
            sc.seccomp.unwrap().profile_type,
            cri::security_profile::ProfileType::RuntimeDefault as i32
        );
        // Unset allowPrivilegeEscalation is the kernel's default.
        assert!(!sc.no_new_privs);
        assert!(sc.run_as_user.is_none());
        let container = p.spec.as_ref().unwrap().containers[0].clone();
        let node = Node {
            seccomp_default: false,
            ..node()
        };
        let sc = linux_config(&node, &p, &container, ImageUser::default())
            .unwrap()
            .security_context
            .unwrap();
        assert_eq!(
            sc.seccomp.unwrap().profile_type,
            cri::security_profile::ProfileType::Unconfined as i32
        );
    }

    #[test]
    fn run_as_non_root_refuses_root_with_the_kubelets_messages() {
        let non_root = |container_sc: serde_json::Value| {
            pod(
                serde_json::json!({"securityContext": {"runAsNonRoot": true},
                "containers": [{"name": "c", "securityContext": container_sc}]}),
            )
        };
        let root = ImageUser {
            uid: Some(0),
            username: String::new(),
        };
        let e = config(&non_root(serde_json::json!({})), root.clone()).unwrap_err();
        assert_eq!(
            e.0,
            "container has runAsNonRoot and image will run as root (pod: \"p_ns(u)\", container: c)"
        );
        let named = ImageUser {
            uid: None,
            username: "www".into(),
        };
        let e = config(&non_root(serde_json::json!({})), named).unwrap_err();
        assert!(e.0.starts_with(
            "container has runAsNonRoot and image has non-numeric user (www), cannot verify user is non-root"
        ));
        let e = config(&non_root(serde_json::json!({"runAsUser": 0})), root.clone()).unwrap_err();
        assert!(e.0.starts_with("container's runAsUser breaks non-root policy"));
        // An image that names no user (a WASM component's) runs as root.
        let e = config(&non_root(serde_json::json!({})), ImageUser::default()).unwrap_err();
        assert!(e.0.starts_with("container has runAsNonRoot and image will run as root"));
        // A process image runs as nobody (its runtime says so): it passes.
        let nobody = ImageUser {
            uid: Some(65534),
            username: String::new(),
        };
        assert!(config(&non_root(serde_json::json!({})), nobody).is_ok());
        // A non-root user given: the image's root is not used.
        let sc = config(&non_root(serde_json::json!({"runAsUser": 1000})), root)
            .unwrap()
            .security_context
            .unwrap();
        assert_eq!(sc.run_as_user.map(|u| u.value), Some(1000));
        // Without runAsNonRoot the image's user is passed on.
        let p = pod(serde_json::json!({"containers": [{"name": "c"}]}));
        let sc = config(
            &p,
            ImageUser {
                uid: Some(0),
                username: String::new(),
            },
        )
        .unwrap()
        .security_context
        .unwrap();
        assert_eq!(sc.run_as_user.map(|u| u.value), Some(0));
    }

    #[test]
    fn the_fs_group_owns_the_pods_volumes_but_not_a_host_path() {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        let dir = tempfile::tempdir().unwrap();
        let (empty, secret, host) = (
            dir.path().join("empty"),
            dir.path().join("secret"),
            dir.path().join("host"),
        );
        for d in [&empty, &secret, &host] {
            std::fs::create_dir(d).unwrap();
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        std::fs::write(secret.join("key"), "v").unwrap();
        std::fs::set_permissions(secret.join("key"), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        let p = pod(serde_json::json!({"securityContext": {"fsGroup": 2345},
            "volumes": [{"name": "empty", "emptyDir": {}}, {"name": "secret", "secret": {"secretName": "s"}},
                {"name": "host", "hostPath": {"path": host}}],
            "containers": [{"name": "c"}]}));
        let volumes = HashMap::from([
            ("empty".to_owned(), empty.clone()),
            ("secret".to_owned(), secret.clone()),
            ("host".to_owned(), host.clone()),
        ]);
        volume_ownership(&p, &volumes).unwrap();
        let meta = |p: &std::path::Path| std::fs::metadata(p).unwrap();
        assert_eq!(meta(&empty).gid(), 2345);
        assert_eq!(meta(&empty).mode() & 0o7777, 0o2777);
        assert_eq!(meta(&secret.join("key")).gid(), 2345);
        assert_eq!(meta(&secret.join("key")).mode() & 0o777, 0o640);
        assert_eq!(meta(&secret).mode() & 0o7777, 0o2755);
        assert_ne!(meta(&host).gid(), 2345);
        assert_eq!(meta(&host).mode() & 0o7777, 0o755);
    }
}
