"""HorizontalPodAutoscalers in `trellis up` through the official Python client: one
made through AutoscalingV2Api scales its Deployment up to its minimum, and reads the
same through AutoscalingV1Api (the CPU target as targetCPUUtilizationPercentage, the
counts in the status); one made through AutoscalingV1Api is read at v2 with its CPU
target as a Resource metric. The autoscaler syncs every second
(--horizontal-pod-autoscaler-sync-period); the Deployment's pods fit no node, so none
runs: the bounds alone move it."""

import pytest
from kubernetes import client

from conftest import trellis_up
from test_controller_plugins import wait_for

NS = "default"


@pytest.fixture(scope="module")
def up():
    with trellis_up("trellis-autoscaling-", "--pod-network=false", "--service-proxy=false",
                    "--horizontal-pod-autoscaler-sync-period", "1") as running:
        yield running


def deployment(name):
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"nodeSelector": {"fits": "nothing"},
                                           "containers": [{"name": "c", "image": "i",
                                                           "resources": {"requests": {"cpu": "100m"}}}]}}}}


def target(name):
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}


def test_an_autoscaler_is_written_at_v2_read_at_v1_and_scales_to_its_minimum(up):
    api, _ = up
    apps = client.AppsV1Api(api)
    v1, v2 = client.AutoscalingV1Api(api), client.AutoscalingV2Api(api)
    apps.create_namespaced_deployment(NS, deployment("web"))
    v2.create_namespaced_horizontal_pod_autoscaler(NS, {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "web"},
        "spec": {"scaleTargetRef": target("web"), "minReplicas": 2, "maxReplicas": 4,
                 "metrics": [{"type": "Resource", "resource": {
                     "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}}}]}})
    wait_for(apps.list_namespaced_deployment, lambda d: d["web"].spec.replicas == 2,
             timeout=60, namespace=NS)
    hpa = wait_for(v1.list_namespaced_horizontal_pod_autoscaler,
                   lambda h: h["web"].status is not None and h["web"].status.desired_replicas == 2,
                   timeout=60, namespace=NS)["web"]
    assert hpa.api_version in (None, "autoscaling/v1"), hpa.api_version
    assert hpa.spec.target_cpu_utilization_percentage == 50, hpa.spec
    assert (hpa.spec.min_replicas, hpa.spec.max_replicas) == (2, 4), hpa.spec
    assert hpa.status.last_scale_time is not None, hpa.status
    conditions = hpa.metadata.annotations["autoscaling.alpha.kubernetes.io/conditions"]
    assert "AbleToScale" in conditions, conditions

    read = v2.read_namespaced_horizontal_pod_autoscaler("web", NS)
    able = {c.type: c for c in read.status.conditions}["AbleToScale"]
    assert able.status == "True", read.status.conditions
    events = client.CoreV1Api(api).list_namespaced_event(
        NS, field_selector="involvedObject.name=web,reason=SuccessfulRescale").items
    assert any(e.message == "New size: 2; reason: Current number of replicas below Spec.MinReplicas"
               for e in events), [e.message for e in events]


def test_an_autoscaler_written_at_v1_is_read_at_v2(up):
    api, _ = up
    v1, v2 = client.AutoscalingV1Api(api), client.AutoscalingV2Api(api)
    client.AppsV1Api(api).create_namespaced_deployment(NS, deployment("api"))
    v1.create_namespaced_horizontal_pod_autoscaler(NS, {
        "apiVersion": "autoscaling/v1", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "api"},
        "spec": {"scaleTargetRef": target("api"), "maxReplicas": 3,
                 "targetCPUUtilizationPercentage": 60}})
    hpa = v2.read_namespaced_horizontal_pod_autoscaler("api", NS)
    assert hpa.spec.min_replicas == 1, hpa.spec
    [metric] = hpa.spec.metrics
    assert (metric.type, metric.resource.name) == ("Resource", "cpu"), metric
    assert (metric.resource.target.type, metric.resource.target.average_utilization) == ("Utilization", 60)
    # A v1 write that v2 refuses is refused with v2's field path.
    with pytest.raises(client.ApiException) as refused:
        v1.patch_namespaced_horizontal_pod_autoscaler("api", NS, {"spec": {"maxReplicas": 0}})
    assert refused.value.status == 422, refused.value
    assert "spec.maxReplicas" in refused.value.body, refused.value.body
