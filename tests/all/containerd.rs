//! The node agent (`trellis-agent`) on a real containerd (Debian's 1.6, with runc) over
//! CRI v1: an ordinary OCI image (busybox, built by `tests/tools/containerd.sh`) runs to
//! completion and its log is served to `kubectl logs`; a long-running container turns
//! Ready through an exec probe and is stopped gracefully when its pod is deleted.
//!
//! containerd's CRI plugin gets its pods' network from a CNI conflist as Trellis'
//! runtime does (a bridge with host-local IPAM, then portmap, from the same plugins): a
//! sandbox made through containerd's CRI gets an IP of the conflist's subnet, which is
//! released when the sandbox is removed. Its own bridge (`trellis-nt85`) and range
//! (10.244.85.0/24), with no gateway, so nothing can leave the machine.
//!
//! Pods' cgroups are made by the agent under a cgroup root of the test's own, and
//! containerd's runc (cgroupfs driver) makes the containers' below them: a memory hog
//! is OOMKilled at its limit and restarted, a CPU hog is held to its 200m.
//!
//! Each test starts a containerd of its own, everything under a temporary directory
//! (FACTS.md, "containerd through CRI v1"), imports the image with `ctr`, and stops
//! it at the end. They are skipped only where the script says containerd cannot run
//! (not root); anywhere else a containerd that does not work fails them.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use trellis_api::Shutdown;

use anyhow::{Context, Result, bail, ensure};
use k8s_cri::v1 as cri;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use tokio::time::Instant;
use trellis_agent::AgentConfig;
use trellis_agent::labels::POD_UID;
use trellis_api::UserInfo;
use trellis_client::identity;
use trellis_client::informer::SharedInformers;
use trellis_tests::TestCluster;
use trellis_tests::cgroups::TestCgroupRoot;

use super::node::{container, phase, wait_pod};

/// The pods' network of the tests' containerd: its bridge and subnet.
const BRIDGE: &str = "trellis-nt85";
const SUBNET_PREFIX: &str = "10.244.85.";

const NODE: &str = "containerd-1";
/// The images in the script's tarball, once imported under this base name.
const BASE_NAME: &str = "trellis.test";
const BUSYBOX: &str = "trellis.test/busybox:local";
const PAUSE: &str = "trellis.test/pause:local";
/// containerd's CRI namespace.
const NAMESPACE: &str = "k8s.io";

/// The busybox image tarball the script builds, or (`Err`) why this machine cannot
/// run containerd.
async fn image() -> Result<Result<PathBuf, String>> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/containerd.sh");
    let output = tokio::process::Command::new(&script)
        .stderr(Stdio::inherit())
        .output()
        .await
        .with_context(|| format!("run {}", script.display()))?;
    ensure!(
        output.status.success(),
        "{} failed with {}",
        script.display(),
        output.status
    );
    let out = String::from_utf8(output.stdout).context("the script's output is not UTF-8")?;
    let out = out.trim();
    Ok(match out.strip_prefix("unsupported:") {
        Some(reason) => Err(reason.trim().to_owned()),
        None => Ok(PathBuf::from(out)),
    })
}

/// A containerd of the test's own: its root, state, socket and log under `dir`, in a
/// process group of its own so that stopping it reaches all it started there.
struct Containerd {
    dir: tempfile::TempDir,
    process: tokio::process::Child,
    socket: PathBuf,
    stopped: bool,
}

impl Containerd {
    async fn start() -> Result<Containerd> {
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        let socket = d.join("containerd.sock");
        std::fs::create_dir(d.join("cni"))?;
        // The shape of Trellis' default network (bridge with hairpin and host-local
        // IPAM, then portmap), on the tests' own bridge and range, without a gateway;
        // addresses are reserved under the test's directory.
        std::fs::write(
            d.join("cni/10-containerd-test.conflist"),
            serde_json::to_vec_pretty(&json!({
                "cniVersion": "1.0.0",
                "name": "containerd-test",
                "plugins": [{
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": format!("{SUBNET_PREFIX}0/24")}]],
                        "dataDir": d.join("ipam"),
                    }
                }, {
                    "type": "portmap",
                    "capabilities": {"portMappings": true}
                }]
            }))?,
        )?;
        let config = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE}"
  # runc may not lower oom_score_adj without CAP_SYS_RESOURCE, which root lacks here.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
