//! `oci://` modules pulled from a real registry (Debian's `docker-registry` on a
//! loopback port, with token authentication): the anonymous token challenge, tags and
//! digests, and the failures a Plugin's status reports.

use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Result, ensure};
use serde_json::Value;
use trellis_tests::registry::Registry;
use trellis_tests::{TestCluster, plugin_wasm};

fn plugin(name: &str, url: &str, sha256: Option<&str>) -> String {
    let sha = sha256
        .map(|s| format!("\n    sha256: \"{s}\""))
        .unwrap_or_default();
    format!(
        "apiVersion: trellis.dev/v1
kind: Plugin
metadata:
  name: {name}
spec:
  kind: validating
  module:
    url: {url}{sha}
  timeoutMs: 1000
  rules:
  - operations: [CREATE]
    apiGroups: [\"\"]
    apiVersions: [v1]
    resources: [configmaps]
"
    )
}

fn condition(obj: &Value) -> (&str, &str) {
    let cond = obj["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Loaded"));
    (
        cond.and_then(|c| c["reason"].as_str()).unwrap_or_default(),
        cond.and_then(|c| c["message"].as_str()).unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_are_pulled_from_an_oci_registry() -> Result<()> {
    let registry = Registry::start().await?;
    let wasm = std::fs::read(plugin_wasm("misbehave")?)?;
    let module_digest = trellis_plugin_host::digest_of(&wasm);
    let manifest_digest = registry
        .push("policies/misbehave", "v1", "application/wasm", &wasm)
        .await?;
    // An artifact that is not WebAssembly: the layer is a tarball.
    registry
        .push(
            "policies/image",
            "v1",
            "application/vnd.oci.image.layer.v1.tar",
            b"not a module",
        )
        .await?;
    let cluster = TestCluster::start().await?;
    let at = &registry.address;
    let load = Duration::from_secs(30);

    // By tag: the registry challenges, the server fetches a token and pulls.
    cluster
        .kubectl_ok_stdin(
            &["apply", "-f", "-"],
            &plugin("by-tag", &format!("oci://{at}/policies/misbehave:v1"), None),
        )
        .await?;
    let obj = cluster.plugin_loaded("by-tag", "True", 1, load).await?;
    ensure!(obj["status"]["digest"] == module_digest.as_str(), "{obj}");
    ensure!(registry.tokens_issued.load(Ordering::SeqCst) > 0);
    let err = cluster
        .kubectl_err_stdin(
            &["apply", "-f", "-"],
            "apiVersion: v1
kind: ConfigMap
metadata:
  name: judged
  namespace: default
  annotations:
    misbehave: deny
",
        )
        .await?;
    ensure!(
        err.contains("admission plugin \"by-tag\" denied the request: misbehave denies judged"),
        "{err}"
    );
    cluster.kubectl_ok(&["delete", "plugin", "by-tag"]).await?;

    // By manifest digest (the manifest is checked against it).
    cluster
        .kubectl_ok_stdin(
            &["apply", "-f", "-"],
            &plugin(
                "by-digest",
                &format!("oci://{at}/policies/misbehave@{manifest_digest}"),
                None,
            ),
        )
        .await?;
    let obj = cluster.plugin_loaded("by-digest", "True", 1, load).await?;
    ensure!(obj["status"]["digest"] == module_digest.as_str(), "{obj}");
    cluster
        .kubectl_ok(&["delete", "plugin", "by-digest"])
        .await?;

    // Failures, each with what went wrong.
    let wrong = "0".repeat(64);
    let cases = [
        (
            "wrong-digest",
            format!("oci://{at}/policies/misbehave:v1"),
            Some(wrong.as_str()),
            format!("the artifact's module is {module_digest}, not the sha256:{wrong}"),
        ),
        (
            "no-such-tag",
            format!("oci://{at}/policies/misbehave:v2"),
            None,
            "MANIFEST_UNKNOWN: manifest unknown".to_owned(),
        ),
        (
            "not-wasm",
            format!("oci://{at}/policies/image:v1"),
            None,
            "not a WebAssembly artifact".to_owned(),
        ),
        (
            "bad-reference",
            format!("oci://{at}/Policies/misbehave:v1"),
            None,
            "spec.module.url: Invalid value".to_owned(),
        ),
    ];
    for (name, url, sha, expected) in cases {
        cluster
            .kubectl_ok_stdin(&["apply", "-f", "-"], &plugin(name, &url, sha))
            .await?;
        let obj = cluster.plugin_loaded(name, "False", 1, load).await?;
        let (reason, message) = condition(&obj);
        ensure!(reason == "FetchFailed", "{name}: {obj}");
        ensure!(message.contains(&expected), "{name}: {message}");
    }
    cluster.stop().await
}
