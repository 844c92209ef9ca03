//! The API server as kubectl sees it: each test starts its own cluster (an embedded
//! store and the server on a free port) and drives it with the system kubectl through
//! the server's `admin.kubeconfig`. Raw requests go through `kubectl get/create/delete
//! --raw`, so they carry the same client certificate.
//!
//! Writes from files go through kubectl's own validation against the server's OpenAPI,
//! as a user's would; tests of the server's refusals pass `--validate=false` so that
//! the server, not kubectl, is what refuses.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::Api;
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, BufReader, Lines};
use tokio::process::ChildStdout;
use trellis_api::UserInfo;
use trellis_client::informer::SharedInformers;
use trellis_tests::TestCluster;

/// A Deployment, a ConfigMap and a Secret with `stringData`, as one YAML stream.
const WEB_APP: &str = r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  replicas: 2
  selector:
    matchLabels: {app: web}
  template:
    metadata:
      labels: {app: web}
    spec:
      containers:
      - name: nginx
        image: nginx:1.27
      - name: sidecar
        image: busybox
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: settings
data:
  color: blue
---
apiVersion: v1
kind: Secret
metadata:
  name: creds
stringData:
  password: hunter2
"#;

/// Two pods: one container, and two.
const PODS: &str = r#"apiVersion: v1
kind: Pod
metadata:
  name: p1
  labels: {app: demo}
spec:
  containers:
  - name: main
    image: busybox
---
apiVersion: v1
kind: Pod
metadata:
  name: p2
spec:
  containers:
  - name: main
    image: busybox
  - name: helper
    image: busybox
"#;

