//! Plugins in the API server's chains, declared as Plugin objects or files in the
//! plugins directory, driven by kubectl: denials, patches, failure policies, limits,
//! hot reload that keeps the last good version, initializers and metrics.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, ensure};
use serde_json::Value;
use trellis_tests::{TestCluster, plugin_wasm};

/// A Plugin object for a fixture, as YAML for `kubectl apply -f -`. The deadline is
/// generous for a debug build on a busy machine: it counts waiting for a CPU too.
fn plugin_yaml(name: &str, module: &str, kind: &str, policy: &str, extra: &str) -> Result<String> {
    let path = plugin_wasm(module)?;
    Ok(format!(
        "apiVersion: trellis.dev/v1
kind: Plugin
metadata:
  name: {name}
spec:
  kind: {kind}
  module:
    url: file://{}
  failurePolicy: {policy}
  timeoutMs: 1000
  rules:
  - operations: [CREATE, UPDATE]
    apiGroups: [\"\"]
    apiVersions: [v1]
    resources: [configmaps, pods]
{extra}",
        path.display()
    ))
}

/// Waits until the Plugin's `Loaded` condition has `status` and returns the object.
async fn loaded(cluster: &TestCluster, name: &str, status: &str, generation: i64) -> Result<Value> {
    cluster
        .plugin_loaded(name, status, generation, Duration::from_secs(20))
        .await
}

fn configmap(name: &str, mode: &str) -> String {
    format!(
        "apiVersion: v1
kind: ConfigMap
metadata:
  name: {name}
  namespace: default
  annotations:
    misbehave: {mode}
data:
  k: v
"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validating_plugins_deny_and_fail_by_their_policy() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let yaml = plugin_yaml("guard", "misbehave", "validating", "Fail", "")?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &yaml)
        .await?;
    let obj = loaded(&cluster, "guard", "True", 1).await?;
    let digest = obj["status"]["digest"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    ensure!(digest.starts_with("sha256:"), "{obj}");

    // kubectl shows the plugin's own message.
    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], &configmap("denied", "deny"))
        .await?;
    ensure!(
        err.contains("admission plugin \"guard\" denied the request: misbehave denies denied"),
        "{err}"
    );
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &configmap("fine", "allow"))
        .await?;

    // Fail: a loop is refused, named, with the deadline.
    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], &configmap("loops", "loop"))
        .await?;
    let short = &digest[..19];
    ensure!(
        err.contains(&format!(
            "plugin guard (validating, v {short}) timed out after 1000ms"
        )),
        "{err}"
    );
    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], &configmap("hoards", "alloc"))
        .await?;
    ensure!(err.contains("exceeded its 64 MiB memory limit"), "{err}");
    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], &configmap("traps", "trap"))
        .await?;
    ensure!(err.contains("trapped"), "{err}");
    ensure!(
        cluster
            .kubectl(&["get", "configmap", "loops"])
            .await?
            .status
            .code()
            != Some(0),
        "a refused object must not be stored"
    );

    // Ignore: the same failures let the request through, with a warning.
    let ignore = plugin_yaml("guard", "misbehave", "validating", "Ignore", "")?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &ignore)
        .await?;
    loaded(&cluster, "guard", "True", 2).await?;
    let out = cluster
        .admin()
        .run(&["apply", "-f", "-"], Some(&configmap("loops", "loop")))
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "{stderr}");
    ensure!(
        stderr.contains("timed out after 1000ms; ignored (failurePolicy: Ignore)"),
        "{stderr}"
    );
    // Denials are answers, not failures: Ignore does not let them through.
    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], &configmap("denied", "deny"))
        .await?;
    ensure!(err.contains("denied the request"), "{err}");

    // The metrics name the plugin.
    let metrics = cluster.request("GET", "/metrics", "text/plain", "").await?;
    let text = String::from_utf8_lossy(&metrics.body);
    ensure!(
        text.lines().any(|l| l
            .starts_with("trellis_plugin_timeouts_total{plugin=\"guard\",kind=\"validating\"} ")
            && !l.ends_with(" 0")),
        "{text}"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutating_plugins_patch_and_bad_patches_are_refused() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let yaml = plugin_yaml("mutator", "misbehave", "mutating", "Fail", "")?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &yaml)
        .await?;
    loaded(&cluster, "mutator", "True", 1).await?;

    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &configmap("labelled", "label"))
        .await?;
    let label = cluster
        .kubectl_ok(&[
            "get",
            "configmap",
            "labelled",
            "-o",
            "jsonpath={.metadata.labels.misbehave}",
        ])
        .await?;
    ensure!(label == "was-here", "label {label:?}");

    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], &configmap("bad", "bad-patch"))
        .await?;
    ensure!(err.contains("returned an invalid JSON Patch"), "{err}");
    ensure!(err.contains("(BadRequest)"), "{err}");
    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], &configmap("bad2", "invalid-patch"))
        .await?;
    ensure!(err.contains("returned an invalid JSON Patch"), "{err}");

    // Schema validation runs after mutation: a patch that breaks a Pod is a 422.
    let pod = "apiVersion: v1
kind: Pod
metadata:
  name: broken
  namespace: default
  annotations:
    misbehave: invalid-object
spec:
  containers:
  - name: main
    image: registry.k8s.io/pause:3.10
