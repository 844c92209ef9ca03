//! The node agent (`trellis-agent`) with Trellis' runtime (`trellis-runtime`) over its
//! CRI socket, against a real server: the Node and its Lease; WASM and process pods
//! run to completion or keep running, restart with back-off, get their environment
//! and volumes, are stopped gracefully when deleted; bad images, unknown handlers and
//! a memory cap end as Kubernetes reports them; a restarted agent finds its pods
//! again without starting duplicates. One server and one node for the module; the
//! tests bind pods themselves (`spec.nodeName`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use trellis_api::{Shutdown, Stop};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_agent::AgentConfig;
use trellis_api::UserInfo;
use trellis_client::identity;
use trellis_client::informer::{Informer, SharedInformers};
use trellis_runtime::{Runtime, RuntimeConfig};
use trellis_tests::TestCluster;
use trellis_tests::pod_network::{NetworkedNode, NetworkedNodeOptions, PodNetwork, delete_pods};

const NODE: &str = "node-1";

fn workload() -> Result<String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../plugins/target/dist/workload.wasm")
        .canonicalize()
        .context("plugins/target/dist/workload.wasm is missing: run plugins/build.sh")?;
    Ok(format!("file://{}", path.display()))
}

/// A node in this test: the runtime on a socket and the agent, until stopped.
struct TestNode {
    stop: Stop,
    agent: tokio::task::JoinHandle<Result<()>>,
    server: tokio::task::JoinHandle<Result<()>>,
}

impl TestNode {
    async fn start(cluster: &TestCluster, root: &std::path::Path) -> Result<TestNode> {
        let (stop, stopped) = Shutdown::new();
        let runtime = Runtime::new(trellis_tests::sandboxed(RuntimeConfig {
            root: root.join("runtime"),
            cache_dir: Some(root.join("compiled")),
            process_handler: true,
            node_ip: "127.0.0.1".parse()?,
            ..Default::default()
        }))?;
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
        config.relist_period = Duration::from_millis(50);
        config.backoff_base = Duration::from_millis(200);
        config.backoff_max = Duration::from_millis(800);
        config.port = 0;
        config.client_ca_pem = Some(cluster.ca_pem.clone());
        // Thresholds no machine meets, so that the conditions say the same wherever
        // the test runs and nothing is evicted (a met threshold is `eviction`'s test).
        config.eviction_hard = Some(
            "memory.available<0,nodefs.available<0%,nodefs.inodesFree<0%,pid.available<0"
                .parse()
                .map_err(anyhow::Error::msg)?,
        );
        let client = cluster.in_process().client(identity::node(NODE));
        let agent = tokio::spawn(trellis_agent::run(
            config,
            client,
            cri,
            SharedInformers::new(),
            stopped,
        ));
        Ok(TestNode {
            stop,
            agent,
            server,
        })
    }

    async fn stop(self) -> Result<()> {
        self.stop.stop();
        self.agent.await??;
        self.server.await??;
        Ok(())
    }
}

/// Waits until the pod satisfies `done` (a watch, not a poll), up to `limit`.
pub(super) async fn wait_pod(
    pods: &Arc<Informer<Pod>>,
    name: &str,
    limit: Duration,
    done: impl Fn(&Pod) -> bool,
) -> Result<Arc<Pod>> {
    let mut changes = pods.subscribe();
    let key = format!("default/{name}");
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(pod) = pods.get(&key)
            && done(&pod)
        {
            return Ok(pod);
        }
        tokio::select! {
            change = changes.recv() => if change.is_none() { bail!("the pod informer ended") },
            _ = tokio::time::sleep_until(deadline) => {
                bail!("pod {name} did not get there in {limit:?}; it is {:?}", pods.get(&key).map(|p| p.status.clone()))
            }
        }
    }
}

pub(super) fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

pub(super) fn container(pod: &Pod) -> Option<&k8s_openapi::api::core::v1::ContainerStatus> {
    pod.status.as_ref()?.container_statuses.as_ref()?.first()
}

fn terminated(pod: &Pod) -> Option<&k8s_openapi::api::core::v1::ContainerStateTerminated> {
    container(pod)?.state.as_ref()?.terminated.as_ref()
}

fn waiting_reason(pod: &Pod) -> Option<&str> {
    container(pod)?
        .state
        .as_ref()?
        .waiting
        .as_ref()?
        .reason
        .as_deref()
}

/// The log of the pod's container attempt, as the runtime wrote it (CRI format).
fn log_of(root: &std::path::Path, pod: &Pod, container: &str, attempt: u32) -> Result<String> {
    let dir = root.join("agent/logs").join(format!(
        "default_{}_{}",
        pod.metadata.name.as_deref().unwrap_or_default(),
        pod.metadata.uid.as_deref().unwrap_or_default()
    ));
    let path = dir.join(container).join(format!("{attempt}.log"));
    std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))
}

