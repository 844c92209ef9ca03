//! What a hostile or unlucky client can do to the server, and must not be able to: add
//! metric series at will, read `/metrics` without a role that grants it, get a token
//! that outlives the cluster, read the store's file. One server for the module; each
//! check names the defect it guards against.

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use trellis_tests::TestCluster;

const VIEWER: &str = "viewer-token-0123456789abcdef";
const MONITOR: &str = "monitor-token-0123456789abcdef";
const DEPUTY: &str = "deputy-token-0123456789abcdef";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_and_unlucky_clients_are_held_to_kubernetes_limits() -> Result<()> {
    let cluster = TestCluster::builder()
        .with_token(VIEWER, "viewer", &[])
        .with_token(MONITOR, "prometheus", &["system:monitoring"])
        .with_token(DEPUTY, "deputy", &[])
        .start()
        .await?;
    unauthenticated_random_paths_add_no_metric_series(&cluster)
        .await
        .context("metrics from random paths")?;
    metrics_are_read_only_with_a_role_that_grants_them(&cluster)
        .await
        .context("/metrics and RBAC")?;
    token_requests_are_held_to_kubernetes_lifetimes(&cluster)
        .await
        .context("TokenRequest lifetimes")?;
    the_data_directory_and_the_store_are_private(&cluster).context("file permissions")?;
    impersonation_runs_as_the_impersonated_user_once_authorized(&cluster)
        .await
        .context("impersonation")?;
    Ok(())
}

fn request_series(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
        .collect()
}

/// Regression: request metrics were keyed by the raw method and path before
/// authentication, so every random path an anonymous client sent made a new series
/// (and a quote in it broke the exposition).
async fn unauthenticated_random_paths_add_no_metric_series(cluster: &TestCluster) -> Result<()> {
    let before = cluster.request("GET", "/metrics", "text/plain", "").await?;
    let before = request_series(std::str::from_utf8(&before.body)?).len();
    for i in 0..100 {
        let path = format!("/probe-{i}/x%22y/{}", rand::random::<u32>());
        let answer = cluster
            .request_as(None, "GET", &path, "text/plain", "")
            .await?;
        ensure!(answer.status == 401, "{path}: {}", answer.status);
    }
    let after = cluster.request("GET", "/metrics", "text/plain", "").await?;
    let text = String::from_utf8(after.body)?;
    let series = request_series(&text);
    ensure!(
        !text.contains("probe-"),
        "a request path became a label:\n{text}"
    );
    ensure!(
        series.len() <= before + 2,
        "{} series before, {} after:\n{}",
        before,
        series.len(),
        series.join("\n")
    );
    ensure!(
        series.iter().any(|s| s.contains(
            r#"verb="get",group="",version="",resource="",subresource="",scope="",code="401""#
        )),
        "the refused requests are not counted:\n{}",
        series.join("\n")
    );
    Ok(())
}

/// Regression: any authenticated user could read `/metrics`; as in Kubernetes it takes
/// a `nonResourceURLs` rule (here the bootstrap `system:monitoring` role).
async fn metrics_are_read_only_with_a_role_that_grants_them(cluster: &TestCluster) -> Result<()> {
    let refused = cluster
        .request_as(Some(VIEWER), "GET", "/metrics", "text/plain", "")
        .await?;
    ensure!(refused.status == 403, "viewer got {}", refused.status);
    let status = refused.json()?;
    ensure!(
        status["kind"] == "Status"
            && status["reason"] == "Forbidden"
            && status["message"]
                .as_str()
                .is_some_and(|m| m.contains("\"viewer\"") && m.contains("/metrics")),
        "{status}"
    );
    let allowed = cluster
        .request_as(Some(MONITOR), "GET", "/metrics", "text/plain", "")
        .await?;
    ensure!(allowed.status == 200, "monitor got {}", allowed.status);
    // Discovery stays open to every authenticated user (system:discovery).
    let discovery = cluster
        .request_as(Some(VIEWER), "GET", "/apis", "application/json", "")
        .await?;
    ensure!(
        discovery.status == 200,
        "viewer's /apis: {}",
        discovery.status
    );
    Ok(())
}

