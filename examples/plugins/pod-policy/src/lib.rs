//! Pod policy: a validating plugin that denies Pods with privileged containers
//! (regular, init and ephemeral) and Pods whose images come from outside an
//! allow-list of registries.
//!
//! Configuration (`spec.configuration` of the Plugin object):
//!
//! ```json
//! {"allowedRegistries": ["registry.k8s.io", "docker.io/library", "ghcr.io/acme/"]}
//! ```
//!
//! An entry matches an image that equals it or continues it after a `/`, `:` or `@`,
//! so `ghcr.io/acme` allows `ghcr.io/acme/api:1.0` but not `ghcr.io/acme-evil/api`.
//! Images are compared in their full form: `nginx` is `docker.io/library/nginx`.
//! Without `allowedRegistries`, any image is allowed.

use serde::Deserialize;
use trellis_plugin::{Request, Status, Validate, Verdict, log};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PodPolicy {
    #[serde(default)]
    allowed_registries: Option<Vec<String>>,
}

impl Validate for PodPolicy {
    fn check_configuration(&self) -> Result<(), String> {
        match &self.allowed_registries {
            Some(list) if list.is_empty() => {
                Err("allowedRegistries is empty, which would deny every image; leave it out to allow any".into())
            }
            Some(list) if list.iter().any(|r| r.trim().is_empty()) => {
                Err("allowedRegistries has an empty entry, which would allow every image".into())
            }
            _ => Ok(()),
        }
    }

    fn validate(&self, req: &Request) -> Result<Verdict, Status> {
        if req.kind.kind != "Pod" || req.object_json().is_none() {
            return Ok(Verdict::allow());
        }
        // Only the spec matters here: decoding it alone skips the metadata (with its
        // managedFields) and the status.
        let Some(spec) = req.spec_as::<PodSpec>()? else {
            return Ok(Verdict::allow());
        };

        // (kind of container, name, image, security context) for every container.
        let containers = spec
            .containers
            .iter()
            .map(|c| {
                (
                    "container",
                    &c.name,
                    c.image.as_deref(),
                    c.security_context.as_ref(),
                )
            })
            .chain(spec.init_containers.iter().flatten().map(|c| {
                (
                    "init container",
                    &c.name,
                    c.image.as_deref(),
                    c.security_context.as_ref(),
                )
            }))
            .chain(spec.ephemeral_containers.iter().flatten().map(|c| {
                (
                    "ephemeral container",
                    &c.name,
                    c.image.as_deref(),
                    c.security_context.as_ref(),
                )
            }));

        let mut problems = Vec::new();
        let mut foreign_image = false;
        for (what, name, image, security) in containers {
            if security.and_then(|s: &SecurityContext| s.privileged) == Some(true) {
                problems.push(format!("{what} {name:?} is privileged"));
            }
            if let (Some(allowed), Some(image)) = (&self.allowed_registries, image) {
                let full = full_image_name(image);
                if !allowed.iter().any(|prefix| image_matches(&full, prefix)) {
                    foreign_image = true;
                    problems.push(format!("{what} {name:?} uses image {image:?}, which is not from an allowed registry"));
                }
            }
        }
        if problems.is_empty() {
            return Ok(Verdict::allow());
        }
        log::with_fields(
            log::Level::Info,
            "denied",
            &[("pod", &req.display_name()), ("uid", &req.uid)],
        );
        let mut message = format!(
            "pod {} is not allowed: {}",
            req.display_name(),
            problems.join("; ")
        );
        if let (true, Some(allowed)) = (foreign_image, &self.allowed_registries) {
            message.push_str(&format!(" (allowed registries: {})", allowed.join(", ")));
        }
        Ok(Verdict::deny(message))
    }
}

/// The image reference as the container runtime resolves it: `nginx` →
/// `docker.io/library/nginx`, `acme/api` → `docker.io/acme/api`.
fn full_image_name(image: &str) -> String {
    match image.split_once('/') {
        None => format!("docker.io/library/{image}"),
        Some((first, _)) if first.contains(['.', ':']) || first == "localhost" => image.to_owned(),
        Some(_) => format!("docker.io/{image}"),
    }
}

