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

#[cfg(test)]
mod tests {
    use super::*;

    fn self_signed(names: &[(rcgen::DnType, &str)]) -> rcgen::Certificate {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        for (kind, value) in names {
            params.distinguished_name.push(kind.clone(), *value);
        }
        params.self_signed(&key).unwrap()
    }

    #[test]
    fn identity_needs_a_common_name() {
        // A CA certificate has a CN and no O.
        let ca = self_signed(&[(rcgen::DnType::CommonName, "trellis-ca")]);
        assert_eq!(
            identity_from_cert(ca.der()),
            Some(UserInfo::new("trellis-ca", Vec::<String>::new()))
        );
        assert_eq!(identity_from_cert(b"not a certificate"), None);

        let no_cn = self_signed(&[(rcgen::DnType::OrganizationName, "system:masters")]);
        assert_eq!(identity_from_cert(no_cn.der()), None);

        let empty_cn = self_signed(&[
            (rcgen::DnType::OrganizationName, "system:masters"),
            (rcgen::DnType::CommonName, ""),
        ]);
        assert_eq!(identity_from_cert(empty_cn.der()), None);
    }

    #[test]
    fn ca_cert_hash_is_the_sha256_of_the_public_key() {
        let ca = self_signed(&[(rcgen::DnType::CommonName, "trellis-ca")]);
        let hash = ca_cert_hash(ca.der()).unwrap();
        let hex = hash.strip_prefix("sha256:").unwrap();
        assert_eq!(hex.len(), 64);
        assert!(
            hex.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        let (_, x509) = x509_parser::parse_x509_certificate(ca.der()).unwrap();
        let digest = ring::digest::digest(&ring::digest::SHA256, x509.public_key().raw);
        let expected: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, expected);
        assert!(ca_cert_hash(b"not a certificate").is_err());
    }

    #[test]
    fn pem_round_trips_and_validity_reads_back() {
        let cert = self_signed(&[(rcgen::DnType::CommonName, "n1")]);
        let pem = pem_encode("CERTIFICATE", cert.der());
        assert!(pem.lines().all(|line| line.len() <= 64));
        assert_eq!(
            CertificateDer::from_pem_slice(pem.as_bytes()).unwrap(),
            *cert.der()
        );
        let (not_before, not_after) = cert_validity(&pem).unwrap();
        assert!(not_before < not_after);
    }
}
