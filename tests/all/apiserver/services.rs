//! Services' ClusterIPs and NodePorts: allocated from the server's ranges with the
//! Service in one store transaction, asked-for values honored or refused with
//! Kubernetes' messages, released and allocated again by deletes and type changes,
//! never handed out twice by two API servers on one etcd, repaired at start; and the
//! defaults, validation and table columns kubectl shows.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use bytes::Bytes;
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use trellis_apiserver::registry::service::{PortRange, ServiceCidr};
use trellis_store::Store;
use trellis_tests::{StoreSettings, TestCluster, TestStore};

fn in_range(ip: &str) -> Result<Ipv4Addr> {
    let ip: Ipv4Addr = ip
        .parse()
        .with_context(|| format!("{ip:?} is not an IPv4 address"))?;
    let o = ip.octets();
    ensure!(o[0] == 10 && o[1] == 43, "{ip} is outside 10.43.0.0/16");
    Ok(ip)
}

async fn service_json(cluster: &TestCluster, name: &str) -> Result<Value> {
    let out = cluster
        .kubectl_ok(&["get", "service", name, "-o", "json"])
        .await?;
    Ok(serde_json::from_str(&out)?)
}

fn manifest(name: &str, spec: Value) -> String {
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec})
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_get_addresses_and_ports_with_kubernetes_rules() -> Result<()> {
    let cluster = TestCluster::start().await?;

    // `kubectl create service` and `kubectl expose`: a ClusterIP from the dynamic band,
    // and everything Kubernetes 1.30 stores.
    cluster
        .kubectl_ok(&["create", "service", "clusterip", "web", "--tcp=80:8080"])
        .await?;
    let web = service_json(&cluster, "web").await?;
    let ip = in_range(web["spec"]["clusterIP"].as_str().unwrap_or(""))?;
    ensure!(
        ip.octets()[2] >= 1,
        "{ip} is in the first 256 addresses, left to requests"
    );
    let spec = &web["spec"];
    ensure!(spec["clusterIPs"] == json!([ip.to_string()]), "{spec}");
    ensure!(spec["ipFamilies"] == json!(["IPv4"]), "{spec}");
    ensure!(spec["ipFamilyPolicy"] == "SingleStack", "{spec}");
    ensure!(spec["internalTrafficPolicy"] == "Cluster", "{spec}");
    ensure!(spec["sessionAffinity"] == "None", "{spec}");
    ensure!(
        spec["ports"][0]["protocol"] == "TCP" && spec["ports"][0]["targetPort"] == 8080,
        "{spec}"
    );
    cluster
        .kubectl_ok(&[
            "create",
            "deployment",
            "app",
            "--image=registry.invalid/app",
        ])
        .await?;
    cluster
        .kubectl_ok(&[
            "expose",
            "deployment",
            "app",
            "--port=80",
            "--target-port=8080",
            "--type=NodePort",
        ])
        .await?;
    let app = service_json(&cluster, "app").await?;
    in_range(app["spec"]["clusterIP"].as_str().unwrap_or(""))?;
    let node_port = app["spec"]["ports"][0]["nodePort"].as_i64().unwrap_or(0);
    ensure!((30000..=32767).contains(&node_port), "{}", app["spec"]);
    ensure!(
        app["spec"]["externalTrafficPolicy"] == "Cluster",
        "{}",
        app["spec"]
    );
    let table = cluster
        .kubectl_ok(&["get", "services", "-o", "wide"])
        .await?;
    ensure!(
        table.contains("TYPE") && table.contains("CLUSTER-IP") && table.contains("SELECTOR"),
        "{table}"
    );
    ensure!(
        table.contains(&format!("80:{node_port}/TCP")) && table.contains("app=app"),
        "{table}"
    );

    // Applying or replacing with the manifest again keeps what was allocated.
    let applied = manifest(
        "applied",
        json!({"type": "NodePort", "selector": {"app": "x"}, "ports": [{"port": 80}]}),
    );
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &applied)
        .await?;
    let first = service_json(&cluster, "applied").await?;
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], &applied.replace("\"x\"", "\"y\""))
        .await?;
    cluster
        .kubectl_ok_stdin(&["replace", "-f", "-"], &applied)
        .await?;
    let again = service_json(&cluster, "applied").await?;
    ensure!(
        again["spec"]["clusterIP"] == first["spec"]["clusterIP"]
            && again["spec"]["ports"][0]["nodePort"] == first["spec"]["ports"][0]["nodePort"],
        "{} became {}",
        first["spec"],
        again["spec"]
    );

    // Asked-for values are honored, a taken or foreign one refused as Kubernetes does.
    let fixed =
        |name: &str, ip: &str| manifest(name, json!({"clusterIP": ip, "ports": [{"port": 80}]}));
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &fixed("fixed", "10.43.0.5"))
        .await?;
    let taken = cluster
        .kubectl_err_stdin(&["create", "-f", "-"], &fixed("again", "10.43.0.5"))
        .await?;
    ensure!(
        taken.contains(r#"spec.clusterIPs: Invalid value: []string{"10.43.0.5"}: failed to allocate IP 10.43.0.5: provided IP is already allocated"#),
        "{taken}"
    );
    let dry = cluster
        .kubectl_err_stdin(
            &["create", "--dry-run=server", "-f", "-"],
            &fixed("again", "10.43.0.5"),
        )
        .await?;
    ensure!(dry.contains("provided IP is already allocated"), "{dry}");
    let dry = cluster
        .kubectl_ok(&[
            "create",
            "service",
            "clusterip",
            "dry",
            "--tcp=80",
            "--dry-run=server",
            "-o",
            "json",
        ])
        .await?;
    let dry: Value = serde_json::from_str(&dry)?;
    in_range(dry["spec"]["clusterIP"].as_str().unwrap_or(""))?;
    let foreign = cluster
        .kubectl_err_stdin(&["create", "-f", "-"], &fixed("foreign", "10.99.0.5"))
        .await?;
    ensure!(
        foreign.contains("is not in the valid range. The range of valid IPs is 10.43.0.0/16"),
        "{foreign}"
    );
    let node_port_service = |name: &str, port: u16| {
        manifest(
            name,
            json!({"type": "NodePort", "ports": [{"port": 80, "nodePort": port}]}),
        )
    };
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &node_port_service("np", 30080))
        .await?;
    let taken = cluster
        .kubectl_err_stdin(&["create", "-f", "-"], &node_port_service("np2", 30080))
        .await?;
    ensure!(
        taken.contains(
            "spec.ports[0].nodePort: Invalid value: 30080: provided port is already allocated"
        ),
        "{taken}"
    );
    let outside = cluster
        .kubectl_err_stdin(&["create", "-f", "-"], &node_port_service("np3", 40000))
        .await?;
    ensure!(
        outside.contains(
            "provided port is not in the valid range. The range of valid ports is 30000-32767"
        ),
        "{outside}"
    );

    // Type changes free and allocate; a freed value is taken by the next who asks.
    cluster
        .kubectl_ok(&[
            "patch",
            "service",
            "np",
            "-p",
            r#"{"spec":{"type":"ClusterIP"}}"#,
        ])
        .await?;
    let np = service_json(&cluster, "np").await?;
    ensure!(
        np["spec"]["ports"][0].get("nodePort").is_none(),
        "{}",
        np["spec"]
    );
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &node_port_service("np2", 30080))
        .await
        .context("30080 is free once its Service became a ClusterIP one")?;
    cluster
        .kubectl_ok(&[
            "patch",
            "service",
            "fixed",
            "-p",
            r#"{"spec":{"type":"ExternalName","externalName":"example.com"}}"#,
        ])
        .await?;
    let external = service_json(&cluster, "fixed").await?;
    ensure!(
        external["spec"].get("clusterIP").is_none()
            && external["spec"].get("ipFamilies").is_none()
            && external["spec"].get("internalTrafficPolicy").is_none(),
        "{}",
        external["spec"]
    );
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &fixed("again", "10.43.0.5"))
        .await
        .context("10.43.0.5 is free once its Service became an ExternalName")?;
    cluster
        .kubectl_ok(&[
            "patch",
            "service",
            "fixed",
            "-p",
            r#"{"spec":{"type":"NodePort","externalName":null}}"#,
        ])
        .await?;
    let back = service_json(&cluster, "fixed").await?;
    in_range(back["spec"]["clusterIP"].as_str().unwrap_or(""))?;
    ensure!(
        back["spec"]["ports"][0]["nodePort"].as_i64().unwrap_or(0) >= 30000,
        "{}",
        back["spec"]
    );
    let table = cluster.kubectl_ok(&["get", "service", "fixed"]).await?;
    ensure!(table.contains("NodePort"), "{table}");

    // A LoadBalancer keeping traffic local gets a health check port, freed with it.
    cluster
        .kubectl_ok_stdin(
            &["create", "-f", "-"],
            &manifest(
                "lb",
                json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local",
                    "ports": [{"port": 443}]}),
            ),
        )
        .await?;
    let lb = service_json(&cluster, "lb").await?;
    let health = lb["spec"]["healthCheckNodePort"].as_i64().unwrap_or(0);
    ensure!(
        (30000..=32767).contains(&health)
            && lb["spec"]["allocateLoadBalancerNodePorts"] == true
            && lb["status"] == json!({"loadBalancer": {}}),
        "{lb}"
    );
    cluster
        .kubectl_ok(&[
            "patch",
            "service",
            "lb",
            "-p",
            r#"{"spec":{"externalTrafficPolicy":"Cluster"}}"#,
        ])
        .await?;
    let lb = service_json(&cluster, "lb").await?;
    ensure!(
        lb["spec"].get("healthCheckNodePort").is_none(),
        "{}",
        lb["spec"]
    );
    let table = cluster.kubectl_ok(&["get", "service", "lb"]).await?;
    ensure!(table.contains("<pending>"), "{table}");

    // A ClusterIP stays; a delete frees it.
    let moved = cluster
        .kubectl_err(&[
            "patch",
            "service",
            "again",
            "-p",
            r#"{"spec":{"clusterIP":"10.43.0.6","clusterIPs":["10.43.0.6"]}}"#,
        ])
        .await?;
    ensure!(
        moved.contains(
            r#"spec.clusterIPs[0]: Invalid value: []string{"10.43.0.6"}: may not change once set"#
        ),
        "{moved}"
    );
    cluster.kubectl_ok(&["delete", "service", "again"]).await?;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &fixed("third", "10.43.0.5"))
        .await
        .context("10.43.0.5 is free once its Service is deleted")?;

    // Headless and ExternalName Services hold nothing; their rows say so.
    cluster
        .kubectl_ok(&[
            "create",
            "service",
            "clusterip",
            "headless",
            "--clusterip=None",
        ])
        .await?;
    let headless = service_json(&cluster, "headless").await?;
    ensure!(
        headless["spec"]["clusterIPs"] == json!(["None"]),
        "{}",
        headless["spec"]
    );
    cluster
        .kubectl_ok(&[
            "create",
            "service",
            "externalname",
            "ext",
            "--external-name=db.example.com",
        ])
        .await?;
    let table = cluster
        .kubectl_ok(&["get", "service", "ext", "headless"])
        .await?;
    ensure!(
        table.contains("db.example.com") && table.contains("None"),
        "{table}"
    );

    // Validation: Kubernetes' field paths and messages, each a cause of its own.
    let refused = cluster
        .request(
            "POST",
            "/api/v1/namespaces/default/services",
            "application/json",
            &manifest(
                "bad",
                json!({"ports": [{"port": 80}, {"port": 70000, "name": "b", "protocol": "SCTX"}],
                    "sessionAffinity": "ClientIP",
                    "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 90000}},
                    "ipFamilies": ["IPv6"], "internalTrafficPolicy": "Nowhere"}),
            ),
        )
        .await?;
    ensure!(
        refused.status == 422,
        "{}",
        String::from_utf8_lossy(&refused.body)
    );
    let status = refused.json()?;
    let causes: Vec<(String, String)> = status["details"]["causes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            (
                c["field"].as_str().unwrap_or("").to_owned(),
                c["message"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    for (field, message) in [
        ("spec.ports[0].name", "Required value"),
        (
            "spec.ports[1].port",
            "Invalid value: 70000: must be between 1 and 65535, inclusive",
        ),
        (
            "spec.ports[1].protocol",
            r#"Unsupported value: "SCTX": supported values: "SCTP", "TCP", "UDP""#,
        ),
        (
            "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
            "Invalid value: 90000: must be greater than 0 and less than 86400",
        ),
        (
            "spec.ipFamilies[0]",
            r#"Invalid value: "IPv6": not configured on this cluster"#,
        ),
        (
            "spec.internalTrafficPolicy",
            r#"Unsupported value: "Nowhere": supported values: "Cluster", "Local""#,
        ),
    ] {
        ensure!(
            causes.iter().any(|(f, m)| f == field && m == message),
            "no cause {field}: {message} in {causes:?}"
        );
    }
    let missing = cluster
        .kubectl_err_stdin(
            &["create", "-f", "-"],
            &manifest("noname", json!({"type": "ExternalName"})),
        )
        .await?;
    ensure!(
        missing.contains("spec.externalName: Required value"),
        "{missing}"
    );
    cluster.stop().await
}

/// An API server of the test's own on `store`, with small ranges.
async fn server_on(
    store: Arc<dyn Store>,
    dir: &std::path::Path,
    settings: &trellis_apiserver::state::Settings,
) -> Result<(trellis_apiserver::Server, kube::Client)> {
    let mut config = trellis_apiserver::Config::new(dir);
    config.listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    config.shutdown_grace = Duration::from_secs(1);
    config.settings = settings.clone();
    let server = trellis_apiserver::start(config, store, std::future::pending())
        .await
        .context("start an API server")?;
    let client = trellis_client::remote(&server.kubeconfig).await?;
    Ok((server, client))
}

fn node_port_service(name: &str) -> Result<Service> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"type": "NodePort", "ports": [{"port": 80}]},
    }))?)
}

