//! Certificates and kubeconfigs where both sides of a cluster use them: the API server,
//! which issues and checks credentials, and the node agent, which asks for them in its
//! TLS bootstrap and keeps them fresh. As client-go's `util/cert`, `util/keyutil` and
//! `clientcmd`, which the kubelet and kube-apiserver share; and the TLS accept loop both
//! serve with.
//!
//! What only the API server does (its CA, serving certificates and signing) stays in
//! `trellis-apiserver`; the node's bootstrap is `trellis_agent::bootstrap`.
//!
//! # Layout
//! - [`cert`]: PEM certificates: encoding, validity, the CA hash a joining node pins,
//!   the user a client certificate names, the hostname that goes into SANs.
//! - [`csr`]: certificate requests a node makes, and the signers they name.
//! - [`file`]: files written whole by rename, keys readable by their owner alone.
//! - [`kubeconfig`]: kubeconfig files with embedded credentials.
//! - [`serve`]: the TLS accept loop: accept until shutdown, a handshake under a
//!   deadline per connection, at most so many connections.
//! - [`verify`]: the server certificate verifier that accepts any certificate, for
//!   the connections Kubernetes leaves unverified too.

pub mod cert;
pub mod csr;
pub mod file;
pub mod kubeconfig;
pub mod serve;
pub mod verify;

pub use cert::{ca_cert_hash, cert_validity, hostname, identity_from_cert, pem_encode};
pub use csr::{CLIENT_SIGNER, KUBELET_CLIENT_SIGNER, node_client_request};
pub use file::{create_file_atomic, write_file_atomic};
pub use verify::AcceptAnyServerCert;
