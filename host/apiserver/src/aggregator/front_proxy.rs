//! The front proxy's credentials, as kube-apiserver's `--requestheader-client-ca-file`
//! and `--proxy-client-cert-file`: a CA of its own (`pki/front-proxy-ca.{crt,key}`,
//! kept across starts so that extension servers keep trusting it) and a client
//! certificate, CN `front-proxy-client`, issued from it at each start. The server
//! presents that certificate on every request it passes to an extension API server,
//! with the user in `X-Remote-*` headers; the extension server trusts those headers
//! only from a certificate of this CA with an allowed name.
//!
//! A separate CA, not the cluster's: a client certificate the cluster CA signed (a
//! node's, a CertificateSigningRequest's) must not be able to speak for other users.
//!
//! The `extension-apiserver-authentication` ConfigMap in `kube-system` publishes what
//! an extension server needs to check both kinds of callers: the cluster CA
//! (`client-ca-file`) and this CA with the allowed names and header names.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256,
};
use serde_json::json;
use trellis_pki::file::{CERT_MODE, KEY_MODE, read_optional};
use trellis_pki::write_file_atomic;

use crate::object::Object;
use crate::state::AppState;

/// The name an extension server allows the front proxy's certificate by.
pub const CLIENT_COMMON_NAME: &str = "front-proxy-client";
/// Where the user, groups and extra attributes of a proxied request travel.
pub const USER_HEADER: &str = "X-Remote-User";
pub const GROUP_HEADER: &str = "X-Remote-Group";
pub const EXTRA_HEADER_PREFIX: &str = "X-Remote-Extra-";
/// The ConfigMap in `kube-system` extension servers read the above from.
pub const CONFIGMAP: &str = "extension-apiserver-authentication";

const CA_VALIDITY: Duration = Duration::from_secs(3650 * 24 * 3600);
const CLIENT_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);
/// Certificates start this far back, for peers whose clocks lag.
const BACKDATE: Duration = Duration::from_secs(5 * 60);

/// The front proxy's CA (PEM) and its client certificate and key (PEM).
pub struct FrontProxy {
    pub ca_pem: String,
    pub client_cert_pem: String,
    pub client_key_pem: String,
}

impl std::fmt::Debug for FrontProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrontProxy").finish_non_exhaustive()
    }
}

impl FrontProxy {
    /// Loads the CA from `pki_dir` (creating it the first time) and issues the client
    /// certificate.
    pub fn load_or_create(pki_dir: &Path) -> anyhow::Result<Self> {
        let cert_path = pki_dir.join("front-proxy-ca.crt");
        let key_path = pki_dir.join("front-proxy-ca.key");
        let (ca_pem, key) = match (read_optional(&cert_path)?, read_optional(&key_path)?) {
            (Some(cert), Some(key)) => (
                cert,
                KeyPair::from_pem(&key).with_context(|| format!("parse {}", key_path.display()))?,
            ),
            _ => {
                tracing::info!(file = %cert_path.display(), "creating the front proxy's CA");
                let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
                    .context("generate the front proxy CA's key")?;
                let cert = ca_params()
                    .self_signed(&key)
                    .context("sign the front proxy's CA")?;
                write_file_atomic(&key_path, key.serialize_pem().as_bytes(), KEY_MODE)?;
                write_file_atomic(&cert_path, cert.pem().as_bytes(), CERT_MODE)?;
                (cert.pem(), key)
            }
        };
        let issuer = Issuer::from_ca_cert_pem(&ca_pem, key)
            .with_context(|| format!("read {}", cert_path.display()))?;
        let client_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
            .context("generate the front proxy client's key")?;
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, CLIENT_COMMON_NAME);
        params.distinguished_name = name;
        let now = x509_parser::time::ASN1Time::now().to_datetime();
        params.not_before = now - BACKDATE;
        params.not_after = now + CLIENT_VALIDITY;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client = params
            .signed_by(&client_key, &issuer)
            .context("issue the front proxy's client certificate")?;
        Ok(Self {
            ca_pem,
            client_cert_pem: client.pem(),
            client_key_pem: client_key.serialize_pem(),
        })
    }

    /// The `extension-apiserver-authentication` ConfigMap's data, as kube-apiserver
    /// writes it (lists as JSON arrays).
    pub fn configmap(&self, cluster_ca_pem: &str) -> Object {
        let object = json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": CONFIGMAP, "namespace": "kube-system"},
            "data": {
                "client-ca-file": cluster_ca_pem,
                "requestheader-client-ca-file": self.ca_pem,
                "requestheader-allowed-names": json!([CLIENT_COMMON_NAME]).to_string(),
                "requestheader-username-headers": json!([USER_HEADER]).to_string(),
                "requestheader-group-headers": json!([GROUP_HEADER]).to_string(),
                "requestheader-extra-headers-prefix": json!([EXTRA_HEADER_PREFIX]).to_string(),
            },
        });
        match object {
            serde_json::Value::Object(map) => map,
            _ => Object::new(),
        }
    }
}

fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, "front-proxy-ca");
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = x509_parser::time::ASN1Time::now().to_datetime();
    params.not_before = now - BACKDATE;
    params.not_after = now + CA_VALIDITY;
    params
}

/// Writes the ConfigMap, creating it or bringing its data up to date. Straight to
/// the store, as the bootstrap objects are: it is the server's own, and admission
/// (an initializer that holds ConfigMaps) must not keep the server from starting.
pub async fn publish(state: &AppState, mut configmap: Object) -> anyhow::Result<()> {
    let configmaps = state.resource("", "v1", "configmaps")?;
    let name = crate::object::name(&configmap)
        .unwrap_or_default()
        .to_owned();
    let key = configmaps.key(Some("kube-system"), &name);
    let metadata = configmap.entry("metadata").or_insert_with(|| json!({}));
    metadata["namespace"] = json!("kube-system");
    metadata["uid"] = json!(uuid::Uuid::new_v4().to_string());
    metadata["creationTimestamp"] = json!(crate::object::now_timestamp());
    let encoded = bytes::Bytes::from(serde_json::to_vec(&configmap)?);
    match state.store.create(&key, encoded).await {
        Ok(_) => return Ok(()),
        Err(trellis_store::Error::AlreadyExists { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    let Some(kv) = state.store.get(&key).await? else {
        return Ok(());
    };
    let mut stored: Object = serde_json::from_slice(&kv.value)?;
    if stored.get("data") == configmap.get("data") {
        return Ok(());
    }
    stored.insert("data".into(), configmap["data"].clone());
    match state
        .store
        .update(
            &key,
            bytes::Bytes::from(serde_json::to_vec(&stored)?),
            Some(kv.mod_revision),
        )
        .await
    {
        // Another server wrote it meanwhile, with the same data.
        Ok(_) | Err(trellis_store::Error::Conflict { .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}
