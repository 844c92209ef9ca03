//! The server certificate verifier for connections whose peer has no certificate the
//! cluster could check: HTTPS probes of containers, and the API server's connections
//! to nodes' agents.

use rustls::DigitallySignedStruct;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

/// Accepts whatever certificate the server presents; the handshake's signatures are
/// still checked against it, so the connection is encrypted to whoever holds that
/// certificate's key, only not proven to be a particular host.
///
/// Safe where Kubernetes does the same, and only there:
/// - a kubelet's HTTPS probes (`scheme: HTTPS`) skip verification: a container's
///   certificate is its own business, and the probe only reads a status code;
/// - kube-apiserver does not verify kubelets' serving certificates without
///   `--kubelet-certificate-authority`, and nodes' agents serve self-signed ones,
///   while the API server still proves itself to them with its client certificate.
#[derive(Debug)]
pub struct AcceptAnyServerCert(pub WebPkiSupportedAlgorithms);

impl ServerCertVerifier for AcceptAnyServerCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_schemes()
    }
}
