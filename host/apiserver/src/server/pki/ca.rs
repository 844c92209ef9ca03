//! The cluster's certificate authority: the CA on disk, the leaf certificates it
//! issues, and when an existing leaf must be issued again (as Kubernetes keeps its
//! `CertificateAuthority` apart from the signer that calls it).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, PublicKeyData as _, SerialNumber,
    SigningKey as _,
};
use rustls::RootCertStore;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier as _;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, DnsName, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;
use trellis_pki::file::{CERT_MODE, KEY_MODE, read_optional};
use trellis_pki::{pem_encode, write_file_atomic};
use x509_parser::certificate::X509Certificate;
use x509_parser::time::ASN1Time;

use super::der;
use super::sans::Sans;

const CA_COMMON_NAME: &str = "trellis-ca";

const CA_VALIDITY: Duration = Duration::from_secs(3650 * 24 * 60 * 60);
pub(super) const LEAF_VALIDITY: Duration = Duration::from_secs(365 * 24 * 60 * 60);
/// Leaf certificates are re-issued on start when they expire within this window, so a
/// server restarted at least monthly never serves an expired certificate.
const RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 60 * 60);
/// Certificates start this far in the past so that peers whose clocks lag ours accept
/// them right away (Kubernetes backdates by the same amount).
pub(super) const BACKDATE: Duration = Duration::from_secs(5 * 60);

/// A certificate and its private key, both PEM.
pub(super) struct CertAndKey {
    pub(super) cert_pem: String,
    pub(super) key_pem: String,
}

/// What a leaf certificate should look like.
pub(super) struct LeafSpec {
    pub(super) common_name: String,
    pub(super) organizations: Vec<String>,
    pub(super) usage: Usage,
    pub(super) validity: Duration,
}

pub(super) enum Usage {
    Server(Sans),
    Client,
}

/// The cluster CA, ready to issue and to verify.
pub(super) struct Ca {
    pub(super) cert_pem: String,
    pub(super) cert_der: CertificateDer<'static>,
    /// The CA's subject exactly as encoded in its certificate. Issued certificates carry
    /// it byte for byte as their issuer, which is how verifiers find the CA, whatever
    /// string types the CA certificate happens to use.
    subject_der: Vec<u8>,
    pub(super) issuer: Issuer<'static, KeyPair>,
    server_verifier: Arc<WebPkiServerVerifier>,
    pub(super) client_verifier: Arc<dyn ClientCertVerifier>,
}