/// Regression: `expirationSeconds` of 1e14 gave a token for millions of years, 2^63−1
/// wrapped around, and 1e30 or 3600.5 silently became an hour.
async fn token_requests_are_held_to_kubernetes_lifetimes(cluster: &TestCluster) -> Result<()> {
    cluster
        .kubectl_ok(&["create", "serviceaccount", "lifetimes"])
        .await?;
    let path = "/api/v1/namespaces/default/serviceaccounts/lifetimes/token";
    let ask = |seconds: &str| {
        format!(
            r#"{{"apiVersion":"authentication.k8s.io/v1","kind":"TokenRequest","spec":{{"expirationSeconds":{seconds}}}}}"#
        )
    };
    for (seconds, code, reason) in [
        ("100000000000000", 422, "Invalid"),
        ("9223372036854775807", 422, "Invalid"),
        ("599", 422, "Invalid"),
        ("1e30", 400, "BadRequest"),
        ("3600.5", 400, "BadRequest"),
    ] {
        let answer = cluster
            .request("POST", path, "application/json", &ask(seconds))
            .await?;
        let status: Value = answer.json()?;
        ensure!(
            answer.status == code && status["reason"] == reason,
            "{seconds}: {} {status}",
            answer.status
        );
        if code == 422 {
            ensure!(
                status["details"]["causes"][0]["field"] == "spec.expirationSeconds",
                "{status}"
            );
        }
    }
    let longest = 1_i64 << 32;
    let answer = cluster
        .request("POST", path, "application/json", &ask(&longest.to_string()))
        .await?;
    ensure!(answer.status == 201, "2^32 s: {}", answer.status);
    let granted = answer.json()?;
    ensure!(granted["spec"]["expirationSeconds"] == longest, "{granted}");
    let expires = granted["status"]["expirationTimestamp"]
        .as_str()
        .context("no expirationTimestamp")?;
    ensure!(expires.starts_with("2"), "expires {expires}");
    Ok(())
}

/// Regression: the store file and the audit log were 0644 in a 0755 directory, and the
/// store holds Secrets.
fn the_data_directory_and_the_store_are_private(cluster: &TestCluster) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let mode = |p: &std::path::Path| -> Result<u32> {
        Ok(std::fs::metadata(p)
            .with_context(|| format!("stat {}", p.display()))?
            .permissions()
            .mode()
            & 0o777)
    };
    ensure!(mode(&cluster.data_dir)? == 0o700, "data directory");
    ensure!(mode(&cluster.store_path())? == 0o600, "store file");
    for file in ["audit.log", "tokens.csv", "admin.kubeconfig"] {
        let path = cluster.data_dir.join(file);
        ensure!(mode(&path)? == 0o600, "{file} is {:o}", mode(&path)?);
    }
    Ok(())
}

/// Refuses bindings to the node `quarantined`, and labels every Binding it admits.
#[derive(Debug)]
struct GuardBindings;

#[async_trait::async_trait]
impl trellis_apiserver::admission::Admission for GuardBindings {
    fn name(&self) -> &str {
        "GuardBindings"
    }

    async fn mutate(
        &self,
        attrs: &trellis_apiserver::admission::Attributes<'_>,
        obj: &mut trellis_apiserver::object::Object,
        _old: Option<&trellis_apiserver::object::Object>,
    ) -> Result<(), trellis_api::ApiError> {
        if attrs.subresource == Some("binding") {
            obj.entry("metadata")
                .or_insert_with(|| serde_json::json!({}))["annotations"]["example.com/admitted"] =
                "yes".into();
        }
        Ok(())
    }

