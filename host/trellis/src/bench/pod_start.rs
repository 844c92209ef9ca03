//! `trellis bench pod-start`: how soon a pod bound to a node runs, in this process: an
//! API server on the embedded store, Trellis' runtime on a Unix socket and the node
//! agent over it, as `trellis up` runs them.
//!
//! Pods are created already bound (`spec.nodeName`), one after the other, each once
//! the one before it is Running, so that each start is measured alone: from the
//! create's answer to the `Running` phase seen by a watch. The first pod of the run
//! starts a component never compiled on this machine (a fresh cache) and is reported
//! apart (`first_start_ms`); the percentiles cover the others.
//!
//! Handlers: `wasmtime` runs `plugins/target/dist/workload.wasm` (a WASI program that
//! sleeps); `process` runs `/bin/sleep`.

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
use super::api::LocalCluster;

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
    /// This whole process at the end, with every pod running: the API server, the
    /// runtime and the agent.
    rss_mb: f64,
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
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let in_process = trellis_client::InProcess::new(cluster.server.in_process.clone());
    let node_dir = cluster.dir.path().join("node");
    std::fs::create_dir_all(&node_dir)?;
    let flags = crate::node::NodeFlags {
        node_name: Some(NODE.into()),
        node_address: "127.0.0.1".parse()?,
        container_runtime_endpoint: None,
        default_runtime_handler: "wasmtime".into(),
        node_lease_renew: Duration::from_secs(10),
        node_status_report: Duration::from_secs(300),
        relist_period: Duration::from_secs(1),
        restart_backoff: Duration::from_secs(10),
        restart_backoff_max: Duration::from_secs(300),
        node_port: 0,
    };
    let client = in_process.client(trellis_client::identity::node(NODE));
    let node = tokio::spawn({
        let stopped = stopped.clone();
        async move {
            crate::node::run_local(
                client,
                SharedInformers::new(),
                &node_dir,
                true,
                None,
                &flags,
                stopped,
            )
            .await
        }
    });
    let admin = in_process.client(trellis_api::UserInfo::new("admin", ["system:masters"]));
    let measured = measure(&admin, &args, &image).await;
    let cleaned = cleanup(&cluster).await;
    let _ = stop.send(true);
    node.await.context("join the node")??;
    let stopped = cluster.stop().await;
    let report = measured?;
    cleaned?;
    stopped?;
    super::print_report(args.json, &report, || {
        format!(
            "pod start ({:?}): {} pods, bound → Running p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; the first (compiled) {:.1} ms; {:.0} MB resident",
            report.handler,
            report.pods,
            report.p50_ms,
            report.p99_ms,
            report.max_ms,
            report.first_start_ms,
            report.rss_mb
        )
    })
}

async fn measure(admin: &kube::Client, args: &PodStartArgs, image: &str) -> anyhow::Result<Report> {
    let informers = SharedInformers::new();
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
        rss_mb: super::scheduler::rss_mb(),
    })
}

/// Stops what the pods run (processes would outlive this process otherwise).
async fn cleanup(cluster: &LocalCluster) -> anyhow::Result<()> {
    let socket = cluster.dir.path().join("node").join("runtime.sock");
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
