//! The cluster's PKI under `DIR/pki/`: the CA, the API server's serving certificate,
//! the admin client certificate and the ServiceAccount token signing key.
//!
//! [`Pki::load_or_create`] is idempotent: the first start creates everything, later
//! starts reuse it. The CA is never replaced once it exists, because every credential
//! it issued (kubeconfigs handed out, node client certificates) would stop working;
//! leaf certificates are re-issued whenever they no longer fit (SANs changed, about
//! to expire, not signed by the CA on disk, key mismatch).
//!
//! # Files
//! - `ca.crt`, `ca.key`: self-signed CA, CN `trellis-ca`, 10 years.
//! - `apiserver.crt`, `apiserver.key`: serving certificate, 1 year.
//! - `admin.crt`, `admin.key`: client certificate CN `admin`, O `system:masters`, 1 year.
//! - `sa.key`: ECDSA P-256 key (PKCS#8) for signing ServiceAccount tokens.
//!
//! Keys are written with mode 0600, certificates with 0644, all atomically.
//!
//! What nodes use as well (certificate requests, the CA hash, private files) is
//! `trellis_pki`'s.

use std::collections::BTreeSet;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, PublicKeyData as _, SanType,
    SerialNumber, SigningKey as _,
};
use rustls::RootCertStore;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier as _;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, DnsName, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;
use trellis_pki::file::{CERT_MODE, KEY_MODE, create_private_dir, read_optional};
use trellis_pki::{pem_encode, write_file_atomic};
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;
use x509_parser::time::ASN1Time;

use trellis_pki::hostname;

/// The subdirectory of the data dir that holds the PKI.
const PKI_DIR: &str = "pki";

const CA_COMMON_NAME: &str = "trellis-ca";
/// As kube-apiserver's self-signed serving certificate; clients check SANs, not the CN.
const APISERVER_COMMON_NAME: &str = "trellis-apiserver";
const ADMIN_COMMON_NAME: &str = "admin";

const DAY: Duration = Duration::from_secs(24 * 60 * 60);
const CA_VALIDITY: Duration = Duration::from_secs(3650 * 24 * 60 * 60);
const LEAF_VALIDITY: Duration = Duration::from_secs(365 * 24 * 60 * 60);
/// Leaf certificates are re-issued on start when they expire within this window, so a
/// server restarted at least monthly never serves an expired certificate.
const RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 60 * 60);
/// Certificates start this far in the past so that peers whose clocks lag ours accept
/// them right away (Kubernetes backdates by the same amount).
const BACKDATE: Duration = Duration::from_secs(5 * 60);

/// The cluster's CA and the credentials the API server needs, loaded from (or created
/// in) `DIR/pki/`.
pub struct Pki {
    dir: PathBuf,
    ca: Ca,
    serving: CertAndKey,
    admin: CertAndKey,
    sa_key_pem: String,
    sa_public_key_pem: String,
}

// Written by hand so that private keys never end up in logs.
impl fmt::Debug for Pki {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pki")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl Pki {
    /// Loads the PKI from `dir/pki/`, creating whatever is missing and re-issuing leaf
    /// certificates that no longer fit. `hosts` are extra SANs (IP addresses or DNS
    /// names) for the serving certificate, on top of `127.0.0.1`, `::1`, `localhost`
    /// and the machine's hostname.
    ///
    /// Fails, naming the file, if a file is unreadable or corrupt, or if `ca.crt` exists
    /// without `ca.key`: a CA that exists is never regenerated.
    pub fn load_or_create(dir: &Path, hosts: &[String]) -> anyhow::Result<Pki> {
        // Before touching the disk: a typo in `hosts` should change nothing.
        let sans = Sans::wanted(hosts)?;
        let dir = dir.join(PKI_DIR);
        create_private_dir(&dir)?;
        let ca = Ca::load_or_create(&dir)?;
        let (sa_key_pem, sa_public_key_pem) = load_or_create_sa_key(&dir.join("sa.key"))?;
        let serving = ca.load_or_issue(
            &dir,
            "apiserver",
            &LeafSpec {
                common_name: APISERVER_COMMON_NAME.to_owned(),
                organizations: Vec::new(),
                usage: Usage::Server(sans),
                validity: LEAF_VALIDITY,
            },
        )?;
        let admin = ca.load_or_issue(
            &dir,
            "admin",
            &LeafSpec {
                common_name: ADMIN_COMMON_NAME.to_owned(),
                organizations: vec![trellis_api::user::groups::MASTERS.to_owned()],
                usage: Usage::Client,
                validity: LEAF_VALIDITY,
            },
        )?;
        Ok(Pki {
            dir,
            ca,
            serving,
            admin,
            sa_key_pem,
            sa_public_key_pem,
        })
    }

