//! A real OCI registry for the `oci://` module tests: Debian's `docker-registry` (the
//! CNCF distribution registry) on a loopback port, with token authentication as public
//! registries have it. Every request without a token is answered 401 with a `Bearer`
//! challenge naming the token service this module runs beside it; that service hands
//! anyone a token for the scope they ask (signed ES256, with its certificate in `x5c`,
//! which the registry trusts through `rootcertbundle`).

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use bytes::Bytes;
use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair};

const SERVICE: &str = "trellis-test-registry";
const ISSUER: &str = "trellis-test-token-service";

/// The registry binary: `$TRELLIS_REGISTRY`, else what `tests/tools/docker-registry.sh`
/// unpacks from Debian's `docker-registry` into `~/.cache/trellis` (once per machine).
pub fn registry_bin() -> anyhow::Result<PathBuf> {
    static BIN: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);
    crate::tool_bin(&BIN, "TRELLIS_REGISTRY", "docker-registry.sh")
}

/// The token service's signing key and certificate.
struct Signer {
    key: EcdsaKeyPair,
    cert_der: Vec<u8>,
}

impl Signer {
    fn token(&self, scope: &str) -> anyhow::Result<String> {
        // scope = repository:NAME:ACTIONS
        let mut parts = scope.splitn(3, ':');
        let (kind, name, actions) = (
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
        );
        let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
        let header = serde_json::json!({
            "typ": "JWT",
            "alg": "ES256",
            "x5c": [STANDARD.encode(&self.cert_der)],
        });
        let claims = serde_json::json!({
            "iss": ISSUER,
            "sub": "",
            "aud": SERVICE,
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": format!("{now}-{}", rand::random::<u64>()),
            "access": [{"type": kind, "name": name, "actions": actions.split(',').collect::<Vec<_>>()}],
        });
        let signing_input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let signature = self
            .key
            .sign(&ring::rand::SystemRandom::new(), signing_input.as_bytes())
            .map_err(|e| anyhow::anyhow!("sign a token: {e}"))?;
        Ok(format!(
            "{signing_input}.{}",
            URL_SAFE_NO_PAD.encode(signature.as_ref())
        ))
    }
}

/// A running registry and its token service; both stop when this is dropped.
#[allow(missing_debug_implementations)]
pub struct Registry {
    /// `127.0.0.1:PORT`, as an `oci://` reference names it.
    pub address: String,
    /// How many tokens the service handed out.
    pub tokens_issued: Arc<AtomicUsize>,
    signer: Arc<Signer>,
    _child: tokio::process::Child,
    _token_service: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl Registry {
    /// A registry whose token service hands tokens to anyone.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(None).await
    }

    /// A private registry: its token service answers 401 unless the request carries
    /// HTTP Basic credentials `user:password`.
    pub async fn start_private(user: &str, password: &str) -> anyhow::Result<Self> {
        use base64::Engine as _;
        let basic = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        Self::start_with(Some(format!("Basic {basic}"))).await
    }

