//! The bundled StatefulSet controller (with the garbage collector and the
//! disruption controller, which reads the sets' scale) against a real
//! server, driven by kubectl, pods made Running and Ready by a stand-in for the node
//! that the tests can overrule: Kubernetes' conformance behaviours (ordered scaling
//! that halts on an unhealthy pod, burst scaling, rolling updates and roll backs),
//! partitions, `kubectl rollout`, claims from templates kept across a pod's delete
//! and removed by the retention policy.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::{ControllerRevision, StatefulSet};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_api::{Shutdown, Stop, UserInfo};
use trellis_client::events::EventRecorder;
use trellis_client::identity;
use trellis_client::informer::{Change, Informer, SharedInformers};
use trellis_client::workqueue::QueueMetrics;
use trellis_controllers::Manager;
use trellis_plugin_host::{Compilers, HostConfig, PluginHost};
use trellis_tests::TestCluster;

/// A cluster with the StatefulSet controller and the garbage collector running, a
/// stand-in node, and informers on what the tests look at.
struct Env {
    cluster: TestCluster,
    admin: kube::Client,
    stop: Stop,
    running: Vec<trellis_controllers::Running>,
    kubelet: tokio::sync::oneshot::Sender<()>,
    pods: Arc<Informer<Pod>>,
    sets: Arc<Informer<StatefulSet>>,
    claims: Arc<Informer<PersistentVolumeClaim>>,
    /// Wakes the waits at any change of the informers.
    changes: tokio::sync::broadcast::Receiver<()>,
    /// `+name` when a pod appeared, `-name` when it went, in order.
    log: Arc<Mutex<Vec<String>>>,
}

impl Env {
    async fn start() -> Result<Env> {
        let cluster = TestCluster::start().await?;
        let in_process = cluster.in_process();
        let admin = in_process.client(UserInfo::new("admin", ["system:masters"]));
        let manager = Manager {
            plugins: PluginHost::new(HostConfig {
                compilers: Compilers::Baseline,
                max_instances: 8,
                ..HostConfig::default()
            })?,
            informers: SharedInformers::new(),
            lister: in_process.client(identity::controller_manager()),
            queues: QueueMetrics::default(),
            running: Default::default(),
        };
        let (stop, stopped) = Shutdown::new();
        let mut running = Vec::new();
        for builtin in
            trellis_controllers::bundled::select("statefulset,garbage-collector,disruption")?
        {
            let writer = in_process.client(identity::controller(builtin.account()));
            let events = EventRecorder::new(writer.clone(), builtin.identity, "test");
            running.push(
                manager
                    .start(builtin.config(), writer, events, stopped.clone())
                    .await
                    .with_context(|| format!("start {}", builtin.name))?,
            );
        }
        let watching = SharedInformers::new();
        let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
        let sets =
            watching.informer::<StatefulSet>(Api::all(admin.clone()), watcher::Config::default());
        let claims = watching
            .informer::<PersistentVolumeClaim>(Api::all(admin.clone()), watcher::Config::default());
        let (tx, changes) = tokio::sync::broadcast::channel(4096);
        let log = Arc::new(Mutex::new(Vec::new()));
        {
            let (tx, log, mut rx) = (tx.clone(), log.clone(), pods.subscribe());
            tokio::spawn(async move {
                while let Some(change) = rx.recv().await {
                    let entry = match &change {
                        Change::Added(p) => Some(format!("+{}", name(p))),
                        Change::Deleted(p) => Some(format!("-{}", name(p))),
                        Change::Updated { .. } => None,
                    };
                    if let Some(e) = entry {
                        log.lock().unwrap_or_else(|e| e.into_inner()).push(e);
                    }
                    let _ = tx.send(());
                }
            });
        }
        {
            let (tx, mut rx) = (tx.clone(), sets.subscribe());
            tokio::spawn(async move {
                while rx.recv().await.is_some() {
                    let _ = tx.send(());
                }
            });
        }
        {
            let (tx, mut rx) = (tx.clone(), claims.subscribe());
            tokio::spawn(async move {
                while rx.recv().await.is_some() {
                    let _ = tx.send(());
                }
            });
        }
        pods.wait_synced().await;
        sets.wait_synced().await;
        claims.wait_synced().await;
        let kubelet = kubelet(pods.clone(), admin.clone());
        Ok(Env {
            cluster,
            admin,
            stop,
            running,
            kubelet,
            pods,
            sets,
            claims,
            changes,
            log,
        })
    }

