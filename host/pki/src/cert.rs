//! PEM certificates: encoding, validity, the CA hash a joining node pins, the user a
//! client certificate names.

use anyhow::anyhow;
use base64::Engine as _;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;
use trellis_api::UserInfo;

/// DER as PEM under `label` (`CERTIFICATE`), 64 columns.
pub fn pem_encode(label: &str, der: &[u8]) -> String {
    let body = base64::engine::general_purpose::STANDARD.encode(der);
    let mut pem = format!("-----BEGIN {label}-----\n");
    // Base64 output is ASCII, so splitting bytes never splits a character.
    for line in body.as_bytes().chunks(64) {
        pem.push_str(&String::from_utf8_lossy(line));
        pem.push('\n');
    }
    pem.push_str(&format!("-----END {label}-----\n"));
    pem
}

/// The validity of a PEM certificate: not before and not after, Unix seconds.
pub fn cert_validity(cert_pem: &str) -> anyhow::Result<(i64, i64)> {
    let der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .map_err(|e| anyhow!("parse the certificate: {e}"))?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| anyhow!("parse the certificate: {e}"))?;
    let validity = cert.validity();
    Ok((
        validity.not_before.timestamp(),
        validity.not_after.timestamp(),
    ))
}

/// kubeadm's `--discovery-token-ca-cert-hash` of a CA certificate (DER):
/// `sha256:` and the hex SHA-256 of its SubjectPublicKeyInfo.
pub fn ca_cert_hash(cert_der: &[u8]) -> anyhow::Result<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der)
        .map_err(|e| anyhow!("parse the CA certificate: {e}"))?;
    let digest = ring::digest::digest(&ring::digest::SHA256, cert.public_key().raw);
    let hex: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("sha256:{hex}"))
}

/// The user a client certificate authenticates, with Kubernetes' x509 authenticator
/// semantics: the name is the subject's common name, the groups are the subject's
/// organizations in order. `None` if the certificate does not parse, has no (or an
/// empty) common name, or has an attribute that is not a string.
///
/// The API server calls this only with a certificate the TLS layer verified (the first
/// of `ServerConnection::peer_certificates`), a node with its own: it checks no
/// signature.
pub fn identity_from_cert(der: &[u8]) -> Option<UserInfo> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let subject = cert.subject();
    // Go's pkix.Name keeps the last common name when there are several; so do we, so
    // that a certificate names the same user here as in Kubernetes.
    let mut name = None;
    for attribute in subject.iter_common_name() {
        name = Some(attribute.as_str().ok()?);
    }
    let name = name.filter(|n| !n.is_empty())?;
    let groups = subject
        .iter_organization()
        .map(|attribute| attribute.as_str().map(str::to_owned).ok())
        .collect::<Option<Vec<_>>>()?;
    Some(UserInfo {
        name: name.to_owned(),
        uid: String::new(),
        groups,
        extra: Default::default(),
    })
}

/// The machine's hostname, read where Linux publishes it (no libc dependency): a
/// serving certificate's SAN, and a node's name when none is given.
pub fn hostname() -> Option<String> {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .map(|name| name.trim().to_owned())
        .find(|name| !name.is_empty())
}
