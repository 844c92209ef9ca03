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

    // A second copy ordered after it, as the README shows: watchers that ask for
    // uninitialized objects see each initializer's turn; others see the result only.
    let late = example_yaml("annotate-init")?
        .replace("name: annotate-init\n", "name: annotate-init-late\n")
        .replace(
            "annotation: trellis.dev/initialized-at",
            "annotation: example.com/second",
        )
        .replace("order: 0", "order: 10");
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &late)
        .await?;
    cluster
        .plugin_loaded("annotate-init-late", "True", 1, Duration::from_secs(600))
        .await?;
    let cluster_ref = &cluster;
    let watch = |uninitialized: bool| async move {
        let path = format!(
            "/api/v1/namespaces/default/configmaps?watch=1&timeoutSeconds=4&includeUninitialized={uninitialized}"
        );
        cluster_ref
            .request("GET", &path, "application/json", "")
            .await
    };
    let watchers = || async {
        let metrics = cluster.request("GET", "/metrics", "text/plain", "").await?;
        anyhow::Ok(
            String::from_utf8_lossy(&metrics.body)
                .lines()
                .find_map(|l| {
                    l.strip_prefix("apiserver_watch_cache_watchers ")?
                        .parse::<u64>()
                        .ok()
                })
                .unwrap_or(0),
        )
    };
    let before = watchers().await?;
    let create = async {
        // Once both watches are open (the server counts them), not after a guess.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while watchers().await? < before + 2 {
            ensure!(
                std::time::Instant::now() < deadline,
                "the watches never opened"
            );
            tokio::task::yield_now().await;
        }
        cluster
            .kubectl_ok(&["create", "configmap", "ordered", "--from-literal=a=b"])
            .await
    };
    let (with, without, created) = tokio::join!(watch(true), watch(false), create);
    created?;
    // Each event about `ordered`: its type, pending initializers and annotation keys.
    type Seen = (String, Vec<String>, Vec<String>);
    let events = |body: &[u8]| -> Result<Vec<Seen>> {
        let mut seen = Vec::new();
        for line in body.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let event: serde_json::Value = serde_json::from_slice(line)?;
            let meta = &event["object"]["metadata"];
            if meta["name"] != "ordered" {
                continue;
            }
            let pending = meta["initializers"]["pending"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["name"].as_str().map(str::to_owned))
                .collect();
            let annotations = meta["annotations"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, _)| k.clone())
                .collect();
            seen.push((
                event["type"].as_str().unwrap_or_default().to_owned(),
                pending,
                annotations,
            ));
        }
        Ok(seen)
    };
    let s = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let (stamp, second) = ("trellis.dev/initialized-at", "example.com/second");
    let with = events(&with?.body)?;
    ensure!(
        with == [
            (
                "ADDED".to_owned(),
                s(&["annotate-init", "annotate-init-late"]),
                s(&[])
            ),
            (
                "MODIFIED".to_owned(),
                s(&["annotate-init-late"]),
                s(&[stamp])
            ),
            ("MODIFIED".to_owned(), s(&[]), s(&[second, stamp])),
        ],
        "includeUninitialized=true saw {with:?}"
    );
    let without = events(&without?.body)?;
    ensure!(
        without == [("ADDED".to_owned(), s(&[]), s(&[second, stamp]))],
        "a plain watch saw {without:?}"
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