    async fn stop(mut self) {
        let _ = self.kubelet.send(());
        self.stop.stop();
        for r in self.running.drain(..) {
            r.stop().await;
        }
    }

    /// Waits until `done` holds, looking again at every change.
    async fn until(&mut self, what: &str, mut done: impl FnMut(&Env) -> bool) -> Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if done(self) {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, self.changes.recv()).await {
                Err(_) => anyhow::bail!("{what}: not within 30 s"),
                Ok(Ok(()) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => {}
                Ok(Err(e)) => anyhow::bail!("the informers stopped: {e}"),
            }
        }
    }

    /// The names of the pods of set `set` in `ns`, in ordinal order.
    fn pods_of(&self, ns: &str, set: &str) -> Vec<String> {
        let mut names: Vec<(u32, String)> = self
            .pods
            .list()
            .iter()
            .filter(|p| p.metadata.namespace.as_deref() == Some(ns))
            .filter_map(|p| {
                let n = name(p);
                let ordinal = n.strip_prefix(&format!("{set}-"))?.parse().ok()?;
                Some((ordinal, n.to_owned()))
            })
            .collect();
        names.sort();
        names.into_iter().map(|(_, n)| n).collect()
    }

    fn pod(&self, ns: &str, name: &str) -> Option<Arc<Pod>> {
        self.pods.get(&format!("{ns}/{name}"))
    }

    fn status(&self, ns: &str, set: &str) -> serde_json::Value {
        self.sets
            .get(&format!("{ns}/{set}"))
            .map(|s| {
                let mut v = serde_json::to_value(&s.status).unwrap_or_default();
                v["generation"] = json!(s.metadata.generation);
                v
            })
            .unwrap_or_default()
    }

    /// Whether the controller has seen the set's latest spec.
    fn observed(&self, ns: &str, set: &str) -> bool {
        let s = self.status(ns, set);
        !s["generation"].is_null() && s["observedGeneration"] == s["generation"]
    }

    /// Sets the pod's readiness, as a failing or passing probe would.
    async fn set_ready(&self, ns: &str, name: &str, ready: bool) -> Result<()> {
        let api: Api<Pod> = Api::namespaced(self.admin.clone(), ns);
        api.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": if ready { "True" } else { "False" },
                 "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string()}]}})),
        )
        .await?;
        Ok(())
    }

    fn take_log(&self) -> Vec<String> {
        std::mem::take(&mut *self.log.lock().unwrap_or_else(|e| e.into_inner()))
    }

    async fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.cluster.kubectl_ok(args).await
    }

    /// `kubectl rollout status sts/NAME`'s output; on failure, what the set and its
    /// pods looked like.
    async fn rollout_status(&self, ns: &str, set: &str) -> Result<String> {
        let target = format!("sts/{set}");
        match self
            .kubectl(&["rollout", "status", &target, "-n", ns, "--timeout=30s"])
            .await
        {
            Ok(out) => Ok(out),
            Err(e) => {
                let seen = self
                    .kubectl(&["get", "sts,controllerrevisions", "-n", ns, "-o", "yaml"])
                    .await
                    .unwrap_or_default();
                Err(e.context(seen))
            }
        }
    }
}

