//! The admin kubeconfig the API server writes at start; kubeconfig files themselves are
//! `trellis_pki::kubeconfig`'s, which nodes write too.

use trellis_pki::kubeconfig::cert_kubeconfig;

/// The user name for the admin client certificate.
const ADMIN_USER: &str = "admin";

/// A kubeconfig for the admin client certificate: cluster `trellis` at `server_url`
/// trusting `ca_pem`, user `admin` authenticating with `cert_pem`/`key_pem`, and the
/// context `trellis` joining them as the current context.
pub fn admin_kubeconfig(server_url: &str, ca_pem: &str, cert_pem: &str, key_pem: &str) -> String {
    cert_kubeconfig(server_url, ca_pem, ADMIN_USER, cert_pem, key_pem)
}
