//! kubectl's uses of OpenAPI: apply with validation on, unknown fields refused under
//! strict validation, and explain for built-in and custom kinds.

use anyhow::{Result, ensure};
use trellis_tests::TestCluster;

const DEPLOYMENT: &str = "apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  selector:
    matchLabels: {app: web}
  template:
    metadata:
      labels: {app: web}
    spec:
      containers:
      - name: nginx
        image: nginx:1.25
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_apply_validates_and_explain_reads_the_schemas() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let applied = cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], DEPLOYMENT)
        .await?;
    ensure!(applied.contains("deployment.apps/web created"), "{applied}");
    let again = cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], DEPLOYMENT)
        .await?;
    ensure!(again.contains("unchanged"), "{again}");

    let bogus = DEPLOYMENT
        .replace("  name: web\n", "  name: bogus\n")
        .replace("spec:\n  selector", "spec:\n  bogusField: 1\n  selector");
    let refused = cluster
        .kubectl_err_stdin(&["apply", "-f", "-"], &bogus)
        .await?;
    ensure!(
        refused.contains("unknown field") && refused.contains("bogusField"),
        "{refused}"
    );

    let explained = cluster
        .kubectl_ok(&["explain", "deployment.spec.replicas"])
        .await?;
    ensure!(
        explained.contains("replicas") && explained.contains("<integer>"),
        "{explained}"
    );
    let surge = cluster
        .kubectl_ok(&["explain", "deployment.spec.strategy.rollingUpdate.maxSurge"])
        .await?;
    ensure!(surge.contains("IntOrString"), "{surge}");
    Ok(())
}
