//! Eviction under node pressure, as the kubelet's eviction manager: a node whose
//! `memory.available` threshold is set above what this machine has (so it is met at
//! once) evicts its BestEffort pod before its Burstable one, each `Failed` with
//! reason `Evicted`, the kubelet's message and an `Evicted` event; it reports
//! `MemoryPressure`, the node lifecycle controller taints it
//! `node.kubernetes.io/memory-pressure:NoSchedule` so that the scheduler leaves a new
//! pod Pending, and the node itself refuses a new BestEffort pod bound to it. A soft
//! threshold evicts only once its grace period is over; with the thresholds lifted
//! the taint goes. One server, one runtime, one node whose agent is restarted with
//! each test's thresholds, the node lifecycle controller and the scheduler.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use trellis_agent::AgentConfig;
use trellis_api::{Shutdown, Stop, UserInfo};
use trellis_client::events::EventRecorder;
use trellis_client::identity;
use trellis_client::informer::{Informer, SharedInformers};
use trellis_client::workqueue::QueueMetrics;
use trellis_controllers::Manager;
use trellis_plugin_host::{Compilers, HostConfig, PluginHost};
use trellis_runtime::{Runtime, RuntimeConfig};
use trellis_tests::TestCluster;
use trellis_tests::cgroups::TestCgroupRoot;
use trellis_tests::pod_network::delete_pods;

const NODE: &str = "pressed";
const MEMORY_TAINT: &str = "node.kubernetes.io/memory-pressure";
/// Thresholds this machine never meets: no pressure.
const ROOMY: &str = "memory.available<0,nodefs.available<0%,nodefs.inodesFree<0%";

/// The runtime of the module's node, and its agent, restarted with other thresholds.
struct PressedNode {
    root: std::path::PathBuf,
    cluster_client: kube::Client,
    runtime_stop: Stop,
    server: JoinHandle<Result<()>>,
    agent: Option<(Stop, JoinHandle<Result<()>>)>,
    /// Where the pods' cgroups go, whose stats rank them; none: ranked without.
    cgroup_root: Option<String>,
}

impl PressedNode {
    async fn start(
        cluster: &TestCluster,
        root: &Path,
        cgroup_root: Option<String>,
    ) -> Result<Self> {
        let (runtime_stop, stopped) = Shutdown::new();
        let runtime = Runtime::new(RuntimeConfig {
            root: root.join("runtime"),
            process_handler: true,
            node_ip: "127.0.0.1".parse()?,
            init_program: Some(trellis_tests::init_program()),
            ..Default::default()
        })?;
        let listener = trellis_runtime::listen(&root.join("cri.sock"))?;
        let server = tokio::spawn(async move {
            trellis_runtime::serve_on(runtime, listener, async move { stopped.wait().await }).await
        });
        Ok(Self {
            root: root.to_owned(),
            cluster_client: cluster.in_process().client(identity::node(NODE)),
            runtime_stop,
            server,
            agent: None,
            cgroup_root,
        })
    }

    /// (Re)starts the agent, its pressure read every 200 ms, with `thresholds` set.
    async fn start_agent(&mut self, thresholds: impl FnOnce(&mut AgentConfig)) -> Result<()> {
        self.stop_agent().await?;
        let cri = trellis_runtime::connect(&self.root.join("cri.sock")).await?;
        let mut config = AgentConfig::new(NODE, "127.0.0.1".parse()?, self.root.join("agent"));
        config.relist_period = Duration::from_millis(50);
        config.backoff_base = Duration::from_millis(200);
        config.port = 0;
        config.pressure_check = Duration::from_millis(200);
        config.eviction_pressure_transition_period = Duration::ZERO;
        config.eviction_hard = Some(ROOMY.parse().map_err(anyhow::Error::msg)?);
        if let Some(cgroup_root) = &self.cgroup_root {
            config.cgroups_per_qos = true;
            config.cgroup_root = cgroup_root.clone();
        }
        thresholds(&mut config);
        let (stop, stopped) = Shutdown::new();
        let agent = tokio::spawn(trellis_agent::run(
            config,
            self.cluster_client.clone(),
            cri,
            SharedInformers::new(),
            stopped,
        ));
        self.agent = Some((stop, agent));
        Ok(())
    }

