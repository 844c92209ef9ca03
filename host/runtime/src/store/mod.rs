//! Where the runtime's records persist. Sandbox and container records are kept by a
//! [`Store`]: [`Files`], each record a JSON file under the root
//! (`sandboxes/<id>.json`, `containers/<id>.json`, written whole under a temporary
//! name and renamed) so a restarted runtime finds them; or [`Memory`], nowhere, for
//! hollow nodes, whose records die with them and must cost no file. Images are kept
//! by an [`ImageStore`] (`image`), which also pulls them.

mod image;

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use crate::record::{ContainerRecord, SandboxRecord};

pub(crate) use image::{ImageStore, Images};

/// Keeps the records the tables hold in memory.
pub(crate) trait Store: Send + Sync + std::fmt::Debug {
    /// The records a previous run left.
    fn load(&self) -> anyhow::Result<(Vec<SandboxRecord>, Vec<ContainerRecord>)>;
    fn save_container(&self, record: &ContainerRecord);
    fn save_sandbox(&self, record: &SandboxRecord);
    /// Deletes the container's record and its directory.
    fn delete_container(&self, id: &str);
    fn delete_sandbox(&self, id: &str);
    /// A container's own directory (a process's output pipes); none without files.
    fn container_dir(&self, id: &str) -> Option<PathBuf>;
    /// The root the records are kept under; none without files.
    fn root(&self) -> Option<&Path>;
}

/// Records in JSON files under a root.
#[derive(Debug)]
pub(crate) struct Files {
    pub root: PathBuf,
}

impl Store for Files {
    fn load(&self) -> anyhow::Result<(Vec<SandboxRecord>, Vec<ContainerRecord>)> {
        Ok((
            load(&self.root.join("sandboxes"))?,
            load(&self.root.join("containers"))?,
        ))
    }

    fn save_container(&self, record: &ContainerRecord) {
        let path = self
            .root
            .join("containers")
            .join(format!("{}.json", record.id));
        save(&path, record);
    }

    fn save_sandbox(&self, record: &SandboxRecord) {
        let path = self
            .root
            .join("sandboxes")
            .join(format!("{}.json", record.id));
        save(&path, record);
    }

    fn delete_container(&self, id: &str) {
        let containers = self.root.join("containers");
        remove(&containers.join(format!("{id}.json")));
        if let Err(e) = std::fs::remove_dir_all(containers.join(id))
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(container = %id, error = %e, "cannot delete a container's directory");
        }
    }

    fn delete_sandbox(&self, id: &str) {
        remove(&self.root.join("sandboxes").join(format!("{id}.json")));
    }

    fn container_dir(&self, id: &str) -> Option<PathBuf> {
        Some(self.root.join("containers").join(id))
    }

    fn root(&self) -> Option<&Path> {
        Some(&self.root)
    }
}

/// Records in the tables only.
#[derive(Debug)]
pub(crate) struct Memory;

impl Store for Memory {
    fn load(&self) -> anyhow::Result<(Vec<SandboxRecord>, Vec<ContainerRecord>)> {
        Ok((Vec::new(), Vec::new()))
    }
    fn save_container(&self, _: &ContainerRecord) {}
    fn save_sandbox(&self, _: &SandboxRecord) {}
    fn delete_container(&self, _: &str) {}
    fn delete_sandbox(&self, _: &str) {}
    fn container_dir(&self, _: &str) -> Option<PathBuf> {
        None
    }
    fn root(&self) -> Option<&Path> {
        None
    }
}

fn load<T: for<'de> Deserialize<'de>>(dir: &Path) -> anyhow::Result<Vec<T>> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let mut records = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("list {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let bytes = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
        match serde_json::from_slice(&bytes) {
            Ok(record) => records.push(record),
            // One unreadable record must not keep the node's runtime down.
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "skipping a bad record"),
        }
    }
    Ok(records)
}

fn save<T: Serialize>(path: &Path, record: &T) {
    let written = serde_json::to_vec_pretty(record)
        .map_err(std::io::Error::other)
        .and_then(|bytes| trellis_oci::write_whole(path, &bytes));
    if let Err(e) = written {
        tracing::warn!(path = %path.display(), error = %e, "cannot save a record");
    }
}

fn remove(path: &Path) {
    if let Err(e) = std::fs::remove_file(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), error = %e, "cannot delete a record");
    }
}
