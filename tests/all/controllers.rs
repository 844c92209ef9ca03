//! `trellis-controllers` against a real server: the `children` fixture (a controller
//! plugin built from `plugins/fixtures/children`) keeps a ConfigMap's children, read
//! from shared informers and written in one batch as the controller's own user, held to
//! the RBAC it is granted; a key whose reconcile traps or spins is named and stops no
//! other.
//! One server for the module.

use std::sync::Arc;
use std::time::Duration;
use trellis_api::Shutdown;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::{ConfigMap, Event, Namespace, Pod};
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_api::UserInfo;
use trellis_client::events::EventRecorder;
use trellis_client::identity;
use trellis_client::informer::{BY_LABEL, Change, SharedInformers};
use trellis_client::workqueue::{QueueMetrics, RateLimits};
use trellis_controllers::{ControllerConfig, Manager};
use trellis_plugin_host::{Compilers, GroupVersionResource, HostConfig, ObjectKey, PluginHost};
use trellis_tests::{TestCluster, plugin_wasm};

fn configmaps() -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: "configmaps".into(),
    }
}

async fn create<K>(api: &Api<K>, value: serde_json::Value) -> Result<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    Ok(api
        .create(&PostParams::default(), &serde_json::from_value(value)?)
        .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_plugin_reconciles_from_informers_as_its_own_user() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let admin = cluster
        .in_process()
        .client(UserInfo::new("admin", ["system:masters"]));
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    for ns in ["ctl", "elsewhere"] {
        create(&namespaces, json!({"metadata": {"name": ns}})).await?;
    }
    // The controller may write ConfigMaps and Events in `ctl` only.
    let user = identity::controller("children").name;
    cluster
        .kubectl_ok_stdin(
            &["apply", "-f", "-"],
            &format!(
                r#"{{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "List", "items": [
                {{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                  "metadata": {{"name": "children", "namespace": "ctl"}},
                  "rules": [{{"apiGroups": [""], "resources": ["configmaps", "events"],
                              "verbs": ["create", "update", "patch", "delete"]}}]}},
                {{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                  "metadata": {{"name": "children", "namespace": "ctl"}},
                  "roleRef": {{"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "children"}},
                  "subjects": [{{"kind": "User", "name": "{user}"}}]}}]}}"#
            ),
        )
        .await
        .context("grant the controller its role")?;

    let plugins = PluginHost::new(HostConfig {
        compilers: Compilers::Baseline,
        max_instances: 16,
        ..HostConfig::default()
    })?;
    let manager = Manager {
        plugins: plugins.clone(),
        informers: SharedInformers::new(),
        lister: cluster.in_process().client(identity::controller_manager()),
        queues: QueueMetrics::default(),
        running: Default::default(),
    };
    let writer = cluster
        .in_process()
        .client(identity::controller("children"));
    let recorder = EventRecorder::new(writer.clone(), "children-controller", "test");
    let mut config = ControllerConfig::new(
        "children",
        Arc::new(std::fs::read(plugin_wasm("children")?)?),
        configmaps(),
    );
    config.owns = vec![configmaps()];
    // Short enough for the test to see a spinning reconcile stopped.
    config.spec.timeout = Duration::from_millis(500);
    config.rate_limits = RateLimits {
        base_delay: Duration::from_millis(5),
        max_delay: Duration::from_millis(200),
        ..RateLimits::default()
    };
    let (stop, stopped) = Shutdown::new();
    let running = manager
        .start(config, writer, recorder.clone(), stopped)
        .await
        .context("start the controller")?;

    // What the test watches: the children, through an informer of its own.
    let watching = SharedInformers::new();
    let maps = watching.informer::<ConfigMap>(
        Api::namespaced(admin.clone(), "ctl"),
        watcher::Config::default(),
    );
    maps.wait_synced().await;
    let mut changes = maps.subscribe();
    let children = || maps.by_index(BY_LABEL, "trellis.dev/parent=web");

    let api: Api<ConfigMap> = Api::namespaced(admin.clone(), "ctl");
    let parent = create(
        &api,
        json!({"metadata": {"name": "web", "annotations": {"trellis.dev/children": "3"}}}),
    )
    .await?;
    let uid = parent.metadata.uid.clone().context("no uid")?;
    tokio::time::timeout(Duration::from_secs(20), async {
        while children().len() < 3 {
            changes.recv().await.context("the informer stopped")?;
        }
        anyhow::Ok(())
    })
    .await
    .context("three children within 20 s")??;
    for child in children() {
        let owner = &child
            .metadata
            .owner_references
            .as_ref()
            .context("no owner")?[0];
        ensure!(
            owner.uid == uid && owner.controller == Some(true),
            "{owner:?}"
        );
    }

    // Fewer wanted: the extra children are deleted; an owned object's change maps to
    // its owner's key.
    api.patch(
        "web",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"trellis.dev/children": "1"}}})),
    )
    .await?;
    tokio::time::timeout(Duration::from_secs(20), async {
        while children().len() != 1 {
            changes.recv().await.context("the informer stopped")?;
        }
        anyhow::Ok(())
    })
    .await
    .context("one child left within 20 s")??;
    ensure!(children()[0].metadata.name.as_deref() == Some("web-0"));

    // The events it recorded (written after its writes, so waited for), as kubectl
    // shows them.
    let events = watching.informer::<Event>(
        Api::namespaced(admin.clone(), "ctl"),
        watcher::Config::default(),
    );
    let mut event_changes = events.subscribe();
    let reasons = || -> Vec<String> {
        events
            .list()
            .iter()
            .filter(|e| e.involved_object.name.as_deref() == Some("web"))
            .filter_map(|e| e.reason.clone())
            .collect()
    };
    tokio::time::timeout(Duration::from_secs(20), async {
        while !(reasons().iter().any(|r| r == "SuccessfulCreate")
            && reasons().iter().any(|r| r == "SuccessfulDelete"))
        {
            event_changes.recv().await.context("the informer stopped")?;
        }
        anyhow::Ok(())
    })
    .await
    .with_context(|| format!("both events within 20 s: {:?}", reasons()))??;
    let described = cluster
        .kubectl_ok(&["describe", "configmap", "web", "-n", "ctl"])
        .await?;
    ensure!(described.contains("Created 3 children"), "{described}");

    // Elsewhere it has no grant: its writes are refused as its own user, and the
    // refusal comes back to the plugin as the API server's Status.
    let other: Api<ConfigMap> = Api::namespaced(admin.clone(), "elsewhere");
    // The controller's own cache (the manager's shared informer of ConfigMaps).
    let cache = manager.informers.informer::<DynamicObject>(
        Api::all_with(
            manager.lister.clone(),
            &ApiResource::erase::<ConfigMap>(&()),
        ),
        watcher::Config::default(),
    );
    let mut cached = cache.subscribe();
    create(
        &other,
        json!({"metadata": {"name": "db", "annotations": {"trellis.dev/children": "2"}}}),
    )
    .await?;
    let key = ObjectKey {
        resource: configmaps(),
        namespace: Some("elsewhere".into()),
        name: "db".into(),
    };
    tokio::time::timeout(Duration::from_secs(20), async {
        while cache.get("elsewhere/db").is_none() {
            cached.recv().await.context("the informer stopped")?;
        }
        anyhow::Ok(())
    })
    .await
    .context("the controller's cache holds elsewhere/db within 20 s")??;
    let reason = running
        .plugin
        .reconcile(&plugins, &key)
        .await?
        .err()
        .context("a reconcile whose writes are forbidden succeeded")?;
    ensure!(reason.contains("403 Forbidden"), "{reason}");
    ensure!(
        reason.contains(&user) && reason.contains("configmaps"),
        "the refusal names the controller's user: {reason}"
    );
    ensure!(other.list(&ListParams::default()).await?.items.len() == 1);

    // A key whose reconcile traps, and one whose reconcile spins until its deadline:
    // each failure names the plugin, the instance is replaced, and other keys go on
    // being reconciled.
    for (name, annotation, failure) in [
        ("boom", "trellis.dev/panic", "trapped"),
        ("spin", "trellis.dev/loop", "timed out"),
    ] {
        create(
            &api,
            json!({"metadata": {"name": name, "annotations": {annotation: "on purpose"}}}),
        )
        .await?;
        tokio::time::timeout(Duration::from_secs(20), async {
            while cache.get(&format!("ctl/{name}")).is_none() {
                cached.recv().await.context("the informer stopped")?;
            }
            anyhow::Ok(())
        })
        .await
        .with_context(|| format!("the controller's cache holds ctl/{name} within 20 s"))??;
        let key = ObjectKey {
            resource: configmaps(),
            namespace: Some("ctl".into()),
            name: name.into(),
        };
        let failed = running
            .plugin
            .reconcile(&plugins, &key)
            .await
            .err()
            .with_context(|| format!("reconciling {name} succeeded"))?
            .to_string();
        ensure!(
            failed.contains("plugin children (controller") && failed.contains(failure),
            "{failed}"
        );
    }
    create(
        &api,
        json!({"metadata": {"name": "after", "annotations": {"trellis.dev/children": "1"}}}),
    )
    .await?;
    let after = || maps.by_index(BY_LABEL, "trellis.dev/parent=after");
    tokio::time::timeout(Duration::from_secs(20), async {
        while after().is_empty() {
            changes.recv().await.context("the informer stopped")?;
        }
        anyhow::Ok(())
    })
    .await
    .context("a child of `after` despite the trapping key, within 20 s")??;

    stop.stop();
    running.stop().await;
    Ok(())
}

