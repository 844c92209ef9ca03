//! `trellis-client` against a real server: kube-rs drives every verb over both
//! transports, components are held to their roles, informers are shared, one of
//! several candidates leads, and events are aggregated and limited.
//! One server for the module; each part works in a namespace of its own.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use trellis_api::UserInfo;
use trellis_client::identity;
use trellis_client::informer::{self, Change, SharedInformers};
use trellis_tests::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_rs_against_trellis() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let remote = cluster.kube_admin().await?;
    let in_process = cluster
        .in_process()
        .client(UserInfo::new("admin", ["system:masters"]));
    verbs(&remote, "kube-remote")
        .await
        .context("the verbs, remote")?;
    verbs(&in_process, "kube-in-process")
        .await
        .context("the verbs, in-process")?;
    identities(&cluster).await.context("identities")?;
    shared_informers(&cluster, &in_process)
        .await
        .context("shared informers")?;
    leader_election(&cluster).await.context("leader election")?;
    events(&cluster, &in_process).await.context("events")?;
    Ok(())
}

async fn namespace(client: &kube::Client, name: &str) -> Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    namespaces.create(&PostParams::default(), &ns).await?;
    Ok(())
}

fn deployment(name: &str) -> Result<Deployment> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "web", "image": "web:1"}]}
            }
        }
    }))?)
}

/// Create, get, list by label, the three patch types, server-side apply, the status
/// subresource and delete, through `client`.
async fn verbs(client: &kube::Client, ns: &str) -> Result<()> {
    namespace(client, ns).await?;
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "one", "labels": {"tier": "a"}}, "data": {"k": "v"}
    }))?;
    let created = maps.create(&PostParams::default(), &cm).await?;
    ensure!(created.metadata.uid.is_some() && created.metadata.resource_version.is_some());
    let listed = maps.list(&ListParams::default().labels("tier=a")).await?;
    ensure!(listed.items.len() == 1, "{:?}", listed.items);
    ensure!(
        maps.list(&ListParams::default().labels("tier=b"))
            .await?
            .items
            .is_empty()
    );
    let merged = maps
        .patch(
            "one",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"m": "1"}})),
        )
        .await?;
    ensure!(
        merged
            .data
            .as_ref()
            .and_then(|d| d.get("m"))
            .map(String::as_str)
            == Some("1")
    );

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    deployments
        .create(&PostParams::default(), &deployment("web")?)
        .await?;
    // A strategic merge patch merges containers by name; a new one goes first, as
    // Kubernetes orders it.
    let patched = deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"template": {"spec": {"containers": [
                {"name": "sidecar", "image": "side:1"}
            ]}}}})),
        )
        .await?;
    let containers = patched
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|s| {
            s.containers
                .iter()
                .map(|c| c.name.clone())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    ensure!(containers == ["sidecar", "web"], "{containers:?}");
    // Server-side apply takes `replicas` from its creator by force; another manager's
    // apply then conflicts.
    let apply = PatchParams::apply("tests-apply").force();
    let applied = deployments
        .patch(
            "web",
            &apply,
            &Patch::Apply(json!({
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "web"}, "spec": {"replicas": 3}
            })),
        )
        .await?;
    ensure!(applied.spec.as_ref().and_then(|s| s.replicas) == Some(3));
    let conflict = deployments
        .patch(
            "web",
            &PatchParams::apply("someone-else"),
            &Patch::Apply(json!({
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "web"}, "spec": {"replicas": 5}
            })),
        )
        .await;
    ensure!(
        matches!(&conflict, Err(kube::Error::Api(s)) if s.code == 409),
        "{conflict:?}"
    );
    // The status subresource changes status only.
    let status = deployments
        .patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"observedGeneration": 7, "replicas": 2},
                                 "spec": {"replicas": 9}})),
        )
        .await?;
    ensure!(status.status.as_ref().and_then(|s| s.replicas) == Some(2));
    ensure!(status.spec.as_ref().and_then(|s| s.replicas) == Some(3));

    maps.delete("one", &DeleteParams::default()).await?;
    let gone = maps.get_opt("one").await?;
    ensure!(gone.is_none(), "{gone:?}");
    Ok(())
}

