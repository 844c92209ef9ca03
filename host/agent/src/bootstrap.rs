//! A node's TLS bootstrap, as the kubelet's (`pkg/kubelet/certificate/bootstrap`, and
//! kubeadm's token discovery before it), then keeping its client certificate fresh
//! (the kubelet's certificate manager).
//!
//! 1. Discovery: a TLS handshake with the server that succeeds only if the chain it
//!    presents holds a certificate whose public key hashes to
//!    `--discovery-token-ca-cert-hash` and the serving certificate verifies against
//!    it. That certificate becomes the cluster CA; nothing is sent before.
//! 2. TLS bootstrap: with the token, over TLS to that CA, a CertificateSigningRequest
//!    for `CN=system:node:NAME, O=system:nodes` (signer
//!    `kubernetes.io/kube-apiserver-client-kubelet`), watched until it carries a
//!    certificate; `DATA_DIR/node.kubeconfig` is then written (mode 0600, atomically)
//!    and used from then on, also by the next start.
//! 3. Rotation: when 70–90 % (jittered) of the certificate's lifetime has passed, a new
//!    request is sent with the current certificate; the new one is written and handed
//!    to the client, and every connection opened before is closed, as the kubelet
//!    closes its connections after a rotation: a connection keeps the certificate
//!    of its handshake, which the server refuses once it expires.
//!
//! Start with [`joined_client`].

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use base64::Engine as _;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::{Api, PostParams};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::sync::watch;
use tracing::{info, warn};
use trellis_pki::file::{CERT_MODE, KEY_MODE};
use trellis_pki::{KUBELET_CLIENT_SIGNER, kubeconfig};

/// How to join a cluster when the node has no credentials yet (`trellis node`'s join
/// flags): a bootstrap token for a server that presents the pinned CA.
#[derive(Clone, Default)]
pub struct BootstrapConfig {
    /// The API server to join, `https://HOST:PORT`.
    pub server: Option<String>,
    /// A bootstrap token, `ID.SECRET`.
    pub token: Option<String>,
    /// The cluster CA's public key hash, `sha256:HEX`: the server is trusted only if
    /// it presents that CA.
    pub discovery_token_ca_cert_hash: Option<String>,
    /// The lifetime asked for the node's certificate, in seconds (at least 600); the
    /// signer's default without it.
    pub cert_duration: Option<u64>,
}

// Written by hand so that the token never ends up in logs.
impl std::fmt::Debug for BootstrapConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootstrapConfig")
            .field("server", &self.server)
            .field(
                "discovery_token_ca_cert_hash",
                &self.discovery_token_ca_cert_hash,
            )
            .field("cert_duration", &self.cert_duration)
            .finish_non_exhaustive()
    }
}

/// The name of the node's kubeconfig in its data directory.
pub const KUBECONFIG_FILE: &str = "node.kubeconfig";
/// How long a TLS handshake for discovery may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request waits to be approved and signed before the join gives up.
const SIGNING_TIMEOUT: Duration = Duration::from_secs(3600);
/// The first wait before a failed rotation is tried again; doubled up to a minute.
const ROTATION_RETRY: Duration = Duration::from_secs(1);

/// The credentials of a joined node.
#[derive(Clone)]
pub struct Credentials {
    pub server: String,
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

// Written by hand so that the key never ends up in logs.
impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// `DATA_DIR/node.kubeconfig` and the files beside it that hold its parts.
struct Files {
    kubeconfig: PathBuf,
    cert: PathBuf,
    ca: PathBuf,
}

impl Files {
    fn new(data_dir: &Path) -> Self {
        Self {
            kubeconfig: data_dir.join(KUBECONFIG_FILE),
            cert: data_dir.join("pki").join("node-client-current.pem"),
            ca: data_dir.join("pki").join("ca.crt"),
        }
    }

    /// The credentials of an earlier join, if there are any.
    fn load(&self) -> anyhow::Result<Option<Credentials>> {
        if !self.cert.exists() || !self.kubeconfig.exists() {
            return Ok(None);
        }
        let both = std::fs::read_to_string(&self.cert)
            .with_context(|| format!("read {}", self.cert.display()))?;
        let ca_pem = std::fs::read_to_string(&self.ca)
            .with_context(|| format!("read {}", self.ca.display()))?;
        let server = kubeconfig::read_server(&self.kubeconfig)?;
        let (cert_pem, key_pem) = split_cert_and_key(&both)
            .with_context(|| format!("read the certificate and key in {}", self.cert.display()))?;
        Ok(Some(Credentials {
            server,
            ca_pem,
            cert_pem,
            key_pem,
        }))
    }

