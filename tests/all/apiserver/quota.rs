//! LimitRanger and ResourceQuota admission, driven by kubectl: defaults and bounds from
//! LimitRanges, quota refusals in Kubernetes' words, `status.used` kept current,
//! concurrent creates held to the quota; and, over HTTPS, ranges and quotas applying
//! to the request right after their own create.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use trellis_tests::TestCluster;

fn pod(name: &str, resources: &str) -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  containers:
  - name: app
    image: nginx:1.25
    resources: {resources}
"
    )
}

/// Polls `jsonpath` of `what` until it equals `want`.
async fn wait_for(cluster: &TestCluster, what: &[&str], jsonpath: &str, want: &str) -> Result<()> {
    let mut args: Vec<&str> = vec!["get"];
    args.extend(what);
    let path = format!("jsonpath={jsonpath}");
    args.extend(["-o", &path]);
    let mut last = String::new();
    for _ in 0..50 {
        last = cluster.kubectl_ok(&args).await?;
        if last == want {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("{what:?} {jsonpath} is {last:?}, not {want:?}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limit_ranges_default_and_bound_pod_resources() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok_stdin(
            &["create", "-f", "-"],
            "apiVersion: v1
kind: LimitRange
metadata:
  name: bounds
spec:
  limits:
  - type: Container
    default: {cpu: 500m, memory: 256Mi}
    defaultRequest: {cpu: 100m}
    max: {cpu: '1'}
    min: {cpu: 50m}
    maxLimitRequestRatio: {cpu: '10'}
",
        )
        .await?;
    let table = cluster.kubectl_ok(&["get", "limits"]).await?;
    ensure!(
        table.contains("bounds") && table.contains("CREATED AT"),
        "{table}"
    );

    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &pod("plain", "{}"))
        .await?;
    let resources = cluster
        .kubectl_ok(&[
            "get",
            "pod",
            "plain",
            "-o",
            "jsonpath={.spec.containers[0].resources}",
        ])
        .await?;
    let resources: serde_json::Value = serde_json::from_str(&resources)?;
    ensure!(
        resources["requests"]["cpu"] == "100m"
            && resources["limits"]["cpu"] == "500m"
            && resources["limits"]["memory"] == "256Mi"
            // The default memory limit stands for the request too.
            && resources["requests"]["memory"] == "256Mi",
        "{resources}"
    );

    let refused = cluster
        .kubectl_err_stdin(
            &["create", "-f", "-"],
            &pod("greedy", "{limits: {cpu: '2'}, requests: {cpu: 10m}}"),
        )
        .await?;
    ensure!(
        refused.contains("pods \"greedy\" is forbidden: [minimum cpu usage per Container is 50m, but request is 10m, maximum cpu usage per Container is 1, but limit is 2, cpu max limit to request ratio per Container is 10, but provided ratio is 200.000000]"),
        "{refused}"
    );

    let invalid = cluster
        .kubectl_err_stdin(
            &["create", "-f", "-"],
            "apiVersion: v1\nkind: LimitRange\nmetadata:\n  name: broken\nspec:\n  limits:\n  - type: Container\n    max: {cpu: lots}\n",
        )
        .await?;
    ensure!(
        invalid.contains("spec.limits[0].max[cpu]") && invalid.contains("Invalid value"),
        "{invalid}"
    );
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_quota_refuses_over_quota_creates_and_tracks_usage() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok(&[
            "create",
            "quota",
            "compute",
            "--hard=pods=2,requests.cpu=1,limits.memory=1Gi",
        ])
        .await?;
    wait_for(&cluster, &["quota", "compute"], "{.status.used.pods}", "0").await?;

    let unspecified = cluster
        .kubectl_err_stdin(&["create", "-f", "-"], &pod("bare", "{}"))
        .await?;
    ensure!(
        unspecified.contains(
            "pods \"bare\" is forbidden: failed quota: compute: must specify limits.memory,requests.cpu"
        ),
        "{unspecified}"
    );

    let sized = "{requests: {cpu: 250m}, limits: {memory: 256Mi}}";
    for name in ["a", "b"] {
        cluster
            .kubectl_ok_stdin(&["create", "-f", "-"], &pod(name, sized))
            .await?;
    }
    let used = cluster
        .kubectl_ok(&["get", "quota", "compute", "-o", "jsonpath={.status.used}"])
        .await?;
    let used: serde_json::Value = serde_json::from_str(&used)?;
    ensure!(
        used["pods"] == "2" && used["requests.cpu"] == "500m" && used["limits.memory"] == "512Mi",
        "{used}"
    );
    // Usage is the server's own status write, made through the registry: managedFields
    // name its manager on the status subresource, and the quota's generation is kept.
    let quota: serde_json::Value = serde_json::from_str(
        &cluster
            .kubectl_ok(&[
                "get",
                "quota",
                "compute",
                "-o",
                "json",
                "--show-managed-fields",
            ])
            .await?,
    )?;
    ensure!(
        quota["metadata"]["generation"] == 1
            && quota["metadata"]["managedFields"]
                .as_array()
                .is_some_and(|fields| fields
                    .iter()
                    .any(|m| m["manager"] == "resourcequota-controller"
                        && m["subresource"] == "status"
                        && m["fieldsV1"]["f:status"]["f:used"].is_object())),
        "{quota}"
    );
    let table = cluster.kubectl_ok(&["get", "quota"]).await?;
    ensure!(
        table.contains("pods: 2/2") && table.contains("limits.memory: 512Mi/1Gi"),
        "{table}"
    );

    let third = cluster
        .kubectl_err_stdin(&["create", "-f", "-"], &pod("c", sized))
        .await?;
    ensure!(
        third.contains(
            "pods \"c\" is forbidden: exceeded quota: compute, requested: pods=1, used: pods=2, limited: pods=2"
        ),
        "{third}"
    );

    // A delete gives the room back.
    cluster.kubectl_ok(&["delete", "pod", "a"]).await?;
    wait_for(&cluster, &["quota", "compute"], "{.status.used.pods}", "1").await?;
    let too_much_cpu = cluster
        .kubectl_err_stdin(
            &["create", "-f", "-"],
            &pod("big", "{requests: {cpu: '1'}, limits: {memory: 128Mi}}"),
        )
        .await?;
    ensure!(
        too_much_cpu.contains(
            "exceeded quota: compute, requested: requests.cpu=1, used: requests.cpu=250m, limited: requests.cpu=1"
        ),
        "{too_much_cpu}"
    );
    // A dry run is checked and not charged.
    cluster
        .kubectl_ok_stdin(&["create", "--dry-run=server", "-f", "-"], &pod("c", sized))
        .await?;
    let pods = cluster
        .kubectl_ok(&[
            "get",
            "quota",
            "compute",
            "-o",
            "jsonpath={.status.used.pods}",
        ])
        .await?;
    ensure!(pods == "1", "{pods}");
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &pod("c", sized))
        .await?;
    wait_for(&cluster, &["quota", "compute"], "{.status.used.pods}", "2").await?;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_never_pass_the_quota() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok(&[
            "create",
            "quota",
            "objects",
            "--hard=configmaps=5,count/deployments.apps=1",
        ])
        .await?;
    wait_for(
        &cluster,
        &["quota", "objects"],
        "{.status.used.configmaps}",
        "0",
    )
    .await?;
    let mut runs = Vec::new();
    for i in 0..16 {
        let kubectl = cluster.admin().clone();
        runs.push(tokio::spawn(async move {
            let name = format!("cm-{i}");
            kubectl
                .run(&["create", "configmap", &name, "--from-literal=k=v"], None)
                .await
        }));
    }
    let (mut created, mut refused) = (0, 0);
    for run in runs {
        let output = run.await??;
        if output.status.success() {
            created += 1;
        } else {
            let stderr = String::from_utf8_lossy(&output.stderr);
            ensure!(
                stderr.contains("exceeded quota: objects, requested: configmaps=1, used: configmaps=5, limited: configmaps=5"),
                "{stderr}"
            );
            refused += 1;
        }
    }
    ensure!(
        created == 5 && refused == 11,
        "{created} created, {refused} refused"
    );
    let stored = cluster.kubectl_ok(&["get", "cm", "-o", "name"]).await?;
    ensure!(stored.lines().count() == 5, "{stored}");
    let used = cluster
        .kubectl_ok(&[
            "get",
            "quota",
            "objects",
            "-o",
            "jsonpath={.status.used.configmaps}",
        ])
        .await?;
    ensure!(used == "5", "{used}");

    cluster
        .kubectl_ok(&["create", "deployment", "one", "--image=nginx:1.25"])
        .await?;
    let second = cluster
        .kubectl_err(&["create", "deployment", "two", "--image=nginx:1.25"])
        .await?;
    ensure!(
        second.contains("deployments.apps \"two\" is forbidden: exceeded quota: objects, requested: count/deployments.apps=1, used: count/deployments.apps=1, limited: count/deployments.apps=1"),
        "{second}"
    );
    let hard = cluster
        .kubectl_ok(&["get", "quota", "objects", "-o", "jsonpath={.status.hard}"])
        .await
        .context("read the quota's status")?;
    ensure!(hard.contains("count/deployments.apps"), "{hard}");
    cluster.stop().await
}

