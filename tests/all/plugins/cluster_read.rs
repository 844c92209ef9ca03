//! The `cluster` import: a plugin granted `clusterRead` reads objects from the server's
//! watch cache (the misbehave fixture's `read` mode denies with what it found); one
//! without the grant reads nothing.

use std::time::Duration;

use anyhow::{Result, bail};
use trellis_tests::{TestCluster, plugin_wasm};

fn plugin(name: &str, grant: bool) -> Result<String> {
    Ok(format!(
        "apiVersion: trellis.dev/v1
kind: Plugin
metadata:
  name: {name}
spec:
  kind: validating
  module:
    url: file://{}
  configuration:
    selector: team=a
    get: cm-b
  timeoutMs: 1000
  rules:
  - operations: [CREATE]
    apiGroups: [\"\"]
    apiVersions: [v1]
    resources: [configmaps]
  capabilities:
    clusterRead: {grant}
",
        plugin_wasm("misbehave")?.display()
    ))
}

fn configmap(name: &str, labels: &str, annotations: &str) -> String {
    format!(
        "apiVersion: v1
kind: ConfigMap
metadata:
  name: {name}
  namespace: default
  labels: {{{labels}}}
  annotations: {{{annotations}}}
"
    )
}

/// Creates a `read` probe until the plugin's answer contains `expected`: reads come
/// from the watch cache, which may trail a write by a few milliseconds.
async fn probe(cluster: &TestCluster, expected: &str) -> Result<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let err = cluster
            .kubectl_err_stdin(
                &["create", "-f", "-"],
                &configmap("probe", "", "misbehave: read"),
            )
            .await?;
        if err.contains(expected) {
            return Ok(err);
        }
        if std::time::Instant::now() > deadline {
            bail!("the plugin never answered {expected:?}; last: {err}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn granted_plugins_read_the_cluster_as_it_changes() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &plugin("reader", true)?)
        .await?;
    cluster
        .plugin_loaded("reader", "True", 1, Duration::from_secs(30))
        .await?;
    for (name, team) in [("cm-a1", "a"), ("cm-a2", "a"), ("cm-b", "b")] {
        cluster
            .kubectl_ok_stdin(
                &["create", "-f", "-"],
                &configmap(name, &format!("team: {team}"), ""),
            )
            .await?;
    }
    probe(&cluster, "misbehave read [cm-a1,cm-a2]; cm-b exists: true").await?;

    cluster
        .kubectl_ok(&["delete", "configmap", "cm-a2", "cm-b"])
        .await?;
    probe(&cluster, "misbehave read [cm-a1]; cm-b exists: false").await?;

    // The same module without the grant: every call fails, and says why.
    cluster.kubectl_ok(&["delete", "plugin", "reader"]).await?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &plugin("no-grant", false)?)
        .await?;
    cluster
        .plugin_loaded("no-grant", "True", 1, Duration::from_secs(30))
        .await?;
    probe(&cluster, "misbehave could not list").await?;
    let err = probe(&cluster, "spec.capabilities.clusterRead").await?;
    if err.contains("misbehave read [") {
        bail!("a plugin without the grant read the cluster: {err}");
    }
    cluster.stop().await
}