    /// Writes the credentials: each file atomically, the key readable by its owner
    /// alone; the kubeconfig last, so that one present means all are.
    fn store(&self, creds: &Credentials, node_name: &str) -> anyhow::Result<()> {
        if let Some(dir) = self.cert.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        }
        trellis_pki::write_file_atomic(
            &self.cert,
            format!("{}{}", creds.cert_pem, creds.key_pem).as_bytes(),
            KEY_MODE,
        )
        .with_context(|| format!("write {}", self.cert.display()))?;
        trellis_pki::write_file_atomic(&self.ca, creds.ca_pem.as_bytes(), CERT_MODE)
            .with_context(|| format!("write {}", self.ca.display()))?;
        let contents = kubeconfig::cert_kubeconfig(
            &creds.server,
            &creds.ca_pem,
            &format!("system:node:{node_name}"),
            &creds.cert_pem,
            &creds.key_pem,
        );
        kubeconfig::write_kubeconfig(&self.kubeconfig, &contents)
            .with_context(|| format!("write {}", self.kubeconfig.display()))
    }
}

fn split_cert_and_key(pem: &str) -> anyhow::Result<(String, String)> {
    let start = pem
        .find("-----BEGIN PRIVATE KEY-----")
        .context("find the key")?;
    let (cert, key) = pem.split_at(start);
    ensure!(cert.contains("BEGIN CERTIFICATE"), "find the certificate");
    Ok((cert.to_owned(), key.to_owned()))
}

/// Credentials for the node: those of an earlier join while they are valid, else new
/// ones from a TLS bootstrap with `join`'s token.
pub async fn credentials(
    join: &BootstrapConfig,
    data_dir: &Path,
    node_name: &str,
) -> anyhow::Result<Credentials> {
    let files = Files::new(data_dir);
    if let Some(creds) = files.load()? {
        let (_, not_after) = trellis_pki::cert_validity(&creds.cert_pem)?;
        // The stored certificate must be this node's, for this server: a data
        // directory reused under another name or cluster joins again.
        let owner = CertificateDer::from_pem_slice(creds.cert_pem.as_bytes())
            .ok()
            .and_then(|der| trellis_pki::identity_from_cert(&der))
            .map(|user| user.name);
        let wanted = format!("system:node:{node_name}");
        let same_server = join.server.as_ref().is_none_or(|s| *s == creds.server);
        if owner.as_deref() != Some(wanted.as_str()) || !same_server {
            warn!(kubeconfig = %files.kubeconfig.display(), ?owner, %wanted, "the stored credentials are another node's or another server's; joining again");
        } else if jiff::Timestamp::now().as_second() < not_after {
            info!(kubeconfig = %files.kubeconfig.display(), "using the credentials of an earlier join");
            return Ok(creds);
        } else {
            warn!(kubeconfig = %files.kubeconfig.display(), "the node's certificate has expired; joining again");
        }
    }
    let (Some(server), Some(token), Some(hash)) = (
        &join.server,
        &join.token,
        &join.discovery_token_ca_cert_hash,
    ) else {
        bail!(
            "join the cluster: give --kubeconfig, or --server, --token and --discovery-token-ca-cert-hash"
        );
    };
    let ca_der = discover_ca(server, hash).await?;
    let ca_pem = trellis_pki::pem_encode("CERTIFICATE", &ca_der);
    info!(%server, "the server presents the pinned CA; requesting a certificate");
    let bootstrap =
        kubeconfig::token_kubeconfig(server, &ca_pem, "tls-bootstrap-token-user", token);
    let kubeconfig: kube::config::Kubeconfig =
        serde_saphyr::from_str(&bootstrap).context("read the bootstrap kubeconfig")?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .context("load the bootstrap kubeconfig")?;
    let client = trellis_client::transport::remote_with(config)?;
    let (cert_pem, key_pem) = request_certificate(client, node_name, join.cert_duration)
        .await
        .context("obtain the node's certificate with the bootstrap token")?;
    let creds = Credentials {
        server: server.clone(),
        ca_pem,
        cert_pem,
        key_pem,
    };
    files.store(&creds, node_name)?;
    info!(kubeconfig = %files.kubeconfig.display(), "joined");
    Ok(creds)
}

