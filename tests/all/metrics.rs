//! The aggregation layer and the resource metrics API: Trellis' metrics server,
//! registered as the APIService `v1beta1.metrics.k8s.io`, is reached through the API
//! server (discovery lists its group, the caller passes as the front proxy's
//! `X-Remote-*` headers and is authorized on both sides), so `kubectl top nodes|pods`
//! (current and 1.20) show a node's and a busy pod's usage; an APIService whose
//! backend does not answer is `Available=False` with the reason Kubernetes gives and
//! its group answers 503.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DynamicObject, PostParams};
use kube::runtime::watcher;
use serde_json::{Value, json};
use trellis::metrics_server::{self, MetricsServer};
use trellis_api::Shutdown;
use trellis_client::informer::SharedInformers;
use trellis_tests::TestCluster;

use super::node::wait_pod;
use super::stats::StatsNode;

const NODE: &str = "metrics-node";
/// How long metrics may take to appear: two readings a resolution apart, with builds
/// sharing the machine.
const SETTLE: Duration = Duration::from_secs(60);

/// Starts the metrics server as `trellis up` does, reading every second, on loopback.
async fn start_metrics_server(cluster: &TestCluster, stopped: Shutdown) -> Result<MetricsServer> {
    let config = metrics_server::Config {
        metric_resolution: Duration::from_secs(1),
        listen: "127.0.0.1:0".parse()?,
        ..Default::default()
    };
    metrics_server::start_in_process(&cluster.in_process(), config, stopped).await
}

