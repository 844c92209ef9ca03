//! The example plugins (examples/plugins), installed from their own `plugin.yaml` into
//! a real API server and exercised with kubectl, as their READMEs show.
//!
//! A test binary of its own: compiling the Python and JavaScript components keeps both
//! cores busy for a while, and cargo runs test binaries one after another, so the
//! timing-sensitive tests in `all` never share the machine with it.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use trellis_tests::{TestCluster, plugin_wasm};

/// An example's Plugin object with its module's path and digest filled in. Deadlines
/// are raised for a debug build on a busy machine.
fn example_yaml(name: &str) -> Result<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the repository root")?;
    let text = std::fs::read_to_string(root.join(format!("examples/plugins/{name}/plugin.yaml")))?;
    let wasm = plugin_wasm(name)?;
    let digest = trellis_plugin_host::digest_of(&std::fs::read(&wasm)?);
    let dist = wasm.parent().context("the plugins' directory")?;
    Ok(text
        .replace("@DIST@", &dist.to_string_lossy())
        .replace("@SHA256@", digest.trim_start_matches("sha256:"))
        .replace("timeoutMs: 100\n", "timeoutMs: 2000\n")
        .replace("timeoutMs: 500\n", "timeoutMs: 10000\n"))
}

async fn install(cluster: &TestCluster, name: &str, within: Duration) -> Result<()> {
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &example_yaml(name)?)
        .await?;
    cluster.plugin_loaded(name, "True", 1, within).await?;
    Ok(())
}

fn pod(name: &str, image: &str, privileged: bool) -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: default
spec:
  containers:
  - name: main
    image: {image}
    securityContext:
      privileged: {privileged}
"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_examples_police_default_and_initialize() -> Result<()> {
    let cluster = TestCluster::start().await?;
    for name in ["pod-policy", "pod-defaults", "annotate-init"] {
        install(&cluster, name, Duration::from_secs(600)).await?;
    }

    let err = cluster
        .kubectl_err_stdin(
            &["apply", "-f", "-"],
            &pod("root", "registry.k8s.io/pause:3.10", true),
        )
        .await?;
    ensure!(
        err.contains("admission plugin \"pod-policy\" denied the request")
            && err.contains("is privileged"),
        "{err}"
    );
    let err = cluster
        .kubectl_err_stdin(
            &["apply", "-f", "-"],
            &pod("foreign", "quay.io/evil/miner:1", false),
        )
        .await?;
    ensure!(err.contains("not from an allowed registry"), "{err}");

    cluster
        .kubectl_ok_stdin(
            &["apply", "-f", "-"],
            &pod("web", "registry.k8s.io/pause:3.10", false),
        )
        .await?;
    let defaulted = cluster
        .kubectl_ok(&[
            "get",
            "pod",
            "web",
            "-o",
            "jsonpath={.metadata.labels.trellis\\.dev/defaulted} {.spec.containers[0].resources.requests.cpu} {.spec.containers[0].resources.limits.memory}",
        ])
        .await?;
    ensure!(
        defaulted == "true 100m 256Mi",
        "pod-defaults left {defaulted:?}"
    );

    cluster
        .kubectl_ok(&["create", "configmap", "settings", "--from-literal=a=b"])
        .await?;
    let stamped = cluster
        .kubectl_ok(&[
            "get",
            "configmap",
            "settings",
            "-o",
            "jsonpath={.metadata.annotations.trellis\\.dev/initialized-at}",
        ])
        .await?;
    ensure!(
        !stamped.is_empty(),
        "annotate-init did not annotate the ConfigMap"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_and_javascript_examples_deny_with_their_messages() -> Result<()> {
    let cluster = TestCluster::start().await?;
    // Their first compilation takes tens of seconds in a debug build.
    for name in ["require-team-label", "deny-latest-tag"] {
        install(&cluster, name, Duration::from_secs(600)).await?;
    }
    cluster
        .kubectl_ok(&[
            "label",
            "namespace",
            "default",
            "trellis.dev/require-team=true",
        ])
        .await?;

    let unowned = "apiVersion: v1
kind: ConfigMap
metadata:
  name: unowned
  namespace: default
";
    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], unowned)
        .await?;
    ensure!(
        err.contains("admission plugin \"require-team-label\" denied the request")
            && err.contains("has no \"team\" label"),
        "{err}"
    );
    let owned = unowned.replace(
        "name: unowned\n",
        "name: owned\n  labels:\n    team: payments\n",
    );
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &owned)
        .await?;

    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], &pod("latest", "nginx:latest", false))
        .await?;
    ensure!(
        err.contains("admission plugin \"deny-latest-tag\" denied the request"),
        "{err}"
    );
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &pod("pinned", "nginx:1.27", false))
        .await?;
    cluster.stop().await
}
