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
//!
//! # Layout
//! - `discovery`: the CA the server presents, found by its pinned hash.
//! - `transport`: the node's client, whose certificate can change under it.
//! - `rotation`: a new certificate before the current one expires.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use base64::Engine as _;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::{Api, PostParams};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;
use tracing::{info, warn};
use trellis_api::Shutdown;
use trellis_pki::file::{CERT_MODE, KEY_MODE};
use trellis_pki::{KUBELET_CLIENT_SIGNER, kubeconfig};

mod discovery;
mod rotation;
mod transport;

pub use discovery::discover_ca;
pub use rotation::rotation_deadline;
pub use transport::{Identity, client};

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
/// How long a request waits to be approved and signed before the join gives up.
const SIGNING_TIMEOUT: Duration = Duration::from_secs(3600);

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

/// A joined node's client, with its certificate rotated before it expires until
/// `stopped`.
pub async fn joined_client(
    join: &BootstrapConfig,
    data_dir: &Path,
    node_name: &str,
    stopped: Shutdown,
) -> anyhow::Result<(kube::Client, String)> {
    let creds = credentials(join, data_dir, node_name).await?;
    let identity = Arc::new(Identity::new(&creds)?);
    let client = client(&creds, identity.clone())?;
    let ca = creds.ca_pem.clone();
    tokio::spawn(rotation::rotate(
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
