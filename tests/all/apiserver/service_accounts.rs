//! ServiceAccount tokens: issued through TokenRequest, authenticated as the account,
//! authorized by RBAC, and refused once the account is gone.

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use trellis_tests::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_account_tokens_authenticate_until_the_account_is_deleted() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let create = ["create", "--validate=false", "-f", "-"];
    cluster
        .kubectl_ok_stdin(
            &create,
            r#"{"apiVersion":"v1","kind":"ServiceAccount","metadata":{"name":"builder"}}"#,
        )
        .await?;
    let request_file = cluster.data_dir.join("token-request.json");
    std::fs::write(
        &request_file,
        r#"{"apiVersion":"authentication.k8s.io/v1","kind":"TokenRequest","spec":{"expirationSeconds":3600}}"#,
    )?;
    let path = "/api/v1/namespaces/default/serviceaccounts/builder/token";
    let answer = cluster
        .kubectl_ok(&[
            "create",
            "--raw",
            path,
            "-f",
            request_file.to_str().context("utf-8 path")?,
        ])
        .await?;
    let answer: Value = serde_json::from_str(&answer)?;
    let token = answer["status"]["token"]
        .as_str()
        .context("no token in the TokenRequest")?
        .to_owned();
    ensure!(
        answer["status"]["expirationTimestamp"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{answer}"
    );

    let builder = cluster.kubectl_with_token("builder", &token)?;
    let refused = builder.err(&["get", "pods"], None).await?;
    ensure!(
        refused.contains(
            "User \"system:serviceaccount:default:builder\" cannot list resource \"pods\""
        ),
        "{refused}"
    );

    let binding = r#"{"apiVersion":"rbac.authorization.k8s.io/v1","kind":"RoleBinding","metadata":{"name":"builder-view"},
        "roleRef":{"apiGroup":"rbac.authorization.k8s.io","kind":"ClusterRole","name":"view"},
        "subjects":[{"kind":"ServiceAccount","name":"builder","namespace":"default"}]}"#;
    cluster.kubectl_ok_stdin(&create, binding).await?;
    builder
        .ok(&["get", "pods"])
        .await
        .context("the bound account lists pods")?;

    cluster
        .kubectl_ok(&["delete", "serviceaccount", "builder"])
        .await?;
    let gone = builder.err(&["get", "pods"], None).await?;
    ensure!(
        gone.contains("Unauthorized") || gone.contains("provide credentials"),
        "{gone}"
    );
    Ok(())
}
