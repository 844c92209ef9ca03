use std::cell::RefCell;
use std::rc::Rc;

use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{
    Action, ApiError, ControllerHost, EventType, ServedResource, Write, with_controller_host,
};
use trellis_plugin::testing::ControllerHarness;

use super::*;

thread_local! {
    /// The configuration [`cluster`] was given, which [`reconcile`] runs with.
    static CONFIG: RefCell<String> = RefCell::new("{}".into());
}

/// The SDK's harness, with the `scale` subresource written as the API server writes
/// it: onto the object the harness holds as `NAME/scale`.
struct Host(ControllerHarness);

impl ControllerHost for Host {
    fn get(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<String>, String> {
        // A subresource (`web/scale`) is named as its object, as the API server names it.
        let object = self.0.get(resource, namespace, name)?;
        Ok(object.map(|o| match name.split_once('/') {
            Some((object_name, _)) => {
                let mut o: Value = serde_json::from_str(&o).unwrap_or_default();
                o["metadata"]["name"] = json!(object_name);
                o.to_string()
            }
            None => o,
        }))
    }

    fn list(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        label_selector: &str,
    ) -> Result<Vec<String>, String> {
        self.0.list(resource, namespace, label_selector)
    }

    fn owned_by(
        &self,
        resource: &GroupVersionResource,
        owner_uid: &str,
    ) -> Result<Vec<String>, String> {
        self.0.owned_by(resource, owner_uid)
    }

    fn resource_of(&self, api_version: &str, kind: &str) -> Option<ServedResource> {
        self.0.resource_of(api_version, kind)
    }

    fn update_subresource(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        object: &Value,
        subresource: &str,
    ) -> Result<String, ApiError> {
        let mut object = object.clone();
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        object["metadata"]["name"] = json!(format!("{name}/{subresource}"));
        let written = self.0.batch(vec![Write::Update {
            resource: resource.clone(),
            namespace: namespace.map(str::to_owned),
            object,
            status: false,
        }]);
        written
            .into_iter()
            .next()
            .unwrap_or_else(|| Err(ApiError::internal("no answer")))
    }

    fn batch(&self, writes: Vec<Write>) -> Vec<Result<String, ApiError>> {
        self.0.batch(writes)
    }

    fn record(&self, object: &str, event_type: EventType, reason: &str, message: &str) {
        self.0.record(object, event_type, reason, message);
    }
}

/// One reconcile of `ns/web`, as the host makes it.
fn reconcile(h: &ControllerHarness) -> Result<Action, String> {
    let key = ObjectKey {
        resource: hpas(),
        namespace: Some("ns".into()),
        name: "web".into(),
    };
    let configuration = CONFIG.with(|c| c.borrow().clone());
    with_controller_host(Rc::new(Host(h.clone())), || {
        trellis_plugin::__private::reconcile::<HorizontalPodAutoscaler>(&key, &configuration)
    })
}

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
    CONFIG.with(|c| *c.borrow_mut() = config.to_string());
    ControllerHarness::new()
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
    let action = reconcile(&h);
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
    reconcile(&h).unwrap();
    assert_eq!(replicas(&h), 4);
    assert_eq!(
        condition(&h, "AbleToScale"),
        ("True".into(), "ScaleDownStabilized".into())
    );
    // No window: straight to what the metrics ask (10 % of 50 % of 4 pods → 1).
    let h = idle(json!({"syncPeriodSeconds": 0, "downscaleStabilizationSeconds": 0}));
    reconcile(&h).unwrap();
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
    reconcile(&h).unwrap();
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
    assert!(!h.writes().iter().any(
        |w| matches!(w, Write::Update { object, .. } if object["metadata"]["name"] == "web/scale")
    ));
}