/// LimitRanger and ResourceQuota read which ranges and quotas exist, and creates
/// check their namespace, from the watch cache, which follows the store by an event's
/// delivery: a namespace, range or quota whose create (or a namespace whose delete)
/// was acknowledged must still apply to the very next request. Requests here
/// go back to back over HTTPS (kubectl's start-up would give the cache time to catch
/// up), in fresh namespaces, several times over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranges_and_quotas_apply_to_the_next_request() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let json = "application/json";
    let pod = |name: &str| {
        serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "app", "image": "nginx:1.25"}]}})
        .to_string()
    };
    for round in 0..10 {
        let ns = format!("next-{round}");
        let created = cluster
            .request(
                "POST",
                "/api/v1/namespaces",
                json,
                &serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
                    .to_string(),
            )
            .await?;
        ensure!(created.status == 201, "namespace {ns}: {}", created.status);

        let range = cluster
            .request(
                "POST",
                &format!("/api/v1/namespaces/{ns}/limitranges"),
                json,
                &serde_json::json!({"apiVersion": "v1", "kind": "LimitRange",
                    "metadata": {"name": "defaults"},
                    "spec": {"limits": [{"type": "Container", "default": {"cpu": "300m"}}]}})
                .to_string(),
            )
            .await?;
        ensure!(range.status == 201, "limit range in {ns}: {}", range.status);
        let first = cluster
            .request(
                "POST",
                &format!("/api/v1/namespaces/{ns}/pods"),
                json,
                &pod("first"),
            )
            .await?;
        ensure!(first.status == 201, "first pod in {ns}: {}", first.status);
        let resources = &first.json()?["spec"]["containers"][0]["resources"];
        ensure!(
            resources["limits"]["cpu"] == "300m" && resources["requests"]["cpu"] == "300m",
            "round {round}: the new LimitRange's defaults are missing: {resources}"
        );

        let quota = cluster
            .request(
                "POST",
                &format!("/api/v1/namespaces/{ns}/resourcequotas"),
                json,
                &serde_json::json!({"apiVersion": "v1", "kind": "ResourceQuota",
                    "metadata": {"name": "one-more"}, "spec": {"hard": {"pods": "2"}}})
                .to_string(),
            )
            .await?;
        ensure!(quota.status == 201, "quota in {ns}: {}", quota.status);
        let second = cluster
            .request(
                "POST",
                &format!("/api/v1/namespaces/{ns}/pods"),
                json,
                &pod("second"),
            )
            .await?;
        ensure!(
            second.status == 201,
            "second pod in {ns}: {}",
            second.status
        );
        let third = cluster
            .request(
                "POST",
                &format!("/api/v1/namespaces/{ns}/pods"),
                json,
                &pod("third"),
            )
            .await?;
        let message = third.json()?["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        ensure!(
            third.status == 403
                && message.contains(
                    "exceeded quota: one-more, requested: pods=1, used: pods=2, limited: pods=2"
                ),
            "round {round}: the third pod got {}: {message}",
            third.status
        );

        // A namespace being deleted takes no new objects, from the next request on.
        let deleted = cluster
            .request("DELETE", &format!("/api/v1/namespaces/{ns}"), json, "")
            .await?;
        ensure!(deleted.status == 200, "delete {ns}: {}", deleted.status);
        let late = cluster
            .request(
                "POST",
                &format!("/api/v1/namespaces/{ns}/pods"),
                json,
                &pod("late"),
            )
            .await?;
        let message = late.json()?["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        ensure!(
            (late.status == 403 && message.contains("because it is being terminated"))
                || late.status == 404,
            "round {round}: a pod in the deleted namespace got {}: {message}",
            late.status
        );
    }
    cluster.stop().await
}

