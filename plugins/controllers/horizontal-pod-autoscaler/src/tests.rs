use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{Action, Write};
use trellis_plugin::testing::ControllerHarness;

use super::*;

fn hpas() -> GroupVersionResource {
    GroupVersionResource {
        group: "autoscaling".into(),
        version: "v2".into(),
        resource: "horizontalpodautoscalers".into(),
    }
}

fn deployments() -> GroupVersionResource {
    GroupVersionResource {
        group: "apps".into(),
        version: "v1".into(),
        resource: "deployments".into(),
    }
}

fn hpa(spec: Value) -> Value {
    let mut spec = spec;
    spec["scaleTargetRef"] = json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": "web"});
    json!({"metadata": {"name": "web", "namespace": "ns"}, "spec": spec})
}

fn utilization(percent: i32) -> Value {
    json!([{"type": "Resource", "resource": {"name": "cpu",
        "target": {"type": "Utilization", "averageUtilization": percent}}}])
}

/// A running pod ready for an hour, requesting 100m of CPU, and its PodMetrics
/// (`None`: it has none).
fn pod(harness: ControllerHarness, name: &str, usage: Option<&str>) -> ControllerHarness {
    let hour_ago = time::format(time::now() - 3600);
    let harness = harness.with_object(
        pods(),
        json!({
            "metadata": {"name": name, "namespace": "ns", "labels": {"app": "web"}},
            "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "100m"}}}]},
            "status": {"phase": "Running", "startTime": hour_ago, "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": hour_ago}]},
        }),
    );
    match usage {
        Some(cpu) => harness.with_object(
            pod_metrics(),
            json!({
                "metadata": {"name": name, "namespace": "ns"},
                "timestamp": time::format(time::now()), "window": "1s",
                "containers": [{"name": "c", "usage": {"cpu": cpu}}],
            }),
        ),
        None => harness,
    }
}

/// A harness with Deployment `web` at `replicas` (its scale subresource) and the
/// autoscaler; `config` is the controller's configuration.
fn cluster(config: Value, autoscaler: Value, replicas: i32) -> ControllerHarness {
    ControllerHarness::new()
        .with_configuration(config)
        .with_kind("apps/v1", "Deployment", deployments(), true)
        .with_object(hpas(), autoscaler)
        .with_object(
            deployments(),
            json!({
                "metadata": {"name": "web/scale", "namespace": "ns"},
                "spec": {"replicas": replicas},
                "status": {"replicas": replicas, "selector": "app=web"},
            }),
        )
}

fn replicas(harness: &ControllerHarness) -> i64 {
    harness
        .object(&deployments(), Some("ns"), "web/scale")
        .unwrap()["spec"]["replicas"]
        .as_i64()
        .unwrap()
}

fn status(harness: &ControllerHarness) -> Value {
    harness.object(&hpas(), Some("ns"), "web").unwrap()["status"].clone()
}

fn condition(harness: &ControllerHarness, kind: &str) -> (String, String) {
    let status = status(harness);
    let c = status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in {status}"))
        .clone();
    (
        c["status"].as_str().unwrap().to_owned(),
        c["reason"].as_str().unwrap().to_owned(),
    )
}

fn no_wait() -> Value {
    json!({"syncPeriodSeconds": 0})
}

