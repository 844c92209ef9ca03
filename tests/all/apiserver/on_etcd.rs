//! A subset of the end-to-end checks with the API server on etcd instead of the
//! embedded store: writes, paginated lists with `remainingItemCount`, server-side
//! apply, a watch from a resourceVersion, RBAC from the watch cache, and namespace
//! deletion. One server (and one etcd) for the module.

use anyhow::{Context as _, Result, ensure};
use serde_json::Value;
use trellis_tests::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_works_the_same_on_etcd() -> Result<()> {
    let cluster = TestCluster::builder().on_etcd().start().await?;
    cluster.kubectl_ok(&["create", "namespace", "e2e"]).await?;
    let items: Vec<String> = (0..30)
        .map(|i| {
            format!(r#"{{"apiVersion":"v1","kind":"ConfigMap","metadata":{{"name":"cm-{i:02}","namespace":"e2e"}},"data":{{"i":"{i}"}}}}"#)
        })
        .collect();
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &items.join("\n"))
        .await
        .context("create 30 ConfigMaps")?;

    // Pages: kubectl's chunked list, and the raw first page's count of the rest.
    let names = cluster
        .kubectl_ok(&["get", "cm", "-n", "e2e", "--chunk-size=7", "-o", "name"])
        .await?;
    ensure!(
        names
            .lines()
            .filter(|l| l.starts_with("configmap/cm-"))
            .count()
            == 30,
        "{names}"
    );
    let page = cluster
        .request(
            "GET",
            "/api/v1/namespaces/e2e/configmaps?limit=10",
            "application/json",
            "",
        )
        .await?
        .json()?;
    ensure!(
        page["metadata"]["remainingItemCount"] == 20,
        "{}",
        page["metadata"]
    );
    let token = page["metadata"]["continue"]
        .as_str()
        .context("no continue token")?
        .to_owned();
    let next = cluster
        .request(
            "GET",
            &format!("/api/v1/namespaces/e2e/configmaps?limit=10&continue={token}"),
            "application/json",
            "",
        )
        .await?
        .json()?;
    ensure!(
        next["metadata"]["remainingItemCount"] == 10,
        "{}",
        next["metadata"]
    );

    // Server-side apply, twice: the second is unchanged.
    let applied = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: applied, namespace: e2e}\ndata: {k: v}\n";
    cluster
        .kubectl_ok_stdin(&["apply", "--server-side", "-f", "-"], applied)
        .await?;
    let again = cluster
        .kubectl_ok_stdin(&["apply", "--server-side", "-f", "-"], applied)
        .await?;
    ensure!(again.contains("serverside-applied"), "{again}");

    // A watch from a resourceVersion sees what came after it.
    let revision = page["metadata"]["resourceVersion"]
        .as_str()
        .context("no resourceVersion")?
        .to_owned();
    let watched = cluster
        .request(
            "GET",
            &format!("/api/v1/namespaces/e2e/configmaps?watch=true&resourceVersion={revision}&timeoutSeconds=1"),
            "application/json",
            "",
        )
        .await?;
    let events: Vec<Value> = String::from_utf8_lossy(&watched.body)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    ensure!(
        events
            .iter()
            .any(|e| e["type"] == "ADDED" && e["object"]["metadata"]["name"] == "applied"),
        "{events:?}"
    );

    // RBAC through the watch cache: a binding applies to the next request.
    let refused = cluster
        .kubectl_err(&["--as", "reader", "get", "cm", "-n", "e2e"])
        .await?;
    ensure!(refused.contains("cannot list resource"), "{refused}");
    cluster
        .kubectl_ok(&[
            "create",
            "rolebinding",
            "reader",
            "--clusterrole=view",
            "--user=reader",
            "-n",
            "e2e",
        ])
        .await?;
    cluster
        .kubectl_ok(&["--as", "reader", "get", "cm", "-n", "e2e"])
        .await
        .context("the new binding applies at once")?;

    // Namespace deletion empties the namespace, then removes it.
    cluster
        .kubectl_ok(&["delete", "namespace", "e2e", "--wait=false"])
        .await?;
    cluster
        .kubectl_ok(&["wait", "--for=delete", "namespace/e2e", "--timeout=30s"])
        .await?;
    cluster.kubectl_ok(&["create", "namespace", "e2e"]).await?;
    let left = cluster
        .kubectl_ok(&["get", "cm", "-n", "e2e", "-o", "name"])
        .await?;
    ensure!(!left.contains("configmap/cm-"), "objects came back: {left}");
    cluster.stop().await
}