fn held(svc: &Service) -> (String, i32) {
    let spec = svc.spec.clone().unwrap_or_default();
    let port = spec
        .ports
        .unwrap_or_default()
        .first()
        .and_then(|p| p.node_port)
        .unwrap_or(0);
    (spec.cluster_ip.unwrap_or_default(), port)
}

fn api_message(result: Result<Service, kube::Error>) -> Result<String> {
    match result {
        Err(kube::Error::Api(e)) => Ok(e.message),
        other => bail!("expected the server to refuse, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_on_one_etcd_never_hand_out_one_address_twice() -> Result<()> {
    let etcd = TestStore::etcd(StoreSettings::default()).await?;
    let dirs = (tempfile::tempdir()?, tempfile::tempdir()?);
    // 62 addresses, 40 ports: two servers racing for them collide often.
    let settings = trellis_apiserver::state::Settings {
        service_cluster_ip_range: "10.43.0.0/26"
            .parse::<ServiceCidr>()
            .map_err(anyhow::Error::msg)?,
        service_node_port_range: "30000-30039"
            .parse::<PortRange>()
            .map_err(anyhow::Error::msg)?,
        ..Default::default()
    };
    let (server_a, client_a) = server_on(etcd.store.clone(), dirs.0.path(), &settings).await?;
    let (server_b, client_b) = server_on(etcd.store.clone(), dirs.1.path(), &settings).await?;
    let (a, b): (Api<Service>, Api<Service>) = (
        Api::namespaced(client_a, "default"),
        Api::namespaced(client_b, "default"),
    );

    // Both servers at once, 18 each: every ClusterIP and NodePort distinct.
    let create = |api: Api<Service>, prefix: &'static str| async move {
        let mut made = Vec::new();
        for i in 0..18 {
            made.push(
                api.create(
                    &PostParams::default(),
                    &node_port_service(&format!("{prefix}-{i}"))?,
                )
                .await
                .with_context(|| format!("create {prefix}-{i}"))?,
            );
        }
        anyhow::Ok(made)
    };
    let (made_a, made_b) = tokio::try_join!(create(a.clone(), "a"), create(b.clone(), "b"))?;
    let all: Vec<(String, i32)> = made_a.iter().chain(&made_b).map(held).collect();
    let ips: std::collections::BTreeSet<&String> = all.iter().map(|(ip, _)| ip).collect();
    let ports: std::collections::BTreeSet<i32> = all.iter().map(|(_, p)| *p).collect();
    ensure!(
        ips.len() == 36 && ports.len() == 36,
        "handed out twice: {all:?}"
    );

    // The rest of the ports, then the range is full, as Kubernetes says it.
    for i in 0..4 {
        a.create(
            &PostParams::default(),
            &node_port_service(&format!("fill-{i}"))?,
        )
        .await?;
    }
    let full = api_message(
        b.create(&PostParams::default(), &node_port_service("one-too-many")?)
            .await,
    )?;
    ensure!(
        full == "Internal error occurred: failed to allocate a nodePort: range is full",
        "{full}"
    );
    // A port freed by one server is found by the other, which believed it taken.
    a.delete("a-0", &DeleteParams::default()).await?;
    let reused = b
        .create(&PostParams::default(), &node_port_service("reused")?)
        .await
        .context("the port a-0 held is free again")?;
    ensure!(held(&reused).1 == held(&made_a[0]).1, "{:?}", held(&reused));

    // Repair at start: a lost allocation key comes back, a leaked one goes.
    let store = etcd.store.clone();
    let lost = format!("/allocations/serviceips/{}", held(&made_b[1]).0);
    store
        .txn(vec![trellis_store::TxnOp::Delete {
            key: lost.clone(),
            expected: None,
        }])
        .await?;
    let leaked = "/allocations/servicenodeports/30999";
    store
        .create(
            leaked,
            Bytes::from_static(br#"{"namespace":"default","name":"gone","uid":"x"}"#),
        )
        .await?;
    server_b.stop().await?;
    let (server_b, _) = server_on(etcd.store.clone(), dirs.1.path(), &settings).await?;
    ensure!(store.get(&lost).await?.is_some(), "{lost} was not restored");
    ensure!(
        store.get(leaked).await?.is_none(),
        "{leaked} was not released"
    );
    server_a.stop().await?;
    server_b.stop().await?;
    Ok(())
}
