//! Server-side apply and field management as kubectl users meet them: `kubectl apply
//! --server-side` creating, pruning and sharing fields, conflicts between managers and
//! `--force-conflicts`, the scale subresource taking `.spec.replicas`, server dry runs,
//! the managers kubectl's other commands record, and what clients may do to
//! `metadata.managedFields`. Also the CRD side of the same work: a deleted CRD takes
//! its objects with it, and `fieldValidation` on custom resources.

use std::process::Output;

use anyhow::{Context as _, Result, bail};
use serde_json::Value;
use trellis_tests::TestCluster;

fn deployment(replicas: u32, image: &str) -> String {
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  replicas: {replicas}
  selector:
    matchLabels: {{app: web}}
  template:
    metadata:
      labels: {{app: web}}
    spec:
      containers:
      - name: nginx
        image: {image}
        ports:
        - containerPort: 80
"#
    )
}

fn parse(out: &str) -> Result<Value> {
    serde_json::from_str(out).with_context(|| format!("parse kubectl output {out:?}"))
}

async fn get_json(cluster: &TestCluster, what: &[&str]) -> Result<Value> {
    let mut args = vec!["get"];
    args.extend_from_slice(what);
    args.extend_from_slice(&["-o", "json", "--show-managed-fields"]);
    parse(&cluster.kubectl_ok(&args).await?)
}

/// The managedFields entry of `manager` with `operation`.
fn entry<'a>(obj: &'a Value, manager: &str, operation: &str) -> Option<&'a Value> {
    obj["metadata"]["managedFields"]
        .as_array()?
        .iter()
        .find(|e| e["manager"] == manager && e["operation"] == operation)
}