fn image_matches(image: &str, prefix: &str) -> bool {
    let prefix = full_prefix(prefix.trim());
    match image.strip_prefix(prefix.as_str()) {
        Some(rest) => prefix.ends_with('/') || rest.is_empty() || rest.starts_with(['/', ':', '@']),
        None => false,
    }
}

/// Prefixes are written like images, so `library/nginx` or `nginx` mean Docker Hub's.
fn full_prefix(prefix: &str) -> String {
    let first = prefix.split('/').next().unwrap_or(prefix);
    if first.contains(['.', ':']) || first == "localhost" {
        prefix.to_owned()
    } else {
        full_image_name(prefix)
    }
}

/// The fields of a Pod's spec this policy reads, as `k8s_openapi::api::core::v1`
/// names them. Decoding into this view rather than the whole `PodSpec` skips the other
/// fields without building them and keeps the decoders of the fifty-odd types under
/// `PodSpec` out of the component: 140 KB instead of 640 KB, compiled by Cranelift in
/// 0.2 s instead of 4 s, and a fifth less time in each call in the server
/// (docs/benchmarks.md). A test checks the view against `k8s-openapi`'s `PodSpec`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PodSpec {
    containers: Vec<Container>,
    init_containers: Option<Vec<Container>>,
    ephemeral_containers: Option<Vec<Container>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Container {
    name: String,
    image: Option<String>,
    security_context: Option<SecurityContext>,
}

#[derive(Deserialize)]
struct SecurityContext {
    privileged: Option<bool>,
}

trellis_plugin::validating!(PodPolicy);

#[cfg(test)]
mod tests {
    use trellis_plugin::{
        Value, json,
        testing::{self, Harness},
    };

    use super::*;

    fn fixture(name: &str) -> Value {
        testing::fixture(&format!("testdata/{name}"))
    }

    fn harness() -> Harness {
        Harness::new().with_configuration(
            json!({"allowedRegistries": ["registry.k8s.io", "docker.io/library", "ghcr.io/acme/"]}),
        )
    }

    #[test]
    fn allows_a_pod_from_allowed_registries() {
        let a = harness().validate::<PodPolicy>(testing::create(fixture("good-pod.json")));
        assert!(a.is_allowed(), "{:?}", a.status());
    }

    #[test]
    fn denies_privileged_containers_of_every_kind() {
        let a = harness().validate::<PodPolicy>(
            testing::create(fixture("privileged-pod.json")).user("mallory", &[]),
        );
        assert!(!a.is_allowed());
        let message = a.message().unwrap();
        assert!(
            message.starts_with("pod prod/debug is not allowed: "),
            "{message}"
        );
        for what in [
            r#"container "app" is privileged"#,
            r#"init container "setup" is privileged"#,
            r#"ephemeral container "shell" is privileged"#,
        ] {
            assert!(message.contains(what), "{what} in {message}");
        }
        assert!(
            !message.contains("\"sidecar\""),
            "the unprivileged sidecar is fine: {message}"
        );
        assert_eq!(a.status().unwrap().reason, "Forbidden");
        assert!(
            !message.contains("allowed registries"),
            "all images are allowed: {message}"
        );
    }

