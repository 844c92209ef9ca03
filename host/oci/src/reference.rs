//! References to artifacts: `HOST[:PORT]/REPOSITORY[:TAG]` or
//! `HOST[:PORT]/REPOSITORY@sha256:HEX`, and Kubernetes image names, whose registry
//! defaults to Docker Hub.

use crate::http::is_loopback;
use crate::is_sha256_hex;

/// Where an artifact is: a registry, a repository in it, and a tag or digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    /// `HOST[:PORT]` as written (Docker Hub's API host for `docker.io`).
    pub registry: String,
    pub repository: String,
    /// A tag, or `sha256:HEX`.
    pub reference: String,
}

impl Reference {
    /// Parses `HOST[:PORT]/REPOSITORY[:TAG|@sha256:HEX]` (no scheme; the registry is
    /// required, the tag defaults to `latest`). The error says what is wrong.
    pub fn parse(name: &str) -> Result<Self, String> {
        let (registry, path) = name
            .split_once('/')
            .ok_or("expected HOST[:PORT]/REPOSITORY[:TAG|@sha256:DIGEST]")?;
        if registry.is_empty()
            || registry.contains('@')
            || registry.parse::<hyper::http::uri::Authority>().is_err()
        {
            return Err("the registry must be HOST[:PORT]".into());
        }
        let (repository, reference) = if let Some((repo, digest)) = path.split_once('@') {
            let hex = digest
                .strip_prefix("sha256:")
                .ok_or("a digest reference must be sha256:HEX")?;
            if !is_sha256_hex(hex) {
                return Err("a sha256 digest has 64 lowercase hex digits".into());
            }
            (repo, digest.to_owned())
        } else {
            match path.rsplit_once(':') {
                Some((repo, tag)) if !tag.contains('/') => {
                    if !is_tag(tag) {
                        return Err(
                            "a tag is 1 to 128 of letters, digits, '_', '.' and '-', not starting with '.' or '-'"
                                .into(),
                        );
                    }
                    (repo, tag.to_owned())
                }
                _ => (path, "latest".to_owned()),
            }
        };
        if !is_repository(repository) {
            return Err(
                "a repository is lowercase path components of letters, digits and separators ('.', '_', '-')"
                    .into(),
            );
        }
        let mut repository = repository.to_owned();
        // Docker Hub's references name a host that does not serve the API, and its
        // official images live under `library/`.
        let registry = if registry == "docker.io" {
            if !repository.contains('/') {
                repository = format!("library/{repository}");
            }
            "registry-1.docker.io".to_owned()
        } else {
            registry.to_owned()
        };
        Ok(Self {
            registry,
            repository,
            reference,
        })
    }

    /// Parses an image name as Kubernetes writes it: `nginx`, `acme/app:v1`,
    /// `127.0.0.1:5000/hello:v1`, `registry.example/ns/app@sha256:HEX`. A first path
    /// component that is no host (no `.` or `:`, not `localhost`) means Docker Hub; a
    /// tag beside a digest is dropped, as the digest names the content.
    pub fn parse_image(name: &str) -> Result<Self, String> {
        if name.contains("://") {
            return Err("an image name has no scheme".into());
        }
        let has_registry = name.split_once('/').is_some_and(|(first, _)| {
            first.contains('.') || first.contains(':') || first == "localhost"
        });
        let mut full = if has_registry {
            name.to_owned()
        } else {
            format!("docker.io/{name}")
        };
        if let Some((named, digest)) = full.split_once('@')
            && let Some((repository, tag)) = named.rsplit_once(':')
            && !tag.contains('/')
        {
            full = format!("{repository}@{digest}");
        }
        Self::parse(&full)
    }

    /// The repository's name as written in a reference: `HOST[:PORT]/REPOSITORY`.
    pub fn repository_name(&self) -> String {
        format!("{}/{}", self.registry, self.repository)
    }

