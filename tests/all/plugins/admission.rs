//! Plugins in the API server's chains, declared as Plugin objects or files in the
//! plugins directory, driven by kubectl: denials, patches, failure policies, limits,
//! hot reload that keeps the last good version, updates while requests are in flight,
//! initializers and metrics.

use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::SeqCst;
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
    // The server wrote that status through its registry: its managedFields name the
    // plugin host as the manager of `status`, on the status subresource.
    let full: Value = serde_json::from_str(
        &cluster
            .kubectl_ok(&[
                "get",
                "plugin",
                "guard",
                "-o",
                "json",
                "--show-managed-fields",
            ])
            .await?,
    )?;
    let managers = full["metadata"]["managedFields"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ensure!(
        managers
            .iter()
            .any(|m| m["manager"] == "trellis-plugin-host"
                && m["subresource"] == "status"
                && m["fieldsV1"]["f:status"]["f:conditions"].is_object()),
        "{full}"
    );

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
    // So do running out of memory and trapping, each named in its warning.
    for (name, mode, failure) in [
        ("hoards", "alloc", "exceeded its 64 MiB memory limit"),
        ("traps", "trap", "trapped"),
    ] {
        let out = cluster
            .admin()
            .run(&["apply", "-f", "-"], Some(&configmap(name, mode)))
            .await?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(out.status.success(), "{mode}: {stderr}");
        ensure!(
            stderr.contains(failure) && stderr.contains("ignored (failurePolicy: Ignore)"),
            "{mode}: {stderr}"
        );
        cluster.kubectl_ok(&["get", "configmap", name]).await?;
    }
    // Denials are answers, not failures: Ignore does not let them through.
    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], &configmap("denied", "deny"))
        .await?;
    ensure!(err.contains("denied the request"), "{err}");

    // The metrics name the plugin.
    let metrics = cluster.request("GET", "/metrics", "text/plain", "").await?;
    let text = String::from_utf8_lossy(&metrics.body);
    let value = |series: &str| -> Result<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .with_context(|| format!("no {series} in\n{text}"))
    };
    let guard = "{plugin=\"guard\",kind=\"validating\"}";
    let calls = value(&format!("trellis_plugin_calls_total{guard}"))?;
    for (series, at_least) in [
        // Two denials under each policy; a loop under each; memory and trap under each.
        ("trellis_plugin_denials_total", 2.0),
        ("trellis_plugin_timeouts_total", 2.0),
        ("trellis_plugin_errors_total", 6.0),
    ] {
        let v = value(&format!("{series}{guard}"))?;
        ensure!(v >= at_least && v <= calls, "{series} is {v}:\n{text}");
    }
    // The alloc calls grew an instance up to its 64 MiB cap, not past it.
    let peak = value(&format!("trellis_plugin_memory_peak_bytes{guard}"))? / 1024.0 / 1024.0;
    ensure!(
        (60.0..=64.0).contains(&peak),
        "memory peak {peak} MiB:\n{text}"
    );
    // Completed calls (answers, not failures) are timed.
    let timed = value(&format!(
        "trellis_plugin_call_duration_seconds_count{guard}"
    ))?;
    ensure!(timed >= 3.0, "{timed} timed calls:\n{text}");
    ensure!(
        value(
            "trellis_plugin_call_duration_seconds_bucket{plugin=\"guard\",kind=\"validating\",le=\"+Inf\"}"
        )? == timed,
        "{text}"
    );
    cluster.stop().await
}