/// Marks every pod Running and Ready as a kubelet would once its containers run:
/// what the workload controllers wait for. Ends with the returned sender.
fn fake_kubelet(
    informers: &SharedInformers,
    admin: kube::Client,
) -> tokio::sync::oneshot::Sender<()> {
    let pods = informers.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let mut changes = pods.subscribe();
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    // An address for each pod, as a node's network would give.
    let next_ip = std::sync::atomic::AtomicU32::new(0);
    tokio::spawn(async move {
        loop {
            let change = tokio::select! {
                change = changes.recv() => change,
                _ = &mut stopped => return,
            };
            let Some(change) = change else { return };
            let pod = change.object();
            let ready = pod
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            if ready
                || matches!(change, Change::Deleted(_))
                || pod.metadata.deletion_timestamp.is_some()
            {
                continue;
            }
            let api: Api<Pod> = Api::namespaced(
                admin.clone(),
                pod.metadata.namespace.as_deref().unwrap_or("default"),
            );
            let now = k8s_openapi::jiff::Timestamp::now().to_string();
            let ip = next_ip.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let status = json!({"status": {"phase": "Running", "podIP": format!("10.1.{}.{}", ip / 250, ip % 250 + 1),
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}});
            // A pod deleted meanwhile is no failure of the test.
            let _ = api
                .patch_status(
                    pod.metadata.name.as_deref().unwrap_or_default(),
                    &PatchParams::default(),
                    &Patch::Merge(status),
                )
                .await;
        }
    });
    stop
}

/// Starts every built-in controller, each as its own ServiceAccount, held to the
/// `system:controller:*` roles the API server bootstraps.
pub(super) async fn start_builtins(
    manager: &Manager,
    in_process: &trellis_client::InProcess,
    stopped: &Shutdown,
) -> Result<Vec<trellis_controllers::Running>> {
    let mut running = Vec::new();
    // The root CA publisher needs the cluster CA in its configuration; the
    // components' own tests run it.
    for builtin in trellis_controllers::bundled::BUILTINS
        .iter()
        .filter(|b| !b.needs_root_ca)
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
    Ok(running)
}

/// A controller manager over the in-process transport, its plugins on the baseline
/// compiler (no background optimization competing with the test).
fn test_manager(in_process: &trellis_client::InProcess, max_instances: u32) -> Result<Manager> {
    Ok(Manager {
        plugins: PluginHost::new(HostConfig {
            compilers: Compilers::Baseline,
            max_instances,
            ..HostConfig::default()
        })?,
        informers: SharedInformers::new(),
        lister: in_process.client(identity::controller_manager()),
        queues: QueueMetrics::default(),
        running: Default::default(),
    })
}

/// One channel that hears every change of several informers.
fn fan_in(sources: Vec<Box<dyn ChangeSource>>) -> tokio::sync::broadcast::Receiver<()> {
    let (tx, changes) = tokio::sync::broadcast::channel(1024);
    for mut rx in sources {
        let tx = tx.clone();
        tokio::spawn(async move {
            while rx.next().await {
                let _ = tx.send(());
            }
        });
    }
    changes
}

