//! What kubectl and client-go need beyond CRUD: OpenAPI v2 in protobuf, `auth can-i`
//! and `auth whoami`, aggregated discovery, events in `describe`, `delete --wait`, and
//! hundreds of watches on one HTTP/2 connection.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use prost_reflect::{DynamicMessage, ReflectMessage as _, Value as ProtoValue};
use trellis_tests::TestCluster;

/// A `kind: List` of two objects, which kubectl validates item by item.
const LIST: &str = "apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: ConfigMap
  metadata:
    name: listed-a
  data: {k: v}
- apiVersion: apps/v1
  kind: Deployment
  metadata:
    name: listed-web
  spec:
    selector:
      matchLabels: {app: listed-web}
    template:
      metadata:
        labels: {app: listed-web}
      spec:
        containers:
        - name: nginx
          image: nginx:1.25
";

/// GETs `path` over HTTPS as the admin with `accept`, with curl; returns the body and
/// the response's Content-Type.
async fn raw_get(cluster: &TestCluster, path: &str, accept: &str) -> Result<(Vec<u8>, String)> {
    let dir = tempfile::tempdir()?;
    let ca = dir.path().join("ca.crt");
    let headers = dir.path().join("headers");
    std::fs::write(&ca, &cluster.ca_pem)?;
    let output = tokio::process::Command::new("curl")
        .arg("-sSf")
        .arg("--cacert")
        .arg(&ca)
        .arg("-D")
        .arg(&headers)
        .arg("-H")
        .arg(format!("Authorization: Bearer {}", cluster.admin_token))
        .arg("-H")
        .arg(format!("Accept: {accept}"))
        .arg(format!("{}{path}", cluster.url))
        .output()
        .await
        .context("run curl")?;
    ensure!(
        output.status.success(),
        "curl {path}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let headers = std::fs::read_to_string(&headers)?;
    let content_type = headers
        .lines()
        .find_map(|l| {
            l.split_once(':')
                .filter(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        })
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_default();
    Ok((output.stdout, content_type))
}

fn field<'a>(msg: &'a DynamicMessage, name: &str) -> Result<std::borrow::Cow<'a, ProtoValue>> {
    msg.get_field_by_name(name)
        .with_context(|| format!("no field {name} in {}", msg.descriptor().full_name()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_v2_protobuf_decodes_and_kubectl_validates_a_list_with_it() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let (body, content_type) = raw_get(
        &cluster,
        "/openapi/v2",
        "application/com.github.proto-openapi.spec.v2@v1.0+protobuf",
    )
    .await?;
    ensure!(
        content_type == "application/com.github.proto-openapi.spec.v2.v1.0+protobuf",
        "{content_type}"
    );
    let document = DynamicMessage::decode(
        trellis_apiserver::endpoints::openapi::proto::document_descriptor()
            .map_err(anyhow::Error::msg)?,
        body.as_slice(),
    )?;
    ensure!(field(&document, "swagger")?.as_str() == Some("2.0"));
    // The Deployment definition carries its group-version-kind, which kubectl maps
    // kinds to schemas with.
    let definitions = field(&document, "definitions")?;
    let named = definitions
        .as_message()
        .context("definitions")?
        .get_field_by_name("additional_properties")
        .context("additional_properties")?;
    let deployment = named
        .as_list()
        .context("a list of definitions")?
        .iter()
        .filter_map(ProtoValue::as_message)
        .find(|d| {
            d.get_field_by_name("name").is_some_and(|n| {
                n.as_str()
                    .is_some_and(|n| n.ends_with("apps.v1.Deployment"))
            })
        })
        .context("no Deployment definition")?;
    let schema = field(deployment, "value")?;
    let extensions = schema
        .as_message()
        .context("schema")?
        .get_field_by_name("vendor_extension")
        .context("vendor_extension")?;
    let gvk = extensions
        .as_list()
        .context("extensions")?
        .iter()
        .filter_map(ProtoValue::as_message)
        .find(|e| {
            e.get_field_by_name("name")
                .and_then(|n| n.as_str().map(str::to_owned))
                == Some("x-kubernetes-group-version-kind".into())
        })
        .context("no group-version-kind extension")?;
    let yaml = field(gvk, "value")?
        .as_message()
        .and_then(|v| v.get_field_by_name("yaml"))
        .and_then(|y| y.as_str().map(str::to_owned))
        .context("yaml")?;
    ensure!(
        yaml.contains("Deployment") && yaml.contains("apps"),
        "{yaml}"
    );

    // The old name serves the same bytes.
    let (legacy, _) = raw_get(&cluster, "/swagger-2.0.0.pb-v1", "*/*").await?;
    ensure!(
        legacy == body,
        "/swagger-2.0.0.pb-v1 differs from /openapi/v2"
    );

    let applied = cluster
        .kubectl_ok_stdin(&["apply", "--validate=true", "-f", "-"], LIST)
        .await?;
    ensure!(
        applied.contains("configmap/listed-a created")
            && applied.contains("deployment.apps/listed-web created"),
        "{applied}"
    );
    let bad = LIST.replace("data: {k: v}", "data: {k: v}\n  bogus: 1");
    let refused = cluster
        .kubectl_err_stdin(&["apply", "--validate=true", "-f", "-"], &bad)
        .await?;
    ensure!(refused.contains("bogus"), "{refused}");
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_can_i_and_whoami_answer_from_rbac() -> Result<()> {
    let cluster = TestCluster::builder()
        .with_token("viewer-token", "viewer", &["viewers"])
        .start()
        .await?;
    let viewer = cluster.kubectl_with_token("viewer", "viewer-token")?;
    cluster
        .kubectl_ok(&[
            "create",
            "rolebinding",
            "viewers",
            "--clusterrole=view",
            "--group=viewers",
            "-n",
            "default",
        ])
        .await?;

    let admin_can = cluster
        .kubectl_ok(&["auth", "can-i", "create", "pods"])
        .await?;
    ensure!(admin_can.trim() == "yes", "{admin_can}");
    let can_list = viewer
        .ok(&["auth", "can-i", "list", "pods", "-n", "default"])
        .await?;
    ensure!(can_list.trim() == "yes", "{can_list}");
    // `no` exits 1 with "no" on stdout.
    let output = viewer
        .run(&["auth", "can-i", "create", "pods", "-n", "default"], None)
        .await?;
    ensure!(
        !output.status.success() && String::from_utf8_lossy(&output.stdout).trim() == "no",
        "{output:?}"
    );
    let elsewhere = viewer
        .run(
            &["auth", "can-i", "list", "pods", "-n", "kube-system"],
            None,
        )
        .await?;
    ensure!(!elsewhere.status.success(), "{elsewhere:?}");

    let rules = viewer
        .ok(&["auth", "can-i", "--list", "-n", "default"])
        .await?;
    ensure!(
        rules.contains("pods") && rules.contains("[get list watch]"),
        "{rules}"
    );
    ensure!(
        rules.contains("selfsubjectaccessreviews.authorization.k8s.io"),
        "{rules}"
    );

    let whoami = viewer.ok(&["auth", "whoami", "-o", "json"]).await?;
    let review: serde_json::Value = serde_json::from_str(&whoami)?;
    ensure!(review["kind"] == "SelfSubjectReview", "{whoami}");
    ensure!(
        review["status"]["userInfo"]["username"] == "viewer",
        "{whoami}"
    );
    let groups = review["status"]["userInfo"]["groups"].to_string();
    ensure!(
        groups.contains("viewers") && groups.contains("system:authenticated"),
        "{groups}"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_discovery_is_served_and_kubectl_stays_quiet() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let accept =
        "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json";
    let (body, content_type) = raw_get(&cluster, "/apis", accept).await?;
    ensure!(
        content_type == "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList",
        "{content_type}"
    );
    let doc: serde_json::Value = serde_json::from_slice(&body)?;
    ensure!(doc["kind"] == "APIGroupDiscoveryList", "{doc}");
    let apps = doc["items"]
        .as_array()
        .and_then(|items| items.iter().find(|g| g["metadata"]["name"] == "apps"))
        .context("no apps group")?;
    let deployments = apps["versions"][0]["resources"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["resource"] == "deployments"))
        .context("no deployments")?;
    ensure!(deployments["scope"] == "Namespaced", "{deployments}");
    let (core, _) = raw_get(
        &cluster,
        "/api",
        "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList",
    )
    .await?;
    let core: serde_json::Value = serde_json::from_slice(&core)?;
    ensure!(
        core["apiVersion"] == "apidiscovery.k8s.io/v2beta1",
        "{core}"
    );
    ensure!(
        core["items"][0]["versions"][0]["resources"]
            .as_array()
            .is_some_and(|r| r.iter().any(|r| r["resource"] == "pods")),
        "{core}"
    );
    // Plain JSON still gets the legacy document.
    let (legacy, _) = raw_get(&cluster, "/apis", "application/json").await?;
    let legacy: serde_json::Value = serde_json::from_slice(&legacy)?;
    ensure!(legacy["kind"] == "APIGroupList", "{legacy}");

    // kubectl resolves short names and categories from it, and says nothing else.
    let output = cluster
        .kubectl(&["get", "deploy,cm,quota,limits", "-n", "default"])
        .await?;
    ensure!(output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        stderr.trim().is_empty() || stderr.trim() == "No resources found in default namespace.",
        "{stderr}"
    );
    let all = cluster
        .kubectl(&["api-resources", "--api-group=apps"])
        .await?;
    ensure!(all.status.success() && all.stderr.is_empty(), "{all:?}");
    ensure!(String::from_utf8_lossy(&all.stdout).contains("deployments"));
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_pod_shows_its_events() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok(&["run", "web", "--image=nginx:1.25", "--restart=Never"])
        .await?;
    let uid = cluster
        .kubectl_ok(&["get", "pod", "web", "-o", "jsonpath={.metadata.uid}"])
        .await?;
    let event = format!(
        "apiVersion: v1
kind: Event
metadata:
  name: web.1
involvedObject:
  apiVersion: v1
  kind: Pod
  name: web
  namespace: default
  uid: {uid}
reason: Scheduled
message: Successfully assigned default/web to node-1
type: Normal
source:
  component: default-scheduler
firstTimestamp: \"2026-01-01T00:00:00Z\"
lastTimestamp: \"2026-01-01T00:00:00Z\"
count: 1
"
    );
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &event)
        .await?;
    // An event about another pod stays out of the description.
    let other = event
        .replace("name: web.1", "name: other.1")
        .replace("  name: web\n", "  name: other\n")
        .replace("Successfully assigned default/web", "Elsewhere");
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &other)
        .await?;
    let described = cluster.kubectl_ok(&["describe", "pod", "web"]).await?;
    let events = described
        .split("Events:")
        .nth(1)
        .context("no Events section")?;
    ensure!(
        events.contains("Scheduled")
            && events.contains("Successfully assigned default/web to node-1")
            && events.contains("default-scheduler"),
        "{described}"
    );
    ensure!(!events.contains("Elsewhere"), "{described}");
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_waits_until_the_finalizer_is_removed() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok_stdin(
            &["create", "-f", "-"],
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: held\n  finalizers: [example.com/hold]\n",
        )
        .await?;
    // kubectl logs its requests (`-v=6`) as their answers arrive: once it has opened its
    // watch of the object, it has seen the object still there and must keep waiting.
    let mut delete = cluster
        .admin()
        .command(&[
            "delete",
            "cm",
            "held",
            "--wait=true",
            "--timeout=30s",
            "-v=6",
        ])
        .spawn()?;
    let stderr = delete.stderr.take().context("kubectl's stderr")?;
    let log = tokio::spawn(async move {
        use tokio::io::AsyncBufReadExt as _;
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        let mut seen = Vec::new();
        while let Some(line) = lines.next_line().await? {
            let watching = line.contains("watch=true");
            seen.push(line);
            if watching {
                return Ok::<_, anyhow::Error>((true, seen, lines));
            }
        }
        Ok((false, seen, lines))
    });
    let (watching, seen, rest) = tokio::time::timeout(Duration::from_secs(30), log).await???;
    ensure!(
        watching,
        "kubectl never watched the object it deletes: {seen:?}"
    );
    let marked = cluster
        .kubectl_ok(&[
            "get",
            "cm",
            "held",
            "-o",
            "jsonpath={.metadata.deletionTimestamp}",
        ])
        .await?;
    ensure!(
        !marked.is_empty(),
        "the config map was not marked for deletion"
    );
    ensure!(
        delete.try_wait()?.is_none(),
        "kubectl delete returned before the finalizer went"
    );
    // Keep draining its log so that it never blocks on a full pipe.
    let drain = tokio::spawn(async move {
        let mut rest = rest;
        while let Ok(Some(_)) = rest.next_line().await {}
    });
    cluster
        .kubectl_ok(&[
            "patch",
            "cm",
            "held",
            "--type=merge",
            "-p",
            r#"{"metadata":{"finalizers":null}}"#,
        ])
        .await?;
    let output = tokio::time::timeout(Duration::from_secs(30), delete.wait_with_output()).await??;
    drain.abort();
    ensure!(output.status.success(), "{output:?}");
    ensure!(
        String::from_utf8_lossy(&output.stdout).contains("configmap \"held\" deleted"),
        "{output:?}"
    );
    let gone = cluster.kubectl_err(&["get", "cm", "held"]).await?;
    ensure!(
        gone.contains("NotFound") || gone.contains("not found"),
        "{gone}"
    );
    cluster.stop().await
}

/// client-go runs every informer of a process as a stream on one HTTP/2 connection: a
/// watch past the 200th on a connection must start at once (hyper's default limit
/// would hold it back until another stream ended), and see changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_http2_connection_carries_hundreds_of_watches() -> Result<()> {
    use http_body_util::BodyExt as _;
    const WATCHES: usize = 300;
    let cluster = TestCluster::start().await?;
    let connection = cluster.http2().await?;
    let mut streams = Vec::with_capacity(WATCHES);
    for n in 1..=WATCHES {
        let request =
            cluster.http2_request("GET", "/api/v1/namespaces/default/configmaps?watch=1")?;
        let response = tokio::time::timeout(
            Duration::from_secs(10),
            connection.clone().send_request(request),
        )
        .await
        .with_context(|| format!("watch {n} did not start within 10 s"))?
        .with_context(|| format!("watch {n}"))?;
        ensure!(response.status() == 200, "watch {n}: {}", response.status());
        streams.push(response.into_body());
    }
    cluster
        .kubectl_ok(&["create", "configmap", "seen-by-all", "--from-literal=k=v"])
        .await?;
    for (n, mut body) in streams.into_iter().enumerate().rev().take(3) {
        let mut seen = Vec::new();
        let found = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame?.into_data() {
                    seen.extend_from_slice(&data);
                    if String::from_utf8_lossy(&seen).contains("\"seen-by-all\"") {
                        return anyhow::Ok(true);
                    }
                }
            }
            Ok(false)
        })
        .await;
        ensure!(
            matches!(found, Ok(Ok(true))),
            "watch {} did not see the create: {found:?}",
            n + 1
        );
    }
    cluster.stop().await
}

