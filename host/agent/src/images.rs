//! Images: pulled as a container's `imagePullPolicy` says, with the credentials of the
//! pod's `imagePullSecrets` (the kubelet's `images` package and its keyring).

use k8s_cri::v1 as cri;
use k8s_openapi::api::core::v1::{Container, Pod};
use kube::api::Api;
use serde_json::Value;
use trellis_client::events::EventType;

use crate::Context;
use crate::status::human;

/// The image, pulled as `imagePullPolicy` says.
pub async fn pull(
    ctx: &Context,
    pod: &Pod,
    container: &Container,
    sandbox_config: &cri::PodSandboxConfig,
) -> Result<(), String> {
    let image = container.image.clone().unwrap_or_default();
    let spec = cri::ImageSpec {
        image: image.clone(),
        ..Default::default()
    };
    let policy = container.image_pull_policy.clone().unwrap_or_else(|| {
        if image.ends_with(":latest") || (!image.contains(':') && !image.contains('@')) {
            "Always".into()
        } else {
            "IfNotPresent".into()
        }
    });
    let mut images = ctx.cri.images.clone();
    if policy != "Always" {
        let present = images
            .image_status(cri::ImageStatusRequest {
                image: Some(spec.clone()),
                verbose: false,
            })
            .await
            .map(|r| r.into_inner().image.is_some())
            .unwrap_or(false);
        if present {
            ctx.events.record(
                pod,
                EventType::Normal,
                "Pulled",
                &format!("Container image \"{image}\" already present on machine"),
            );
            return Ok(());
        }
        if policy == "Never" {
            return Err(format!(
                "Container image \"{image}\" is not present with pull policy of Never"
            ));
        }
    }
    ctx.events.record(
        pod,
        EventType::Normal,
        "Pulling",
        &format!("Pulling image \"{image}\""),
    );
    let started = std::time::Instant::now();
    images
        .pull_image(cri::PullImageRequest {
            image: Some(spec),
            auth: pull_credentials(ctx, pod, &image).await,
            sandbox_config: Some(sandbox_config.clone()),
        })
        .await
        .map_err(|e| format!("Failed to pull image \"{image}\": {}", e.message()))?;
    ctx.events.record(
        pod,
        EventType::Normal,
        "Pulled",
        &format!(
            "Successfully pulled image \"{image}\" in {}",
            human(started.elapsed())
        ),
    );
    Ok(())
}

/// Credentials for the image's registry from the pod's `imagePullSecrets`
/// (`kubernetes.io/dockerconfigjson` or `kubernetes.io/dockercfg`), the first that
/// names the registry, as the kubelet passes them to the runtime.
async fn pull_credentials(ctx: &Context, pod: &Pod, image: &str) -> Option<cri::AuthConfig> {
    let secrets = pod.spec.as_ref()?.image_pull_secrets.as_ref()?;
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let registry = registry_of(image);
    let api: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(ctx.client.clone(), ns);
    for reference in secrets {
        let Ok(Some(secret)) = api.get_opt(&reference.name).await else {
            continue;
        };
        let data = secret.data.unwrap_or_default();
        let config: Value = match (data.get(".dockerconfigjson"), data.get(".dockercfg")) {
            (Some(json), _) => serde_json::from_slice::<Value>(&json.0)
                .ok()
                .and_then(|v| v.get("auths").cloned())
                .unwrap_or_default(),
            (None, Some(cfg)) => serde_json::from_slice(&cfg.0).unwrap_or_default(),
            _ => continue,
        };
        let Some(entries) = config.as_object() else {
            continue;
        };
        for (server, entry) in entries {
            if registry_of_key(server) != registry {
                continue;
            }
            let field = |k: &str| {
                entry
                    .get(k)
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned()
            };
            return Some(cri::AuthConfig {
                username: field("username"),
                password: field("password"),
                auth: field("auth"),
                server_address: server.clone(),
                identity_token: field("identitytoken"),
                registry_token: field("registrytoken"),
            });
        }
    }
    None
}
/// The registry host of an image reference, as Docker names them: the first path
/// part when it looks like a host (a dot, a port, or `localhost`), else Docker Hub.
fn registry_of(image: &str) -> String {
    match image.split_once('/') {
        Some((host, _)) if host.contains('.') || host.contains(':') || host == "localhost" => {
            host.to_owned()
        }
        _ => "docker.io".to_owned(),
    }
}

/// The registry host a docker config key names (`https://host/v1/`, `host:5000`).
fn registry_of_key(key: &str) -> String {
    let host = key
        .trim_start_matches("https://")
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default();
    match host {
        "index.docker.io" | "registry-1.docker.io" => "docker.io".to_owned(),
        other => other.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registries_are_named_as_docker_names_them() {
        assert_eq!(registry_of("127.0.0.1:5000/wasm/app:v1"), "127.0.0.1:5000");
        assert_eq!(registry_of("ghcr.io/org/app"), "ghcr.io");
        assert_eq!(registry_of("nginx"), "docker.io");
        assert_eq!(registry_of("library/nginx:1"), "docker.io");
        assert_eq!(registry_of_key("https://index.docker.io/v1/"), "docker.io");
        assert_eq!(registry_of_key("127.0.0.1:5000"), "127.0.0.1:5000");
    }
}