/// The request a plugin gets names what the server was asked, and deletes (one by
/// one or by collection) reach plugins with the stored object as the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_see_each_request_as_sent_including_deletes() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let path = plugin_wasm("misbehave")?;
    let yaml = format!(
        "apiVersion: trellis.dev/v1
kind: Plugin
metadata:
  name: echo
spec:
  kind: validating
  module:
    url: file://{}
  configuration: {{\"mode\": \"allow\"}}
  failurePolicy: Fail
  timeoutMs: 1000
  rules:
  - operations: [CREATE, DELETE]
    apiGroups: [\"\"]
    apiVersions: [v1]
    resources: [configmaps]
",
        path.display()
    );
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &yaml)
        .await?;
    loaded(&cluster, "echo", "True", 1).await?;

    // kubectl prints the columns the Plugin CRD declares.
    let table = cluster.kubectl_ok(&["get", "plugins"]).await?;
    let words = |line: &str| {
        line.split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    ensure!(
        table.lines().next().map(words).unwrap_or_default()
            == ["NAME", "KIND", "FAILURE-POLICY", "LOADED", "AGE"],
        "{table}"
    );
    let row = table
        .lines()
        .find(|l| l.starts_with("echo "))
        .map(words)
        .unwrap_or_default();
    ensure!(
        row.len() == 5 && row[..4] == ["echo", "validating", "Fail", "True"],
        "{table}"
    );
    let wide = cluster
        .kubectl_ok(&["get", "plugins", "-o", "wide"])
        .await?;
    ensure!(
        wide.contains("DIGEST") && wide.contains("TIER") && wide.contains("sha256:"),
        "{wide}"
    );

    // A create: the object, no old object, who asked.
    let err = cluster
        .kubectl_err_stdin(&["create", "-f", "-"], &configmap("echoed", "echo"))
        .await?;
    for field in [
        "uid=set",
        "operation=CREATE",
        "kind=/v1/ConfigMap",
        "resource=/v1/configmaps",
        "subResource=none",
        "name=echoed",
        "namespace=default",
        "user=admin",
        "groups=system:masters,system:authenticated",
        "dryRun=false",
        "object=echoed",
        "oldObject=none",
        r#"configuration={"mode":"allow"}"#,
    ] {
        ensure!(err.contains(field), "{field} missing in {err}");
    }

    // Stored without the plugin's say (UPDATE is not in its rules), then deleted: the
    // delete carries no object and the stored one as the old object, and is refused.
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &configmap("kept", "allow"))
        .await?;
    cluster
        .kubectl_ok(&[
            "annotate",
            "configmap",
            "kept",
            "misbehave=echo",
            "--overwrite",
        ])
        .await?;
    let err = cluster
        .kubectl_err(&["delete", "configmap", "kept", "--dry-run=server"])
        .await?;
    for field in [
        "operation=DELETE",
        "name=kept",
        "dryRun=true",
        "object=none",
        "oldObject=kept",
    ] {
        ensure!(err.contains(field), "{field} missing in {err}");
    }
    let err = cluster
        .kubectl_err(&["delete", "configmap", "kept"])
        .await?;
    ensure!(
        err.contains("admission plugin \"echo\" denied the request")
            && err.contains("dryRun=false"),
        "{err}"
    );
    cluster.kubectl_ok(&["get", "configmap", "kept"]).await?;

    // A deletecollection asks about each object: the refused one stays.
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &configmap("goes", "allow"))
        .await?;
    cluster
        .kubectl_ok(&["label", "configmap", "goes", "kept", "batch=1"])
        .await?;
    let out = cluster
        .kubectl(&["delete", "configmaps", "-l", "batch=1"])
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && stderr.contains("oldObject=kept"),
        "{stderr}"
    );
    cluster.kubectl_ok(&["get", "configmap", "kept"]).await?;

    // Allowed again, the delete goes through.
    cluster
        .kubectl_ok(&[
            "annotate",
            "configmap",
            "kept",
            "misbehave=allow",
            "--overwrite",
        ])
        .await?;
    // kubectl sends a delete's dryRun in its DeleteOptions body: nothing is deleted.
    cluster
        .kubectl_ok(&["delete", "configmap", "kept", "--dry-run=server"])
        .await?;
    cluster.kubectl_ok(&["get", "configmap", "kept"]).await?;
    cluster.kubectl_ok(&["delete", "configmap", "kept"]).await?;
    ensure!(
        cluster
            .kubectl(&["get", "configmap", "kept"])
            .await?
            .status
            .code()
            != Some(0),
        "kept must be gone once its plugin allows the delete"
    );
    cluster.stop().await
}