/// The value of the sample `name{labels}` in a Prometheus text exposition.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// `/metrics` counts requests by verb, resource and code, times them and the store's
/// calls, and counts open watches; the health endpoints and `/version` answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_health_endpoints_answer() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok(&["create", "configmap", "counted", "--from-literal=k=v"])
        .await?;
    cluster.kubectl_ok(&["get", "configmap", "counted"]).await?;
    let metrics = cluster.request("GET", "/metrics", "text/plain", "").await?;
    ensure!(
        metrics.status == 200,
        "/metrics answered {}",
        metrics.status
    );
    let text = String::from_utf8_lossy(&metrics.body);
    for (series, at_least) in [
        (
            r#"apiserver_request_total{verb="create",group="",version="v1",resource="configmaps",subresource="",scope="namespace",code="201"}"#,
            1.0,
        ),
        (
            r#"apiserver_request_total{verb="get",group="",version="v1",resource="configmaps",subresource="",scope="resource",code="200"}"#,
            1.0,
        ),
        (
            r#"apiserver_request_duration_seconds_count{verb="create",group="",version="v1",resource="configmaps",subresource="",scope="namespace"}"#,
            1.0,
        ),
        (
            r#"apiserver_request_duration_seconds_bucket{le="+Inf",verb="create",group="",version="v1",resource="configmaps",subresource="",scope="namespace"}"#,
            1.0,
        ),
        (
            r#"apiserver_storage_request_duration_seconds_count{operation="create"}"#,
            1.0,
        ),
        (
            r#"apiserver_storage_request_duration_seconds_count{operation="get"}"#,
            1.0,
        ),
        ("apiserver_watch_cache_watchers", 0.0),
    ] {
        let value = sample(&text, series).with_context(|| format!("no {series} in\n{text}"))?;
        ensure!(value >= at_least, "{series} is {value}:\n{text}");
    }
    for path in ["/healthz", "/livez", "/readyz"] {
        let answer = cluster.request("GET", path, "text/plain", "").await?;
        ensure!(
            answer.status == 200 && String::from_utf8_lossy(&answer.body).contains("ok"),
            "{path}: {} {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
    }
    let version = cluster
        .request("GET", "/version", "application/json", "")
        .await?
        .json()?;
    ensure!(
        version["gitVersion"]
            .as_str()
            .is_some_and(|v| v.starts_with('v'))
            && version["major"].is_string(),
        "{version}"
    );
    cluster.stop().await
}