/// Waits until `done` holds, looking again at every change of the informers.
async fn until(
    changes: &mut tokio::sync::broadcast::Receiver<()>,
    what: &str,
    mut done: impl FnMut() -> Result<bool>,
) -> Result<()> {
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if done()? {
                return anyhow::Ok(());
            }
            match changes.recv().await {
                Ok(()) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => anyhow::bail!("the informers stopped: {e}"),
            }
        }
    })
    .await
    .with_context(|| format!("{what} within 30 s"))?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_built_in_workload_controllers_and_garbage_collector_behave_as_kubernetes() -> Result<()>
{
    use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};

    let cluster = TestCluster::start().await?;
    let in_process = cluster.in_process();
    let admin = in_process.client(UserInfo::new("admin", ["system:masters"]));
    let manager = test_manager(&in_process, 32)?;
    let (stop, stopped) = Shutdown::new();
    let mut running = start_builtins(&manager, &in_process, &stopped).await?;

    let watching = SharedInformers::new();
    let kubelet = fake_kubelet(&watching, admin.clone());
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let sets = watching.informer::<ReplicaSet>(Api::all(admin.clone()), watcher::Config::default());
    let deployments =
        watching.informer::<Deployment>(Api::all(admin.clone()), watcher::Config::default());
    let budgets = watching.informer::<k8s_openapi::api::policy::v1::PodDisruptionBudget>(
        Api::all(admin.clone()),
        watcher::Config::default(),
    );
    // Any change of these wakes the waits below.
    let mut changes = fan_in(vec![
        Box::new(pods.subscribe()) as Box<dyn ChangeSource>,
        Box::new(sets.subscribe()),
        Box::new(deployments.subscribe()),
        Box::new(budgets.subscribe()),
    ]);
    pods.wait_synced().await;
    sets.wait_synced().await;
    deployments.wait_synced().await;

    // A ReplicaSet alone: exactly its replicas, however many reconciles the pods'
    // own changes cause while the cache lags (the host's expectations).
    let rs_api: Api<ReplicaSet> = Api::namespaced(admin.clone(), "default");
    create(
        &rs_api,
        json!({"metadata": {"name": "many"}, "spec": {"replicas": 60,
            "selector": {"matchLabels": {"set": "many"}},
            "template": {"metadata": {"labels": {"set": "many"}},
                         "spec": {"containers": [{"name": "c", "image": "i"}]}}}}),
    )
    .await?;
    let of = |label: &str| {
        pods.list()
            .iter()
            .filter(|p| {
                p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("set"))
                    .map(String::as_str)
                    == Some(label)
            })
            .count()
    };
    until(&mut changes, "60 ready pods of ReplicaSet many", || {
        Ok(sets
            .get("default/many")
            .and_then(|rs| rs.status.clone())
            .is_some_and(|s| s.ready_replicas == Some(60) && s.available_replicas == Some(60)))
    })
    .await?;
    ensure!(of("many") == 60, "{} pods for 60 replicas", of("many"));
    // Scaled down: the surplus goes.
    rs_api
        .patch(
            "many",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 7}})),
        )
        .await?;
    until(&mut changes, "ReplicaSet many down to 7", || {
        Ok(of("many") == 7
            && sets
                .get("default/many")
                .and_then(|rs| rs.status.clone())
                .is_some_and(|s| s.replicas == 7))
    })
    .await?;
    // The disruption controller: 30 % of the set's 7 replicas may be unavailable,
    // rounded up to 3, so 4 must stay healthy and 3 may be disrupted.
    let budget_api: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
        Api::namespaced(admin.clone(), "default");
    create(
        &budget_api,
        json!({"metadata": {"name": "many"}, "spec": {"maxUnavailable": "30%",
            "selector": {"matchLabels": {"set": "many"}}}}),
    )
    .await?;
    let allowed = || {
        budgets
            .get("default/many")
            .and_then(|b| b.status.clone())
            .map(|s| {
                (
                    s.expected_pods,
                    s.desired_healthy,
                    s.current_healthy,
                    s.disruptions_allowed,
                )
            })
    };
    until(&mut changes, "the budget's status", || {
        Ok(allowed() == Some((7, 4, 7, 3)))
    })
    .await?;
    budget_api.delete("many", &Default::default()).await?;

    // An orphan that matches a new ReplicaSet's selector is adopted instead of a pod
    // being created; an owned pod relabelled away is released and replaced.
    let pod_api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    create(
        &pod_api,
        json!({"metadata": {"name": "stray", "labels": {"set": "adopter"}},
               "spec": {"containers": [{"name": "c", "image": "i"}]}}),
    )
    .await?;
    // The controller's own cache must hold the orphan before the set exists.
    let cache = manager.informers.informer::<DynamicObject>(
        Api::all_with(manager.lister.clone(), &ApiResource::erase::<Pod>(&())),
        watcher::Config::default(),
    );
    until(
        &mut changes,
        "the controller's cache holds the stray pod",
        || Ok(cache.get("default/stray").is_some()),
    )
    .await?;
    let adopter = create(
        &rs_api,
        json!({"metadata": {"name": "adopter"}, "spec": {"replicas": 1,
            "selector": {"matchLabels": {"set": "adopter"}},
            "template": {"metadata": {"labels": {"set": "adopter"}},
                         "spec": {"containers": [{"name": "c", "image": "i"}]}}}}),
    )
    .await?;
    let adopter_uid = adopter.metadata.uid.clone().context("no uid")?;
    let owned_by_adopter = |name: &str| {
        pods.get(&format!("default/{name}")).is_some_and(|p| {
            p.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.uid == adopter_uid && o.controller == Some(true))
        })
    };
    until(&mut changes, "the stray pod adopted", || {
        Ok(owned_by_adopter("stray")
            && sets
                .get("default/adopter")
                .and_then(|rs| rs.status.clone())
                .is_some_and(|s| s.ready_replicas == Some(1)))
    })
    .await?;
    ensure!(of("adopter") == 1, "{} pods for 1 replica", of("adopter"));
    pod_api
        .patch(
            "stray",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"set": "away"}}})),
        )
        .await?;
    until(
        &mut changes,
        "the relabelled pod released and replaced",
        || {
            let released = pods.get("default/stray").is_some_and(|p| {
                p.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .all(|o| o.uid != adopter_uid)
            });
            Ok(released && of("adopter") == 1)
        },
    )
    .await?;

    // A Deployment: a ReplicaSet named after its template's hash, pods owned by it.
    let d_api: Api<Deployment> = Api::namespaced(admin.clone(), "default");
    create(
        &d_api,
        json!({"metadata": {"name": "web"}, "spec": {"replicas": 4,
            "selector": {"matchLabels": {"set": "web"}},
            "template": {"metadata": {"labels": {"set": "web"}},
                         "spec": {"containers": [{"name": "c", "image": "v1"}]}}}}),
    )
    .await?;
    let complete = |image: &str| {
        let image = image.to_owned();
        let deployments = deployments.clone();
        let sets = sets.clone();
        move || -> Result<bool> {
            let Some(d) = deployments.get("default/web") else {
                return Ok(false);
            };
            let s = d.status.clone().unwrap_or_default();
            let current: Vec<_> = sets
                .list()
                .into_iter()
                .filter(|rs| {
                    rs.metadata
                        .name
                        .as_deref()
                        .is_some_and(|n| n.starts_with("web-"))
                        && rs.spec.as_ref().and_then(|s| s.replicas).unwrap_or(0) > 0
                })
                .collect();
            let images_ok = current.iter().all(|rs| {
                rs.spec
                    .as_ref()
                    .and_then(|s| s.template.as_ref())
                    .and_then(|t| t.spec.as_ref())
                    .is_some_and(|p| p.containers[0].image.as_deref() == Some(image.as_str()))
            });
            Ok(s.observed_generation == d.metadata.generation
                && s.updated_replicas == Some(4)
                && s.available_replicas == Some(4)
                && s.replicas == Some(4)
                && current.len() == 1
                && images_ok)
        }
    };
    until(&mut changes, "Deployment web rolled out", complete("v1")).await?;
    ensure!(of("web") == 4);
    let status = cluster
        .kubectl_ok(&["rollout", "status", "deployment/web", "--timeout=10s"])
        .await?;
    ensure!(status.contains("successfully rolled out"), "{status}");

    // A rolling update: the ReplicaSets never ask for more than 5 pods together
    // (replicas + maxSurge, 25 % of 4 rounded up). Pods being deleted may outlive
    // that for a moment, as in Kubernetes. The controllers are restarted midway, with
    // empty caches, as a process would be: the rollout resumes, with no pod or
    // ReplicaSet made twice.
    cluster
        .kubectl_ok(&["set", "image", "deployment/web", "c=v2"])
        .await?;
    until(&mut changes, "the rollout to v2 under way", || {
        Ok(sets.list().iter().any(|rs| {
            rs.spec.as_ref().is_some_and(|s| {
                s.replicas.unwrap_or(0) > 0
                    && s.template
                        .as_ref()
                        .and_then(|t| t.spec.as_ref())
                        .is_some_and(|p| p.containers[0].image.as_deref() == Some("v2"))
            })
        }))
    })
    .await?;
    for r in running.drain(..) {
        r.stop().await;
    }
    let manager = Manager {
        informers: SharedInformers::new(),
        ..manager
    };
    running = start_builtins(&manager, &in_process, &stopped).await?;
    let mut most = 0;
    until(&mut changes, "Deployment web rolled out to v2", || {
        let asked: i32 = sets
            .list()
            .iter()
            .filter(|rs| {
                rs.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with("web-"))
            })
            .filter_map(|rs| rs.spec.as_ref().and_then(|s| s.replicas))
            .sum();
        most = most.max(asked);
        complete("v2")()
    })
    .await?;
    ensure!(
        most <= 5,
        "the sets asked for {most} pods at once: more than replicas + maxSurge"
    );
    let web_sets = sets
        .list()
        .iter()
        .filter(|rs| {
            rs.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with("web-"))
        })
        .count();
    ensure!(web_sets == 2, "{web_sets} ReplicaSets for two templates");
    until(
        &mut changes,
        "exactly 4 pods of web once the old ones are gone",
        || Ok(of("web") == 4),
    )
    .await?;
    let history = cluster
        .kubectl_ok(&["rollout", "history", "deployment/web"])
        .await?;
    ensure!(history.contains('1') && history.contains('2'), "{history}");

    // Undo goes back to the first template, as revision 3.
    cluster
        .kubectl_ok(&["rollout", "undo", "deployment/web"])
        .await?;
    until(
        &mut changes,
        "Deployment web rolled back to v1",
        complete("v1"),
    )
    .await?;
    let d = deployments.get("default/web").context("web is gone")?;
    ensure!(
        d.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("deployment.kubernetes.io/revision"))
            .map(String::as_str)
            == Some("3"),
        "{:?}",
        d.metadata.annotations
    );
    let events = cluster
        .kubectl_ok(&[
            "get",
            "events",
            "--field-selector",
            "involvedObject.name=web",
        ])
        .await?;
    ensure!(
        events.contains("ScalingReplicaSet") && events.contains("Scaled up replica set web-"),
        "{events}"
    );

    // A Service selecting the Deployment's pods: its Endpoints list the four, ready,
    // with the named target port resolved.
    let services: Api<k8s_openapi::api::core::v1::Service> =
        Api::namespaced(admin.clone(), "default");
    create(
        &services,
        json!({"metadata": {"name": "web"}, "spec": {"selector": {"set": "web"},
               "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}),
    )
    .await?;
    let endpoints = watching.informer::<k8s_openapi::api::core::v1::Endpoints>(
        Api::all(admin.clone()),
        watcher::Config::default(),
    );
    let mut endpoint_changes = endpoints.subscribe();
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let ready = endpoints
                .get("default/web")
                .and_then(|e| e.subsets.clone())
                .map(|s| {
                    s.iter()
                        .filter(|s| s.ports.as_ref().is_some_and(|p| p[0].port == 8080))
                        .map(|s| s.addresses.as_ref().map_or(0, Vec::len))
                        .sum::<usize>()
                });
            if ready == Some(4) {
                return anyhow::Ok(());
            }
            endpoint_changes
                .recv()
                .await
                .context("the informer stopped")?;
        }
    })
    .await
    .context("Endpoints web with 4 ready addresses within 30 s")??;
    // And the same as an EndpointSlice, labelled with the Service's name.
    let slices = watching.informer::<k8s_openapi::api::discovery::v1::EndpointSlice>(
        Api::all(admin.clone()),
        watcher::Config::default(),
    );
    let mut slice_changes = slices.subscribe();
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let ready: usize = slices
                .by_index(BY_LABEL, "kubernetes.io/service-name=web")
                .iter()
                .map(|s| {
                    s.endpoints
                        .iter()
                        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
                        .count()
                })
                .sum();
            if ready == 4 {
                return anyhow::Ok(());
            }
            slice_changes.recv().await.context("the informer stopped")?;
        }
    })
    .await
    .context("EndpointSlices of web with 4 ready endpoints within 30 s")??;

    // The garbage collector. An object whose only owner never existed goes; one
    // with a live owner beside the missing one only loses the dangling reference.
    let cm_api: Api<ConfigMap> = Api::namespaced(admin.clone(), "default");
    let keeper = create(&cm_api, json!({"metadata": {"name": "keeper"}})).await?;
    let ghost = json!({"apiVersion": "v1", "kind": "ConfigMap", "name": "ghost",
                       "uid": "00000000-0000-0000-0000-000000000000"});
    let live = json!({"apiVersion": "v1", "kind": "ConfigMap", "name": "keeper",
                      "uid": keeper.metadata.uid.clone().context("no uid")?});
    create(
        &cm_api,
        json!({"metadata": {"name": "dangling", "ownerReferences": [ghost]}}),
    )
    .await?;
    create(
        &cm_api,
        json!({"metadata": {"name": "half", "ownerReferences": [ghost, live]}}),
    )
    .await?;
    let maps = watching.informer::<ConfigMap>(Api::all(admin.clone()), watcher::Config::default());
    let mut map_changes = maps.subscribe();
    // Alone this takes under a second; with the whole suite on two cores the garbage
    // collector (which caches every resource) once needed more than 30 s.
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let half_refs = maps
                .get("default/half")
                .and_then(|m| m.metadata.owner_references.clone())
                .map(|r| r.len());
            if maps.has_synced() && maps.get("default/dangling").is_none() && half_refs == Some(1) {
                return anyhow::Ok(());
            }
            map_changes.recv().await.context("the informer stopped")?;
        }
    })
    .await
    .context(
        "the dangling ConfigMap collected and half's dangling reference removed within 60 s",
    )??;

    // Orphan: the ReplicaSet goes, its pods stay, owned by nothing.
    let many_uid = sets
        .get("default/many")
        .and_then(|rs| rs.metadata.uid.clone())
        .context("no uid")?;
    cluster
        .kubectl_ok(&["delete", "replicaset", "many", "--cascade=orphan"])
        .await?;
    until(
        &mut changes,
        "ReplicaSet many gone, its 7 pods orphaned",
        || {
            let orphaned = pods
                .list()
                .iter()
                .filter(|p| {
                    p.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get("set"))
                        .map(String::as_str)
                        == Some("many")
                })
                .all(|p| {
                    p.metadata
                        .owner_references
                        .iter()
                        .flatten()
                        .all(|o| o.uid != many_uid)
                });
            Ok(sets.get("default/many").is_none() && orphaned && of("many") == 7)
        },
    )
    .await?;
    // Background (kubectl's default): the ReplicaSet goes at once, its pods after.
    cluster
        .kubectl_ok(&["delete", "replicaset", "adopter"])
        .await?;
    until(&mut changes, "ReplicaSet adopter and its pod gone", || {
        Ok(sets.get("default/adopter").is_none() && of("adopter") == 0)
    })
    .await?;
    // Foreground: kubectl waits until the Deployment is gone, and it goes last.
    cluster
        .kubectl_ok(&[
            "delete",
            "deployment",
            "web",
            "--cascade=foreground",
            "--timeout=20s",
        ])
        .await?;
    let live_sets = rs_api
        .list(&ListParams::default().labels("set=web"))
        .await?;
    let live_pods = pod_api
        .list(&ListParams::default().labels("set=web"))
        .await?;
    ensure!(
        live_sets.items.is_empty() && live_pods.items.is_empty(),
        "after a foreground deletion: {} ReplicaSets and {} pods left",
        live_sets.items.len(),
        live_pods.items.len()
    );

    let _ = kubelet.send(());
    stop.stop();
    for r in running {
        r.stop().await;
    }
    Ok(())
}