    /// The directory holding the PKI files (`DIR/pki`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA certificate, PEM: what clients trust and what client certificates are
    /// verified against.
    pub fn ca_pem(&self) -> &str {
        &self.ca.cert_pem
    }

    /// The CA certificate, DER.
    pub fn ca_cert_der(&self) -> &CertificateDer<'static> {
        &self.ca.cert_der
    }

    /// The serving certificate, PEM. The server presents it followed by the CA (see
    /// [`crate::server::tls::server_config`]), so that a joining node can find the CA
    /// it pins by hash.
    pub fn serving_cert_chain_pem(&self) -> &str {
        &self.serving.cert_pem
    }

    /// The serving certificate's private key, PEM (PKCS#8).
    pub fn serving_key_pem(&self) -> &str {
        &self.serving.key_pem
    }

    /// The admin client certificate (CN `admin`, O `system:masters`), PEM.
    pub fn admin_cert_pem(&self) -> &str {
        &self.admin.cert_pem
    }

    /// The admin client certificate's private key, PEM (PKCS#8).
    pub fn admin_key_pem(&self) -> &str {
        &self.admin.key_pem
    }

    /// The ECDSA P-256 private key that signs ServiceAccount tokens, PEM (PKCS#8).
    pub fn sa_key_pem(&self) -> &str {
        &self.sa_key_pem
    }

    /// The public half of [`Pki::sa_key_pem`], PEM (SubjectPublicKeyInfo), for
    /// verifying ServiceAccount tokens.
    pub fn sa_public_key_pem(&self) -> &str {
        &self.sa_public_key_pem
    }

    /// Issues a client certificate signed by the cluster CA with subject CN
    /// `common_name` and one O per group, as Kubernetes' x509 authenticator reads them.
    /// Returns the certificate and a fresh private key, both PEM.
    pub fn issue_client_cert(
        &self,
        common_name: &str,
        groups: &[&str],
        valid_days: u32,
    ) -> anyhow::Result<(String, String)> {
        ensure!(
            !common_name.is_empty(),
            "client certificate needs a common name"
        );
        ensure!(
            groups.iter().all(|g| !g.is_empty()),
            "client certificate groups must not be empty"
        );
        ensure!(
            valid_days > 0,
            "client certificate validity must be at least a day"
        );
        let issued = self
            .ca
            .issue(&LeafSpec {
                common_name: common_name.to_owned(),
                organizations: groups.iter().map(|g| (*g).to_owned()).collect(),
                usage: Usage::Client,
                validity: DAY * valid_days,
            })
            .with_context(|| format!("issue client certificate for {common_name}"))?;
        Ok((issued.cert_pem, issued.key_pem))
    }

    /// Signs a certificate request (PEM) with the cluster CA as a client certificate:
    /// the request's key, subject CN `common_name` and one O per group, the usages
    /// given, valid for `validity` from now. The request's signature is checked first.
    pub fn sign_client_request(
        &self,
        request_pem: &str,
        common_name: &str,
        groups: &[String],
        usages: ClientUsages,
        validity: Duration,
    ) -> anyhow::Result<String> {
        ensure!(
            !common_name.is_empty(),
            "client certificate needs a common name"
        );
        let mut request = rcgen::CertificateSigningRequestParams::from_pem(request_pem)
            .context("parse the certificate request")?;
        let now = ASN1Time::now().to_datetime();
        let params = &mut request.params;
        // Backdated for clocks behind ours, as Kubernetes' signer does, but by no more
        // than a tenth of a short lifetime: a node rotates at 70–90 % of it.
        params.not_before = now - BACKDATE.min(validity / 10);
        params.not_after = now + validity;
        params.serial_number = Some(random_serial());
        // Replaced by `der_name` below, as in `Ca::issue`.
        let mut placeholder = DistinguishedName::new();
        placeholder.push(DnType::CommonName, common_name);
        params.distinguished_name = placeholder;
        params.subject_alt_names = Vec::new();
        params.is_ca = rcgen::IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        if usages.key_encipherment {
            params.key_usages.push(KeyUsagePurpose::KeyEncipherment);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let draft = request
            .signed_by(&self.ca.issuer)
            .context("sign the certificate")?;
        let der = self
            .ca
            .rename(draft.der(), &der_name(common_name, groups))?;
        Ok(pem_encode("CERTIFICATE", &der))
    }
}