#[test]
fn a_busy_deployment_is_scaled_up_at_the_fixed_rate_without_a_behavior() {
    let h = cluster(
        no_wait(),
        hpa(json!({"maxReplicas": 10, "metrics": utilization(50)})),
        2,
    );
    let h = pod(pod(h, "a", Some("200m")), "b", Some("200m"));
    let action = h.reconcile::<HorizontalPodAutoscaler>(&hpas(), Some("ns"), "web");
    assert!(matches!(action, Ok(Action::RequeueAfter(_))), "{action:?}");
    // 200 % against 50 % asks for 8; without a behavior a scale-up at most doubles
    // (at least to 4).
    assert_eq!(replicas(&h), 4);
    let status = status(&h);
    assert_eq!(status["currentReplicas"], 2);
    assert_eq!(status["desiredReplicas"], 4);
    assert_eq!(
        status["currentMetrics"],
        json!([{"type": "Resource", "resource": {"name": "cpu",
            "current": {"averageUtilization": 200, "averageValue": "200m"}}}])
    );
    assert!(status["lastScaleTime"].is_string());
    assert_eq!(
        condition(&h, "AbleToScale"),
        ("True".into(), "SucceededRescale".into())
    );
    assert_eq!(
        condition(&h, "ScalingActive"),
        ("True".into(), "ValidMetricFound".into())
    );
    assert_eq!(
        condition(&h, "ScalingLimited"),
        ("True".into(), "ScaleUpLimit".into())
    );
    assert!(h.events().contains(&(
        "SuccessfulRescale".into(),
        "New size: 4; reason: cpu resource utilization (percentage of request) above target".into()
    )));
}

#[test]
fn an_idle_deployment_waits_for_the_downscale_window_then_shrinks() {
    let idle = |config: Value| {
        let h = cluster(
            config,
            hpa(json!({"maxReplicas": 10, "metrics": utilization(50)})),
            4,
        );
        pod(
            pod(
                pod(pod(h, "a", Some("10m")), "b", Some("10m")),
                "c",
                Some("10m"),
            ),
            "d",
            Some("10m"),
        )
    };
    // The default five-minute window: this sync's own recommendation is the only
    // one, so it holds... after one at 4 was made a moment ago.
    let h = idle(no_wait());
    let web = h.object(&hpas(), Some("ns"), "web").unwrap();
    let mut history = History::of(&web);
    history.recommendations.push((now_ms() - 10_000, 4));
    let h = h.with_object(hpas(), {
        let mut w = web;
        w["metadata"]["annotations"] =
            json!({HISTORY_ANNOTATION: serde_json::to_string(&history).unwrap()});
        w
    });
    h.reconcile::<HorizontalPodAutoscaler>(&hpas(), Some("ns"), "web")
        .unwrap();
    assert_eq!(replicas(&h), 4);
    assert_eq!(
        condition(&h, "AbleToScale"),
        ("True".into(), "ScaleDownStabilized".into())
    );
    // No window: straight to what the metrics ask (10 % of 50 % of 4 pods → 1).
    let h = idle(json!({"syncPeriodSeconds": 0, "downscaleStabilizationSeconds": 0}));
    h.reconcile::<HorizontalPodAutoscaler>(&hpas(), Some("ns"), "web")
        .unwrap();
    assert_eq!(replicas(&h), 1);
    assert!(h.events().contains(&(
        "SuccessfulRescale".into(),
        "New size: 1; reason: All metrics below target".into()
    )));
}

#[test]
fn without_metrics_nothing_is_scaled_and_the_conditions_say_why() {
    let h = cluster(
        no_wait(),
        hpa(json!({"maxReplicas": 10, "metrics": utilization(50)})),
        2,
    );
    let h = pod(pod(h, "a", None), "b", None);
    h.reconcile::<HorizontalPodAutoscaler>(&hpas(), Some("ns"), "web")
        .unwrap();
    assert_eq!(replicas(&h), 2);
    assert_eq!(
        condition(&h, "ScalingActive"),
        ("False".into(), "FailedGetResourceMetric".into())
    );
    let events = h.events();
    let (_, message) = events
        .iter()
        .find(|(reason, _)| reason == "FailedComputeMetricsReplicas")
        .expect("a FailedComputeMetricsReplicas event");
    assert_eq!(
        message,
        "invalid metrics (1 invalid out of 1), first error is: failed to get cpu resource metric value: unable to get metrics for resource cpu: no metrics returned from resource metrics API"
    );
    assert!(
        !h.writes()
            .iter()
            .any(|w| matches!(w, Write::Patch { name, .. } if name == "web/scale"))
    );
}

