//! The image store. An image is a WebAssembly component (copied under the store, for
//! the `wasmtime` handler) pulled from a `file://` URL or an OCI registry, or an
//! executable (recorded by path, for the `process` handler) pulled from a `file://`
//! URL. Its id is the `sha256:` digest of its bytes; `index.json` lists the images so a
//! restarted runtime keeps them.
//!
//! A registry image is named as Kubernetes writes it (`127.0.0.1:5000/hello:v1`,
//! `registry.example/ns/app@sha256:HEX`, `nginx` for Docker Hub) and is a WebAssembly
//! artifact as `wkg` and `oras` push it (see [`trellis_oci`]); the pull's credentials
//! are `PullImageRequest.auth`. Its repo digest (`REPOSITORY@sha256:<manifest digest>`)
//! is what the pull returns as the image's ref, and names it from then on, as its tag
//! and id do.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use k8s_cri::v1::{AuthConfig, FilesystemIdentifier, FilesystemUsage, UInt64Value};
use tonic::Status;

use crate::record::{ImageKind, ImageRecord, now_ns};

/// The largest layer pulled from a registry (components are a few MiB at most).
const MAX_LAYER: usize = 256 << 20;

/// The component encoding's preamble: the magic, then version 0x0d and layer 1.
const COMPONENT_PREAMBLE: [u8; 8] = [0, b'a', b's', b'm', 0x0d, 0x00, 0x01, 0x00];
const WASM_MAGIC: [u8; 4] = [0, b'a', b's', b'm'];

/// Where a runtime's images come from and are kept.
#[tonic::async_trait]
pub(crate) trait ImageStore: Send + Sync {
    /// The image `name` names: a reference it was pulled by, or its id.
    fn get(&self, name: &str) -> Option<ImageRecord>;
    /// Every image it holds.
    fn list(&self) -> Vec<ImageRecord>;
    /// Pulls the image `reference` names, with the pull request's credentials;
    /// returns its ref.
    async fn pull(
        self: Arc<Self>,
        reference: String,
        auth: Option<AuthConfig>,
    ) -> Result<String, Status>;
    /// Removes the image `name` names; nothing to do when there is none.
    fn remove(&self, name: &str) -> Result<(), Status>;
    /// What `ImageFsInfo` reports.
    fn filesystems(&self) -> Vec<FilesystemUsage>;
}

#[tonic::async_trait]
impl ImageStore for Images {
    fn get(&self, name: &str) -> Option<ImageRecord> {
        Images::get(self, name)
    }

    fn list(&self) -> Vec<ImageRecord> {
        Images::list(self)
    }

    async fn pull(
        self: Arc<Self>,
        reference: String,
        auth: Option<AuthConfig>,
    ) -> Result<String, Status> {
        if reference.starts_with("file://") {
            tokio::task::spawn_blocking(move || self.pull_file(&reference))
                .await
                .map_err(|e| Status::internal(format!("the pull failed: {e}")))?
        } else {
            self.pull_oci(&reference, auth).await
        }
    }

    fn remove(&self, name: &str) -> Result<(), Status> {
        Images::remove(self, name)
    }

    fn filesystems(&self) -> Vec<FilesystemUsage> {
        let (bytes, files) = self.usage();
        vec![FilesystemUsage {
            timestamp: now_ns(),
            fs_id: Some(FilesystemIdentifier {
                mountpoint: self.dir.display().to_string(),
            }),
            used_bytes: Some(UInt64Value { value: bytes }),
            inodes_used: Some(UInt64Value { value: files }),
        }]
    }
}

#[derive(Debug)]
pub(crate) struct Images {
    dir: PathBuf,
    index: Mutex<Vec<ImageRecord>>,
}