/// Key usages of a signed client certificate beyond digital signature and client auth.
#[derive(Clone, Copy, Debug, Default)]
pub struct ClientUsages {
    /// `key encipherment`, which RSA keys of older clients ask for.
    pub key_encipherment: bool,
}

/// A certificate and its private key, both PEM.
struct CertAndKey {
    cert_pem: String,
    key_pem: String,
}

/// What a leaf certificate should look like.
struct LeafSpec {
    common_name: String,
    organizations: Vec<String>,
    usage: Usage,
    validity: Duration,
}

enum Usage {
    Server(Sans),
    Client,
}

/// The cluster CA, ready to issue and to verify.
struct Ca {
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    /// The CA's subject exactly as encoded in its certificate. Issued certificates carry
    /// it byte for byte as their issuer, which is how verifiers find the CA, whatever
    /// string types the CA certificate happens to use.
    subject_der: Vec<u8>,
    issuer: Issuer<'static, KeyPair>,
    server_verifier: Arc<WebPkiServerVerifier>,
    client_verifier: Arc<dyn ClientCertVerifier>,
}

impl Ca {
    fn load_or_create(dir: &Path) -> anyhow::Result<Ca> {
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
    fn load_or_issue(&self, dir: &Path, name: &str, spec: &LeafSpec) -> anyhow::Result<CertAndKey> {
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
    fn issue(&self, spec: &LeafSpec) -> anyhow::Result<CertAndKey> {
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
    fn rename(&self, cert_der: &[u8], subject: &[u8]) -> anyhow::Result<Vec<u8>> {
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

fn load_or_create_sa_key(path: &Path) -> anyhow::Result<(String, String)> {
    let key = match read_optional(path)? {
        Some(pem) => parse_key(path, &pem)?,
        None => {
            tracing::info!(file = %path.display(), "creating ServiceAccount signing key");
            let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
                .context("generate ServiceAccount signing key")?;
            write_file_atomic(path, key.serialize_pem().as_bytes(), KEY_MODE)?;
            key
        }
    };
    Ok((key.serialize_pem(), key.public_key_pem()))
}

/// The SANs of a serving certificate, normalised so that sets compare equal regardless
/// of order, case and trailing dots.
#[derive(Debug, PartialEq, Eq)]
struct Sans {
    ips: BTreeSet<IpAddr>,
    dns: BTreeSet<String>,
    /// SANs of other kinds, which only a certificate we did not issue has: they make
    /// it differ from what is wanted, so it gets re-issued.
    other: BTreeSet<String>,
}

impl Sans {
    fn wanted(hosts: &[String]) -> anyhow::Result<Sans> {
        let mut sans = Sans {
            ips: BTreeSet::from([
                IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(Ipv6Addr::LOCALHOST),
            ]),
            dns: BTreeSet::from(["localhost".to_owned()]),
            other: BTreeSet::new(),
        };
        match hostname() {
            Some(name) => match normalize_dns_name(&name) {
                Ok(name) => {
                    sans.dns.insert(name);
                }
                Err(e) => tracing::debug!(%name, "hostname left out of SANs: {e:#}"),
            },
            None => tracing::debug!("hostname unknown, left out of SANs"),
        }
        for host in hosts {
            let host = host.trim();
            match host.parse::<IpAddr>() {
                Ok(ip) => {
                    sans.ips.insert(ip);
                }
                Err(_) => {
                    sans.dns.insert(normalize_dns_name(host)?);
                }
            }
        }
        Ok(sans)
    }

    fn of(x509: &X509Certificate<'_>) -> anyhow::Result<Sans> {
        let mut sans = Sans {
            ips: BTreeSet::new(),
            dns: BTreeSet::new(),
            other: BTreeSet::new(),
        };
        let Some(extension) = x509
            .subject_alternative_name()
            .map_err(|e| anyhow!("parse subjectAltName: {e}"))?
        else {
            return Ok(sans);
        };
        for name in &extension.value.general_names {
            match name {
                GeneralName::DNSName(name) => {
                    sans.dns
                        .insert(name.trim_end_matches('.').to_ascii_lowercase());
                }
                GeneralName::IPAddress(bytes) => {
                    let ip = match bytes.len() {
                        4 => <[u8; 4]>::try_from(*bytes).map(IpAddr::from).ok(),
                        16 => <[u8; 16]>::try_from(*bytes).map(IpAddr::from).ok(),
                        _ => None,
                    };
                    sans.ips
                        .insert(ip.ok_or_else(|| anyhow!("IP SAN of {} bytes", bytes.len()))?);
                }
                other => {
                    sans.other.insert(format!("{other:?}"));
                }
            }
        }
        Ok(sans)
    }

    fn to_rcgen(&self) -> anyhow::Result<Vec<SanType>> {
        let mut sans: Vec<SanType> = self.ips.iter().map(|ip| SanType::IpAddress(*ip)).collect();
        for name in &self.dns {
            sans.push(SanType::DnsName(
                name.as_str()
                    .try_into()
                    .with_context(|| format!("encode DNS SAN {name}"))?,
            ));
        }
        Ok(sans)
    }
}

impl fmt::Display for Sans {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ips = self.ips.iter().map(ToString::to_string);
        let names: Vec<String> = ips
            .chain(self.dns.iter().cloned())
            .chain(self.other.iter().cloned())
            .collect();
        write!(f, "[{}]", names.join(", "))
    }
}

fn normalize_dns_name(name: &str) -> anyhow::Result<String> {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    DnsName::try_from(name.as_str())
        .map_err(|e| anyhow!("{name:?} is neither an IP address nor a DNS name: {e}"))?;
    Ok(name)
}

fn expires_within(x509: &X509Certificate<'_>, window: Duration) -> bool {
    let deadline = ASN1Time::now().to_datetime() + window;
    x509.validity().not_after.to_datetime() <= deadline
}

/// A random positive 128-bit serial: rcgen's default derives the serial from the public
/// key, which clients may flag when two certificates from one CA share it.
fn random_serial() -> SerialNumber {
    let mut bytes: [u8; 16] = rand::random();
    // Positive and of fixed length in DER.
    bytes[0] = (bytes[0] & 0x7f) | 0x40;
    SerialNumber::from_slice(&bytes)
}

/// A DER X.501 Name: one RDN per organization (Kubernetes groups), then the common
/// name, the order Go's crypto/x509 writes them in.
fn der_name(common_name: &str, organizations: &[String]) -> Vec<u8> {
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

fn parse_x509<'a>(path: &Path, der: &'a [u8]) -> anyhow::Result<X509Certificate<'a>> {
    let (_, x509) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| anyhow!("parse {}: {e}", path.display()))?;
    Ok(x509)
}

fn parse_key(path: &Path, pem: &str) -> anyhow::Result<KeyPair> {
    KeyPair::from_pem(pem)
        .with_context(|| format!("parse {}: not a PEM private key", path.display()))
}

/// Just enough DER to rewrite the names in a certificate.
mod der {
    use anyhow::{bail, ensure};

    pub(super) const VERSION: u8 = 0xa0;
    pub(super) const BIT_STRING: u8 = 0x03;
    pub(super) const SEQUENCE: u8 = 0x30;
    const SET: u8 = 0x31;
    const OID: u8 = 0x06;
    const UTF8_STRING: u8 = 0x0c;
    /// 2.5.4.3
    pub(super) const OID_COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];
    /// 2.5.4.10
    pub(super) const OID_ORGANIZATION: &[u8] = &[0x55, 0x04, 0x0a];

    /// Splits the first TLV off `input`: returns it whole and what follows.
    pub(super) fn next(input: &[u8]) -> anyhow::Result<(&[u8], &[u8])> {
        let (header, content_len) = header(input)?;
        let end = header
            .checked_add(content_len)
            .filter(|end| *end <= input.len());
        let Some(end) = end else {
            bail!("truncated DER value");
        };
        Ok(input.split_at(end))
    }

    /// Expects a TLV with `tag` first in `input`: returns its content and what follows.
    pub(super) fn split(input: &[u8], tag: u8) -> anyhow::Result<(&[u8], &[u8])> {
        ensure!(input.first() == Some(&tag), "expected DER tag {tag:#04x}");
        let (whole, rest) = next(input)?;
        let (header, _) = header(whole)?;
        Ok((&whole[header..], rest))
    }

    /// The header length and content length of the TLV at the start of `input`.
    fn header(input: &[u8]) -> anyhow::Result<(usize, usize)> {
        let (Some(tag), Some(first)) = (input.first(), input.get(1)) else {
            bail!("truncated DER header");
        };
        ensure!(tag & 0x1f != 0x1f, "multi-byte DER tags are not supported");
        if first & 0x80 == 0 {
            return Ok((2, usize::from(*first)));
        }
        let count = usize::from(first & 0x7f);
        ensure!((1..=4).contains(&count), "unsupported DER length form");
        let Some(bytes) = input.get(2..2 + count) else {
            bail!("truncated DER length");
        };
        let len = bytes
            .iter()
            .fold(0usize, |len, byte| (len << 8) | usize::from(*byte));
        Ok((2 + count, len))
    }

    pub(super) fn tlv(tag: u8, content: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        let len = content.len();
        if len < 0x80 {
            // Fits in the short form by the check above.
            out.push(len as u8);
        } else {
            let bytes = len.to_be_bytes();
            let skip = bytes.iter().take_while(|b| **b == 0).count();
            let significant = &bytes[skip..];
            // At most size_of::<usize>() bytes, far below 0x7f.
            out.push(0x80 | significant.len() as u8);
            out.extend_from_slice(significant);
        }
        out.extend_from_slice(content);
        out
    }

    /// A RelativeDistinguishedName holding one attribute.
    pub(super) fn rdn(oid: &[u8], value: &str) -> Vec<u8> {
        let attribute = [tlv(OID, oid), tlv(UTF8_STRING, value.as_bytes())].concat();
        tlv(SET, &tlv(SEQUENCE, &attribute))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    fn x509_of(pem: &str) -> (CertificateDer<'static>, String) {
        let der = CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
        let subject = parse_x509(Path::new("test"), &der)
            .unwrap()
            .subject()
            .to_string();
        (der, subject)
    }

    #[test]
    fn creates_every_file_with_private_keys() {
        let dir = tempfile::tempdir().unwrap();
        Pki::load_or_create(dir.path(), &[]).unwrap();
        let pki = dir.path().join("pki");
        for file in ["ca.crt", "apiserver.crt", "admin.crt"] {
            assert!(pki.join(file).is_file(), "{file} missing");
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            for file in ["ca.key", "apiserver.key", "admin.key", "sa.key"] {
                let mode = std::fs::metadata(pki.join(file))
                    .unwrap()
                    .permissions()
                    .mode();
                assert_eq!(mode & 0o777, 0o600, "{file} mode {mode:o}");
            }
            let mode = std::fs::metadata(&pki).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700);
        }
        let leftovers: Vec<_> = std::fs::read_dir(&pki)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn reload_reuses_ca_and_leaves() {
        let dir = tempfile::tempdir().unwrap();
        let first = Pki::load_or_create(dir.path(), &hosts(&["10.0.0.1"])).unwrap();
        let second = Pki::load_or_create(dir.path(), &hosts(&["10.0.0.1"])).unwrap();
        assert_eq!(first.ca_pem(), second.ca_pem());
        assert_eq!(
            first.serving_cert_chain_pem(),
            second.serving_cert_chain_pem()
        );
        assert_eq!(first.serving_key_pem(), second.serving_key_pem());
        assert_eq!(first.admin_cert_pem(), second.admin_cert_pem());
        assert_eq!(first.admin_key_pem(), second.admin_key_pem());
        assert_eq!(first.sa_key_pem(), second.sa_key_pem());
        assert!(first.sa_public_key_pem().contains("BEGIN PUBLIC KEY"));
    }

    #[test]
    fn ca_is_self_signed_ten_year_ca() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        let (der, subject) = x509_of(pki.ca_pem());
        let x509 = parse_x509(Path::new("ca"), &der).unwrap();
        assert_eq!(subject, "CN=trellis-ca");
        assert_eq!(x509.issuer().as_raw(), x509.subject().as_raw());
        assert!(x509.is_ca());
        let lifetime =
            x509.validity().not_after.timestamp() - x509.validity().not_before.timestamp();
        assert!(lifetime >= 3649 * 86400, "lifetime {lifetime}s");
    }

    #[test]
    fn serving_cert_has_default_and_extra_sans() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(
            dir.path(),
            &hosts(&["192.168.1.10", "fd00::1", "API.Example.com."]),
        )
        .unwrap();
        let (der, _) = x509_of(pki.serving_cert_chain_pem());
        let x509 = parse_x509(Path::new("apiserver"), &der).unwrap();
        let sans = Sans::of(&x509).unwrap();
        // The subject is set, so the SAN extension need not be critical.
        assert!(!x509.subject_alternative_name().unwrap().unwrap().critical);
        let ips: Vec<String> = sans.ips.iter().map(ToString::to_string).collect();
        assert_eq!(ips, ["127.0.0.1", "192.168.1.10", "::1", "fd00::1"]);
        assert!(sans.dns.contains("localhost"));
        assert!(sans.dns.contains("api.example.com"));
        if let Some(name) = hostname() {
            assert!(sans.dns.contains(&name.to_ascii_lowercase()), "{sans}");
        }
        let lifetime =
            x509.validity().not_after.timestamp() - x509.validity().not_before.timestamp();
        assert!(
            (364 * 86400..=366 * 86400).contains(&lifetime),
            "lifetime {lifetime}s"
        );
        // Signed by the CA on disk.
        let ca = parse_x509(Path::new("ca"), pki.ca_cert_der()).unwrap();
        assert_eq!(x509.issuer().as_raw(), ca.subject().as_raw());
    }

