//! The workload, batch, storage, autoscaling and aggregation APIs as kubectl meets
//! them on an API server alone (no controllers, so what it shows is what the server
//! wrote): discovery and short names, defaults, validation with field paths, tables
//! with `-o wide`, the scale subresource, `explain`, and the bootstrap roles.

use anyhow::{Result, ensure};
use serde_json::Value;
use trellis_tests::TestCluster;

const WORKLOADS: &str = "apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: agent
spec:
  selector:
    matchLabels: {app: agent}
  template:
    metadata:
      labels: {app: agent}
    spec:
      nodeSelector: {disk: ssd}
      containers:
      - name: agent
        image: busybox:1.36
---
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: web
spec:
  serviceName: web
  selector:
    matchLabels: {app: web}
  template:
    metadata:
      labels: {app: web}
    spec:
      containers:
      - name: nginx
        image: nginx:1.25
  volumeClaimTemplates:
  - metadata:
      name: data
    spec:
      accessModes: [ReadWriteOnce]
      resources:
        requests: {storage: 1Gi}
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: fast
  annotations:
    storageclass.kubernetes.io/is-default-class: \"true\"
provisioner: example.com/fast
volumeBindingMode: WaitForFirstConsumer
---
apiVersion: v1
kind: PersistentVolume
metadata:
  name: disk-1
spec:
  capacity: {storage: 2Gi}
  accessModes: [ReadWriteOnce]
  storageClassName: fast
  hostPath: {path: /tmp/disk-1}
";

fn json(text: &str) -> Result<Value> {
    Ok(serde_json::from_str(text)?)
}

