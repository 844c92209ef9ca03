"""An autoscaler in `trellis up` scales a CPU-busy Deployment up and, once its pods are
idle, back down: its process pods spin a core for 20 s, then sleep. The autoscaler
syncs every second, the metrics server reads every second, the scale-down window is
5 s."""

import os

import pytest
from kubernetes import client

from conftest import kubectl_up as kubectl, trellis_up
from test_controller_plugins import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="process pods run sandboxed, which needs root")
NS = "kube-system"


@pytest.fixture(scope="module")
def up():
    with trellis_up("trellis-autoscaling-cpu-", "--relist-period", "0.1", "--metric-resolution", "1",
                    "--horizontal-pod-autoscaler-sync-period", "1") as running:
        yield running


def test_a_busy_deployment_is_scaled_up_then_down_when_idle(up):
    api, data_dir = up
    apps, autoscaling = client.AppsV1Api(api), client.AutoscalingV2Api(api)
    labels = {"app": "spinner"}
    apps.create_namespaced_deployment(NS, {
        "metadata": {"name": "spinner"},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels},
                              "spec": {"runtimeClassName": "process", "hostNetwork": True,
                                       "terminationGracePeriodSeconds": 0,
                                       "containers": [{"name": "spin", "image": "file:///bin/sh",
                                                       "resources": {"requests": {"cpu": "100m"}},
                                                       "command": ["/bin/sh", "-c",
                                                                   "timeout 20 /bin/sh -c 'while :; do :; done'; exec sleep 3600"]}]}}}})
    autoscaling.create_namespaced_horizontal_pod_autoscaler(NS, {
        "metadata": {"name": "spinner"},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "spinner"},
                 "minReplicas": 1, "maxReplicas": 2,
                 "metrics": [{"type": "Resource", "resource": {
                     "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}}}],
                 "behavior": {"scaleDown": {"stabilizationWindowSeconds": 5}}}})
    wait_for(apps.list_namespaced_deployment, lambda d: d["spinner"].spec.replicas == 2,
             timeout=90, namespace=NS)
    hpa = autoscaling.read_namespaced_horizontal_pod_autoscaler("spinner", NS)
    [metric] = hpa.status.current_metrics
    assert metric.resource.current.average_utilization > 50, hpa.status
    table = kubectl(data_dir, "get", "hpa", "spinner", "-n", NS)
    assert "Deployment/spinner" in table and "/50%" in table, table
    top = kubectl(data_dir, "top", "pods", "-n", NS, "-l", "app=spinner")
    assert "spinner" in top, top

    # Both pods idle after their 20 s: back to one, the window of 5 s past.
    wait_for(apps.list_namespaced_deployment, lambda d: d["spinner"].spec.replicas == 1,
             timeout=90, namespace=NS)
    events = client.CoreV1Api(api).list_namespaced_event(
        NS, field_selector="involvedObject.name=spinner,reason=SuccessfulRescale").items
    messages = sorted(e.message for e in events)
    assert "New size: 1; reason: All metrics below target" in messages, messages
    assert any(m.startswith("New size: 2; reason: cpu resource utilization (percentage of request) above target")
               for m in messages), messages
    apps.delete_namespaced_deployment("spinner", NS)
