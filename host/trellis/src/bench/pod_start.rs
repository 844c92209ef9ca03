//! `trellis bench pod-start`: how soon a pod bound to a node runs: an API server on the
//! embedded store in this process, and a `trellis node` child process (the agent and
//! Trellis' runtime on its Unix socket) joined to it with a node's certificate.
//!
//! Pods are created already bound (`spec.nodeName`), one after the other, each once
//! the one before it is Running, so that each start is measured alone: from the
//! create's answer to the `Running` phase seen by a watch. The first pod of the run
//! starts a component never compiled on this machine (a fresh cache) and is reported
//! apart (`first_start_ms`); the percentiles cover the others.
//!
//! Handlers: `wasmtime` runs `plugins/target/dist/workload.wasm` (a WASI program that
//! sleeps); `process` runs `/bin/sleep`. `node_rss_mb` is the node process's resident
//! memory with every pod running (for `process`, the agent and the runtime alone: the
//! pods are processes of their own).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Args, ValueEnum};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;
use trellis_client::informer::SharedInformers;

use super::Percentiles;
use super::cluster::LocalCluster;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Handler {
    Wasmtime,
    Process,
}

#[derive(Debug, Args)]
pub struct PodStartArgs {
    #[arg(long, value_enum, default_value = "wasmtime")]
    handler: Handler,

    /// Pods started.
    #[arg(long, default_value_t = 200)]
    pods: usize,

    /// The WASI program the `wasmtime` pods run (it is passed `sleep MS`).
    #[arg(
        long,
        default_value = "plugins/target/dist/workload.wasm",
        value_name = "FILE"
    )]
    component: PathBuf,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    handler: Handler,
    pods: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    /// The first pod: a component compiled for the first time on this machine.
    first_start_ms: f64,
    /// The `trellis node` process (agent and runtime) with every pod running.
    node_rss_mb: f64,
}

const NODE: &str = "bench-node";

pub async fn run(args: PodStartArgs) -> anyhow::Result<()> {
    let image = match args.handler {
        Handler::Wasmtime => {
            let path = args.component.canonicalize().with_context(|| {
                format!(
                    "find {} (build it with plugins/build.sh)",
                    args.component.display()
                )
            })?;
            format!("file://{}", path.display())
        }
        Handler::Process => "file:///bin/sleep".to_owned(),
    };
    let cluster = LocalCluster::start().await?;
    let node_dir = cluster.dir.path().join("node");
    let node = start_node(&cluster, &node_dir);
    let in_process = trellis_client::InProcess::new(cluster.server.in_process.clone());
    let admin = in_process.client(trellis_api::UserInfo::new("admin", ["system:masters"]));
    let measured = match node {
        Ok(mut child) => {
            let measured = measure(&admin, &args, &image, child.id()).await;
            let cleaned = cleanup(&node_dir).await;
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_raw(child.id().unwrap_or(0) as i32)
                    .unwrap_or(rustix::process::Pid::INIT),
                rustix::process::Signal::TERM,
            );
            let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
            let _ = child.kill().await;
            cleaned.and(measured)
        }
        Err(e) => Err(e),
    };
    let stopped = cluster.stop().await;
    let report = measured?;
    stopped?;
    super::print_report(args.json, &report, || {
        format!(
            "pod start ({:?}): {} pods, bound → Running p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; the first (compiled) {:.1} ms; the node process {:.1} MB with every pod running",
            report.handler,
            report.pods,
            report.p50_ms,
            report.p99_ms,
            report.max_ms,
            report.first_start_ms,
            report.node_rss_mb
        )
    })
}

