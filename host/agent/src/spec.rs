//! What a container is given: its environment (values, the downward API, ConfigMap and
//! Secret keys, `envFrom`, `$(VAR)` references), and its volumes made on the node and
//! mounted at their `mountPath`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{
    ConfigMap, Container, DownwardAPIVolumeFile, KeyToPath, ObjectFieldSelector, PersistentVolume,
    PersistentVolumeClaim, Pod, ResourceFieldSelector, Secret, Volume,
};
use kube::api::Api;
use trellis_quantity::Quantity as Parsed;

use crate::Context;

/// A container could not be given what it asks for: the kubelet's
/// `CreateContainerConfigError`, with this message.
#[derive(Debug)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// ConfigMaps and Secrets read for one pod's sync, each once.
#[derive(Debug, Default)]
pub struct Sources {
    config_maps: HashMap<String, Option<ConfigMap>>,
    secrets: HashMap<String, Option<Secret>>,
}

impl Sources {
    async fn config_map(
        &mut self,
        ctx: &Context,
        ns: &str,
        name: &str,
    ) -> Result<Option<&ConfigMap>, ConfigError> {
        if !self.config_maps.contains_key(name) {
            let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), ns);
            let found = api
                .get_opt(name)
                .await
                .map_err(|e| ConfigError(format!("read configmap {ns}/{name}: {e}")))?;
            self.config_maps.insert(name.to_owned(), found);
        }
        Ok(self.config_maps.get(name).and_then(Option::as_ref))
    }

    async fn secret(
        &mut self,
        ctx: &Context,
        ns: &str,
        name: &str,
    ) -> Result<Option<&Secret>, ConfigError> {
        if !self.secrets.contains_key(name) {
            let api: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
            let found = api
                .get_opt(name)
                .await
                .map_err(|e| ConfigError(format!("read secret {ns}/{name}: {e}")))?;
            self.secrets.insert(name.to_owned(), found);
        }
        Ok(self.secrets.get(name).and_then(Option::as_ref))
    }
}

/// A container's environment: names and values, in order. Values are bytes, as the
/// kubelet's are: a Secret's value reaches a process as it is stored, UTF-8 or not.
pub type Environment = Vec<(String, Vec<u8>)>;

/// The container's environment, in order, as Kubernetes builds it: `envFrom` first,
/// then `env`, each value's `$(VAR)` references expanded from what comes before (and
/// the service variables), then the service variables the container does not set
/// ([`crate::service_env`]).
pub async fn environment(
    ctx: &Context,
    pod: &Pod,
    container: &Container,
    sources: &mut Sources,
) -> Result<Environment, ConfigError> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let services = crate::service_env::for_pod(ctx, pod)
        .await
        .map_err(ConfigError)?;
    let mut env: Environment = Vec::new();
    let set = |env: &mut Environment, name: String, value: Vec<u8>| match env
        .iter_mut()
        .find(|(n, _)| *n == name)
    {
        Some(slot) => slot.1 = value,
        None => env.push((name, value)),
    };
    for from in container.env_from.iter().flatten() {
        let prefix = from.prefix.clone().unwrap_or_default();
        if let Some(r) = &from.config_map_ref {
            match sources.config_map(ctx, ns, &r.name).await? {
                Some(cm) => {
                    for (k, v) in cm.data.iter().flatten() {
                        set(&mut env, format!("{prefix}{k}"), v.clone().into_bytes());
                    }
                }
                None if r.optional == Some(true) => {}
                None => return Err(ConfigError(format!("configmap \"{}\" not found", r.name))),
            }
        }
        if let Some(r) = &from.secret_ref {
            match sources.secret(ctx, ns, &r.name).await? {
                Some(s) => {
                    for (k, v) in s.data.iter().flatten() {
                        set(&mut env, format!("{prefix}{k}"), v.0.clone());
                    }
                }
                None if r.optional == Some(true) => {}
                None => return Err(ConfigError(format!("secret \"{}\" not found", r.name))),
            }
        }
    }
    for var in container.env.iter().flatten() {
        let value = if let Some(value) = &var.value {
            expand_with(value, |name| {
                env.iter()
                    .rev()
                    .chain(services.iter())
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.as_slice())
            })
        } else if let Some(from) = &var.value_from {
            if let Some(field) = &from.field_ref {
                field_value(ctx, pod, field)?.into_bytes()
            } else if let Some(field) = &from.resource_field_ref {
                resource_value(ctx, pod, Some(container), field)?.into_bytes()
            } else if let Some(r) = &from.config_map_key_ref {
                let cm = sources.config_map(ctx, ns, &r.name).await?;
                match cm.and_then(|cm| cm.data.as_ref()?.get(&r.key).cloned()) {
                    Some(v) => v.into_bytes(),
                    None if r.optional == Some(true) => continue,
                    None if cm.is_none() => {
                        return Err(ConfigError(format!("configmap \"{}\" not found", r.name)));
                    }
                    None => {
                        return Err(ConfigError(format!(
                            "couldn't find key {} in ConfigMap {ns}/{}",
                            r.key, r.name
                        )));
                    }
                }
            } else if let Some(r) = &from.secret_key_ref {
                let secret = sources.secret(ctx, ns, &r.name).await?;
                match secret.and_then(|s| s.data.as_ref()?.get(&r.key).cloned()) {
                    Some(v) => v.0,
                    None if r.optional == Some(true) => continue,
                    None if secret.is_none() => {
                        return Err(ConfigError(format!("secret \"{}\" not found", r.name)));
                    }
                    None => {
                        return Err(ConfigError(format!(
                            "couldn't find key {} in Secret {ns}/{}",
                            r.key, r.name
                        )));
                    }
                }
            } else {
                Vec::new()
            }
        } else {
            Vec::new()
        };
        set(&mut env, var.name.clone(), value);
    }
    for (name, value) in services {
        if !env.iter().any(|(n, _)| *n == name) {
            env.push((name, value));
        }
    }
    Ok(env)
}