impl Ca {
    pub(super) fn load_or_create(dir: &Path) -> anyhow::Result<Ca> {
        let cert_path = dir.join("ca.crt");
        let key_path = dir.join("ca.key");
        let cert_pem = read_optional(&cert_path)?;
        let key_pem = read_optional(&key_path)?;
        match (cert_pem, key_pem) {
            (Some(cert_pem), Some(key_pem)) => {
                let key = parse_key(&key_path, &key_pem)?;
                Ca::from_parts(&cert_path, cert_pem, &key_path, key)
            }
            (Some(_), None) => bail!(
                "{} exists but {} is missing; refusing to create a new CA, which would \
                 invalidate every credential the existing one issued",
                cert_path.display(),
                key_path.display()
            ),
            (None, Some(key_pem)) => {
                // Only the key was written (the CA key goes to disk first): nothing can
                // have been issued under a certificate that never existed, and a
                // re-signed certificate with the same key and subject would verify the
                // same leaves anyway.
                tracing::warn!(file = %cert_path.display(), "CA certificate missing, re-signing it with the existing key");
                let key = parse_key(&key_path, &key_pem)?;
                let cert_pem = self_signed_ca(&key)?;
                write_file_atomic(&cert_path, cert_pem.as_bytes(), CERT_MODE)?;
                Ca::from_parts(&cert_path, cert_pem, &key_path, key)
            }
            (None, None) => {
                tracing::info!(dir = %dir.display(), "creating cluster CA");
                let key =
                    KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).context("generate CA key")?;
                write_file_atomic(&key_path, key.serialize_pem().as_bytes(), KEY_MODE)?;
                let cert_pem = self_signed_ca(&key)?;
                write_file_atomic(&cert_path, cert_pem.as_bytes(), CERT_MODE)?;
                Ca::from_parts(&cert_path, cert_pem, &key_path, key)
            }
        }
    }

    fn from_parts(
        cert_path: &Path,
        cert_pem: String,
        key_path: &Path,
        key: KeyPair,
    ) -> anyhow::Result<Ca> {
        let cert_der = parse_cert_pem(cert_path, &cert_pem)?;
        let x509 = parse_x509(cert_path, &cert_der)?;
        ensure!(
            x509.is_ca(),
            "{} is not a CA certificate (basicConstraints CA:TRUE missing)",
            cert_path.display()
        );
        ensure!(
            x509.public_key().raw == key.subject_public_key_info().as_slice(),
            "{} is not the key of {}",
            key_path.display(),
            cert_path.display()
        );
        let not_after = x509.validity().not_after;
        ensure!(
            not_after > ASN1Time::now(),
            "CA certificate {} expired at {not_after}",
            cert_path.display()
        );
        if expires_within(&x509, RENEW_BEFORE) {
            tracing::warn!(file = %cert_path.display(), %not_after, "CA certificate expires soon");
        }
        let subject_der = x509.subject().as_raw().to_vec();

        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        roots
            .add(cert_der.clone())
            .with_context(|| format!("use {} as a trust anchor", cert_path.display()))?;
        let roots = Arc::new(roots);
        let server_verifier =
            WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone())
                .build()
                .context("build serving certificate verifier")?;
        let client_verifier = WebPkiClientVerifier::builder_with_provider(roots, provider)
            .build()
            .context("build client certificate verifier")?;

        Ok(Ca {
            cert_pem,
            cert_der,
            subject_der,
            // The parameters only feed the issuer name, which `issue` overwrites with
            // `subject_der`, and the key identifier method, which is unused.
            issuer: Issuer::new(ca_params(), key),
            server_verifier,
            client_verifier,
        })
    }

    /// Loads `dir/{name}.crt` and `dir/{name}.key`, re-issuing them when they are
    /// missing or no longer match `spec`.
    pub(super) fn load_or_issue(
        &self,
        dir: &Path,
        name: &str,
        spec: &LeafSpec,
    ) -> anyhow::Result<CertAndKey> {
        let cert_path = dir.join(format!("{name}.crt"));
        let key_path = dir.join(format!("{name}.key"));
        let reason = match (read_optional(&cert_path)?, read_optional(&key_path)?) {
            (Some(cert_pem), Some(key_pem)) => {
                let existing = CertAndKey { cert_pem, key_pem };
                match self.mismatch(&cert_path, &key_path, &existing, spec)? {
                    None => return Ok(existing),
                    Some(reason) => reason,
                }
            }
            _ => "missing".to_owned(),
        };
        tracing::info!(file = %cert_path.display(), %reason, "issuing certificate");
        let issued = self
            .issue(spec)
            .with_context(|| format!("issue {}", cert_path.display()))?;
        // Key first: a crash in between leaves a certificate that does not match its
        // key, which the next start re-issues.
        write_file_atomic(&key_path, issued.key_pem.as_bytes(), KEY_MODE)?;
        write_file_atomic(&cert_path, issued.cert_pem.as_bytes(), CERT_MODE)?;
        Ok(issued)
    }

    /// Why an existing leaf certificate must be re-issued, or `None` if it is fine.
    fn mismatch(
        &self,
        cert_path: &Path,
        key_path: &Path,
        existing: &CertAndKey,
        spec: &LeafSpec,
    ) -> anyhow::Result<Option<String>> {
        let cert_der = parse_cert_pem(cert_path, &existing.cert_pem)?;
        let x509 = parse_x509(cert_path, &cert_der)?;
        let key = parse_key(key_path, &existing.key_pem)?;
        if x509.public_key().raw != key.subject_public_key_info().as_slice() {
            return Ok(Some(format!("does not match {}", key_path.display())));
        }
        let verified = match &spec.usage {
            Usage::Server(_) => self
                .server_verifier
                .verify_server_cert(
                    &cert_der,
                    &[],
                    &ServerName::DnsName(DnsName::try_from("localhost")?),
                    &[],
                    UnixTime::now(),
                )
                .map(|_| ()),
            Usage::Client => self
                .client_verifier
                .verify_client_cert(&cert_der, &[], UnixTime::now())
                .map(|_| ()),
        };
        if let Err(e) = verified {
            return Ok(Some(format!("not valid under the current CA: {e}")));
        }
        if expires_within(&x509, RENEW_BEFORE) {
            return Ok(Some(format!("expires at {}", x509.validity().not_after)));
        }
        if x509.subject().as_raw() != der_name(&spec.common_name, &spec.organizations) {
            return Ok(Some(format!("subject changed from {}", x509.subject())));
        }
        if let Usage::Server(wanted) = &spec.usage {
            let current =
                Sans::of(&x509).with_context(|| format!("read SANs of {}", cert_path.display()))?;
            if &current != wanted {
                return Ok(Some(format!("SANs changed from {current}")));
            }
        }
        Ok(None)
    }

    /// Issues a certificate for a fresh ECDSA P-256 key.
    pub(super) fn issue(&self, spec: &LeafSpec) -> anyhow::Result<CertAndKey> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).context("generate key")?;
        let now = ASN1Time::now().to_datetime();
        let mut params = CertificateParams::default();
        params.not_before = now - BACKDATE;
        params.not_after = now + spec.validity;
        params.serial_number = Some(random_serial());
        // Replaced by `der_name` below: rcgen keeps one value per attribute type, and
        // a client certificate needs one O per group. Not empty, or rcgen would mark
        // the SAN extension critical (RFC 5280 asks that of subjectless certificates).
        let mut placeholder = DistinguishedName::new();
        placeholder.push(DnType::CommonName, spec.common_name.as_str());
        params.distinguished_name = placeholder;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        match &spec.usage {
            Usage::Server(sans) => {
                params.subject_alt_names = sans.to_rcgen()?;
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
            }
            Usage::Client => {
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            }
        }
        let draft = params
            .signed_by(&key, &self.issuer)
            .context("sign certificate")?;
        let der = self.rename(
            draft.der(),
            &der_name(&spec.common_name, &spec.organizations),
        )?;
        Ok(CertAndKey {
            cert_pem: pem_encode("CERTIFICATE", &der),
            key_pem: key.serialize_pem(),
        })
    }

    /// Rewrites the issuer and subject of a certificate rcgen signed, and signs it again.
    pub(super) fn rename(&self, cert_der: &[u8], subject: &[u8]) -> anyhow::Result<Vec<u8>> {
        let (cert, _) = der::split(cert_der, der::SEQUENCE)?;
        let (tbs, rest) = der::next(cert)?;
        let (signature_algorithm, _) = der::next(rest)?;
        let (mut fields, _) = der::split(tbs, der::SEQUENCE)?;
        // TBSCertificate: version, serialNumber, signature, issuer, validity, subject,
        // subjectPublicKeyInfo, extensions.
        let mut tbs_fields = Vec::new();
        while !fields.is_empty() {
            let (field, rest) = der::next(fields)?;
            tbs_fields.push(field);
            fields = rest;
        }
        ensure!(
            tbs_fields.len() >= 7 && tbs_fields[0].first() == Some(&der::VERSION),
            "unexpected TBSCertificate layout from rcgen"
        );
        tbs_fields[3] = &self.subject_der;
        tbs_fields[5] = subject;
        let tbs = der::tlv(der::SEQUENCE, &tbs_fields.concat());
        let signature = self.issuer.key().sign(&tbs).context("sign certificate")?;
        let mut bits = Vec::with_capacity(signature.len() + 1);
        bits.push(0); // no unused bits
        bits.extend_from_slice(&signature);
        Ok(der::tlv(
            der::SEQUENCE,
            &[
                tbs,
                signature_algorithm.to_vec(),
                der::tlv(der::BIT_STRING, &bits),
            ]
            .concat(),
        ))
    }
}

fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, CA_COMMON_NAME);
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params
}

fn self_signed_ca(key: &KeyPair) -> anyhow::Result<String> {
    let now = ASN1Time::now().to_datetime();
    let mut params = ca_params();
    params.not_before = now - BACKDATE;
    params.not_after = now + CA_VALIDITY;
    params.serial_number = Some(random_serial());
    let cert = params
        .self_signed(key)
        .context("self-sign CA certificate")?;
    Ok(cert.pem())
}

fn expires_within(x509: &X509Certificate<'_>, window: Duration) -> bool {
    let deadline = ASN1Time::now().to_datetime() + window;
    x509.validity().not_after.to_datetime() <= deadline
}

/// A random positive 128-bit serial: rcgen's default derives the serial from the public
/// key, which clients may flag when two certificates from one CA share it.
pub(super) fn random_serial() -> SerialNumber {
    let mut bytes: [u8; 16] = rand::random();
    // Positive and of fixed length in DER.
    bytes[0] = (bytes[0] & 0x7f) | 0x40;
    SerialNumber::from_slice(&bytes)
}

/// A DER X.501 Name: one RDN per organization (Kubernetes groups), then the common
/// name, the order Go's crypto/x509 writes them in.
pub(super) fn der_name(common_name: &str, organizations: &[String]) -> Vec<u8> {
    let mut rdns = Vec::new();
    for organization in organizations {
        rdns.extend(der::rdn(der::OID_ORGANIZATION, organization));
    }
    rdns.extend(der::rdn(der::OID_COMMON_NAME, common_name));
    der::tlv(der::SEQUENCE, &rdns)
}

fn parse_cert_pem(path: &Path, pem: &str) -> anyhow::Result<CertificateDer<'static>> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .with_context(|| format!("parse {}: not a PEM certificate", path.display()))
}

pub(super) fn parse_x509<'a>(path: &Path, der: &'a [u8]) -> anyhow::Result<X509Certificate<'a>> {
    let (_, x509) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| anyhow!("parse {}: {e}", path.display()))?;
    Ok(x509)
}

pub(super) fn parse_key(path: &Path, pem: &str) -> anyhow::Result<KeyPair> {
    KeyPair::from_pem(pem)
        .with_context(|| format!("parse {}: not a PEM private key", path.display()))
}
