//! A node's credentials reach its own Node, its Lease and the pods bound to it, and
//! nothing else.

use anyhow::{Result, ensure};
use trellis_tests::TestCluster;

const NODE: &str = r#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"n1"}}"#;
const OTHER_NODE: &str = r#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"n2"}}"#;

fn pod(name: &str, node: &str) -> String {
    format!(
        r#"{{"apiVersion":"v1","kind":"Pod","metadata":{{"name":"{name}"}},"spec":{{"nodeName":"{node}","containers":[{{"name":"c","image":"nginx"}}]}}}}"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_reaches_only_its_node_lease_and_bound_pods() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let node = cluster.kubectl_with_cert("system:node:n1", &["system:nodes"])?;
    let create = ["create", "--validate=false", "-f", "-"];

    node.ok_stdin(&create, NODE).await?;
    let refused = node.err(&create, Some(OTHER_NODE)).await?;
    ensure!(
        refused.contains("User \"system:node:n1\" cannot create resource \"nodes\""),
        "{refused}"
    );

    cluster
        .kubectl_ok_stdin(&create, &pod("mine", "n1"))
        .await?;
    cluster
        .kubectl_ok_stdin(&create, &pod("theirs", "n2"))
        .await?;
    ensure!(node.ok(&["get", "pod", "mine", "-o", "name"]).await?.trim() == "pod/mine");
    let refused = node.err(&["get", "pod", "theirs"], None).await?;
    ensure!(
        refused.contains("Forbidden") || refused.contains("forbidden"),
        "{refused}"
    );
    // Lists only with the node's own field selector.
    let listed = node
        .ok(&[
            "get",
            "pods",
            "--field-selector",
            "spec.nodeName=n1",
            "-o",
            "name",
        ])
        .await?;
    ensure!(listed.trim() == "pod/mine", "{listed}");
    ensure!(
        node.err(&["get", "pods"], None)
            .await?
            .contains("forbidden")
    );

    let lease = r#"{"apiVersion":"coordination.k8s.io/v1","kind":"Lease","metadata":{"name":"n1","namespace":"kube-node-lease"},"spec":{"holderIdentity":"n1"}}"#;
    node.ok_stdin(
        &[
            "create",
            "--validate=false",
            "-n",
            "kube-node-lease",
            "-f",
            "-",
        ],
        lease,
    )
    .await?;
    // Another node's Lease is not its to write or read.
    let other_lease = lease.replace("\"name\":\"n1\"", "\"name\":\"n2\"");
    let refused = node
        .err(
            &[
                "create",
                "--validate=false",
                "-n",
                "kube-node-lease",
                "-f",
                "-",
            ],
            Some(&other_lease),
        )
        .await?;
    ensure!(
        refused.contains("User \"system:node:n1\" cannot create resource \"leases\""),
        "{refused}"
    );
    // Its own Node's status is its to write; another's is not.
    let ready = r#"{"status":{"conditions":[{"type":"Ready","status":"True","reason":"KubeletReady","message":"ready"}]}}"#;
    node.ok(&[
        "patch",
        "node",
        "n1",
        "--subresource=status",
        "--type=merge",
        "-p",
        ready,
    ])
    .await?;
    let status = cluster
        .kubectl_ok(&[
            "get",
            "node",
            "n1",
            "-o",
            "jsonpath={.status.conditions[0].status}",
        ])
        .await?;
    ensure!(status == "True", "status {status:?}");
    cluster.kubectl_ok_stdin(&create, OTHER_NODE).await?;
    let refused = node
        .err(
            &[
                "patch",
                "node",
                "n2",
                "--subresource=status",
                "--type=merge",
                "-p",
                ready,
            ],
            None,
        )
        .await?;
    ensure!(
        refused.contains("forbidden") || refused.contains("Forbidden"),
        "{refused}"
    );
    ensure!(
        node.err(&["get", "configmaps"], None)
            .await?
            .contains("forbidden")
    );
    ensure!(
        node.err(&["get", "secrets", "-n", "kube-system"], None)
            .await?
            .contains("forbidden")
    );
    Ok(())
}