/// Mutating plugins run by `order`, each on the object the ones before it patched, and
/// an `objectSelector` sees those patches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutating_plugins_run_in_order_and_select_patched_objects() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let labeller = |order: i32| {
        plugin_yaml(
            "labeller",
            "misbehave",
            "mutating",
            "Fail",
            &format!("  order: {order}\n  configuration: {{mode: label}}\n"),
        )
        .map(|yaml| yaml.replace("[CREATE, UPDATE]", "[CREATE, UPDATE, DELETE]"))
    };
    let echo = plugin_yaml(
        "echo",
        "misbehave",
        "mutating",
        "Fail",
        "  order: 2
  configuration: {mode: echo}
  objectSelector:
    matchLabels: {misbehave: was-here}
",
    )?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &labeller(1)?)
        .await?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &echo)
        .await?;
    loaded(&cluster, "labeller", "True", 1).await?;
    loaded(&cluster, "echo", "True", 1).await?;
    let plain = "apiVersion: v1
kind: ConfigMap
metadata:
  name: ordered
  namespace: default
data:
  k: v
";
    // labeller (1) labels the object, so echo (2) selects it and refuses.
    let err = cluster
        .kubectl_err_stdin(&["create", "-f", "-"], plain)
        .await?;
    ensure!(
        err.contains("admission plugin \"echo\" denied") && err.contains("object=ordered"),
        "{err}"
    );

    // labeller after echo: echo sees no label, does not select it, and it is stored.
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &labeller(3)?)
        .await?;
    loaded(&cluster, "labeller", "True", 2).await?;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], plain)
        .await?;
    let label = cluster
        .kubectl_ok(&[
            "get",
            "configmap",
            "ordered",
            "-o",
            "jsonpath={.metadata.labels.misbehave}",
        ])
        .await?;
    ensure!(label == "was-here", "label {label:?}");

    // A patch for a delete has no object to change: a plugin failure, as in Kubernetes.
    let err = cluster
        .kubectl_err(&["delete", "configmap", "ordered"])
        .await?;
    ensure!(
        err.contains("plugin labeller (mutating, v sha256:")
            && err.contains("a patch for a delete"),
        "{err}"
    );
    cluster.kubectl_ok(&["get", "configmap", "ordered"]).await?;
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

    // Ignore: a bad patch is dropped with a warning and the object stored unpatched;
    // a valid patch that breaks the object is no plugin failure, so it stays a 422.
    let ignore = plugin_yaml("mutator", "misbehave", "mutating", "Ignore", "")?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &ignore)
        .await?;
    loaded(&cluster, "mutator", "True", 2).await?;
    for (name, mode) in [("bad", "bad-patch"), ("bad2", "invalid-patch")] {
        let out = cluster
            .admin()
            .run(&["apply", "-f", "-"], Some(&configmap(name, mode)))
            .await?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(out.status.success(), "{mode}: {stderr}");
        ensure!(
            stderr.contains("returned an invalid JSON Patch")
                && stderr.contains("ignored (failurePolicy: Ignore)"),
            "{mode}: {stderr}"
        );
        let labels = cluster
            .kubectl_ok(&[
                "get",
                "configmap",
                name,
                "-o",
                "jsonpath={.metadata.labels}",
            ])
            .await?;
        ensure!(labels.is_empty(), "{mode}: stored with labels {labels}");
    }
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

