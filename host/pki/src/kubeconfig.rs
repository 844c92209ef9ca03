//! Kubeconfig files, as `kubectl --kubeconfig` reads them: one cluster and one context
//! named `trellis`, one user, credentials embedded so that the file works on its own.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;
use base64::Engine as _;

/// The cluster's and the context's name in generated kubeconfigs.
const CLUSTER: &str = "trellis";
/// Kubeconfigs embed credentials: readable by their owner alone.
const KUBECONFIG_MODE: u32 = crate::file::KEY_MODE;

/// A kubeconfig whose user `user` authenticates with a client certificate: cluster
/// `trellis` at `server_url` trusting `ca_pem`, user `user` with `cert_pem`/`key_pem`,
/// and the context `trellis` joining them as the current context.
pub fn cert_kubeconfig(
    server_url: &str,
    ca_pem: &str,
    user: &str,
    cert_pem: &str,
    key_pem: &str,
) -> String {
    kubeconfig(
        server_url,
        ca_pem,
        user,
        &[
            ("client-certificate-data", base64_of(cert_pem)),
            ("client-key-data", base64_of(key_pem)),
        ],
    )
}

/// A kubeconfig for a bearer token: like [`cert_kubeconfig`], but user `user`
/// authenticates with `token`.
pub fn token_kubeconfig(server_url: &str, ca_pem: &str, user: &str, token: &str) -> String {
    kubeconfig(server_url, ca_pem, user, &[("token", quote(token))])
}

/// Writes a kubeconfig with mode 0600, atomically: kubectl running at the same time
/// reads the old file or the new one, never a partial one.
pub fn write_kubeconfig(path: &Path, contents: &str) -> anyhow::Result<()> {
    crate::file::write_file_atomic(path, contents.as_bytes(), KUBECONFIG_MODE)
}

/// The server URL of a kubeconfig's first cluster: where a node that joined earlier
/// connects again.
pub fn read_server(path: &Path) -> anyhow::Result<String> {
    #[derive(serde::Deserialize)]
    struct Config {
        #[serde(default)]
        clusters: Vec<NamedCluster>,
    }
    #[derive(serde::Deserialize)]
    struct NamedCluster {
        cluster: Option<Cluster>,
    }
    #[derive(serde::Deserialize)]
    struct Cluster {
        server: Option<String>,
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let config: Config =
        serde_saphyr::from_str(&text).with_context(|| format!("read {}", path.display()))?;
    config
        .clusters
        .into_iter()
        .next()
        .and_then(|c| c.cluster)
        .and_then(|c| c.server)
        .with_context(|| format!("find the server in {}", path.display()))
}

/// The document around one user's credentials, given as YAML-ready `(field, value)`
/// pairs.
fn kubeconfig(
    server_url: &str,
    ca_pem: &str,
    user: &str,
    credentials: &[(&str, String)],
) -> String {
    let user = quote(user);
    let mut lines = vec![
        "apiVersion: v1".to_owned(),
        "kind: Config".to_owned(),
        "clusters:".to_owned(),
        format!("- name: {CLUSTER}"),
        "  cluster:".to_owned(),
        format!("    server: {}", quote(server_url)),
        format!("    certificate-authority-data: {}", base64_of(ca_pem)),
        "users:".to_owned(),
        format!("- name: {user}"),
        "  user:".to_owned(),
    ];
    lines.extend(
        credentials
            .iter()
            .map(|(field, value)| format!("    {field}: {value}")),
    );
    lines.extend([
        "contexts:".to_owned(),
        format!("- name: {CLUSTER}"),
        "  context:".to_owned(),
        format!("    cluster: {CLUSTER}"),
        format!("    user: {user}"),
        format!("current-context: {CLUSTER}"),
        "preferences: {}".to_owned(),
    ]);
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

/// Kubeconfig `*-data` fields hold base64 of the PEM text.
fn base64_of(pem: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(pem)
}

/// A YAML double-quoted scalar, so that no value (a URL with `#`, a name like `yes`
/// or `null`) is read back as anything but the string it is.
fn quote(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn cert_kubeconfig_parses_back_with_embedded_credentials() {
        let config = parse(&cert_kubeconfig(
            "https://127.0.0.1:6443",
            CA,
            "admin",
            CERT,
            KEY,
        ));
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

    #[test]
    fn token_kubeconfig_carries_the_token() {
        let config = parse(&token_kubeconfig(
            "https://[::1]:6443",
            CA,
            "jane",
            "abc-_123",
        ));
        assert_eq!(
            config["users"],
            json!([{"name": "jane", "user": {"token": "abc-_123"}}])
        );
        assert_eq!(config["contexts"][0]["context"]["user"], "jane");
        assert_eq!(
            config["clusters"][0]["cluster"]["server"],
            "https://[::1]:6443"
        );
        assert_eq!(
            decode(&config["clusters"][0]["cluster"]["certificate-authority-data"]),
            CA
        );
    }

    #[test]
    fn awkward_values_stay_strings() {
        for value in [
            "yes",
            "null",
            "1.5",
            "a # b",
            "quote\"back\\slash",
            "tab\tnew\nline",
            "ünï",
            "",
        ] {
            let config = parse(&token_kubeconfig(value, CA, value, value));
            assert_eq!(
                config["clusters"][0]["cluster"]["server"], value,
                "{value:?}"
            );
            assert_eq!(config["users"][0]["name"], value, "{value:?}");
            assert_eq!(config["users"][0]["user"]["token"], value, "{value:?}");
        }
    }

    #[test]
    fn write_kubeconfig_is_private_and_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("admin.kubeconfig");
        write_kubeconfig(&path, "old").unwrap();
        write_kubeconfig(&path, "new").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn read_server_finds_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.kubeconfig");
        let url = "https://10.0.0.1:6443";
        write_kubeconfig(
            &path,
            &cert_kubeconfig(url, CA, "system:node:n1", CERT, KEY),
        )
        .unwrap();
        assert_eq!(read_server(&path).unwrap(), url);
        write_kubeconfig(&path, "apiVersion: v1\nkind: Config\nclusters: []\n").unwrap();
        assert!(read_server(&path).is_err());
    }
}
