//! Fetching a plugin's module: `file://` paths, `https://` URLs whose content must
//! match `spec.module.sha256`, and `oci://` artifacts pulled from a registry (see
//! [`crate::oci`]). Fetched modules are kept by digest in the process's plugin cache, so
//! a restart does not need the network when the digest is pinned.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use trellis_plugin_host::digest_of;

use crate::http;
use crate::oci;
use crate::spec::ModuleDoc;

/// Largest module accepted (a Python component is ~20 MB).
const MAX_MODULE: usize = 128 << 20;

/// Reads the module `doc` names; `base` resolves relative `file:` paths.
pub async fn fetch(doc: &ModuleDoc, cache: &Path, base: Option<&Path>) -> Result<Vec<u8>, String> {
    let expected = doc
        .sha256
        .as_deref()
        .map(|d| d.trim_start_matches("sha256:").to_ascii_lowercase());
    if let Some(hex) = &expected
        && (hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()))
    {
        return Err(format!(
            "spec.module.sha256: Invalid value: {hex:?}: must be 64 hex digits"
        ));
    }
    let bytes = if let Some(path) = doc.url.strip_prefix("file://") {
        let path = match base {
            Some(base) if !path.starts_with('/') => base.join(path),
            _ => PathBuf::from(path),
        };
        tokio::fs::read(&path)
            .await
            .map_err(|e| format!("reading {}: {e}", path.display()))?
    } else if doc.url.starts_with("https://") {
        let Some(hex) = &expected else {
            return Err(
                "spec.module.sha256: Required value: an https:// module needs its digest".into(),
            );
        };
        if let Some(bytes) = cached(cache, hex).await {
            return Ok(bytes);
        }
        let bytes = https_get(&doc.url).await?;
        check_digest(&bytes, Some(hex))?;
        keep(cache, hex, &bytes).await;
        bytes
    } else if doc.url.starts_with("oci://") {
        return pull(&doc.url, expected.as_deref(), cache).await;
    } else {
        return Err(format!(
            "spec.module.url: Unsupported value: {:?}: supported schemes: \"file://\", \"https://\", \"oci://\"",
            doc.url
        ));
    };
    check_digest(&bytes, expected.as_deref())?;
    Ok(bytes)
}

fn check_digest(bytes: &[u8], expected: Option<&str>) -> Result<(), String> {
    let actual = digest_of(bytes);
    match expected {
        Some(hex) if !actual.ends_with(hex) => Err(format!(
            "the module's digest is {actual}, not the sha256:{hex} spec.module.sha256 asks for"
        )),
        _ => Ok(()),
    }
}

/// Pulls an `oci://` artifact's WebAssembly layer; `expected` (spec.module.sha256)
/// must name that layer when given.
async fn pull(url: &str, expected: Option<&str>, cache: &Path) -> Result<Vec<u8>, String> {
    let reference = oci::Reference::parse(url)?;
    if let Some(hex) = expected
        && let Some(bytes) = cached(cache, hex).await
    {
        return Ok(bytes);
    }
    let mut client = oci::Client::new(&reference);
    let layer = client.resolve().await?;
    if let Some(hex) = expected
        && hex != layer.hex
    {
        return Err(format!(
            "{url}: the artifact's module is sha256:{}, not the sha256:{hex} spec.module.sha256 asks for",
            layer.hex
        ));
    }
    if let Some(bytes) = cached(cache, &layer.hex).await {
        return Ok(bytes);
    }
    let bytes = client.blob(&layer, MAX_MODULE).await?;
    keep(cache, &layer.hex, &bytes).await;
    Ok(bytes)
}

/// A module fetched before, if the cache has it intact.
async fn cached(cache: &Path, hex: &str) -> Option<Vec<u8>> {
    let bytes = tokio::fs::read(cache.join(format!("{hex}.wasm")))
        .await
        .ok()?;
    digest_of(&bytes).ends_with(hex).then_some(bytes)
}

/// Keeps a fetched module by digest; a failure only costs a fetch next time.
async fn keep(cache: &Path, hex: &str, bytes: &[u8]) {
    // Plugins load concurrently, and two of one module may fetch it at once: each
    // writes a file of its own, and the renames replace whole files.
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let path = cache.join(format!("{hex}.wasm"));
    let tmp = path.with_extension(format!(
        "tmp{}-{}",
        std::process::id(),
        WRITES.fetch_add(1, Ordering::Relaxed)
    ));
    if tokio::fs::write(&tmp, bytes).await.is_ok() {
        let _ = tokio::fs::rename(&tmp, &path).await;
    }
}

/// One GET over HTTPS; redirects are not followed (the digest pins the content, not
/// the address).
async fn https_get(url: &str) -> Result<Vec<u8>, String> {
    let response = http::get(url, &[], MAX_MODULE).await?;
    if !response.status.is_success() {
        return Err(format!("{url}: HTTP {}", response.status));
    }
    Ok(response.body.to_vec())
}