/// The replication manager (the ReplicaSet controller's component configured for
/// `v1` ReplicationControllers) and the garbage collector, driven by kubectl: the
/// selector and labels defaulted from the template, an orphan adopted, `kubectl
/// scale rc` up and down, `get` and `describe`, and a cascading delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_controllers_are_served_scaled_and_deleted_as_kubernetes() -> Result<()> {
    use k8s_openapi::api::core::v1::ReplicationController;

    let cluster = TestCluster::start().await?;
    let in_process = cluster.in_process();
    let admin = in_process.client(UserInfo::new("admin", ["system:masters"]));
    let manager = test_manager(&in_process, 8)?;
    let (stop, stopped) = Shutdown::new();
    let mut running = Vec::new();
    for builtin in trellis_controllers::bundled::select("replicationcontroller,garbage-collector")?
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
    let kubelet = fake_kubelet(&watching, admin.clone());
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let rcs = watching
        .informer::<ReplicationController>(Api::all(admin.clone()), watcher::Config::default());
    let mut changes = fan_in(vec![
        Box::new(pods.subscribe()) as Box<dyn ChangeSource>,
        Box::new(rcs.subscribe()),
    ]);
    pods.wait_synced().await;
    rcs.wait_synced().await;

    // An orphan with the template's labels, in the controller's cache before the
    // controller exists: it is adopted instead of a third pod being made.
    let pod_api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    create(
        &pod_api,
        json!({"metadata": {"name": "rc-stray", "labels": {"app": "rcweb"}},
               "spec": {"containers": [{"name": "c", "image": "i"}]}}),
    )
    .await?;
    let cache = manager.informers.informer::<DynamicObject>(
        Api::all_with(manager.lister.clone(), &ApiResource::erase::<Pod>(&())),
        watcher::Config::default(),
    );
    until(
        &mut changes,
        "the controller's cache holds rc-stray",
        || Ok(cache.get("default/rc-stray").is_some()),
    )
    .await?;

    // No selector and no labels: both come from the template's labels.
    cluster
        .kubectl_ok_stdin(
            &["create", "-f", "-"],
            "apiVersion: v1\nkind: ReplicationController\nmetadata:\n  name: rcweb\n\
             spec:\n  replicas: 3\n  template:\n    metadata:\n      labels:\n        app: rcweb\n\
             \x20   spec:\n      containers:\n      - name: web\n        image: nginx\n",
        )
        .await?;
    let rc_api: Api<ReplicationController> = Api::namespaced(admin.clone(), "default");
    let rc = rc_api.get("rcweb").await?;
    let want = std::collections::BTreeMap::from([("app".to_owned(), "rcweb".to_owned())]);
    let spec = rc.spec.clone().context("no spec")?;
    ensure!(
        spec.selector.as_ref() == Some(&want) && rc.metadata.labels.as_ref() == Some(&want),
        "selector {:?} and labels {:?} not defaulted from the template",
        spec.selector,
        rc.metadata.labels
    );
    // Its scale names the selector (a plain map read as matchLabels), as an
    // autoscaler reads it.
    let scale = cluster
        .kubectl_ok(&[
            "get",
            "--raw",
            "/api/v1/namespaces/default/replicationcontrollers/rcweb/scale",
        ])
        .await?;
    let scale: serde_json::Value = serde_json::from_str(&scale)?;
    ensure!(
        scale["status"]["selector"] == "app=rcweb",
        "the scale's selector: {scale}"
    );
    let uid = rc.metadata.uid.clone().context("no uid")?;
    // Live pods owned by the controller, as `v1` ReplicationController.
    let owned = || {
        pods.list()
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| {
                p.metadata.owner_references.iter().flatten().any(|o| {
                    o.uid == uid
                        && o.controller == Some(true)
                        && o.kind == "ReplicationController"
                        && o.api_version == "v1"
                })
            })
            .map(|p| p.metadata.name.clone().unwrap_or_default())
            .collect::<Vec<_>>()
    };
    let settled = |n: i32| {
        rcs.get("default/rcweb")
            .and_then(|rc| rc.status.clone())
            .is_some_and(|s| s.replicas == n && s.ready_replicas == Some(n))
    };
    until(
        &mut changes,
        "3 ready pods of rcweb, rc-stray adopted",
        || {
            let owned = owned();
            Ok(settled(3) && owned.len() == 3 && owned.iter().any(|n| n == "rc-stray"))
        },
    )
    .await?;

    for n in [5, 1] {
        cluster
            .kubectl_ok(&["scale", "rc", "rcweb", &format!("--replicas={n}")])
            .await?;
        until(&mut changes, &format!("rcweb scaled to {n}"), || {
            Ok(settled(n) && owned().len() == n as usize)
        })
        .await?;
    }

    let table = cluster
        .kubectl_ok(&["get", "rc", "rcweb", "-o", "wide"])
        .await?;
    let header: Vec<&str> = table
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    ensure!(
        header
            == [
                "NAME",
                "DESIRED",
                "CURRENT",
                "READY",
                "AGE",
                "CONTAINERS",
                "IMAGES",
                "SELECTOR"
            ],
        "kubectl get rc -o wide:\n{table}"
    );
    let row: Vec<&str> = table
        .lines()
        .nth(1)
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    ensure!(
        row.len() == 8
            && row[..4] == ["rcweb", "1", "1", "1"]
            && row[5..] == ["web", "nginx", "app=rcweb"],
        "kubectl get rc -o wide:\n{table}"
    );
    let all = cluster.kubectl_ok(&["get", "all"]).await?;
    ensure!(
        all.contains("replicationcontroller/rcweb"),
        "kubectl get all:\n{all}"
    );
    let described = cluster.kubectl_ok(&["describe", "rc", "rcweb"]).await?;
    ensure!(
        described.contains("app=rcweb")
            && described.contains("1 current / 1 desired")
            && described.contains("SuccessfulDelete"),
        "kubectl describe rc:\n{described}"
    );

    // Background deletion: the controller goes at once, the garbage collector takes
    // its pods.
    cluster.kubectl_ok(&["delete", "rc", "rcweb"]).await?;
    until(&mut changes, "rcweb and its pods gone", || {
        Ok(rcs.get("default/rcweb").is_none()
            && !pods.list().iter().any(|p| {
                p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("app"))
                    .map(String::as_str)
                    == Some("rcweb")
            }))
    })
    .await?;

    let _ = kubelet.send(());
    stop.stop();
    for r in running.drain(..) {
        r.stop().await;
    }
    Ok(())
}