#[test]
fn the_bounds_apply_before_the_metrics_and_a_target_at_zero_is_left_alone() {
    let h = cluster(
        no_wait(),
        hpa(json!({"minReplicas": 3, "maxReplicas": 5})),
        1,
    );
    reconcile(&h).unwrap();
    assert_eq!(replicas(&h), 3);
    assert!(h.events().contains(&(
        "SuccessfulRescale".into(),
        "New size: 3; reason: Current number of replicas below Spec.MinReplicas".into()
    )));
    let h = cluster(no_wait(), hpa(json!({"maxReplicas": 5})), 0);
    reconcile(&h).unwrap();
    assert_eq!(replicas(&h), 0);
    assert_eq!(
        condition(&h, "ScalingActive"),
        ("False".into(), "ScalingDisabled".into())
    );
    // A target of a kind the controller does not know.
    let mut other = hpa(json!({"maxReplicas": 5}));
    other["spec"]["scaleTargetRef"]["kind"] = json!("Nothing");
    let h = cluster(no_wait(), other, 1);
    reconcile(&h).unwrap();
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
    let first = reconcile(&h);
    assert_eq!(first, Ok(Action::RequeueAfter(Duration::from_secs(60))));
    let writes = h.writes().len();
    assert!(writes > 0);
    // Its own writes bring it back at once: it waits out the period instead.
    match reconcile(&h) {
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
    reconcile(&h).unwrap();
    assert_eq!(replicas(&h), 3);
    let history = History::of(&h.object(&hpas(), Some("ns"), "web").unwrap());
    assert_eq!(history.scale_up.len(), 1);
    // The next sync (the target now at 3): the minute's one pod is spent.
    reconcile(&h).unwrap();
    assert_eq!(replicas(&h), 3);
    assert_eq!(
        condition(&h, "ScalingLimited"),
        ("True".into(), "ScaleUpLimit".into())
    );
}

#[test]
fn an_invalid_metric_blocks_a_scale_down_but_not_a_scale_up() {
    let qps = json!({"type": "Pods", "pods": {"metric": {"name": "qps"},
        "target": {"type": "AverageValue", "averageValue": "10"}}});
    let metrics = |cpu: &str| {
        let mut m = utilization(50);
        m.as_array_mut().unwrap().push(qps.clone());
        let h = cluster(no_wait(), hpa(json!({"maxReplicas": 10, "metrics": m})), 2);
        pod(pod(h, "a", Some(cpu)), "b", Some(cpu))
    };
    // Idle: the CPU asks for fewer pods, but a metric could not be read.
    let h = metrics("5m");
    reconcile(&h).unwrap();
    assert_eq!(replicas(&h), 2);
    assert_eq!(
        condition(&h, "ScalingActive"),
        ("False".into(), "FailedGetPodsMetric".into())
    );
    assert_eq!(status(&h)["currentMetrics"][1], json!({"type": ""}));
    // Busy: the CPU's proposal stands.
    let h = metrics("100m");
    reconcile(&h).unwrap();
    assert_eq!(replicas(&h), 4);
    assert_eq!(
        condition(&h, "ScalingActive"),
        ("True".into(), "ValidMetricFound".into())
    );
}

#[test]
fn a_container_resource_average_value_counts_that_container_only() {
    let metric = json!([{"type": "ContainerResource", "containerResource": {"name": "cpu",
        "container": "c", "target": {"type": "AverageValue", "averageValue": "50m"}}}]);
    let h = cluster(
        no_wait(),
        hpa(json!({"maxReplicas": 10, "metrics": metric})),
        2,
    );
    let h = pod(pod(h, "a", Some("75m")), "b", Some("75m"));
    reconcile(&h).unwrap();
    // 75m against 50m a pod: 1.5 × 2 pods.
    assert_eq!(replicas(&h), 3);
    assert_eq!(
        status(&h)["currentMetrics"],
        json!([{"type": "ContainerResource", "containerResource": {"name": "cpu",
            "container": "c", "current": {"averageValue": "75m"}}}])
    );
    assert!(h.events().contains(&(
        "SuccessfulRescale".into(),
        "New size: 3; reason: cpu container resource above target".into()
    )));
}
