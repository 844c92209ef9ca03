"""Claims and volumes in `trellis up` through the official Python client: a claim
created without a class gets the default `local-path` class and waits for its first
pod; the pod's scheduling gives the claim a volume on the local node, which the pod
writes and a second pod of the claim reads; the claim's deletion deletes its volume.
A static volume binds a claim of its class and is Released when the claim goes.
The pods run the WASM workload on the local node.

The workload is `plugins/target/dist/workload.wasm` (plugins/build.sh)."""

import pytest
from kubernetes import client

from conftest import REPO_ROOT, SHARED_NETNS, trellis_up
from test_controller_plugins import wait_for

WORKLOAD = REPO_ROOT / "plugins" / "target" / "dist" / "workload.wasm"
NS = "default"
ROOT = "trellis.dev/local-path-root"


@pytest.fixture(scope="module")
def up():
    if not WORKLOAD.exists():
        pytest.fail(f"{WORKLOAD} is missing: run plugins/build.sh")
    # Volumes need no network: none is made, so that other clusters on this machine
    # keep theirs.
    with trellis_up("trellis-storage-", "--relist-period", "0.1", "--pod-network=false",
                    *SHARED_NETNS) as running:
        yield running


def pod(name, *args):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
                     "containers": [{"name": "main", "image": f"file://{WORKLOAD}", "args": list(args),
                                     "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]}}


def phase_of(items, name):
    item = items.get(name)
    return item.status.phase if item is not None and item.status else None


def test_a_claim_of_the_default_class_keeps_its_data_across_pods(up):
    api, data_dir = up
    core, storage = client.CoreV1Api(api), client.StorageV1Api(api)
    classes = {c.metadata.name: c for c in storage.list_storage_class().items}
    assert classes["local-path"].metadata.annotations[
        "storageclass.kubernetes.io/is-default-class"] == "true"
    assert classes["local-path"].volume_binding_mode == "WaitForFirstConsumer"
    # Where the local node keeps its volumes, unless its agent said so already.
    node = wait_for(core.list_node, lambda items: "local" in items)["local"]
    if ROOT not in (node.metadata.annotations or {}):
        core.patch_node("local", {"metadata": {"annotations": {ROOT: str(data_dir / "storage")}}})

    claim = core.create_namespaced_persistent_volume_claim(NS, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "16Mi"}}}})
    assert claim.spec.storage_class_name == "local-path"

    core.create_namespaced_pod(NS, pod("writer", "write", "/data/file", "kept"))
    wait_for(core.list_namespaced_pod, lambda items: phase_of(items, "writer") == "Succeeded",
             timeout=60, namespace=NS)
    claims = wait_for(core.list_namespaced_persistent_volume_claim,
                      lambda items: phase_of(items, "data") == "Bound", namespace=NS)
    volume_name = claims["data"].spec.volume_name
    volume = core.read_persistent_volume(volume_name)
    assert volume.spec.host_path.path.startswith(str(data_dir)), volume.spec.host_path
    assert volume.spec.persistent_volume_reclaim_policy == "Delete"

    core.create_namespaced_pod(NS, pod("reader", "cat", "/data/file"))
    wait_for(core.list_namespaced_pod, lambda items: phase_of(items, "reader") == "Succeeded",
             timeout=60, namespace=NS)
    assert core.read_namespaced_pod_log("reader", NS) == "kept"

    for name in ("writer", "reader"):
        core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
    # Kubernetes answers a claim's delete with the claim, which the client parses.
    deleted = core.delete_namespaced_persistent_volume_claim("data", NS)
    assert deleted.metadata.name == "data" and deleted.spec.volume_name == volume_name, deleted
    wait_for(core.list_persistent_volume, lambda items: volume_name not in items, timeout=30)


def test_a_static_volume_binds_a_claim_of_its_class_and_is_released(up):
    api, data_dir = up
    core = client.CoreV1Api(api)
    core.create_persistent_volume({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "manual"},
        "spec": {"storageClassName": "manual", "capacity": {"storage": "1Gi"},
                 "accessModes": ["ReadWriteOnce"], "hostPath": {"path": str(data_dir / "manual")}}})
    core.create_namespaced_persistent_volume_claim(NS, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "manual"},
        "spec": {"storageClassName": "manual", "accessModes": ["ReadWriteOnce"],
                 "resources": {"requests": {"storage": "100Mi"}}}})
    claims = wait_for(core.list_namespaced_persistent_volume_claim,
                      lambda items: phase_of(items, "manual") == "Bound", namespace=NS)
    assert claims["manual"].spec.volume_name == "manual"
    core.delete_namespaced_persistent_volume_claim("manual", NS)
    volumes = wait_for(core.list_persistent_volume,
                       lambda items: phase_of(items, "manual") == "Released")
    assert volumes["manual"].spec.persistent_volume_reclaim_policy == "Retain"
