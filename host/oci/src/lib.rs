//! Pulling WebAssembly components from OCI registries, for the API server's `oci://`
//! plugin modules and the container runtime's images alike.
//!
//! An artifact is what `wkg`, `oras` and Kubewarden push: an OCI image manifest whose
//! single layer is the component (`application/wasm`, or the older
//! `application/vnd.wasm.content.layer.v1+wasm`), possibly behind an image index.
//! Start with [`Reference::parse`] (or [`Reference::parse_image`] for a name as
//! Kubernetes writes it) and [`Client`]: [`Client::resolve`] reads the manifest,
//! [`Client::blob`] downloads and checks the layer.
//!
//! Registries are spoken to over HTTPS, or plain HTTP when the host is a loopback
//! address. Pulls are anonymous unless [`Credentials`] are given; a registry that
//! answers 401 with a `Bearer` challenge gets asked for a token (with the credentials,
//! if any), as public registries (ghcr.io, Docker Hub) require. Every byte is checked:
//! a manifest named by digest against that digest, the layer against its descriptor.
//!
//! # Layout
//! - `reference`: [`Reference`]: registry, repository, tag or digest, and the
//!   defaults of Kubernetes image names.
//! - `client`: [`Client`]: one repository's session: manifests, indexes, tokens,
//!   blobs and redirects.
//! - [`http`]: one HTTP/1.1 GET at a time, HTTPS verified against the system's roots.

mod client;
pub mod http;
mod reference;

pub use client::{Client, Credentials, Layer};
pub use reference::Reference;

/// `sha256:<hex>` of `bytes`, as OCI names content.
pub fn digest_of(bytes: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256:");
    for b in digest.as_ref() {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// Writes `bytes` whole under a temporary name, then renames it into place, as a
/// content store commits what it ingested: a reader (or the next run after a crash)
/// never sees a partial file. The temporary name is this write's own, so two writers
/// of one file never truncate what the other just renamed into place (and a reader
/// may have mapped).
pub fn write_whole(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let tmp = path.with_extension(format!(
        "tmp{}-{}",
        std::process::id(),
        WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn is_sha256_hex(hex: &str) -> bool {
    hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}
