//! Client certificates the cluster CA signs on request: for a name and groups the
//! server chose ([`Pki::issue_client_cert`]), or for a node's certificate request
//! ([`Pki::sign_client_request`]), as Kubernetes' certificate signer does.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use rcgen::{DistinguishedName, DnType, ExtendedKeyUsagePurpose, KeyUsagePurpose};
use trellis_pki::pem_encode;
use x509_parser::time::ASN1Time;

use super::Pki;
use super::ca::{BACKDATE, LeafSpec, Usage, der_name, random_serial};

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

impl Pki {
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    use rcgen::{KeyPair, PublicKeyData as _};
    use rustls::pki_types::UnixTime;

    use super::super::Pki;
    use super::super::ca::{BACKDATE, parse_x509};
    use super::super::tests::x509_of;

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
}