#[test]
fn the_bounds_apply_before_the_metrics_and_a_target_at_zero_is_left_alone() {
    let h = cluster(
        no_wait(),
        hpa(json!({"minReplicas": 3, "maxReplicas": 5})),
        1,
    );
    h.reconcile::<HorizontalPodAutoscaler>(&hpas(), Some("ns"), "web")
        .unwrap();
    assert_eq!(replicas(&h), 3);
    assert!(h.events().contains(&(
        "SuccessfulRescale".into(),
        "New size: 3; reason: Current number of replicas below Spec.MinReplicas".into()
    )));
    let h = cluster(no_wait(), hpa(json!({"maxReplicas": 5})), 0);
    h.reconcile::<HorizontalPodAutoscaler>(&hpas(), Some("ns"), "web")
        .unwrap();
    assert_eq!(replicas(&h), 0);
    assert_eq!(
        condition(&h, "ScalingActive"),
        ("False".into(), "ScalingDisabled".into())
    );
    // A target of a kind the controller does not know.
    let mut other = hpa(json!({"maxReplicas": 5}));
    other["spec"]["scaleTargetRef"]["kind"] = json!("Nothing");
    let h = cluster(no_wait(), other, 1);
    h.reconcile::<HorizontalPodAutoscaler>(&hpas(), Some("ns"), "web")
        .unwrap();
    assert_eq!(
        condition(&h, "AbleToScale"),
        ("False".into(), "FailedGetScale".into())
    );
}

#[test]
fn an_autoscaler_syncs_at_most_once_a_period() {
    let h = cluster(
        json!({"syncPeriodSeconds": 60}),
        hpa(json!({"maxReplicas": 10, "metrics": utilization(50)})),
        2,
    );
    let h = pod(pod(h, "a", Some("50m")), "b", Some("50m"));
    let first = h.reconcile::<HorizontalPodAutoscaler>(&hpas(), Some("ns"), "web");
    assert_eq!(first, Ok(Action::RequeueAfter(Duration::from_secs(60))));
    let writes = h.writes().len();
    assert!(writes > 0);
    // Its own writes bring it back at once: it waits out the period instead.
    match h.reconcile::<HorizontalPodAutoscaler>(&hpas(), Some("ns"), "web") {
        Ok(Action::RequeueAfter(d)) => assert!(
            d <= Duration::from_secs(60) && d > Duration::from_secs(50),
            "{d:?}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(h.writes().len(), writes);
    assert_eq!(
        condition(&h, "AbleToScale"),
        ("True".into(), "ReadyForNewScale".into())
    );
    assert_eq!(
        condition(&h, "ScalingLimited"),
        ("False".into(), "DesiredWithinRange".into())
    );
}

#[test]
fn a_behavior_limits_the_rate_and_the_history_carries_it_to_the_next_sync() {
    let behavior = json!({
        "scaleUp": {"policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
        "scaleDown": {"stabilizationWindowSeconds": 0},
    });
    let h = cluster(
        no_wait(),
        hpa(json!({"maxReplicas": 10, "metrics": utilization(50), "behavior": behavior})),
        2,
    );
    let h = pod(pod(h, "a", Some("200m")), "b", Some("200m"));
    h.reconcile::<HorizontalPodAutoscaler>(&hpas(), Some("ns"), "web")
        .unwrap();
    assert_eq!(replicas(&h), 3);
    let history = History::of(&h.object(&hpas(), Some("ns"), "web").unwrap());
    assert_eq!(history.scale_up.len(), 1);
    // The next sync (the target now at 3): the minute's one pod is spent.
    h.reconcile::<HorizontalPodAutoscaler>(&hpas(), Some("ns"), "web")
        .unwrap();
    assert_eq!(replicas(&h), 3);
    assert_eq!(
        condition(&h, "ScalingLimited"),
        ("True".into(), "ScaleUpLimit".into())
    );
}