    async fn start_with(required: Option<String>) -> anyhow::Result<Self> {
        let bin = registry_bin()?;
        let dir = tempfile::tempdir()?;
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let cert = rcgen::CertificateParams::new(Vec::<String>::new())?.self_signed(&key)?;
        let signer = Arc::new(Signer {
            key: EcdsaKeyPair::from_pkcs8(
                &ECDSA_P256_SHA256_FIXED_SIGNING,
                &key.serialize_der(),
                &ring::rand::SystemRandom::new(),
            )
            .map_err(|e| anyhow::anyhow!("read the token key: {e}"))?,
            cert_der: cert.der().to_vec(),
        });
        let bundle = dir.path().join("token-ca.pem");
        std::fs::write(&bundle, cert.pem())?;

        let tokens_issued = Arc::new(AtomicUsize::new(0));
        let token_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let token_address = token_listener.local_addr()?;
        let app = {
            let signer = signer.clone();
            let issued = tokens_issued.clone();
            axum::Router::new().route(
                "/token",
                axum::routing::get(
                    move |headers: axum::http::HeaderMap,
                          axum::extract::Query(query): axum::extract::Query<
                        std::collections::HashMap<String, String>,
                    >| {
                        let signer = signer.clone();
                        let issued = issued.clone();
                        let required = required.clone();
                        async move {
                            if query.get("service").map(String::as_str) != Some(SERVICE) {
                                return Err(axum::http::StatusCode::BAD_REQUEST);
                            }
                            let given = headers
                                .get(axum::http::header::AUTHORIZATION)
                                .and_then(|v| v.to_str().ok());
                            if required.is_some() && given != required.as_deref() {
                                return Err(axum::http::StatusCode::UNAUTHORIZED);
                            }
                            let scope = query.get("scope").cloned().unwrap_or_default();
                            let token = signer
                                .token(&scope)
                                .map_err(|_| axum::http::StatusCode::INTERNAL_SERVER_ERROR)?;
                            issued.fetch_add(1, Ordering::SeqCst);
                            Ok(axum::Json(serde_json::json!({"token": token})))
                        }
                    },
                ),
            )
        };
        let token_service = tokio::spawn(async move {
            let _ = axum::serve(token_listener, app).await;
        });

        // A free port for the registry (it cannot report the one it bound).
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let address = format!("127.0.0.1:{port}");
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: {}
http:
  addr: {address}
auth:
  token:
    realm: http://{token_address}/token
    service: {SERVICE}
    issuer: {ISSUER}
    rootcertbundle: {}
",
                dir.path().join("data").display(),
                bundle.display()
            ),
        )?;
        let child = tokio::process::Command::new(&bin)
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {}", bin.display()))?;
        let registry = Self {
            address,
            tokens_issued,
            signer,
            _child: child,
            _token_service: token_service,
            _dir: dir,
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(r) = registry.send("GET", "/v2/", None, &[], Bytes::new()).await
                && r.status == 401
            {
                return Ok(registry);
            }
            if std::time::Instant::now() > deadline {
                bail!("the registry did not answer on {}", registry.address);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Pushes a WebAssembly artifact as `wkg` and `oras` do: a wasm config and one
    /// layer of `layer_type` holding `module`. Returns the manifest's digest.
    pub async fn push(
        &self,
        repository: &str,
        tag: &str,
        layer_type: &str,
        module: &[u8],
    ) -> anyhow::Result<String> {
        let token = self
            .signer
            .token(&format!("repository:{repository}:pull,push"))?;
        let config = br#"{"architecture":"wasm","os":"wasip2"}"#;
        let config_digest = self.push_blob(repository, &token, config).await?;
        let layer_digest = self.push_blob(repository, &token, module).await?;
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.wasm.config.v0+json",
                "digest": config_digest,
                "size": config.len(),
            },
            "layers": [{"mediaType": layer_type, "digest": layer_digest, "size": module.len()}],
        })
        .to_string();
        let r = self
            .send(
                "PUT",
                &format!("/v2/{repository}/manifests/{tag}"),
                Some(&token),
                &[("content-type", "application/vnd.oci.image.manifest.v1+json")],
                Bytes::from(manifest.clone()),
            )
            .await?;
        if r.status != 201 {
            bail!(
                "manifest PUT: {} {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            );
        }
        Ok(trellis_plugin_host::digest_of(manifest.as_bytes()))
    }

    async fn push_blob(
        &self,
        repository: &str,
        token: &str,
        blob: &[u8],
    ) -> anyhow::Result<String> {
        let digest = trellis_plugin_host::digest_of(blob);
        let r = self
            .send(
                "POST",
                &format!("/v2/{repository}/blobs/uploads/"),
                Some(token),
                &[],
                Bytes::new(),
            )
            .await?;
        if r.status != 202 {
            bail!(
                "blob upload POST: {} {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            );
        }
        let location = r
            .header_values("location")
            .first()
            .map(|l| (*l).to_owned())
            .context("the upload has no Location")?;
        let path = location
            .strip_prefix(&format!("http://{}", self.address))
            .unwrap_or(&location);
        let sep = if path.contains('?') { '&' } else { '?' };
        let r = self
            .send(
                "PUT",
                &format!("{path}{sep}digest={digest}"),
                Some(token),
                &[("content-type", "application/octet-stream")],
                Bytes::copy_from_slice(blob),
            )
            .await?;
        if r.status != 201 {
            bail!(
                "blob PUT: {} {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            );
        }
        Ok(digest)
    }

    async fn send(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> anyhow::Result<crate::HttpResponse> {
        use http_body_util::BodyExt as _;
        let tcp = tokio::net::TcpStream::connect(&self.address).await?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await?;
        tokio::spawn(connection);
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.address);
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        let response = sender
            .send_request(request.body(http_body_util::Full::new(body))?)
            .await?;
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let body = response.into_body().collect().await?.to_bytes().to_vec();
        Ok(crate::HttpResponse {
            status,
            headers,
            body,
        })
    }
}