impl Images {
    pub(crate) fn open(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("create the image store {}", dir.display()))?;
        let index_path = dir.join("index.json");
        let index = match std::fs::read(&index_path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .with_context(|| format!("read the image index {}", index_path.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("read the image index {}", index_path.display()));
            }
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            index: Mutex::new(index),
        })
    }

    /// Pulls the image at the `file://` URL `reference`; returns its id. Blocking.
    pub(crate) fn pull_file(&self, reference: &str) -> Result<String, Status> {
        let Some(path) = reference.strip_prefix("file://") else {
            return Err(Status::invalid_argument(format!(
                "cannot pull {reference:?}: not a file:// URL"
            )));
        };
        let path = Path::new(path);
        if !path.is_absolute() {
            return Err(Status::invalid_argument(format!(
                "cannot pull {reference:?}: a file:// image needs an absolute path"
            )));
        }
        let bytes = std::fs::read(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                Status::not_found(format!("image file {} does not exist", path.display()))
            }
            _ => Status::internal(format!("cannot read image file {}: {e}", path.display())),
        })?;
        let id = trellis_plugin_host::digest_of(&bytes);
        let (kind, stored) = if bytes.starts_with(&WASM_MAGIC) {
            let what = format!("image file {}", path.display());
            (ImageKind::Wasm, self.store_component(&what, &id, &bytes)?)
        } else if is_executable(path) {
            (ImageKind::Process, path.to_path_buf())
        } else {
            return Err(Status::invalid_argument(format!(
                "image file {} is neither a WebAssembly component nor an executable file",
                path.display()
            )));
        };
        let image = ImageRecord {
            id: id.clone(),
            tags: vec![reference.to_string()],
            digests: Vec::new(),
            kind,
            path: stored,
            size: bytes.len() as u64,
        };
        self.add(image)?;
        Ok(id)
    }

    /// Pulls the image `name` (as Kubernetes writes it) from its registry, showing
    /// `auth` if given; returns its repo digest, `REPOSITORY@sha256:<manifest digest>`.
    pub(crate) async fn pull_oci(
        &self,
        name: &str,
        auth: Option<AuthConfig>,
    ) -> Result<String, Status> {
        let reference = trellis_oci::Reference::parse_image(name).map_err(|why| {
            Status::invalid_argument(format!(
                "cannot pull {name:?}: {why} (images are file:// URLs or OCI references such as registry.example/app:v1)"
            ))
        })?;
        let credentials = credentials(auth)
            .map_err(|why| Status::invalid_argument(format!("cannot pull {name:?}: {why}")))?;
        let unavailable = |why: String| Status::unavailable(format!("cannot pull {name:?}: {why}"));
        let mut client = trellis_oci::Client::new(&reference).with_credentials(credentials);
        let layer = client.resolve().await.map_err(unavailable)?;
        let id = format!("sha256:{}", layer.hex);
        let repo_digest = format!("{}@{}", repo_name(&reference), layer.manifest);
        let (path, size) = match self.get(&id) {
            // The same component under another name: no download.
            Some(image) => (image.path, image.size),
            None => {
                let bytes = client.blob(&layer, MAX_LAYER).await.map_err(unavailable)?;
                let what = format!("image {name}");
                (
                    self.store_component(&what, &id, &bytes)?,
                    bytes.len() as u64,
                )
            }
        };
        let pinned = reference.reference.starts_with("sha256:");
        self.add(ImageRecord {
            id,
            tags: if pinned {
                Vec::new()
            } else {
                vec![name.to_string()]
            },
            digests: vec![repo_digest.clone()],
            kind: ImageKind::Wasm,
            path,
            size,
        })?;
        Ok(repo_digest)
    }

    /// Keeps a component's bytes under the store (once per digest `id`).
    fn store_component(&self, what: &str, id: &str, bytes: &[u8]) -> Result<PathBuf, Status> {
        if !bytes.starts_with(&COMPONENT_PREAMBLE) {
            return Err(Status::invalid_argument(format!(
                "{what} is WebAssembly but not a WebAssembly component (a core module?)"
            )));
        }
        let stored = self
            .dir
            .join(format!("{}.wasm", id.trim_start_matches("sha256:")));
        if !stored.exists() {
            trellis_oci::write_whole(&stored, bytes).map_err(|e| {
                Status::internal(format!("cannot store image {}: {e}", stored.display()))
            })?;
        }
        Ok(stored)
    }

    /// Records `image`: its names move to it from any image that had them (pulling a
    /// tag again may move it to new content); an image of the same id gains them.
    fn add(&self, image: ImageRecord) -> Result<(), Status> {
        let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        for other in index.iter_mut() {
            other.tags.retain(|t| !image.tags.contains(t));
            other.digests.retain(|d| !image.digests.contains(d));
        }
        match index.iter_mut().find(|i| i.id == image.id) {
            Some(existing) => {
                existing.tags.extend(image.tags);
                existing.digests.extend(image.digests);
            }
            None => index.push(image),
        }
        self.save(&index)
    }

    /// The image `name` names: a reference it was pulled by, or its id.
    pub(crate) fn get(&self, name: &str) -> Option<ImageRecord> {
        let index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        index.iter().find(|i| matches(i, name)).cloned()
    }

    pub(crate) fn list(&self) -> Vec<ImageRecord> {
        self.index.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Removes the image `name` names; nothing to do when there is none.
    pub(crate) fn remove(&self, name: &str) -> Result<(), Status> {
        let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        let Some(at) = index.iter().position(|i| matches(i, name)) else {
            return Ok(());
        };
        let image = index.remove(at);
        self.save(&index)?;
        if image.kind == ImageKind::Wasm
            && let Err(e) = std::fs::remove_file(&image.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %image.path.display(), error = %e, "cannot delete an image file");
        }
        Ok(())
    }

    /// Bytes and files the store holds (components; executables stay where they are).
    pub(crate) fn usage(&self) -> (u64, u64) {
        let index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        index
            .iter()
            .filter(|i| i.kind == ImageKind::Wasm)
            .fold((0, 0), |(bytes, files), i| (bytes + i.size, files + 1))
    }

    fn save(&self, index: &[ImageRecord]) -> Result<(), Status> {
        let path = self.dir.join("index.json");
        let bytes = serde_json::to_vec_pretty(index)
            .map_err(|e| Status::internal(format!("cannot encode the image index: {e}")))?;
        trellis_oci::write_whole(&path, &bytes).map_err(|e| {
            Status::internal(format!(
                "cannot write the image index {}: {e}",
                path.display()
            ))
        })
    }
}