    async fn validate(
        &self,
        attrs: &trellis_apiserver::admission::Attributes<'_>,
        obj: &trellis_apiserver::object::Object,
        _old: Option<&trellis_apiserver::object::Object>,
    ) -> Result<(), trellis_api::ApiError> {
        if attrs.subresource == Some("binding")
            && attrs.operation == "CREATE"
            && obj["target"]["name"] == "quarantined"
        {
            return Err(trellis_api::ApiError::new(
                403,
                trellis_api::status::Reason::Forbidden,
                "node quarantined takes no pods",
            ));
        }
        Ok(())
    }
}

/// Regression: `pods/binding` wrote the pod without admission (a plugin could not
/// refuse or see a binding) and without recording its field manager.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bindings_are_admitted_and_recorded_in_managed_fields() -> Result<()> {
    let mut chains = trellis_apiserver::admission::builtin();
    chains.add(std::sync::Arc::new(GuardBindings));
    let cluster = TestCluster::builder().with_chains(chains).start().await?;
    let pod = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p"},
        "spec":{"containers":[{"name":"c","image":"busybox"}]}}"#;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], pod)
        .await?;
    let path = "/api/v1/namespaces/default/pods/p/binding";
    let bind = |node: &str| {
        format!(
            r#"{{"apiVersion":"v1","kind":"Binding","metadata":{{"name":"p"}},"target":{{"kind":"Node","name":"{node}"}}}}"#
        )
    };
    let refused = cluster
        .request("POST", path, "application/json", &bind("quarantined"))
        .await?;
    ensure!(
        refused.status == 403
            && refused.json()?["message"]
                .as_str()
                .is_some_and(|m| m.contains("quarantined takes no pods")),
        "{} {}",
        refused.status,
        String::from_utf8_lossy(&refused.body)
    );
    let bound = cluster
        .request(
            "POST",
            &format!("{path}?fieldManager=my-scheduler"),
            "application/json",
            &bind("n1"),
        )
        .await?;
    ensure!(
        bound.status == 201,
        "{}",
        String::from_utf8_lossy(&bound.body)
    );
    let pod: Value = serde_json::from_str(
        &cluster
            .kubectl_ok(&["get", "pod", "p", "-o", "json", "--show-managed-fields"])
            .await?,
    )?;
    ensure!(pod["spec"]["nodeName"] == "n1", "{pod}");
    ensure!(
        pod["metadata"]["annotations"]["example.com/admitted"] == "yes",
        "the mutated Binding's annotations reach the pod: {pod}"
    );
    let entry = pod["metadata"]["managedFields"]
        .as_array()
        .and_then(|m| m.iter().find(|e| e["manager"] == "my-scheduler"))
        .with_context(|| format!("no managedFields entry for the binding: {pod}"))?;
    ensure!(
        entry["operation"] == "Update"
            && entry["subresource"] == "binding"
            && entry["fieldsV1"]["f:spec"]["f:nodeName"].is_object(),
        "{entry}"
    );
    Ok(())
}