"#,
            root = d.join("root").display(),
            state = d.join("state").display(),
            socket = socket.display(),
            opt = d.join("opt").display(),
            cni = d.join("cni").display(),
        );
        let config_path = d.join("config.toml");
        std::fs::write(&config_path, config)?;
        let log = std::fs::File::create(d.join("containerd.log"))?;
        let process = tokio::process::Command::new("containerd")
            .arg("--config")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()
            .context("start containerd (tests/tools/containerd.sh installs it)")?;
        let mut containerd = Containerd {
            dir,
            process,
            socket,
            stopped: false,
        };
        // A socket file is all there is to wait for (`ctr` on a missing one hangs).
        let deadline = Instant::now() + Duration::from_secs(10);
        while !containerd.socket.exists() {
            if let Some(status) = containerd.process.try_wait()? {
                bail!(
                    "containerd exited with {status}:\n{}",
                    containerd.log_tail()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "containerd made no socket in 10 s:\n{}",
                    containerd.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(containerd)
    }

    /// The end of containerd's log, for error messages.
    fn log_tail(&self) -> String {
        let log =
            std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Imports an OCI image tarball into CRI's namespace (CRI itself has no import).
    async fn import(&self, tarball: &Path) -> Result<()> {
        let output = tokio::time::timeout(
            Duration::from_secs(60),
            tokio::process::Command::new("ctr")
                .arg("-a")
                .arg(&self.socket)
                .args([
                    "-n",
                    NAMESPACE,
                    "images",
                    "import",
                    "--base-name",
                    BASE_NAME,
                ])
                .arg(tarball)
                .kill_on_drop(true)
                .output(),
        )
        .await
        .context("ctr images import did not finish in 60 s")?
        .context("run ctr")?;
        ensure!(
            output.status.success(),
            "ctr images import {} failed: {}\n{}",
            tarball.display(),
            String::from_utf8_lossy(&output.stderr),
            self.log_tail()
        );
        Ok(())
    }

    /// A CRI client, once containerd's CRI plugin says the runtime is ready.
    async fn cri(&self) -> Result<trellis_runtime::Client> {
        let cri = trellis_runtime::connect(&self.socket).await?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let status = cri
                .runtime
                .clone()
                .status(cri::StatusRequest { verbose: false })
                .await;
            let ready = status.as_ref().is_ok_and(|s| {
                s.get_ref().status.as_ref().is_some_and(|s| {
                    s.conditions
                        .iter()
                        .any(|c| c.r#type == "RuntimeReady" && c.status)
                })
            });
            if ready {
                return Ok(cri);
            }
            if Instant::now() > deadline {
                bail!(
                    "containerd's CRI runtime is not ready: {status:?}\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Removes every sandbox (their shims outlive containerd otherwise), stops
    /// containerd and unmounts what is left under its directory.
    async fn stop(&mut self) -> Result<()> {
        let mut removed = Ok(());
        if let Ok(cri) = trellis_runtime::connect(&self.socket).await {
            removed = remove_sandboxes(&cri).await;
        }
        self.stopped = true;
        let pid = self.process.id().context("containerd's pid")?;
        let _ = tokio::process::Command::new("kill")
            .args(["-TERM", "--", &format!("-{pid}")])
            .status()
            .await;
        if tokio::time::timeout(Duration::from_secs(10), self.process.wait())
            .await
            .is_err()
        {
            self.process.kill().await?;
        }
        trellis_tests::unmount_under(self.dir.path());
        removed
    }

    /// The addresses host-local holds reserved for containerd's pods.
    fn reserved(&self) -> Vec<String> {
        std::fs::read_dir(self.dir.path().join("ipam/containerd-test"))
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|name| name.starts_with(SUBNET_PREFIX))
            .collect()
    }
}

impl Drop for Containerd {
    /// A test that panicked: kill what is left, so the directory can go.
    fn drop(&mut self) {
        if self.stopped {
            return;
        }
        if let Some(pid) = self.process.id() {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{pid}")])
                .status();
        }
        trellis_tests::unmount_under(self.dir.path());
    }
}

/// Deletes the tests' bridge (CNI leaves it), also after a failure.
struct BridgeGuard;

impl Drop for BridgeGuard {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", BRIDGE])
            .status();
    }
}

async fn remove_sandboxes(cri: &trellis_runtime::Client) -> Result<()> {
    let mut runtime = cri.runtime.clone();
    let sandboxes = runtime
        .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
        .await?
        .into_inner()
        .items;
    for sandbox in sandboxes {
        runtime
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: sandbox.id.clone(),
            })
            .await?;
        runtime
            .remove_pod_sandbox(cri::RemovePodSandboxRequest {
                pod_sandbox_id: sandbox.id,
            })
            .await?;
    }
    Ok(())
}

/// Waits until the pod satisfies `done` (a watch, not a poll), up to `limit`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_runs_oci_containers_on_containerd() -> Result<()> {
    let tarball = match image().await? {
        Ok(path) => path,
        Err(reason) => {
            eprintln!("skipping the containerd test: {reason}");
            return Ok(());
        }
    };
    let mut containerd = Containerd::start().await?;
    let result = run_pods(&containerd, &tarball).await;
    let stopped = containerd.stop().await.context("stop containerd");
    result?;
    stopped
}

/// A sandbox made through containerd's CRI on the pod's network gets an IP of the
/// conflist's subnet, reserved by host-local, and releases it when removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containerd_gives_sandboxes_ips_from_the_cni_conflist() -> Result<()> {
    let tarball = match image().await? {
        Ok(path) => path,
        Err(reason) => {
            eprintln!("skipping the containerd test: {reason}");
            return Ok(());
        }
    };
    let started = Instant::now();
    let _bridge = BridgeGuard;
    let mut containerd = Containerd::start().await?;
    let result = sandbox_on_the_pod_network(&containerd, &tarball).await;
    let stopped = containerd.stop().await.context("stop containerd");
    result?;
    eprintln!("containerd's pod network test took {:?}", started.elapsed());
    stopped
}