/// Kubernetes' `$(VAR)` expansion: a defined variable's value, `$$` an escaped `$`,
/// anything else left as written.
pub fn expand(input: &str, env: &[(String, Vec<u8>)]) -> Vec<u8> {
    expand_with(input, |name| {
        env.iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    })
}

/// [`expand`] with the variables `lookup` finds.
fn expand_with<'a>(input: &str, lookup: impl Fn(&str) -> Option<&'a [u8]>) -> Vec<u8> {
    let mut out = Vec::with_capacity(input.len());
    let mut rest = input;
    while let Some(at) = rest.find('$') {
        out.extend_from_slice(&rest.as_bytes()[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push(b'$');
            rest = tail;
        } else if let Some(body) = after.strip_prefix('(')
            && let Some(end) = body.find(')')
        {
            let name = &body[..end];
            match lookup(name) {
                Some(v) => out.extend_from_slice(v),
                None => {
                    out.extend_from_slice(b"$(");
                    out.extend_from_slice(name.as_bytes());
                    out.push(b')');
                }
            }
            rest = &body[end + 1..];
        } else {
            out.push(b'$');
            rest = after;
        }
    }
    out.extend_from_slice(rest.as_bytes());
    out
}

/// A downward API field of the pod.
pub fn field_value(
    ctx: &Context,
    pod: &Pod,
    field: &ObjectFieldSelector,
) -> Result<String, ConfigError> {
    let meta = &pod.metadata;
    let path = field.field_path.as_str();
    let map_value = |map: &Option<BTreeMap<String, String>>, key: &str| {
        map.as_ref()
            .and_then(|m| m.get(key).cloned())
            .unwrap_or_default()
    };
    let quoted_key = |prefix: &str| {
        path.strip_prefix(prefix)
            .and_then(|k| k.strip_suffix("']"))
            .map(str::to_owned)
    };
    Ok(match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_default(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "metadata.labels" => render_map(&meta.labels),
        "metadata.annotations" => render_map(&meta.annotations),
        "spec.nodeName" => ctx.config.node_name.clone(),
        "spec.serviceAccountName" => pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_default(),
        "status.hostIP" | "status.hostIPs" => ctx.config.node_ip.to_string(),
        "status.podIP" => pod_ips(ctx, pod).swap_remove(0),
        "status.podIPs" => pod_ips(ctx, pod).join(","),
        _ => {
            if let Some(key) = quoted_key("metadata.labels['") {
                map_value(&meta.labels, &key)
            } else if let Some(key) = quoted_key("metadata.annotations['") {
                map_value(&meta.annotations, &key)
            } else {
                return Err(ConfigError(format!("unsupported fieldPath: {path}")));
            }
        }
    })
}

/// The pod's IPs, the first one first: those the runtime gave it on its own network
/// (its status's, which the worker fills in from the sandbox before it starts or
/// probes anything), else the node's.
pub fn pod_ips(ctx: &Context, pod: &Pod) -> Vec<String> {
    let own = own_network(ctx.config.pod_network, pod)
        .then_some(pod.status.as_ref())
        .flatten();
    let ips: Vec<String> = own
        .and_then(|s| s.pod_ips.as_ref())
        .into_iter()
        .flatten()
        .map(|ip| ip.ip.clone())
        .filter(|ip| !ip.is_empty())
        .collect();
    if ips.is_empty() {
        vec![ctx.config.node_ip.to_string()]
    } else {
        ips
    }
}

/// `key="value"` lines, sorted, as the downward API writes labels and annotations.
fn render_map(map: &Option<BTreeMap<String, String>>) -> String {
    map.iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v:?}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A container's resource limit or request, in units of the divisor (rounded up), the
/// node's allocatable when a limit is not set.
pub fn resource_value(
    ctx: &Context,
    pod: &Pod,
    container: Option<&Container>,
    field: &ResourceFieldSelector,
) -> Result<String, ConfigError> {
    let containers = pod
        .spec
        .as_ref()
        .map(|s| s.containers.as_slice())
        .unwrap_or_default();
    let container = match (&field.container_name, container) {
        (Some(name), _) if !name.is_empty() => containers
            .iter()
            .find(|c| &c.name == name)
            .ok_or_else(|| ConfigError(format!("no container {name:?} for resourceFieldRef")))?,
        (_, Some(c)) => c,
        _ => {
            return Err(ConfigError(
                "resourceFieldRef needs containerName here".into(),
            ));
        }
    };
    let (kind, resource) = field
        .resource
        .split_once('.')
        .ok_or_else(|| ConfigError(format!("unsupported resource: {}", field.resource)))?;
    let resources = container.resources.as_ref();
    let set = match kind {
        "limits" => resources.and_then(|r| r.limits.as_ref()),
        "requests" => resources.and_then(|r| r.requests.as_ref()),
        _ => {
            return Err(ConfigError(format!(
                "unsupported resource: {}",
                field.resource
            )));
        }
    };
    let given = set.and_then(|m| m.get(resource)).map(|q| q.0.clone());
    let value = match given {
        Some(v) => v,
        None => {
            let (cpus, memory) = ctx.config.capacity.unwrap_or((
                std::thread::available_parallelism()
                    .map(|n| n.get() as u64)
                    .unwrap_or(1),
                0,
            ));
            match resource {
                "cpu" => cpus.to_string(),
                "memory" => memory.to_string(),
                _ => "0".to_owned(),
            }
        }
    };
    let parse = |s: &str| {
        s.parse::<Parsed>()
            .map_err(|e| ConfigError(format!("resourceFieldRef {}: {s:?}: {e}", field.resource)))
    };
    let divisor = field.divisor.as_ref().map(|d| d.0.as_str()).unwrap_or("1");
    let (value, divisor) = (parse(&value)?, parse(divisor)?);
    let (v, d) = (value.milli_value(), divisor.milli_value().max(1));
    // Rounded up, as Kubernetes converts a quantity to the divisor's units.
    Ok((v.max(0) as u64).div_ceil(d as u64).to_string())
}

/// Where the pod's files live on the node.
pub fn pod_dir(ctx: &Context, uid: &str) -> PathBuf {
    ctx.config.root.join("pods").join(uid)
}

/// Makes the pod's volumes under its directory (or finds a hostPath), and returns each
/// volume's directory on the node by name.
pub async fn volumes(
    ctx: &Context,
    pod: &Pod,
    sources: &mut Sources,
) -> Result<HashMap<String, PathBuf>, ConfigError> {
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let base = pod_dir(ctx, uid).join("volumes");
    let mut out = HashMap::new();
    for volume in pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .into_iter()
        .flatten()
    {
        let dir = base.join(&volume.name);
        let path = make_volume(ctx, pod, ns, volume, &dir, sources).await?;
        out.insert(volume.name.clone(), path);
    }
    Ok(out)
}

async fn make_volume(
    ctx: &Context,
    pod: &Pod,
    ns: &str,
    volume: &Volume,
    dir: &Path,
    sources: &mut Sources,
) -> Result<PathBuf, ConfigError> {
    let io = |e: std::io::Error| ConfigError(format!("volume {:?}: {e}", volume.name));
    if let Some(host) = &volume.host_path {
        let path = PathBuf::from(&host.path);
        match host.type_.as_deref().unwrap_or("") {
            "DirectoryOrCreate" => std::fs::create_dir_all(&path).map_err(io)?,
            "Directory" if !path.is_dir() => {
                return Err(ConfigError(format!(
                    "hostPath type check failed: {} is not a directory",
                    host.path
                )));
            }
            "File" if !path.is_file() => {
                return Err(ConfigError(format!(
                    "hostPath type check failed: {} is not a file",
                    host.path
                )));
            }
            _ => {}
        }
        return Ok(path);
    }
    if let Some(claim) = &volume.persistent_volume_claim {
        return claimed_volume(ctx, ns, &claim.claim_name).await;
    }
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    // Projected tokens: their files, to keep fresh once written.
    let mut tokens = Vec::new();
    if volume.empty_dir.is_some() {
        return Ok(dir.to_owned());
    } else if let Some(cm) = &volume.config_map {
        let name = cm.name.as_str();
        match sources.config_map(ctx, ns, name).await? {
            Some(found) => {
                let mut data: BTreeMap<String, Vec<u8>> = found
                    .data
                    .iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
                    .collect();
                data.extend(
                    found
                        .binary_data
                        .iter()
                        .flatten()
                        .map(|(k, v)| (k.clone(), v.0.clone())),
                );
                files.extend(select(&data, cm.items.as_deref(), name)?);
            }
            None if cm.optional == Some(true) => {}
            None => return Err(ConfigError(format!("configmap \"{name}\" not found"))),
        }
    } else if let Some(secret) = &volume.secret {
        let name = secret.secret_name.as_deref().unwrap_or_default();
        match sources.secret(ctx, ns, name).await? {
            Some(found) => {
                let data: BTreeMap<String, Vec<u8>> = found
                    .data
                    .iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.0.clone()))
                    .collect();
                files.extend(select(&data, secret.items.as_deref(), name)?);
            }
            None if secret.optional == Some(true) => {}
            None => return Err(ConfigError(format!("secret \"{name}\" not found"))),
        }
    } else if let Some(downward) = &volume.downward_api {
        files.extend(downward_files(ctx, pod, downward.items.as_deref())?);
    } else if let Some(projected) = &volume.projected {
        for source in projected.sources.iter().flatten() {
            if let Some(cm) = &source.config_map {
                if let Some(found) = sources.config_map(ctx, ns, &cm.name).await? {
                    let data: BTreeMap<String, Vec<u8>> = found
                        .data
                        .iter()
                        .flatten()
                        .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
                        .collect();
                    files.extend(select(&data, cm.items.as_deref(), &cm.name)?);
                } else if cm.optional != Some(true) {
                    return Err(ConfigError(format!("configmap \"{}\" not found", cm.name)));
                }
            }
            if let Some(secret) = &source.secret {
                if let Some(found) = sources.secret(ctx, ns, &secret.name).await? {
                    let data: BTreeMap<String, Vec<u8>> = found
                        .data
                        .iter()
                        .flatten()
                        .map(|(k, v)| (k.clone(), v.0.clone()))
                        .collect();
                    files.extend(select(&data, secret.items.as_deref(), &secret.name)?);
                } else if secret.optional != Some(true) {
                    return Err(ConfigError(format!("secret \"{}\" not found", secret.name)));
                }
            }
            if let Some(downward) = &source.downward_api {
                files.extend(downward_files(ctx, pod, downward.items.as_deref())?);
            }
            if let Some(token) = &source.service_account_token {
                check_relative(&token.path)?;
                let issued_at = std::time::SystemTime::now();
                let issued = crate::tokens::service_account_token(ctx, pod, token)
                    .await
                    .map_err(ConfigError)?;
                files.push((token.path.clone(), issued.token.clone().into_bytes()));
                tokens.push((dir.join(&token.path), token, issued_at, issued));
            }
        }
    } else {
        return Err(ConfigError(format!(
            "volume {:?}: this node supports emptyDir, hostPath, configMap, secret, downwardAPI and projected volumes",
            volume.name
        )));
    }
    for (path, content) in files {
        let target = dir.join(&path);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        // Written whole under another name and renamed: a container reading the file
        // sees the old content or the new, never part of one.
        crate::tokens::write_whole(&target, &content).map_err(io)?;
    }
    // Written: from now on kept fresh, as the kubelet's token manager keeps them.
    for (path, source, issued_at, issued) in tokens {
        crate::tokens::track(ctx, &path, pod, source, issued_at, &issued);
    }
    Ok(dir.to_owned())
}

