//! The node's resource usage through the API server, as a metrics server reads it:
//! `kubectl get --raw /api/v1/nodes/N/proxy/stats/summary` (the kubelet's Summary API)
//! lists the running pods with their usage and the node's memory, filesystems and
//! PIDs; `/metrics/resource` through the same proxy is Prometheus text with the pods'
//! series; `nodes/proxy` is what a user needs to read them, and a node without an
//! address answers 503. One server and one node (on the machine's network) for the
//! module.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher;
use serde_json::{Value, json};
use trellis_agent::AgentConfig;
use trellis_api::{Shutdown, Stop};
use trellis_client::identity;
use trellis_client::informer::SharedInformers;
use trellis_runtime::{Runtime, RuntimeConfig};
use trellis_tests::TestCluster;

use super::node::wait_pod;

const NODE: &str = "stats-node";
/// How long the Summary may take to show both pods' usage: the busy pod's rate needs
/// two readings some time apart.
const SETTLE: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_stats_through_the_api_server_show_the_pods_usage() -> Result<()> {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: process pods run sandboxed, which needs root");
        return Ok(());
    }
    let started = tokio::time::Instant::now();
    let cluster = TestCluster::start().await?;
    let dir = trellis_tests::test_dir()?;
    let node = StatsNode::start(&cluster, dir.path(), NODE).await?;
    let admin = cluster.kube_admin().await?;
    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let work = async {
        for (name, script) in [
            ("busy", "while :; do :; done"),
            ("idle", "exec sleep 3600"),
        ] {
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {"nodeName": NODE, "runtimeClassName": "process",
                    "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "main", "image": "file:///bin/sh",
                        "command": ["/bin/sh", "-c", script]}]}
            }))?;
            api.create(&PostParams::default(), &pod).await?;
        }
        for name in ["busy", "idle"] {
            wait_pod(&pods, name, Duration::from_secs(60), |p| {
                super::node::container(p)
                    .and_then(|c| c.state.as_ref())
                    .is_some_and(|s| s.running.is_some())
            })
            .await?;
        }

        let summary_path = format!("/api/v1/nodes/{NODE}/proxy/stats/summary");
        let (summary, tries) = settle(&cluster, &summary_path).await?;
        eprintln!("the summary showed both pods' rates after {tries} readings");
        check_node(&summary)?;

        // Only CPU and memory, as a metrics server asks.
        let lean: Value = serde_json::from_str(
            &cluster
                .kubectl_ok(&[
                    "get",
                    "--raw",
                    &format!("{summary_path}?only_cpu_and_memory=true"),
                ])
                .await?,
        )?;
        ensure!(
            lean["node"].get("fs").is_none() && lean["node"]["memory"].is_object(),
            "only_cpu_and_memory kept more or less: {lean}"
        );

        let metrics = cluster
            .kubectl_ok(&[
                "get",
                "--raw",
                &format!("/api/v1/nodes/{NODE}/proxy/metrics/resource"),
            ])
            .await?;
        let series = parse_prometheus_text(&metrics)?;
        for name in [
            r#"pod_cpu_usage_seconds_total{namespace="default",pod="busy"}"#,
            r#"pod_memory_working_set_bytes{namespace="default",pod="idle"}"#,
            r#"container_cpu_usage_seconds_total{container="main",namespace="default",pod="busy"}"#,
            r#"container_memory_working_set_bytes{container="main",namespace="default",pod="busy"}"#,
            r#"container_start_time_seconds{container="main",namespace="default",pod="idle"}"#,
            "node_cpu_usage_seconds_total",
            "node_memory_working_set_bytes",
        ] {
            let value = series.get(name).with_context(|| {
                format!("/metrics/resource has no {name}:\n{metrics}")
            })?;
            ensure!(*value > 0.0, "{name} is {value}:\n{metrics}");
        }
        ensure!(
            series.get("resource_scrape_error") == Some(&0.0),
            "the scrape failed:\n{metrics}"
        );

        // Reading pods is not enough: the stats are behind `nodes/proxy`.
        cluster
            .admin()
            .ok_stdin(
                &["apply", "-f", "-"],
                r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: node-stats-reader}