async fn sandbox_on_the_pod_network(containerd: &Containerd, tarball: &Path) -> Result<()> {
    containerd.import(tarball).await?;
    let cri = containerd.cri().await?;
    let mut runtime = cri.runtime.clone();
    let status = runtime
        .status(cri::StatusRequest { verbose: false })
        .await?
        .into_inner();
    ensure!(
        status.status.as_ref().is_some_and(|s| s
            .conditions
            .iter()
            .any(|c| c.r#type == "NetworkReady" && c.status)),
        "containerd's network is not ready: {status:?}\n{}",
        containerd.log_tail()
    );
    let config = cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: "net".into(),
            uid: "uid-containerd-net".into(),
            namespace: "default".into(),
            attempt: 0,
        }),
        hostname: "net".into(),
        log_directory: containerd.dir.path().join("pod-logs").display().to_string(),
        linux: Some(cri::LinuxPodSandboxConfig {
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    network: cri::NamespaceMode::Pod as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let id = runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(config),
            runtime_handler: String::new(),
        })
        .await
        .with_context(|| containerd.log_tail())?
        .into_inner()
        .pod_sandbox_id;
    let status = runtime
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: id.clone(),
            verbose: false,
        })
        .await?
        .into_inner()
        .status
        .context("sandbox status")?;
    let ip = status.network.map(|n| n.ip).unwrap_or_default();
    ensure!(
        ip.starts_with(SUBNET_PREFIX),
        "the sandbox's IP {ip:?} is not of the conflist's subnet"
    );
    ensure!(
        containerd.reserved() == [ip.clone()],
        "host-local holds {:?}, not {ip}",
        containerd.reserved()
    );
    runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: id.clone(),
        })
        .await?;
    runtime
        .remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: id })
        .await?;
    ensure!(
        containerd.reserved().is_empty(),
        "addresses still reserved after RemovePodSandbox: {:?}",
        containerd.reserved()
    );
    let ports = std::fs::read_dir(Path::new("/sys/class/net").join(BRIDGE).join("brif"))
        .map(|d| d.count())
        .unwrap_or(0);
    ensure!(ports == 0, "{ports} veths left on {BRIDGE}");
    Ok(())
}