/// Regression: `Impersonate-*` headers were ignored, so `kubectl --as` ran as the
/// caller (an admin keeping its privileges) and `kubectl auth can-i --as` answered
/// for the wrong user.
async fn impersonation_runs_as_the_impersonated_user_once_authorized(
    cluster: &TestCluster,
) -> Result<()> {
    // The admin drops its privileges by impersonating.
    let refused = cluster
        .kubectl_err(&["--as", "viewer", "get", "secrets"])
        .await?;
    ensure!(
        refused.contains("User \"viewer\" cannot list resource \"secrets\""),
        "{refused}"
    );
    let can_i = cluster
        .kubectl(&["auth", "can-i", "list", "secrets", "--as", "viewer"])
        .await?;
    ensure!(
        String::from_utf8_lossy(&can_i.stdout).trim() == "no",
        "can-i --as viewer: {}",
        String::from_utf8_lossy(&can_i.stdout)
    );
    let whoami = cluster
        .kubectl_ok(&[
            "auth",
            "whoami",
            "--as",
            "bob",
            "--as-group",
            "team-a",
            "-o",
            "json",
        ])
        .await?;
    let whoami: Value = serde_json::from_str(&whoami)?;
    ensure!(
        whoami["status"]["userInfo"]["username"] == "bob"
            && whoami["status"]["userInfo"]["groups"]
                == serde_json::json!(["team-a", "system:authenticated"]),
        "{whoami}"
    );
    // Without the impersonate verb, asking to be someone else is refused.
    let deputy = cluster.kubectl_with_token("deputy", DEPUTY)?;
    let refused = deputy.err(&["--as", "viewer", "get", "pods"], None).await?;
    ensure!(
        refused.contains("User \"deputy\" cannot impersonate resource \"users\""),
        "{refused}"
    );
    // Granted for one user, it works for that user and no other.
    let grant = r#"{"apiVersion":"rbac.authorization.k8s.io/v1","kind":"ClusterRole","metadata":{"name":"impersonate-viewer"},
        "rules":[{"apiGroups":[""],"resources":["users"],"verbs":["impersonate"],"resourceNames":["viewer"]}]}
        {"apiVersion":"rbac.authorization.k8s.io/v1","kind":"ClusterRoleBinding","metadata":{"name":"deputy-impersonates-viewer"},
        "roleRef":{"apiGroup":"rbac.authorization.k8s.io","kind":"ClusterRole","name":"impersonate-viewer"},
        "subjects":[{"kind":"User","apiGroup":"rbac.authorization.k8s.io","name":"deputy"}]}"#;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], grant)
        .await?;
    let as_viewer = deputy
        .err(&["--as", "viewer", "get", "secrets"], None)
        .await?;
    ensure!(
        as_viewer.contains("User \"viewer\" cannot list"),
        "deputy as viewer: {as_viewer}"
    );
    let as_admin = deputy.err(&["--as", "admin", "get", "pods"], None).await?;
    ensure!(
        as_admin.contains("cannot impersonate resource \"users\""),
        "deputy as admin: {as_admin}"
    );
    // Taken away, the grant is gone for the next request.
    cluster
        .kubectl_ok(&["delete", "clusterrolebinding", "deputy-impersonates-viewer"])
        .await?;
    let revoked = deputy
        .err(&["--as", "viewer", "get", "secrets"], None)
        .await?;
    ensure!(
        revoked.contains("User \"deputy\" cannot impersonate resource \"users\""),
        "after the binding's delete: {revoked}"
    );
    Ok(())
}

/// Regression: a watch whose client never reads held its connection, its buffers and
/// the server's work for ever. It is ended once its buffer fills (counted on
/// /metrics), and its connection once the writes to it have stalled for the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_that_never_read_are_dropped_and_their_connections_closed() -> Result<()> {
    use tokio::io::AsyncReadExt as _;
    const WATCHERS: usize = 4;
    let settings = trellis_apiserver::state::Settings {
        stalled_write_timeout: std::time::Duration::from_secs(1),
        ..Default::default()
    };
    let cluster = TestCluster::builder()
        .with_settings(settings)
        .with_watch_buffer(4)
        .start()
        .await?;
    let watching = |text: &str, name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
            .unwrap_or(-1.0)
    };
    // The server's own watches (the plugin manager's) stay open throughout.
    let before = cluster.request("GET", "/metrics", "text/plain", "").await?;
    let own = watching(
        &String::from_utf8_lossy(&before.body),
        "apiserver_watch_cache_watchers",
    );
    let mut streams = Vec::new();
    for _ in 0..WATCHERS {
        streams.push(
            cluster
                .unread_request("/api/v1/namespaces/default/configmaps?watch=true")
                .await?,
        );
    }
    // Large objects fill the socket buffers behind each unread watch, then its buffer.
    let data = "x".repeat(512 * 1024);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut i = 0;
    loop {
        let metrics = cluster.request("GET", "/metrics", "text/plain", "").await?;
        let text = String::from_utf8_lossy(&metrics.body).into_owned();
        if watching(&text, "apiserver_terminated_watchers_total") >= WATCHERS as f64 {
            ensure!(
                watching(&text, "apiserver_watch_cache_watchers") == own,
                "{text}"
            );
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "the watches were never dropped:\n{text}"
        );
        let body = serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": format!("big-{i}")}, "data": {"d": data}})
        .to_string();
        let created = cluster
            .request(
                "POST",
                "/api/v1/namespaces/default/configmaps",
                "application/json",
                &body,
            )
            .await?;
        ensure!(created.status == 201, "create: {}", created.status);
        i += 1;
    }
    // The server's writes to the unread connections stall; once they have for
    // `stalled_write_timeout` it closes them and counts each. Wait for that count
    // (reading before then would unblock them).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let metrics = cluster.request("GET", "/metrics", "text/plain", "").await?;
        let text = String::from_utf8_lossy(&metrics.body).into_owned();
        if watching(&text, "apiserver_stalled_connections_closed_total") >= WATCHERS as f64 {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "the stalled connections were never closed:\n{text}"
        );
        tokio::task::yield_now().await;
    }
    // Each connection ends: reading what the server sent reaches its end.
    for mut stream in streams {
        let mut sink = vec![0_u8; 1 << 20];
        tokio::time::timeout(std::time::Duration::from_secs(30), async {
            loop {
                match stream.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        })
        .await
        .context("the stalled connection was never closed")?;
    }
    Ok(())
}

