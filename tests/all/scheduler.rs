//! The scheduler (`trellis-scheduler`) with the bundled default plugins, a WASM
//! component, against a real server: pods are bound to the node the plugins choose
//! and told so in a `Scheduled` event; a pod no node fits gets kube-scheduler's
//! FitError in a `FailedScheduling` event and its PodScheduled condition, and is
//! scheduled once a node it fits joins; pods for another scheduler are left alone; a
//! pod of higher priority preempts the fewest, lowest pods of a node and is bound there;
//! preemption spares the pod a PodDisruptionBudget protects when another node will
//! do; pods of a group wait at Permit (the gang example) until the group is complete, or
//! are given up when the wait runs out. One server for the module.

use std::sync::Arc;
use std::time::Duration;
use trellis_api::Shutdown;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_api::UserInfo;
use trellis_client::events::EventRecorder;
use trellis_client::identity;
use trellis_client::informer::SharedInformers;
use trellis_plugin_host::{Compilers, HostConfig, PluginHost, PluginKind, PluginSpec};
use trellis_scheduler::{Component, QueueSettings, SchedulerConfig};
use trellis_tests::TestCluster;

async fn create<K>(api: &Api<K>, value: serde_json::Value) -> Result<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let obj: K = serde_json::from_value(value)?;
    Ok(api.create(&PostParams::default(), &obj).await?)
}

fn node(name: &str, cpu: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut node = json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {"allocatable": {"cpu": cpu, "memory": "8Gi", "pods": "110"},
                   "capacity": {"cpu": cpu, "memory": "8Gi", "pods": "110"}},
    });
    if let Some(spec) = extra.get("spec") {
        node["spec"] = spec.clone();
    }
    node
}

fn pod(name: &str, cpu: &str) -> serde_json::Value {
    json!({"metadata": {"name": name}, "spec": {"containers": [{"name": "c", "image": "i",
        "resources": {"requests": {"cpu": cpu}}}]}})
}

/// The bundled default plugins, loaded as the scheduler loads them, as a component
/// of a profile.
pub(super) async fn default_plugins(host: &Arc<PluginHost>) -> Result<Component> {
    let mut spec = PluginSpec::new("default-plugins", PluginKind::Scheduler);
    spec.timeout = Duration::from_secs(2);
    spec.memory_limit = 256 << 20;
    let plugin = host
        .load(
            spec,
            Arc::new(trellis_scheduler::DEFAULT_PLUGINS.to_vec()),
            None,
        )
        .await?;
    Ok(component(plugin))
}

/// A loaded plugin as a component with no configuration, weights or failures ignored.
fn component(plugin: Arc<trellis_plugin_host::Plugin>) -> Component {
    Component {
        plugin,
        configuration: "{}".into(),
        weights: Default::default(),
        ignore_failures: false,
    }
}