/// Submits a CSR for the node's client certificate through `client` and waits until
/// it is signed; the certificate and its key, PEM.
async fn request_certificate(
    client: kube::Client,
    node_name: &str,
    duration: Option<u64>,
) -> anyhow::Result<(String, String)> {
    let (key_pem, request_pem) = trellis_pki::node_client_request(node_name)?;
    let api: Api<CertificateSigningRequest> = Api::all(client);
    let name = format!("node-csr-{}", random_suffix(8));
    let csr: CertificateSigningRequest = serde_json::from_value(serde_json::json!({
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": name},
        "spec": {
            "request": base64::engine::general_purpose::STANDARD.encode(&request_pem),
            "signerName": KUBELET_CLIENT_SIGNER,
            "usages": ["digital signature", "client auth"],
            "expirationSeconds": duration,
        },
    }))
    .context("build the CertificateSigningRequest")?;
    api.create(&PostParams::default(), &csr)
        .await
        .with_context(|| format!("create CertificateSigningRequest {name}"))?;
    info!(csr = %name, "waiting for the certificate signing request to be approved and signed");
    let decided = |csr: Option<&CertificateSigningRequest>| {
        csr.and_then(|c| c.status.as_ref()).is_some_and(|s| {
            s.certificate.is_some()
                || s.conditions
                    .iter()
                    .flatten()
                    .any(|c| matches!(c.type_.as_str(), "Denied" | "Failed") && c.status == "True")
        })
    };
    let done = tokio::time::timeout(
        SIGNING_TIMEOUT,
        kube::runtime::wait::await_condition(api, &name, decided),
    )
    .await
    .map_err(|_| anyhow!("no certificate for {name} after {SIGNING_TIMEOUT:?}"))?
    .with_context(|| format!("watch CertificateSigningRequest {name}"))?
    .with_context(|| format!("CertificateSigningRequest {name} was deleted"))?;
    let status = done.status.unwrap_or_default();
    if let Some(cert) = status.certificate {
        let cert_pem = String::from_utf8(cert.0).context("read the issued certificate")?;
        return Ok((cert_pem, key_pem));
    }
    let why = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.status == "True")
        .map(|c| format!("{}: {}", c.type_, c.message.clone().unwrap_or_default()))
        .unwrap_or_default();
    bail!("CertificateSigningRequest {name} was not signed ({why})")
}

/// `n` random lowercase letters and digits: a name no other request has.
fn random_suffix(n: usize) -> String {
    use rand::Rng as _;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..n)
        .map(|_| char::from(ALPHABET[rng.random_range(0..ALPHABET.len())]))
        .collect()
}

/// The CA of the server at `url`, found in the chain it presents by `hash`, once its
/// serving certificate verifies against it.
pub async fn discover_ca(url: &str, hash: &str) -> anyhow::Result<Vec<u8>> {
    let hash = hash.trim().to_lowercase();
    ensure!(
        hash.strip_prefix("sha256:")
            .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit())),
        "parse --discovery-token-ca-cert-hash {hash:?}: expected sha256: and 64 hex digits"
    );
    let uri: hyper::Uri = url
        .parse()
        .with_context(|| format!("parse the server URL {url:?}"))?;
    ensure!(
        uri.scheme_str() == Some("https"),
        "parse the server URL {url:?}: expected https://HOST:PORT"
    );
    let host = uri
        .host()
        .with_context(|| format!("parse the server URL {url:?}: no host"))?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = uri.port_u16().unwrap_or(443);
    let verifier = Arc::new(PinnedCa {
        hash,
        provider: provider(),
        found: Mutex::new(None),
        mismatch: Mutex::new(None),
    });
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("select TLS protocol versions")?
        .dangerous()
        .with_custom_certificate_verifier(verifier.clone())
        .with_no_client_auth();
    let name = ServerName::try_from(host.clone())
        .with_context(|| format!("parse the server name {host:?}"))?;
    let connect = async {
        let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .with_context(|| format!("connect to {host}:{port}"))?;
        tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .map_err(anyhow::Error::from)
    };
    let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, connect)
        .await
        .map_err(|_| anyhow!("TLS handshake with {url} timed out"))?;
    if let Some(why) = lock(&verifier.mismatch).take() {
        bail!("trust the server {url}: {why}");
    }
    handshake.with_context(|| format!("verify the server {url}"))?;
    lock(&verifier.found)
        .take()
        .with_context(|| format!("find the cluster CA of {url}"))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Trusts a server whose chain holds the CA of the pinned hash and whose serving
/// certificate that CA verifies.
#[derive(Debug)]
struct PinnedCa {
    hash: String,
    provider: Arc<CryptoProvider>,
    found: Mutex<Option<Vec<u8>>>,
    mismatch: Mutex<Option<String>>,
}