/// Regression: one task loaded the plugins one after another, so a module fetched from
/// a server that never answered held up every other Plugin's load and reload until the
/// fetch timed out (10 s for a TLS handshake, 120 s for a request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_that_hangs_holds_up_no_other_plugin() -> Result<()> {
    // Accepts connections, reads nothing, answers nothing.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = silent.local_addr()?.port();
    let (accepted, mut connections) = tokio::sync::mpsc::unbounded_channel();
    let server = tokio::spawn(async move {
        while let Ok((socket, _)) = silent.accept().await {
            if accepted.send(socket).is_err() {
                return;
            }
        }
    });
    let cluster = TestCluster::start().await?;
    let good = plugin_yaml("stuck", "misbehave", "validating", "Fail", "")?;
    let file_url = format!("url: file://{}", plugin_wasm("misbehave")?.display());
    let hanging = good.replace(
        &file_url,
        &format!(
            "url: https://127.0.0.1:{port}/policy.wasm\n    sha256: \"{}\"",
            "0".repeat(64)
        ),
    );
    ensure!(hanging != good, "{hanging}");
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &hanging)
        .await?;
    // The server has connected: the stuck plugin's load is under way, and stays so.
    let mut held = tokio::time::timeout(Duration::from_secs(10), connections.recv())
        .await
        .context("the server never connected to fetch the module")?
        .context("the silent server stopped")?;

    // Another Plugin, created after it, loads and serves at once: well before the stuck
    // fetch gives up, 10 s after it connected.
    let promptly = Duration::from_secs(6);
    let prompt = plugin_yaml("prompt", "misbehave", "validating", "Fail", "")?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &prompt)
        .await?;
    cluster
        .plugin_loaded("prompt", "True", 1, promptly)
        .await
        .context("a hanging fetch of another plugin held this one up")?;
    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], &configmap("judged", "deny"))
        .await?;
    ensure!(
        err.contains("admission plugin \"prompt\" denied the request"),
        "{err}"
    );
    let obj: Value = serde_json::from_str(
        &cluster
            .kubectl_ok(&["get", "plugin", "stuck", "-o", "json"])
            .await?,
    )?;
    ensure!(
        obj["status"]["conditions"].is_null(),
        "the stuck load cannot have reported yet: {obj}"
    );

    // A newer spec of the stuck plugin supersedes its load: it serves at once, and the
    // old load was stopped when the new one started (its connection closed, long before
    // its own timeout would have closed it).
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &good)
        .await?;
    cluster.plugin_loaded("stuck", "True", 2, promptly).await?;
    let closed = tokio::time::timeout(Duration::from_secs(2), async {
        use tokio::io::AsyncReadExt as _;
        let mut buf = [0u8; 4096];
        // The ClientHello, then the end of the stream.
        loop {
            match held.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    ensure!(closed.is_ok(), "the superseded fetch is still connected");
    server.abort();
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

    // A misbehaving initializer fails the create under Fail, named, storing nothing;
    // under Ignore the object is stored as it was, without the stamp. A refusal is an
    // answer, not a failure: it fails the create under either policy.
    let misbehaving = |name: &str, mode: &str| {
        format!(
            "apiVersion: v1
kind: ConfigMap
metadata:
  name: {name}
  annotations:
    stamp-mode: {mode}
"
        )
    };
    let cases = [
        ("renamed", "rename", "an object whose metadata.name changed"),
        ("garbled", "not-json", "an object that is not JSON"),
        ("trapped", "trap", "trapped"),
        ("looped", "loop", "timed out after 1000ms"),
    ];
    for (name, mode, failure) in cases {
        let err = cluster
            .kubectl_err_stdin(&["create", "-f", "-"], &misbehaving(name, mode))
            .await?;
        ensure!(
            err.contains("plugin stamp (initializer, v sha256:") && err.contains(failure),
            "{mode}: {err}"
        );
        let gone = cluster.kubectl(&["get", "configmap", name]).await?;
        ensure!(gone.status.code() != Some(0), "{mode}: {name} was stored");
    }
    let ignore = plugin_yaml(
        "stamp",
        "stamp",
        "initializer",
        "Ignore",
        "  configuration:\n    annotation: stamped-by\n",
    )?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &ignore)
        .await?;
    loaded(&cluster, "stamp", "True", 2).await?;
    for (name, mode, _) in cases {
        cluster
            .kubectl_ok_stdin(&["create", "-f", "-"], &misbehaving(name, mode))
            .await
            .with_context(|| format!("{mode} under Ignore"))?;
        let annotations = cluster
            .kubectl_ok(&[
                "get",
                "configmap",
                name,
                "-o",
                "jsonpath={.metadata.annotations}",
            ])
            .await?;
        ensure!(
            !annotations.contains("stamped-by") && annotations.contains(mode),
            "{mode}: {annotations}"
        );
    }
    let err = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], failing)
        .await?;
    ensure!(err.contains("the object asked stamp to fail"), "{err}");
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

    // A changed module: noop allows what misbehave denied, then misbehave is back.
    let replace = |name: &str, from: &std::path::Path| -> Result<()> {
        let staged = plugins.path().join(format!(".{name}.tmp"));
        std::fs::copy(from, &staged)?;
        std::fs::rename(&staged, plugins.path().join(name))?;
        Ok(())
    };
    replace("dropped.wasm", &plugin_wasm("noop")?)?;
    until_dropped_plugin(&cluster, false)
        .await
        .context("replacing the module with noop")?;
    replace("dropped.wasm", &plugin_wasm("misbehave")?)?;
    until_dropped_plugin(&cluster, true)
        .await
        .context("putting misbehave back")?;

    // A changed spec: rules that no longer select ConfigMaps, then again.
    std::fs::write(
        plugins.path().join("dropped.yaml"),
        spec.replace("configmaps", "secrets"),
    )?;
    until_dropped_plugin(&cluster, false)
        .await
        .context("rules for secrets only")?;
    std::fs::write(plugins.path().join("dropped.yaml"), spec)?;
    until_dropped_plugin(&cluster, true)
        .await
        .context("rules for configmaps again")?;

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