/// The scheduler over the in-process transport, as its own user, with `components`
/// in the default profile and back-offs short enough for tests; it runs until
/// `stopped`.
pub(super) fn spawn(
    in_process: &trellis_client::InProcess,
    host: Arc<PluginHost>,
    components: Vec<Component>,
    stopped: Shutdown,
) -> tokio::task::JoinHandle<Result<()>> {
    let config = SchedulerConfig {
        profiles: vec![(trellis_scheduler::DEFAULT_SCHEDULER.to_owned(), components)],
        defaults: Vec::new(),
        percentage_of_nodes_to_score: 0,
        queue: QueueSettings {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(400),
            unschedulable_timeout: Duration::from_secs(300),
        },
    };
    let client = in_process.client(identity::scheduler());
    let events = EventRecorder::new(client.clone(), trellis_scheduler::DEFAULT_SCHEDULER, "test");
    tokio::spawn(trellis_scheduler::run(
        config,
        trellis_scheduler::Parts {
            host,
            client,
            informers: SharedInformers::new(),
            events,
            metrics: Default::default(),
        },
        tokio::sync::mpsc::unbounded_channel().1,
        stopped,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_binds_by_the_default_plugins_and_explains_what_does_not_fit() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let in_process = cluster.in_process();
    let admin = in_process.client(UserInfo::new("admin", ["system:masters"]));
    let nodes: Api<Node> = Api::all(admin.clone());
    create(&nodes, node("n1", "2", json!({}))).await?;
    create(
        &nodes,
        node(
            "n2",
            "4",
            json!({"spec": {"taints": [{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}]}}),
        ),
    )
    .await?;
    create(
        &nodes,
        node("n3", "8", json!({"spec": {"unschedulable": true}})),
    )
    .await?;

    let host = PluginHost::new(HostConfig {
        compilers: Compilers::Baseline,
        ..HostConfig::default()
    })?;
    let plugin = default_plugins(&host).await?;
    // The gang example (co-scheduling at Permit) beside them.
    let gang = host
        .load(
            PluginSpec::new("gang", PluginKind::Scheduler),
            Arc::new(std::fs::read(trellis_tests::plugin_wasm("gang")?)?),
            None,
        )
        .await?;
    let (stop, stopped) = Shutdown::new();
    let scheduler = spawn(
        &in_process,
        host,
        vec![
            plugin,
            Component {
                configuration: r#"{"waitSeconds": 2}"#.into(),
                ..component(gang)
            },
        ],
        stopped,
    );

    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let event_cache =
        watching.informer::<Event>(Api::all(admin.clone()), watcher::Config::default());
    let mut pod_changes = pods.subscribe();
    let mut event_changes = event_cache.subscribe();
    let node_of = |name: &str| {
        pods.get(&format!("default/{name}"))
            .and_then(|p| p.spec.as_ref().and_then(|s| s.node_name.clone()))
    };
    let event = |name: &str, reason: &str| {
        event_cache
            .list()
            .into_iter()
            .find(|e| {
                e.involved_object.name.as_deref() == Some(name)
                    && e.reason.as_deref() == Some(reason)
            })
            .and_then(|e| e.message.clone())
    };
    // Waits for a change of pods or events after which `done` holds.
    macro_rules! until {
        ($what:expr, $done:expr) => {
            tokio::time::timeout(Duration::from_secs(20), async {
                loop {
                    if $done {
                        break;
                    }
                    tokio::select! {
                        Some(_) = pod_changes.recv() => {}
                        Some(_) = event_changes.recv() => {}
                    }
                }
            })
            .await
            .with_context(|| format!("{} within 20 s", $what))?
        };
    }

    let pod_api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let mut other = pod("elsewhere", "100m");
    other["spec"]["schedulerName"] = json!("another-scheduler");
    create(&pod_api, other).await?;
    // Only n1 fits: n2's taint is not tolerated and n3 is cordoned.
    create(&pod_api, pod("small", "1")).await?;
    until!("small bound", node_of("small").is_some());
    ensure!(
        node_of("small").as_deref() == Some("n1"),
        "small on {:?}",
        node_of("small")
    );
    until!("its Scheduled event", event("small", "Scheduled").is_some());
    ensure!(
        event("small", "Scheduled").as_deref() == Some("Successfully assigned default/small to n1"),
        "{:?}",
        event("small", "Scheduled")
    );

    // Now nothing fits 2 CPUs: n1 has 1 left.
    create(&pod_api, pod("big", "2")).await?;
    // As kube-scheduler words it, preemption's part included (its two periods too):
    // nothing of lower priority runs on n1, and a taint or a cordon is not resolved
    // by preempting.
    let fit_error = "0/3 nodes are available: 1 Insufficient cpu, 1 node(s) had untolerated taint {dedicated: gpu}, 1 node(s) were unschedulable. preemption: 0/3 nodes are available: 1 No preemption victims found for incoming pod., 2 Preemption is not helpful for scheduling..";
    until!(
        "big's FailedScheduling",
        event("big", "FailedScheduling").is_some()
    );
    ensure!(
        event("big", "FailedScheduling").as_deref() == Some(fit_error),
        "{:?}",
        event("big", "FailedScheduling")
    );
    let scheduled_condition = || {
        pods.get("default/big").and_then(|p| {
            p.status
                .as_ref()?
                .conditions
                .as_ref()?
                .iter()
                .find(|c| c.type_ == "PodScheduled")
                .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
        })
    };
    until!("big's PodScheduled=False", scheduled_condition().is_some());
    ensure!(
        scheduled_condition()
            == Some((
                "False".into(),
                Some("Unschedulable".into()),
                Some(fit_error.into())
            )),
        "{:?}",
        scheduled_condition()
    );

    // A node it fits joins: the node's arrival moves it back, and it is bound there.
    create(&nodes, node("n4", "4", json!({}))).await?;
    until!("big bound", node_of("big").is_some());
    ensure!(
        node_of("big").as_deref() == Some("n4"),
        "big on {:?}",
        node_of("big")
    );
    ensure!(
        node_of("elsewhere").is_none(),
        "a pod for another scheduler was bound"
    );
    // Preemption: n1 has 1 CPU left and n4 none; a pod of priority 1,000 asking
    // for 2 fits n1 once `small` (priority 0, 1 CPU) is gone: the fewest and
    // lowest victims. It is nominated there, `small` is told and deleted, and the
    // pod is bound to n1.
    // Priorities come from PriorityClasses, through the Priority admission; a pod
    // that names none has 0.
    let classes: Api<PriorityClass> = Api::all(admin.clone());
    create(
        &classes,
        json!({"metadata": {"name": "important"}, "value": 1000}),
    )
    .await?;
    create(&pod_api, pod("low", "2")).await?;
    until!("low bound", node_of("low").is_some());
    ensure!(
        node_of("low").as_deref() == Some("n4"),
        "low on {:?}",
        node_of("low")
    );
    let mut high = pod("high", "2");
    high["spec"]["priorityClassName"] = json!("important");
    let created: Pod = create(&pod_api, high).await?;
    ensure!(
        created.spec.as_ref().and_then(|s| s.priority) == Some(1000),
        "the Priority admission did not set the pod's priority"
    );
    let mut lost = pod("lost", "1");
    lost["spec"]["priorityClassName"] = json!("missing");
    let refused = create(&pod_api, lost).await.err().map(|e| e.to_string());
    ensure!(
        refused
            .as_deref()
            .is_some_and(|e| e.contains("no PriorityClass with name missing was found")),
        "{refused:?}"
    );
    // The victim is deleted gracefully: Terminating until its node's agent has stopped
    // it. No agent runs here, so the test finishes the deletion as one would.
    until!(
        format!("small preempted ({:?})", event("high", "FailedScheduling")),
        pods.get("default/small")
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some())
    );
    let _ = pod_api
        .delete(
            "small",
            &kube::api::DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            },
        )
        .await;
    until!("its Preempted event", event("small", "Preempted").is_some());
    until!("high bound", node_of("high").is_some());
    ensure!(
        node_of("high").as_deref() == Some("n1"),
        "high on {:?}",
        node_of("high")
    );
    ensure!(
        pods.get("default/high")
            .and_then(|p| p.status.as_ref()?.nominated_node_name.clone())
            .is_none_or(|n| n == "n1"),
        "nominated elsewhere"
    );
    ensure!(
        node_of("low").as_deref() == Some("n4"),
        "low was preempted too"
    );

    // Preemption and PodDisruptionBudgets: two equal candidates, the first one's
    // victim protected by a budget that allows no disruption; the other is chosen.
    let budgets: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
        Api::namespaced(admin.clone(), "default");
    create(
        &budgets,
        json!({"metadata": {"name": "guard"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"guarded": "yes"}}}}),
    )
    .await?;
    budgets
        .patch_status(
            "guard",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"status": {"disruptionsAllowed": 0,
                "currentHealthy": 1, "desiredHealthy": 1, "expectedPods": 1}})),
        )
        .await?;
    for name in ["n6", "n7"] {
        let mut n = node(name, "1", json!({}));
        n["metadata"]["labels"]["pdb-test"] = json!("yes");
        create(&nodes, n).await?;
    }
    let mut guarded = pod("guarded", "1");
    guarded["metadata"]["labels"] = json!({"guarded": "yes"});
    guarded["spec"]["nodeName"] = json!("n6");
    create(&pod_api, guarded).await?;
    let mut unguarded = pod("unguarded", "1");
    unguarded["spec"]["nodeName"] = json!("n7");
    create(&pod_api, unguarded).await?;
    let mut urgent = pod("urgent", "1");
    urgent["spec"]["priorityClassName"] = json!("important");
    urgent["spec"]["nodeSelector"] = json!({"pdb-test": "yes"});
    create(&pod_api, urgent).await?;
    until!(
        "unguarded preempted",
        pods.get("default/unguarded")
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some())
    );
    let _ = pod_api
        .delete(
            "unguarded",
            &kube::api::DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            },
        )
        .await;
    until!("urgent bound", node_of("urgent").is_some());
    ensure!(
        node_of("urgent").as_deref() == Some("n7"),
        "urgent on {:?}",
        node_of("urgent")
    );
    ensure!(
        pods.get("default/guarded")
            .is_some_and(|p| p.metadata.deletion_timestamp.is_none()),
        "the pod its budget protects was preempted"
    );

    // Permit's wait (the gang example): two of a group of three hold their nodes
    // unbound while a later pod outside the group is bound; the third completes
    // the group and all three are bound.
    create(&nodes, node("n5", "8", json!({}))).await?;
    let member = |name: &str, group: &str, min: &str| {
        let mut p = pod(name, "100m");
        p["metadata"]["labels"] = json!({"pod-group.trellis.dev/name": group,
            "pod-group.trellis.dev/min-member": min});
        p
    };
    create(&pod_api, member("trio-a", "trio", "3")).await?;
    create(&pod_api, member("trio-b", "trio", "3")).await?;
    create(&pod_api, pod("after-two", "100m")).await?;
    until!("after-two bound", node_of("after-two").is_some());
    ensure!(
        node_of("trio-a").is_none() && node_of("trio-b").is_none(),
        "a member of an incomplete group was bound"
    );
    create(&pod_api, member("trio-c", "trio", "3")).await?;
    until!(
        "the whole group bound",
        ["trio-a", "trio-b", "trio-c"]
            .iter()
            .all(|n| node_of(n).is_some())
    );
    // A group that never completes: its pod is given up when the wait runs out.
    create(&pod_api, member("lone", "pair", "2")).await?;
    until!("lone given up", event("lone", "FailedScheduling").is_some());
    let message = event("lone", "FailedScheduling").unwrap_or_default();
    ensure!(
        message.contains("rejected due to timeout after waiting 2s at plugin gang"),
        "{message}"
    );
    ensure!(node_of("lone").is_none(), "lone was bound");

    stop.stop();
    scheduler.await??;
    Ok(())
}