    #[test]
    fn changed_hosts_reissue_serving_cert_but_keep_ca() {
        let dir = tempfile::tempdir().unwrap();
        let first = Pki::load_or_create(dir.path(), &hosts(&["10.0.0.1"])).unwrap();
        let second = Pki::load_or_create(dir.path(), &hosts(&["10.0.0.2"])).unwrap();
        assert_eq!(first.ca_pem(), second.ca_pem());
        assert_ne!(
            first.serving_cert_chain_pem(),
            second.serving_cert_chain_pem()
        );
        assert_eq!(first.admin_cert_pem(), second.admin_cert_pem());
        let (der, _) = x509_of(second.serving_cert_chain_pem());
        let sans = Sans::of(&parse_x509(Path::new("apiserver"), &der).unwrap()).unwrap();
        assert!(sans.ips.contains(&"10.0.0.2".parse::<IpAddr>().unwrap()));
        assert!(!sans.ips.contains(&"10.0.0.1".parse::<IpAddr>().unwrap()));
    }

    #[test]
    fn leaves_from_a_replaced_ca_are_reissued() {
        let dir = tempfile::tempdir().unwrap();
        let first = Pki::load_or_create(dir.path(), &[]).unwrap();
        let pki_dir = dir.path().join("pki");
        std::fs::remove_file(pki_dir.join("ca.crt")).unwrap();
        std::fs::remove_file(pki_dir.join("ca.key")).unwrap();
        let second = Pki::load_or_create(dir.path(), &[]).unwrap();
        assert_ne!(first.ca_pem(), second.ca_pem());
        assert_ne!(
            first.serving_cert_chain_pem(),
            second.serving_cert_chain_pem()
        );
        assert_ne!(first.admin_cert_pem(), second.admin_cert_pem());
    }