fn managers(obj: &Value) -> Vec<String> {
    obj["metadata"]["managedFields"]
        .as_array()
        .map(|list| {
            list.iter()
                .map(|e| {
                    format!(
                        "{}/{}",
                        e["manager"].as_str().unwrap_or(""),
                        e["operation"].as_str().unwrap_or("")
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

async fn run_stdin(cluster: &TestCluster, args: &[&str], stdin: &str) -> Result<Output> {
    cluster.admin().run(args, Some(stdin)).await
}

#[tokio::test]
async fn apply_creates_owns_and_removes_what_it_no_longer_states() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let first = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: settings\n  labels: {tier: web}\ndata:\n  color: blue\n  size: large\n";
    let out = cluster
        .kubectl_ok_stdin(&["apply", "--server-side", "-f", "-"], first)
        .await?;
    assert!(
        out.contains("configmap/settings serverside-applied"),
        "{out}"
    );

    let cm = get_json(&cluster, &["configmap", "settings"]).await?;
    let mine = entry(&cm, "kubectl", "Apply").context("kubectl's Apply entry")?;
    assert_eq!(mine["apiVersion"], "v1");
    assert_eq!(mine["fieldsType"], "FieldsV1");
    assert!(mine["time"].is_string());
    assert_eq!(
        mine["fieldsV1"],
        serde_json::json!({
            "f:data": {"f:color": {}, "f:size": {}},
            "f:metadata": {"f:labels": {"f:tier": {}}}
        })
    );

    // Re-applied without `size` and the label: both go.
    let second =
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: settings\ndata:\n  color: red\n";
    cluster
        .kubectl_ok_stdin(&["apply", "--server-side", "-f", "-"], second)
        .await?;
    let cm = get_json(&cluster, &["configmap", "settings"]).await?;
    assert_eq!(cm["data"], serde_json::json!({"color": "red"}));
    assert!(cm["metadata"].get("labels").is_none(), "{cm}");

    // kubectl hides managedFields unless asked.
    let yaml = cluster
        .kubectl_ok(&["get", "configmap", "settings", "-o", "yaml"])
        .await?;
    assert!(!yaml.contains("managedFields"), "{yaml}");
    cluster.stop().await
}

#[tokio::test]
async fn two_managers_conflict_until_one_forces() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let apply = |manager: &'static str| {
        vec![
            "apply",
            "--server-side",
            "--field-manager",
            manager,
            "-f",
            "-",
        ]
    };
    cluster
        .kubectl_ok_stdin(&apply("alice"), &deployment(2, "nginx:1.27"))
        .await?;
    // The same values are shared, not a conflict.
    cluster
        .kubectl_ok_stdin(&apply("bob"), &deployment(2, "nginx:1.27"))
        .await?;

    let err = cluster
        .kubectl_err_stdin(&apply("bob"), &deployment(3, "nginx:1.27"))
        .await?;
    assert!(
        err.contains(r#"Apply failed with 1 conflict: conflict with "alice": .spec.replicas"#),
        "{err}"
    );
    let err = cluster
        .kubectl_err_stdin(&apply("bob"), &deployment(3, "nginx:1.28"))
        .await?;
    assert!(err.contains("Apply failed with 2 conflicts"), "{err}");
    assert!(
        err.contains(r#"- .spec.template.spec.containers[name="nginx"].image"#),
        "{err}"
    );

    let mut forced = apply("bob");
    forced.insert(2, "--force-conflicts");
    cluster
        .kubectl_ok_stdin(&forced, &deployment(3, "nginx:1.28"))
        .await?;
    let d = get_json(&cluster, &["deployment", "web"]).await?;
    assert_eq!(d["spec"]["replicas"], 3);
    let alice = entry(&d, "alice", "Apply").context("alice still owns something")?;
    assert!(
        alice["fieldsV1"]["f:spec"].get("f:replicas").is_none(),
        "{alice}"
    );
    let bob = entry(&d, "bob", "Apply").context("bob's entry")?;
    assert!(
        bob["fieldsV1"]["f:spec"].get("f:replicas").is_some(),
        "{bob}"
    );

    // Alice drops replicas from her configuration: bob still owns it, so it stays.
    let without_replicas = deployment(3, "nginx:1.28").replace("  replicas: 3\n", "");
    cluster
        .kubectl_ok_stdin(&apply("alice"), &without_replicas)
        .await?;
    let d = get_json(&cluster, &["deployment", "web"]).await?;
    assert_eq!(d["spec"]["replicas"], 3);
    cluster.stop().await
}

#[tokio::test]
async fn scaling_takes_replicas_so_reapplying_conflicts() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let apply = ["apply", "--server-side", "-f", "-"];
    cluster
        .kubectl_ok_stdin(&apply, &deployment(2, "nginx"))
        .await?;
    cluster
        .kubectl_ok(&["scale", "deployment", "web", "--replicas=5"])
        .await?;
    let d = get_json(&cluster, &["deployment", "web"]).await?;
    let scaler = d["metadata"]["managedFields"]
        .as_array()
        .and_then(|l| l.iter().find(|e| e["subresource"] == "scale"))
        .with_context(|| format!("an entry for the scale subresource: {:?}", managers(&d)))?;
    // kubectl scale names no field manager: the User-Agent's "kubectl" is its name.
    assert_eq!(scaler["manager"], "kubectl");
    assert_eq!(scaler["operation"], "Update");
    assert_eq!(scaler["apiVersion"], "apps/v1");
    assert_eq!(
        scaler["fieldsV1"],
        serde_json::json!({"f:spec": {"f:replicas": {}}})
    );

    let err = cluster
        .kubectl_err_stdin(&apply, &deployment(2, "nginx"))
        .await?;
    let expected = format!(
        "conflict with {:?} with subresource \"scale\" using apps/v1: .spec.replicas",
        scaler["manager"].as_str().unwrap_or("")
    );
    assert!(err.contains(&expected), "{err}");
    // Stating the scaled value is no conflict.
    cluster
        .kubectl_ok_stdin(&apply, &deployment(5, "nginx"))
        .await?;
    cluster.stop().await
}

#[tokio::test]
async fn server_dry_run_applies_nothing() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let apply = ["apply", "--server-side", "-f", "-"];
    cluster
        .kubectl_ok_stdin(&apply, &deployment(2, "nginx"))
        .await?;
    let before = get_json(&cluster, &["deployment", "web"]).await?;
    let out = cluster
        .kubectl_ok_stdin(
            &[
                "apply",
                "--server-side",
                "--dry-run=server",
                "-o",
                "json",
                "-f",
                "-",
            ],
            &deployment(4, "nginx:2"),
        )
        .await?;
    let preview = parse(&out)?;
    assert_eq!(preview["spec"]["replicas"], 4);
    let after = get_json(&cluster, &["deployment", "web"]).await?;
    assert_eq!(after, before);

    // A dry run of a new object creates nothing either.
    let cm = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ghost\ndata: {a: b}\n";
    cluster
        .kubectl_ok_stdin(
            &["apply", "--server-side", "--dry-run=server", "-f", "-"],
            cm,
        )
        .await?;
    let err = cluster.kubectl_err(&["get", "configmap", "ghost"]).await?;
    assert!(
        err.contains("NotFound") || err.contains("not found"),
        "{err}"
    );
    cluster.stop().await
}

#[tokio::test]
async fn other_writes_record_their_managers() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok(&["create", "configmap", "made", "--from-literal=color=blue"])
        .await?;
    let cm = get_json(&cluster, &["configmap", "made"]).await?;
    let created = entry(&cm, "kubectl-create", "Update")
        .with_context(|| format!("kubectl-create's entry: {:?}", managers(&cm)))?;
    assert!(
        created["fieldsV1"]["f:data"].get("f:color").is_some(),
        "{created}"
    );

    // Client-side apply records kubectl-client-side-apply; a server-side apply that
    // changes its field then conflicts with it.
    let csa = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: csa\ndata:\n  color: blue\n";
    cluster.kubectl_ok_stdin(&["apply", "-f", "-"], csa).await?;
    let cm = get_json(&cluster, &["configmap", "csa"]).await?;
    assert!(
        entry(&cm, "kubectl-client-side-apply", "Update").is_some(),
        "{:?}",
        managers(&cm)
    );
    let err = cluster
        .kubectl_err_stdin(
            &["apply", "--server-side", "-f", "-"],
            &csa.replace("blue", "green"),
        )
        .await?;
    assert!(
        err.contains(r#"conflict with "kubectl-client-side-apply" using v1: .data.color"#),
        "{err}"
    );

    // A patch takes over what it changes.
    cluster
        .kubectl_ok(&[
            "patch",
            "configmap",
            "made",
            "--type=merge",
            "-p",
            r#"{"data":{"color":"red"}}"#,
        ])
        .await?;
    let cm = get_json(&cluster, &["configmap", "made"]).await?;
    let patcher = entry(&cm, "kubectl-patch", "Update")
        .with_context(|| format!("kubectl-patch's entry: {:?}", managers(&cm)))?;
    assert!(
        patcher["fieldsV1"]["f:data"].get("f:color").is_some(),
        "{patcher}"
    );
    // kubectl-create keeps the data map it created, not the value it no longer set.
    let creator = entry(&cm, "kubectl-create", "Update").context("kubectl-create's entry")?;
    assert_eq!(
        creator["fieldsV1"],
        serde_json::json!({"f:data": {}}),
        "{creator}"
    );
    cluster.stop().await
}

#[tokio::test]
async fn managed_fields_can_be_cleared_but_not_broken() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok(&["create", "configmap", "c", "--from-literal=a=b"])
        .await?;
    let err = cluster
        .kubectl_err(&[
            "patch",
            "configmap",
            "c",
            "--type=json",
            "-p",
            r#"[{"op":"replace","path":"/metadata/managedFields/0/operation","value":"Delete"}]"#,
        ])
        .await?;
    assert!(err.contains("metadata.managedFields[0].operation"), "{err}");

    cluster
        .kubectl_ok(&[
            "patch",
            "configmap",
            "c",
            "--type=merge",
            "-p",
            r#"{"metadata":{"managedFields":[{}]}}"#,
        ])
        .await?;
    let cm = get_json(&cluster, &["configmap", "c"]).await?;
    assert!(cm["metadata"].get("managedFields").is_none(), "{cm}");
    assert_eq!(cm["data"]["a"], "b");

    // With no managers left, a first apply finds the fields owned by
    // "before-first-apply", as Kubernetes names them.
    let cm = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\ndata:\n  a: changed\n";
    let err = cluster
        .kubectl_err_stdin(&["apply", "--server-side", "-f", "-"], cm)
        .await?;
    assert!(
        err.contains(r#"conflict with "before-first-apply" using v1: .data.a"#),
        "{err}"
    );

    // An applied configuration may not carry managed fields.
    let with_managers = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: d\n  managedFields:\n  - {manager: me, operation: Apply}\ndata:\n  a: b\n";
    let err = cluster
        .kubectl_err_stdin(&["apply", "--server-side", "-f", "-"], with_managers)
        .await?;
    assert!(err.contains("metadata.managedFields must be nil"), "{err}");
    cluster.stop().await
}

const WIDGETS_CRD: &str = r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.example.com
spec:
  group: example.com
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              color: {type: string}
              ports:
                type: array
                x-kubernetes-list-type: map
                x-kubernetes-list-map-keys: [port]
                items:
                  type: object
                  properties:
                    port: {type: integer}
                    name: {type: string}
"#;

fn widget(name: &str, spec: &str) -> String {
    format!("apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: {name}\nspec:\n{spec}")
}

async fn with_widgets() -> Result<TestCluster> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok_stdin(&["apply", "--server-side", "-f", "-"], WIDGETS_CRD)
        .await?;
    Ok(cluster)
}

#[tokio::test]
async fn custom_resources_merge_lists_by_their_declared_keys() -> Result<()> {
    let cluster = with_widgets().await?;
    let apply = |m: &'static str| vec!["apply", "--server-side", "--field-manager", m, "-f", "-"];
    cluster
        .kubectl_ok_stdin(
            &apply("a"),
            &widget("w", "  color: red\n  ports:\n  - {port: 80, name: http}\n"),
        )
        .await?;
    cluster
        .kubectl_ok_stdin(
            &apply("b"),
            &widget("w", "  ports:\n  - {port: 443, name: https}\n"),
        )
        .await?;
    let w = get_json(&cluster, &["widget", "w"]).await?;
    let ports: Vec<i64> = w["spec"]["ports"]
        .as_array()
        .context("ports")?
        .iter()
        .filter_map(|p| p["port"].as_i64())
        .collect();
    assert_eq!(ports, [80, 443], "{w}");
    let b = entry(&w, "b", "Apply").context("b's entry")?;
    assert!(
        b["fieldsV1"]["f:spec"]["f:ports"]
            .get(r#"k:{"port":443}"#)
            .is_some(),
        "{b}"
    );
    // a drops its port; b's stays.
    cluster
        .kubectl_ok_stdin(&apply("a"), &widget("w", "  color: red\n"))
        .await?;
    let w = get_json(&cluster, &["widget", "w"]).await?;
    assert_eq!(
        w["spec"]["ports"],
        serde_json::json!([{"port": 443, "name": "https"}])
    );
    cluster.stop().await
}

#[tokio::test]
async fn unknown_fields_are_refused_or_warned() -> Result<()> {
    let cluster = with_widgets().await?;
    let bad = widget("odd", "  color: red\n  colour: red\n");
    let err = cluster
        .kubectl_err_stdin(&["create", "--validate=strict", "-f", "-"], &bad)
        .await?;
    assert!(
        err.contains(r#"unknown field \"spec.colour\""#)
            || err.contains(r#"unknown field "spec.colour""#),
        "{err}"
    );
    assert!(err.contains("BadRequest"), "{err}");

    let out = run_stdin(&cluster, &["create", "--validate=warn", "-f", "-"], &bad).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("create with --validate=warn failed: {stderr}");
    }
    assert!(
        stderr.contains(r#"Warning: unknown field "spec.colour""#),
        "{stderr}"
    );
    let w = get_json(&cluster, &["widget", "odd"]).await?;
    assert!(w["spec"].get("colour").is_none(), "pruned: {w}");

    // Built-in kinds warn the same way.
    let cm = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: odd\ncolour: red\n";
    let out = run_stdin(&cluster, &["create", "--validate=warn", "-f", "-"], cm).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(r#"Warning: unknown field "colour""#),
        "{stderr}"
    );
    cluster.stop().await
}

#[tokio::test]
async fn deleting_a_crd_deletes_its_objects() -> Result<()> {
    let cluster = with_widgets().await?;
    let crd = get_json(&cluster, &["crd", "widgets.example.com"]).await?;
    assert_eq!(
        crd["metadata"]["finalizers"],
        serde_json::json!(["customresourcecleanup.apiextensions.k8s.io"])
    );
    cluster
        .kubectl_ok_stdin(
            &["apply", "--server-side", "-f", "-"],
            &widget("plain", "  color: red\n"),
        )
        .await?;
    let held = "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: held\n  finalizers: [example.com/hold]\nspec:\n  color: blue\n";
    cluster
        .kubectl_ok_stdin(&["apply", "--server-side", "-f", "-"], held)
        .await?;

    // The held widget keeps the CRD terminating.
    cluster
        .kubectl_ok(&["delete", "crd", "widgets.example.com", "--wait=false"])
        .await?;
    let crd = get_json(&cluster, &["crd", "widgets.example.com"]).await?;
    assert!(crd["metadata"]["deletionTimestamp"].is_string(), "{crd}");
    let left = get_json(&cluster, &["widgets"]).await?;
    let names: Vec<&str> = left["items"]
        .as_array()
        .context("items")?
        .iter()
        .filter_map(|w| w["metadata"]["name"].as_str())
        .collect();
    assert_eq!(names, ["held"]);
    let err = cluster
        .kubectl_err_stdin(
            &["apply", "--server-side", "-f", "-"],
            &widget("late", "  color: red\n"),
        )
        .await?;
    assert!(
        err.contains("create not allowed while custom resource definition is terminating"),
        "{err}"
    );

    // Releasing it lets the CRD go, and a new CRD of the same name starts empty.
    cluster
        .kubectl_ok(&[
            "patch",
            "widget",
            "held",
            "--type=merge",
            "-p",
            r#"{"metadata":{"finalizers":null}}"#,
        ])
        .await?;
    let err = cluster
        .kubectl_err(&["get", "crd", "widgets.example.com"])
        .await?;
    assert!(err.contains("not found"), "{err}");
    cluster
        .kubectl_ok_stdin(&["apply", "--server-side", "-f", "-"], WIDGETS_CRD)
        .await?;
    let widgets = get_json(&cluster, &["widgets"]).await?;
    assert_eq!(widgets["items"], serde_json::json!([]));
    cluster.stop().await
}
