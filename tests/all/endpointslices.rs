//! The bundled Endpoints and EndpointSlice controllers against a real server, with
//! pods given their status by the test (no node runs them): slices of at most 100
//! endpoints, conditions that follow readiness and deletion, ports resolved per pod,
//! hostnames, zones from the Nodes, `publishNotReadyAddresses`, only changed slices
//! written, and what `kubectl get endpointslices,endpoints` prints.
//! One server for the module.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Endpoints, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::{Value, json};
use trellis_api::{Shutdown, UserInfo};
use trellis_client::events::EventRecorder;
use trellis_client::identity;
use trellis_client::informer::{BY_LABEL, Informer, SharedInformers};
use trellis_controllers::{Manager, Running};
use trellis_plugin_host::{Compilers, HostConfig, PluginHost};
use trellis_tests::TestCluster;

const MANAGED: &str = "endpointslice.kubernetes.io/managed-by=endpointslice-controller.k8s.io";

/// Starts the bundled `endpoint` and `endpointslice` controllers, each as its own
/// ServiceAccount.
async fn start_controllers(
    manager: &Manager,
    in_process: &trellis_client::InProcess,
    stopped: &Shutdown,
) -> Result<Vec<Running>> {
    let mut running = Vec::new();
    for builtin in trellis_controllers::bundled::select("endpoint,endpointslice")? {
        let config = builtin.config();
        // Zones come from the Nodes the controller reads.
        ensure!(
            builtin.name != "endpointslice"
                || config
                    .watches
                    .iter()
                    .any(|w| w.resource.resource == "nodes"),
            "the EndpointSlice controller watches no Nodes"
        );
        let writer = in_process.client(identity::controller(builtin.account()));
        let events = EventRecorder::new(writer.clone(), builtin.identity, "test");
        running.push(
            manager
                .start(config, writer, events, stopped.clone())
                .await
                .with_context(|| format!("start {}", builtin.name))?,
        );
    }
    Ok(running)
}

/// The slices this controller keeps for `service`.
fn slices_of(slices: &Informer<EndpointSlice>, service: &str) -> Vec<EndpointSlice> {
    slices
        .by_index(BY_LABEL, &format!("kubernetes.io/service-name={service}"))
        .into_iter()
        .filter(|s| {
            s.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("endpointslice.kubernetes.io/managed-by"))
                == Some(&"endpointslice-controller.k8s.io".to_owned())
        })
        .map(|s| (*s).clone())
        .collect()
}

/// The endpoints of `slices` by pod name, each with the ports of its slice.
fn by_pod(slices: &[EndpointSlice]) -> BTreeMap<String, (Value, Vec<i32>)> {
    let mut out = BTreeMap::new();
    for slice in slices {
        let ports: Vec<i32> = slice
            .ports
            .iter()
            .flatten()
            .filter_map(|p| p.port)
            .collect();
        for e in &slice.endpoints {
            let name = e
                .target_ref
                .as_ref()
                .and_then(|r| r.name.clone())
                .unwrap_or_default();
            out.insert(
                name,
                (serde_json::to_value(e).unwrap_or_default(), ports.clone()),
            );
        }
    }
    out
}

/// Waits until `done` holds, looking again at every change of `slices` and `endpoints`.
async fn until(
    slices: &Informer<EndpointSlice>,
    endpoints: &Informer<Endpoints>,
    what: &str,
    mut done: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let mut slice_changes = slices.subscribe();
    let mut endpoint_changes = endpoints.subscribe();
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if done()? {
                return anyhow::Ok(());
            }
            tokio::select! {
                c = slice_changes.recv() => c.map(drop).context("the informer stopped")?,
                c = endpoint_changes.recv() => c.map(drop).context("the informer stopped")?,
            };
        }
    })
    .await
    .with_context(|| format!("{what} within 20 s"))?
}

fn pod(name: &str, app: &str, node: &str, port: i32) -> Value {
    json!({"metadata": {"name": name, "labels": {"app": app}},
           "spec": {"nodeName": node, "containers": [{"name": "c", "image": "none",
                    "ports": [{"name": "http", "containerPort": port}]}]}})
}

/// The status a node would give: an address, Running, ready or not.
fn status(ip: &str, ready: bool) -> Value {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
           "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }, "lastTransitionTime": now}]}})
}