    #[test]
    fn mismatched_leaf_key_is_reissued() {
        let dir = tempfile::tempdir().unwrap();
        let first = Pki::load_or_create(dir.path(), &[]).unwrap();
        let pki_dir = dir.path().join("pki");
        std::fs::copy(pki_dir.join("sa.key"), pki_dir.join("admin.key")).unwrap();
        let second = Pki::load_or_create(dir.path(), &[]).unwrap();
        assert_ne!(first.admin_cert_pem(), second.admin_cert_pem());
        assert_ne!(second.admin_key_pem(), second.sa_key_pem());
    }

    #[test]
    fn missing_ca_cert_is_resigned_with_the_same_key() {
        let dir = tempfile::tempdir().unwrap();
        let first = Pki::load_or_create(dir.path(), &[]).unwrap();
        std::fs::remove_file(dir.path().join("pki/ca.crt")).unwrap();
        let second = Pki::load_or_create(dir.path(), &[]).unwrap();
        // Same key and subject: the existing leaves still verify and are kept.
        assert_eq!(
            first.serving_cert_chain_pem(),
            second.serving_cert_chain_pem()
        );
        assert_eq!(first.admin_cert_pem(), second.admin_cert_pem());
    }

    #[test]
    fn refuses_ca_cert_without_key() {
        let dir = tempfile::tempdir().unwrap();
        Pki::load_or_create(dir.path(), &[]).unwrap();
        std::fs::remove_file(dir.path().join("pki/ca.key")).unwrap();
        let err = Pki::load_or_create(dir.path(), &[]).unwrap_err();
        assert!(format!("{err:#}").contains("ca.key"), "{err:#}");
        assert!(dir.path().join("pki/ca.crt").exists());
    }