/// The files of a ConfigMap or Secret volume: every key, or the listed items.
fn select(
    data: &BTreeMap<String, Vec<u8>>,
    items: Option<&[KeyToPath]>,
    source: &str,
) -> Result<Vec<(String, Vec<u8>)>, ConfigError> {
    let Some(items) = items else {
        return Ok(data.iter().map(|(k, v)| (k.clone(), v.clone())).collect());
    };
    let mut out = Vec::new();
    for item in items {
        let value = data.get(&item.key).ok_or_else(|| {
            ConfigError(format!(
                "configmap or secret {source:?} has no key {:?}",
                item.key
            ))
        })?;
        check_relative(&item.path)?;
        out.push((item.path.clone(), value.clone()));
    }
    Ok(out)
}

fn downward_files(
    ctx: &Context,
    pod: &Pod,
    items: Option<&[DownwardAPIVolumeFile]>,
) -> Result<Vec<(String, Vec<u8>)>, ConfigError> {
    let mut out = Vec::new();
    for item in items.into_iter().flatten() {
        check_relative(&item.path)?;
        let value = if let Some(field) = &item.field_ref {
            field_value(ctx, pod, field)?
        } else if let Some(field) = &item.resource_field_ref {
            resource_value(ctx, pod, None, field)?
        } else {
            String::new()
        };
        out.push((item.path.clone(), value.into_bytes()));
    }
    Ok(out)
}

