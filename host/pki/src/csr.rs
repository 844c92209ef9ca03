//! Certificate requests a node makes, and the signers of `certificates.k8s.io/v1`
//! CertificateSigningRequests that the API server knows.

use anyhow::Context as _;
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, PKCS_ECDSA_P256_SHA256};

/// The signer of node client certificates (`system:node:NAME`, `system:nodes`).
pub const KUBELET_CLIENT_SIGNER: &str = "kubernetes.io/kube-apiserver-client-kubelet";
/// The signer of any other client certificate for the API server; never auto-approved.
pub const CLIENT_SIGNER: &str = "kubernetes.io/kube-apiserver-client";

/// A fresh ECDSA P-256 key and a certificate request for a node's client certificate
/// (`CN=system:node:NAME, O=system:nodes`), both PEM: what a joining node sends.
pub fn node_client_request(node_name: &str) -> anyhow::Result<(String, String)> {
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).context("generate key")?;
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, format!("system:node:{node_name}"));
    name.push(DnType::OrganizationName, trellis_api::user::groups::NODES);
    params.distinguished_name = name;
    let request = params
        .serialize_request(&key)
        .context("make the certificate request")?;
    let pem = request.pem().context("encode the certificate request")?;
    Ok((key.serialize_pem(), pem))
}
