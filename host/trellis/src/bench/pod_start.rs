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
//! sleeps); `process` runs `/bin/sleep` in its sandbox (its init builds a root, a PID
//! namespace and credentials of its own), or with `--privileged` as the node's own
//! process (the namespace `default` then at Pod Security's `privileged` level). `node_rss_mb` is the node process's resident
//! memory with every pod running (for `process`, the agent and the runtime alone: the
//! pods are processes of their own).
//!
//! With `--pod-network` the node runs with the pod network on (`trellis node
//! --pod-network`) and its Node gets `--pod-cidr` (the node IPAM controller's part,
//! done by the benchmark): every pod gets a network namespace and an address of its
//! own. The node's config dir holds the runtime's default network on a bridge of the
//! benchmark's own (`--bridge`), never a user's `trellis0`; with `--cni-plugins` the
//! same network goes through the CNI plugins rather than the runtime's in-process
//! bridge. At the end, each pod is deleted alone and `teardown_ms` measures from the
//! delete's answer to its sandbox gone from the runtime; then the bridge and what
//! the network left on the node are removed.

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

    /// Pods on a network of their own: the node runs with `--pod-network`, its Node
    /// gets `--pod-cidr`.
    #[arg(long)]
    pod_network: bool,

    /// The node's pod CIDR with `--pod-network`: a private range no other network on
    /// this machine uses.
    #[arg(long, default_value = "10.244.250.0/24", value_name = "CIDR")]
    pod_cidr: String,

    /// The bridge of the pods' network with `--pod-network`; removed at the end.
    #[arg(long, default_value = "trellis-bench", value_name = "NAME")]
    bridge: String,

    /// With `--pod-network`: the default network through the CNI plugins (bridge,
    /// host-local, portmap) instead of the runtime's in-process bridge.
    #[arg(long)]
    cni_plugins: bool,

    /// `process` pods with `securityContext.privileged`: no sandbox, the cost without it.
    #[arg(long)]
    privileged: bool,
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
    /// Whether pods had a network of their own, and through what.
    pod_network: Option<&'static str>,
    /// Whether `process` pods ran in their sandbox (not privileged).
    sandboxed: bool,
    /// From a pod's delete to its sandbox gone from the runtime, each pod alone.
    teardown_p50_ms: f64,
    teardown_p99_ms: f64,
    teardown_max_ms: f64,
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
    let network = if args.pod_network {
        match write_network(&args, &node_dir) {
            Ok(conf_dir) => Some(conf_dir),
            Err(e) => {
                let _ = cluster.stop().await;
                return Err(e);
            }
        }
    } else {
        None
    };
    let node = start_node(&cluster, &node_dir, network.as_deref());
    let in_process = trellis_client::InProcess::new(cluster.server.in_process.clone());
    let admin = in_process.client(trellis_api::UserInfo::new("admin", ["system:masters"]));
    let measured = match node {
        Ok(mut child) => {
            let measured = measure(&admin, &args, &image, child.id(), &node_dir).await;
            let cleaned = cleanup(&node_dir).await;
            if args.pod_network {
                remove_network(&args.bridge);
            }
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
            "pod start ({:?}{}, {}): {} pods, bound → Running p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; the first (compiled) {:.1} ms; the node process {:.1} MB with every pod running; delete → sandbox gone p50 {:.1} ms, p99 {:.1} ms",
            report.handler,
            if report.sandboxed { ", sandboxed" } else { "" },
            report.pod_network.unwrap_or("node network"),
            report.pods,
            report.p50_ms,
            report.p99_ms,
            report.max_ms,
            report.first_start_ms,
            report.node_rss_mb,
            report.teardown_p50_ms,
            report.teardown_p99_ms,
        )
    })
}