/// How long each request of an in-flight batch stays in the plugin: long enough for a
/// Plugin update to be applied, loaded and reported while all of them wait. The
/// fixture busy-waits on the wall clock, so more requests burn more CPU but do not
/// take longer.
const IN_FLIGHT_MS: u64 = 8000;
/// Requests held in the plugin while it is updated.
const IN_FLIGHT: usize = 24;
/// Requests sent once the update is reported.
const AFTER: usize = 8;

/// A validating `misbehave` Plugin named `slow` with `configuration` (JSON), module
/// `module`, and the longest deadline, so that waiting for a CPU behind the other
/// requests' busy waits never times a call out.
fn slow_plugin(policy: &str, module: &std::path::Path, configuration: &str) -> Result<String> {
    let yaml = plugin_yaml(
        "slow",
        "misbehave",
        "validating",
        policy,
        &format!("  configuration: {configuration}\n"),
    )?;
    Ok(yaml.replace("timeoutMs: 1000", "timeoutMs: 30000").replace(
        plugin_wasm("misbehave")?.to_string_lossy().as_ref(),
        module.to_string_lossy().as_ref(),
    ))
}

/// One create's outcome.
#[derive(Debug)]
struct Created {
    name: String,
    status: u16,
    message: String,
    warnings: Vec<String>,
}

/// Creates ConfigMap `name` (no `misbehave` annotation unless `mode` is given, so the
/// plugin's configuration decides) over a connection of its own.
async fn create(cluster: &TestCluster, name: String, mode: Option<&str>) -> Result<Created> {
    let annotations = mode
        .map(|m| serde_json::json!({ "misbehave": m }))
        .unwrap_or_else(|| serde_json::json!({}));
    let body = serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "annotations": annotations},
        "data": {"k": "v"},
    });
    let response = cluster
        .request(
            "POST",
            "/api/v1/namespaces/default/configmaps",
            "application/json",
            &body.to_string(),
        )
        .await
        .with_context(|| format!("create {name}"))?;
    let message = response
        .json()
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_owned))
        .unwrap_or_default();
    Ok(Created {
        name,
        status: response.status,
        message,
        warnings: response
            .header_values("warning")
            .into_iter()
            .map(str::to_owned)
            .collect(),
    })
}

