"""DaemonSets in `trellis up` through the official Python client's AppsV1Api: a
DaemonSet runs its pod on the local node, keeps a ControllerRevision per template
whose hash its pods carry, rolls a changed template out, and its pods go with it.
The pods run the WASM workload on the local node.

The workload is `plugins/target/dist/workload.wasm` (plugins/build.sh)."""

import pytest
from kubernetes import client

from conftest import REPO_ROOT, trellis_up
from test_controller_plugins import wait_for

WORKLOAD = REPO_ROOT / "plugins" / "target" / "dist" / "workload.wasm"
NS = "default"


@pytest.fixture(scope="module")
def up():
    if not WORKLOAD.exists():
        pytest.fail(f"{WORKLOAD} is missing: run plugins/build.sh")
    # No pod network or service proxy: the DaemonSet needs neither.
    with trellis_up("trellis-daemonsets-", "--pod-network=false", "--service-proxy=false") as running:
        yield running


def daemon_set(ms):
    return {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "agent"},
        "spec": {"selector": {"matchLabels": {"app": "agent"}},
                 "template": {"metadata": {"labels": {"app": "agent"}},
                              "spec": {"terminationGracePeriodSeconds": 1,
                                       "containers": [{"name": "main", "image": f"file://{WORKLOAD}",
                                                       "args": ["sleep", str(ms)]}]}}}}


def ds_until(apps, accept, timeout=60):
    return wait_for(apps.list_namespaced_daemon_set, lambda items: "agent" in items and accept(items["agent"]),
                    timeout=timeout, namespace=NS)["agent"]


def rolled_out(generation):
    def accept(ds):
        s = ds.status
        return (s is not None and (s.observed_generation or 0) >= generation
                and s.desired_number_scheduled == 1 and s.updated_number_scheduled == 1
                and s.number_available == 1)
    return accept


def test_a_daemon_set_runs_on_the_node_rolls_out_and_goes(up):
    api, _ = up
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    apps.create_namespaced_daemon_set(NS, daemon_set(3_600_000))
    ds = ds_until(apps, rolled_out(1))
    assert ds.status.current_number_scheduled == 1 and ds.status.number_misscheduled == 0, ds.status

    pods = core.list_namespaced_pod(NS, label_selector="app=agent").items
    assert len(pods) == 1, [p.metadata.name for p in pods]
    pod = pods[0]
    assert pod.spec.node_name == "local"
    assert pod.metadata.owner_references[0].kind == "DaemonSet"
    terms = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    assert terms[0].match_fields[0].key == "metadata.name" and terms[0].match_fields[0].values == ["local"]
    revisions = apps.list_namespaced_controller_revision(NS, label_selector="app=agent").items
    assert [r.revision for r in revisions] == [1]
    hash_ = pod.metadata.labels["controller-revision-hash"]
    assert revisions[0].metadata.name == f"agent-{hash_}"

    # A new template: the pod is replaced by one of the new revision.
    apps.patch_namespaced_daemon_set("agent", NS, {"spec": {"template": {"spec": {"containers": [
        {"name": "main", "args": ["sleep", "3600001"]}]}}}})
    ds_until(apps, rolled_out(2))
    revisions = apps.list_namespaced_controller_revision(NS, label_selector="app=agent").items
    assert sorted(r.revision for r in revisions) == [1, 2]
    wait_for(core.list_namespaced_pod, lambda items: len(items) == 1 and all(
        p.metadata.labels["controller-revision-hash"] != hash_ for p in items.values()),
             timeout=60, namespace=NS, label_selector="app=agent")

    apps.delete_namespaced_daemon_set("agent", NS, propagation_policy="Foreground")
    wait_for(core.list_namespaced_pod, lambda items: not items, timeout=60, namespace=NS,
             label_selector="app=agent")