    #[test]
    fn corrupt_pem_error_names_the_file() {
        for file in ["ca.crt", "ca.key", "apiserver.crt", "admin.key", "sa.key"] {
            let dir = tempfile::tempdir().unwrap();
            Pki::load_or_create(dir.path(), &[]).unwrap();
            let ca_before = std::fs::read(dir.path().join("pki/ca.crt")).unwrap();
            std::fs::write(dir.path().join("pki").join(file), "not a pem\n").unwrap();
            let err = Pki::load_or_create(dir.path(), &[]).unwrap_err();
            assert!(format!("{err:#}").contains(file), "{file}: {err:#}");
            if file != "ca.crt" {
                assert_eq!(
                    std::fs::read(dir.path().join("pki/ca.crt")).unwrap(),
                    ca_before
                );
            }
        }
    }

    #[test]
    fn rejects_invalid_host() {
        let dir = tempfile::tempdir().unwrap();
        let err = Pki::load_or_create(dir.path(), &hosts(&["not a host!"])).unwrap_err();
        assert!(format!("{err:#}").contains("not a host!"), "{err:#}");
        assert!(!dir.path().join("pki").exists());
    }

    #[test]
    fn client_cert_carries_one_organization_per_group() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        let (cert, key) = pki
            .issue_client_cert("system:node:n1", &["system:nodes", "team-a", "team-b"], 7)
            .unwrap();
        assert!(key.contains("PRIVATE KEY"));
        let (der, subject) = x509_of(&cert);
        assert_eq!(
            subject,
            "O=system:nodes, O=team-a, O=team-b, CN=system:node:n1"
        );
        let x509 = parse_x509(Path::new("client"), &der).unwrap();
        let lifetime =
            x509.validity().not_after.timestamp() - x509.validity().not_before.timestamp();
        assert_eq!(lifetime, 7 * 86400 + BACKDATE.as_secs() as i64);
        // The rewritten certificate still verifies under the CA.
        pki.ca
            .client_verifier
            .verify_client_cert(&der, &[], UnixTime::now())
            .unwrap();
        // And the public key is the returned key's.
        let key = KeyPair::from_pem(&key).unwrap();
        assert_eq!(
            x509.public_key().raw,
            key.subject_public_key_info().as_slice()
        );
    }

    #[test]
    fn admin_cert_is_cn_admin_in_system_masters() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        let (_, subject) = x509_of(pki.admin_cert_pem());
        assert_eq!(subject, "O=system:masters, CN=admin");
    }

    #[test]
    fn client_certs_get_distinct_serials() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        let serial = |pem: &str| {
            let (der, _) = x509_of(pem);
            parse_x509(Path::new("c"), &der)
                .unwrap()
                .raw_serial()
                .to_vec()
        };
        let (a, _) = pki.issue_client_cert("a", &[], 1).unwrap();
        let (b, _) = pki.issue_client_cert("a", &[], 1).unwrap();
        assert_ne!(serial(&a), serial(&b));
        assert_ne!(serial(&a), serial(pki.admin_cert_pem()));
    }

    #[test]
    fn rejects_empty_client_identity() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        assert!(pki.issue_client_cert("", &["g"], 1).is_err());
        assert!(pki.issue_client_cert("u", &[""], 1).is_err());
        assert!(pki.issue_client_cert("u", &[], 0).is_err());
    }

    #[test]
    fn der_lengths_round_trip() {
        for len in [0usize, 1, 127, 128, 255, 256, 70_000] {
            let content = vec![7u8; len];
            let encoded = der::tlv(der::SEQUENCE, &content);
            let (decoded, rest) = der::split(&encoded, der::SEQUENCE).unwrap();
            assert_eq!(decoded, content.as_slice(), "len {len}");
            assert!(rest.is_empty());
        }
        assert!(der::next(&[0x30, 0x05, 0x00]).is_err());
        assert!(der::next(&[0x30, 0x82, 0x01]).is_err());
    }
}