/// A hundred creates at once through a slow plugin: every one is answered, as the
/// policy says, and the server goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_plugin_under_a_hundred_concurrent_creates() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let module = plugin_wasm("misbehave")?;
    let install = |policy: &str, sleep_ms: u64, timeout_ms: u64| -> Result<String> {
        Ok(slow_plugin(
            policy,
            &module,
            &format!("{{\"mode\": \"sleep\", \"sleepMs\": {sleep_ms}}}"),
        )?
        .replace("timeoutMs: 30000", &format!("timeoutMs: {timeout_ms}")))
    };
    let hundred = |prefix: &'static str| {
        futures::future::join_all(
            (0..100).map(|i| create(&cluster, format!("{prefix}-{i:03}"), None)),
        )
    };
    let all =
        |prefix: &str| -> Vec<String> { (0..100).map(|i| format!("{prefix}-{i:03}")).collect() };

    // 5 ms each within a 10 s deadline: all are served.
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &install("Fail", 5, 10_000)?)
        .await?;
    loaded(&cluster, "slow", "True", 1).await?;
    for created in hundred("quick").await {
        let created = created?;
        ensure!(created.status == 201, "{created:?}");
    }
    ensure!(stored(&cluster, "quick-").await? == all("quick"));

    // 150 ms each against a 50 ms deadline, Fail: every create is refused, named,
    // and nothing is stored.
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &install("Fail", 150, 50)?)
        .await?;
    loaded(&cluster, "slow", "True", 2).await?;
    for created in hundred("late").await {
        let created = created?;
        ensure!(
            created.status >= 500 && created.message.contains("timed out after 50ms"),
            "{created:?}"
        );
    }
    ensure!(stored(&cluster, "late-").await?.is_empty());

    // The same under Ignore: every create is stored, each with a warning.
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &install("Ignore", 150, 50)?)
        .await?;
    loaded(&cluster, "slow", "True", 3).await?;
    for created in hundred("let").await {
        let created = created?;
        ensure!(
            created.status == 201
                && created
                    .warnings
                    .iter()
                    .any(|w| w.contains("timed out after 50ms")),
            "{created:?}"
        );
    }
    ensure!(stored(&cluster, "let-").await? == all("let"));

    // And the server answers the next request.
    let next = cluster
        .request(
            "GET",
            "/api/v1/namespaces/default/configmaps/let-000",
            "",
            "",
        )
        .await?;
    ensure!(next.status == 200, "{}", next.status);
    cluster.stop().await
}