    async fn stop_agent(&mut self) -> Result<()> {
        if let Some((stop, agent)) = self.agent.take() {
            stop.stop();
            agent.await??;
        }
        Ok(())
    }

    async fn stop(mut self) -> Result<()> {
        self.stop_agent().await?;
        self.runtime_stop.stop();
        self.server.await??;
        Ok(())
    }
}

/// A threshold of `memory.available` this machine meets: a GiB more than it has.
fn memory_met() -> Result<String> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    let available: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no MemAvailable in /proc/meminfo")?;
    // Not a whole number of GiB, which Kubernetes would write in Gi.
    let mut mebibytes = available / 1024 + 1024;
    if mebibytes.is_multiple_of(1024) {
        mebibytes += 1;
    }
    Ok(format!("{mebibytes}Mi"))
}

/// A process pod bound to the node, sleeping; with a memory request, Burstable.
fn sleeper(name: &str, memory_request: Option<&str>, bound: bool) -> Result<Pod> {
    let mut container = json!({"name": "main", "image": "file:///bin/sleep", "args": ["600"]});
    if let Some(request) = memory_request {
        container["resources"] = json!({"requests": {"memory": request}});
    }
    let mut spec = json!({"runtimeClassName": "process", "terminationGracePeriodSeconds": 5,
        "containers": [container]});
    if bound {
        spec["nodeName"] = json!(NODE);
    }
    Ok(serde_json::from_value(
        json!({"metadata": {"name": name}, "spec": spec}),
    )?)
}

fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

/// Running with its container up (not between restarts).
fn ready(pod: &Pod) -> bool {
    phase(pod) == "Running"
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn evicted(pod: &Pod) -> bool {
    phase(pod) == "Failed"
        && pod.status.as_ref().and_then(|s| s.reason.as_deref()) == Some("Evicted")
}

fn message(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.message.as_deref())
        .unwrap_or("")
}

/// Waits for the first of `informer`'s objects named `key` to satisfy `done`.
async fn wait_for<K>(
    informer: &Arc<Informer<K>>,
    key: &str,
    limit: Duration,
    done: impl Fn(&K) -> bool,
) -> Result<Arc<K>>
where
    K: kube::Resource
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let mut changes = informer.subscribe();
    let deadline = Instant::now() + limit;
    loop {
        if let Some(object) = informer.get(key)
            && done(&object)
        {
            return Ok(object);
        }
        tokio::select! {
            change = changes.recv() => if change.is_none() { bail!("the informer ended") },
            _ = tokio::time::sleep_until(deadline) => {
                bail!("{key} did not get there in {limit:?}: {:#?}", informer.get(key))
            }
        }
    }
}

fn condition(node: &Node, kind: &str) -> Option<String> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind)
        .map(|c| c.status.clone())
}