impl ServerCertVerifier for PinnedCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ca = intermediates
            .iter()
            .find(|c| trellis_pki::ca_cert_hash(c).is_ok_and(|h| h == self.hash));
        let Some(ca) = ca else {
            let why = format!(
                "no certificate the server presents matches --discovery-token-ca-cert-hash {}",
                self.hash
            );
            *lock(&self.mismatch) = Some(why.clone());
            return Err(rustls::Error::General(why));
        };
        let mut roots = RootCertStore::empty();
        roots
            .add(ca.clone().into_owned())
            .map_err(|e| rustls::Error::General(format!("use the pinned CA: {e}")))?;
        let verifier =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
                .build()
                .map_err(|e| rustls::Error::General(format!("build the verifier: {e}")))?;
        if let Err(e) =
            verifier.verify_server_cert(end_entity, &[], server_name, ocsp_response, now)
        {
            *lock(&self.mismatch) = Some(format!(
                "the serving certificate does not verify against the pinned CA: {e}"
            ));
            return Err(e);
        }
        *lock(&self.found) = Some(ca.to_vec());
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The node's client certificate, replaced in place when it rotates: connections
/// opened after a rotation present the new one, and those opened before are closed.
#[derive(Debug)]
pub struct Identity {
    current: RwLock<Arc<CertifiedKey>>,
    /// Counts rotations; a connection ends when it changes.
    generation: watch::Sender<u64>,
}

impl Identity {
    fn new(creds: &Credentials) -> anyhow::Result<Self> {
        Ok(Self {
            current: RwLock::new(Arc::new(certified_key(creds)?)),
            generation: watch::Sender::new(0),
        })
    }

    fn replace(&self, creds: &Credentials) -> anyhow::Result<()> {
        let key = Arc::new(certified_key(creds)?);
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = key;
        self.generation.send_modify(|g| *g += 1);
        Ok(())
    }
}

fn certified_key(creds: &Credentials) -> anyhow::Result<CertifiedKey> {
    let chain = CertificateDer::pem_slice_iter(creds.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .context("parse the node's certificate")?;
    let key =
        PrivateKeyDer::from_pem_slice(creds.key_pem.as_bytes()).context("parse the node's key")?;
    let signing =
        rustls::crypto::ring::sign::any_supported_type(&key).context("load the node's key")?;
    Ok(CertifiedKey::new(chain, signing))
}

impl ResolvesClientCert for Identity {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        )
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// A client for the node: the cluster CA as the only root, the node's certificate
/// from `identity`.
pub fn client(creds: &Credentials, identity: Arc<Identity>) -> anyhow::Result<kube::Client> {
    use hyper_util::rt::TokioExecutor;
    use kube::client::ConfigExt as _;
    use tower::{BoxError, ServiceBuilder};
    let mut roots = RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(creds.ca_pem.as_bytes()) {
        roots
            .add(ca.context("parse the cluster CA")?)
            .context("trust the cluster CA")?;
    }
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("select TLS protocol versions")?
        .with_root_certificates(roots)
        .with_client_cert_resolver(identity.clone());
    // A resumed session keeps the certificate of the handshake it resumes: after a
    // rotation that would be the old one again.
    tls.resumption = rustls::client::Resumption::disabled();
    let url: hyper::Uri = creds
        .server
        .parse()
        .with_context(|| format!("parse the server URL {:?}", creds.server))?;
    let config = kube::Config::new(url);
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(10)));
    let generation = identity.generation.subscribe();
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_all_versions()
        .wrap_connector(http);
    let https = ClosedOnRotation {
        inner: https,
        generation,
    };
    let hyper: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .http2_keep_alive_interval(Duration::from_secs(30))
            .http2_keep_alive_timeout(Duration::from_secs(10))
            .build(https);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .map_err(BoxError::from)
        .service(hyper);
    Ok(kube::Client::new(service, config.default_namespace))
}

/// A joined node's client, with its certificate rotated before it expires until
/// `stopped`.
pub async fn joined_client(
    join: &BootstrapConfig,
    data_dir: &Path,
    node_name: &str,
    stopped: watch::Receiver<bool>,
) -> anyhow::Result<(kube::Client, String)> {
    let creds = credentials(join, data_dir, node_name).await?;
    let identity = Arc::new(Identity::new(&creds)?);
    let client = client(&creds, identity.clone())?;
    let ca = creds.ca_pem.clone();
    tokio::spawn(rotate(
        creds,
        identity,
        client.clone(),
        Files::new(data_dir),
        node_name.to_owned(),
        join.cert_duration,
        stopped,
    ));
    Ok((client, ca))
}

