//! The plugins directory: `NAME.yaml` (a Plugin object, or just its spec) beside
//! `NAME.wasm`. Polled, so adding, changing or removing files needs no restart and
//! works on every filesystem.

use std::path::{Path, PathBuf};

use serde_json::Value;

#[derive(Debug)]
pub struct Entry {
    pub name: String,
    pub spec_path: PathBuf,
    /// Modification times and sizes of both files.
    pub fingerprint: String,
}

/// The declarations in `dir` (a YAML file without its module is skipped until the
/// module appears).
pub async fn scan(dir: &Path) -> Vec<Entry> {
    let mut out = Vec::new();
    let Ok(mut entries) = tokio::fs::read_dir(dir).await else {
        return out;
    };
    while let Ok(Some(entry)) = entries.next_entry().await {
        let path = entry.path();
        let is_yaml = matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        );
        let Some(name) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if !is_yaml || name.starts_with('.') {
            continue;
        }
        let module = dir.join(format!("{name}.wasm"));
        let (Some(a), Some(b)) = (stamp(&path).await, stamp(&module).await) else {
            continue;
        };
        out.push(Entry {
            name: name.to_owned(),
            spec_path: path,
            fingerprint: format!("{a}|{b}"),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

async fn stamp(path: &Path) -> Option<String> {
    let meta = tokio::fs::metadata(path).await.ok()?;
    let modified = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    Some(format!("{modified}:{}", meta.len()))
}

/// The spec in a declaration file: a whole Plugin object's `spec`, or the file itself.
pub async fn read_spec(entry: &Entry) -> Result<Value, String> {
    let text = tokio::fs::read_to_string(&entry.spec_path)
        .await
        .map_err(|e| format!("reading {}: {e}", entry.spec_path.display()))?;
    let doc: Value =
        serde_saphyr::from_str(&text).map_err(|e| format!("{}: {e}", entry.spec_path.display()))?;
    Ok(match doc.get("spec") {
        Some(spec) if doc.get("kind").and_then(Value::as_str) == Some("Plugin") => spec.clone(),
        _ => doc,
    })
}