fn name(p: &Pod) -> &str {
    p.metadata.name.as_deref().unwrap_or_default()
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The node's part: a new pod becomes Running and Ready (with an address); what the
/// tests make unready stays so until they say otherwise.
fn kubelet(pods: Arc<Informer<Pod>>, admin: kube::Client) -> tokio::sync::oneshot::Sender<()> {
    let mut changes = pods.subscribe();
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let next_ip = std::sync::atomic::AtomicU32::new(0);
    tokio::spawn(async move {
        loop {
            let change = tokio::select! {
                change = changes.recv() => change,
                _ = &mut stopped => return,
            };
            let Some(change) = change else { return };
            let pod = change.object();
            let running = pod
                .status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|p| p == "Running");
            if running
                || matches!(change, Change::Deleted(_))
                || pod.metadata.deletion_timestamp.is_some()
            {
                continue;
            }
            let api: Api<Pod> = Api::namespaced(
                admin.clone(),
                pod.metadata.namespace.as_deref().unwrap_or("default"),
            );
            let ip = next_ip.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let status = json!({"status": {"phase": "Running", "podIP": format!("10.244.123.{}", ip % 250 + 1),
                "conditions": [{"type": "Ready", "status": "True",
                    "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string()}]}});
            // A pod deleted meanwhile is no failure of the test.
            let _ = api
                .patch_status(name(pod), &PatchParams::default(), &Patch::Merge(status))
                .await;
        }
    });
    stop
}

fn set_yaml(ns: &str, name: &str, replicas: u32, policy: &str, extra: &str) -> String {
    format!(
        "apiVersion: apps/v1\nkind: StatefulSet\nmetadata:\n  name: {name}\n  namespace: {ns}\n\
         spec:\n  replicas: {replicas}\n  serviceName: test\n  podManagementPolicy: {policy}\n\
         \x20 selector:\n    matchLabels:\n      app: {name}\n{extra}\
         \x20 template:\n    metadata:\n      labels:\n        app: {name}\n\
         \x20   spec:\n      containers:\n      - name: web\n        image: nginx:1\n"
    )
}

/// "Scaling should happen in predictable order and halt if any stateful pod is
/// unhealthy" and "Burst scaling should run to completion even with unhealthy
/// pods", as Kubernetes' conformance tests them; `kubectl scale sts`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_is_ordered_and_halts_on_an_unhealthy_pod_and_burst_scaling_is_not() -> Result<()> {
    let mut env = Env::start().await?;
    env.kubectl(&["create", "namespace", "sts-order"]).await?;
    env.cluster
        .kubectl_ok_stdin(
            &["create", "-f", "-"],
            &set_yaml("sts-order", "ss", 1, "OrderedReady", ""),
        )
        .await?;
    env.until("ss-0 ready", |e| {
        e.pod("sts-order", "ss-0").is_some_and(|p| is_ready(&p))
    })
    .await?;

    // Scale up halts while ss-0 is unhealthy.
    env.set_ready("sts-order", "ss-0", false).await?;
    env.until("ss unready", |e| {
        e.status("sts-order", "ss")["readyReplicas"].is_null()
    })
    .await?;
    env.kubectl(&["scale", "sts", "ss", "-n", "sts-order", "--replicas=3"])
        .await?;
    env.until("the scale up seen", |e| e.observed("sts-order", "ss"))
        .await?;
    ensure!(
        env.pods_of("sts-order", "ss") == ["ss-0"],
        "scale up went on past an unhealthy ss-0: {:?}",
        env.pods_of("sts-order", "ss")
    );
    // Healthy again: the others come, in order.
    env.take_log();
    env.set_ready("sts-order", "ss-0", true).await?;
    env.until("3 ready replicas", |e| {
        e.status("sts-order", "ss")["readyReplicas"] == 3
    })
    .await?;
    let log = env.take_log();
    ensure!(log == ["+ss-1", "+ss-2"], "pods made out of order: {log:?}");

    // Scale down halts while the pods are unhealthy.
    for n in ["ss-0", "ss-1", "ss-2"] {
        env.set_ready("sts-order", n, false).await?;
    }
    env.until("ss unready", |e| {
        e.status("sts-order", "ss")["readyReplicas"].is_null()
    })
    .await?;
    env.kubectl(&["scale", "sts", "ss", "-n", "sts-order", "--replicas=0"])
        .await?;
    env.until("the scale down seen", |e| e.observed("sts-order", "ss"))
        .await?;
    ensure!(
        env.pods_of("sts-order", "ss").len() == 3,
        "scale down went on with unhealthy pods: {:?}",
        env.pods_of("sts-order", "ss")
    );
    // Each pod healthy again lets the next go: a pod may be gone before its turn.
    for n in ["ss-2", "ss-1", "ss-0"] {
        if let Err(e) = env.set_ready("sts-order", n, true).await
            && !e.to_string().contains("NotFound")
        {
            return Err(e);
        }
    }
    env.until("no pods", |e| e.pods_of("sts-order", "ss").is_empty())
        .await?;
    let log = env.take_log();
    ensure!(
        log == ["-ss-2", "-ss-1", "-ss-0"],
        "pods removed out of order: {log:?}"
    );

    // Parallel: unhealthy pods hold nothing up, either way.
    env.kubectl(&["create", "namespace", "sts-burst"]).await?;
    env.cluster
        .kubectl_ok_stdin(
            &["create", "-f", "-"],
            &set_yaml("sts-burst", "ss", 1, "Parallel", ""),
        )
        .await?;
    env.until("ss-0 ready", |e| {
        e.pod("sts-burst", "ss-0").is_some_and(|p| is_ready(&p))
    })
    .await?;
    env.set_ready("sts-burst", "ss-0", false).await?;
    env.kubectl(&["scale", "sts", "ss", "-n", "sts-burst", "--replicas=3"])
        .await?;
    env.until("3 pods", |e| e.pods_of("sts-burst", "ss").len() == 3)
        .await?;
    env.until("2 ready of 3", |e| {
        let s = e.status("sts-burst", "ss");
        s["replicas"] == 3 && s["readyReplicas"] == 2
    })
    .await?;
    // The disruption controller finds the set's scale: 3 pods expected, 2 healthy,
    // none to spare with one allowed unavailable.
    env.cluster
        .kubectl_ok_stdin(
            &["create", "-f", "-"],
            "apiVersion: policy/v1\nkind: PodDisruptionBudget\nmetadata:\n  name: ss\n\
             \x20 namespace: sts-burst\nspec:\n  maxUnavailable: 1\n  selector:\n\
             \x20   matchLabels:\n      app: ss\n",
        )
        .await?;
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(env.admin.clone(), "sts-burst");
    let expected = |b: Option<&PodDisruptionBudget>| {
        b.and_then(|b| b.status.as_ref())
            .is_some_and(|s| s.expected_pods == 3 && s.current_healthy == 2)
    };
    let budget = tokio::time::timeout(
        Duration::from_secs(30),
        kube::runtime::wait::await_condition(budgets.clone(), "ss", expected),
    )
    .await;
    let seen = budgets.get("ss").await?.status;
    ensure!(
        matches!(budget, Ok(Ok(_))),
        "the budget did not find the set's scale: {seen:?}"
    );
    ensure!(
        seen.as_ref()
            .is_some_and(|s| s.desired_healthy == 2 && s.disruptions_allowed == 0),
        "{seen:?}"
    );
    env.kubectl(&["scale", "sts", "ss", "-n", "sts-burst", "--replicas=0"])
        .await?;
    env.until("no pods", |e| e.pods_of("sts-burst", "ss").is_empty())
        .await?;
    env.stop().await;
    Ok(())
}

/// "should perform rolling updates and roll backs of template modifications",
/// through `kubectl rollout status|history|undo sts`; a partitioned rollout; claims
/// from `volumeClaimTemplates` kept across a pod's delete, and a scaled-down pod's
/// removed with it when `whenScaled` is Delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_updates_roll_back_and_partition_and_claims_outlive_their_pods() -> Result<()> {
    let mut env = Env::start().await?;
    let ns = "sts-roll";
    env.kubectl(&["create", "namespace", ns]).await?;
    let claims = "  volumeClaimTemplates:\n  - metadata:\n      name: www\n    spec:\n\
                  \x20     accessModes: [ReadWriteOnce]\n      resources:\n        requests:\n\
                  \x20         storage: 1Mi\n  persistentVolumeClaimRetentionPolicy:\n\
                  \x20   whenScaled: Delete\n";
    env.cluster
        .kubectl_ok_stdin(
            &["create", "-f", "-"],
            &set_yaml(ns, "web", 3, "OrderedReady", claims),
        )
        .await?;
    let out = env.rollout_status(ns, "web").await?;
    ensure!(
        // The API server defaults a partition of 0, which kubectl reports as a
        // partitioned roll out, as against Kubernetes.
        out.contains("partitioned roll out complete: 3 new pods have been updated"),
        "{out}"
    );
    let first = env.status(ns, "web")["currentRevision"]
        .as_str()
        .context("no current revision")?
        .to_owned();

    // Each pod mounts its own claim; a deleted pod comes back with the same one.
    let claim_of = |e: &Env, pod: &str| {
        e.pod(ns, pod).and_then(|p| {
            p.spec.as_ref()?.volumes.as_ref()?.iter().find_map(|v| {
                v.persistent_volume_claim
                    .as_ref()
                    .map(|c| c.claim_name.clone())
            })
        })
    };
    ensure!(claim_of(&env, "web-1").as_deref() == Some("www-web-1"));
    let uid = |e: &Env, pod: &str| e.pod(ns, pod).and_then(|p| p.metadata.uid.clone());
    let old_uid = uid(&env, "web-1");
    let claim_uid = env
        .claims
        .get(&format!("{ns}/www-web-1"))
        .and_then(|c| c.metadata.uid.clone())
        .context("no claim www-web-1")?;
    env.kubectl(&["delete", "pod", "web-1", "-n", ns]).await?;
    env.until("web-1 back and ready", |e| {
        e.pod(ns, "web-1")
            .is_some_and(|p| p.metadata.uid != old_uid && is_ready(&p))
    })
    .await?;
    ensure!(
        env.claims
            .get(&format!("{ns}/www-web-1"))
            .and_then(|c| c.metadata.uid.clone())
            == Some(claim_uid),
        "web-1's claim was not kept across the pod's delete"
    );
    ensure!(claim_of(&env, "web-1").as_deref() == Some("www-web-1"));

    // A new template rolls out from the highest ordinal down.
    env.take_log();
    env.kubectl(&["set", "image", "sts/web", "web=nginx:2", "-n", ns])
        .await?;
    let out = env.rollout_status(ns, "web").await?;
    ensure!(
        out.contains("partitioned roll out complete: 3 new pods have been updated"),
        "{out}"
    );
    let log: Vec<String> = env
        .take_log()
        .into_iter()
        .filter(|e| e.starts_with('-'))
        .collect();
    ensure!(
        log == ["-web-2", "-web-1", "-web-0"],
        "pods replaced out of order: {log:?}"
    );
    let second = env.status(ns, "web")["updateRevision"]
        .as_str()
        .context("no update revision")?
        .to_owned();
    ensure!(second != first && env.status(ns, "web")["currentRevision"] == second.as_str());
    for n in ["web-0", "web-1", "web-2"] {
        let image = env
            .pod(ns, n)
            .and_then(|p| p.spec.as_ref()?.containers.first()?.image.clone());
        ensure!(image.as_deref() == Some("nginx:2"), "{n}: {image:?}");
    }
    // Both revisions listed, by the current kubectl and by 1.20's, which also
    // reads the rollout's status.
    let old_kubectl = env.cluster.kubectl_1_20()?;
    for history in [
        env.kubectl(&["rollout", "history", "sts/web", "-n", ns])
            .await?,
        old_kubectl
            .ok(&["rollout", "history", "sts/web", "-n", ns])
            .await?,
    ] {
        ensure!(
            history
                .lines()
                .filter(|l| l.starts_with('1') || l.starts_with('2'))
                .count()
                == 2,
            "{history}"
        );
    }
    let out = old_kubectl
        .ok(&["rollout", "status", "sts/web", "-n", ns, "--timeout=30s"])
        .await?;
    ensure!(
        out.contains("partitioned roll out complete: 3 new pods have been updated"),
        "{out}"
    );

    // Rolled back: the first revision again, renumbered the newest.
    env.kubectl(&["rollout", "undo", "sts/web", "-n", ns])
        .await?;
    env.rollout_status(ns, "web").await?;
    let s = env.status(ns, "web");
    ensure!(
        s["currentRevision"] == first.as_str() && s["updateRevision"] == first.as_str(),
        "not rolled back to {first}: {s}"
    );
    let revisions: Api<ControllerRevision> = Api::namespaced(env.admin.clone(), ns);
    ensure!(revisions.get(&first).await?.revision == 3);
    for n in ["web-0", "web-1", "web-2"] {
        let image = env
            .pod(ns, n)
            .and_then(|p| p.spec.as_ref()?.containers.first()?.image.clone());
        ensure!(image.as_deref() == Some("nginx:1"), "{n}: {image:?}");
    }

    // A partition of 2: only web-2 takes the new template.
    env.kubectl(&[
        "patch",
        "sts",
        "web",
        "-n",
        ns,
        "-p",
        r#"{"spec": {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 2}},
            "template": {"spec": {"containers": [{"name": "web", "image": "nginx:3"}]}}}}"#,
    ])
    .await?;
    let out = env.rollout_status(ns, "web").await?;
    ensure!(
        out.contains("partitioned roll out complete: 1 new pods have been updated"),
        "{out}"
    );
    let images: Vec<Option<String>> = ["web-0", "web-1", "web-2"]
        .iter()
        .map(|n| {
            env.pod(ns, n)
                .and_then(|p| p.spec.as_ref()?.containers.first()?.image.clone())
        })
        .collect();
    ensure!(
        images
            == [
                Some("nginx:1".into()),
                Some("nginx:1".into()),
                Some("nginx:3".into())
            ],
        "{images:?}"
    );

    // Scaled down with whenScaled Delete: web-2's claim goes with it, the others stay.
    env.kubectl(&["scale", "sts", "web", "-n", ns, "--replicas=2"])
        .await?;
    env.until("www-web-2 gone with web-2", |e| {
        e.pod(ns, "web-2").is_none() && e.claims.get(&format!("{ns}/www-web-2")).is_none()
    })
    .await?;
    ensure!(env.claims.get(&format!("{ns}/www-web-1")).is_some());
    env.stop().await;
    Ok(())
}