async fn set_status(pods: &Api<Pod>, name: &str, ip: &str, ready: bool) -> Result<()> {
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(status(ip, ready)),
    )
    .await
    .with_context(|| format!("status of {name}"))?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_slices_follow_pods_as_kubernetes_writes_them() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let in_process = cluster.in_process();
    let admin = in_process.client(UserInfo::new("admin", ["system:masters"]));
    let manager = Manager {
        plugins: PluginHost::new(HostConfig {
            compilers: Compilers::Baseline,
            max_instances: 16,
            ..HostConfig::default()
        })?,
        informers: SharedInformers::new(),
        lister: in_process.client(identity::controller_manager()),
        queues: Default::default(),
        running: Default::default(),
    };
    let (stop, stopped) = Shutdown::new();
    let running = start_controllers(&manager, &in_process, &stopped).await?;

    let watching = SharedInformers::new();
    let slices =
        watching.informer::<EndpointSlice>(Api::all(admin.clone()), watcher::Config::default());
    let endpoints =
        watching.informer::<Endpoints>(Api::all(admin.clone()), watcher::Config::default());
    slices.wait_synced().await;
    endpoints.wait_synced().await;

    let nodes: Api<Node> = Api::all(admin.clone());
    for (node, zone) in [("n1", "zone-a"), ("n2", "zone-b")] {
        nodes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": node,
                    "labels": {"topology.kubernetes.io/zone": zone}}}))?,
            )
            .await?;
    }
    let services: Api<Service> = Api::namespaced(admin.clone(), "default");
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    // An ExternalName Service selecting pods, and one without a selector: no slice
    // from the controller for either.
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "external"},
                "spec": {"type": "ExternalName", "externalName": "example.org", "selector": {"app": "web"}}}))?,
        )
        .await?;
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "manual"},
                "spec": {"ports": [{"port": 80}]}}))?,
        )
        .await?;

    // 250 ready pods over two nodes, then a Service selecting them.
    let ip = |i: usize| format!("10.244.{}.{}", 121 + i / 200, i % 200 + 1);
    futures::stream::iter(0..250)
        .map(|i| {
            let pods = pods.clone();
            let ip = ip(i);
            async move {
                let node = if i % 2 == 0 { "n1" } else { "n2" };
                let name = format!("web-{i}");
                pods.create(
                    &PostParams::default(),
                    &serde_json::from_value(pod(&name, "web", node, 8080))?,
                )
                .await
                .with_context(|| format!("create {name}"))?;
                set_status(&pods, &name, &ip, true).await
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    // The Service comes once its pods are ready, so that they are sliced at once.
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "web", "labels": {"tier": "front"}},
                "spec": {"selector": {"app": "web"}, "ports": [
                    {"name": "http", "port": 80, "targetPort": "http"},
                    {"name": "metrics", "port": 9000, "targetPort": 9000}]}}),
            )?,
        )
        .await?;
    until(
        &slices,
        &endpoints,
        "250 ready endpoints of web in slices and Endpoints",
        || {
            let ready = by_pod(&slices_of(&slices, "web"))
                .values()
                .filter(|(e, _)| e["conditions"]["ready"] == true)
                .count();
            let addresses = endpoints
                .get("default/web")
                .and_then(|e| e.subsets.clone())
                .map_or(0, |s| {
                    s.iter()
                        .map(|s| s.addresses.as_ref().map_or(0, Vec::len))
                        .sum::<usize>()
                });
            Ok(ready == 250 && addresses == 250)
        },
    )
    .await?;
    let web = slices_of(&slices, "web");
    let sizes: Vec<usize> = web.iter().map(|s| s.endpoints.len()).collect();
    ensure!(
        web.len() == 3 && sizes.iter().all(|n| *n <= 100),
        "{sizes:?}"
    );
    let service_uid = services.get("web").await?.metadata.uid;
    for slice in &web {
        let name = slice.metadata.name.clone().unwrap_or_default();
        ensure!(
            name.len() == "web-".len() + 5 && name.starts_with("web-"),
            "{name}"
        );
        ensure!(slice.address_type == "IPv4");
        let labels = slice.metadata.labels.clone().unwrap_or_default();
        ensure!(
            labels.get("tier").map(String::as_str) == Some("front"),
            "{labels:?}"
        );
        let owner = &slice
            .metadata
            .owner_references
            .as_ref()
            .context("no owner")?[0];
        ensure!(
            owner.kind == "Service"
                && Some(&owner.uid) == service_uid.as_ref()
                && owner.controller == Some(true)
        );
        let ports: Vec<(Option<String>, Option<i32>)> = slice
            .ports
            .iter()
            .flatten()
            .map(|p| (p.name.clone(), p.port))
            .collect();
        ensure!(
            ports
                == [
                    (Some("http".into()), Some(8080)),
                    (Some("metrics".into()), Some(9000))
                ],
            "{ports:?}"
        );
    }
    let all = by_pod(&web);
    let (seven, _) = &all["web-7"];
    ensure!(
        seven["nodeName"] == "n2" && seven["zone"] == "zone-b",
        "{seven}"
    );
    ensure!(
        seven["conditions"] == json!({"ready": true, "serving": true, "terminating": false}),
        "{seven}"
    );

    // Readiness lost: its endpoint says so, only its slice is written, and the
    // Endpoints moves it to notReadyAddresses.
    let versions = |slices: &[EndpointSlice]| -> BTreeMap<String, String> {
        slices
            .iter()
            .map(|s| {
                (
                    s.metadata.name.clone().unwrap_or_default(),
                    s.metadata.resource_version.clone().unwrap_or_default(),
                )
            })
            .collect()
    };
    let before = versions(&web);
    set_status(&pods, "web-7", &ip(7), false).await?;
    until(&slices, &endpoints, "web-7 not ready", || {
        let not_ready = endpoints
            .get("default/web")
            .and_then(|e| e.subsets.clone())
            .is_some_and(|s| {
                s.iter().any(|s| {
                    s.not_ready_addresses
                        .iter()
                        .flatten()
                        .any(|a| a.ip == ip(7))
                })
            });
        Ok(by_pod(&slices_of(&slices, "web"))["web-7"].0["conditions"]
            == json!({"ready": false, "serving": false, "terminating": false})
            && not_ready)
    })
    .await?;
    let after = versions(&slices_of(&slices, "web"));
    let changed: Vec<&String> = before
        .keys()
        .filter(|k| after.get(*k) != before.get(*k))
        .collect();
    ensure!(
        changed.len() == 1,
        "slices written for one endpoint: {changed:?}"
    );

    // A change of the Service that changes no endpoint writes nothing; then web-7
    // ready again rewrites its slice alone.
    services
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"note": "x"}}})),
        )
        .await?;
    set_status(&pods, "web-7", &ip(7), true).await?;
    until(&slices, &endpoints, "web-7 ready again", || {
        Ok(by_pod(&slices_of(&slices, "web"))["web-7"].0["conditions"]["ready"] == true)
    })
    .await?;
    let again = versions(&slices_of(&slices, "web"));
    let rewritten: Vec<&String> = before
        .keys()
        .filter(|k| again.get(*k) != before.get(*k))
        .collect();
    ensure!(
        rewritten == changed,
        "{rewritten:?} written, not only {changed:?}"
    );

    // A terminating pod (a finalizer holds it): not ready, serving as it is ready,
    // terminating; out of the Endpoints.
    pods.patch(
        "web-3",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": ["test/hold"]}})),
    )
    .await?;
    pods.delete("web-3", &DeleteParams::default()).await?;
    until(&slices, &endpoints, "web-3 terminating", || {
        let listed = endpoints
            .get("default/web")
            .and_then(|e| e.subsets.clone())
            .is_some_and(|s| {
                s.iter()
                    .any(|s| s.addresses.iter().flatten().any(|a| a.ip == ip(3)))
            });
        Ok(by_pod(&slices_of(&slices, "web"))["web-3"].0["conditions"]
            == json!({"ready": false, "serving": true, "terminating": true})
            && !listed)
    })
    .await?;

    // Two pods whose named port is another number: a slice of their own, one of
    // them with the hostname it publishes as the Service's subdomain.
    for i in 0..2 {
        let name = format!("alt-{i}");
        let mut p = pod(&name, "web", "n1", 8081);
        if i == 0 {
            p["spec"]["hostname"] = json!("alt-0");
            p["spec"]["subdomain"] = json!("web");
        }
        pods.create(&PostParams::default(), &serde_json::from_value(p)?)
            .await?;
        set_status(&pods, &name, &format!("10.244.123.{}", i + 1), true).await?;
    }
    until(
        &slices,
        &endpoints,
        "the alt pods in a slice of port 8081",
        || {
            let all = by_pod(&slices_of(&slices, "web"));
            Ok(["alt-0", "alt-1"]
                .iter()
                .all(|n| all.get(*n).is_some_and(|(_, ports)| ports == &[8081, 9000]))
                && endpoints.get("default/web").is_some_and(|e| {
                    e.subsets.iter().flatten().any(|s| {
                        s.addresses
                            .iter()
                            .flatten()
                            .any(|a| a.hostname.as_deref() == Some("alt-0"))
                    })
                }))
        },
    )
    .await?;
    let web = slices_of(&slices, "web");
    let all = by_pod(&web);
    ensure!(all["alt-0"].0["hostname"] == "alt-0", "{}", all["alt-0"].0);
    ensure!(
        all["alt-1"].0.get("hostname").is_none(),
        "{}",
        all["alt-1"].0
    );
    ensure!(all["web-0"].0.get("hostname").is_none());
    let alt_slices: Vec<&EndpointSlice> = web
        .iter()
        .filter(|s| s.ports.iter().flatten().any(|p| p.port == Some(8081)))
        .collect();
    ensure!(
        alt_slices.len() == 1 && alt_slices[0].endpoints.len() == 2,
        "{alt_slices:?}"
    );

    // publishNotReadyAddresses: a pod that is not ready is listed as ready (not serving).
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "peers"},
                "spec": {"clusterIP": "None", "publishNotReadyAddresses": true, "selector": {"app": "peers"},
                         "ports": [{"name": "peer", "port": 7000, "targetPort": "http"}]}}))?,
        )
        .await?;
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(pod("peer-0", "peers", "n1", 7001))?,
    )
    .await?;
    set_status(&pods, "peer-0", "10.244.124.1", false).await?;
    until(&slices, &endpoints, "peer-0 published", || {
        let published = endpoints.get("default/peers").is_some_and(|e| {
            e.subsets
                .iter()
                .flatten()
                .any(|s| s.addresses.iter().flatten().any(|a| a.ip == "10.244.124.1"))
        });
        Ok(by_pod(&slices_of(&slices, "peers"))
            .get("peer-0")
            .is_some_and(|(e, _)| {
                e["conditions"] == json!({"ready": true, "serving": false, "terminating": false})
            })
            && published)
    })
    .await?;
    let peers = slices_of(&slices, "peers");
    let labels = peers[0].metadata.labels.clone().unwrap_or_default();
    ensure!(
        labels.contains_key("service.kubernetes.io/headless"),
        "{labels:?}"
    );

    // Neither the ExternalName Service nor the one without a selector got a slice.
    for name in ["external", "manual"] {
        ensure!(slices_of(&slices, name).is_empty(), "{name} has slices");
        ensure!(
            endpoints.get(&format!("default/{name}")).is_none(),
            "{name} has Endpoints"
        );
    }

    // What kubectl prints.
    let table = cluster
        .kubectl_ok(&[
            "get",
            "endpointslices",
            "-l",
            "kubernetes.io/service-name=peers",
        ])
        .await?;
    let mut lines = table.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    ensure!(
        header == ["NAME", "ADDRESSTYPE", "PORTS", "ENDPOINTS", "AGE"],
        "{table}"
    );
    let row: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    ensure!(row[1..4] == ["IPv4", "7001", "10.244.124.1"], "{table}");
    let table = cluster
        .kubectl_ok(&[
            "get",
            "endpointslices",
            "-l",
            &format!("kubernetes.io/service-name=web,{MANAGED}"),
        ])
        .await?;
    ensure!(
        table.contains("8080,9000") && table.contains("8081,9000") && table.contains(" more..."),
        "{table}"
    );
    let table = cluster
        .kubectl_ok(&["get", "endpoints", "peers", "web"])
        .await?;
    let mut lines = table.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    ensure!(header == ["NAME", "ENDPOINTS", "AGE"], "{table}");
    ensure!(
        table.contains("10.244.124.1:7001") && table.contains("more..."),
        "{table}"
    );
    let described = cluster
        .kubectl_ok(&["describe", "service", "peers"])
        .await?;
    ensure!(described.contains("10.244.124.1:7001"), "{described}");

    pods.patch(
        "web-3",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await?;
    stop.stop();
    for r in running {
        r.stop().await;
    }
    Ok(())
}