/// Waits (on a watch) until APIService `name`'s `Available` condition has `status`
/// and, if given, `reason`; returns the condition.
async fn wait_available(
    cluster: &TestCluster,
    name: &str,
    status: &str,
    reason: Option<&str>,
) -> Result<Value> {
    let admin = cluster.kube_admin().await?;
    let api: Api<DynamicObject> = Api::all_with(admin, &metrics_server::apiservice_resource());
    let condition = |o: &DynamicObject| {
        o.data["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "Available")
            .cloned()
    };
    let fits = |o: Option<&DynamicObject>| {
        o.and_then(condition)
            .is_some_and(|c| c["status"] == status && reason.is_none_or(|r| c["reason"] == r))
    };
    let found = tokio::time::timeout(
        Duration::from_secs(30),
        kube::runtime::wait::await_condition(api.clone(), name, fits),
    )
    .await;
    let last = api.get_opt(name).await?;
    match found {
        Ok(Ok(_)) => last.as_ref().and_then(condition).context("condition gone"),
        _ => bail!(
            "APIService {name} is not Available={status} ({reason:?}): {:?}",
            last.map(|o| o.data["status"].clone())
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apiservice_is_proxied_and_one_whose_backend_is_down_answers_503() -> Result<()> {
    let started = tokio::time::Instant::now();
    let cluster = TestCluster::start().await?;
    let (stop, stopped) = Shutdown::new();
    let server = start_metrics_server(&cluster, stopped).await?;
    let condition =
        wait_available(&cluster, metrics_server::APISERVICE, "True", Some("Passed")).await?;
    ensure!(condition["message"] == "all checks passed", "{condition}");

    // Discovery lists the group and the backend's resources.
    let groups = cluster.kubectl_ok(&["get", "--raw", "/apis"]).await?;
    ensure!(groups.contains("metrics.k8s.io/v1beta1"), "/apis: {groups}");
    let group = cluster
        .kubectl_ok(&["get", "--raw", "/apis/metrics.k8s.io"])
        .await?;
    ensure!(group.contains(r#""preferredVersion""#), "{group}");
    let resources = cluster
        .kubectl_ok(&["api-resources", "--api-group", "metrics.k8s.io"])
        .await?;
    ensure!(
        resources.contains("PodMetrics") && resources.contains("NodeMetrics"),
        "kubectl api-resources: {resources}"
    );
    // Through the API server to the backend: no node yet, so no metrics.
    let nodes: Value = serde_json::from_str(
        &cluster
            .kubectl_ok(&["get", "--raw", "/apis/metrics.k8s.io/v1beta1/nodes"])
            .await?,
    )?;
    ensure!(nodes["kind"] == "NodeMetricsList", "{nodes}");
    let missing = cluster
        .kubectl_err(&[
            "get",
            "--raw",
            "/apis/metrics.k8s.io/v1beta1/namespaces/default/pods/none",
        ])
        .await?;
    ensure!(
        missing.contains("NotFound") || missing.contains("not found"),
        "{missing}"
    );
    // A user without the right is refused before the backend; one with `view` (which
    // aggregates the metrics reader) passes both, as themselves.
    let jane = cluster.kubectl_with_cert("jane", &[])?;
    let refused = jane
        .err(
            &[
                "get",
                "--raw",
                "/apis/metrics.k8s.io/v1beta1/namespaces/default/pods",
            ],
            None,
        )
        .await?;
    ensure!(refused.contains("forbidden"), "jane was told: {refused}");
    cluster
        .kubectl_ok(&[
            "create",
            "rolebinding",
            "jane-views",
            "--clusterrole=view",
            "--user=jane",
            "-n",
            "default",
        ])
        .await?;
    let pods = jane
        .ok(&[
            "get",
            "--raw",
            "/apis/metrics.k8s.io/v1beta1/namespaces/default/pods",
        ])
        .await?;
    ensure!(pods.contains("PodMetricsList"), "{pods}");

    // A backend nothing answers for: its Service's endpoint is a closed port.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    cluster
        .kubectl_ok_stdin(
            &["apply", "-f", "-"],
            &format!(
                r#"
apiVersion: v1
kind: Service
metadata: {{name: down, namespace: default}}
spec: {{ports: [{{name: https, port: 443, targetPort: {closed}}}]}}
---
apiVersion: v1
kind: Endpoints
metadata: {{name: down, namespace: default}}
subsets: [{{addresses: [{{ip: 127.0.0.1}}], ports: [{{name: https, port: {closed}}}]}}]
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {{name: v1.down.example.com}}
spec:
  group: down.example.com
  version: v1
  service: {{name: down, namespace: default, port: 443}}
  insecureSkipTLSVerify: true
  groupPriorityMinimum: 1000
  versionPriority: 15
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {{name: v1.nowhere.example.com}}
spec:
  group: nowhere.example.com
  version: v1
  service: {{name: nowhere, namespace: default, port: 443}}
  insecureSkipTLSVerify: true
  groupPriorityMinimum: 1000
  versionPriority: 15
"#
            ),
        )
        .await?;
    let down = wait_available(
        &cluster,
        "v1.down.example.com",
        "False",
        Some("FailedDiscoveryCheck"),
    )
    .await?;
    ensure!(
        down["message"]
            .as_str()
            .is_some_and(|m| m.contains("connect")),
        "{down}"
    );
    wait_available(
        &cluster,
        "v1.nowhere.example.com",
        "False",
        Some("ServiceNotFound"),
    )
    .await?;
    let answered = cluster
        .kubectl_err(&["get", "--raw", "/apis/down.example.com/v1/things"])
        .await?;
    ensure!(
        answered.contains("ServiceUnavailable") || answered.contains("service unavailable"),
        "a request for the unavailable group got: {answered}"
    );
    let table = cluster.kubectl_ok(&["get", "apiservices"]).await?;
    ensure!(
        table.contains("v1beta1.metrics.k8s.io") && table.contains("kube-system/metrics-server"),
        "kubectl get apiservices:\n{table}"
    );
    // The backend gone: its Endpoints emptied, the group-version is unavailable.
    cluster
        .kubectl_ok(&[
            "patch",
            "endpoints",
            "metrics-server",
            "-n",
            "kube-system",
            "--type=merge",
            "-p",
            r#"{"subsets": []}"#,
        ])
        .await?;
    wait_available(
        &cluster,
        metrics_server::APISERVICE,
        "False",
        Some("MissingEndpoints"),
    )
    .await?;
    let answered = cluster
        .kubectl_err(&["get", "--raw", "/apis/metrics.k8s.io/v1beta1/nodes"])
        .await?;
    ensure!(
        answered.contains("ServiceUnavailable") || answered.contains("service unavailable"),
        "{answered}"
    );

    stop.stop();
    server.wait().await?;
    eprintln!("took {:?}", started.elapsed());
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_top_shows_the_nodes_and_a_busy_pods_usage() -> Result<()> {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: process pods run sandboxed, which needs root");
        return Ok(());
    }
    let started = tokio::time::Instant::now();
    let cluster = TestCluster::start().await?;
    let dir = trellis_tests::test_dir()?;
    let node = StatsNode::start(&cluster, dir.path(), NODE).await?;
    let (stop, stopped) = Shutdown::new();
    let server = start_metrics_server(&cluster, stopped).await?;
    let admin = cluster.kube_admin().await?;
    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let work = async {
        for (name, containers) in [
            (
                "busy",
                json!([
                    {"name": "spin", "image": "file:///bin/sh",
                     "command": ["/bin/sh", "-c", "while :; do :; done"]},
                    {"name": "rest", "image": "file:///bin/sh",
                     "command": ["/bin/sh", "-c", "exec sleep 3600"]},
                ]),
            ),
            (
                "idle",
                json!([{"name": "main", "image": "file:///bin/sh",
                        "command": ["/bin/sh", "-c", "exec sleep 3600"]}]),
            ),
        ] {
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": name, "labels": {"app": name}},
                "spec": {"nodeName": NODE, "runtimeClassName": "process",
                    "terminationGracePeriodSeconds": 0, "containers": containers}
            }))?;
            api.create(&PostParams::default(), &pod).await?;
        }
        for name in ["busy", "idle"] {
            wait_pod(&pods, name, Duration::from_secs(60), |p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .is_some_and(|cs| {
                        !cs.is_empty()
                            && cs
                                .iter()
                                .all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
                    })
            })
            .await?;
        }
        wait_available(&cluster, metrics_server::APISERVICE, "True", None).await?;

        // Bounded retries of the real thing: a pod's figure needs two readings.
        let deadline = tokio::time::Instant::now() + SETTLE;
        let mut tries = 0;
        let (top_pods, tries) = loop {
            let out = cluster.kubectl(&["top", "pods"]).await?;
            tries += 1;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            if out.status.success() && text.contains("busy") && text.contains("idle") {
                break (text, tries);
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "kubectl top pods never showed both pods: {text}{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        };
        eprintln!("kubectl top pods after {tries} tries:\n{top_pods}");
        ensure!(
            top_pods.contains("CPU(cores)") && top_pods.contains("MEMORY(bytes)"),
            "{top_pods}"
        );
        let busy_cpu = millicores(&top_pods, "busy")?;
        ensure!(
            busy_cpu >= 100,
            "the busy pod uses {busy_cpu}m:\n{top_pods}"
        );
        ensure!(millicores(&top_pods, "idle")? < busy_cpu, "{top_pods}");

        let containers = cluster.kubectl_ok(&["top", "pods", "--containers"]).await?;
        for name in ["spin", "rest", "main"] {
            ensure!(
                containers.contains(name),
                "no container {name}:\n{containers}"
            );
        }
        let selected = cluster
            .kubectl_ok(&["top", "pods", "-l", "app=busy"])
            .await?;
        ensure!(
            selected.contains("busy") && !selected.contains("idle"),
            "{selected}"
        );
        let nodes = cluster.kubectl_ok(&["top", "nodes"]).await?;
        ensure!(
            nodes.contains(NODE) && nodes.contains("CPU(%)"),
            "kubectl top nodes:\n{nodes}"
        );
        let old = cluster
            .kubectl_1_20()?
            .ok(&["top", "pods", "busy", "--containers"])
            .await?;
        ensure!(old.contains("spin"), "kubectl 1.20 top:\n{old}");

        let metrics: Value = serde_json::from_str(
            &cluster
                .kubectl_ok(&[
                    "get",
                    "--raw",
                    "/apis/metrics.k8s.io/v1beta1/namespaces/default/pods/busy",
                ])
                .await?,
        )?;
        ensure!(
            metrics["kind"] == "PodMetrics"
                && metrics["window"].as_str().is_some_and(|w| w.ends_with('s'))
                && metrics["timestamp"].is_string()
                && metrics["metadata"]["labels"]["app"] == "busy"
                && metrics["containers"]
                    .as_array()
                    .is_some_and(|c| c.len() == 2),
            "{metrics}"
        );
        anyhow::Ok(())
    };
    let result = work.await;
    for name in ["busy", "idle"] {
        let _ = api.delete(name, &Default::default()).await;
    }
    stop.stop();
    server.wait().await?;
    node.stop().await?;
    eprintln!("took {:?}", started.elapsed());
    result?;
    cluster.stop().await
}

/// The CPU column of `pod`'s row in `kubectl top pods`, in millicores.
fn millicores(table: &str, pod: &str) -> Result<u64> {
    let row = table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(pod))
        .with_context(|| format!("no row for {pod}"))?;
    let cpu = row.split_whitespace().nth(1).context("no CPU column")?;
    cpu.trim_end_matches('m')
        .parse()
        .with_context(|| format!("CPU {cpu:?}"))
}