/// A quota counts custom resources (`count/<plural>.<group>`), and gives the room back
/// when their CRD is deleted and takes them along, not only when each is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_counts_custom_resources_until_their_crd_goes() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let crd = r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: gadgets.example.com}
spec:
  group: example.com
  scope: Namespaced
  names: {plural: gadgets, singular: gadget, kind: Gadget}
  versions:
  - name: v1
    served: true
    storage: true
    schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
"#;
    cluster.kubectl_ok_stdin(&["apply", "-f", "-"], crd).await?;
    cluster
        .kubectl_ok(&[
            "create",
            "quota",
            "gadgets",
            "--hard=count/gadgets.example.com=2",
        ])
        .await?;
    let gadget = |name: &str| {
        format!("apiVersion: example.com/v1\nkind: Gadget\nmetadata: {{name: {name}}}\n")
    };
    for name in ["a", "b"] {
        cluster
            .kubectl_ok_stdin(&["create", "-f", "-"], &gadget(name))
            .await?;
    }
    let path = "{.status.used.count/gadgets\\.example\\.com}";
    wait_for(&cluster, &["quota", "gadgets"], path, "2").await?;
    let refused = cluster
        .kubectl_err_stdin(&["create", "-f", "-"], &gadget("c"))
        .await?;
    ensure!(refused.contains("exceeded quota: gadgets"), "{refused}");

    cluster
        .kubectl_ok(&["delete", "crd", "gadgets.example.com"])
        .await?;
    wait_for(&cluster, &["quota", "gadgets"], path, "0").await?;
    cluster.stop().await
}

