//! Discovery, as kubeadm's with a token: the cluster CA is the certificate in the
//! server's chain whose public key hashes to `--discovery-token-ca-cert-hash`, once the
//! serving certificate verifies against it; nothing is sent before.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::provider;

/// How long a TLS handshake for discovery may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
