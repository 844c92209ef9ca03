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
//!
//! # Layout
//! - this file: [`Pki`], the files under `DIR/pki/` and what the server reads of them.
//! - `ca`: the certificate authority: loading or creating the CA, issuing leaf
//!   certificates and deciding when one must be re-issued.
//! - `signer`: client certificates signed on request ([`Pki::issue_client_cert`],
//!   [`Pki::sign_client_request`]), as Kubernetes' certificate signer issues them.
//! - `sans`: the subject alternative names of the serving certificate.
//! - `der`: just enough DER to rewrite the names in a certificate.

use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use rcgen::{KeyPair, PKCS_ECDSA_P256_SHA256};
use rustls::pki_types::CertificateDer;
use trellis_pki::file::{KEY_MODE, create_private_dir, read_optional};
use trellis_pki::write_file_atomic;

use self::ca::{Ca, CertAndKey, LEAF_VALIDITY, LeafSpec, Usage, parse_key};
use self::sans::Sans;

mod ca;
mod der;
mod sans;
mod signer;

pub use self::signer::ClientUsages;

/// The subdirectory of the data dir that holds the PKI.
const PKI_DIR: &str = "pki";

/// As kube-apiserver's self-signed serving certificate; clients check SANs, not the CN.
const APISERVER_COMMON_NAME: &str = "trellis-apiserver";
const ADMIN_COMMON_NAME: &str = "admin";

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

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use rustls::pki_types::pem::PemObject as _;
    use trellis_pki::hostname;

    use super::ca::parse_x509;
    use super::*;

    fn hosts(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    pub(super) fn x509_of(pem: &str) -> (CertificateDer<'static>, String) {
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
    fn admin_cert_is_cn_admin_in_system_masters() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        let (_, subject) = x509_of(pki.admin_cert_pem());
        assert_eq!(subject, "O=system:masters, CN=admin");
    }
}