fn matches(image: &ImageRecord, name: &str) -> bool {
    image.id == name
        || image.tags.iter().any(|t| t == name)
        || image.digests.iter().any(|d| d == name)
        || image.id.strip_prefix("sha256:") == Some(name)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The repository a repo digest names (`127.0.0.1:5000/hello`); Docker Hub's images
/// as Kubernetes names them (`docker.io/library/nginx`), not by its API's host.
fn repo_name(reference: &trellis_oci::Reference) -> String {
    if reference.registry == "registry-1.docker.io" {
        return format!("docker.io/{}", reference.repository);
    }
    reference.repository_name()
}

/// The credentials `auth` (from the pod's imagePullSecrets) gives: a registry token,
/// a user name and password, or `auth` (base64 of `user:password`).
fn credentials(auth: Option<AuthConfig>) -> Result<Option<trellis_oci::Credentials>, String> {
    use base64::Engine as _;
    let Some(auth) = auth else { return Ok(None) };
    if !auth.registry_token.is_empty() {
        return Ok(Some(trellis_oci::Credentials::Bearer(auth.registry_token)));
    }
    if !auth.username.is_empty() {
        return Ok(Some(trellis_oci::Credentials::Basic {
            username: auth.username,
            password: auth.password,
        }));
    }
    if !auth.auth.is_empty() {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(auth.auth.trim())
            .ok()
            .and_then(|d| String::from_utf8(d).ok())
            .ok_or("the auth is not base64 of user:password")?;
        let (username, password) = decoded
            .split_once(':')
            .ok_or("the auth is not base64 of user:password")?;
        return Ok(Some(trellis_oci::Credentials::Basic {
            username: username.to_string(),
            password: password.to_string(),
        }));
    }
    if !auth.identity_token.is_empty() {
        return Err("identity tokens (OAuth refresh tokens) are not supported; give a registry token or a password".into());
    }
    Ok(None)
}
