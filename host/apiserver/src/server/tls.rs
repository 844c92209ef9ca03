//! TLS for the API server: the rustls server configuration built from the cluster
//! [`Pki`], and the x509 authenticator that turns a verified client certificate into a
//! [`UserInfo`](trellis_api::UserInfo).
//!
//! Client certificates are optional at the TLS layer, as in kube-apiserver: a client
//! without one still connects and may authenticate with a bearer token, or stays
//! anonymous. A client that presents one must present one the cluster CA signed,
//! otherwise the handshake fails.

use std::sync::Arc;

use anyhow::Context as _;
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use trellis_api::user::Peer;
use trellis_pki::identity_from_cert;

use crate::server::pki::Pki;

/// ALPN protocols, most preferred first: kubectl and client-go speak HTTP/2.
const ALPN_PROTOCOLS: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// The server configuration: the serving certificate from `pki`, ALPN `h2` and
/// `http/1.1`, and optional client certificates verified against the cluster CA.
///
/// Uses the ring provider explicitly rather than a process-wide default, so it works
/// whatever else the process installs.
pub fn server_config(pki: &Pki) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());

    let mut roots = RootCertStore::empty();
    roots
        .add(pki.ca_cert_der().clone())
        .context("add cluster CA to client certificate roots")?;
    let client_verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .allow_unauthenticated()
            .build()
            .context("build client certificate verifier")?;

    let mut chain = CertificateDer::pem_slice_iter(pki.serving_cert_chain_pem().as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .context("parse serving certificate chain")?;
    // The CA after the leaf, as kube-apiserver's serving bundle: a node joining with
    // only the CA's hash finds the CA in the handshake and checks the leaf against it.
    chain.push(pki.ca_cert_der().clone());
    let key = PrivateKeyDer::from_pem_slice(pki.serving_key_pem().as_bytes())
        .context("parse serving key")?;

    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("select TLS protocol versions")?
        .with_client_cert_verifier(client_verifier)
        .with_single_cert(chain, key)
        .context("use serving certificate")?;
    config.alpn_protocols = ALPN_PROTOCOLS.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// What a connection's verified client certificate proves: its user (see
/// [`identity_from_cert`]) until the certificate expires.
pub fn peer_from_cert(der: &[u8]) -> Peer {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Peer::default();
    };
    Peer {
        user: identity_from_cert(der),
        not_after: Some(cert.validity().not_after.timestamp()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use rustls::pki_types::ServerName;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio_rustls::{TlsAcceptor, TlsConnector};
    use trellis_api::UserInfo;

    /// A client that trusts the cluster CA and presents `identity` (cert, key PEM) if
    /// given.
    fn client_config(ca_pem: &str, identity: Option<(&str, &str)>) -> Arc<rustls::ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
            .unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let mut config = match identity {
            Some((cert, key)) => builder
                .with_client_auth_cert(
                    CertificateDer::pem_slice_iter(cert.as_bytes())
                        .collect::<Result<Vec<_>, _>>()
                        .unwrap(),
                    PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(config)
    }

    struct Outcome {
        server: std::io::Result<(Option<UserInfo>, Option<Vec<u8>>)>,
        client: std::io::Result<()>,
    }

    /// Runs one handshake over an in-memory pipe, then a one-byte exchange so that a
    /// rejection the server sends after the client's last flight reaches the client.
    async fn handshake(
        server: Arc<rustls::ServerConfig>,
        client: Arc<rustls::ClientConfig>,
    ) -> Outcome {
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let server = async move {
            let mut stream = TlsAcceptor::from(server).accept(server_io).await?;
            let (_, connection) = stream.get_ref();
            let user = connection
                .peer_certificates()
                .and_then(|chain| chain.first())
                .and_then(|cert| identity_from_cert(cert));
            let alpn = connection.alpn_protocol().map(<[u8]>::to_vec);
            stream.write_all(b"!").await?;
            stream.flush().await?;
            Ok((user, alpn))
        };
        let client = async move {
            let name = ServerName::try_from("localhost").unwrap();
            let mut stream = TlsConnector::from(client).connect(name, client_io).await?;
            let mut byte = [0u8; 1];
            stream.read_exact(&mut byte).await?;
            Ok(())
        };
        let (server, client) = tokio::join!(server, client);
        Outcome { server, client }
    }

    #[tokio::test]
    async fn admin_client_cert_authenticates_as_system_masters() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        let client = client_config(
            pki.ca_pem(),
            Some((pki.admin_cert_pem(), pki.admin_key_pem())),
        );
        let outcome = handshake(server_config(&pki).unwrap(), client).await;
        outcome.client.unwrap();
        let (user, alpn) = outcome.server.unwrap();
        assert_eq!(
            user,
            Some(UserInfo {
                name: "admin".into(),
                uid: String::new(),
                groups: vec!["system:masters".into()],
                extra: Default::default(),
            })
        );
        assert_eq!(alpn.as_deref(), Some(&b"h2"[..]));
    }

    #[tokio::test]
    async fn issued_client_cert_authenticates_with_all_groups() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        let (cert, key) = pki.issue_client_cert("jane", &["dev", "ops"], 1).unwrap();
        let client = client_config(pki.ca_pem(), Some((&cert, &key)));
        let outcome = handshake(server_config(&pki).unwrap(), client).await;
        outcome.client.unwrap();
        let (user, _) = outcome.server.unwrap();
        assert_eq!(user, Some(UserInfo::new("jane", ["dev", "ops"])));
    }

    #[tokio::test]
    async fn client_without_cert_connects_anonymously() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        let client = client_config(pki.ca_pem(), None);
        let outcome = handshake(server_config(&pki).unwrap(), client).await;
        outcome.client.unwrap();
        let (user, _) = outcome.server.unwrap();
        assert_eq!(user, None);
    }

    #[tokio::test]
    async fn client_cert_from_another_ca_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        let other_dir = tempfile::tempdir().unwrap();
        let other = Pki::load_or_create(other_dir.path(), &[]).unwrap();
        // Trusts our CA for the server but presents a cert the other CA signed.
        let client = client_config(
            pki.ca_pem(),
            Some((other.admin_cert_pem(), other.admin_key_pem())),
        );
        let outcome = handshake(server_config(&pki).unwrap(), client).await;
        let err = outcome.server.unwrap_err();
        // Both CAs are named trellis-ca, so the chain is found and its signature fails.
        assert!(
            err.to_string().contains("invalid peer certificate"),
            "{err}"
        );
        assert!(outcome.client.is_err());
    }

    #[tokio::test]
    async fn client_rejects_server_of_another_cluster() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        let other_dir = tempfile::tempdir().unwrap();
        let other = Pki::load_or_create(other_dir.path(), &[]).unwrap();
        let client = client_config(other.ca_pem(), None);
        let outcome = handshake(server_config(&pki).unwrap(), client).await;
        assert!(outcome.client.is_err());
        assert!(outcome.server.is_err());
    }

    #[test]
    fn server_offers_h2_then_http11() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        let config = server_config(&pki).unwrap();
        assert_eq!(
            config.alpn_protocols,
            [b"h2".to_vec(), b"http/1.1".to_vec()]
        );
    }

    #[test]
    fn a_peer_is_its_certificates_user_until_the_certificate_expires() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        let (cert_pem, _) = pki
            .issue_client_cert("system:node:n1", &["system:nodes"], 1)
            .unwrap();
        let der = CertificateDer::from_pem_slice(cert_pem.as_bytes()).unwrap();
        let peer = peer_from_cert(&der);
        let (_, not_after) = trellis_pki::cert_validity(&cert_pem).unwrap();
        assert_eq!(peer.not_after, Some(not_after));
        let user = UserInfo::new("system:node:n1", ["system:nodes"]);
        assert_eq!(peer.user_at(not_after), Some(&user));
        assert_eq!(peer.user_at(not_after + 1), None);
        assert_eq!(
            Peer::in_process(user.clone()).user_at(i64::MAX),
            Some(&user)
        );
        assert!(peer_from_cert(b"not a certificate").user.is_none());
    }
}