/// A volume file's path stays inside its volume.
fn check_relative(path: &str) -> Result<(), ConfigError> {
    if path.starts_with('/') || path.split('/').any(|p| p == "..") {
        return Err(ConfigError(format!(
            "invalid volume file path {path:?}: must be relative, without '..'"
        )));
    }
    Ok(())
}

/// The directory of the volume bound to claim `ns/name`, as the kubelet's volume
/// manager finds it: the claim must be bound (the scheduler binds a pod only once
/// its claims are), to a volume that names it; the volume's `hostPath` (made when
/// missing for `DirectoryOrCreate`, as a local-path volume's is) or `local` path.
async fn claimed_volume(ctx: &Context, ns: &str, name: &str) -> Result<PathBuf, ConfigError> {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), ns);
    let claim = claims
        .get_opt(name)
        .await
        .map_err(|e| ConfigError(format!("read persistentvolumeclaim {ns}/{name}: {e}")))?
        .ok_or_else(|| ConfigError(format!("persistentvolumeclaim \"{name}\" not found")))?;
    let volume_name = claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .filter(|v| !v.is_empty())
        .ok_or_else(|| ConfigError(format!("PVC {ns}/{name} has not been bound")))?;
    let volumes: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let volume = volumes
        .get_opt(volume_name)
        .await
        .map_err(|e| ConfigError(format!("read persistentvolume {volume_name}: {e}")))?
        .ok_or_else(|| ConfigError(format!("persistentvolume \"{volume_name}\" not found")))?;
    let spec = volume.spec.unwrap_or_default();
    let claimed_by = spec.claim_ref.as_ref().and_then(|r| r.uid.as_deref());
    if claimed_by.is_some() && claimed_by != claim.metadata.uid.as_deref() {
        return Err(ConfigError(format!(
            "persistentvolume {volume_name} is bound to another claim than {ns}/{name}"
        )));
    }
    let io = |e: std::io::Error| ConfigError(format!("persistentvolume {volume_name}: {e}"));
    // A local-path volume's directory is made writable by all, as k3s' provisioner
    // makes it: the pods of the claim run as whichever user they choose.
    let local_path = volume
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("pv.kubernetes.io/provisioned-by"))
        .is_some_and(|p| p == crate::storage::PROVISIONER);
    if let Some(host) = &spec.host_path {
        let path = PathBuf::from(&host.path);
        match host.type_.as_deref().unwrap_or("") {
            "DirectoryOrCreate" if local_path && !path.exists() => {
                use std::os::unix::fs::PermissionsExt as _;
                std::fs::create_dir_all(&path).map_err(io)?;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777))
                    .map_err(io)?;
            }
            "DirectoryOrCreate" => std::fs::create_dir_all(&path).map_err(io)?,
            _ if !path.exists() => {
                return Err(ConfigError(format!(
                    "persistentvolume {volume_name}: hostPath {} does not exist",
                    host.path
                )));
            }
            _ => {}
        }
        return Ok(path);
    }
    if let Some(local) = &spec.local {
        let path = PathBuf::from(&local.path);
        if !path.exists() {
            return Err(ConfigError(format!(
                "persistentvolume {volume_name}: local path {} does not exist",
                local.path
            )));
        }
        return Ok(path);
    }
    Err(ConfigError(format!(
        "persistentvolume {volume_name}: only hostPath and local volumes are served on this node"
    )))
}