    /// The API's base URL for this repository: HTTPS, or HTTP for a loopback registry.
    pub(crate) fn base(&self) -> String {
        let host = self
            .registry
            .parse::<hyper::http::uri::Authority>()
            .map(|a| a.host().to_owned())
            .unwrap_or_default();
        let scheme = if is_loopback(&host) { "http" } else { "https" };
        format!("{scheme}://{}/v2/{}", self.registry, self.repository)
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sep = if self.reference.starts_with("sha256:") {
            '@'
        } else {
            ':'
        };
        write!(
            f,
            "{}/{}{sep}{}",
            self.registry, self.repository, self.reference
        )
    }
}

fn is_tag(tag: &str) -> bool {
    let bytes = tag.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 128
        && bytes[0] != b'.'
        && bytes[0] != b'-'
        && bytes
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// The distribution spec's repository grammar: components of `[a-z0-9]` runs joined
/// by `.`, `_`, `__` or dashes, separated by `/`.
fn is_repository(repo: &str) -> bool {
    !repo.is_empty()
        && repo.len() <= 255
        && repo.split('/').all(|component| {
            let b = component.as_bytes();
            !b.is_empty()
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|&c| matches!(c, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-'))
                && !component.contains("..")
                && !component.contains("___")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(name: &str) -> Reference {
        Reference::parse(name).unwrap()
    }

    #[test]
    fn references_with_tags_digests_and_ports_parse() {
        assert_eq!(
            parse("ghcr.io/acme/policies/pod-policy:v1.2"),
            Reference {
                registry: "ghcr.io".into(),
                repository: "acme/policies/pod-policy".into(),
                reference: "v1.2".into(),
            }
        );
        let hex = "a".repeat(64);
        let r = parse(&format!("127.0.0.1:5000/p@sha256:{hex}"));
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.reference, format!("sha256:{hex}"));
        assert_eq!(r.base(), "http://127.0.0.1:5000/v2/p");
        assert_eq!(r.to_string(), format!("127.0.0.1:5000/p@sha256:{hex}"));
        assert_eq!(parse("localhost:5000/a/b").reference, "latest");
        assert_eq!(parse("ghcr.io/a/b:1").base(), "https://ghcr.io/v2/a/b");
        let hub = parse("docker.io/nginx:1");
        assert_eq!(hub.base(), "https://registry-1.docker.io/v2/library/nginx");
    }

    #[test]
    fn bad_references_say_what_is_wrong() {
        for (name, why) in [
            ("ghcr.io", "HOST[:PORT]/REPOSITORY"),
            ("ghcr.io/Acme/p:1", "lowercase"),
            ("ghcr.io/a//p:1", "lowercase"),
            ("ghcr.io/a/p:-x", "a tag is"),
            ("ghcr.io/a/p@md5:00", "sha256:HEX"),
            ("ghcr.io/a/p@sha256:ABC", "64 lowercase hex"),
            ("/a/p:1", "HOST[:PORT]"),
            ("user@ghcr.io/a/p:1", "HOST[:PORT]"),
        ] {
            let err = Reference::parse(name).unwrap_err();
            assert!(err.contains(why), "{name}: {err}");
        }
    }

    #[test]
    fn image_names_default_to_docker_hub() {
        let image = |name| Reference::parse_image(name).unwrap();
        assert_eq!(
            image("nginx").to_string(),
            "registry-1.docker.io/library/nginx:latest"
        );
        assert_eq!(
            image("acme/app:v1").to_string(),
            "registry-1.docker.io/acme/app:v1"
        );
        assert_eq!(
            image("127.0.0.1:5000/hello:v1").to_string(),
            "127.0.0.1:5000/hello:v1"
        );
        assert_eq!(
            image("localhost/hello").to_string(),
            "localhost/hello:latest"
        );
        let hex = "0".repeat(64);
        let pinned = image(&format!("registry.example/ns/app:v2@sha256:{hex}"));
        assert_eq!(pinned.reference, format!("sha256:{hex}"));
        assert_eq!(pinned.repository_name(), "registry.example/ns/app");
        assert!(Reference::parse_image("file:///bin/sh").is_err());
    }
}