/// `trellis node` as a child process, with a node's certificate from the cluster CA.
fn start_node(
    cluster: &LocalCluster,
    dir: &std::path::Path,
) -> anyhow::Result<tokio::process::Child> {
    std::fs::create_dir_all(dir)?;
    let pki = trellis_apiserver::server::pki::Pki::load_or_create(cluster.dir.path(), &[])?;
    let user = format!("system:node:{NODE}");
    let (cert, key) = pki.issue_client_cert(&user, &["system:nodes"], 1)?;
    let kubeconfig = dir.join("node.kubeconfig");
    std::fs::write(
        &kubeconfig,
        trellis_pki::kubeconfig::cert_kubeconfig(
            &cluster.server.url,
            pki.ca_pem(),
            &user,
            &cert,
            &key,
        ),
    )?;
    let exe = std::env::current_exe().context("find this binary")?;
    let log = std::fs::File::create(dir.join("node.log"))?;
    tokio::process::Command::new(exe)
        .args(["node", "--kubeconfig"])
        .arg(&kubeconfig)
        .arg("--data-dir")
        .arg(dir)
        .args([
            "--node-name",
            NODE,
            "--node-port",
            "0",
            "--process-handler",
            "true",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("start `trellis node`")
}

async fn measure(
    admin: &kube::Client,
    args: &PodStartArgs,
    image: &str,
    node_pid: Option<u32>,
) -> anyhow::Result<Report> {
    let informers = SharedInformers::new();
    let nodes = informers.informer::<k8s_openapi::api::core::v1::Node>(
        Api::all(admin.clone()),
        watcher::Config::default(),
    );
    let mut node_changes = nodes.subscribe();
    let ready = async {
        while !nodes.get(NODE).is_some_and(|n| {
            n.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        }) {
            node_changes.recv().await.context("node informer ended")?;
        }
        Ok::<_, anyhow::Error>(())
    };
    tokio::time::timeout(Duration::from_secs(30), ready)
        .await
        .context("the node did not become Ready (see its node.log)")??;
    let pods = informers.informer::<Pod>(
        Api::namespaced(admin.clone(), "default"),
        watcher::Config::default(),
    );
    pods.wait_synced().await;
    let mut changes = pods.subscribe();
    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let mut samples = Vec::with_capacity(args.pods);
    let mut first = Duration::ZERO;
    for i in 0..=args.pods {
        let name = format!("start-{i}");
        let (class, command) = match args.handler {
            Handler::Wasmtime => ("wasmtime", json!({"args": ["sleep", "3600000"]})),
            Handler::Process => ("process", json!({"args": ["3600"]})),
        };
        let mut container = json!({"name": "main", "image": image});
        container
            .as_object_mut()
            .context("container")?
            .extend(command.as_object().cloned().unwrap_or_default());
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"nodeName": NODE, "runtimeClassName": class, "containers": [container]},
        }))?;
        api.create(&PostParams::default(), &pod).await?;
        let created = Instant::now();
        let key = format!("default/{name}");
        let deadline = created + Duration::from_secs(60);
        loop {
            let phase = pods
                .get(&key)
                .and_then(|p| p.status.as_ref().and_then(|s| s.phase.clone()));
            match phase.as_deref() {
                Some("Running") => break,
                Some("Failed") => bail!(
                    "pod {name} failed: {:?}",
                    pods.get(&key).and_then(|p| p.status.clone())
                ),
                _ => {}
            }
            tokio::select! {
                _ = changes.recv() => {}
                _ = tokio::time::sleep_until(deadline) => bail!("pod {name} was not Running within 60 s"),
            }
        }
        let took = created.elapsed();
        if i == 0 {
            first = took;
        } else {
            samples.push(took);
        }
    }
    let p = Percentiles::of(&mut samples);
    Ok(Report {
        handler: args.handler,
        pods: args.pods,
        p50_ms: p.p50_ms,
        p99_ms: p.p99_ms,
        max_ms: p.max_ms,
        first_start_ms: super::ms(first),
        node_rss_mb: node_pid.map_or(0.0, rss_of),
    })
}

pub(crate) fn rss_of(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Stops what the pods run (processes would outlive the node otherwise).
async fn cleanup(node_dir: &std::path::Path) -> anyhow::Result<()> {
    let socket = node_dir.join("runtime.sock");
    let Ok(mut cri) = trellis_runtime::connect(&socket).await else {
        return Ok(());
    };
    let listed = cri
        .runtime
        .list_containers(k8s_cri::v1::ListContainersRequest { filter: None })
        .await
        .map_err(|e| anyhow::anyhow!("list containers: {}", e.message()))?
        .into_inner();
    for c in listed.containers {
        let _ = cri
            .runtime
            .stop_container(k8s_cri::v1::StopContainerRequest {
                container_id: c.id,
                timeout: 0,
            })
            .await;
    }
    Ok(())
}