";
    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], pod)
        .await?;
    ensure!(
        err.contains("is invalid") && err.contains("spec.containers[0].name"),
        "{err}"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_update_keeps_the_last_good_version_serving() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let yaml = plugin_yaml("guard", "misbehave", "validating", "Fail", "")?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &yaml)
        .await?;
    loaded(&cluster, "guard", "True", 1).await?;

    // A configuration the plugin refuses: the status says why, the old one serves.
    let rejected = plugin_yaml(
        "guard",
        "misbehave",
        "validating",
        "Fail",
        "  configuration:\n    reject: true\n",
    )?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &rejected)
        .await?;
    let obj = loaded(&cluster, "guard", "False", 2).await?;
    let cond = &obj["status"]["conditions"][0];
    ensure!(cond["reason"] == "ConfigurationRejected", "{cond}");
    ensure!(
        cond["message"]
            .as_str()
            .unwrap_or_default()
            .contains("keeps serving"),
        "{cond}"
    );
    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], &configmap("still", "deny"))
        .await?;
    ensure!(
        err.contains("denied the request"),
        "the last good version must serve: {err}"
    );

    // The wrong world: the status names the missing export.
    let wrong = plugin_yaml("guard", "stamp", "validating", "Fail", "")?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &wrong)
        .await?;
    let obj = loaded(&cluster, "guard", "False", 3).await?;
    let cond = &obj["status"]["conditions"][0];
    ensure!(cond["reason"] == "WrongWorld", "{cond}");
    ensure!(
        cond["message"]
            .as_str()
            .unwrap_or_default()
            .contains("admission-handler"),
        "{cond}"
    );

    // A missing file and an https module without a digest are named too.
    let missing = yaml.replace(
        plugin_wasm("misbehave")?.to_string_lossy().as_ref(),
        "/nonexistent/plugin.wasm",
    );
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &missing)
        .await?;
    let obj = loaded(&cluster, "guard", "False", 4).await?;
    ensure!(
        obj["status"]["conditions"][0]["reason"] == "FetchFailed",
        "{obj}"
    );

    // Fixed: serving again within a second of the change.
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &yaml)
        .await?;
    let started = Instant::now();
    loaded(&cluster, "guard", "True", 5).await?;
    ensure!(
        started.elapsed() < Duration::from_secs(1),
        "took {:?}",
        started.elapsed()
    );

    // Deleting the Plugin removes it from the chain.
    cluster.kubectl_ok(&["delete", "plugin", "guard"]).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = cluster
            .admin()
            .run(&["apply", "-f", "-"], Some(&configmap("after", "deny")))
            .await?;
        if out.status.success() {
            break;
        }
        ensure!(Instant::now() < deadline, "the deleted plugin still denies");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initializer_plugins_run_after_persistence() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let yaml = plugin_yaml(
        "stamp",
        "stamp",
        "initializer",
        "Fail",
        "  configuration:\n    annotation: stamped-by\n",
    )?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &yaml)
        .await?;
    loaded(&cluster, "stamp", "True", 1).await?;
    cluster
        .kubectl_ok(&["create", "configmap", "first", "--from-literal=a=b"])
        .await?;
    let stamped = cluster
        .kubectl_ok(&[
            "get",
            "configmap",
            "first",
            "-o",
            "jsonpath={.metadata.annotations.stamped-by}",
        ])
        .await?;
    ensure!(stamped == "done", "annotation {stamped:?}");
    let pending = cluster
        .kubectl_ok(&[
            "get",
            "configmap",
            "first",
            "-o",
            "jsonpath={.metadata.initializers}",
        ])
        .await?;
    ensure!(pending.is_empty(), "initializers left: {pending}");

    // A refusal fails the create with the plugin's reason and stores nothing.
    let failing = "apiVersion: v1
kind: ConfigMap
metadata:
  name: second
  annotations:
    stamp-fail: \"yes\"
";
    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], failing)
        .await?;
    ensure!(err.contains("the object asked stamp to fail"), "{err}");
    ensure!(
        cluster
            .kubectl(&["get", "configmap", "second"])
            .await?
            .status
            .code()
            != Some(0)
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugins_directory_is_followed_without_a_restart() -> Result<()> {
    let plugins = tempfile::tempdir()?;
    let cluster = TestCluster::builder()
        .with_plugin_dir(plugins.path())
        .start()
        .await?;
    let spec = "kind: validating
failurePolicy: Fail
rules:
- operations: [CREATE]
  apiGroups: [\"\"]
  apiVersions: [v1]
  resources: [configmaps]
";
    std::fs::copy(
        plugin_wasm("misbehave")?,
        plugins.path().join("dropped.wasm"),
    )?;
    std::fs::write(plugins.path().join("dropped.yaml"), spec)?;
    let started = Instant::now();
    until_dropped_plugin(&cluster, true).await?;
    let took = started.elapsed();
    ensure!(took < Duration::from_secs(3), "took {took:?}");
    std::fs::remove_file(plugins.path().join("dropped.yaml"))?;
    until_dropped_plugin(&cluster, false)
        .await
        .context("removing the file")?;
    cluster.stop().await
}

/// Waits until the `dropped` plugin denies (or, with `denies` false, stops denying).
async fn until_dropped_plugin(cluster: &TestCluster, denies: bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut n = 0;
    loop {
        n += 1;
        let out = cluster
            .admin()
            .run(
                &["apply", "-f", "-"],
                Some(&configmap(&format!("probe{n}-{denies}"), "deny")),
            )
            .await?;
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.status.success() != denies {
            if denies {
                ensure!(
                    stderr.contains("admission plugin \"dropped\" denied"),
                    "{stderr}"
                );
            }
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the directory change never took effect"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