/// When to rotate a certificate valid from `not_before` to `not_after` (Unix seconds):
/// at 70–90 % of its lifetime, as kubelet's certificate manager, by `jitter` in [0, 1).
pub fn rotation_deadline(not_before: i64, not_after: i64, jitter: f64) -> i64 {
    let lifetime = (not_after - not_before).max(0) as f64;
    not_before + (lifetime * (0.7 + 0.2 * jitter.clamp(0.0, 1.0))) as i64
}

async fn rotate(
    mut creds: Credentials,
    identity: Arc<Identity>,
    client: kube::Client,
    files: Files,
    node_name: String,
    duration: Option<u64>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut retry = ROTATION_RETRY;
    loop {
        let wait = match trellis_pki::cert_validity(&creds.cert_pem) {
            Ok((not_before, not_after)) => {
                let deadline = rotation_deadline(not_before, not_after, rand::random::<f64>());
                let now = jiff::Timestamp::now().as_second();
                // At least a second apart, whatever the certificate says.
                Duration::from_secs(u64::try_from(deadline - now).unwrap_or(0).max(1))
            }
            Err(e) => {
                warn!(error = %format!("{e:#}"), "cannot read the node's certificate; not rotating it");
                return;
            }
        };
        info!(node = %node_name, in_seconds = wait.as_secs(), "certificate rotation scheduled");
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = stopped.wait_for(|s| *s) => return,
        }
        let rotated = async {
            let (cert_pem, key_pem) =
                request_certificate(client.clone(), &node_name, duration).await?;
            let next = Credentials {
                cert_pem,
                key_pem,
                ..creds.clone()
            };
            files.store(&next, &node_name)?;
            identity.replace(&next)?;
            anyhow::Ok(next)
        };
        let rotated = tokio::select! {
            r = rotated => r,
            _ = stopped.wait_for(|s| *s) => return,
        };
        match rotated {
            Ok(next) => {
                info!(node = %node_name, "certificate rotated");
                creds = next;
                retry = ROTATION_RETRY;
            }
            Err(e) => {
                warn!(node = %node_name, error = %format!("{e:#}"), "failed to rotate the certificate; retrying");
                tokio::select! {
                    () = tokio::time::sleep(retry) => {}
                    _ = stopped.wait_for(|s| *s) => return,
                }
                retry = (retry * 2).min(Duration::from_secs(60));
            }
        }
    }
}

/// A connector whose connections end when the node's certificate rotates.
#[derive(Clone)]
struct ClosedOnRotation<C> {
    inner: C,
    generation: watch::Receiver<u64>,
}

impl<C> tower::Service<hyper::Uri> for ClosedOnRotation<C>
where
    C: tower::Service<hyper::Uri>,
    C::Future: Send + 'static,
    C::Response: Send + 'static,
{
    type Response = ClosedOnRotationIo<C::Response>;
    type Error = C::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, C::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), C::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: hyper::Uri) -> Self::Future {
        // The generation before the handshake: a rotation during it closes the
        // connection, whichever certificate it presented.
        let mut generation = self.generation.clone();
        generation.mark_unchanged();
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            let io = connecting.await?;
            let rotated = Box::pin(async move {
                if generation.changed().await.is_err() {
                    // The identity is gone, and with it any rotation.
                    std::future::pending::<()>().await;
                }
            });
            Ok(ClosedOnRotationIo {
                io,
                rotated,
                closed: false,
            })
        })
    }
}

/// A connection that fails its reads and writes once the certificate has rotated, so
/// that the client's pool drops it and opens a new one with the new certificate.
struct ClosedOnRotationIo<T> {
    io: T,
    rotated: Pin<Box<dyn Future<Output = ()> + Send>>,
    closed: bool,
}

impl<T> ClosedOnRotationIo<T> {
    /// Polled on every read, so an idle connection (whose task waits in a read) is
    /// woken and ended by a rotation too.
    fn check(&mut self, cx: &mut Context<'_>) -> std::io::Result<()> {
        if !self.closed && self.rotated.as_mut().poll(cx).is_ready() {
            self.closed = true;
        }
        if self.closed {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "closed: the node's certificate rotated",
            ));
        }
        Ok(())
    }
}

impl<T: hyper::rt::Read + Unpin> hyper::rt::Read for ClosedOnRotationIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write + Unpin> hyper::rt::Write for ClosedOnRotationIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl<T: hyper_util::client::legacy::connect::Connection>
    hyper_util::client::legacy::connect::Connection for ClosedOnRotationIo<T>
{
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        self.io.connected()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_falls_between_seventy_and_ninety_percent() {
        assert_eq!(rotation_deadline(0, 1000, 0.0), 700);
        assert_eq!(rotation_deadline(0, 1000, 0.999_999), 899);
        assert_eq!(rotation_deadline(100, 100, 0.5), 100);
    }
}
