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

#[cfg(test)]
mod tests {
    use super::*;

    use base64::Engine as _;
    use serde_json::{Value, json};

    fn parse(yaml: &str) -> Value {
        serde_saphyr::from_str(yaml).unwrap()
    }

    fn decode(value: &Value) -> String {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(value.as_str().unwrap())
            .unwrap();
        String::from_utf8(bytes).unwrap()
    }

    const CA: &str = "-----BEGIN CERTIFICATE-----\nQ0E=\n-----END CERTIFICATE-----\n";
    const CERT: &str = "-----BEGIN CERTIFICATE-----\nQ0VSVA==\n-----END CERTIFICATE-----\n";
    const KEY: &str = "-----BEGIN PRIVATE KEY-----\nS0VZ\n-----END PRIVATE KEY-----\n";

    #[test]
    fn admin_kubeconfig_parses_back_with_embedded_credentials() {
        let config = parse(&admin_kubeconfig("https://127.0.0.1:6443", CA, CERT, KEY));
        assert_eq!(config["apiVersion"], "v1");
        assert_eq!(config["kind"], "Config");
        assert_eq!(config["current-context"], "trellis");

        let clusters = config["clusters"].as_array().unwrap();
        assert_eq!(clusters.len(), 1);
        assert_eq!(clusters[0]["name"], "trellis");
        assert_eq!(clusters[0]["cluster"]["server"], "https://127.0.0.1:6443");
        assert_eq!(
            decode(&clusters[0]["cluster"]["certificate-authority-data"]),
            CA
        );

        let users = config["users"].as_array().unwrap();
        assert_eq!(users.len(), 1);
        assert_eq!(users[0]["name"], "admin");
        assert_eq!(decode(&users[0]["user"]["client-certificate-data"]), CERT);
        assert_eq!(decode(&users[0]["user"]["client-key-data"]), KEY);

        assert_eq!(
            config["contexts"],
            json!([{"name": "trellis", "context": {"cluster": "trellis", "user": "admin"}}])
        );
    }
}
