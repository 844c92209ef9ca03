//! An image's record: its id (the `sha256:` digest of its bytes), the names it was
//! pulled by, and its kind, which tells the handler that runs it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ImageKind {
    Wasm,
    Process,
    /// A hollow node's: every image, with nothing in it to run.
    Hollow,
}

impl ImageKind {
    /// The runtime handler that runs images of this kind.
    pub(crate) fn handler(self) -> &'static str {
        match self {
            ImageKind::Wasm => crate::WASMTIME,
            ImageKind::Process => crate::PROCESS,
            ImageKind::Hollow => crate::HOLLOW,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct ImageRecord {
    /// `sha256:<hex>` of the file's bytes.
    pub id: String,
    /// The references it was pulled by (a registry image's tags; `file://` URLs).
    pub tags: Vec<String>,
    /// A registry image's `REPOSITORY@sha256:<manifest digest>`s.
    #[serde(default)]
    pub digests: Vec<String>,
    pub kind: ImageKind,
    /// The component's copy in the store, or the executable's own path.
    pub path: PathBuf,
    pub size: u64,
}