/// A fixture component of the plugins workspace (built by plugins/build.sh).
fn fixture(name: &str) -> Result<String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../plugins/target/dist/{name}.wasm"))
        .canonicalize()
        .with_context(|| {
            format!("plugins/target/dist/{name}.wasm is missing: run plugins/build.sh")
        })?;
    Ok(format!("file://{}", path.display()))
}

/// The node's log directories of pods named `name` in `default`.
fn log_dirs(root: &std::path::Path, name: &str) -> Vec<String> {
    let prefix = format!("default_{name}_");
    std::fs::read_dir(root.join("agent/logs"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

/// Waits until the node has no log directory left of the pods `names`, up to `limit`.
async fn wait_logs_removed(root: &std::path::Path, names: &[&str], limit: Duration) -> Result<()> {
    let left = || names.iter().flat_map(|n| log_dirs(root, n)).collect();
    trellis_tests::wait_removed(&root.join("agent/logs"), left, limit)
        .await
        .context("log directories left")
}

async fn create_pod(api: &Api<Pod>, value: serde_json::Value) -> Result<Pod> {
    let mut value = value;
    value["spec"]["nodeName"] = NODE.into();
    let pod: Pod = serde_json::from_value(value)?;
    Ok(api.create(&PostParams::default(), &pod).await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_runs_pods_as_kubernetes_reports_them() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let dir = trellis_tests::test_dir()?;
    let root = dir.path();
    let node = TestNode::start(&cluster, root).await?;
    let admin = cluster
        .in_process()
        .client(UserInfo::new("admin", ["system:masters"]));
    let image = workload()?;
    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let events = watching.informer::<Event>(Api::all(admin.clone()), watcher::Config::default());
    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");

    // The Node: Ready, its handlers, its Lease.
    let node_informer =
        watching.informer::<Node>(Api::all(admin.clone()), watcher::Config::default());
    let registered = async {
        let mut changes = node_informer.subscribe();
        loop {
            if let Some(n) = node_informer.get(NODE)
                && n.status.as_ref().is_some_and(|s| s.node_info.is_some())
            {
                return Ok::<_, anyhow::Error>(n);
            }
            changes.recv().await.context("node informer ended")?;
        }
    };
    let n = tokio::time::timeout(Duration::from_secs(10), registered)
        .await
        .context("the node did not register")??;
    let status = n.status.clone().unwrap_or_default();
    let ready = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.status.clone());
    ensure!(ready.as_deref() == Some("True"), "{status:#?}");
    // The pressure conditions, by the thresholds the node was given.
    let reason = |kind: &str| {
        status
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == kind)
            .map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()))
    };
    ensure!(
        reason("PIDPressure") == Some(("False".into(), "KubeletHasSufficientPID".into()))
            && reason("MemoryPressure")
                == Some(("False".into(), "KubeletHasSufficientMemory".into()))
            && reason("DiskPressure") == Some(("False".into(), "KubeletHasNoDiskPressure".into())),
        "{:#?}",
        status.conditions
    );
    let handlers: Vec<String> = status
        .runtime_handlers
        .iter()
        .flatten()
        .filter_map(|h| h.name.clone())
        .collect();
    ensure!(
        handlers.contains(&"wasmtime".to_owned()) && handlers.contains(&"process".to_owned()),
        "{handlers:?}"
    );
    ensure!(
        status
            .node_info
            .as_ref()
            .is_some_and(|i| i.container_runtime_version.starts_with("trellis://")),
        "{:?}",
        status.node_info
    );
    if node.agent.is_finished() {
        bail!("the agent stopped: {:?}", node.agent.await);
    }
    let labels = n.metadata.labels.clone().unwrap_or_default();
    ensure!(
        labels
            .get("handler.trellis.dev/process")
            .map(String::as_str)
            == Some("true"),
        "{labels:?}"
    );
    let leases: Api<Lease> = Api::namespaced(admin.clone(), "kube-node-lease");
    ensure!(
        leases
            .get(NODE)
            .await?
            .spec
            .and_then(|s| s.renew_time)
            .is_some()
    );

    // Containers that fail at start (StartError: a file that is not a program, a
    // component that exports neither wasi:cli/run nor wasi:http) restart with the
    // same back-off as containers that exit, not in a tight loop. Started here and
    // counted further down, so the test's other steps make the time that passes.
    let storm_started = tokio::time::Instant::now();
    let storm_writes = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counting = {
        let mut changes = pods.subscribe();
        let writes = storm_writes.clone();
        tokio::spawn(async move {
            while let Some(change) = changes.recv().await {
                let name = change.object().metadata.name.clone().unwrap_or_default();
                if name.starts_with("storm-") {
                    writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        })
    };
    create_pod(
        &api,
        json!({"metadata": {"name": "storm-exec"}, "spec": {"runtimeClassName": "process",
            "containers": [{"name": "main", "image": "file:///etc/hostname"}]}}),
    )
    .await?;
    create_pod(
        &api,
        json!({"metadata": {"name": "storm-wasm"}, "spec": {
            "containers": [{"name": "main", "image": fixture("noop")?}]}}),
    )
    .await?;

    // A WASM program runs to completion: its output in the log, Succeeded, events.
    create_pod(
        &api,
        json!({"metadata": {"name": "hello"}, "spec": {"restartPolicy": "Never",
            "containers": [{"name": "main", "image": image, "args": ["echo", "hello from wasm", "--", "stderr", "to stderr"]}]}}),
    )
    .await?;
    let pod = wait_pod(&pods, "hello", Duration::from_secs(30), |p| {
        phase(p) == "Succeeded"
    })
    .await?;
    let t = terminated(&pod).context("terminated state")?;
    ensure!(
        t.exit_code == 0 && t.reason.as_deref() == Some("Completed"),
        "{t:?}"
    );
    let s = pod.status.as_ref().context("status")?;
    ensure!(
        s.pod_ip.as_deref() == Some("127.0.0.1") && s.qos_class.as_deref() == Some("BestEffort"),
        "{s:?}"
    );
    let log = log_of(root, &pod, "main", 0)?;
    ensure!(
        log.contains(" stdout F hello from wasm\n") && log.contains(" stderr F to stderr\n"),
        "{log}"
    );
    // A copy of the pod that says it runs (as the watch can bring one from before the
    // terminal status): the agent starts nothing again and puts its status back.
    let rewound = api
        .patch_status(
            "hello",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running"}})),
        )
        .await?;
    let rewound_rv = rewound.metadata.resource_version.clone();
    wait_pod(&pods, "hello", Duration::from_secs(10), |p| {
        phase(p) == "Succeeded" && p.metadata.resource_version != rewound_rv
    })
    .await
    .context("the agent did not put the terminal status back")?;
    let again = log_of(root, &pod, "main", 0)?;
    ensure!(again == log, "the finished pod ran again:\n{again}");
    // The same through the API server and the node's log endpoint, with kubectl.
    let kubectl = cluster.admin();
    // Both streams, whole lines; their order across streams is the runtime's (as
    // with containerd, whose stdout and stderr are separate pipes).
    let logs = kubectl.ok(&["logs", "hello"]).await?;
    let mut lines: Vec<&str> = logs.lines().collect();
    lines.sort_unstable();
    ensure!(
        logs.ends_with('\n') && lines == ["hello from wasm", "to stderr"],
        "{logs:?}; the file: {log}"
    );
    let last = logs.lines().last().unwrap_or_default();
    ensure!(kubectl.ok(&["logs", "hello", "--tail", "1"]).await? == format!("{last}\n"));
    let stamped = kubectl
        .ok(&["logs", "hello", "-c", "main", "--timestamps"])
        .await?;
    ensure!(
        stamped.lines().all(|l| l.len() > 30 && l.contains("Z ")),
        "{stamped}"
    );
    for reason in ["Pulled", "Created", "Started"] {
        let seen = async {
            let mut changes = events.subscribe();
            loop {
                if events.list().iter().any(|e| {
                    e.involved_object.name.as_deref() == Some("hello")
                        && e.reason.as_deref() == Some(reason)
                }) {
                    return Ok::<_, anyhow::Error>(());
                }
                changes.recv().await.context("event informer ended")?;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), seen)
            .await
            .with_context(|| format!("no {reason} event"))??;
    }

    // Env from values, the downward API, a ConfigMap and a Secret; volumes, a
    // ServiceAccount token among them (no controller makes the account here).
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(admin.clone(), "default");
    accounts
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "default"}}))?,
        )
        .await?;
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(admin.clone(), "default");
    cms.create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": "settings"}, "data": {"color": "blue", "file.txt": "from a configmap"}}))?).await?;
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(admin.clone(), "default");
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "creds"}, "stringData": {"password": "s3cret"}}),
            )?,
        )
        .await?;
    create_pod(
        &api,
        json!({"metadata": {"name": "wired", "labels": {"app": "wired"}}, "spec": {"restartPolicy": "Never",
            "volumes": [{"name": "config", "configMap": {"name": "settings"}}, {"name": "scratch", "emptyDir": {}},
                        {"name": "api", "projected": {"sources": [{"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
                                                                  {"downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}}]}}],
            "containers": [{"name": "main", "image": image,
                "env": [{"name": "GREETING", "value": "hi"}, {"name": "SAID", "value": "$(GREETING) there"},
                        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                        {"name": "COLOR", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "color"}}},
                        {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}}],
                "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": true}, {"name": "scratch", "mountPath": "/scratch"},
                                 {"name": "api", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}],
                "args": ["env", "SAID", "--", "env", "POD", "--", "env", "APP", "--", "env", "COLOR", "--", "env", "PASSWORD",
                         "--", "cat", "/config/file.txt", "--", "write", "/scratch/out", "written", "--", "cat", "/scratch/out",
                         "--", "cat", "/var/run/secrets/kubernetes.io/serviceaccount/name", "--", "echo",
                         "--", "cat", "/var/run/secrets/kubernetes.io/serviceaccount/token", "--", "echo"]}]}}),
    )
    .await?;
    let pod = wait_pod(&pods, "wired", Duration::from_secs(30), |p| {
        matches!(phase(p), "Succeeded" | "Failed")
    })
    .await?;
    let log = log_of(root, &pod, "main", 0)?;
    ensure!(phase(&pod) == "Succeeded", "{log}");
    for line in [
        "SAID=hi there",
        "POD=wired",
        "APP=wired",
        "COLOR=blue",
        "PASSWORD=s3cret",
        "from a configmap",
        "written",
        "writtenwired",
        // A ServiceAccount token is a JWT: its header starts so.
        " stdout F eyJ",
    ] {
        ensure!(log.contains(line), "{line:?} missing from\n{log}");
    }

    // The Node authorizer's graph: the node reads what its pods use, nothing else.
    let as_node = cluster.in_process().client(identity::node(NODE));
    let node_secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(as_node.clone(), "default");
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "unrelated"}, "stringData": {"k": "v"}}),
            )?,
        )
        .await?;
    ensure!(
        node_secrets.get("creds").await.is_ok(),
        "a secret a bound pod uses is readable"
    );
    match node_secrets.get("unrelated").await {
        Err(kube::Error::Api(e)) if e.code == 403 => {}
        other => bail!("a secret no pod of the node uses must be forbidden: {other:?}"),
    }
    let other_node: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(
        cluster.in_process().client(identity::node("node-2")),
        "default",
    );
    ensure!(
        other_node.get("settings").await.is_err(),
        "another node may not read it"
    );

    // A crashing container restarts with back-off (OnFailure), counted.
    create_pod(
        &api,
        json!({"metadata": {"name": "crasher"}, "spec": {"restartPolicy": "OnFailure",
            "containers": [{"name": "main", "image": image, "args": ["echo", "crashing", "--", "exit", "3"]}]}}),
    )
    .await?;
    let pod = wait_pod(&pods, "crasher", Duration::from_secs(30), |p| {
        container(p).is_some_and(|c| c.restart_count >= 2)
            && waiting_reason(p) == Some("CrashLoopBackOff")
    })
    .await?;
    let last = container(&pod)
        .and_then(|c| c.last_state.as_ref())
        .and_then(|s| s.terminated.as_ref());
    ensure!(
        last.is_some_and(|t| t.exit_code == 3 && t.reason.as_deref() == Some("Error")),
        "{last:?}"
    );
    ensure!(phase(&pod) == "Running", "{:?}", pod.status);
    ensure!(kubectl.ok(&["logs", "crasher", "--previous"]).await? == "crashing\n");

    // Probes: a failing liveness probe restarts the container, a readiness probe
    // that cannot connect keeps it unready; both are told in Unhealthy events.
    create_pod(
        &api,
        json!({"metadata": {"name": "probed"}, "spec": {"runtimeClassName": "process", "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "file:///bin/sleep", "args": ["600"],
                "livenessProbe": {"exec": {"command": ["/bin/sh", "-c", "exit 1"]}, "periodSeconds": 1, "failureThreshold": 1},
                "readinessProbe": {"tcpSocket": {"port": 1}, "periodSeconds": 1}}]}}),
    )
    .await?;
    let pod = wait_pod(&pods, "probed", Duration::from_secs(30), |p| {
        container(p).is_some_and(|c| c.restart_count >= 1)
    })
    .await?;
    let ready = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.status.clone());
    ensure!(ready.as_deref() == Some("False"), "{:?}", pod.status);
    let probe_events: Vec<String> = events
        .list()
        .iter()
        .filter(|e| {
            e.involved_object.name.as_deref() == Some("probed")
                && e.reason.as_deref() == Some("Unhealthy")
        })
        .filter_map(|e| e.message.clone())
        .collect();
    ensure!(
        probe_events
            .iter()
            .any(|m| m.starts_with("Liveness probe failed")),
        "{probe_events:?}"
    );
    api.delete(
        "probed",
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        },
    )
    .await?;

    // A memory cap: the instance is stopped, OOMKilled.
    create_pod(
        &api,
        json!({"metadata": {"name": "hungry"}, "spec": {"restartPolicy": "Never",
            "containers": [{"name": "main", "image": image, "args": ["alloc", "64"],
                "resources": {"limits": {"memory": "16Mi"}}}]}}),
    )
    .await?;
    let pod = wait_pod(&pods, "hungry", Duration::from_secs(30), |p| {
        phase(p) == "Failed"
    })
    .await?;
    let t = terminated(&pod).context("terminated")?;
    ensure!(
        t.reason.as_deref() == Some("OOMKilled") && t.exit_code == 137,
        "{t:?}"
    );
    ensure!(pod.status.as_ref().and_then(|s| s.qos_class.as_deref()) == Some("Burstable"));

    // An image in a private registry: pulled with the pod's imagePullSecrets; a pod
    // without them is refused by the registry (pulled again: `Always`).
    let registry = trellis_tests::registry::Registry::start_private("puller", "pw").await?;
    let wasm = std::fs::read(image.trim_start_matches("file://"))?;
    registry
        .push("wasm/workload", "v1", "application/wasm", &wasm)
        .await?;
    let private = format!("{}/wasm/workload:v1", registry.address);
    let docker_config =
        json!({"auths": {registry.address.clone(): {"username": "puller", "password": "pw"}}});
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "pull"},
                "type": "kubernetes.io/dockerconfigjson",
                "stringData": {".dockerconfigjson": docker_config.to_string()}}))?,
        )
        .await?;
    create_pod(
        &api,
        json!({"metadata": {"name": "private"}, "spec": {"restartPolicy": "Never",
            "imagePullSecrets": [{"name": "pull"}],
            "containers": [{"name": "main", "image": private, "args": ["echo", "pulled"]}]}}),
    )
    .await?;
    let pod = wait_pod(&pods, "private", Duration::from_secs(30), |p| {
        matches!(phase(p), "Succeeded" | "Failed")
            || waiting_reason(p).is_some_and(|r| r.contains("Image"))
    })
    .await?;
    ensure!(phase(&pod) == "Succeeded", "{:?}", pod.status);
    let image_id = container(&pod)
        .map(|c| c.image_id.clone())
        .unwrap_or_default();
    ensure!(
        image_id.starts_with(&format!("{}/wasm/workload@sha256:", registry.address)),
        "{image_id}"
    );
    create_pod(
        &api,
        json!({"metadata": {"name": "no-secret"}, "spec": {"restartPolicy": "Never",
            "containers": [{"name": "main", "image": private, "imagePullPolicy": "Always"}]}}),
    )
    .await?;
    wait_pod(&pods, "no-secret", Duration::from_secs(30), |p| {
        matches!(waiting_reason(p), Some("ErrImagePull" | "ImagePullBackOff"))
    })
    .await?;

    // A missing image: ErrImagePull, then ImagePullBackOff.
    create_pod(
        &api,
        json!({"metadata": {"name": "no-image"}, "spec": {"containers": [{"name": "main", "image": "file:///nonexistent/app.wasm"}]}}),
    )
    .await?;
    let pod = wait_pod(&pods, "no-image", Duration::from_secs(30), |p| {
        waiting_reason(p) == Some("ImagePullBackOff")
    })
    .await?;
    ensure!(phase(&pod) == "Pending", "{:?}", pod.status);

    // A RuntimeClass that does not exist is refused at admission; one whose handler
    // the node lacks fails the pod, which says why.
    let no_class = json!({"metadata": {"name": "no-class"}, "spec": {"runtimeClassName": "gvisor",
        "containers": [{"name": "main", "image": image}]}});
    let refused = create_pod(&api, no_class.clone())
        .await
        .err()
        .map(|e| e.to_string());
    ensure!(
        refused
            .as_deref()
            .is_some_and(|e| e.contains("RuntimeClass \"gvisor\" not found")),
        "{refused:?}"
    );
    let classes: Api<k8s_openapi::api::node::v1::RuntimeClass> = Api::all(admin.clone());
    classes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "gvisor"}, "handler": "runsc"}))?,
        )
        .await?;
    create_pod(&api, no_class).await?;
    let pod = wait_pod(&pods, "no-class", Duration::from_secs(30), |p| {
        phase(p) == "Failed"
    })
    .await?;
    let s = pod.status.as_ref().context("status")?;
    ensure!(
        s.reason.as_deref() == Some("UnsupportedRuntimeHandler")
            && s.message.as_deref().is_some_and(|m| m.contains("runsc")),
        "{s:?}"
    );

    // The failed starts, counted over the time since they were created.
    for name in ["storm-exec", "storm-wasm"] {
        let pod = wait_pod(&pods, name, Duration::from_secs(10), |p| {
            waiting_reason(p) == Some("CrashLoopBackOff")
        })
        .await?;
        let c = container(&pod).context("container status")?;
        let last = c
            .last_state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .context("last state")?;
        ensure!(
            last.reason.as_deref() == Some("StartError") && last.exit_code == 128,
            "{name}: {last:?}"
        );
        // Back-off of 200 ms doubling to 800 ms: the first restart at once, then at
        // most one per 200, 400, 800, 800… ms. A tight loop makes hundreds a second.
        let ran = storm_started.elapsed().as_secs_f64();
        let most = 3 + (ran / 0.8).ceil() as i32;
        ensure!(
            (1..=most).contains(&c.restart_count),
            "{name}: {} restarts in {ran:.1} s, at most {most} expected",
            c.restart_count
        );
    }
    let ran = storm_started.elapsed().as_secs_f64();
    let writes = storm_writes.load(std::sync::atomic::Ordering::Relaxed);
    // Two pods, a few status writes per restart each.
    let most = 2 * (10 + 4 * (ran / 0.8).ceil() as u64);
    ensure!(
        writes <= most,
        "{writes} changes of the failing pods in {ran:.1} s, at most {most} expected"
    );
    counting.abort();

    // A Secret's bytes reach a process as they are, UTF-8 or not; a WASM component,
    // whose environment is UTF-8 strings, is refused with the reason, not given
    // another value.
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "raw"}, "data": {"bytes": "//5vaw=="}}),
            )?,
        )
        .await?;
    let raw_env =
        json!([{"name": "RAW", "valueFrom": {"secretKeyRef": {"name": "raw", "key": "bytes"}}}]);
    create_pod(
        &api,
        json!({"metadata": {"name": "raw-process"}, "spec": {"runtimeClassName": "process", "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "file:///bin/sh", "env": raw_env,
                "command": ["/bin/sh", "-c", "printf %s \"$RAW\" | od -An -tx1"]}]}}),
    )
    .await?;
    create_pod(
        &api,
        json!({"metadata": {"name": "raw-wasm"}, "spec": {"restartPolicy": "Never",
            "containers": [{"name": "main", "image": image, "env": raw_env, "args": ["env", "RAW"]}]}}),
    )
    .await?;
    let pod = wait_pod(&pods, "raw-process", Duration::from_secs(30), |p| {
        matches!(phase(p), "Succeeded" | "Failed")
    })
    .await?;
    let log = log_of(root, &pod, "main", 0)?;
    ensure!(
        phase(&pod) == "Succeeded" && log.contains(" stdout F  ff fe 6f 6b"),
        "{log}"
    );
    let pod = wait_pod(&pods, "raw-wasm", Duration::from_secs(30), |p| {
        waiting_reason(p).is_some()
    })
    .await?;
    let waiting = container(&pod)
        .and_then(|c| c.state.as_ref()?.waiting.clone())
        .context("waiting")?;
    ensure!(
        waiting.reason.as_deref() == Some("CreateContainerError")
            && waiting
                .message
                .as_deref()
                .is_some_and(|m| m.contains("RAW is not valid UTF-8")),
        "{waiting:?}"
    );

    // A pod name as long as Kubernetes allows: its logs and events still work (the
    // log directory's name and the events' names are cut and hashed).
    let long = format!("long-{}", "n".repeat(248));
    create_pod(
        &api,
        json!({"metadata": {"name": long}, "spec": {"restartPolicy": "Never",
            "containers": [{"name": "main", "image": image, "args": ["echo", "a long name"]}]}}),
    )
    .await?;
    let pod = wait_pod(&pods, &long, Duration::from_secs(30), |p| {
        matches!(phase(p), "Succeeded" | "Failed")
    })
    .await?;
    ensure!(phase(&pod) == "Succeeded", "{:?}", pod.status);
    ensure!(kubectl.ok(&["logs", &long]).await? == "a long name\n");
    let started = async {
        let mut changes = events.subscribe();
        loop {
            if events.list().iter().any(|e| {
                e.involved_object.name.as_deref() == Some(long.as_str())
                    && e.reason.as_deref() == Some("Started")
            }) {
                return Ok::<_, anyhow::Error>(());
            }
            changes.recv().await.context("event informer ended")?;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), started)
        .await
        .context("no Started event for the pod with a long name")??;

    // Lines longer than the reader's 1 MiB cap: `--tail` counts each as one line
    // and shows it whole.
    create_pod(
        &api,
        json!({"metadata": {"name": "long-lines"}, "spec": {"runtimeClassName": "process", "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "file:///bin/sh",
                "command": ["/bin/sh", "-c", "echo first; head -c 1572864 /dev/zero | tr '\\0' x; echo; echo last"]}]}}),
    )
    .await?;
    wait_pod(&pods, "long-lines", Duration::from_secs(30), |p| {
        matches!(phase(p), "Succeeded" | "Failed")
    })
    .await?;
    let long_line = "x".repeat(1_572_864);
    ensure!(
        kubectl.ok(&["logs", "long-lines", "--tail", "2"]).await? == format!("{long_line}\nlast\n"),
        "--tail 2 is not the long line and the last"
    );
    ensure!(
        kubectl.ok(&["logs", "long-lines"]).await? == format!("first\n{long_line}\nlast\n"),
        "the whole log is not the three lines"
    );

    // Logs go with their pods: a finished pod deleted, a running one force-deleted.
    let forced = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    ensure!(
        !log_dirs(root, "hello").is_empty() && !log_dirs(root, "storm-exec").is_empty(),
        "the pods have logs before they are deleted"
    );
    api.delete("hello", &DeleteParams::default()).await?;
    api.delete("storm-exec", &forced).await?;
    wait_logs_removed(
        root,
        &["hello", "probed", "storm-exec"],
        Duration::from_secs(10),
    )
    .await?;

    // A process keeps running; the agent restarts; nothing is started twice.
    create_pod(
        &api,
        json!({"metadata": {"name": "sleeper"}, "spec": {"runtimeClassName": "process", "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "main", "image": "file:///bin/sh", "command": ["/bin/sh", "-c", "echo started; trap 'echo bye; exit 0' TERM; while true; do sleep 0.05; done"]}]}}),
    )
    .await?;
    let before = wait_pod(&pods, "sleeper", Duration::from_secs(30), |p| {
        phase(p) == "Running"
    })
    .await?;
    let id = container(&before)
        .and_then(|c| c.container_id.clone())
        .context("container id")?;
    node.stop().await?;
    // Deleted while its node is down: the node removes its logs when it is back.
    ensure!(!log_dirs(root, "wired").is_empty(), "wired has logs");
    api.delete("wired", &forced).await?;
    let node = TestNode::start(&cluster, root).await?;
    wait_logs_removed(root, &["wired"], Duration::from_secs(10)).await?;
    // The restarted agent writes the same status: wait for a change of any pod, then
    // compare.
    let crasher_restarts = |p: &Pod| container(p).map(|c| c.restart_count).unwrap_or(0);
    let now = pods
        .get("default/crasher")
        .map(|p| crasher_restarts(&p))
        .unwrap_or(0);
    wait_pod(&pods, "crasher", Duration::from_secs(30), |p| {
        crasher_restarts(p) > now
    })
    .await?;
    let after = pods.get("default/sleeper").context("sleeper")?;
    ensure!(phase(&after) == "Running", "{:?}", after.status);
    let c = container(&after).context("status")?;
    ensure!(
        c.container_id.as_deref() == Some(id.as_str()) && c.restart_count == 0,
        "{c:?} vs {id}"
    );

    // Deleted: stopped gracefully (SIGTERM, the trap runs), then the pod is gone.
    api.delete("sleeper", &DeleteParams::default()).await?;
    let marked = api.get("sleeper").await;
    if let Ok(p) = &marked {
        ensure!(
            p.metadata.deletion_timestamp.is_some(),
            "a bound pod is deleted gracefully"
        );
    }
    let gone = async {
        let mut changes = pods.subscribe();
        while pods.get("default/sleeper").is_some() {
            changes.recv().await.context("pod informer ended")?;
        }
        Ok::<_, anyhow::Error>(())
    };
    tokio::time::timeout(Duration::from_secs(20), gone)
        .await
        .context("the pod was not removed")??;
    let logs = root.join("agent/logs");
    ensure!(
        !std::fs::read_dir(&logs)?.flatten().any(|e| e
            .file_name()
            .to_string_lossy()
            .starts_with("default_sleeper_")),
        "the removed pod's logs are cleaned up"
    );

    node.stop().await?;
    cluster.stop().await?;
    Ok(())
}

/// With `pod_network`, pods that are not hostNetwork wait for the Node's pod CIDR and
/// get addresses of their own from it: two web servers on the same port, each
/// answering on its pod IP, made Ready by an HTTP readiness probe against that IP; a
/// hostNetwork pod keeps the node's IP; the downward API's `status.podIP` is the
/// pod's; nothing of the pods' namespaces is left once they are deleted. Needs root
/// and the CNI plugins; the node has a CNI network of its own (its bridge, no
/// masquerade) on 10.244.79.0/24, so it never meets the runtime tests' default
/// network.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_on_their_own_network_get_ips_from_the_node_pod_cidr() -> Result<()> {
    if !rustix::process::geteuid().is_root()
        || !std::path::Path::new("/usr/lib/cni/bridge").exists()
    {
        eprintln!("skipped: pod networks need root and the CNI plugins (make deps)");
        return Ok(());
    }
    const NET_NODE: &str = "node-net";
    let cluster = TestCluster::start().await?;
    let node = NetworkedNode::start(
        &cluster,
        NetworkedNodeOptions {
            node: NET_NODE,
            pod_cidr: "10.244.79.0/24",
            bridge: "trellis-nt79",
            network: PodNetwork::Bridge {
                name: "node-test",
                hairpin: true,
            },
            client_ca: false,
            backoff_base: None,
        },
    )
    .await?;
    let root = node.root();
    let admin = node.admin.clone();
    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let names = ["web-a", "web-b", "on-host"];
    // Where the sandboxed pods (as nobody) tell the test their IP.
    let shared = root.join("shared");
    std::fs::create_dir_all(&shared)?;
    std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o777))?;
    let work = async {
        // The pods come before the pod CIDR: they wait for it.
        for name in ["web-a", "web-b"] {
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {"nodeName": NET_NODE, "runtimeClassName": "process",
                    "terminationGracePeriodSeconds": 1,
                    "volumes": [{"name": "shared", "hostPath": {"path": shared.display().to_string()}}],
                    "containers": [{"name": "web", "image": "file:///bin/sh",
                        "command": ["/bin/sh", "-c", "echo \"$POD_IP\" > ip-$NAME; exec /usr/bin/python3 -m http.server 8080"],
                        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                        "workingDir": shared.display().to_string(),
                        "volumeMounts": [{"name": "shared", "mountPath": shared.display().to_string()}],
                        "ports": [{"containerPort": 8080}],
                        "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1}}]}
            }))?;
            api.create(&PostParams::default(), &pod).await?;
        }
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "on-host"},
            "spec": {"nodeName": NET_NODE, "runtimeClassName": "process", "hostNetwork": true,
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "main", "image": "file:///bin/sleep", "args": ["600"]}]}
        }))?;
        api.create(&PostParams::default(), &pod).await?;
        // A hostNetwork pod does not wait for the pod CIDR.
        let on_host = wait_pod(&pods, "on-host", Duration::from_secs(30), |p| {
            phase(p) == "Running"
        })
        .await?;
        let status = on_host.status.clone().unwrap_or_default();
        ensure!(
            status.pod_ip.as_deref() == Some("127.0.0.1"),
            "a hostNetwork pod has the node's IP: {status:?}"
        );
        ensure!(
            pods.get("default/web-a")
                .and_then(|p| p.status.clone())
                .and_then(|s| s.pod_ip)
                .is_none(),
            "no pod IP before the node has a pod CIDR"
        );

        // The node IPAM controller's part, done by hand.
        node.set_pod_cidr().await?;
        let mut ips = Vec::new();
        for name in ["web-a", "web-b"] {
            let pod = wait_pod(&pods, name, Duration::from_secs(60), |p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                    .is_some_and(|c| c.status == "True")
            })
            .await?;
            let status = pod.status.clone().unwrap_or_default();
            let ip = status.pod_ip.clone().context("no podIP")?;
            ensure!(ip.starts_with("10.244.79."), "{name}'s IP {ip} is in the pod CIDR");
            let listed: Vec<String> = status
                .pod_ips
                .iter()
                .flatten()
                .map(|i| i.ip.clone())
                .collect();
            ensure!(listed == [ip.clone()], "{listed:?}");
            ensure!(
                status.host_ip.as_deref() == Some("127.0.0.1"),
                "{:?}",
                status.host_ip
            );
            // The downward API gives the container the same IP.
            let told = std::fs::read_to_string(shared.join(format!("ip-{name}")))?;
            ensure!(told.trim() == ip, "{name} was told {told:?}, not {ip}");
            ips.push(ip);
        }
        ensure!(ips[0] != ips[1], "{ips:?}");
        for ip in &ips {
            ensure!(trellis_tests::http_answers(ip, 8080).await, "the pod at {ip} answers from the host");
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;

    // Deleted whatever happened above, so that no namespace outlives the test.
    let gone = delete_pods(&api, &pods, &names, Duration::from_secs(30)).await;
    // The agent removes what a deleted pod ran right after it is gone from the API.
    let netns = root.join("runtime/netns");
    let pins = || {
        std::fs::read_dir(&netns)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    let removed = trellis_tests::wait_removed(&netns, pins, Duration::from_secs(15)).await;
    node.stop().await?;
    work?;
    gone.context("the pods were not removed")??;
    removed.context("netns pins left")?;
    cluster.stop().await?;
    Ok(())
}