/// `trellis node` as a child process, with a node's certificate from the cluster CA.
fn start_node(
    cluster: &LocalCluster,
    dir: &std::path::Path,
    cni_conf_dir: Option<&std::path::Path>,
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
    let mut command = tokio::process::Command::new(exe);
    command.args(["node", "--kubeconfig"]).arg(&kubeconfig);
    // Said either way: the node's default depends on the machine.
    match cni_conf_dir {
        Some(conf_dir) => command
            .arg("--pod-network=true")
            .arg("--cni-conf-dir")
            .arg(conf_dir),
        None => command.arg("--pod-network=false"),
    };
    command
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
    node_dir: &std::path::Path,
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
    if args.privileged {
        // Pod Security's default (baseline) refuses a privileged process pod.
        Api::<k8s_openapi::api::core::v1::Namespace>::all(admin.clone())
            .patch(
                "default",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(json!({"metadata": {"labels":
                    {"pod-security.kubernetes.io/enforce": "privileged"}}})),
            )
            .await
            .context("open the namespace default to privileged pods")?;
    }
    if args.pod_network {
        // The node IPAM controller's part.
        let cidr = &args.pod_cidr;
        Api::<k8s_openapi::api::core::v1::Node>::all(admin.clone())
            .patch(
                NODE,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(json!({"spec": {"podCIDR": cidr, "podCIDRs": [cidr]}})),
            )
            .await
            .context("give the node its pod CIDR")?;
    }
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
            Handler::Process => (
                "process",
                json!({"args": ["3600"], "securityContext": {"privileged": args.privileged}}),
            ),
        };
        let mut container = json!({"name": "main", "image": image});
        container
            .as_object_mut()
            .context("container")?
            .extend(command.as_object().cloned().unwrap_or_default());
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"nodeName": NODE, "runtimeClassName": class, "containers": [container],
                "terminationGracePeriodSeconds": 5},
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
    let node_rss_mb = node_pid.map_or(0.0, rss_of);
    let mut teardowns = teardown(&api, args.pods, node_dir).await?;
    let p = Percentiles::of(&mut samples);
    let t = Percentiles::of(&mut teardowns);
    Ok(Report {
        handler: args.handler,
        pods: args.pods,
        p50_ms: p.p50_ms,
        p99_ms: p.p99_ms,
        max_ms: p.max_ms,
        first_start_ms: super::ms(first),
        node_rss_mb,
        pod_network: args.pod_network.then_some(if args.cni_plugins {
            "CNI plugins"
        } else {
            "in-process bridge"
        }),
        sandboxed: args.handler == Handler::Process && !args.privileged,
        teardown_p50_ms: t.p50_ms,
        teardown_p99_ms: t.p99_ms,
        teardown_max_ms: t.max_ms,
    })
}

/// Deletes the pods one at a time, each timed from the delete's answer until the
/// runtime no longer knows its sandbox.
async fn teardown(
    api: &Api<Pod>,
    pods: usize,
    node_dir: &std::path::Path,
) -> anyhow::Result<Vec<Duration>> {
    use k8s_cri::v1::{ListPodSandboxRequest, PodSandboxFilter, PodSandboxStatusRequest};
    let mut cri = trellis_runtime::connect(&node_dir.join("runtime.sock"))
        .await
        .context("connect to the node's runtime")?;
    let mut took = Vec::with_capacity(pods + 1);
    for i in 0..=pods {
        let name = format!("start-{i}");
        let sandboxes = cri
            .runtime
            .list_pod_sandbox(ListPodSandboxRequest {
                filter: Some(PodSandboxFilter {
                    label_selector: [("io.kubernetes.pod.name".to_owned(), name.clone())].into(),
                    ..Default::default()
                }),
            })
            .await
            .map_err(|e| anyhow::anyhow!("list {name}'s sandboxes: {}", e.message()))?
            .into_inner()
            .items;
        api.delete(&name, &kube::api::DeleteParams::default())
            .await
            .with_context(|| format!("delete {name}"))?;
        let deleted = Instant::now();
        let deadline = deleted + Duration::from_secs(60);
        for sandbox in sandboxes {
            // A probe of the runtime every millisecond: the agent says nothing when it
            // removes a sandbox.
            while cri
                .runtime
                .pod_sandbox_status(PodSandboxStatusRequest {
                    pod_sandbox_id: sandbox.id.clone(),
                    verbose: false,
                })
                .await
                .is_ok()
            {
                if Instant::now() > deadline {
                    bail!("{name}'s sandbox was not removed within 60 s");
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        took.push(deleted.elapsed());
    }
    Ok(took)
}

/// Writes the runtime's default network on the benchmark's bridge and pod CIDR into
/// the node's CNI config dir, where the runtime finds it instead of writing its own;
/// with `--cni-plugins`, under another name, so the runtime runs it through the CNI
/// plugins. Returns the config dir.
fn write_network(args: &PodStartArgs, node_dir: &std::path::Path) -> anyhow::Result<PathBuf> {
    if !rustix::process::geteuid().is_root() {
        bail!("--pod-network needs root (network namespaces, links, nftables)");
    }
    let root = node_dir.join("runtime");
    let conf_dir = root.join("cni").join("net.d");
    std::fs::create_dir_all(&conf_dir)?;
    let mut conflist = trellis_runtime::default_conflist(
        std::slice::from_ref(&args.pod_cidr),
        &args.bridge,
        &root.join("cni").join("networks"),
    );
    if args.cni_plugins {
        conflist["name"] = json!("trellis-cni");
    }
    std::fs::write(
        conf_dir.join("10-trellis.conflist"),
        serde_json::to_vec_pretty(&conflist)?,
    )?;
    Ok(conf_dir)
}

/// Removes the benchmark's bridge and what the network keeps beside it (the
/// in-process bridge's nftables table); the pods' namespaces and veths went with
/// their sandboxes.
fn remove_network(bridge: &str) {
    let quiet = |program: &str, args: &[&str]| {
        let _ = std::process::Command::new(program)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    };
    quiet("ip", &["link", "del", bridge]);
    quiet("nft", &["delete", "table", "ip", bridge]);
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