/// The value of the sample `metric{plugin="slow",kind="validating"}` on `/metrics`.
async fn slow_metric(cluster: &TestCluster, metric: &str) -> Result<u64> {
    let response = cluster.request("GET", "/metrics", "text/plain", "").await?;
    let text = String::from_utf8_lossy(&response.body).into_owned();
    let prefix = format!("{metric}{{plugin=\"slow\",kind=\"validating\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("no {prefix}in /metrics:\n{text}"))
}

/// The names of the stored ConfigMaps in `default` that start with `prefix`.
async fn stored(cluster: &TestCluster, prefix: &str) -> Result<Vec<String>> {
    let list = cluster
        .request("GET", "/api/v1/namespaces/default/configmaps", "", "")
        .await?
        .json()?;
    let mut names: Vec<String> = list["items"]
        .as_array()
        .context("a list has items")?
        .iter()
        .filter_map(|o| o["metadata"]["name"].as_str())
        .filter(|n| n.starts_with(prefix))
        .map(str::to_owned)
        .collect();
    names.sort();
    Ok(names)
}

/// Starts [`IN_FLIGHT`] creates that wait in the `slow` plugin, counting in `finished`
/// those answered, runs `update` once all of them are inside the plugin, and returns
/// their outcomes and what `update` returned.
async fn with_requests_in_flight<T>(
    cluster: &TestCluster,
    finished: &AtomicUsize,
    update: impl Future<Output = Result<T>>,
) -> Result<(Vec<Created>, T)> {
    let batch = futures::future::join_all((0..IN_FLIGHT).map(|i| async move {
        let created = create(cluster, format!("inflight-{i}"), None).await;
        finished.fetch_add(1, SeqCst);
        created
    }));
    let driver = async {
        // Every request is inside the old version before the update is written.
        let deadline = Instant::now() + Duration::from_secs(30);
        while slow_metric(cluster, "trellis_plugin_calls_total").await? < IN_FLIGHT as u64 {
            ensure!(
                Instant::now() < deadline,
                "the batch never reached the plugin"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        ensure!(
            finished.load(SeqCst) == 0,
            "requests finished before the update began: the plugin is not slow enough"
        );
        update.await
    };
    let (results, out) = tokio::join!(batch, driver);
    let out = out?;
    let results = results.into_iter().collect::<Result<Vec<_>>>()?;
    Ok((results, out))
}

/// The names of the in-flight batch's objects, sorted.
fn in_flight_names() -> Vec<String> {
    let mut names: Vec<String> = (0..IN_FLIGHT).map(|i| format!("inflight-{i}")).collect();
    names.sort();
    names
}

/// Fails unless some of the in-flight batch was still waiting when the update was
/// reported: otherwise nothing was tested.
fn ensure_in_flight(finished: &AtomicUsize) -> Result<()> {
    let done = finished.load(SeqCst);
    ensure!(
        done < IN_FLIGHT,
        "all {done} requests had finished before the update was reported: none was in flight"
    );
    Ok(())
}

/// The fixture with a custom section appended: the same code under another digest,
/// so loading it compiles anew.
fn renamed_module(dir: &std::path::Path, tag: &str) -> Result<std::path::PathBuf> {
    let mut bytes = std::fs::read(plugin_wasm("misbehave")?)?;
    let name = b"trellis-test";
    let payload = tag.as_bytes();
    let size = 1 + name.len() + payload.len();
    ensure!(size < 128 && name.len() < 128, "one-byte LEB128 sizes only");
    bytes.push(0); // custom section id
    bytes.push(size as u8);
    bytes.push(name.len() as u8);
    bytes.extend_from_slice(name);
    bytes.extend_from_slice(payload);
    let path = dir.join(format!("misbehave-{tag}.wasm"));
    std::fs::write(&path, bytes)?;
    Ok(path)
}

/// A Plugin changed from a slow allowing version to a denying one (a new module and
/// configuration) while requests wait in the old version.
async fn an_update_in_flight_answers_each_request_from_one_version(policy: &str) -> Result<()> {
    let cluster = TestCluster::start().await?;
    let modules = tempfile::tempdir()?;
    let old_module = renamed_module(modules.path(), "old")?;
    let new_module = renamed_module(modules.path(), "new")?;
    let slow = format!(r#"{{"mode": "sleep", "sleepMs": {IN_FLIGHT_MS}}}"#);
    cluster
        .kubectl_ok_stdin(
            &["apply", "-f", "-"],
            &slow_plugin(policy, &old_module, &slow)?,
        )
        .await?;
    let old = loaded(&cluster, "slow", "True", 1).await?;
    let new_digest = trellis_plugin_host::digest_of(&std::fs::read(&new_module)?);
    ensure!(old["status"]["digest"] != new_digest.as_str(), "{old}");

    let finished = AtomicUsize::new(0);
    let update = async {
        cluster
            .kubectl_ok_stdin(
                &["apply", "-f", "-"],
                &slow_plugin(policy, &new_module, r#"{"mode": "deny"}"#)?,
            )
            .await?;
        let new = loaded(&cluster, "slow", "True", 2).await?;
        ensure_in_flight(&finished)?;
        ensure!(new["status"]["digest"] == new_digest.as_str(), "{new}");
        // Reported: every request from now on meets the new version only.
        let after = futures::future::join_all(
            (0..AFTER).map(|i| create(&cluster, format!("after-{i}"), None)),
        )
        .await;
        after.into_iter().collect::<Result<Vec<_>>>()
    };
    let (in_flight, after) = with_requests_in_flight(&cluster, &finished, update).await?;

    // Each request in flight was judged by the old version alone: allowed, with no
    // failure (which Ignore would have turned into a warning) and no new-version denial.
    for c in &in_flight {
        ensure!(c.status == 201, "{} in flight: {c:?}", c.name);
        ensure!(c.warnings.is_empty(), "{} in flight: {c:?}", c.name);
    }
    for c in &after {
        ensure!(
            c.status == 403 && c.message.ends_with(&format!("misbehave denies {}", c.name)),
            "{} after the update: {c:?}",
            c.name
        );
        ensure!(c.warnings.iter().all(|w| !w.contains("ignored")), "{c:?}");
    }
    // None lost, none extra: the stored objects are the 201s.
    ensure!(stored(&cluster, "inflight-").await? == in_flight_names());
    ensure!(stored(&cluster, "after-").await?.is_empty());

    // The plugin's counters span both versions: the old one's calls that ended after
    // the swap are not lost with it.
    let calls = slow_metric(&cluster, "trellis_plugin_calls_total").await?;
    ensure!(calls == (IN_FLIGHT + AFTER) as u64, "calls {calls}");
    let denials = slow_metric(&cluster, "trellis_plugin_denials_total").await?;
    ensure!(denials == AFTER as u64, "denials {denials}");
    let errors = slow_metric(&cluster, "trellis_plugin_errors_total").await?;
    ensure!(errors == 0, "errors {errors}");

    // And the server goes on serving (the annotation overrides the configuration).
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &configmap("last", "allow"))
        .await?;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_in_flight_answers_each_request_from_one_version_under_fail() -> Result<()> {
    an_update_in_flight_answers_each_request_from_one_version("Fail").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_in_flight_answers_each_request_from_one_version_under_ignore() -> Result<()> {
    an_update_in_flight_answers_each_request_from_one_version("Ignore").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_update_in_flight_leaves_the_old_version_serving() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let modules = tempfile::tempdir()?;
    let good = renamed_module(modules.path(), "good")?;
    let garbage = modules.path().join("garbage.wasm");
    std::fs::write(&garbage, b"\0asm but not really a component")?;
    let slow = format!(r#"{{"mode": "sleep", "sleepMs": {IN_FLIGHT_MS}}}"#);
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &slow_plugin("Fail", &good, &slow)?)
        .await?;
    let old = loaded(&cluster, "slow", "True", 1).await?;
    let digest = old["status"]["digest"].clone();

    let finished = AtomicUsize::new(0);
    let update = async {
        cluster
            .kubectl_ok_stdin(
                &["apply", "-f", "-"],
                &slow_plugin("Fail", &garbage, r#"{"mode": "deny"}"#)?,
            )
            .await?;
        let failed = loaded(&cluster, "slow", "False", 2).await?;
        let cond = &failed["status"]["conditions"][0];
        ensure!(cond["reason"] == "CompileFailed", "{failed}");
        ensure!(
            cond["message"]
                .as_str()
                .unwrap_or_default()
                .contains(&format!(
                    "the last good version ({}) keeps serving",
                    digest.as_str().unwrap_or_default()
                )),
            "{failed}"
        );
        ensure!(failed["status"]["digest"] == digest, "{failed}");
        ensure_in_flight(&finished)?;
        // The old version judges what comes next: it denies on the annotation's word
        // (the broken one cannot answer at all).
        let after = futures::future::join_all(
            (0..AFTER).map(|i| create(&cluster, format!("after-{i}"), Some("deny"))),
        )
        .await;
        after.into_iter().collect::<Result<Vec<_>>>()
    };
    let (in_flight, after) = with_requests_in_flight(&cluster, &finished, update).await?;
    for c in &in_flight {
        ensure!(
            c.status == 201 && c.warnings.is_empty(),
            "{} in flight: {c:?}",
            c.name
        );
    }
    for c in &after {
        ensure!(
            c.status == 403 && c.message.ends_with(&format!("misbehave denies {}", c.name)),
            "{} after the failed update: {c:?}",
            c.name
        );
    }
    ensure!(stored(&cluster, "inflight-").await? == in_flight_names());
    let calls = slow_metric(&cluster, "trellis_plugin_calls_total").await?;
    ensure!(calls == (IN_FLIGHT + AFTER) as u64, "calls {calls}");
    let errors = slow_metric(&cluster, "trellis_plugin_errors_total").await?;
    ensure!(errors == 0, "errors {errors}");
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &configmap("last", "allow"))
        .await?;
    cluster.stop().await
}
