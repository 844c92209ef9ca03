//! Pods' resources and security context on a node with Trellis' runtime, for real:
//! a memory hog is OOMKilled at its limit and restarted with back-off, a CPU hog is
//! throttled to its limit (measured from its pod's cgroup), a pod runs as the user,
//! group and groups it asks for and writes its emptyDir as its fsGroup, each pod's
//! cgroup is where its QoS class puts it (and goes with the pod), a root container of
//! a `runAsNonRoot` pod is refused, the cgroup of a pod deleted while the agent was
//! down goes once the agent is back, and the Node's allocatable leaves out what is
//! reserved. One server and one node for the module, the node's cgroups under a root
//! of the test's own; skipped where cgroups cannot be made (not root).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_agent::AgentConfig;
use trellis_api::{Shutdown, UserInfo};
use trellis_client::identity;
use trellis_client::informer::{Informer, SharedInformers};
use trellis_runtime::{Runtime, RuntimeConfig};
use trellis_tests::TestCluster;
use trellis_tests::cgroups::TestCgroupRoot;

use super::node::{container, phase, wait_pod};

const NODE: &str = "resources-1";

async fn create_pod(api: &Api<Pod>, value: serde_json::Value) -> Result<Pod> {
    let mut value = value;
    value["spec"]["nodeName"] = NODE.into();
    value["spec"]["runtimeClassName"] = "process".into();
    let pod: Pod = serde_json::from_value(value)?;
    Ok(api.create(&PostParams::default(), &pod).await?)
}

fn uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

fn qos(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.qos_class.as_deref())
        .unwrap_or("")
}