    #[test]
    fn denies_images_outside_the_allow_list() {
        let mut pod = fixture("good-pod.json");
        pod["spec"]["containers"][0]["image"] = json!("ghcr.io/acme-evil/api:1");
        pod["spec"]["initContainers"] = json!([{"name": "init", "image": "quay.io/x/y"}]);
        let a = harness().validate::<PodPolicy>(testing::create(pod));
        let message = a.message().unwrap();
        assert!(
            message.contains(r#"container "app" uses image "ghcr.io/acme-evil/api:1""#),
            "{message}"
        );
        assert!(
            message.contains(r#"init container "init" uses image "quay.io/x/y""#),
            "{message}"
        );
        assert!(
            message.ends_with(
                "(allowed registries: registry.k8s.io, docker.io/library, ghcr.io/acme/)"
            ),
            "{message}"
        );
    }

    #[test]
    fn image_names_are_compared_in_full() {
        assert_eq!(
            full_image_name("nginx:1.27"),
            "docker.io/library/nginx:1.27"
        );
        assert_eq!(full_image_name("acme/api"), "docker.io/acme/api");
        assert_eq!(full_image_name("localhost/api"), "localhost/api");
        assert_eq!(full_image_name("registry:5000/api"), "registry:5000/api");
        assert!(image_matches("docker.io/library/nginx:1.27", "nginx"));
        assert!(image_matches(
            "docker.io/library/nginx@sha256:abc",
            "docker.io/library/nginx"
        ));
        assert!(!image_matches("docker.io/library/nginxx", "nginx"));
        assert!(image_matches(
            "registry.k8s.io/pause:3.10",
            "registry.k8s.io"
        ));
        assert!(!image_matches(
            "registry.k8s.io.evil.com/pause",
            "registry.k8s.io"
        ));
    }

    #[test]
    fn ignores_deletes_and_other_kinds() {
        assert!(
            harness()
                .validate::<PodPolicy>(testing::delete(fixture("privileged-pod.json")))
                .is_allowed()
        );
        let cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}});
        assert!(
            harness()
                .validate::<PodPolicy>(testing::create(cm))
                .is_allowed()
        );
    }

    #[test]
    fn rejects_configurations_that_would_surprise() {
        let empty = Harness::new().with_configuration(json!({"allowedRegistries": []}));
        assert!(
            empty
                .validate_configuration::<PodPolicy>()
                .unwrap_err()
                .contains("deny every image")
        );
        let blank = Harness::new().with_configuration(json!({"allowedRegistries": [" "]}));
        assert!(blank.validate_configuration::<PodPolicy>().is_err());
        let typo = Harness::new().with_configuration(json!({"allowedRegistry": ["x.io"]}));
        assert!(
            typo.validate_configuration::<PodPolicy>()
                .unwrap_err()
                .contains("unknown field `allowedRegistry`")
        );
        assert!(Harness::new().validate_configuration::<PodPolicy>().is_ok());
    }

    /// The view reads the same containers, images and privileges as the full type:
    /// a field renamed wrongly here would read as absent, and allow.
    #[test]
    fn the_view_reads_what_k8s_openapi_reads() {
        use trellis_plugin::k8s::api::core::v1 as k8s;
        let spec = fixture("privileged-pod.json")["spec"].clone();
        let full: k8s::PodSpec = trellis_plugin::serde_json::from_value(spec.clone()).unwrap();
        let view: PodSpec = trellis_plugin::serde_json::from_value(spec).unwrap();
        let from_full: Vec<_> = full
            .init_containers
            .iter()
            .flatten()
            .chain(&full.containers)
            .map(|c| {
                let privileged = c.security_context.as_ref().and_then(|s| s.privileged);
                (c.name.clone(), c.image.clone(), privileged)
            })
            .chain(full.ephemeral_containers.iter().flatten().map(|c| {
                let privileged = c.security_context.as_ref().and_then(|s| s.privileged);
                (c.name.clone(), c.image.clone(), privileged)
            }))
            .collect();
        let from_view: Vec<_> = view
            .init_containers
            .iter()
            .flatten()
            .chain(&view.containers)
            .chain(view.ephemeral_containers.iter().flatten())
            .map(|c| {
                let privileged = c.security_context.as_ref().and_then(|s| s.privileged);
                (c.name.clone(), c.image.clone(), privileged)
            })
            .collect();
        assert_eq!(from_view, from_full);
        assert_eq!(from_view.len(), 4);
        assert_eq!(
            from_view.iter().filter(|c| c.2 == Some(true)).count(),
            3,
            "{from_view:?}"
        );
    }

    #[test]
    fn a_pod_that_does_not_decode_is_a_bad_request() {
        let mut pod = fixture("good-pod.json");
        pod["spec"]["containers"] = json!("not a list");
        let a = harness().validate::<PodPolicy>(testing::create(pod));
        assert_eq!(a.status().map(|s| s.code), Some(400));
    }
}
