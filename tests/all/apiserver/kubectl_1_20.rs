//! kubectl 1.20 (Debian's `kubernetes-client`, unpacked by `tests/tools/kubectl-1.20.sh`)
//! against the server: legacy discovery only, OpenAPI v2 in protobuf for `apply`'s
//! client-side validation and `explain`, client-side apply's strategic merge.

use anyhow::{Result, ensure};
use trellis_tests::TestCluster;

const DEPLOYMENT: &str = "apiVersion: apps/v1
kind: Deployment
metadata:
  name: old-client
spec:
  replicas: 1
  selector:
    matchLabels: {app: old-client}
  template:
    metadata:
      labels: {app: old-client}
    spec:
      containers:
      - name: nginx
        image: nginx:1.25
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_1_20_creates_applies_gets_explains_and_deletes() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let kubectl = cluster.kubectl_1_20()?;
    let version = kubectl.ok(&["version", "--client", "--short"]).await?;
    ensure!(version.contains("v1.20."), "{version}");

    let created = kubectl
        .ok(&[
            "create",
            "configmap",
            "settings",
            "--from-literal=mode=fast",
        ])
        .await?;
    ensure!(created.contains("configmap/settings created"), "{created}");
    let listed = kubectl.ok(&["get", "configmaps"]).await?;
    ensure!(
        listed.contains("settings") && listed.contains("DATA"),
        "{listed}"
    );

    // apply validates on the client with the protobuf OpenAPI document.
    let applied = kubectl.ok_stdin(&["apply", "-f", "-"], DEPLOYMENT).await?;
    ensure!(
        applied.contains("deployment.apps/old-client created"),
        "{applied}"
    );
    // The merge keys in the OpenAPI schemas make the second apply an empty patch.
    let again = kubectl.ok_stdin(&["apply", "-f", "-"], DEPLOYMENT).await?;
    ensure!(again.contains("unchanged"), "{again}");
    let scaled = DEPLOYMENT.replace("replicas: 1", "replicas: 3");
    let configured = kubectl.ok_stdin(&["apply", "-f", "-"], &scaled).await?;
    ensure!(configured.contains("configured"), "{configured}");
    let replicas = kubectl
        .ok(&[
            "get",
            "deploy",
            "old-client",
            "-o",
            "jsonpath={.spec.replicas}",
        ])
        .await?;
    ensure!(replicas == "3", "{replicas}");
    let bogus = DEPLOYMENT.replace("  replicas: 1\n", "  replicas: 1\n  bogusField: 1\n");
    let refused = kubectl.err(&["apply", "-f", "-"], Some(&bogus)).await?;
    ensure!(
        refused.contains("bogusField") && refused.contains("error validating"),
        "{refused}"
    );

    let explained = kubectl.ok(&["explain", "deployment.spec.replicas"]).await?;
    ensure!(
        explained.contains("replicas") && explained.contains("<integer>"),
        "{explained}"
    );

    let deleted = kubectl.ok(&["delete", "deployment", "old-client"]).await?;
    ensure!(deleted.contains("deleted"), "{deleted}");
    let gone = kubectl
        .err(&["get", "deployment", "old-client"], None)
        .await?;
    ensure!(gone.contains("not found"), "{gone}");
    let whoami = kubectl
        .ok(&["auth", "can-i", "delete", "configmaps"])
        .await?;
    ensure!(whoami.trim() == "yes", "{whoami}");
    cluster.stop().await
}