/// In-process components are held to their roles; a remote request cannot claim an
/// identity by headers.
async fn identities(cluster: &TestCluster) -> Result<()> {
    let scheduler = cluster.in_process().client(identity::scheduler());
    let pods: Api<Pod> = Api::namespaced(scheduler.clone(), "default");
    pods.list(&ListParams::default())
        .await
        .context("the scheduler lists pods")?;
    let maps: Api<ConfigMap> = Api::namespaced(scheduler, "default");
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "nope"}}))?;
    let denied = maps.create(&PostParams::default(), &cm).await;
    ensure!(
        matches!(&denied, Err(kube::Error::Api(s)) if s.code == 403
            && s.message.contains("system:kube-scheduler")),
        "{denied:?}"
    );
    let node = cluster.in_process().client(identity::node("n1"));
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(node, "default");
    let denied = secrets.list(&ListParams::default()).await;
    ensure!(
        matches!(&denied, Err(kube::Error::Api(s)) if s.code == 403),
        "{denied:?}"
    );

    // Headers that front proxies use to pass identities are not trusted.
    let raw = cluster
        .raw_http1(
            b"GET /api/v1/namespaces/default/configmaps HTTP/1.1\r\nHost: x\r\n\
              X-Remote-User: system:kube-scheduler\r\nX-Remote-Group: system:masters\r\n\
              Connection: close\r\n\r\n",
        )
        .await?;
    let head = String::from_utf8_lossy(&raw);
    ensure!(head.starts_with("HTTP/1.1 401"), "{head}");
    Ok(())
}

/// Waits for the next change of a subscription.
async fn next<K>(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Change<K>>) -> Result<Change<K>> {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .context("no change within 10 s")?
        .context("the informer stopped")
}

async fn open_watches(cluster: &TestCluster) -> Result<f64> {
    let metrics = cluster.request("GET", "/metrics", "text/plain", "").await?;
    Ok(String::from_utf8_lossy(&metrics.body)
        .lines()
        .find_map(|l| l.strip_prefix("apiserver_watch_cache_watchers "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_default())
}

async fn shared_informers(cluster: &TestCluster, client: &kube::Client) -> Result<()> {
    let ns = "informers";
    namespace(client, ns).await?;
    let before = open_watches(cluster).await?;
    let metrics = trellis_client::metrics::ComponentMetrics::default();
    let factory = SharedInformers::with_metrics(metrics.informers.clone());
    let config = || watcher::Config::default().labels("app=x");
    let first = factory.informer::<ConfigMap>(Api::namespaced(client.clone(), ns), config());
    let second = factory.informer::<ConfigMap>(Api::namespaced(client.clone(), ns), config());
    ensure!(Arc::ptr_eq(&first, &second), "two informers for one key");
    ensure!(factory.len() == 1);
    first.wait_synced().await;
    ensure!(second.has_synced() && first.is_empty());

    let mut a = first.subscribe();
    let mut b = second.subscribe();
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let cm = |v: &str| -> Result<ConfigMap> {
        Ok(serde_json::from_value(json!({
            "metadata": {"name": "c", "labels": {"app": "x"}}, "data": {"v": v}
        }))?)
    };
    maps.create(&PostParams::default(), &cm("1")?).await?;
    maps.patch(
        "c",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"v": "2"}})),
    )
    .await?;
    // Outside the selector: never seen.
    let other: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "other"}}))?;
    maps.create(&PostParams::default(), &other).await?;
    maps.delete("c", &DeleteParams::default()).await?;
    let v = |c: &ConfigMap| c.data.as_ref().and_then(|d| d.get("v")).cloned();
    for rx in [&mut a, &mut b] {
        let added = next(rx).await?;
        ensure!(matches!(&added, Change::Added(c) if v(c).as_deref() == Some("1")));
        let updated = next(rx).await?;
        ensure!(matches!(&updated, Change::Updated { old, new }
                if v(old).as_deref() == Some("1") && v(new).as_deref() == Some("2")));
        ensure!(matches!(next(rx).await?, Change::Deleted(_)));
    }
    ensure!(first.get(&format!("{ns}/other")).is_none() && first.is_empty());
    // The changes came through a watch, so it is open: one on the server for both.
    let watching = open_watches(cluster).await?;
    ensure!(watching == before + 1.0, "{before} → {watching} watches");
    // What the informer did, on the component's /metrics: one list, three changes,
    // nothing left in the store.
    let text = metrics.render();
    let label = format!("informer=\"/api/v1/namespaces/{ns}/configmaps labels=app=x\"");
    for line in [
        format!("informer_lists_total{{{label}}} 1"),
        format!("informer_synced{{{label}}} 1"),
        format!("informer_objects{{{label}}} 0"),
        format!("informer_events_total{{{label},type=\"added\"}} 1"),
        format!("informer_events_total{{{label},type=\"updated\"}} 1"),
        format!("informer_events_total{{{label},type=\"deleted\"}} 1"),
    ] {
        ensure!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }

    // Indexes: by label (built in) and by node name (added).
    let pods = factory.informer::<Pod>(
        Api::namespaced(client.clone(), ns),
        watcher::Config::default(),
    );
    pods.add_index(informer::BY_NODE_NAME, informer::pod_node_name());
    pods.wait_synced().await;
    let mut changes = pods.subscribe();
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    for (name, node) in [("p1", "n1"), ("p2", "n2"), ("p3", "n1")] {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"role": node}},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]}
        }))?;
        api.create(&PostParams::default(), &pod).await?;
        next(&mut changes).await?;
    }
    let mut on_n1: Vec<String> = pods
        .by_index(informer::BY_NODE_NAME, "n1")
        .iter()
        .map(|p| p.metadata.name.clone().unwrap_or_default())
        .collect();
    on_n1.sort();
    ensure!(on_n1 == ["p1", "p3"], "{on_n1:?}");
    ensure!(pods.by_index(informer::BY_LABEL, "role=n2").len() == 1);
    ensure!(pods.by_index(informer::BY_NAMESPACE, ns).len() == 3);
    // Cached objects carry no managedFields, which the server does record (Kubernetes'
    // scheduler and controller manager trim them from their informers too).
    let stored = api.get("p1").await?.metadata.managed_fields;
    ensure!(stored.is_some_and(|m| !m.is_empty()));
    ensure!(
        pods.list()
            .iter()
            .all(|p| p.metadata.managed_fields.is_none())
    );
    Ok(())
}