/// Regression: namespace deletion removed objects with finalizers outright, an update
/// of the terminating namespace removed it with its objects still stored (and a
/// namespace re-created under the name got them back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_deletion_waits_for_finalizers_and_leaves_nothing() -> Result<()> {
    let settings = trellis_apiserver::state::Settings {
        namespace_resync: std::time::Duration::from_millis(100),
        ..Default::default()
    };
    let cluster = TestCluster::builder()
        .with_settings(settings)
        .start()
        .await?;
    cluster.kubectl_ok(&["create", "namespace", "held"]).await?;
    let objects = r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"kept","namespace":"held","finalizers":["example.com/keep"]}}
        {"apiVersion":"v1","kind":"Secret","metadata":{"name":"plain","namespace":"held"},"stringData":{"k":"v"}}"#;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], objects)
        .await?;
    cluster
        .kubectl_ok(&["delete", "namespace", "held", "--wait=false"])
        .await?;
    // The plain Secret goes; the ConfigMap is marked and stays, and so does the namespace.
    cluster
        .kubectl_ok(&[
            "wait",
            "--for=delete",
            "secret/plain",
            "-n",
            "held",
            "--timeout=20s",
        ])
        .await?;
    let kept: Value = serde_json::from_str(
        &cluster
            .kubectl_ok(&["get", "configmap", "kept", "-n", "held", "-o", "json"])
            .await?,
    )?;
    ensure!(kept["metadata"]["deletionTimestamp"].is_string(), "{kept}");
    // An update of the terminating namespace does not remove it.
    cluster
        .kubectl_ok(&["label", "namespace", "held", "touched=yes"])
        .await?;
    let ns: Value = serde_json::from_str(
        &cluster
            .kubectl_ok(&["get", "namespace", "held", "-o", "json"])
            .await?,
    )?;
    ensure!(
        ns["status"]["phase"] == "Terminating"
            && ns["spec"]["finalizers"] == serde_json::json!(["kubernetes"]),
        "{ns}"
    );
    // The finalizer's owner lets go: the ConfigMap goes, then the namespace.
    cluster
        .kubectl_ok(&[
            "patch",
            "configmap",
            "kept",
            "-n",
            "held",
            "--type=merge",
            "-p",
            r#"{"metadata":{"finalizers":null}}"#,
        ])
        .await?;
    cluster
        .kubectl_ok(&["wait", "--for=delete", "namespace/held", "--timeout=20s"])
        .await?;
    cluster.kubectl_ok(&["create", "namespace", "held"]).await?;
    let left = cluster
        .kubectl_ok(&["get", "configmaps,secrets", "-n", "held", "-o", "name"])
        .await?;
    ensure!(left.trim().is_empty(), "objects came back: {left}");
    Ok(())
}

