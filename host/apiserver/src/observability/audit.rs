//! The audit log: one JSON line per request (time, user, verb, resource, namespace,
//! name, code, latency) in `DATA_DIR/audit.log`, rotated to `audit.log.1` … when it
//! grows past a size. Lines are written by a background task so that requests never
//! wait for the disk; if the queue is full, the line is counted as dropped.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};
use tokio::sync::mpsc;
use tracing::warn;

/// One request, as the audit log records it.
#[derive(Debug)]
pub struct Entry {
    /// Who sent the request.
    pub user: String,
    /// Who it acted as, when it impersonated someone (`kubectl --as`).
    pub impersonated_user: Option<String>,
    pub verb: String,
    pub resource: String,
    pub namespace: String,
    pub name: String,
    pub code: u16,
    pub latency_ms: f64,
    /// What admission said of the request (`pod-security.kubernetes.io/enforce-policy`,
    /// `…/audit-violations`), as Kubernetes' audit event `annotations`.
    pub annotations: std::collections::BTreeMap<String, String>,
}

/// The name of the object a request wrote, when its URL does not say (a create), as a
/// response extension for the audit log.
#[derive(Clone, Debug)]
pub struct ObjectName(pub String);

#[derive(Debug)]
pub struct AuditLog {
    tx: mpsc::Sender<Entry>,
    dropped: AtomicU64,
}

/// Settings of the audit log.
#[derive(Clone, Debug)]
pub struct AuditConfig {
    pub path: PathBuf,
    /// Rotate when the file reaches this size.
    pub max_bytes: u64,
    /// Rotated files kept.
    pub max_files: usize,
}

impl AuditLog {
    /// Starts the writer task.
    pub fn start(config: AuditConfig) -> Self {
        let (tx, mut rx) = mpsc::channel::<Entry>(4096);
        tokio::task::spawn_blocking(move || {
            let mut writer = Writer::new(config);
            while let Some(entry) = rx.blocking_recv() {
                let mut batch = vec![entry];
                while let Ok(more) = rx.try_recv() {
                    batch.push(more);
                }
                if let Err(e) = writer.write(&batch) {
                    warn!(error = %e, "writing the audit log failed");
                }
            }
        });
        Self {
            tx,
            dropped: AtomicU64::new(0),
        }
    }

    pub fn record(&self, entry: Entry) {
        if self.tx.try_send(entry).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

struct Writer {
    config: AuditConfig,
    file: Option<std::fs::File>,
    size: u64,
}

impl Writer {
    fn new(config: AuditConfig) -> Self {
        Self {
            config,
            file: None,
            size: 0,
        }
    }

    fn open(&mut self) -> std::io::Result<&mut std::fs::File> {
        if self.file.is_none() {
            let mut options = std::fs::OpenOptions::new();
            options.create(true).append(true);
            // The log names users and objects: its owner's alone.
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
            let file = options.open(&self.config.path)?;
            self.size = file.metadata()?.len();
            self.file = Some(file);
        }
        self.file
            .as_mut()
            .ok_or_else(|| std::io::Error::other("audit log not open"))
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        self.file = None;
        let name = |i: usize| -> PathBuf { rotated(&self.config.path, i) };
        for i in (1..self.config.max_files).rev() {
            if name(i).exists() {
                std::fs::rename(name(i), name(i + 1))?;
            }
        }
        if self.config.max_files > 0 {
            std::fs::rename(&self.config.path, name(1))?;
        } else {
            std::fs::remove_file(&self.config.path)?;
        }
        Ok(())
    }

    fn write(&mut self, batch: &[Entry]) -> std::io::Result<()> {
        let mut text = Vec::new();
        let now = crate::object::now_timestamp();
        for e in batch {
            let mut line: Value = json!({
                "time": now, "user": e.user, "verb": e.verb, "resource": e.resource,
                "namespace": e.namespace, "name": e.name, "code": e.code, "latencyMs": e.latency_ms,
            });
            if let Some(as_user) = &e.impersonated_user {
                line["impersonatedUser"] = as_user.clone().into();
            }
            if !e.annotations.is_empty() {
                line["annotations"] = json!(e.annotations);
            }
            serde_json::to_writer(&mut text, &line)?;
            text.push(b'\n');
        }
        let file = self.open()?;
        file.write_all(&text)?;
        self.size += text.len() as u64;
        if self.size >= self.config.max_bytes {
            self.rotate()?;
        }
        Ok(())
    }
}

fn rotated(path: &Path, i: usize) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{i}"));
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: usize) -> Entry {
        Entry {
            user: "admin".into(),
            impersonated_user: None,
            verb: "get".into(),
            resource: "pods".into(),
            namespace: "default".into(),
            name: format!("p{i}"),
            code: 200,
            latency_ms: 0.5,
            annotations: Default::default(),
        }
    }

    #[test]
    fn writes_json_lines_and_rotates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let mut w = Writer::new(AuditConfig {
            path: path.clone(),
            max_bytes: 600,
            max_files: 2,
        });
        for i in 0..20 {
            w.write(&[entry(i)]).unwrap();
        }
        assert!(rotated(&path, 1).exists() && rotated(&path, 2).exists());
        assert!(
            !rotated(&path, 3).exists(),
            "only two rotated files are kept"
        );
        let text = std::fs::read_to_string(rotated(&path, 1)).unwrap();
        let first: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(first["user"], "admin");
        assert_eq!(first["verb"], "get");
        assert_eq!(first["code"], 200);
    }
}