/// Two candidates for one Lease: one leads, the other takes over only once the
/// leader's lease has run out, and never both at once; a leader that finishes hands
/// the lease back at once.
async fn leader_election(cluster: &TestCluster) -> Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use trellis_client::leader::{LeaderConfig, LeaderElector, Outcome};

    let config = LeaderConfig {
        lease_duration: Duration::from_secs(2),
        renew_deadline: Duration::from_millis(1_500),
        retry_period: Duration::from_millis(200),
    };
    let client = cluster.in_process().client(identity::controller_manager());
    let elector = |id: &str| {
        LeaderElector::new(
            client.clone(),
            "kube-system",
            "kube-controller-manager",
            id,
            config,
        )
    };
    let leading = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    // Who leads, as the leaders' work announces it.
    let leader = Arc::new(tokio::sync::watch::channel(String::new()).0);
    // The work of a leader: counts itself while it runs; `until` ends it.
    let work = |id: &'static str, until: tokio::sync::oneshot::Receiver<()>| {
        let (leading, most, leader) = (leading.clone(), most.clone(), leader.clone());
        move || async move {
            struct Leading(Arc<AtomicUsize>);
            impl Drop for Leading {
                fn drop(&mut self) {
                    self.0.fetch_sub(1, Ordering::SeqCst);
                }
            }
            let now = leading.fetch_add(1, Ordering::SeqCst) + 1;
            let _leading = Leading(leading.clone());
            most.fetch_max(now, Ordering::SeqCst);
            leader.send_replace(id.to_owned());
            let _ = until.await;
        }
    };
    let wait_for_leader = |id: &'static str| {
        let mut announced = leader.subscribe();
        async move {
            tokio::time::timeout(Duration::from_secs(4), announced.wait_for(|l| l == id))
                .await
                .with_context(|| format!("{id} never led"))?
                .map(|_| ())
                .context("the announcements ended")
        }
    };
    let (_keep_a, until_a) = tokio::sync::oneshot::channel();
    let a = elector("a");
    let task_a = tokio::spawn({
        let work = work("a", until_a);
        async move { a.run(work).await }
    });
    wait_for_leader("a").await?;
    let (end_b, until_b) = tokio::sync::oneshot::channel();
    let b = elector("b");
    let task_b = tokio::spawn({
        let work = work("b", until_b);
        async move { b.run(work).await }
    });
    // `a` dies without handing the lease back.
    ensure!(*leader.borrow() == "a");
    task_a.abort();
    let killed = tokio::time::Instant::now();
    wait_for_leader("b").await?;
    let takeover = killed.elapsed();
    ensure!(
        takeover >= Duration::from_millis(1_500) && takeover < Duration::from_secs(4),
        "b took over {takeover:?} after a died (lease 2 s)"
    );
    ensure!(most.load(Ordering::SeqCst) == 1, "two leaders at once");
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), "kube-system");
    let spec = leases
        .get("kube-controller-manager")
        .await?
        .spec
        .unwrap_or_default();
    ensure!(spec.holder_identity.as_deref() == Some("b") && spec.lease_transitions == Some(1));

    // `b` finishes: the lease is handed back, and `c` need not wait out its duration.
    let _ = end_b.send(());
    ensure!(task_b.await? == Outcome::Finished);
    let (_keep_c, until_c) = tokio::sync::oneshot::channel();
    let c = elector("c");
    let started = tokio::time::Instant::now();
    let task_c = tokio::spawn({
        let work = work("c", until_c);
        async move { c.run(work).await }
    });
    wait_for_leader("c").await?;
    ensure!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    task_c.abort();
    // Held to its role: the controller manager cannot take the scheduler's Lease.
    let theirs = leases.get("kube-scheduler").await;
    ensure!(
        matches!(&theirs, Err(kube::Error::Api(s)) if s.code == 403),
        "{theirs:?}"
    );
    Ok(())
}