/// Regression: the OpenAPI documents were rebuilt on the request path by every request
/// that found them stale, so a CRD change followed by many clients' discovery built
/// them once per client, concurrently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_documents_are_built_once_per_change_however_many_ask() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let builds = |text: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix("apiserver_openapi_builds_total ")?
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or(0.0)
    };
    let metrics = cluster.request("GET", "/metrics", "text/plain", "").await?;
    let before = builds(&String::from_utf8_lossy(&metrics.body));
    let crd = r#"{"apiVersion":"apiextensions.k8s.io/v1","kind":"CustomResourceDefinition",
        "metadata":{"name":"widgets.example.com"},
        "spec":{"group":"example.com","scope":"Namespaced",
          "names":{"plural":"widgets","singular":"widget","kind":"Widget"},
          "versions":[{"name":"v1","served":true,"storage":true,
            "schema":{"openAPIV3Schema":{"type":"object","x-kubernetes-preserve-unknown-fields":true}}}]}}"#;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], crd)
        .await?;
    let asks = (0..20).map(|_| cluster.request("GET", "/openapi/v2", "application/json", ""));
    for answer in futures::future::join_all(asks).await {
        let answer = answer?;
        ensure!(answer.status == 200, "{}", answer.status);
        ensure!(
            String::from_utf8_lossy(&answer.body).contains("com.example.v1.Widget"),
            "the new kind is not in the document"
        );
    }
    let metrics = cluster.request("GET", "/metrics", "text/plain", "").await?;
    let after = builds(&String::from_utf8_lossy(&metrics.body));
    // The CRD's create, and its Established status: at most one build each.
    ensure!(
        after - before <= 2.0,
        "{before} builds before, {after} after"
    );
    Ok(())
}

/// Regression: a malformed request line, a URI too long and headers too large were
/// answered with empty bodies (hyper's own answers), and a body cut short was called
/// "larger than the limit".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_errors_are_answered_with_a_status() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let status_of = |answer: &[u8]| -> Result<(String, Value)> {
        let text = String::from_utf8_lossy(answer).into_owned();
        let (head, body) = text
            .split_once("\r\n\r\n")
            .with_context(|| format!("no response in {text:?}"))?;
        let status: Value = serde_json::from_str(body)
            .with_context(|| format!("the body is not a Status: {text:?}"))?;
        Ok((head.lines().next().unwrap_or_default().to_owned(), status))
    };
    let authority = cluster.url.trim_start_matches("https://").to_owned();
    let cases = [
        (
            "malformed request line",
            b"GET\x01/ nonsense\r\n\r\n".to_vec(),
            "400",
        ),
        (
            "URI too long",
            format!(
                "GET /api/{} HTTP/1.1\r\nHost: {authority}\r\n\r\n",
                "x".repeat(70_000)
            )
            .into_bytes(),
            "414",
        ),
        (
            "headers too large",
            format!(
                "GET /api HTTP/1.1\r\nHost: {authority}\r\nX-Big: {}\r\n\r\n",
                "y".repeat(1_100_000)
            )
            .into_bytes(),
            "431",
        ),
    ];
    for (what, request, code) in cases {
        let answer = cluster.raw_http1(&request).await?;
        let (line, status) = status_of(&answer).context(what)?;
        ensure!(line.contains(code), "{what}: {line}");
        ensure!(
            status["kind"] == "Status"
                && status["code"] == code.parse::<u16>()?
                && status["message"].is_string(),
            "{what}: {status}"
        );
    }
    // A body that stops short of its Content-Length is not "too large".
    let cut = format!(
        "POST /api/v1/namespaces/default/configmaps HTTP/1.1\r\nHost: {authority}\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"apiVersion\":",
        cluster.admin_token
    );
    let answer = cluster.raw_http1_then(cut.as_bytes(), true).await?;
    let text = String::from_utf8_lossy(&answer);
    ensure!(
        text.starts_with("HTTP/1.1 400") && !text.contains("larger than the limit"),
        "{text}"
    );
    Ok(())
}