/// ConfigMaps named `names` in the request's namespace, each with one key, as one
/// YAML stream.
fn config_maps(names: &[&str]) -> String {
    names
        .iter()
        .map(|name| {
            format!("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {name}\ndata:\n  k: v\n")
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

/// The rows of a `kubectl get` table, header first, each split into its columns.
fn table(out: &str) -> Vec<Vec<&str>> {
    out.lines()
        .map(|line| line.split_whitespace().collect())
        .collect()
}

/// The rows of a table without their last column (AGE, which changes with time).
fn table_without_age(out: &str) -> Vec<Vec<&str>> {
    table(out)
        .into_iter()
        .map(|mut row| {
            row.pop();
            row
        })
        .collect()
}

fn parse_json(text: &str) -> Result<Value> {
    serde_json::from_str(text).with_context(|| format!("parse kubectl's output as JSON: {text}"))
}

fn is_uuid(s: &str) -> bool {
    let lengths: Vec<usize> = s.split('-').map(str::len).collect();
    lengths == [8, 4, 4, 4, 12] && s.chars().all(|c| c == '-' || c.is_ascii_hexdigit())
}

/// `2025-01-02T03:04:05Z`, as Kubernetes writes `metav1.Time`.
fn is_timestamp(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 20
        && b.iter().enumerate().all(|(i, c)| match i {
            4 | 7 => *c == b'-',
            10 => *c == b'T',
            13 | 16 => *c == b':',
            19 => *c == b'Z',
            _ => c.is_ascii_digit(),
        })
}

/// The names of a list's items, in order.
fn item_names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .filter_map(|i| i["metadata"]["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_namespaces_are_listed_as_active() -> Result<()> {
    let cluster = TestCluster::start().await?;

    let out = cluster.kubectl_ok(&["get", "ns"]).await?;
    assert_eq!(
        table_without_age(&out),
        [
            vec!["NAME", "STATUS"],
            vec!["default", "Active"],
            vec!["kube-node-lease", "Active"],
            vec!["kube-public", "Active"],
            vec!["kube-system", "Active"],
        ],
        "kubectl get ns:\n{out}"
    );
    assert_eq!(table(&out)[0], ["NAME", "STATUS", "AGE"]);
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_from_stdin_defaults_the_deployment_and_encodes_secret_string_data() -> Result<()> {
    let cluster = TestCluster::start().await?;

    let out = cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], WEB_APP)
        .await?;
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "deployment.apps/web created",
            "configmap/settings created",
            "secret/creds created"
        ]
    );

    let deploy = parse_json(
        &cluster
            .kubectl_ok(&["get", "deploy", "web", "-o", "json"])
            .await?,
    )?;
    let spec = &deploy["spec"];
    assert_eq!(
        spec["strategy"],
        json!({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}})
    );
    assert_eq!(spec["revisionHistoryLimit"], 10);
    assert_eq!(spec["progressDeadlineSeconds"], 600);
    assert_eq!(spec["replicas"], 2);
    let pod = &spec["template"]["spec"];
    assert_eq!(pod["restartPolicy"], "Always");
    assert_eq!(pod["dnsPolicy"], "ClusterFirst");
    assert_eq!(pod["terminationGracePeriodSeconds"], 30);
    // A tagged image is pulled if not present; an untagged one means :latest, always pulled.
    assert_eq!(pod["containers"][0]["imagePullPolicy"], "IfNotPresent");
    assert_eq!(pod["containers"][1]["imagePullPolicy"], "Always");
    assert_eq!(
        pod["containers"][0]["terminationMessagePath"],
        "/dev/termination-log"
    );

    let meta = &deploy["metadata"];
    assert_eq!(meta["generation"], 1);
    assert_eq!(meta["namespace"], "default");
    let uid = meta["uid"].as_str().unwrap_or_default();
    assert!(is_uuid(uid), "uid {uid:?} is not a UUID");
    let created = meta["creationTimestamp"].as_str().unwrap_or_default();
    assert!(is_timestamp(created), "creationTimestamp {created:?}");
    let rv = meta["resourceVersion"].as_str().unwrap_or_default();
    assert!(
        rv.parse::<u64>().is_ok_and(|n| n > 0),
        "resourceVersion {rv:?}"
    );

    let secret = parse_json(
        &cluster
            .kubectl_ok(&["get", "secret", "creds", "-o", "json"])
            .await?,
    )?;
    // base64("hunter2")
    assert_eq!(secret["data"], json!({"password": "aHVudGVyMg=="}));
    assert_eq!(secret.get("stringData"), None, "{secret:#}");
    assert_eq!(secret["type"], "Opaque");

    let color = cluster
        .kubectl_ok(&["get", "cm", "settings", "-o", "jsonpath={.data.color}"])
        .await?;
    assert_eq!(color, "blue");
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_creates_then_reports_unchanged_then_configured() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let apply = ["apply", "-f", "-"];
    let v1 = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: applied\ndata:\n  a: \"1\"\n";
    let v2 = v1.replace("\"1\"", "\"2\"");

    assert_eq!(
        cluster.kubectl_ok_stdin(&apply, v1).await?,
        "configmap/applied created\n"
    );
    assert_eq!(
        cluster.kubectl_ok_stdin(&apply, v1).await?,
        "configmap/applied unchanged\n"
    );
    assert_eq!(
        cluster.kubectl_ok_stdin(&apply, &v2).await?,
        "configmap/applied configured\n"
    );

    let cm = parse_json(
        &cluster
            .kubectl_ok(&["get", "cm", "applied", "-o", "json"])
            .await?,
    )?;
    assert_eq!(cm["data"], json!({"a": "2"}));
    let last_applied =
        cm["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"]
            .as_str()
            .unwrap_or_default();
    assert_eq!(parse_json(last_applied)?["data"], json!({"a": "2"}));
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_changes_one_port_and_keeps_the_others() -> Result<()> {
    // kubectl's patch names only the changed element, by the list's merge key
    // (`port`, not `name`); merged by anything else the other port would be lost.
    let cluster = TestCluster::start().await?;
    let apply = ["apply", "-f", "-"];
    let v1 = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\nspec:\n  selector:\n    app: web\n  ports:\n  - name: http\n    port: 80\n    targetPort: 8080\n  - name: https\n    port: 443\n    targetPort: 8443\n";
    let v2 = v1.replace("8443", "9443");
    cluster.kubectl_ok_stdin(&apply, v1).await?;
    assert_eq!(
        cluster.kubectl_ok_stdin(&apply, &v2).await?,
        "service/web configured\n"
    );
    let ports = cluster
        .kubectl_ok(&[
            "get",
            "service",
            "web",
            "-o",
            "jsonpath={range .spec.ports[*]}{.name}={.port}:{.targetPort} {end}",
        ])
        .await?;
    assert_eq!(ports.trim(), "http=80:8080 https=443:9443");
    cluster.stop().await
}

/// A Deployment with three containers and a rolling update with its parameters.
const ROLLING: &str = r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  selector:
    matchLabels: {app: web}
  strategy:
    type: RollingUpdate
    rollingUpdate: {maxSurge: 1, maxUnavailable: 0}
  template:
    metadata:
      labels: {app: web}
    spec:
      containers:
      - name: web
        image: nginx:1.27
      - name: log
        image: fluent-bit:3
      - name: proxy
        image: envoy:1.31
"#;

/// [`ROLLING`] edited: `log` removed, `proxy` moved first, `Recreate` instead.
const RECREATE: &str = r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  selector:
    matchLabels: {app: web}
  strategy:
    type: Recreate
  template:
    metadata:
      labels: {app: web}
    spec:
      containers:
      - name: proxy
        image: envoy:1.31
      - name: web
        image: nginx:1.27
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_reorders_and_removes_containers_and_clears_the_old_strategy() -> Result<()> {
    // kubectl's patch orders the containers with `$setElementOrder/containers`, removes
    // one with a `$patch: delete` element and sends `$retainKeys` with the strategy.
    let cluster = TestCluster::start().await?;
    let apply = ["apply", "-f", "-"];
    assert_eq!(
        cluster.kubectl_ok_stdin(&apply, ROLLING).await?,
        "deployment.apps/web created\n"
    );
    // A container the file never had, added by someone else: a patch without
    // `$setElementOrder` puts it before the containers it is not ordered against.
    cluster
        .kubectl_ok(&[
            "patch",
            "deploy",
            "web",
            "-p",
            r#"{"spec":{"template":{"spec":{"containers":[{"name":"injected","image":"busybox"}]}}}}"#,
        ])
        .await?;
    assert_eq!(
        cluster.kubectl_ok_stdin(&apply, RECREATE).await?,
        "deployment.apps/web configured\n"
    );

    let stored = parse_json(
        &cluster
            .kubectl_ok(&["get", "deploy", "web", "-o", "json"])
            .await?,
    )?;
    let containers: Vec<(&str, &str)> = stored["spec"]["template"]["spec"]["containers"]
        .as_array()
        .context("containers")?
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap_or_default(),
                c["image"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    // Had kubectl replaced the list, `injected` would be gone; it keeps its place.
    assert_eq!(
        containers,
        [
            ("injected", "busybox"),
            ("proxy", "envoy:1.31"),
            ("web", "nginx:1.27")
        ],
        "{stored}"
    );
    assert_eq!(stored["spec"]["strategy"], json!({"type": "Recreate"}));
    assert!(!stored.to_string().contains("$setElementOrder"), "{stored}");

    // The same apply again: while `injected` is there kubectl sends the order again,
    // which changes nothing.
    assert_eq!(
        cluster.kubectl_ok_stdin(&apply, RECREATE).await?,
        "deployment.apps/web configured\n"
    );
    let again = parse_json(
        &cluster
            .kubectl_ok(&["get", "deploy", "web", "-o", "json"])
            .await?,
    )?;
    assert_eq!(
        again["metadata"]["resourceVersion"], stored["metadata"]["resourceVersion"],
        "{again}"
    );

    // A directive the server does not know is the client's error, naming the field.
    let err = cluster
        .kubectl_err(&[
            "patch",
            "deploy",
            "web",
            "-p",
            r#"{"spec":{"strategy":{"$patch":"merge"}}}"#,
        ])
        .await?;
    assert!(
        err.contains("Error from server (BadRequest)") && err.contains("spec.strategy.$patch"),
        "{err}"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_prints_tables_names_jsonpath_and_yaml() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let objects = format!("{PODS}---\n{WEB_APP}");
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &objects)
        .await?;

    let pods = cluster.kubectl_ok(&["get", "pods"]).await?;
    assert_eq!(
        table(&pods)[0],
        ["NAME", "READY", "STATUS", "RESTARTS", "AGE"],
        "{pods}"
    );
    assert_eq!(
        table_without_age(&pods)[1..],
        [
            vec!["p1", "0/1", "Pending", "0"],
            vec!["p2", "0/2", "Pending", "0"]
        ],
        "{pods}"
    );

    let deployments = cluster.kubectl_ok(&["get", "deploy"]).await?;
    assert_eq!(
        table(&deployments)[0],
        ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"],
        "{deployments}"
    );
    assert_eq!(
        table_without_age(&deployments)[1..],
        [vec!["web", "0/2", "0", "0"]],
        "{deployments}"
    );

    assert_eq!(
        cluster.kubectl_ok(&["get", "pods", "-o", "name"]).await?,
        "pod/p1\npod/p2\n"
    );
    assert_eq!(
        cluster
            .kubectl_ok(&["get", "pods", "-o", "jsonpath={.items[*].metadata.name}"])
            .await?,
        "p1 p2"
    );

    let yaml = cluster
        .kubectl_ok(&["get", "pod", "p1", "-o", "yaml"])
        .await?;
    let pod: Value =
        serde_saphyr::from_str(&yaml).with_context(|| format!("parse as YAML: {yaml}"))?;
    assert_eq!(pod["apiVersion"], "v1");
    assert_eq!(pod["kind"], "Pod");
    assert_eq!(pod["metadata"]["name"], "p1");
    assert_eq!(pod["metadata"]["labels"], json!({"app": "demo"}));
    assert_eq!(pod["spec"]["containers"][0]["image"], "busybox");
    assert_eq!(pod["status"]["phase"], "Pending");
    cluster.stop().await
}

/// The other kinds kubectl prints with columns of their own; a Node's come from its
/// status, written through `nodes/status`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_prints_the_columns_of_replicasets_nodes_events_secrets_and_leases() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let objects = "apiVersion: apps/v1
kind: ReplicaSet
metadata: {name: rs}
spec:
  replicas: 3
  selector: {matchLabels: {app: rs}}
  template:
    metadata: {labels: {app: rs}}
    spec: {containers: [{name: c, image: busybox}]}
---
apiVersion: v1
kind: Node
metadata:
  name: n1
  labels: {node-role.kubernetes.io/control-plane: \"\"}
---
apiVersion: v1
kind: Node
metadata: {name: n2}
status:
  conditions: [{type: Ready, status: \"True\", reason: KubeletReady, message: ready}]
  nodeInfo: {kubeletVersion: v1.31.4, architecture: amd64, bootID: \"\", containerRuntimeVersion: \"\", kernelVersion: \"\", kubeProxyVersion: \"\", machineID: \"\", operatingSystem: linux, osImage: \"\", systemUUID: \"\"}
---
apiVersion: v1
kind: Event
metadata: {name: p1.backoff}
type: Warning
reason: BackOff
message: Back-off restarting failed container
involvedObject: {kind: Pod, name: p1, namespace: default}
---
apiVersion: v1
kind: Secret
metadata: {name: s}
type: Opaque
stringData: {a: \"1\", b: \"2\"}
---
apiVersion: coordination.k8s.io/v1
kind: Lease
metadata: {name: l}
spec: {holderIdentity: n1}
";
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], objects)
        .await?;
    let status = r#"{"status":{"conditions":[{"type":"Ready","status":"True","reason":"KubeletReady","message":"ready"}],"nodeInfo":{"kubeletVersion":"v1.32.0","architecture":"amd64","bootID":"","containerRuntimeVersion":"","kernelVersion":"","kubeProxyVersion":"","machineID":"","operatingSystem":"linux","osImage":"","systemUUID":""}}}"#;
    cluster
        .kubectl_ok(&[
            "patch",
            "node",
            "n1",
            "--subresource=status",
            "--type=merge",
            "-p",
            status,
        ])
        .await?;

    let rs = cluster.kubectl_ok(&["get", "rs"]).await?;
    assert_eq!(
        table(&rs),
        [
            vec!["NAME", "DESIRED", "CURRENT", "READY", "AGE"],
            vec!["rs", "3", "0", "0", table(&rs)[1][4]]
        ],
        "{rs}"
    );
    let nodes = cluster.kubectl_ok(&["get", "nodes"]).await?;
    let rows = table(&nodes);
    assert_eq!(
        rows[0],
        ["NAME", "STATUS", "ROLES", "AGE", "VERSION"],
        "{nodes}"
    );
    assert_eq!(
        [rows[1][0], rows[1][1], rows[1][2], rows[1][4]],
        ["n1", "Ready", "control-plane", "v1.32.0"],
        "{nodes}"
    );
    // A node registered with its status keeps it.
    assert_eq!(
        [rows[2][0], rows[2][1], rows[2][2], rows[2][4]],
        ["n2", "Ready", "<none>", "v1.31.4"],
        "{nodes}"
    );
    let events = cluster.kubectl_ok(&["get", "events"]).await?;
    let rows = table(&events);
    assert_eq!(
        rows[0],
        ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"],
        "{events}"
    );
    assert_eq!(
        rows[1][1..],
        [
            "Warning",
            "BackOff",
            "pod/p1",
            "Back-off",
            "restarting",
            "failed",
            "container"
        ],
        "{events}"
    );
    let secrets = cluster.kubectl_ok(&["get", "secrets", "s"]).await?;
    assert_eq!(
        table_without_age(&secrets),
        [vec!["NAME", "TYPE", "DATA"], vec!["s", "Opaque", "2"]],
        "{secrets}"
    );
    let leases = cluster.kubectl_ok(&["get", "leases"]).await?;
    assert_eq!(
        table_without_age(&leases),
        [vec!["NAME", "HOLDER"], vec!["l", "n1"]],
        "{leases}"
    );

    // `-o wide`: the columns of priority 1, in kubectl 1.20 and the current one.
    let pod = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"wide"},
        "spec":{"nodeName":"n1","containers":[{"name":"c","image":"busybox"}],
                "readinessGates":[{"conditionType":"example.com/gate"}]}}"#;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], pod)
        .await?;
    cluster
        .kubectl_ok(&[
            "patch",
            "pod",
            "wide",
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"podIP":"10.1.2.3","conditions":[{"type":"example.com/gate","status":"True"}]}}"#,
        ])
        .await?;
    let kubectl_1_20 = cluster.kubectl_1_20()?;
    for (version, pods) in [
        (
            "current",
            cluster.kubectl_ok(&["get", "pods", "-o", "wide"]).await?,
        ),
        (
            "1.20",
            kubectl_1_20.ok(&["get", "pods", "-o", "wide"]).await?,
        ),
    ] {
        let rows = table(&pods);
        assert_eq!(
            rows[0],
            [
                "NAME",
                "READY",
                "STATUS",
                "RESTARTS",
                "AGE",
                "IP",
                "NODE",
                "NOMINATED",
                "NODE",
                "READINESS",
                "GATES"
            ],
            "kubectl {version}: {pods}"
        );
        assert_eq!(
            rows[1][5..],
            ["10.1.2.3", "n1", "<none>", "1/1"],
            "kubectl {version}: {pods}"
        );
    }
    let rs = cluster.kubectl_ok(&["get", "rs", "-o", "wide"]).await?;
    let rows = table(&rs);
    assert_eq!(rows[0][5..], ["CONTAINERS", "IMAGES", "SELECTOR"], "{rs}");
    assert_eq!(rows[1][5..], ["c", "busybox", "app=rs"], "{rs}");
    let nodes = cluster.kubectl_ok(&["get", "nodes", "-o", "wide"]).await?;
    assert_eq!(
        table(&nodes)[0][5..],
        [
            "INTERNAL-IP",
            "EXTERNAL-IP",
            "OS-IMAGE",
            "KERNEL-VERSION",
            "CONTAINER-RUNTIME"
        ],
        "{nodes}"
    );
    cluster.stop().await
}