/// Events as the scheduler records them: repeats counted on one object, a limit per
/// object, visible to kubectl.
async fn events(cluster: &TestCluster, admin: &kube::Client) -> Result<()> {
    use trellis_client::events::{EventLimits, EventRecorder, EventType};
    let ns = "events";
    namespace(admin, ns).await?;
    let maps: Api<ConfigMap> = Api::namespaced(admin.clone(), ns);
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "target"}}))?;
    let cm = maps.create(&PostParams::default(), &cm).await?;
    let recorder = EventRecorder::with_limits(
        cluster.in_process().client(identity::scheduler()),
        "default-scheduler",
        "node-x",
        EventLimits {
            burst: 5,
            ..EventLimits::default()
        },
    );
    for _ in 0..3 {
        recorder.record(&cm, EventType::Normal, "Scheduled", "placed on node-x");
    }
    for i in 0..5 {
        recorder.record(&cm, EventType::Warning, "Other", &format!("attempt {i}"));
    }
    recorder.flush().await;
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(admin.clone(), ns);
    let list = events.list(&ListParams::default()).await?.items;
    ensure!(list.len() == 3, "{list:?}");
    let scheduled = list
        .iter()
        .find(|e| e.reason.as_deref() == Some("Scheduled"))
        .context("no Scheduled event")?;
    ensure!(scheduled.count == Some(3), "{scheduled:?}");
    ensure!(
        scheduled.involved_object.uid == cm.metadata.uid
            && scheduled
                .source
                .as_ref()
                .and_then(|s| s.component.as_deref())
                == Some("default-scheduler")
    );
    ensure!(recorder.dropped() == 3, "dropped {}", recorder.dropped());
    let table = cluster.kubectl_ok(&["get", "events", "-n", ns]).await?;
    ensure!(
        table.contains("Scheduled") && table.contains("configmap/target"),
        "{table}"
    );
    let described = cluster
        .kubectl_ok(&["describe", "configmap", "target", "-n", ns])
        .await?;
    ensure!(
        described.contains("Scheduled") && described.contains("placed on node-x"),
        "{described}"
    );
    Ok(())
}