/// Issue 27: a Plugin named after a built-in controller stopped the built-in before
/// it loaded, so one whose module could not load left ReplicaSets with no controller,
/// and deleting it never started the built-in again (until another controller
/// manager took the lease); the built-in's entry read `Loaded=True` all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_replacing_a_built_in_runs_only_once_loaded_and_gives_it_back_when_deleted()
-> Result<()> {
    use k8s_openapi::api::apps::v1::ReplicaSet;
    use trellis::components::Component;
    use trellis::setup::{ControllerSetup, Credentials, Shared};

    let cluster = TestCluster::start().await?;
    let in_process = cluster.in_process();
    let admin = in_process.client(UserInfo::new("admin", ["system:masters"]));
    let plugin_api: Api<DynamicObject> =
        Api::all_with(admin.clone(), &trellis_plugins::object::plugins_resource());
    // The built-in's entry, as the API server of `trellis up` creates it.
    for entry in trellis::plugin_controllers::builtin_entries()
        .into_iter()
        .filter(|e| e["metadata"]["name"] == "replicaset-controller")
    {
        plugin_api
            .create(&PostParams::default(), &serde_json::from_value(entry)?)
            .await?;
    }

    // The controller manager of `trellis up` (no leader election), with the ReplicaSet
    // controller as its only built-in.
    let dir = tempfile::tempdir()?;
    let mut shared = Shared::new();
    shared.controllers = Some(ControllerSetup {
        plugins: PluginHost::new(HostConfig {
            compilers: Compilers::Baseline,
            ..HostConfig::default()
        })?,
        credentials: Credentials::InProcess(in_process.clone()),
        builtins: trellis_controllers::bundled::select("replicaset")?,
        modules_dir: dir.path().join("modules"),
        running: Default::default(),
        root_ca: None,
        node_monitor_grace_period: 50,
        plugin_status_interval: Duration::from_secs(10),
        node_ipam: Default::default(),
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let controller_manager = tokio::spawn(trellis::components::run(
        Component::Controllers,
        in_process.client(identity::controller_manager()),
        shared,
        None,
        async move {
            let _ = stopped.await;
        },
    ));

    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let plugins = watching.informer::<DynamicObject>(
        Api::all_with(admin.clone(), &trellis_plugins::object::plugins_resource()),
        watcher::Config::default(),
    );
    let events = watching.informer::<Event>(Api::all(admin.clone()), watcher::Config::default());
    let mut changes = fan_in(vec![
        Box::new(pods.subscribe()) as Box<dyn ChangeSource>,
        Box::new(plugins.subscribe()),
        Box::new(events.subscribe()),
    ]);
    // Live pods of the set.
    let web = || -> Vec<Arc<Pod>> {
        pods.list()
            .into_iter()
            .filter(|p| {
                p.metadata.deletion_timestamp.is_none()
                    && p.metadata
                        .labels
                        .as_ref()
                        .is_some_and(|l| l.get("app").map(String::as_str) == Some("web"))
            })
            .collect()
    };
    // The pods of the set a controller created, as its events tell.
    let made_by = |controller: &str| {
        events
            .list()
            .iter()
            .filter(|e| {
                e.reason.as_deref() == Some("SuccessfulCreate")
                    && e.involved_object.name.as_deref() == Some("web")
                    && e.source.as_ref().and_then(|s| s.component.as_deref()) == Some(controller)
            })
            .count()
    };
    // A Plugin's `Loaded` condition: status, reason and message.
    let loaded = |name: &str| {
        plugins.get(name).and_then(|p| {
            let conditions = p.data["status"]["conditions"].as_array()?.clone();
            let c = conditions.into_iter().find(|c| c["type"] == "Loaded")?;
            Some((
                c["status"].as_str()?.to_owned(),
                c["reason"].as_str()?.to_owned(),
                c["message"].as_str().unwrap_or_default().to_owned(),
            ))
        })
    };
    let is = |name: &str, status: &str, reason: &str| {
        loaded(name).is_some_and(|(s, r, _)| s == status && r == reason)
    };
    let rs_api: Api<ReplicaSet> = Api::namespaced(admin.clone(), "default");
    let scale = |replicas: i32| {
        let rs_api = rs_api.clone();
        async move {
            rs_api
                .patch(
                    "web",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"replicas": replicas}})),
                )
                .await
        }
    };
    create(
        &rs_api,
        json!({"metadata": {"name": "web"}, "spec": {"replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}},
                         "spec": {"containers": [{"name": "c", "image": "i"}]}}}}),
    )
    .await?;
    until(
        &mut changes,
        "2 pods from the built-in, its entry Builtin",
        || Ok(web().len() == 2 && is("replicaset-controller", "True", "Builtin")),
    )
    .await?;

    // A replacement whose module is not a component: it cannot load, so the built-in
    // keeps the ReplicaSets, and the Plugin says so.
    let garbage = dir.path().join("garbage.wasm");
    std::fs::write(&garbage, b"not a component")?;
    let replacement = |url: String| -> Result<DynamicObject> {
        Ok(serde_json::from_value(json!({
        "apiVersion": "trellis.dev/v1", "kind": "Plugin",
        "metadata": {"name": "replicaset"},
        "spec": {"kind": "controller", "module": {"url": url},
            "controller": {
                "for": {"group": "apps", "version": "v1", "resource": "replicasets"},
                "owns": [{"version": "v1", "resource": "pods"}],
                "rules": [
                    {"apiGroups": ["apps"], "resources": ["replicasets/status"], "verbs": ["update", "patch"]},
                    {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete", "patch"]},
                ]}}}))?)
    };
    plugin_api
        .create(
            &PostParams::default(),
            &replacement(format!("file://{}", garbage.display()))?,
        )
        .await?;
    until(&mut changes, "the broken replacement LoadFailed", || {
        Ok(is("replicaset", "False", "LoadFailed"))
    })
    .await?;
    let (_, _, message) = loaded("replicaset").context("no Loaded condition")?;
    ensure!(
        message.contains("the built-in controller replicaset-controller keeps running"),
        "{message}"
    );
    scale(4).await?;
    until(
        &mut changes,
        "4 pods while the replacement cannot load",
        || Ok(web().len() == 4),
    )
    .await?;
    ensure!(
        is("replicaset-controller", "True", "Builtin"),
        "the built-in's entry: {:?}",
        loaded("replicaset-controller")
    );
    plugin_api.delete("replicaset", &Default::default()).await?;
    scale(1).await?;
    until(
        &mut changes,
        "1 pod once the broken replacement is gone",
        || Ok(web().len() == 1),
    )
    .await?;

    // A replacement that loads runs in the built-in's place, and its entry says so;
    // deleted, the built-in runs again at once.
    let stood_in = made_by("replicaset");
    ensure!(stood_in == 0, "{stood_in} pods made by the replacement");
    plugin_api
        .create(
            &PostParams::default(),
            &replacement("builtin:replicaset".to_owned())?,
        )
        .await?;
    until(
        &mut changes,
        "the replacement Loaded, the built-in Replaced",
        || {
            Ok(is("replicaset", "True", "Loaded")
                && is("replicaset-controller", "False", "Replaced"))
        },
    )
    .await?;
    scale(3).await?;
    until(&mut changes, "3 pods, 2 made by the replacement", || {
        Ok(web().len() == 3 && made_by("replicaset") == 2)
    })
    .await?;
    let before = made_by("replicaset-controller");
    plugin_api.delete("replicaset", &Default::default()).await?;
    until(&mut changes, "the built-in's entry Builtin again", || {
        Ok(is("replicaset-controller", "True", "Builtin"))
    })
    .await?;
    scale(5).await?;
    until(&mut changes, "5 pods, 2 more made by the built-in", || {
        Ok(web().len() == 5 && made_by("replicaset-controller") == before + 2)
    })
    .await?;

    let _ = stop.send(());
    controller_manager.await??;
    Ok(())
}

