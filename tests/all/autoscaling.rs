//! HorizontalPodAutoscalers against a real server and the bundled autoscaler
//! (`horizontalpodautoscaling`), syncing every second: made by `kubectl autoscale`,
//! listed by `kubectl get hpa`, they scale their target through its scale
//! subresource and say in their conditions and events why.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use futures::TryStreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{Event, Namespace};
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use trellis_api::UserInfo;
use trellis_client::identity;
use trellis_plugin_host::{Compilers, HostConfig, PluginHost};
use trellis_tests::TestCluster;

/// How long the autoscaler may take: loading its component, then a sync or two.
const SETTLE: Duration = Duration::from_secs(60);

/// The controller manager of `trellis up` with the autoscaler as its only built-in,
/// syncing every second; it stops when the returned sender is dropped (the directory
/// holds its modules).
fn start_autoscaler(
    cluster: &TestCluster,
) -> Result<(tokio::sync::oneshot::Sender<()>, tempfile::TempDir)> {
    use trellis::components::Component;
    use trellis::setup::{ControllerSetup, Credentials, Shared};
    let in_process = cluster.in_process();
    let dir = tempfile::tempdir()?;
    let mut shared = Shared::new();
    shared.controllers = Some(ControllerSetup {
        plugins: PluginHost::new(HostConfig {
            compilers: Compilers::Baseline,
            ..HostConfig::default()
        })?,
        credentials: Credentials::InProcess(in_process.clone()),
        builtins: trellis::setup::with_hpa_sync_period(
            trellis_controllers::bundled::select("horizontalpodautoscaling")?,
            Duration::from_secs(1),
        ),
        modules_dir: dir.path().join("modules"),
        running: Default::default(),
        root_ca: None,
        node_monitor_grace_period: 50,
        plugin_status_interval: Duration::from_secs(10),
        node_ipam: Default::default(),
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(trellis::components::run(
        Component::Controllers,
        in_process.client(identity::controller_manager()),
        shared,
        None,
        async move {
            let _ = stopped.await;
        },
    ));
    Ok((stop, dir))
}

/// `(status, reason)` of the autoscaler's condition `kind`.
fn condition(hpa: &HorizontalPodAutoscaler, kind: &str) -> Option<(String, String)> {
    let c = hpa
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind)?;
    Some((c.status.clone(), c.reason.clone().unwrap_or_default()))
}

/// Below its minimum a target is scaled up at once, metrics or not; with no pod
/// measured the autoscaler says so in ScalingActive and scales nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_autoscale_keeps_a_deployment_within_its_bounds_and_says_why() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let admin = cluster
        .in_process()
        .client(UserInfo::new("admin", ["system:masters"]));
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "hpa"}}))?,
        )
        .await?;
    let _autoscaler = start_autoscaler(&cluster)?;
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), "hpa");
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "web"}, "spec": {"replicas": 1,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [
                    {"name": "c", "image": "i", "resources": {"requests": {"cpu": "100m"}}}]}}}}))?,
        )
        .await?;
    cluster
        .kubectl_ok(&[
            "autoscale",
            "deploy",
            "web",
            "-n",
            "hpa",
            "--min=2",
            "--max=3",
            "--cpu-percent=50",
        ])
        .await?;

    let scaled = tokio::time::timeout(
        SETTLE,
        kube::runtime::wait::await_condition(
            deployments.clone(),
            "web",
            |d: Option<&Deployment>| d.and_then(|d| d.spec.as_ref()?.replicas) == Some(2),
        ),
    )
    .await;
    ensure!(
        matches!(scaled, Ok(Ok(_))),
        "the Deployment was not scaled to its minimum of 2: {:?}; the autoscaler: {:?}",
        deployments.get("web").await?.spec.and_then(|s| s.replicas),
        Api::<HorizontalPodAutoscaler>::namespaced(admin.clone(), "hpa")
            .get("web")
            .await?
    );

    // The next sync finds the target within bounds, and no pod measured (none runs).
    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(admin.clone(), "hpa");
    let settled = tokio::time::timeout(
        SETTLE,
        kube::runtime::wait::await_condition(
            hpas.clone(),
            "web",
            |h: Option<&HorizontalPodAutoscaler>| {
                h.is_some_and(|h| {
                    condition(h, "ScalingActive")
                        == Some(("False".into(), "FailedGetResourceMetric".into()))
                        && h.status
                            .as_ref()
                            .is_some_and(|s| s.current_replicas == Some(2))
                })
            },
        ),
    )
    .await;
    let hpa = hpas.get("web").await?;
    ensure!(
        matches!(settled, Ok(Ok(_))),
        "the autoscaler did not report the missing metrics: {:?}",
        hpa.status
    );
    let status = hpa.status.as_ref().context("no status")?;
    ensure!(status.desired_replicas == 2, "{status:?}");
    ensure!(status.last_scale_time.is_some(), "{status:?}");
    ensure!(
        condition(&hpa, "AbleToScale").map(|(s, _)| s) == Some("True".into()),
        "{status:?}"
    );
    let spec = hpa.spec.as_ref().context("no spec")?;
    ensure!(
        spec.min_replicas == Some(2) && spec.max_replicas == 3,
        "{spec:?}"
    );

    // Its event, from the autoscaler.
    let events: Api<Event> = Api::namespaced(admin.clone(), "hpa");
    let rescaled = tokio::time::timeout(SETTLE, async {
        let stream = watcher(events, watcher::Config::default()).applied_objects();
        futures::pin_mut!(stream);
        while let Some(e) = stream.try_next().await? {
            if e.reason.as_deref() == Some("SuccessfulRescale") {
                return Ok::<_, anyhow::Error>(e);
            }
        }
        anyhow::bail!("the event watch ended")
    })
    .await
    .context("no SuccessfulRescale event")??;
    ensure!(
        rescaled.message.as_deref()
            == Some("New size: 2; reason: Current number of replicas below Spec.MinReplicas"),
        "{rescaled:?}"
    );
    ensure!(
        rescaled.involved_object.kind.as_deref() == Some("HorizontalPodAutoscaler"),
        "{rescaled:?}"
    );
    ensure!(
        rescaled
            .source
            .as_ref()
            .and_then(|s| s.component.as_deref())
            == Some("horizontal-pod-autoscaler"),
        "{rescaled:?}"
    );

    // kubectl's columns: the target, what is measured against what is aimed at.
    let table = cluster
        .kubectl_ok(&["get", "hpa", "web", "-n", "hpa"])
        .await?;
    let row = table.lines().nth(1).context("no row")?;
    ensure!(
        row.contains("Deployment/web") && row.contains("/50%"),
        "{table}"
    );

    // kubectl 1.20 writes autoscaling/v1: served from v2's objects, converted both ways.
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "api"}, "spec": {"replicas": 1,
                "selector": {"matchLabels": {"app": "api"}},
                "template": {"metadata": {"labels": {"app": "api"}}, "spec": {"containers": [
                    {"name": "c", "image": "i", "resources": {"requests": {"cpu": "100m"}}}]}}}}))?,
        )
        .await?;
    cluster
        .kubectl_1_20()?
        .ok(&[
            "autoscale",
            "deploy",
            "api",
            "-n",
            "hpa",
            "--min=2",
            "--max=4",
            "--cpu-percent=60",
        ])
        .await?;
    let settled = tokio::time::timeout(
        SETTLE,
        kube::runtime::wait::await_condition(
            hpas.clone(),
            "api",
            |h: Option<&HorizontalPodAutoscaler>| {
                h.and_then(|h| h.status.as_ref())
                    .is_some_and(|s| s.desired_replicas == 2)
            },
        ),
    )
    .await;
    ensure!(
        matches!(settled, Ok(Ok(_))),
        "the v1 autoscaler did not scale its target: {:?}",
        hpas.get("api").await?.status
    );
    let v1: serde_json::Value = serde_json::from_str(
        &cluster
            .kubectl_ok(&[
                "get",
                "horizontalpodautoscalers.v1.autoscaling",
                "api",
                "-n",
                "hpa",
                "-o",
                "json",
            ])
            .await?,
    )?;
    ensure!(v1["apiVersion"] == "autoscaling/v1", "{v1}");
    ensure!(
        v1["spec"]["targetCPUUtilizationPercentage"] == 60 && v1["spec"]["minReplicas"] == 2,
        "{v1}"
    );
    ensure!(v1["status"]["desiredReplicas"] == 2, "{v1}");
    // What v1 has no field for travels in annotations.
    let conditions = v1["metadata"]["annotations"]["autoscaling.alpha.kubernetes.io/conditions"]
        .as_str()
        .context("no conditions annotation")?;
    ensure!(conditions.contains("AbleToScale"), "{conditions}");
    // A patch at v1 is made on the v1 form, and v2 sees it.
    cluster
        .kubectl_1_20()?
        .ok(&[
            "patch",
            "horizontalpodautoscalers.v1.autoscaling",
            "api",
            "-n",
            "hpa",
            "--type=merge",
            "-p",
            r#"{"spec": {"targetCPUUtilizationPercentage": 70}}"#,
        ])
        .await?;
    let v2 = hpas.get("api").await?;
    let metrics = v2
        .spec
        .as_ref()
        .and_then(|s| s.metrics.clone())
        .unwrap_or_default();
    ensure!(
        metrics.len() == 1
            && metrics[0]
                .resource
                .as_ref()
                .and_then(|r| r.target.average_utilization)
                == Some(70),
        "{metrics:?}"
    );
    Ok(())
}
