//! `trellis-controllers` against a real server: the `children` fixture (a controller
//! plugin built from `plugins/fixtures/children`) keeps a ConfigMap's children, read
//! from shared informers and written in one batch as the controller's own user, held to
//! the RBAC it is granted; a key whose reconcile traps is named and stops no other.
//! One server for the module.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::{ConfigMap, Event, Namespace};
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_api::UserInfo;
use trellis_client::events::EventRecorder;
use trellis_client::identity;
use trellis_client::informer::{BY_LABEL, SharedInformers};
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
    config.rate_limits = RateLimits {
        base_delay: Duration::from_millis(5),
        max_delay: Duration::from_millis(200),
        ..RateLimits::default()
    };
    let (stop, stopped) = tokio::sync::watch::channel(false);
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

    // A key whose reconcile traps: the failure names the plugin, the instance is
    // replaced, and other keys go on being reconciled.
    create(
        &api,
        json!({"metadata": {"name": "boom", "annotations": {"trellis.dev/panic": "on purpose"}}}),
    )
    .await?;
    let boom = ObjectKey {
        resource: configmaps(),
        namespace: Some("ctl".into()),
        name: "boom".into(),
    };
    tokio::time::timeout(Duration::from_secs(20), async {
        while cache.get("ctl/boom").is_none() {
            cached.recv().await.context("the informer stopped")?;
        }
        anyhow::Ok(())
    })
    .await
    .context("the controller's cache holds ctl/boom within 20 s")??;
    let trapped = running
        .plugin
        .reconcile(&plugins, &boom)
        .await
        .err()
        .context("a trapping reconcile succeeded")?
        .to_string();
    ensure!(
        trapped.contains("plugin children (controller") && trapped.contains("trapped"),
        "{trapped}"
    );
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

    let _ = stop.send(true);
    running.stop().await;
    Ok(())
}
