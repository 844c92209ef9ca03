"""The resource metrics API through the official client: `trellis up` runs its metrics
server and registers it as the APIService `v1beta1.metrics.k8s.io`, which the API
server proxies to. `CustomObjectsApi` reads a busy pod's `PodMetrics` (per container)
and the node's `NodeMetrics`, and `kubectl top pod` shows the same pod. The pod is a
process on the node's network (in `kube-system`, which Pod Security exempts): no pod
network is needed."""

import os
import time

import pytest
from kubernetes import client

from conftest import kubectl_up as kubectl, trellis_up

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="process pods run sandboxed, which needs root")


@pytest.fixture(scope="module")
def up():
    with trellis_up("trellis-top-", "--relist-period", "0.1", "--metric-resolution", "1") as running:
        yield running


def metrics_of(custom, namespace, name, deadline):
    """The pod's PodMetrics once it has them: two readings a resolution apart. A
    bounded retry of the real read, as nothing announces the next reading."""
    while True:
        try:
            return custom.get_namespaced_custom_object("metrics.k8s.io", "v1beta1", namespace, "pods", name)
        except client.ApiException as e:
            # 404: not read twice yet; 503: the APIService is not available yet.
            if e.status not in (404, 503) or time.monotonic() > deadline:
                raise


def nanocores(quantity):
    assert quantity.endswith("n"), quantity
    return int(quantity[:-1])


def test_the_python_client_reads_pod_and_node_metrics(up):
    api, data_dir = up
    v1 = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    v1.create_namespaced_pod("kube-system", {
        "metadata": {"name": "spinner", "labels": {"app": "spinner"}},
        "spec": {"runtimeClassName": "process", "hostNetwork": True, "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "spin", "image": "file:///bin/sh",
                                 "command": ["/bin/sh", "-c", "while :; do :; done"]}]},
    })
    metrics = metrics_of(custom, "kube-system", "spinner", time.monotonic() + 90)
    assert metrics["kind"] == "PodMetrics"
    assert metrics["metadata"]["labels"] == {"app": "spinner"}
    [container] = metrics["containers"]
    assert container["name"] == "spin"
    # A core spinning, with whatever else the machine runs: well above idle.
    assert nanocores(container["usage"]["cpu"]) >= 100_000_000, metrics

    listed = custom.list_namespaced_custom_object("metrics.k8s.io", "v1beta1", "kube-system", "pods",
                                                  label_selector="app=spinner")
    assert [m["metadata"]["name"] for m in listed["items"]] == ["spinner"]
    nodes = custom.list_cluster_custom_object("metrics.k8s.io", "v1beta1", "nodes")
    assert [n["metadata"]["name"] for n in nodes["items"]] == ["local"]
    assert nodes["items"][0]["usage"]["memory"].endswith("Ki")

    top = kubectl(data_dir, "top", "pod", "spinner", "--containers", "-n", "kube-system")
    assert "spin" in top and "CPU(cores)" in top, top
    v1.delete_namespaced_pod("spinner", "kube-system")