/// The log of the pod's first container run, as the runtime wrote it (CRI format:
/// each line after its time, stream and tag).
fn log_of(root: &std::path::Path, pod: &Pod) -> Result<String> {
    let path = root.join("agent/logs").join(format!(
        "default_{}_{}/main/0.log",
        pod.metadata.name.as_deref().unwrap_or_default(),
        uid(pod)
    ));
    let raw = std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    Ok(raw
        .lines()
        .filter_map(|l| l.splitn(4, ' ').nth(3))
        .collect::<Vec<_>>()
        .join("\n"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_qos_cgroups_and_users_hold_for_process_pods() -> Result<()> {
    let cgroups = match TestCgroupRoot::new() {
        Ok(root) => root,
        Err(why) => {
            eprintln!("skipped: {why}");
            return Ok(());
        }
    };
    let cluster = TestCluster::start().await?;
    let dir = trellis_tests::test_dir()?;
    let root = dir.path();
    let (stop, stopped) = Shutdown::new();
    let runtime = Runtime::new(RuntimeConfig {
        root: root.join("runtime"),
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
    let mut config = AgentConfig::new(NODE, "127.0.0.1".parse()?, root.join("agent"));
    cgroups.configure(&mut config);
    config.relist_period = Duration::from_millis(50);
    config.backoff_base = Duration::from_millis(200);
    config.backoff_max = Duration::from_millis(800);
    config.port = 0;
    config.capacity = Some((4, 8 << 30));
    config.kube_reserved = "cpu=100m,memory=256Mi"
        .parse()
        .map_err(anyhow::Error::msg)?;
    config.eviction_hard = Some(
        "memory.available<100Mi,nodefs.available<0%,nodefs.inodesFree<0%"
            .parse()
            .map_err(anyhow::Error::msg)?,
    );
    // The agent stops on its own (the runtime goes on), to be started again.
    let start_agent = |config: AgentConfig| {
        let (stop, stopped) = Shutdown::new();
        let agent = tokio::spawn(trellis_agent::run(
            config,
            cluster.in_process().client(identity::node(NODE)),
            cri.clone(),
            SharedInformers::new(),
            stopped,
        ));
        (stop, agent)
    };
    let (agent_stop, agent) = start_agent(config.clone());
    let admin = cluster
        .in_process()
        .client(UserInfo::new("admin", ["system:masters"]));
    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");

    // Everything starts at once; each is checked in turn.
    create_pod(
        &api,
        json!({"metadata": {"name": "memory-hog"}, "spec": {"terminationGracePeriodSeconds": 0, "containers": [{"name": "main",
            "image": "file:///usr/bin/tail", "command": ["/usr/bin/tail", "/dev/zero"],
            "resources": {"limits": {"memory": "64Mi"}}}]}}),
    )
    .await?;
    let spinner = create_pod(
        &api,
        json!({"metadata": {"name": "cpu-hog"}, "spec": {"terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "file:///bin/sh",
            "command": ["/bin/sh", "-c", "while :; do :; done"],
            "resources": {"limits": {"cpu": "200m"}}}]}}),
    )
    .await?;
    let sleeper = |name: &str, resources: serde_json::Value| {
        json!({"metadata": {"name": name}, "spec": {"terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "file:///bin/sh",
            "command": ["/bin/sh", "-c", "exec sleep 3600"], "resources": resources}]}})
    };
    let guaranteed = create_pod(
        &api,
        sleeper(
            "guaranteed",
            json!({"limits": {"cpu": "100m", "memory": "32Mi"}}),
        ),
    )
    .await?;
    let best_effort = create_pod(&api, sleeper("best-effort", json!({}))).await?;
    create_pod(
        &api,
        json!({"metadata": {"name": "as-user"}, "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
            "securityContext": {"runAsUser": 1234, "runAsGroup": 2345,
                "supplementalGroups": [3456], "fsGroup": 4567},
            "volumes": [{"name": "data", "emptyDir": {}}],
            "containers": [{"name": "main", "image": "file:///bin/sh",
                "command": ["/bin/sh", "-c", "id -u; id -g; id -G; touch /data/f && stat -c %g /data/f"],
                "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]}}),
    )
    .await?;
    create_pod(
        &api,
        json!({"metadata": {"name": "non-root"}, "spec": {"terminationGracePeriodSeconds": 0,
            "securityContext": {"runAsNonRoot": true},
            "containers": [{"name": "main", "image": "file:///bin/sh",
                "securityContext": {"runAsUser": 0},
                "command": ["/bin/sh", "-c", "exit 0"]}]}}),
    )
    .await?;

    // Allocatable: 4 CPUs less 100m, 8Gi less 256Mi and the 100Mi hard threshold.
    let nodes: Api<Node> = Api::all(admin.clone());
    let node = nodes.get(NODE).await?;
    let allocatable = node
        .status
        .and_then(|s| s.allocatable)
        .context("the node reports no allocatable")?;
    let memory = (8u64 << 30) - (256 << 20) - (100 << 20);
    ensure!(
        allocatable.get("cpu").map(|q| q.0.as_str()) == Some("3900m")
            && allocatable.get("memory").map(|q| q.0.clone())
                == Some(format!("{}Ki", memory / 1024)),
        "{allocatable:?}"
    );

    // The memory hog is killed at its limit, as the kubelet reports it, and restarted
    // with back-off.
    let started = tokio::time::Instant::now();
    let oom = wait_pod(&pods, "memory-hog", Duration::from_secs(30), |p| {
        container(p).is_some_and(|c| {
            c.restart_count >= 2
                && c.last_state
                    .as_ref()
                    .and_then(|s| s.terminated.as_ref())
                    .is_some_and(|t| t.reason.as_deref() == Some("OOMKilled"))
        })
    })
    .await?;
    let last = container(&oom)
        .and_then(|c| c.last_state.as_ref())
        .and_then(|s| s.terminated.as_ref())
        .context("no last state")?;
    ensure!(last.exit_code == 137, "{last:?}");
    ensure!(qos(&oom) == "Burstable", "{:?}", oom.status);
    println!("memory hog OOMKilled twice in {:?}", started.elapsed());

    // The CPU hog uses its 200m: measured from its pod's cgroup, where the kubelet's
    // layout puts a Burstable pod.
    let running = wait_pod(&pods, "cpu-hog", Duration::from_secs(30), |p| {
        phase(p) == "Running"
    })
    .await?;
    ensure!(qos(&running) == "Burstable", "{:?}", running.status);
    let pod_cgroup = cgroups.cgroup(&format!("kubepods/burstable/pod{}", uid(&spinner)));
    ensure!(pod_cgroup.exists(), "no cgroup {}", pod_cgroup.path());
    let before = pod_cgroup.stats()?.cpu_usage_ns;
    let measured = tokio::time::Instant::now();
    // A measurement over a window, not a wait for something to happen.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let used =
        (pod_cgroup.stats()?.cpu_usage_ns - before) as f64 / measured.elapsed().as_nanos() as f64;
    ensure!(
        (0.15..=0.25).contains(&used),
        "the CPU hog limited to 200m used {used:.3} core"
    );
    println!("the CPU hog limited to 200m used {used:.3} core");

    // Each QoS class in its place.
    for (name, p, path) in [
        (
            "guaranteed",
            &guaranteed,
            format!("kubepods/pod{}", uid(&guaranteed)),
        ),
        (
            "best-effort",
            &best_effort,
            format!("kubepods/besteffort/pod{}", uid(&best_effort)),
        ),
    ] {
        let running = wait_pod(&pods, name, Duration::from_secs(30), |p| {
            phase(p) == "Running"
        })
        .await?;
        ensure!(
            cgroups.cgroup(&path).exists(),
            "no cgroup {path} for {name} ({}, {})",
            qos(&running),
            uid(p)
        );
    }

    // The pod runs as the user, group and groups it asks for; its emptyDir takes the
    // fsGroup.
    let done = wait_pod(&pods, "as-user", Duration::from_secs(30), |p| {
        matches!(phase(p), "Succeeded" | "Failed")
    })
    .await?;
    let out = log_of(root, &done)?;
    let lines: Vec<&str> = out.lines().collect();
    ensure!(phase(&done) == "Succeeded", "{out}\n{:?}", done.status);
    let groups: Vec<&str> = lines
        .get(2)
        .map(|l| l.split(' ').collect())
        .unwrap_or_default();
    ensure!(
        lines.first() == Some(&"1234")
            && lines.get(1) == Some(&"2345")
            && ["2345", "3456", "4567"].iter().all(|g| groups.contains(g))
            && lines.get(3) == Some(&"4567"),
        "{out}"
    );

    // runAsNonRoot with a root user is refused, as the kubelet refuses it.
    let refused = wait_pod(&pods, "non-root", Duration::from_secs(30), |p| {
        container(p).and_then(|c| c.state.as_ref()?.waiting.as_ref()?.reason.as_deref())
            == Some("CreateContainerConfigError")
    })
    .await?;
    let message = container(&refused)
        .and_then(|c| c.state.as_ref()?.waiting.as_ref()?.message.clone())
        .unwrap_or_default();
    ensure!(
        message.starts_with("container's runAsUser breaks non-root policy"),
        "{message}"
    );

    // A deleted pod's cgroup goes with it: the agent removes it before the pod.
    api.delete("cpu-hog", &DeleteParams::default()).await?;
    wait_gone(&pods, &["cpu-hog"]).await?;
    ensure!(!pod_cgroup.exists(), "{} is left", pod_cgroup.path());

    // A pod deleted while the agent was down: its cgroup goes once the agent is back
    // and has collected its sandbox.
    let best_effort_cgroup =
        cgroups.cgroup(&format!("kubepods/besteffort/pod{}", uid(&best_effort)));
    agent_stop.stop();
    agent.await??;
    api.delete("best-effort", &DeleteParams::default().grace_period(0))
        .await?;
    wait_gone(&pods, &["best-effort"]).await?;
    ensure!(
        best_effort_cgroup.exists(),
        "removed while the agent was down?"
    );
    let (agent_stop, agent) = start_agent(config);
    let parent = cgroups.cgroup("kubepods/besteffort");
    let dirs: Vec<std::path::PathBuf> = parent
        .procs_files()
        .iter()
        .filter_map(|f| f.parent().map(|d| d.to_owned()))
        .collect();
    let dirs: Vec<&std::path::Path> = dirs.iter().map(|d| d.as_path()).collect();
    trellis_tests::wait_removed_in(
        &dirs,
        || {
            if best_effort_cgroup.exists() {
                vec![best_effort_cgroup.path().to_owned()]
            } else {
                Vec::new()
            }
        },
        Duration::from_secs(30),
    )
    .await?;

    delete_all(&api, &pods).await?;
    agent_stop.stop();
    agent.await??;
    stop.stop();
    server.await??;
    Ok(())
}

/// Deletes the test's pods at once and waits until they are gone: the agent removes
/// a pod once it stopped its containers and removed its cgroup.
async fn delete_all(api: &Api<Pod>, pods: &Arc<Informer<Pod>>) -> Result<()> {
    let names = ["memory-hog", "guaranteed", "as-user", "non-root"];
    for name in names {
        let _ = api.delete(name, &DeleteParams::default()).await;
    }
    wait_gone(pods, &names).await
}

async fn wait_gone(pods: &Arc<Informer<Pod>>, names: &[&str]) -> Result<()> {
    let mut changes = pods.subscribe();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let left = || {
        names
            .iter()
            .filter(|n| pods.get(&format!("default/{n}")).is_some())
            .count()
    };
    while left() > 0 {
        tokio::select! {
            change = changes.recv() => if change.is_none() { bail!("the pod informer ended") },
            _ = tokio::time::sleep_until(deadline) => bail!("{} of {names:?} left", left()),
        }
    }
    Ok(())
}
