//! Fetching a plugin's module: `file://` paths, and `https://` URLs whose content must
//! match `spec.module.sha256`. Fetched modules are kept by digest in the server's
//! plugin cache, so a restart does not need the network.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty, Limited};
use trellis_plugin_host::digest_of;

use super::spec::ModuleDoc;

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
        let cached = cache.join(format!("{hex}.wasm"));
        if let Ok(bytes) = tokio::fs::read(&cached).await
            && digest_of(&bytes).ends_with(hex.as_str())
        {
            return Ok(bytes);
        }
        let bytes = https_get(&doc.url).await?;
        check_digest(&bytes, Some(hex))?;
        let tmp = cached.with_extension("tmp");
        if tokio::fs::write(&tmp, &bytes).await.is_ok() {
            let _ = tokio::fs::rename(&tmp, &cached).await;
        }
        bytes
    } else if doc.url.starts_with("oci://") {
        return Err(format!(
            "spec.module.url: Unsupported value: {:?}: oci:// registries are not supported by this server; use file:// or https://",
            doc.url
        ));
    } else {
        return Err(format!(
            "spec.module.url: Unsupported value: {:?}: supported schemes: \"file://\", \"https://\"",
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

/// One GET over HTTPS, verified against the system's roots; redirects are not
/// followed (the digest pins the content, not the address).
async fn https_get(url: &str) -> Result<Vec<u8>, String> {
    let uri: hyper::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let host = uri
        .host()
        .ok_or_else(|| format!("{url}: no host"))?
        .to_owned();
    let port = uri.port_u16().unwrap_or(443);
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("TLS: {e}"))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let server_name =
        rustls::pki_types::ServerName::try_from(host.clone()).map_err(|e| format!("{url}: {e}"))?;
    let stream = tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect(server_name, tcp)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| format!("{url}: {e}"))?;
    tokio::spawn(conn);
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let request = hyper::Request::get(path)
        .header(hyper::header::HOST, host)
        .body(Empty::<Bytes>::new())
        .map_err(|e| format!("{url}: {e}"))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    if !response.status().is_success() {
        return Err(format!("{url}: HTTP {}", response.status()));
    }
    let body = Limited::new(response.into_body(), MAX_MODULE)
        .collect()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    Ok(body.to_bytes().to_vec())
}