fn tainted(node: &Node, key: &str) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == key && t.effect == "NoSchedule"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_under_memory_pressure_evicts_best_effort_first_is_tainted_and_admits_none()
-> Result<()> {
    let cluster = TestCluster::start().await?;
    let in_process = cluster.in_process();
    let admin = in_process.client(UserInfo::new("admin", ["system:masters"]));
    let dir = trellis_tests::test_dir()?;
    let (stop, stopped) = Shutdown::new();

    // The node lifecycle controller, which taints by the pressure conditions.
    let manager = Manager {
        plugins: PluginHost::new(HostConfig {
            compilers: Compilers::Baseline,
            ..HostConfig::default()
        })?,
        informers: SharedInformers::new(),
        lister: in_process.client(identity::controller_manager()),
        queues: QueueMetrics::default(),
        running: Default::default(),
    };
    let builtin = trellis_controllers::bundled::select("nodelifecycle")?[0];
    let writer = in_process.client(identity::controller(builtin.identity));
    let events = EventRecorder::new(writer.clone(), builtin.identity, "test");
    let _lifecycle = manager
        .start(builtin.config(), writer, events, stopped.clone())
        .await?;
    // The scheduler, which must leave a new pod off the tainted node.
    let host = PluginHost::new(HostConfig {
        compilers: Compilers::Baseline,
        ..HostConfig::default()
    })?;
    let plugins = crate::scheduler::default_plugins(&host).await?;
    let scheduler = crate::scheduler::spawn(&in_process, host, vec![plugins], stopped.clone());

    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let nodes = watching.informer::<Node>(Api::all(admin.clone()), watcher::Config::default());
    let events = watching.informer::<Event>(Api::all(admin.clone()), watcher::Config::default());
    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");

    // Pod cgroups give the runtime the containers' memory to rank by.
    let cgroups = TestCgroupRoot::new()
        .map_err(|why| eprintln!("pods without cgroups ({why}): ranked without their usage"))
        .ok();
    let mut node = PressedNode::start(
        &cluster,
        dir.path(),
        cgroups.as_ref().map(|c| c.path().to_owned()),
    )
    .await?;
    let result = async {
        // Without pressure, a BestEffort and a Burstable pod run.
        node.start_agent(|_| {}).await?;
        let started = Instant::now();
        api.create(&PostParams::default(), &sleeper("best-effort", None, true)?)
            .await?;
        api.create(
            &PostParams::default(),
            &sleeper("burstable", Some("64Mi"), true)?,
        )
        .await?;
        for name in ["best-effort", "burstable"] {
            wait_for(
                &pods,
                &format!("default/{name}"),
                Duration::from_secs(20),
                ready,
            )
            .await?;
        }
        eprintln!("pods running in {:?}", started.elapsed());

        // A hard threshold met at once: the BestEffort pod goes first, then the
        // Burstable one, one at a time.
        let threshold = memory_met()?;
        let pressed = Instant::now();
        let mut changes = pods.subscribe();
        node.start_agent(|config| {
            config.eviction_hard = format!("{ROOMY},memory.available<{threshold}").parse().ok();
        })
        .await?;
        let mut order = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while order.len() < 2 {
            let change = tokio::select! {
                change = changes.recv() => change.context("the pod informer ended")?,
                _ = tokio::time::sleep_until(deadline) => bail!("evicted only {order:?}"),
            };
            let pod = change.object();
            let name = pod.metadata.name.clone().unwrap_or_default();
            if evicted(pod) && !order.contains(&name) {
                order.push(name);
            }
        }
        eprintln!("both evicted in {:?}", pressed.elapsed());
        ensure!(
            order == ["best-effort", "burstable"],
            "eviction order {order:?}"
        );
        let best_effort = pods
            .get("default/best-effort")
            .context("best-effort gone")?;
        let prefix = format!(
            "The node was low on resource: memory. Threshold quantity: {threshold}, available: "
        );
        ensure!(
            message(&best_effort).starts_with(&prefix),
            "{:?}",
            best_effort.status
        );
        eprintln!("best-effort evicted: {}", message(&best_effort));
        if cgroups.is_some() {
            ensure!(
                message(&best_effort).contains("Container main was using ")
                    && message(&best_effort)
                        .ends_with(", request is 0, has larger consumption of memory. "),
                "{}",
                message(&best_effort)
            );
        }
        let status = best_effort.status.clone().unwrap_or_default();
        ensure!(
            status
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "DisruptionTarget"
                    && c.status == "True"
                    && c.reason.as_deref() == Some("TerminationByKubelet")),
            "{status:#?}"
        );
        ensure!(
            status
                .container_statuses
                .iter()
                .flatten()
                .all(|c| c.state.as_ref().is_some_and(|s| s.terminated.is_some())),
            "{status:#?}"
        );
        let uid = best_effort.metadata.uid.clone().unwrap_or_default();
        let event = async {
            let mut changes = events.subscribe();
            loop {
                if let Some(e) = events.list().into_iter().find(|e| {
                    e.involved_object.uid.as_deref() == Some(uid.as_str())
                        && e.reason.as_deref() == Some("Evicted")
                }) {
                    return Ok::<_, anyhow::Error>(e);
                }
                changes.recv().await.context("event informer ended")?;
            }
        };
        let event = tokio::time::timeout(Duration::from_secs(10), event)
            .await
            .context("no Evicted event")??;
        ensure!(
            event.type_.as_deref() == Some("Warning")
                && event.message.as_deref() == Some(message(&best_effort)),
            "{event:#?}"
        );

        // The node says so and is tainted; a new pod is left Pending by the
        // scheduler, and a BestEffort pod bound to the node is refused by it.
        let tainted_at = Instant::now();
        wait_for(&nodes, NODE, Duration::from_secs(10), |n| {
            condition(n, "MemoryPressure").as_deref() == Some("True") && tainted(n, MEMORY_TAINT)
        })
        .await?;
        eprintln!("tainted {:?} after the evictions", tainted_at.elapsed());
        api.create(
            &PostParams::default(),
            &sleeper("unscheduled", Some("64Mi"), false)?,
        )
        .await?;
        let unscheduled = wait_for(&pods, "default/unscheduled", Duration::from_secs(10), |p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| {
                    c.iter().any(|c| {
                        c.type_ == "PodScheduled"
                            && c.reason.as_deref() == Some("Unschedulable")
                            && c.message
                                .as_deref()
                                .is_some_and(|m| m.contains(MEMORY_TAINT))
                    })
                })
        })
        .await?;
        ensure!(
            unscheduled
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .is_none(),
            "{unscheduled:#?}"
        );
        api.create(&PostParams::default(), &sleeper("refused", None, true)?)
            .await?;
        let refused = wait_for(&pods, "default/refused", Duration::from_secs(10), |p| {
            phase(p) == "Failed"
        })
        .await?;
        ensure!(
            evicted(&refused) && message(&refused) == "The node had condition: [MemoryPressure]. ",
            "{:?}",
            refused.status
        );
        delete_pods(
            &api,
            &pods,
            &["unscheduled", "refused"],
            Duration::from_secs(10),
        )
        .await??;

        // Lifted: the condition and the taint go.
        node.start_agent(|_| {}).await?;
        let lifted = Instant::now();
        wait_for(&nodes, NODE, Duration::from_secs(10), |n| {
            condition(n, "MemoryPressure").as_deref() == Some("False") && !tainted(n, MEMORY_TAINT)
        })
        .await?;
        eprintln!(
            "taint gone {:?} after the thresholds were lifted",
            lifted.elapsed()
        );
        // A soft threshold evicts only once it held for its grace period.
        let grace = Duration::from_secs(3);
        let softened = Instant::now();
        node.start_agent(|config| {
            config.eviction_soft = trellis_agent::pressure::Thresholds::parse_soft(&format!(
                "memory.available<{threshold}"
            ))
            .unwrap_or_else(|_| trellis_agent::pressure::Thresholds::none());
            config
                .eviction_soft_grace_period
                .0
                .insert(trellis_agent::pressure::Signal::MemoryAvailable, grace);
        })
        .await?;
        // Burstable: admitted under memory pressure.
        api.create(
            &PostParams::default(),
            &sleeper("soft", Some("64Mi"), true)?,
        )
        .await?;
        wait_for(&pods, "default/soft", Duration::from_secs(20), |p| {
            ready(p) || evicted(p)
        })
        .await?;
        let soft = wait_for(&pods, "default/soft", Duration::from_secs(20), evicted).await?;
        let after = softened.elapsed();
        eprintln!("soft threshold: evicted {after:?} after the agent started (grace {grace:?})");
        ensure!(
            after >= grace,
            "evicted after {after:?}, before the grace period {grace:?}"
        );
        ensure!(message(&soft).starts_with(&prefix), "{:?}", soft.status);

        Ok::<_, anyhow::Error>(())
    }
    .await;
    let _ = delete_pods(
        &api,
        &pods,
        &["best-effort", "burstable", "unscheduled", "refused", "soft"],
        Duration::from_secs(20),
    )
    .await;
    node.stop().await?;
    drop(cgroups);
    stop.stop();
    let _ = scheduler.await;
    result
}