/// The header and the row of `name` of a `kubectl get` table, split on runs of two
/// or more spaces (the columns' separator).
fn table_row(out: &str, name: &str) -> Result<(Vec<String>, Vec<String>)> {
    let split = |line: &str| -> Vec<String> {
        line.split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let mut lines = out.lines();
    let header = split(lines.next().unwrap_or_default());
    let row = lines
        .find(|l| l.split_whitespace().next() == Some(name))
        .map(split);
    let Some(row) = row else {
        anyhow::bail!("no row {name} in\n{out}");
    };
    Ok((header, row))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workload_apis_are_served_defaulted_validated_and_listed_as_kubernetes() -> Result<()> {
    let cluster = TestCluster::start().await?;

    // Discovery: each kind with its short name and scope.
    let resources = cluster
        .kubectl_ok(&["api-resources", "--no-headers"])
        .await?;
    for (name, short, namespaced, kind) in [
        ("daemonsets", "ds", "true", "DaemonSet"),
        ("statefulsets", "sts", "true", "StatefulSet"),
        ("cronjobs", "cj", "true", "CronJob"),
        (
            "persistentvolumeclaims",
            "pvc",
            "true",
            "PersistentVolumeClaim",
        ),
        ("persistentvolumes", "pv", "false", "PersistentVolume"),
        ("storageclasses", "sc", "false", "StorageClass"),
        (
            "horizontalpodautoscalers",
            "hpa",
            "true",
            "HorizontalPodAutoscaler",
        ),
    ] {
        let found = resources.lines().any(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.first() == Some(&name)
                && cols.contains(&short)
                && cols.contains(&namespaced)
                && cols.last() == Some(&kind)
        });
        ensure!(found, "{name} ({short}) missing:\n{resources}");
    }
    for name in ["controllerrevisions", "jobs", "apiservices"] {
        ensure!(
            resources
                .lines()
                .any(|l| l.starts_with(&format!("{name} "))),
            "{name} missing:\n{resources}"
        );
    }
    let hpa_versions = cluster.kubectl_ok(&["api-versions"]).await?;
    ensure!(
        hpa_versions.contains("autoscaling/v2") && hpa_versions.contains("autoscaling/v1"),
        "{hpa_versions}"
    );

    // A Job from kubectl: the generated selector and its pods' labels.
    cluster
        .kubectl_ok(&[
            "create",
            "job",
            "pi",
            "--image=busybox:1.36",
            "--",
            "echo",
            "3.14",
        ])
        .await?;
    let job = json(
        &cluster
            .kubectl_ok(&["get", "job", "pi", "-o", "json"])
            .await?,
    )?;
    let uid = job["metadata"]["uid"].as_str().unwrap_or_default();
    ensure!(!uid.is_empty(), "{job}");
    ensure!(
        job["spec"]["selector"]["matchLabels"]["batch.kubernetes.io/controller-uid"] == uid,
        "{job}"
    );
    let labels = &job["spec"]["template"]["metadata"]["labels"];
    for (key, value) in [
        ("batch.kubernetes.io/controller-uid", uid),
        ("controller-uid", uid),
        ("batch.kubernetes.io/job-name", "pi"),
        ("job-name", "pi"),
    ] {
        ensure!(labels[key] == value, "{key}: {labels}");
    }
    ensure!(
        job["spec"]["backoffLimit"] == 6 && job["spec"]["completionMode"] == "NonIndexed",
        "{job}"
    );
    let (header, row) = table_row(&cluster.kubectl_ok(&["get", "jobs"]).await?, "pi")?;
    ensure!(
        header == ["NAME", "STATUS", "COMPLETIONS", "DURATION", "AGE"],
        "{header:?}"
    );
    ensure!(row[1] == "Running" && row[2] == "0/1", "{row:?}");
    // Its template is fixed once made; a Job restarting Always is refused.
    let refused = cluster
        .kubectl_err(&["set", "image", "job/pi", "pi=nginx:1.25"])
        .await?;
    ensure!(
        refused.contains("spec.template: Invalid value") && refused.contains("field is immutable"),
        "{refused}"
    );
    let always = cluster
        .kubectl_err_stdin(
            &["create", "-f", "-"],
            "apiVersion: batch/v1
kind: Job
metadata: {name: forever}
spec:
  template:
    spec:
      containers: [{name: c, image: busybox:1.36}]
",
        )
        .await?;
    ensure!(
        always.contains(r#"spec.template.spec.restartPolicy: Unsupported value: "Always": supported values: "OnFailure", "Never""#),
        "{always}"
    );

    // CronJobs: a schedule and a time zone as Kubernetes reads them.
    cluster
        .kubectl_ok(&[
            "create",
            "cronjob",
            "hello",
            "--image=busybox:1.36",
            "--schedule=*/5 * * * *",
        ])
        .await?;
    let (header, row) = table_row(&cluster.kubectl_ok(&["get", "cj"]).await?, "hello")?;
    ensure!(
        header
            == [
                "NAME",
                "SCHEDULE",
                "TIMEZONE",
                "SUSPEND",
                "ACTIVE",
                "LAST SCHEDULE",
                "AGE"
            ],
        "{header:?}"
    );
    ensure!(
        row[1..6] == ["*/5 * * * *", "<none>", "False", "0", "<none>"],
        "{row:?}"
    );
    let bad = cluster
        .kubectl_err(&[
            "create",
            "cronjob",
            "bad",
            "--image=busybox:1.36",
            "--schedule=61 * * * *",
        ])
        .await?;
    ensure!(
        bad.contains(r#"spec.schedule: Invalid value: "61 * * * *": end of range (61) above maximum (59): 61"#),
        "{bad}"
    );
    let zone = cluster
        .kubectl_err(&[
            "patch",
            "cj",
            "hello",
            "-p",
            r#"{"spec":{"timeZone":"Mars/Olympus"}}"#,
        ])
        .await?;
    ensure!(
        zone.contains(
            r#"spec.timeZone: Invalid value: "Mars/Olympus": unknown time zone Mars/Olympus"#
        ),
        "{zone}"
    );

    // DaemonSets, StatefulSets, classes and volumes: defaults, tables, scale.
    cluster
        .kubectl_ok_stdin(&["apply", "-f", "-"], WORKLOADS)
        .await?;
    let ds = json(
        &cluster
            .kubectl_ok(&["get", "ds", "agent", "-o", "json"])
            .await?,
    )?;
    ensure!(
        ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1
            && ds["spec"]["revisionHistoryLimit"] == 10,
        "{ds}"
    );
    let (header, row) = table_row(
        &cluster.kubectl_ok(&["get", "ds", "-o", "wide"]).await?,
        "agent",
    )?;
    ensure!(
        header
            == [
                "NAME",
                "DESIRED",
                "CURRENT",
                "READY",
                "UP-TO-DATE",
                "AVAILABLE",
                "NODE SELECTOR",
                "AGE",
                "CONTAINERS",
                "IMAGES",
                "SELECTOR"
            ],
        "{header:?}"
    );
    ensure!(
        row[6] == "disk=ssd" && row[8..] == ["agent", "busybox:1.36", "app=agent"],
        "{row:?}"
    );
    cluster
        .kubectl_ok(&["scale", "sts", "web", "--replicas=3"])
        .await?;
    let (header, row) = table_row(&cluster.kubectl_ok(&["get", "sts"]).await?, "web")?;
    ensure!(header == ["NAME", "READY", "AGE"], "{header:?}");
    ensure!(row[1] == "0/3", "{row:?}");
    let scale = json(
        &cluster
            .kubectl_ok(&[
                "get",
                "--raw",
                "/apis/apps/v1/namespaces/default/statefulsets/web/scale",
            ])
            .await?,
    )?;
    ensure!(
        scale["spec"]["replicas"] == 3 && scale["status"]["selector"] == "app=web",
        "{scale}"
    );
    let renamed = cluster
        .kubectl_err(&[
            "patch",
            "sts",
            "web",
            "-p",
            r#"{"spec":{"serviceName":"other"}}"#,
        ])
        .await?;
    ensure!(
        renamed.contains("spec: Forbidden: updates to statefulset spec for fields other than"),
        "{renamed}"
    );
    let (_, row) = table_row(&cluster.kubectl_ok(&["get", "sc"]).await?, "fast")?;
    ensure!(
        row == [
            "fast (default)",
            "example.com/fast",
            "Delete",
            "WaitForFirstConsumer",
            "false",
            &row[5]
        ],
        "{row:?}"
    );
    let (header, row) = table_row(&cluster.kubectl_ok(&["get", "pv"]).await?, "disk-1")?;
    ensure!(
        header[..6]
            == [
                "NAME",
                "CAPACITY",
                "ACCESS MODES",
                "RECLAIM POLICY",
                "STATUS",
                "CLAIM"
            ],
        "{header:?}"
    );
    ensure!(row[1..4] == ["2Gi", "RWO", "Retain"], "{row:?}");
    let claim = cluster
        .kubectl_err_stdin(
            &["create", "-f", "-"],
            "apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data}
spec:
  accessModes: []
  resources: {requests: {storage: 1Gi}}
",
        )
        .await?;
    ensure!(
        claim.contains("spec.accessModes: Required value: at least 1 access mode is required"),
        "{claim}"
    );

    // An APIService is named after the group-version it serves.
    let misnamed = cluster
        .kubectl_err_stdin(
            &["create", "-f", "-"],
            "apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {name: metrics}
spec:
  group: example.com
  version: v1alpha1
  groupPriorityMinimum: 100
  versionPriority: 100
  insecureSkipTLSVerify: true
  service: {namespace: default, name: example}
",
        )
        .await?;
    ensure!(
        misnamed
            .contains(r#"metadata.name: Invalid value: "metrics": must be v1alpha1.example.com"#),
        "{misnamed}"
    );

    // `get all` takes them by category; `describe` reads each kind.
    let all = cluster.kubectl_ok(&["get", "all"]).await?;
    for shown in [
        "daemonset.apps/agent",
        "statefulset.apps/web",
        "job.batch/pi",
        "cronjob.batch/hello",
    ] {
        ensure!(all.contains(shown), "{shown} missing:\n{all}");
    }
    for (kind, name) in [
        ("ds", "agent"),
        ("sts", "web"),
        ("job", "pi"),
        ("cj", "hello"),
        ("pv", "disk-1"),
        ("sc", "fast"),
    ] {
        let described = cluster.kubectl_ok(&["describe", kind, name]).await?;
        ensure!(
            described
                .lines()
                .next()
                .is_some_and(|l| l.starts_with("Name:") && l.ends_with(name)),
            "{kind}:\n{described}"
        );
    }

    // kubectl 1.20 finds them by legacy discovery and prints the same tables.
    let old = cluster.kubectl_1_20()?;
    let listed = old
        .ok(&["get", "ds,sts,jobs,cj,pv,sc", "-o", "name"])
        .await?;
    for shown in [
        "daemonset.apps/agent",
        "statefulset.apps/web",
        "job.batch/pi",
        "cronjob.batch/hello",
        "persistentvolume/disk-1",
        "storageclass.storage.k8s.io/fast",
    ] {
        ensure!(listed.contains(shown), "{shown} missing:\n{listed}");
    }
    let (header, _) = table_row(&old.ok(&["get", "jobs"]).await?, "pi")?;
    ensure!(
        header[..3] == ["NAME", "STATUS", "COMPLETIONS"],
        "{header:?}"
    );
    let explained = old.ok(&["explain", "job.spec.backoffLimit"]).await?;
    ensure!(explained.contains("<integer>"), "{explained}");

    // The OpenAPI schemas reach explain.
    let explained = cluster
        .kubectl_ok(&[
            "explain",
            "statefulset.spec.updateStrategy.rollingUpdate.partition",
        ])
        .await?;
    ensure!(explained.contains("<integer>"), "{explained}");
    let explained = cluster
        .kubectl_ok(&["explain", "cronjob.spec.timeZone"])
        .await?;
    ensure!(explained.contains("<string>"), "{explained}");
    let explained = cluster
        .kubectl_ok(&["explain", "poddisruptionbudget.spec.maxUnavailable"])
        .await?;
    ensure!(explained.contains("<IntOrString>"), "{explained}");

    // The bootstrap roles: controllers, and what view and edit may do.
    let can = |user: &'static str, what: &'static [&'static str]| {
        let cluster = &cluster;
        async move {
            let mut args = vec!["auth", "can-i", "--as", user, "-n", "default"];
            args.extend_from_slice(what);
            let out = cluster.kubectl(&args).await?;
            anyhow::Ok(String::from_utf8_lossy(&out.stdout).trim() == "yes")
        }
    };
    let hpa = "system:serviceaccount:kube-system:horizontal-pod-autoscaler";
    ensure!(can(hpa, &["update", "statefulsets.apps", "--subresource=scale"]).await?);
    ensure!(!can(hpa, &["delete", "statefulsets.apps"]).await?);
    let jobs = "system:serviceaccount:kube-system:job-controller";
    ensure!(can(jobs, &["patch", "jobs.batch", "--subresource=status"]).await?);
    ensure!(can(jobs, &["create", "pods"]).await?);
    ensure!(!can(jobs, &["create", "cronjobs.batch"]).await?);
    cluster
        .kubectl_ok(&[
            "create",
            "rolebinding",
            "viewer",
            "--clusterrole=view",
            "--user=val",
            "-n",
            "default",
        ])
        .await?;
    ensure!(can("val", &["list", "cronjobs.batch"]).await?);
    ensure!(can("val", &["get", "persistentvolumeclaims"]).await?);
    ensure!(!can("val", &["create", "jobs.batch"]).await?);

    cluster.stop().await
}