/// Scoped quotas (`kubectl create quota --scopes`, `scopeSelector`) charge only the
/// pods their scopes select, and count only those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scoped_quotas_charge_the_pods_they_select() -> Result<()> {
    let cluster = TestCluster::start().await?;
    cluster
        .kubectl_ok(&[
            "create",
            "quota",
            "best-effort",
            "--hard=pods=1",
            "--scopes=BestEffort",
        ])
        .await?;
    let high = r#"apiVersion: v1
kind: ResourceQuota
metadata: {name: high-priority}
spec:
  hard: {pods: "1"}
  scopeSelector:
    matchExpressions:
    - {scopeName: PriorityClass, operator: In, values: [high]}
"#;
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], high)
        .await?;
    wait_for(
        &cluster,
        &["quota", "best-effort"],
        "{.status.used.pods}",
        "0",
    )
    .await?;
    wait_for(
        &cluster,
        &["quota", "high-priority"],
        "{.status.used.pods}",
        "0",
    )
    .await?;

    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &pod("free-1", "{}"))
        .await?;
    let second = cluster
        .kubectl_err_stdin(&["create", "-f", "-"], &pod("free-2", "{}"))
        .await?;
    ensure!(
        second.contains(
            "exceeded quota: best-effort, requested: pods=1, used: pods=1, limited: pods=1"
        ),
        "{second}"
    );
    // Pods with requests are outside BestEffort, and without a priority class outside
    // the other: neither quota holds them back.
    let sized = "{requests: {cpu: 100m}}";
    for name in ["sized-1", "sized-2"] {
        cluster
            .kubectl_ok_stdin(&["create", "-f", "-"], &pod(name, sized))
            .await?;
    }
    // The Priority admission wants the class to exist.
    cluster
        .kubectl_ok(&["create", "priorityclass", "high", "--value=1000"])
        .await?;
    let prioritized =
        |name: &str| pod(name, sized).replace("spec:\n", "spec:\n  priorityClassName: high\n");
    cluster
        .kubectl_ok_stdin(&["create", "-f", "-"], &prioritized("high-1"))
        .await?;
    let refused = cluster
        .kubectl_err_stdin(&["create", "-f", "-"], &prioritized("high-2"))
        .await?;
    ensure!(
        refused.contains("exceeded quota: high-priority"),
        "{refused}"
    );

    // Recounts (after a delete) count the selected pods only.
    cluster.kubectl_ok(&["delete", "pod", "sized-1"]).await?;
    wait_for(
        &cluster,
        &["quota", "best-effort"],
        "{.status.used.pods}",
        "1",
    )
    .await?;
    wait_for(
        &cluster,
        &["quota", "high-priority"],
        "{.status.used.pods}",
        "1",
    )
    .await?;
    cluster.kubectl_ok(&["delete", "pod", "free-1"]).await?;
    wait_for(
        &cluster,
        &["quota", "best-effort"],
        "{.status.used.pods}",
        "0",
    )
    .await?;
    cluster.stop().await
}