/// kubectl's Accept header for `kubectl get`: a Table, else the object.
const TABLE: &str = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json";

/// A GET on `connection` that accepts a Table: the status and the body, whole or (for
/// a watch) up to the end of its first event.
async fn get_table(
    cluster: &TestCluster,
    connection: &hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>>,
    path: &str,
) -> Result<(u16, Value)> {
    use http_body_util::BodyExt as _;
    let mut request = cluster.http2_request("GET", path)?;
    request
        .headers_mut()
        .insert("accept", hyper::header::HeaderValue::from_static(TABLE));
    let response = connection.clone().send_request(request).await?;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut seen = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                seen.extend_from_slice(&data);
                if seen.contains(&b'\n') {
                    break;
                }
            }
        }
        anyhow::Ok(())
    })
    .await
    .with_context(|| format!("{path}: no answer within 10 s"))??;
    let line = seen.split(|b| *b == b'\n').next().unwrap_or_default();
    let value = serde_json::from_slice(line)
        .with_context(|| format!("{path}: {}", String::from_utf8_lossy(&seen)))?;
    Ok((status, value))
}

/// Regression: every Table row carried a `PartialObjectMetadata` whatever
/// `includeObject` asked for, so `kubectl get --sort-by` (which asks for `Object` and
/// sorts by the rows' objects) printed "No resources found" for any field outside
/// `metadata`. Rows carry the metadata by default, the whole object or nothing when
/// asked, in lists, gets and watches; any other value is a 400 as in Kubernetes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_rows_carry_the_object_include_object_asks_for() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let connection = cluster.http2().await?;
    let pods = "/api/v1/namespaces/default/pods";
    let (_, empty) = get_table(&cluster, &connection, pods).await?;
    let before = empty["metadata"]["resourceVersion"]
        .as_str()
        .context("the Table's resourceVersion")?
        .to_owned();
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], PODS)
        .await?;

    let metadata = |object: &Value, name: &str| {
        object["kind"] == "PartialObjectMetadata"
            && object["apiVersion"] == "meta.k8s.io/v1"
            && object["metadata"]["name"] == name
            && object.get("spec").is_none()
    };
    let whole = |object: &Value, name: &str| {
        object["kind"] == "Pod"
            && object["apiVersion"] == "v1"
            && object["metadata"]["name"] == name
            && object["spec"]["containers"][0]["name"] == "main"
            && object["status"]["phase"] == "Pending"
    };
    let nothing = |object: &Value, _: &str| object.is_null();
    type Check<'a> = &'a dyn Fn(&Value, &str) -> bool;
    let both: &[&str] = &["p1", "p2"];
    let cases: [(String, &[&str], Check); 5] = [
        (pods.to_owned(), both, &metadata),
        (format!("{pods}?includeObject=Metadata"), both, &metadata),
        // What kubectl asks for with --sort-by.
        (format!("{pods}?includeObject=Object"), both, &whole),
        (format!("{pods}?includeObject=None"), both, &nothing),
        (format!("{pods}/p2?includeObject=Object"), &["p2"], &whole),
    ];
    for (path, names, check) in cases {
        let (status, table) = get_table(&cluster, &connection, &path).await?;
        ensure!(status == 200 && table["kind"] == "Table", "{path}: {table}");
        let rows = table["rows"].as_array().context("rows")?;
        ensure!(rows.len() == names.len(), "{path}: {table}");
        for (row, name) in rows.iter().zip(names) {
            ensure!(row["cells"][0] == *name, "{path}: {row}");
            let object = row.get("object").unwrap_or(&Value::Null);
            ensure!(check(object, name), "{path}: {name}'s row carries {object}");
        }
    }

    // A watch of Tables (kubectl get -w) carries what its rows are asked to.
    for (query, check) in [
        ("", &metadata as Check),
        ("&includeObject=Object", &whole),
        ("&includeObject=None", &nothing),
    ] {
        let path = format!("{pods}?watch=1&resourceVersion={before}{query}");
        let (status, event) = get_table(&cluster, &connection, &path).await?;
        ensure!(status == 200 && event["type"] == "ADDED", "{path}: {event}");
        let row = &event["object"]["rows"][0];
        let object = row.get("object").unwrap_or(&Value::Null);
        ensure!(
            event["object"]["kind"] == "Table" && row["cells"][0] == "p1" && check(object, "p1"),
            "{path}: {event}"
        );
    }

    // Any other value is refused, as kube-apiserver refuses it; without a Table it is
    // not read at all.
    let (status, refused) =
        get_table(&cluster, &connection, &format!("{pods}?includeObject=All")).await?;
    ensure!(
        status == 400
            && refused["kind"] == "Status"
            && refused["reason"] == "BadRequest"
            && refused["message"]
                .as_str()
                .is_some_and(|m| m.contains("includeObject")),
        "{refused}"
    );
    let plain = cluster
        .request(
            "GET",
            &format!("{pods}?includeObject=All"),
            "application/json",
            "",
        )
        .await?;
    ensure!(plain.status == 200, "without a Table: {}", plain.status);
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn label_and_field_selectors_filter_config_maps() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok_stdin(
            &["create", "-f", "-"],
            &config_maps(&["cm-a", "cm-b", "cm-c"]),
        )
        .await?;
    assert_eq!(
        cluster
            .kubectl_ok(&["label", "cm", "cm-a", "tier=a"])
            .await?,
        "configmap/cm-a labeled\n"
    );
    cluster
        .kubectl_ok(&["label", "cm", "cm-b", "tier=b"])
        .await?;
    assert_eq!(
        cluster
            .kubectl_ok(&["annotate", "cm", "cm-a", "note=hello"])
            .await?,
        "configmap/cm-a annotated\n"
    );
    assert_eq!(
        cluster
            .kubectl_ok(&[
                "get",
                "cm",
                "cm-a",
                "-o",
                "jsonpath={.metadata.annotations.note}"
            ])
            .await?,
        "hello"
    );

    let names = async |selector: &[&str]| -> Result<String> {
        let mut args = vec!["get", "cm", "-o", "name"];
        args.extend_from_slice(selector);
        cluster.kubectl_ok(&args).await
    };
    assert_eq!(names(&["-l", "tier=a"]).await?, "configmap/cm-a\n");
    assert_eq!(
        names(&["-l", "tier in (a,b)"]).await?,
        "configmap/cm-a\nconfigmap/cm-b\n"
    );
    assert_eq!(names(&["-l", "!tier"]).await?, "configmap/cm-c\n");
    // notin also matches objects without the label.
    assert_eq!(
        names(&["-l", "tier notin (a)"]).await?,
        "configmap/cm-b\nconfigmap/cm-c\n"
    );
    assert_eq!(
        names(&["--field-selector", "metadata.name=cm-c"]).await?,
        "configmap/cm-c\n"
    );
    assert_eq!(
        names(&["--field-selector", "metadata.name!=cm-c"]).await?,
        "configmap/cm-a\nconfigmap/cm-b\n"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replace_with_a_stale_resource_version_is_a_conflict() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &config_maps(&["settings"]))
        .await?;
    let mut stale = parse_json(
        &cluster
            .kubectl_ok(&["get", "cm", "settings", "-o", "json"])
            .await?,
    )?;
    cluster
        .kubectl_ok(&["label", "cm", "settings", "color=red"])
        .await?;

    stale["data"]["k"] = json!("from a stale copy");
    let err = cluster
        .kubectl_err_stdin(
            &["replace", "--validate=false", "-f", "-"],
            &stale.to_string(),
        )
        .await?;
    assert!(err.contains("Error from server (Conflict)"), "{err}");
    assert!(
        err.contains(
            r#"Operation cannot be fulfilled on configmaps "settings": the object has been modified; please apply your changes to the latest version and try again"#
        ),
        "{err}"
    );

    let current = parse_json(
        &cluster
            .kubectl_ok(&["get", "cm", "settings", "-o", "json"])
            .await?,
    )?;
    assert_eq!(current["data"], json!({"k": "v"}));
    assert_eq!(current["metadata"]["labels"], json!({"color": "red"}));
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_without_containers_is_invalid() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let pod = r#"{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "empty"}, "spec": {}}"#;

    // -v=6 logs each response's status line.
    let err = cluster
        .kubectl_err_stdin(&["create", "--validate=false", "-f", "-", "-v=6"], pod)
        .await?;
    assert!(err.contains("422 Unprocessable Entity"), "{err}");
    assert!(
        err.contains(r#"The Pod "empty" is invalid: spec.containers: Required value"#),
        "{err}"
    );
    let err = cluster.kubectl_err(&["get", "pod", "empty"]).await?;
    assert!(
        err.contains(r#"Error from server (NotFound): pods "empty" not found"#),
        "{err}"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn name_with_capitals_and_underscores_is_invalid() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let cm = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: Bad_Name\n";

    let err = cluster
        .kubectl_err_stdin(&["create", "--validate=false", "-f", "-"], cm)
        .await?;
    assert!(
        err.contains(
            r#"The ConfigMap "Bad_Name" is invalid: metadata.name: Invalid value: "Bad_Name": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"#
        ),
        "{err}"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_resources_are_not_found() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let not_found =
        "Error from server (NotFound): the server could not find the requested resource";

    for path in [
        "/api/v1/namespaces/default/widgets",
        "/api/v1/widgets",
        "/apis/example.com/v1/widgets",
    ] {
        let err = cluster.kubectl_err(&["get", "--raw", path]).await?;
        assert!(err.contains(not_found), "GET {path}: {err}");
    }
    let err = cluster.kubectl_err(&["get", "widgets"]).await?;
    assert!(
        err.contains(r#"error: the server doesn't have a resource type "widgets""#),
        "{err}"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creating_in_a_missing_namespace_is_not_found() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let cm = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: lost\n  namespace: nope\n";

    let err = cluster
        .kubectl_err_stdin(&["create", "--validate=false", "-f", "-"], cm)
        .await?;
    assert!(
        err.contains(r#"Error from server (NotFound): error when creating "STDIN": namespaces "nope" not found"#),
        "{err}"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_config_map_is_not_found() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &config_maps(&["gone"]))
        .await?;

    assert_eq!(
        cluster.kubectl_ok(&["delete", "cm", "gone"]).await?,
        "configmap \"gone\" deleted\n"
    );
    let err = cluster.kubectl_err(&["get", "cm", "gone"]).await?;
    assert!(
        err.contains(r#"Error from server (NotFound): configmaps "gone" not found"#),
        "{err}"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_with_a_finalizer_is_only_marked_until_the_finalizer_is_removed() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let held = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: held\n  finalizers: [example.com/hold]\n";
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], held)
        .await?;

    // Without --wait=false kubectl would wait for the object to go.
    assert_eq!(
        cluster
            .kubectl_ok(&["delete", "cm", "held", "--wait=false"])
            .await?,
        "configmap \"held\" deleted\n"
    );
    let marked = parse_json(
        &cluster
            .kubectl_ok(&["get", "cm", "held", "-o", "json"])
            .await?,
    )?;
    let deleted_at = marked["metadata"]["deletionTimestamp"]
        .as_str()
        .unwrap_or_default();
    assert!(is_timestamp(deleted_at), "deletionTimestamp {deleted_at:?}");
    assert_eq!(
        marked["metadata"]["finalizers"],
        json!(["example.com/hold"])
    );

    assert_eq!(
        cluster
            .kubectl_ok(&[
                "patch",
                "cm",
                "held",
                "--type=merge",
                "-p",
                r#"{"metadata":{"finalizers":null}}"#,
            ])
            .await?,
        "configmap/held patched\n"
    );
    let err = cluster.kubectl_err(&["get", "cm", "held"]).await?;
    assert!(
        err.contains(r#"Error from server (NotFound): configmaps "held" not found"#),
        "{err}"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_namespace_terminates_it_then_removes_it_and_its_objects() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let objects = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: doomed\n---\n\
                   apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: inside\n  namespace: doomed\n";
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], objects)
        .await?;

    // The raw response is the namespace as the delete left it.
    let marked = parse_json(
        &cluster
            .kubectl_ok(&["delete", "--raw", "/api/v1/namespaces/doomed"])
            .await?,
    )?;
    assert_eq!(marked["kind"], "Namespace");
    assert_eq!(marked["status"]["phase"], "Terminating");
    let deleted_at = marked["metadata"]["deletionTimestamp"]
        .as_str()
        .unwrap_or_default();
    assert!(is_timestamp(deleted_at), "deletionTimestamp {deleted_at:?}");

    wait_for_namespace(&cluster, "doomed", Option::is_none).await?;
    // Raw, because kubectl reports a named get in a missing namespace as the
    // namespace not being found.
    let err = cluster
        .kubectl_err(&[
            "get",
            "--raw",
            "/api/v1/namespaces/doomed/configmaps/inside",
        ])
        .await?;
    assert!(
        err.contains(r#"Error from server (NotFound): configmaps "inside" not found"#),
        "{err}"
    );
    cluster.stop().await
}

/// Waits, on a watch of namespaces, up to 10 s for namespace `name` to be as `done`
/// says (`None`: gone); the namespace then.
async fn wait_for_namespace(
    cluster: &TestCluster,
    name: &str,
    done: impl Fn(&Option<Arc<Namespace>>) -> bool,
) -> Result<Option<Arc<Namespace>>> {
    let admin = cluster
        .in_process()
        .client(UserInfo::new("admin", ["system:masters"]));
    let informers = SharedInformers::new();
    let namespaces = informers.informer::<Namespace>(Api::all(admin), watcher::Config::default());
    let mut changes = namespaces.subscribe();
    namespaces.wait_synced().await;
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let now = namespaces.get(name);
            if done(&now) {
                return Ok(now);
            }
            changes
                .recv()
                .await
                .context("the namespace informer stopped")?;
        }
    })
    .await
    .with_context(|| format!("namespace {name} not as expected within 10 s"))?
}

async fn namespace_json(cluster: &TestCluster, name: &str) -> Result<Value> {
    parse_json(
        &cluster
            .kubectl_ok(&["get", "ns", name, "-o", "json"])
            .await?,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalize_subresource_removes_a_namespace_only_it_may_release() -> Result<()> {
    // No namespace controller in the server: a controller manager's would finalize.
    let cluster = TestCluster::builder()
        .with_token("finalizer-token-0123456789", "finalizer", &[])
        .without_namespace_controller()
        .start()
        .await?;
    let discovery = parse_json(&cluster.kubectl_ok(&["get", "--raw", "/api/v1"]).await?)?;
    let finalize = discovery["resources"]
        .as_array()
        .context("resources")?
        .iter()
        .find(|r| r["name"] == "namespaces/finalize")
        .context("namespaces/finalize is not in discovery")?;
    assert_eq!(finalize["kind"], "Namespace");
    assert_eq!(finalize["verbs"], json!(["update"]));
    assert_eq!(finalize["namespaced"], false);

    cluster
        .kubectl_ok_stdin(
            &["create", "-f", "-"],
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: held\n---\n\
             apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: inside\n  namespace: held\n",
        )
        .await?;
    cluster
        .kubectl_ok(&["delete", "ns", "held", "--wait=false"])
        .await?;
    // Marked; nothing in the server empties it (checked again below, after the
    // requests that follow).
    let marked = namespace_json(&cluster, "held").await?;
    assert_eq!(marked["status"]["phase"], "Terminating");
    assert_eq!(marked["spec"]["finalizers"], json!(["kubernetes"]));

    // A plain update, or a patch, cannot release the namespace.
    let mut update = marked.clone();
    update["spec"]["finalizers"] = json!([]);
    update["metadata"]["labels"]["touched"] = "yes".into();
    let updated = cluster
        .request(
            "PUT",
            "/api/v1/namespaces/held",
            "application/json",
            &update.to_string(),
        )
        .await?;
    assert_eq!(
        updated.status,
        200,
        "{}",
        String::from_utf8_lossy(&updated.body)
    );
    let updated = updated.json()?;
    assert_eq!(updated["spec"]["finalizers"], json!(["kubernetes"]));
    assert_eq!(updated["metadata"]["labels"]["touched"], "yes");
    cluster
        .kubectl_ok(&[
            "patch",
            "ns",
            "held",
            "--type=merge",
            "-p",
            r#"{"spec":{"finalizers":null}}"#,
        ])
        .await?;
    let current = namespace_json(&cluster, "held").await?;
    assert_eq!(current["spec"]["finalizers"], json!(["kubernetes"]));

    cluster
        .kubectl_ok(&["get", "cm", "inside", "-n", "held"])
        .await?;

    // Finalizing is its own permission: `update` on `namespaces/finalize`.
    let finalizer = cluster.kubectl_with_token("finalizer", "finalizer-token-0123456789")?;
    let mut body = current.clone();
    body["spec"]["finalizers"] = json!([]);
    let body = body.to_string();
    let err = finalizer
        .err(
            &[
                "replace",
                "--raw",
                "/api/v1/namespaces/held/finalize",
                "-f",
                "-",
            ],
            Some(&body),
        )
        .await?;
    assert!(
        err.contains(r#"cannot update resource "namespaces/finalize""#),
        "{err}"
    );
    cluster
        .kubectl_ok_stdin(
            &["apply", "-f", "-"],
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: finalize-namespaces\n\
             rules:\n- apiGroups: [\"\"]\n  resources: [namespaces/finalize]\n  verbs: [update]\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: finalize-namespaces\n\
             roleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: finalize-namespaces\n\
             subjects:\n- kind: User\n  name: finalizer\n",
        )
        .await?;
    // Which does not let it update the namespace itself.
    let err = finalizer
        .err(
            &["replace", "--raw", "/api/v1/namespaces/held", "-f", "-"],
            Some(&body),
        )
        .await?;
    assert!(
        err.contains(r#"cannot update resource "namespaces""#),
        "{err}"
    );

    // The response is the namespace as written; it is gone from the store.
    let finalized = parse_json(
        &finalizer
            .ok_stdin(
                &[
                    "replace",
                    "--raw",
                    "/api/v1/namespaces/held/finalize",
                    "-f",
                    "-",
                ],
                &body,
            )
            .await?,
    )?;
    assert_eq!(finalized["kind"], "Namespace");
    assert_eq!(finalized["metadata"]["name"], "held");
    assert_eq!(finalized["spec"]["finalizers"], json!([]));
    wait_for_namespace(&cluster, "held", Option::is_none).await?;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalize_subresource_changes_only_spec_finalizers() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster.kubectl_ok(&["create", "ns", "live"]).await?;
    let mut body = namespace_json(&cluster, "live").await?;
    body["spec"]["finalizers"] = json!(["kubernetes", "example.com/wait"]);
    body["metadata"]["labels"]["ignored"] = "yes".into();
    body["status"]["phase"] = "Terminating".into();
    let written = parse_json(
        &cluster
            .kubectl_ok_stdin(
                &[
                    "replace",
                    "--raw",
                    "/api/v1/namespaces/live/finalize",
                    "-f",
                    "-",
                ],
                &body.to_string(),
            )
            .await?,
    )?;
    assert_eq!(
        written["spec"]["finalizers"],
        json!(["kubernetes", "example.com/wait"])
    );
    let stored = namespace_json(&cluster, "live").await?;
    assert_eq!(
        stored["spec"]["finalizers"],
        json!(["kubernetes", "example.com/wait"])
    );
    assert!(
        stored["metadata"]["labels"].get("ignored").is_none(),
        "{stored}"
    );
    assert_eq!(stored["status"]["phase"], "Active");
    assert!(stored["metadata"].get("deletionTimestamp").is_none());

    // Finalizer names are checked as Kubernetes checks them.
    let mut bad = stored.clone();
    bad["spec"]["finalizers"] = json!(["custom"]);
    let err = cluster
        .kubectl_err_stdin(
            &[
                "replace",
                "--raw",
                "/api/v1/namespaces/live/finalize",
                "-f",
                "-",
            ],
            &bad.to_string(),
        )
        .await?;
    assert!(
        err.contains("name is neither a standard finalizer name nor is it fully qualified"),
        "{err}"
    );
    // Only `update` is served.
    let err = cluster
        .kubectl_err(&["get", "--raw", "/api/v1/namespaces/live/finalize"])
        .await?;
    assert!(err.contains("MethodNotAllowed"), "{err}");

    // Deleted: the server's controller empties it and removes its own finalizer; the
    // other one holds it until it is finalized away.
    cluster
        .kubectl_ok(&["delete", "ns", "live", "--wait=false"])
        .await?;
    wait_for_namespace(&cluster, "live", |ns| {
        ns.as_ref()
            .and_then(|n| n.spec.as_ref())
            .and_then(|s| s.finalizers.clone())
            == Some(vec!["example.com/wait".to_owned()])
    })
    .await
    .context("the namespace controller did not remove its finalizer")?;
    // Held by the other finalizer: still there.
    let mut body = namespace_json(&cluster, "live").await?;
    body["spec"]["finalizers"] = json!([]);
    cluster
        .kubectl_ok_stdin(
            &[
                "replace",
                "--raw",
                "/api/v1/namespaces/live/finalize",
                "-f",
                "-",
            ],
            &body.to_string(),
        )
        .await?;
    wait_for_namespace(&cluster, "live", Option::is_none).await?;
    cluster.stop().await
}

/// Reads lines into `seen` until one satisfies `done`, for up to 10 s.
async fn read_until(
    lines: &mut Lines<BufReader<ChildStdout>>,
    seen: &mut Vec<String>,
    done: impl Fn(&str) -> bool,
) -> Result<()> {
    let read = async {
        while let Some(line) = lines.next_line().await? {
            let finished = done(&line);
            seen.push(line);
            if finished {
                return Ok(());
            }
        }
        bail!("the watch ended; it printed:\n{}", seen.join("\n"))
    };
    match tokio::time::timeout(Duration::from_secs(10), read).await {
        Ok(result) => result,
        Err(_) => bail!(
            "no expected line within 10 s; the watch printed:\n{}",
            seen.join("\n")
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_with_watch_prints_objects_created_and_changed_while_it_runs() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &config_maps(&["seed"]))
        .await?;

    let mut watch = cluster
        .admin()
        .command(&[
            "get",
            "cm",
            "-w",
            "--output-watch-events",
            "--request-timeout=30s",
        ])
        .spawn()
        .context("start kubectl get -w")?;
    let mut lines = BufReader::new(watch.stdout.take().context("take the watch's stdout")?).lines();
    let mut seen = Vec::new();
    // The initial list has arrived: the watch is running.
    read_until(&mut lines, &mut seen, |l| l.contains("seed")).await?;

    let fresh = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: fresh\n";
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], fresh)
        .await?;
    cluster
        .kubectl_ok(&["label", "cm", "fresh", "stage=two"])
        .await?;
    read_until(&mut lines, &mut seen, |l| {
        l.starts_with("MODIFIED") && l.contains("fresh")
    })
    .await?;
    watch.kill().await.context("stop kubectl get -w")?;

    let rows: Vec<Vec<&str>> = seen
        .iter()
        .map(|l| {
            let mut row: Vec<&str> = l.split_whitespace().collect();
            row.pop();
            row
        })
        .collect();
    assert_eq!(
        rows,
        [
            vec!["EVENT", "NAME", "DATA"],
            vec!["ADDED", "seed", "1"],
            vec!["ADDED", "fresh", "0"],
            vec!["MODIFIED", "fresh", "0"],
        ],
        "kubectl get -w printed:\n{}",
        seen.join("\n")
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_list_returns_every_config_map() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let names = [
        "page-1", "page-2", "page-3", "page-4", "page-5", "page-6", "page-7",
    ];
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &config_maps(&names))
        .await?;

    // -v=6 logs each request, so the pages kubectl asked for can be counted.
    let out = cluster
        .kubectl(&["get", "cm", "--chunk-size=2", "-o", "name", "-v=6"])
        .await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let expected: Vec<String> = names.iter().map(|n| format!("configmap/{n}")).collect();
    assert_eq!(stdout.lines().collect::<Vec<_>>(), expected);
    let page_requests = stderr
        .lines()
        .filter(|l| l.contains("/configmaps?") && l.contains("limit=2"))
        .count();
    assert_eq!(page_requests, 4, "7 objects in pages of 2:\n{stderr}");
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_list_pages_follow_the_continue_token() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let names = [
        "page-1", "page-2", "page-3", "page-4", "page-5", "page-6", "page-7",
    ];
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &config_maps(&names))
        .await?;
    let path = "/api/v1/namespaces/default/configmaps?limit=2";

    let first = parse_json(&cluster.kubectl_ok(&["get", "--raw", path]).await?)?;
    assert_eq!(item_names(&first), ["page-1", "page-2"]);
    let list_rv = first["metadata"]["resourceVersion"].clone();
    let mut token = first["metadata"]["continue"]
        .as_str()
        .filter(|t| !t.is_empty())
        .context("the first page has no continue token")?
        .to_owned();

    let second = parse_json(
        &cluster
            .kubectl_ok(&["get", "--raw", &format!("{path}&continue={token}")])
            .await?,
    )?;
    assert_eq!(item_names(&second), ["page-3", "page-4"]);

    let mut all = item_names(&first);
    all.extend(item_names(&second));
    let mut page = second;
    for _ in 0..names.len() {
        // Every page is read at the first page's revision.
        assert_eq!(page["metadata"]["resourceVersion"], list_rv);
        match page["metadata"]["continue"].as_str() {
            Some(next) if !next.is_empty() => token = next.to_owned(),
            _ => break,
        }
        page = parse_json(
            &cluster
                .kubectl_ok(&["get", "--raw", &format!("{path}&continue={token}")])
                .await?,
        )?;
        all.extend(item_names(&page));
    }
    assert_eq!(all, names);
    assert_eq!(page.get("metadata").and_then(|m| m.get("continue")), None);
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_watch_from_a_resource_version_returns_the_later_events() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let created = parse_json(
        &cluster
            .kubectl_ok_stdin(
                &["create", "-f", "-", "-o", "json"],
                &config_maps(&["first"]),
            )
            .await?,
    )?;
    let after: u64 = created["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|rv| rv.parse().ok())
        .context("the created object has no resourceVersion")?;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &config_maps(&["second"]))
        .await?;
    cluster.kubectl_ok(&["label", "cm", "first", "x=y"]).await?;
    cluster.kubectl_ok(&["delete", "cm", "second"]).await?;

    let path = format!(
        "/api/v1/namespaces/default/configmaps?watch=1&resourceVersion={after}&timeoutSeconds=2"
    );
    let out = cluster.kubectl_ok(&["get", "--raw", &path]).await?;
    let events = out
        .lines()
        .map(parse_json)
        .collect::<Result<Vec<Value>>>()?;
    let summary: Vec<(&str, &str)> = events
        .iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap_or_default(),
                e["object"]["metadata"]["name"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("ADDED", "second"),
            ("MODIFIED", "first"),
            ("DELETED", "second")
        ],
        "{out}"
    );
    assert_eq!(events[1]["object"]["metadata"]["labels"], json!({"x": "y"}));
    let revisions: Vec<u64> = events
        .iter()
        .filter_map(|e| e["object"]["metadata"]["resourceVersion"].as_str())
        .filter_map(|rv| rv.parse().ok())
        .collect();
    assert_eq!(revisions.len(), 3, "{out}");
    assert!(
        revisions.first().is_some_and(|first| *first > after) && revisions.is_sorted(),
        "revisions {revisions:?} after {after}"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_changes_only_through_the_status_subresource_and_only_spec_bumps_generation()
-> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], WEB_APP)
        .await?;
    let fields = [
        "get",
        "deploy",
        "web",
        "-o",
        "jsonpath={.metadata.generation} {.spec.replicas} {.status}",
    ];

    let out = cluster
        .kubectl_ok(&[
            "patch",
            "deploy",
            "web",
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"observedGeneration":1,"replicas":2}}"#,
        ])
        .await?;
    assert_eq!(out, "deployment.apps/web patched\n");
    assert_eq!(
        cluster.kubectl_ok(&fields).await?,
        r#"1 2 {"observedGeneration":1,"replicas":2}"#
    );

    // Status written through the main resource is ignored.
    cluster
        .kubectl_ok(&[
            "patch",
            "deploy",
            "web",
            "--type=merge",
            "-p",
            r#"{"status":{"replicas":9}}"#,
        ])
        .await?;
    assert_eq!(
        cluster.kubectl_ok(&fields).await?,
        r#"1 2 {"observedGeneration":1,"replicas":2}"#
    );

    // A spec change bumps the generation and keeps the status.
    cluster
        .kubectl_ok(&[
            "patch",
            "deploy",
            "web",
            "--type=merge",
            "-p",
            r#"{"spec":{"replicas":3}}"#,
        ])
        .await?;
    assert_eq!(
        cluster.kubectl_ok(&fields).await?,
        r#"2 3 {"observedGeneration":1,"replicas":2}"#
    );

    // Through /status, spec is ignored and the generation stays.
    cluster
        .kubectl_ok(&[
            "patch",
            "deploy",
            "web",
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"spec":{"replicas":7},"status":{"observedGeneration":2,"replicas":3}}"#,
        ])
        .await?;
    assert_eq!(
        cluster.kubectl_ok(&fields).await?,
        r#"2 3 {"observedGeneration":2,"replicas":3}"#
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patch_that_changes_nothing_reports_no_change_and_keeps_the_resource_version() -> Result<()>
{
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], WEB_APP)
        .await?;
    let rv = |kind: &'static str, name: &'static str| {
        let cluster = &cluster;
        async move {
            cluster
                .kubectl_ok(&[
                    "get",
                    kind,
                    name,
                    "-o",
                    "jsonpath={.metadata.resourceVersion}",
                ])
                .await
        }
    };
    let cm_before = rv("cm", "settings").await?;
    let deploy_before = rv("deploy", "web").await?;

    // The same value again.
    let out = cluster
        .kubectl_ok(&[
            "patch",
            "cm",
            "settings",
            "--type=merge",
            "-p",
            r#"{"data":{"color":"blue"}}"#,
        ])
        .await?;
    assert_eq!(out, "configmap/settings patched (no change)\n");
    assert_eq!(rv("cm", "settings").await?, cm_before);

    // Status through the main resource, which ignores it.
    let out = cluster
        .kubectl_ok(&[
            "patch",
            "deploy",
            "web",
            "--type=merge",
            "-p",
            r#"{"status":{"replicas":9}}"#,
        ])
        .await?;
    assert_eq!(out, "deployment.apps/web patched (no change)\n");
    assert_eq!(rv("deploy", "web").await?, deploy_before);
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imperative_create_commands_create_objects() -> Result<()> {
    let cluster = TestCluster::start().await?;

    assert_eq!(
        cluster
            .kubectl_ok(&["create", "configmap", "literal", "--from-literal=k=v"])
            .await?,
        "configmap/literal created\n"
    );
    assert_eq!(
        cluster
            .kubectl_ok(&["create", "namespace", "team-a"])
            .await?,
        "namespace/team-a created\n"
    );
    assert_eq!(
        cluster
            .kubectl_ok(&["get", "cm", "literal", "-o", "jsonpath={.data.k}"])
            .await?,
        "v"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bearer_token_is_unauthorized() -> Result<()> {
    let cluster = TestCluster::start().await?;

    let intruder = cluster.kubectl_with_token("intruder", "wrong")?;
    // A raw request reports the server's Status; `get pods` fails earlier, in
    // discovery, which kubectl words as the server asking for credentials.
    let err = intruder
        .err(&["get", "--raw", "/api/v1/namespaces/default/pods"], None)
        .await?;
    assert!(
        err.contains("error: You must be logged in to the server (Unauthorized)"),
        "{err}"
    );
    let err = intruder.err(&["get", "pods"], None).await?;
    assert!(
        err.contains("error: You must be logged in to the server"),
        "{err}"
    );

    // The same kubeconfig with the admin's token is let in.
    let admin = cluster.kubectl_with_token("admin", &cluster.admin_token)?;
    assert_eq!(
        admin.ok(&["get", "ns", "default", "-o", "name"]).await?,
        "namespace/default\n"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_outside_system_masters_is_forbidden() -> Result<()> {
    let cluster = TestCluster::builder()
        .with_token("bob-token-0123456789", "bob", &[])
        .start()
        .await?;

    let bob = cluster.kubectl_with_token("bob", "bob-token-0123456789")?;
    let err = bob.err(&["get", "pods"], None).await?;
    assert!(
        err.contains(
            r#"Error from server (Forbidden): pods is forbidden: User "bob" cannot list resource "pods" in API group "" in the namespace "default""#
        ),
        "{err}"
    );

    // The admin of the same token file is let in: bob is authenticated, not authorized.
    let admin = cluster.kubectl_with_token("admin", &cluster.admin_token)?;
    assert_eq!(admin.ok(&["get", "pods"]).await?, "");
    cluster.stop().await
}