/// Regression: a client that finished its TLS handshake and sent nothing kept its
/// connection until the idle timeout (90 s), as did one that sent only HTTP/2's
/// preface: hyper's header deadline starts only once the first bytes have told
/// HTTP/1.1 from HTTP/2, and HTTP/2 has none. kube-apiserver closes them after its
/// `ReadHeaderTimeout` (32 s). Clients that are slow but within the deadline are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_without_request_headers_are_closed_at_the_header_deadline() -> Result<()> {
    use std::time::{Duration, Instant};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    const DEADLINE: Duration = Duration::from_secs(1);
    let settings = trellis_apiserver::state::Settings {
        header_read_timeout: DEADLINE,
        idle_timeout: Duration::from_secs(600),
        ..Default::default()
    };
    let cluster = TestCluster::builder()
        .with_settings(settings)
        .start()
        .await?;
    let authority = cluster.url.trim_start_matches("https://").to_owned();

    for (what, alpn, sent) in [
        ("nothing, HTTP/1.1 negotiated", &b"http/1.1"[..], &b""[..]),
        ("nothing, HTTP/2 negotiated", b"h2", b""),
        (
            "HTTP/2's preface alone",
            b"h2",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        ),
        ("half a request line", b"http/1.1", b"GET /version HT"),
    ] {
        let mut stream = cluster.tls_stream(alpn).await?;
        let connected = Instant::now();
        stream.write_all(sent).await?;
        stream.flush().await?;
        // Closed: a read reaches the end (or fails, the server not saying goodbye).
        let mut sink = vec![0_u8; 1 << 16];
        tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match stream.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        })
        .await
        .with_context(|| format!("{what}: the connection is still open after 30 s"))?;
        let open = connected.elapsed();
        ensure!(
            open >= DEADLINE.mul_f64(0.9) && open < DEADLINE + Duration::from_secs(5),
            "{what}: closed after {open:?}, the header deadline being {DEADLINE:?}"
        );
    }

    // HTTP/1.1 headers that trickle in but are whole within the deadline are served.
    let mut stream = cluster.tls_stream(b"http/1.1").await?;
    let request = format!("GET /version HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    for piece in request.as_bytes().chunks(request.len().div_ceil(4)) {
        stream.write_all(piece).await?;
        stream.flush().await?;
        tokio::time::sleep(DEADLINE / 10).await;
    }
    let mut answer = Vec::new();
    let mut buf = vec![0_u8; 1 << 16];
    tokio::time::timeout(Duration::from_secs(10), async {
        while !String::from_utf8_lossy(&answer).contains("gitVersion") {
            match stream.read(&mut buf).await {
                Ok(n) if n > 0 => answer.extend_from_slice(&buf[..n]),
                _ => break,
            }
        }
    })
    .await
    .context("the slow request was not answered")?;
    let answer = String::from_utf8_lossy(&answer);
    ensure!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("gitVersion"),
        "the slow request: {answer}"
    );

    // An HTTP/2 client that opens its connection and sends its first request after a
    // pause within the deadline is served, and its connection then lasts past the
    // deadline: with a request seen, only the idle timeout applies.
    let connection = cluster.http2().await?;
    for pause in [DEADLINE / 2, DEADLINE * 2] {
        tokio::time::sleep(pause).await;
        let response = tokio::time::timeout(
            Duration::from_secs(10),
            connection
                .clone()
                .send_request(cluster.http2_request("GET", "/version")?),
        )
        .await
        .context("HTTP/2 request unanswered")?
        .with_context(|| format!("an HTTP/2 request after {pause:?}"))?;
        ensure!(
            response.status() == 200,
            "HTTP/2 after {pause:?}: {}",
            response.status()
        );
    }
    drop((stream, connection));
    cluster.stop().await
}