rules: [{apiGroups: [""], resources: ["nodes/proxy"], verbs: ["get"]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: kate-reads-node-stats}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: node-stats-reader}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: kate}]
"#,
            )
            .await?;
        let jane = cluster.kubectl_with_cert("jane", &[])?;
        let refused = jane.err(&["get", "--raw", &summary_path], None).await?;
        ensure!(
            refused.contains(r#"cannot get resource "nodes/proxy""#),
            "jane was told: {refused}"
        );
        let kate = cluster.kubectl_with_cert("kate", &[])?;
        let read = kate.ok(&["get", "--raw", &summary_path]).await?;
        ensure!(read.contains("\"podRef\""), "kate read: {read}");

        // A node that serves nothing yet: 503, with a Status.
        cluster
            .admin()
            .ok_stdin(
                &["apply", "-f", "-"],
                "apiVersion: v1\nkind: Node\nmetadata: {name: no-address}\n",
            )
            .await?;
        let unavailable = cluster
            .admin()
            .err(
                &["get", "--raw", "/api/v1/nodes/no-address/proxy/stats/summary"],
                None,
            )
            .await?;
        ensure!(
            unavailable.contains("ServiceUnavailable")
                || unavailable.contains("service unavailable"),
            "a node without an address: {unavailable}"
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;

    for name in ["busy", "idle"] {
        let _ = api
            .delete(name, &DeleteParams::default().grace_period(0))
            .await;
    }
    // The informer drops a deleted pod: wait until neither is there.
    let _ = tokio::time::timeout(Duration::from_secs(30), async {
        let mut changes = pods.subscribe();
        while ["busy", "idle"]
            .iter()
            .any(|n| pods.get(&format!("default/{n}")).is_some())
        {
            if changes.recv().await.is_none() {
                break;
            }
        }
    })
    .await;
    // The agent removes a gone pod's sandbox (its processes, the busy loop) right after;
    // stopped before that, they would outlive the test.
    let removed = node.sandboxes_removed(Duration::from_secs(20)).await;
    node.stop().await?;
    work?;
    removed?;
    cluster.stop().await?;
    eprintln!("stats test took {:?}", started.elapsed());
    Ok(())
}

/// Reads the Summary until both pods show their usage and the busy one's rate is
/// above the idle one's (the rate needs a previous reading), up to [`SETTLE`].
async fn settle(cluster: &TestCluster, path: &str) -> Result<(Value, u32)> {
    let deadline = tokio::time::Instant::now() + SETTLE;
    let mut tries = 0;
    loop {
        tries += 1;
        let summary: Value =
            serde_json::from_str(&cluster.kubectl_ok(&["get", "--raw", path]).await?)
                .context("the summary is not JSON")?;
        match pods_settled(&summary) {
            Ok(()) => return Ok((summary, tries)),
            Err(e) if tokio::time::Instant::now() > deadline => {
                bail!("after {tries} readings: {e:#}\n{summary:#}")
            }
            // A real probe retried: the next reading is what changes the answer.
            Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
}

/// Both pods listed with their container's and their own usage; busy uses more CPU.
fn pods_settled(summary: &Value) -> Result<()> {
    let pod = |name: &str| -> Result<&Value> {
        summary["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["podRef"]["name"] == name && p["podRef"]["namespace"] == "default")
            .with_context(|| format!("pod {name} is not listed"))
    };
    let mut rates = Vec::new();
    for name in ["busy", "idle"] {
        let p = pod(name)?;
        ensure!(
            p["podRef"]["uid"].as_str().is_some_and(|u| !u.is_empty()),
            "{name} has no uid"
        );
        ensure!(p["startTime"].is_string(), "{name} has no startTime");
        let container = p["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["name"] == "main")
            .with_context(|| format!("{name}'s container is not listed"))?;
        for (what, stats) in [("container", container), ("pod", p)] {
            let working_set = stats["memory"]["workingSetBytes"].as_u64().unwrap_or(0);
            ensure!(
                working_set > 0,
                "{name}'s {what} working set is {working_set}"
            );
            let cpu = stats["cpu"]["usageCoreNanoSeconds"].as_u64().unwrap_or(0);
            ensure!(cpu > 0, "{name}'s {what} CPU time is {cpu}");
        }
        let rate = p["cpu"]["usageNanoCores"]
            .as_u64()
            .with_context(|| format!("{name} has no usageNanoCores yet"))?;
        rates.push(rate);
    }
    ensure!(
        rates[0] > rates[1],
        "busy uses {} nanocores, idle {}",
        rates[0],
        rates[1]
    );
    Ok(())
}

/// The node's own figures hold together.
fn check_node(summary: &Value) -> Result<()> {
    let node = &summary["node"];
    ensure!(node["nodeName"] == NODE, "nodeName: {}", node["nodeName"]);
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    let total = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .context("no MemTotal")?
        * 1024;
    let memory = &node["memory"];
    let (available, working_set) = (n(&memory["availableBytes"]), n(&memory["workingSetBytes"]));
    ensure!(
        working_set > 0 && available > 0 && available <= total && available + working_set == total,
        "node memory: available {available}, working set {working_set}, capacity {total}"
    );
    ensure!(
        n(&node["cpu"]["usageCoreNanoSeconds"]) > 0,
        "node cpu: {}",
        node["cpu"]
    );
    for (what, fs) in [
        ("fs", &node["fs"]),
        ("imageFs", &node["runtime"]["imageFs"]),
    ] {
        let capacity = n(&fs["capacityBytes"]);
        ensure!(
            capacity > 0
                && n(&fs["availableBytes"]) <= capacity
                && n(&fs["usedBytes"]) <= capacity
                && n(&fs["inodesFree"]) <= n(&fs["inodes"]),
            "node {what}: {fs}"
        );
    }
    let rlimit = &node["rlimit"];
    ensure!(
        n(&rlimit["curproc"]) > 0 && n(&rlimit["curproc"]) < n(&rlimit["maxpid"]),
        "node rlimit: {rlimit}"
    );
    Ok(())
}

/// Prometheus' text format, strictly enough to catch a malformed line: every sample
/// line is `NAME[{LABELS}] VALUE [TIMESTAMP]`, its family announced by `# TYPE`
/// before it. The samples by their name and labels as written.
fn parse_prometheus_text(text: &str) -> Result<HashMap<String, f64>> {
    let mut typed = Vec::new();
    let mut samples = HashMap::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(comment) = line.strip_prefix("# ") {
            let mut words = comment.split_whitespace();
            if words.next() == Some("TYPE") {
                let name = words.next().context("TYPE without a name")?;
                let kind = words.next().context("TYPE without a type")?;
                ensure!(
                    ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                    "unknown type in {line:?}"
                );
                typed.push(name.to_owned());
            }
            continue;
        }
        let (series, rest) = match line.find('}') {
            Some(end) => (&line[..=end], line[end + 1..].trim_start()),
            None => line.split_once(' ').context("a sample without a value")?,
        };
        let name = series.split('{').next().unwrap_or_default();
        ensure!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name in {line:?}"
        );
        ensure!(
            typed.last().is_some_and(|t| t == name),
            "{name} comes without its # TYPE"
        );
        let mut fields = rest.split_whitespace();
        let value: f64 = fields
            .next()
            .context("no value")?
            .parse()
            .with_context(|| format!("bad value in {line:?}"))?;
        if let Some(ts) = fields.next() {
            ts.parse::<i64>()
                .with_context(|| format!("bad timestamp in {line:?}"))?;
        }
        ensure!(fields.next().is_none(), "trailing fields in {line:?}");
        samples.insert(series.to_owned(), value);
    }
    Ok(samples)
}

/// A node of its own for a module (also `metrics`): Trellis' runtime on a socket (with
/// the process handler) and the agent serving its routes with the cluster CA, on
/// 127.0.0.1.
pub(crate) struct StatsNode {
    stop: Stop,
    /// Where the runtime keeps its sandbox records (`sandboxes/ID.json`).
    runtime_root: std::path::PathBuf,
    agent: tokio::task::JoinHandle<Result<()>>,
    server: tokio::task::JoinHandle<Result<()>>,
}

impl StatsNode {
    pub(crate) async fn start(
        cluster: &TestCluster,
        root: &std::path::Path,
        name: &str,
    ) -> Result<StatsNode> {
        let (stop, stopped) = Shutdown::new();
        // The defaults stand for the fields the runtime may grow.
        #[allow(clippy::needless_update)]
        let runtime = Runtime::new(RuntimeConfig {
            root: root.join("runtime"),
            cache_dir: Some(root.join("compiled")),
            process_handler: true,
            node_ip: "127.0.0.1".parse()?,
            init_program: Some(trellis_tests::init_program()),
            ..Default::default()
        })?;
        let socket = root.join("cri.sock");
        let listener = trellis_runtime::listen(&socket)?;
        let server_stop = stopped.clone();
        let server = tokio::spawn(async move {
            trellis_runtime::serve_on(runtime, listener, async move {
                server_stop.wait().await;
            })
            .await
        });
        let cri = trellis_runtime::connect(&socket).await?;
        let mut config = AgentConfig::new(name, "127.0.0.1".parse()?, root.join("agent"));
        config.relist_period = Duration::from_millis(50);
        config.port = 0;
        config.client_ca_pem = Some(cluster.ca_pem.clone());
        // No pressure wherever the test runs: the usage is what is checked.
        config.eviction_hard = None;
        let client = cluster.in_process().client(identity::node(name));
        let agent = tokio::spawn(trellis_agent::run(
            config,
            client,
            cri,
            SharedInformers::new(),
            stopped,
        ));
        Ok(StatsNode {
            stop,
            runtime_root: root.join("runtime"),
            agent,
            server,
        })
    }

    /// Waits until the runtime has no sandbox left, up to `limit`: woken as their
    /// records are removed.
    async fn sandboxes_removed(&self, limit: Duration) -> Result<()> {
        let records = self.runtime_root.join("sandboxes");
        let left = || {
            std::fs::read_dir(&records)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        };
        trellis_tests::wait_removed(&records, left, limit).await
    }

    pub(crate) async fn stop(self) -> Result<()> {
        self.stop.stop();
        self.agent.await??;
        self.server.await??;
        Ok(())
    }
}