async fn run_pods(containerd: &Containerd, tarball: &Path) -> Result<()> {
    containerd.import(tarball).await?;
    let cri = containerd.cri().await?;
    let cluster = TestCluster::start().await?;
    let (stop, stopped) = Shutdown::new();
    let mut config = AgentConfig::new(
        NODE,
        "127.0.0.1".parse()?,
        containerd.dir.path().join("agent"),
    );
    // containerd's own default runtime (runc); 1.6 lists no handlers in its Status.
    config.default_handler = String::new();
    config.relist_period = Duration::from_millis(50);
    config.backoff_base = Duration::from_millis(200);
    config.backoff_max = Duration::from_millis(800);
    config.port = 0;
    config.client_ca_pem = Some(cluster.ca_pem.clone());
    // No pressure whatever the machine's disk holds: eviction is `eviction`'s test.
    config.eviction_hard = None;
    // Pods' cgroups under a root of the test's own; containerd (runc, cgroupfs driver)
    // makes its containers' below them.
    let cgroups = TestCgroupRoot::new().map_err(anyhow::Error::msg)?;
    cgroups.configure(&mut config);
    let agent = tokio::spawn(trellis_agent::run(
        config,
        cluster.in_process().client(identity::node(NODE)),
        cri.clone(),
        SharedInformers::new(),
        stopped,
    ));
    let admin = cluster
        .in_process()
        .client(UserInfo::new("admin", ["system:masters"]));
    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let create = |value: serde_json::Value| {
        let api = api.clone();
        async move {
            let mut value = value;
            value["spec"]["nodeName"] = NODE.into();
            let pod: Pod = serde_json::from_value(value)?;
            api.create(&PostParams::default(), &pod).await?;
            Ok::<_, anyhow::Error>(())
        }
    };

    // A busybox container runs to completion; its log goes through the agent.
    create(
        json!({"metadata": {"name": "hello"}, "spec": {"restartPolicy": "Never",
        "containers": [{"name": "main", "image": BUSYBOX, "imagePullPolicy": "Never",
            "command": ["/bin/busybox", "sh", "-c", "echo hello from busybox"]}]}}),
    )
    .await?;
    let pod = wait_pod(&pods, "hello", Duration::from_secs(10), |p| {
        matches!(phase(p), "Succeeded" | "Failed")
    })
    .await
    .with_context(|| containerd.log_tail())?;
    ensure!(phase(&pod) == "Succeeded", "{:#?}", pod.status);
    let c = container(&pod).context("container status")?;
    let t = c
        .state
        .as_ref()
        .and_then(|s| s.terminated.as_ref())
        .context("terminated state")?;
    ensure!(
        t.exit_code == 0 && t.reason.as_deref() == Some("Completed"),
        "{t:?}"
    );
    ensure!(
        c.container_id
            .as_deref()
            .is_some_and(|id| id.starts_with("containerd://"))
            && c.image_id.starts_with("sha256:"),
        "{c:?}"
    );
    ensure!(
        cluster.admin().ok(&["logs", "hello"]).await? == "hello from busybox\n",
        "kubectl logs"
    );
    let node: Api<Node> = Api::all(admin.clone());
    let info = node
        .get(NODE)
        .await?
        .status
        .and_then(|s| s.node_info)
        .context("nodeInfo")?;
    ensure!(
        info.container_runtime_version.starts_with("containerd://"),
        "{info:?}"
    );

    // A long-running container, Ready once its exec probe passes (the trap is set by
    // then); deleted with the default grace of 30 s, it ends at SIGTERM, at once.
    create(json!({"metadata": {"name": "sleeper"}, "spec": {
        "containers": [{"name": "main", "image": BUSYBOX,
            "command": ["/bin/busybox", "sh", "-c",
                "trap 'exit 0' TERM; touch /tmp/ready; sleep 600 & wait"],
            "readinessProbe": {"exec": {"command": ["cat", "/tmp/ready"]}, "periodSeconds": 1}}]}}))
    .await?;
    let pod = wait_pod(&pods, "sleeper", Duration::from_secs(10), |p| {
        phase(p) == "Running" && container(p).is_some_and(|c| c.ready)
    })
    .await
    .with_context(|| containerd.log_tail())?;
    let uid = pod.metadata.uid.clone().context("uid")?;
    api.delete("sleeper", &DeleteParams::default()).await?;
    let gone = async {
        let mut changes = pods.subscribe();
        while pods.get("default/sleeper").is_some() {
            changes.recv().await.context("pod informer ended")?;
        }
        Ok::<_, anyhow::Error>(())
    };
    tokio::time::timeout(Duration::from_secs(10), gone)
        .await
        .context("the pod was not stopped at SIGTERM and removed")??;
    // And containerd has nothing of it left.
    let left = cri
        .runtime
        .clone()
        .list_pod_sandbox(cri::ListPodSandboxRequest {
            filter: Some(cri::PodSandboxFilter {
                label_selector: [(POD_UID.to_owned(), uid)].into(),
                ..Default::default()
            }),
        })
        .await?
        .into_inner()
        .items;
    ensure!(left.is_empty(), "sandboxes left: {left:?}");

    // Limits as containerd applies them in the pod's cgroup: a memory hog is
    // OOMKilled and restarted with back-off, a CPU hog held to 200m.
    create(
        json!({"metadata": {"name": "memory-hog"}, "spec": {"terminationGracePeriodSeconds": 0,
        "containers": [{"name": "main", "image": BUSYBOX, "imagePullPolicy": "Never",
            "command": ["/bin/busybox", "tail", "/dev/zero"],
            "resources": {"limits": {"memory": "64Mi"}}}]}}),
    )
    .await?;
    create(
        json!({"metadata": {"name": "cpu-hog"}, "spec": {"terminationGracePeriodSeconds": 0,
        "containers": [{"name": "main", "image": BUSYBOX, "imagePullPolicy": "Never",
            "command": ["/bin/busybox", "sh", "-c", "while :; do :; done"],
            "resources": {"limits": {"cpu": "200m"}}}]}}),
    )
    .await?;
    wait_pod(&pods, "memory-hog", Duration::from_secs(30), |p| {
        container(p).is_some_and(|c| {
            c.restart_count >= 2
                && c.last_state
                    .as_ref()
                    .and_then(|s| s.terminated.as_ref())
                    .is_some_and(|t| t.reason.as_deref() == Some("OOMKilled") && t.exit_code == 137)
        })
    })
    .await
    .with_context(|| containerd.log_tail())?;
    let hog = wait_pod(&pods, "cpu-hog", Duration::from_secs(10), |p| {
        phase(p) == "Running"
    })
    .await?;
    let pod_cgroup = cgroups.cgroup(&format!(
        "kubepods/burstable/pod{}",
        hog.metadata.uid.as_deref().unwrap_or_default()
    ));
    let before = pod_cgroup.stats()?.cpu_usage_ns;
    let measured = Instant::now();
    // A measurement over a window, not a wait for something to happen.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let used =
        (pod_cgroup.stats()?.cpu_usage_ns - before) as f64 / measured.elapsed().as_nanos() as f64;
    ensure!(
        (0.15..=0.25).contains(&used),
        "the CPU hog limited to 200m used {used:.3} core"
    );
    for name in ["memory-hog", "cpu-hog"] {
        api.delete(name, &DeleteParams::default()).await?;
    }
    let gone = async {
        let mut changes = pods.subscribe();
        while pods.get("default/memory-hog").is_some() || pods.get("default/cpu-hog").is_some() {
            changes.recv().await.context("pod informer ended")?;
        }
        Ok::<_, anyhow::Error>(())
    };
    tokio::time::timeout(Duration::from_secs(10), gone)
        .await
        .context("the hogs were not removed")??;
    ensure!(!pod_cgroup.exists(), "{} is left", pod_cgroup.path());
    // Nor in the hierarchies without a controller, where runc makes its cgroups too.
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    let left: Vec<PathBuf> = mounts
        .lines()
        .filter_map(|l| {
            let fields: Vec<&str> = l.split(' ').collect();
            matches!(fields.get(2), Some(&"cgroup" | &"cgroup2"))
                .then(|| Path::new(fields[1]).join(pod_cgroup.path().trim_start_matches('/')))
        })
        .filter(|dir| dir.exists())
        .collect();
    ensure!(left.is_empty(), "left: {left:?}");

    stop.stop();
    agent.await??;
    cluster.stop().await?;
    Ok(())
}