/// Refuses ConfigMaps labelled `refuse: "yes"`: a validating step that would run after
/// ResourceQuota if quota did not run last.
#[derive(Debug)]
struct RefuseLabelled;

#[async_trait::async_trait]
impl trellis_apiserver::admission::Admission for RefuseLabelled {
    fn name(&self) -> &str {
        "RefuseLabelled"
    }

    async fn validate(
        &self,
        attrs: &trellis_apiserver::admission::Attributes<'_>,
        obj: &trellis_apiserver::object::Object,
        _old: Option<&trellis_apiserver::object::Object>,
    ) -> Result<(), trellis_api::ApiError> {
        if attrs.resource.plural == "configmaps" && obj["metadata"]["labels"]["refuse"] == "yes" {
            return Err(trellis_api::ApiError::new(
                403,
                trellis_api::status::Reason::Forbidden,
                "refused by a later step",
            ));
        }
        Ok(())
    }
}

/// Regression: quota charged a create before later admission steps and the store had
/// their say, and the charge stayed until its reservation expired: a 2 MiB ConfigMap,
/// a plugin's refusal, a name taken — each left `status.used` one too high.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_creates_leave_quota_usage_where_it_was() -> Result<()> {
    let mut chains = trellis_apiserver::admission::builtin();
    chains.add(std::sync::Arc::new(RefuseLabelled));
    let cluster = TestCluster::builder().with_chains(chains).start().await?;
    cluster
        .kubectl_ok_stdin(
            &["create", "-f", "-"],
            "apiVersion: v1\nkind: ResourceQuota\nmetadata: {name: q}\nspec:\n  hard: {configmaps: '5'}\n",
        )
        .await?;
    let used = "{.status.used.configmaps}";
    wait_for(&cluster, &["resourcequota", "q"], used, "0").await?;
    let collection = "/api/v1/namespaces/default/configmaps";
    let configmap = |name: &str, label: &str, bytes: usize| {
        serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "labels": {"refuse": label}},
            "data": {"d": "x".repeat(bytes)}})
        .to_string()
    };
    let created = cluster
        .request(
            "POST",
            collection,
            "application/json",
            &configmap("a", "no", 10),
        )
        .await?;
    ensure!(created.status == 201, "{}", created.status);
    wait_for(&cluster, &["resourcequota", "q"], used, "1").await?;

    // Over Kubernetes' 1 MiB of data: invalid, before quota is asked.
    let big = cluster
        .request(
            "POST",
            collection,
            "application/json",
            &configmap("big", "no", (1 << 20) + 1),
        )
        .await?;
    let status = big.json()?;
    ensure!(
        big.status == 422 && status["details"]["causes"][0]["reason"] == "FieldValueTooLong",
        "{status}"
    );
    // Refused by a step that runs before quota.
    let refused = cluster
        .request(
            "POST",
            collection,
            "application/json",
            &configmap("r", "yes", 10),
        )
        .await?;
    ensure!(refused.status == 403, "{}", refused.status);
    // Charged, then refused by the store: the name is taken.
    let taken = cluster
        .request(
            "POST",
            collection,
            "application/json",
            &configmap("a", "no", 10),
        )
        .await?;
    ensure!(taken.status == 409, "{}", taken.status);
    let quota: serde_json::Value = serde_json::from_str(
        &cluster
            .kubectl_ok(&["get", "resourcequota", "q", "-o", "json"])
            .await?,
    )?;
    ensure!(
        quota["status"]["used"]["configmaps"] == "1",
        "usage after refused creates: {quota}"
    );
    Ok(())
}
