//! The image store. An image is a file pulled from a `file://` URL: a WebAssembly
//! component (copied under the store, for the `wasmtime` handler) or an executable
//! (recorded by path, for the `process` handler). Its id is the `sha256:` digest of
//! its bytes; `index.json` lists the images so a restarted runtime keeps them.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use tonic::Status;

/// The component encoding's preamble: the magic, then version 0x0d and layer 1.
const COMPONENT_PREAMBLE: [u8; 8] = [0, b'a', b's', b'm', 0x0d, 0x00, 0x01, 0x00];
const WASM_MAGIC: [u8; 4] = [0, b'a', b's', b'm'];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ImageKind {
    Wasm,
    Process,
}

impl ImageKind {
    /// The runtime handler that runs images of this kind.
    pub(crate) fn handler(self) -> &'static str {
        match self {
            ImageKind::Wasm => crate::WASMTIME,
            ImageKind::Process => crate::PROCESS,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct ImageRecord {
    /// `sha256:<hex>` of the file's bytes.
    pub id: String,
    /// The references it was pulled by.
    pub tags: Vec<String>,
    pub kind: ImageKind,
    /// The component's copy in the store, or the executable's own path.
    pub path: PathBuf,
    pub size: u64,
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

    /// Pulls the image `reference` names; returns its id.
    pub(crate) fn pull(&self, reference: &str) -> Result<String, Status> {
        let Some(path) = reference.strip_prefix("file://") else {
            return Err(Status::invalid_argument(format!(
                "cannot pull {reference:?}: only file:// images are supported by this runtime for now"
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
            if !bytes.starts_with(&COMPONENT_PREAMBLE) {
                return Err(Status::invalid_argument(format!(
                    "image file {} is WebAssembly but not a WebAssembly component (a core module?)",
                    path.display()
                )));
            }
            let stored = self
                .dir
                .join(format!("{}.wasm", id.trim_start_matches("sha256:")));
            if !stored.exists() {
                crate::state::write_whole(&stored, &bytes).map_err(|e| {
                    Status::internal(format!("cannot store image {}: {e}", stored.display()))
                })?;
            }
            (ImageKind::Wasm, stored)
        } else if is_executable(path) {
            (ImageKind::Process, path.to_path_buf())
        } else {
            return Err(Status::invalid_argument(format!(
                "image file {} is neither a WebAssembly component nor an executable file",
                path.display()
            )));
        };
        let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        // A reference names one image: pulling it again may move it to new content.
        for image in index.iter_mut() {
            image.tags.retain(|t| t != reference);
        }
        match index.iter_mut().find(|i| i.id == id) {
            Some(image) => image.tags.push(reference.to_string()),
            None => index.push(ImageRecord {
                id: id.clone(),
                tags: vec![reference.to_string()],
                kind,
                path: stored,
                size: bytes.len() as u64,
            }),
        }
        self.save(&index)?;
        Ok(id)
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

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    fn save(&self, index: &[ImageRecord]) -> Result<(), Status> {
        let path = self.dir.join("index.json");
        let bytes = serde_json::to_vec_pretty(index)
            .map_err(|e| Status::internal(format!("cannot encode the image index: {e}")))?;
        crate::state::write_whole(&path, &bytes).map_err(|e| {
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
        || image.id.strip_prefix("sha256:") == Some(name)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