/// The change streams of informers of different kinds, as one interface.
#[async_trait::async_trait]
trait ChangeSource: Send {
    /// Whether a change came (false: the informer is gone).
    async fn next(&mut self) -> bool;
}

#[async_trait::async_trait]
impl<K: Send + Sync + 'static> ChangeSource for tokio::sync::mpsc::UnboundedReceiver<Change<K>> {
    async fn next(&mut self) -> bool {
        self.recv().await.is_some()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_lease_lapses_is_tainted_and_its_pods_evicted_as_they_tolerate() -> Result<()>
{
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::core::v1::Node;

    let cluster = TestCluster::start().await?;
    let in_process = cluster.in_process();
    let admin = in_process.client(UserInfo::new("admin", ["system:masters"]));
    let manager = test_manager(&in_process, 8)?;
    let builtin = trellis_controllers::bundled::select("nodelifecycle")?[0];
    let mut config = builtin.config();
    // A grace period of 1 s instead of 50, looked at every second.
    config.spec.configuration = json!({"gracePeriodSeconds": 1, "recheckSeconds": 1}).to_string();
    let writer = in_process.client(identity::controller(builtin.identity));
    let events = EventRecorder::new(writer.clone(), builtin.identity, "test");
    let (stop, stopped) = Shutdown::new();
    let running = manager.start(config, writer, events, stopped).await?;

    let now = || {
        k8s_openapi::jiff::Timestamp::now()
            .strftime("%Y-%m-%dT%H:%M:%SZ")
            .to_string()
    };
    let nodes: Api<Node> = Api::all(admin.clone());
    create(&nodes, json!({"metadata": {"name": "n1"}})).await?;
    let ready = json!({"status": {"conditions": [{"type": "Ready", "status": "True",
        "reason": "KubeletReady", "lastHeartbeatTime": now(), "lastTransitionTime": now()}]}});
    nodes
        .patch_status("n1", &PatchParams::default(), &Patch::Merge(ready.clone()))
        .await?;
    let leases: Api<Lease> = Api::namespaced(admin.clone(), "kube-node-lease");
    let renew = || {
        json!({"metadata": {"name": "n1"}, "spec": {"holderIdentity": "n1",
            "leaseDurationSeconds": 40,
            "renewTime": k8s_openapi::jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S.%6fZ").to_string()}})
    };
    create(&leases, renew()).await?;
    let pod_api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let unreachable = "node.kubernetes.io/unreachable";
    for (name, tolerations) in [
        (
            "zero",
            json!([{"key": unreachable, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 0}]),
        ),
        (
            "short",
            json!([{"key": unreachable, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 3}]),
        ),
        (
            "forever",
            json!([{"key": unreachable, "operator": "Exists", "effect": "NoExecute"}]),
        ),
        // The DefaultTolerationSeconds admission gives it 300 s.
        ("plain", json!(null)),
    ] {
        create(
            &pod_api,
            json!({"metadata": {"name": name}, "spec": {"nodeName": "n1", "tolerations": tolerations,
                   "containers": [{"name": "c", "image": "i"}]}}),
        )
        .await?;
    }
    // Evicted pods are told in their own namespace (issue 27: the events named the
    // node, in `default`).
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    create(&namespaces, json!({"metadata": {"name": "tenant"}})).await?;
    create(
        &Api::<Pod>::namespaced(admin.clone(), "tenant"),
        json!({"metadata": {"name": "elsewhere"}, "spec": {"nodeName": "n1",
               "tolerations": [{"key": unreachable, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 0}],
               "containers": [{"name": "c", "image": "i"}]}}),
    )
    .await?;
    let plain = pod_api.get("plain").await?;
    ensure!(
        plain
            .spec
            .as_ref()
            .and_then(|s| s.tolerations.as_ref())
            .is_some_and(|t| t.iter().any(
                |t| t.key.as_deref() == Some(unreachable) && t.toleration_seconds == Some(300)
            )),
        "no default toleration: {:?}",
        plain.spec.map(|s| s.tolerations)
    );

    let watching = SharedInformers::new();
    let node_cache = watching.informer::<Node>(Api::all(admin.clone()), watcher::Config::default());
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let events = watching.informer::<Event>(Api::all(admin.clone()), watcher::Config::default());
    let mut changes = fan_in(vec![
        Box::new(node_cache.subscribe()) as Box<dyn ChangeSource>,
        Box::new(pods.subscribe()),
        Box::new(events.subscribe()),
    ]);
    let node_ready = || {
        node_cache
            .get("n1")
            .and_then(|n| n.status.clone())
            .and_then(|s| s.conditions)
            .and_then(|c| c.into_iter().find(|c| c.type_ == "Ready"))
            .map(|c| c.status)
    };
    let tainted = |key: &str| {
        node_cache.get("n1").is_some_and(|n| {
            n.spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.key == key && t.effect == "NoExecute"))
        })
    };
    let pod = |name: &str| pods.get(&format!("default/{name}"));
    // Evicted: deleted gracefully, so Terminating until an agent stops it (none runs
    // here), as pods of an unreachable node stay in Kubernetes.
    let evicted = |name: &str| pod(name).is_none_or(|p| p.metadata.deletion_timestamp.is_some());

    // Unheard for 1 s: Unknown, tainted, the intolerant pod evicted at once, the others
    // not ready.
    until(
        &mut changes,
        "n1 Ready=Unknown, tainted, pod zero evicted",
        || {
            Ok(node_ready().as_deref() == Some("Unknown")
                && tainted(unreachable)
                && evicted("zero"))
        },
    )
    .await?;
    ensure!(!evicted("short"), "pod short evicted before its 2 s");
    // Each eviction is an event on its pod, as Kubernetes' taint manager records it,
    // where `kubectl describe pod` finds it (by the pod's uid too).
    let evictions = || -> Vec<[String; 6]> {
        events
            .list()
            .iter()
            .filter(|e| e.reason.as_deref() == Some("TaintManagerEviction"))
            .map(|e| {
                let o = &e.involved_object;
                [
                    e.metadata.namespace.clone(),
                    o.kind.clone(),
                    o.namespace.clone(),
                    o.name.clone(),
                    o.uid.clone(),
                    e.message.clone(),
                ]
                .map(Option::unwrap_or_default)
            })
            .collect()
    };
    let told = |namespace: &str, name: &str| {
        let uid = pods
            .get(&format!("{namespace}/{name}"))
            .and_then(|p| p.metadata.uid.clone())
            .unwrap_or_default();
        evictions().contains(&[
            namespace.to_owned(),
            "Pod".to_owned(),
            namespace.to_owned(),
            name.to_owned(),
            uid,
            format!("Marking for deletion Pod {namespace}/{name}"),
        ])
    };
    until(
        &mut changes,
        "TaintManagerEviction events on pods default/zero and tenant/elsewhere",
        || Ok(told("default", "zero") && told("tenant", "elsewhere")),
    )
    .await
    .with_context(|| format!("the evictions told: {:?}", evictions()))?;
    let described = cluster
        .kubectl_ok(&["describe", "pod", "elsewhere", "--namespace", "tenant"])
        .await?;
    ensure!(
        described.contains("TaintManagerEviction"),
        "kubectl describe pod shows no eviction: {described}"
    );
    until(&mut changes, "pod short evicted after its 2 s", || {
        Ok(evicted("short"))
    })
    .await?;
    for name in ["forever", "plain"] {
        ensure!(!evicted(name), "pod {name} was evicted");
        let p = pod(name).with_context(|| format!("pod {name} is gone"))?;
        let ready = p
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
            .map(|c| c.status.clone());
        ensure!(
            ready.as_deref() == Some("False"),
            "pod {name} Ready {ready:?}"
        );
    }

    // Heard from again: Ready, untainted.
    leases
        .replace("n1", &PostParams::default(), &{
            let mut lease: Lease = serde_json::from_value(renew())?;
            lease.metadata.resource_version = leases.get("n1").await?.metadata.resource_version;
            lease
        })
        .await?;
    let ready = json!({"status": {"conditions": [{"type": "Ready", "status": "True",
        "reason": "KubeletReady", "lastHeartbeatTime": now(), "lastTransitionTime": now()}]}});
    nodes
        .patch_status("n1", &PatchParams::default(), &Patch::Merge(ready))
        .await?;
    until(&mut changes, "n1 untainted once Ready again", || {
        Ok(node_ready().as_deref() == Some("True") && !tainted(unreachable))
    })
    .await?;

    stop.stop();
    running.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_namespace_controller_empties_a_namespace_waits_for_finalizers_and_resumes()
-> Result<()> {
    // The server's own namespace deletion off: the plugin does it all.
    let cluster = TestCluster::builder()
        .without_namespace_controller()
        .start()
        .await?;
    let in_process = cluster.in_process();
    let admin = in_process.client(UserInfo::new("admin", ["system:masters"]));
    let manager = test_manager(&in_process, 8)?;
    let builtin = trellis_controllers::bundled::select("namespace")?[0];
    let start = |manager: Manager, stopped| {
        let writer = in_process.client(identity::controller(builtin.identity));
        let events = EventRecorder::new(writer.clone(), builtin.identity, "test");
        async move {
            manager
                .start(builtin.config(), writer, events, stopped)
                .await
        }
    };
    let (stop, stopped) = Shutdown::new();
    let running = start(manager.clone(), stopped.clone()).await?;

    let namespaces: Api<Namespace> = Api::all(admin.clone());
    create(&namespaces, json!({"metadata": {"name": "doomed"}})).await?;
    let maps: Api<ConfigMap> = Api::namespaced(admin.clone(), "doomed");
    for i in 0..3 {
        create(&maps, json!({"metadata": {"name": format!("cm-{i}")}})).await?;
    }
    create(
        &maps,
        json!({"metadata": {"name": "held", "finalizers": ["example.com/hold"]}}),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "doomed");
    create(
        &pods,
        json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}),
    )
    .await?;

    let watching = SharedInformers::new();
    let ns_cache =
        watching.informer::<Namespace>(Api::all(admin.clone()), watcher::Config::default());
    let map_cache = watching.informer::<ConfigMap>(maps.clone(), watcher::Config::default());
    let pod_cache = watching.informer::<Pod>(pods.clone(), watcher::Config::default());
    ns_cache.wait_synced().await;
    let mut changes = fan_in(vec![
        Box::new(ns_cache.subscribe()) as Box<dyn ChangeSource>,
        Box::new(map_cache.subscribe()),
        Box::new(pod_cache.subscribe()),
    ]);
    let condition = |kind: &str| {
        ns_cache
            .get("doomed")
            .and_then(|n| n.status.clone())
            .and_then(|s| s.conditions)
            .and_then(|c| c.into_iter().find(|c| c.type_ == kind))
            .map(|c| (c.status, c.message.unwrap_or_default()))
    };

    cluster
        .kubectl_ok(&["delete", "namespace", "doomed", "--wait=false"])
        .await?;
    until(
        &mut changes,
        "doomed emptied but for the held ConfigMap",
        || {
            let finalizers = condition("NamespaceFinalizersRemaining");
            Ok(map_cache.len() == 1
                && map_cache.get("doomed/held").is_some()
                && pod_cache.is_empty()
                && finalizers.is_some_and(|(s, m)| s == "True" && m.contains("example.com/hold")))
        },
    )
    .await?;
    ensure!(
        ns_cache.get("doomed").is_some(),
        "removed while an object waits"
    );

    // The controller restarts with empty caches; the held object lets go; the
    // namespace goes.
    running.stop().await;
    let manager = Manager {
        informers: SharedInformers::new(),
        ..manager
    };
    let running = start(manager, stopped).await?;
    maps.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await?;
    until(&mut changes, "doomed removed", || {
        Ok(ns_cache.get("doomed").is_none())
    })
    .await?;

    stop.stop();
    running.stop().await;
    Ok(())
}

/// The ResourceQuota controller keeps a quota's status by itself: the server runs
/// without its own quota step, as if it had stopped after each write and before its
/// recount. Usage is counted, written wrong by hand and put right, and lowered after
/// a delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resourcequota_controller_puts_usage_left_wrong_right() -> Result<()> {
    use k8s_openapi::api::core::v1::ResourceQuota;

    let mut chains = trellis_apiserver::admission::builtin();
    chains
        .admission
        .retain(|step| step.name() != trellis_apiserver::admission::chain::RESOURCE_QUOTA);
    let cluster = TestCluster::builder().with_chains(chains).start().await?;
    let in_process = cluster.in_process();
    let admin = in_process.client(UserInfo::new("admin", ["system:masters"]));
    let manager = test_manager(&in_process, 8)?;
    let builtin = trellis_controllers::bundled::select("resourcequota")?[0];
    let writer = in_process.client(identity::controller(builtin.identity));
    let events = EventRecorder::new(writer.clone(), builtin.identity, "test");
    let (stop, stopped) = Shutdown::new();
    let running = manager
        .start(builtin.config(), writer, events, stopped)
        .await?;

    let namespaces: Api<Namespace> = Api::all(admin.clone());
    create(&namespaces, json!({"metadata": {"name": "quota"}})).await?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "quota");
    for i in 0..3 {
        create(
            &pods,
            json!({"metadata": {"name": format!("p{i}")},
                   "spec": {"containers": [{"name": "c", "image": "i"}]}}),
        )
        .await?;
    }
    let maps: Api<ConfigMap> = Api::namespaced(admin.clone(), "quota");
    for i in 0..2 {
        create(&maps, json!({"metadata": {"name": format!("cm-{i}")}})).await?;
    }
    // After what it counts, so that its first count is the whole one: the controller
    // leaves a status it wrote itself alone for a second before writing it again.
    let quota_api: Api<ResourceQuota> = Api::namespaced(admin.clone(), "quota");
    create(
        &quota_api,
        json!({"metadata": {"name": "q"}, "spec": {"hard": {"pods": "10", "count/configmaps": "5"}}}),
    )
    .await?;

    let watching = SharedInformers::new();
    let quotas = watching.informer::<ResourceQuota>(quota_api.clone(), watcher::Config::default());
    let mut changes = fan_in(vec![Box::new(quotas.subscribe()) as Box<dyn ChangeSource>]);
    let used = |name: &str| {
        quotas
            .get("quota/q")
            .and_then(|q| q.status.clone()?.used?.get(name).map(|q| q.0.clone()))
    };
    // The version of the quota the informer shows: a wait for the controller's
    // answer to a write looks past that write.
    let version = || {
        quotas
            .get("quota/q")
            .and_then(|q| q.metadata.resource_version.clone()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    until(&mut changes, "3 pods and 2 ConfigMaps counted", || {
        Ok(
            used("pods").as_deref() == Some("3")
                && used("count/configmaps").as_deref() == Some("2"),
        )
    })
    .await?;

    // Written wrong by hand: put right.
    let wrong = quota_api
        .patch_status(
            "q",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"used": {"pods": "7"}}})),
        )
        .await?;
    let wrong_version: u64 = wrong
        .metadata
        .resource_version
        .context("no resourceVersion")?
        .parse()?;
    until(&mut changes, "pods put back to 3", || {
        Ok(version() > wrong_version && used("pods").as_deref() == Some("3"))
    })
    .await?;

    // A delete no recount followed: the usage comes down (a second after the
    // controller's last write at most).
    pods.delete("p0", &Default::default()).await?;
    until(&mut changes, "pods down to 2", || {
        Ok(
            used("pods").as_deref() == Some("2")
                && used("count/configmaps").as_deref() == Some("2"),
        )
    })
    .await?;

    stop.stop();
    running.stop().await;
    Ok(())
}