/// A remote informer outlives a restart of the server: its watch ends, it resumes
/// against the new server and sees what is written after. (Regression: a watch that
/// arrived while the server stopped joined the stopped watch cache and hung for ever,
/// holding its connection.) A watch from before the history the new server has is
/// answered 410 Gone, which kube-rs' watcher meets with a relist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn informers_resume_after_the_server_restarts() -> Result<()> {
    let mut cluster = TestCluster::start().await?;
    let client = cluster.kube_admin().await?;
    namespace(&client, "restart").await?;
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), "restart");
    let cm = |name: &str| -> Result<ConfigMap> {
        Ok(serde_json::from_value(json!({"metadata": {"name": name}}))?)
    };
    maps.create(&PostParams::default(), &cm("before")?).await?;
    let informers = SharedInformers::new();
    let informer = informers.informer::<ConfigMap>(maps.clone(), watcher::Config::default());
    informer.wait_synced().await;
    let mut changes = informer.subscribe();
    ensure!(matches!(next(&mut changes).await?, Change::Added(_)));

    // Elsewhere in the store: the informer's revision falls behind, then out of history.
    // Two writes, so that the revision after the informer's is itself compacted away:
    // a watch from the compacted revision on is still served, as etcd serves it.
    let others: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    others
        .create(&PostParams::default(), &cm("elsewhere")?)
        .await?;
    let latest = others
        .create(&PostParams::default(), &cm("elsewhere-too")?)
        .await?;
    let revision: u64 = latest
        .metadata
        .resource_version
        .as_deref()
        .unwrap_or_default()
        .parse()?;
    cluster.compact(revision).await?;
    cluster.restart().await?;
    maps.create(&PostParams::default(), &cm("after")?).await?;
    let added = next(&mut changes).await.with_context(|| {
        format!(
            "after the restart: errors {}, lists {}",
            informer.errors(),
            informer.lists()
        )
    })?;
    ensure!(
        matches!(&added, Change::Added(c) if c.metadata.name.as_deref() == Some("after")),
        "{added:?}"
    );
    ensure!(informer.len() == 2);
    // What the informer met: a watch from before the history the new server has.
    let gone = maps.watch(&kube::api::WatchParams::default(), "1").await;
    match gone {
        Err(kube::Error::Api(s)) => ensure!(s.code == 410, "{s:?}"),
        Ok(stream) => {
            let first = futures::StreamExt::next(&mut futures::StreamExt::boxed(stream)).await;
            ensure!(
                matches!(&first, Some(Ok(kube::api::WatchEvent::Error(e))) if e.code == 410),
                "{first:?}"
            );
        }
        Err(e) => anyhow::bail!("{e}"),
    }

    ensure!(
        informer.errors() >= 1,
        "the restart went unnoticed: errors {}, lists {}",
        informer.errors(),
        informer.lists()
    );
    Ok(())
}

/// A watch served from the store (from a revision older than the watch cache holds)
/// ends cleanly when the server stops. (Regression: it polled its already completed
/// stop signal a second time and panicked, "`async fn` resumed after completion".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_served_from_the_store_ends_when_the_server_stops() -> Result<()> {
    use futures::StreamExt as _;
    use kube::api::{WatchEvent, WatchParams};

    let cluster = TestCluster::builder()
        .with_watch_cache_events(4)
        .start()
        .await?;
    let client = cluster
        .in_process()
        .client(UserInfo::new("admin", ["system:masters"]));
    namespace(&client, "from-store").await?;
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), "from-store");
    let cm = |name: String| -> Result<ConfigMap> {
        Ok(serde_json::from_value(json!({"metadata": {"name": name}}))?)
    };
    let first = maps
        .create(&PostParams::default(), &cm("c-0".into())?)
        .await?;
    for i in 1..12 {
        maps.create(&PostParams::default(), &cm(format!("c-{i}"))?)
            .await?;
    }
    let from = first
        .metadata
        .resource_version
        .context("no resourceVersion")?;
    let mut stream = maps.watch(&WatchParams::default(), &from).await?.boxed();
    let replayed = stream.next().await;
    ensure!(
        matches!(&replayed, Some(Ok(WatchEvent::Added(c))) if c.metadata.name.as_deref() == Some("c-1")),
        "{replayed:?}"
    );
    let stopping = tokio::spawn(cluster.stop());
    while let Some(event) = stream.next().await {
        // A replay from the store that falls more than the cache's 4 events behind
        // while the server stops (a loaded machine) ends as any lagging watch does,
        // with 410 Expired; anything else is a failure.
        if let Ok(WatchEvent::Error(e)) = &event
            && e.code != 410
        {
            anyhow::bail!("the watch ended with an error, not because the server stopped: {e:?}");
        }
    }
    stopping.await??;
    Ok(())
}