/// The container's mounts: each `volumeMount`'s directory on the node (with its
/// `subPath`) at its `mountPath`.
pub fn mounts(
    container: &Container,
    volumes: &HashMap<String, PathBuf>,
) -> Result<Vec<k8s_cri::v1::Mount>, ConfigError> {
    let mut out = Vec::new();
    for mount in container.volume_mounts.iter().flatten() {
        let mut host = volumes.get(&mount.name).cloned().ok_or_else(|| {
            ConfigError(format!(
                "cannot find volume {:?} to mount into container {:?}",
                mount.name, container.name
            ))
        })?;
        if let Some(sub) = mount.sub_path.as_deref().filter(|s| !s.is_empty()) {
            check_relative(sub)?;
            host = host.join(sub);
            if !host.exists() {
                std::fs::create_dir_all(&host)
                    .map_err(|e| ConfigError(format!("subPath {sub:?}: {e}")))?;
            }
        }
        out.push(k8s_cri::v1::Mount {
            container_path: mount.mount_path.clone(),
            host_path: host.to_string_lossy().into_owned(),
            readonly: mount.read_only.unwrap_or(false),
            ..Default::default()
        });
    }
    Ok(out)
}

/// Whether pod `pod` is on a network of its own when the node gives pods one
/// (`pod_network`): every pod but a hostNetwork one.
pub fn own_network(pod_network: bool, pod: &Pod) -> bool {
    pod_network
        && !pod
            .spec
            .as_ref()
            .and_then(|s| s.host_network)
            .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &[u8])]) -> Environment {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
            .collect()
    }

    #[test]
    fn expansion_follows_kubernetes() {
        let vars = env(&[("A", b"1"), ("B", b"two"), ("RAW", b"\xff\xfeok")]);
        assert_eq!(expand("$(A)-$(B)", &vars), b"1-two");
        assert_eq!(expand("$(MISSING)", &vars), b"$(MISSING)");
        assert_eq!(expand("$$(A)", &vars), b"$(A)");
        assert_eq!(expand("cost $5", &vars), b"cost $5");
        assert_eq!(expand("$(A", &vars), b"$(A");
        assert_eq!(expand("<$(RAW)>", &vars), b"<\xff\xfeok>");
    }

    #[test]
    fn volume_paths_stay_inside() {
        assert!(check_relative("a/b").is_ok());
        assert!(check_relative("/etc/passwd").is_err());
        assert!(check_relative("a/../../x").is_err());
    }
}