/// The node IPAM controller, as `trellis up` runs it (its own plugin, as the
/// `node-controller` account): Nodes that register at once get distinct ranges, and a
/// deleted Node's range goes to the next new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_get_distinct_pod_cidrs_and_a_deleted_nodes_range_is_given_again() -> Result<()> {
    use k8s_openapi::api::core::v1::Node;

    let cluster = TestCluster::start().await?;
    let in_process = cluster.in_process();
    let admin = in_process.client(UserInfo::new("admin", ["system:masters"]));
    let manager = test_manager(&in_process, 4)?;
    let builtin = trellis_controllers::bundled::select("nodeipam")?[0];
    let writer = in_process.client(identity::controller(builtin.account()));
    let events = EventRecorder::new(writer.clone(), builtin.identity, "test");
    let (stop, stopped) = Shutdown::new();
    let running = manager
        .start(builtin.config(), writer, events, stopped)
        .await?;

    let nodes: Api<Node> = Api::all(admin.clone());
    let pod_cidr = |node: &Node| node.spec.as_ref().and_then(|s| s.pod_cidr.clone());
    // Waits, on a watch of each Node, until every one of `names` has a podCIDR; their
    // podCIDRs.
    let allocated = |names: Vec<&'static str>| {
        let nodes = nodes.clone();
        async move {
            let mut cidrs = Vec::new();
            for name in names {
                let given = |node: Option<&Node>| node.and_then(pod_cidr).is_some();
                let node = tokio::time::timeout(
                    Duration::from_secs(30),
                    kube::runtime::wait::await_condition(nodes.clone(), name, given),
                )
                .await
                .with_context(|| format!("{name} given a podCIDR within 30 s"))??
                .with_context(|| format!("{name} deleted"))?;
                let cidr = pod_cidr(&node).context("podCIDR")?;
                let listed = node.spec.as_ref().and_then(|s| s.pod_cidrs.clone());
                ensure!(listed == Some(vec![cidr.clone()]), "{node:?}");
                cidrs.push(cidr);
            }
            Ok::<_, anyhow::Error>(cidrs)
        }
    };

    for name in ["n1", "n2", "n3"] {
        create(&nodes, json!({"metadata": {"name": name}})).await?;
    }
    let mut cidrs = allocated(vec!["n1", "n2", "n3"]).await?;
    cidrs.sort();
    ensure!(
        cidrs == ["10.42.0.0/24", "10.42.1.0/24", "10.42.2.0/24"],
        "{cidrs:?}"
    );

    let freed = pod_cidr(&nodes.get("n2").await?).context("n2's podCIDR")?;
    nodes
        .delete("n2", &kube::api::DeleteParams::default())
        .await?;
    tokio::time::timeout(
        Duration::from_secs(30),
        kube::runtime::wait::await_condition(nodes.clone(), "n2", |n: Option<&Node>| n.is_none()),
    )
    .await
    .context("n2 gone within 30 s")??;
    // The controller's informer sees n2 go before n4 come (a watch is in revision
    // order), so n4's reconcile finds the range free.
    create(&nodes, json!({"metadata": {"name": "n4"}})).await?;
    let n4 = allocated(vec!["n4"]).await?;
    ensure!(n4 == [freed.clone()], "n4 got {n4:?}, not n2's {freed}");

    stop.stop();
    running.stop().await;
    Ok(())
}
