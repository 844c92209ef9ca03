"""`trellis up`, the README's first command, as one process: the API server, the
controllers, the scheduler and a local node. A Deployment created with kubectl ends as
running WASM pods on the local node, with the ownerReferences chain, the events
Kubernetes tells (ScalingReplicaSet, SuccessfulCreate, Scheduled, Pulled, Created,
Started), `kubectl logs deploy/…`; it scales down, and `kubectl delete deployment`
removes everything, the workloads on the node included. A rolling update and `kubectl
rollout undo` go as kubectl's `rollout status` expects; a crashing container goes into
CrashLoopBackOff with its previous logs kept. A second node joins with `trellis node`,
and a pod waiting for it runs there; when it dies, the node lifecycle controller marks
it and evicts its pod, and the Deployment's replacement runs on the local node (the
lease, grace and toleration times shortened for the test).

The workload is `plugins/target/dist/workload.wasm` (plugins/build.sh)."""

import shutil
import subprocess

import pytest
import yaml
from kubernetes import client

from conftest import REPO_ROOT, SHARED_NETNS, kubectl_up as kubectl, trellis_binary, trellis_up
from test_node import node_kubeconfig
from test_controller_plugins import wait_for

WORKLOAD = REPO_ROOT / "plugins" / "target" / "dist" / "workload.wasm"


@pytest.fixture(scope="module")
def up():
    if not WORKLOAD.exists():
        pytest.fail(f"{WORKLOAD} is missing: run plugins/build.sh")
    with trellis_up("trellis-up-", "--relist-period", "0.1", "--node-lease-renew", "0.5",
                    "--node-monitor-grace-period", "3",
                    # A crashing container's back-offs: 1 s, 2 s, 4 s, …
                    "--restart-backoff", "1") as running:
        yield running


def running(items, count):
    pods = [p for p in items.values() if p.metadata.deletion_timestamp is None]
    return len(pods) == count and all(p.status.phase == "Running" for p in pods)


def test_a_deployment_runs_on_the_local_node_scales_and_goes(up):
    api, data_dir = up
    v1 = client.CoreV1Api(api)
    def ready(items):
        status = items["local"].status if "local" in items else None
        return any(c.type == "Ready" and c.status == "True" for c in (status and status.conditions or []))
    node = wait_for(v1.list_node, ready, timeout=30)["local"]
    assert node.metadata.labels["handler.trellis.dev/wasmtime"] == "true"

    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}}, "spec": {
                     "terminationGracePeriodSeconds": 2,
                     "containers": [{"name": "main", "image": f"file://{WORKLOAD}",
                                     "args": ["echo", "serving", "--", "sleep", "600000"]}]}}},
    }
    kubectl(data_dir, "apply", "-f", "-", stdin=yaml.safe_dump(deployment))
    pods = wait_for(v1.list_namespaced_pod, lambda items: running(items, 3), timeout=60,
                    namespace="default", label_selector="app=web")
    for pod in pods.values():
        assert pod.spec.node_name == "local"
        (owner,) = pod.metadata.owner_references
        assert owner.kind == "ReplicaSet" and owner.name.startswith("web-")
    assert kubectl(data_dir, "logs", "deploy/web") == "serving\n"

    reasons = {(e.involved_object.kind, e.reason) for e in v1.list_namespaced_event("default").items}
    for expected in [("Deployment", "ScalingReplicaSet"), ("ReplicaSet", "SuccessfulCreate"),
                     ("Pod", "Scheduled"), ("Pod", "Pulled"), ("Pod", "Created"), ("Pod", "Started")]:
        assert expected in reasons, (expected, sorted(reasons))

    kubectl(data_dir, "scale", "deployment", "web", "--replicas=1")
    wait_for(v1.list_namespaced_pod, lambda items: len(items) == 1 and running(items, 1), timeout=60,
             namespace="default", label_selector="app=web")

    kubectl(data_dir, "delete", "deployment", "web")
    wait_for(v1.list_namespaced_pod, lambda items: not items, timeout=60,
             namespace="default", label_selector="app=web")
    wait_for(client.AppsV1Api(api).list_namespaced_replica_set, lambda items: not items, timeout=60,
             namespace="default")


def test_a_dead_nodes_pod_is_evicted_and_replaced_on_the_local_node(up):
    api, data_dir = up
    v1 = client.CoreV1Api(api)
    # A pod for a node that is not there yet waits, unschedulable, until it joins.
    waiter = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "waiter"}, "spec": {
        "nodeSelector": {"kubernetes.io/hostname": "joined"}, "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": f"file://{WORKLOAD}", "args": ["sleep", "600000"]}]}}
    kubectl(data_dir, "apply", "-f", "-", stdin=yaml.safe_dump(waiter))

    def unschedulable(items):
        conditions = items["waiter"].status.conditions or [] if "waiter" in items else []
        return any(c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
                   for c in conditions)
    wait_for(v1.list_namespaced_pod, unschedulable, timeout=30, namespace="default")
    log = open(data_dir / "joined.log", "wb")
    joined = subprocess.Popen(
        [str(trellis_binary()), "node", "--kubeconfig", str(node_kubeconfig(data_dir, "joined")),
         "--data-dir", str(data_dir / "joined"), "--node-name", "joined", "--node-port", "0",
         "--node-lease-renew", "0.5", "--relist-period", "0.1", *SHARED_NETNS],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def both_ready(items):
            return all(n in items and items[n].status and any(
                c.type == "Ready" and c.status == "True" for c in (items[n].status.conditions or []))
                for n in ("local", "joined"))
        wait_for(v1.list_node, both_ready, timeout=30)
        pods = wait_for(v1.list_namespaced_pod, lambda items: running(items, 1), timeout=60,
                        namespace="default", field_selector="metadata.name=waiter")
        assert pods["waiter"].spec.node_name == "joined"
        kubectl(data_dir, "delete", "pod", "waiter")
        # Preferring the joined node, and gone from it 0 s after it is unreachable.
        deployment = {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "mover"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "mover"}},
                     "template": {"metadata": {"labels": {"app": "mover"}}, "spec": {
                         "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                             {"weight": 100, "preference": {"matchExpressions": [
                                 {"key": "kubernetes.io/hostname", "operator": "In", "values": ["joined"]}]}}]}},
                         "tolerations": [
                             {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                              "effect": "NoExecute", "tolerationSeconds": 0},
                             {"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                              "effect": "NoExecute", "tolerationSeconds": 0}],
                         "containers": [{"name": "main", "image": f"file://{WORKLOAD}",
                                         "args": ["sleep", "600000"]}]}}},
        }
        kubectl(data_dir, "apply", "-f", "-", stdin=yaml.safe_dump(deployment))
        pods = wait_for(v1.list_namespaced_pod, lambda items: running(items, 1), timeout=60,
                        namespace="default", label_selector="app=mover")
        (first,) = pods.values()
        assert first.spec.node_name == "joined", first.spec.node_name

        joined.kill()  # the node dies: no agent to say goodbye
        joined.wait()

        def replaced(items):
            live = [p for p in items.values() if p.metadata.deletion_timestamp is None]
            return (first.metadata.name not in {p.metadata.name for p in live}
                    and len(live) == 1 and live[0].spec.node_name == "local"
                    and live[0].status.phase == "Running")
        wait_for(v1.list_namespaced_pod, replaced, timeout=60,
                 namespace="default", label_selector="app=mover")
        node = v1.read_node("joined")
        ready = {c.type: c.status for c in node.status.conditions}["Ready"]
        assert ready == "Unknown", node.status.conditions
        taints = {t.key for t in node.spec.taints or []}
        assert "node.kubernetes.io/unreachable" in taints, taints
        kubectl(data_dir, "delete", "deployment", "mover")
    finally:
        if joined.poll() is None:
            joined.kill()
        joined.wait()
        log.close()


def containers_env(pod):
    return {e.name: e.value for e in pod.spec.containers[0].env or []}


def test_a_rolling_update_and_its_undo(up):
    api, data_dir = up
    v1, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "roll"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "roll"}},
                 "strategy": {"type": "RollingUpdate",
                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                 "template": {"metadata": {"labels": {"app": "roll"}}, "spec": {
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": f"file://{WORKLOAD}",
                                     "env": [{"name": "VERSION", "value": "v1"}],
                                     "args": ["env", "VERSION", "--", "sleep", "600000"]}]}}},
    }
    kubectl(data_dir, "apply", "-f", "-", stdin=yaml.safe_dump(deployment))
    # kubectl's own notion of done: observedGeneration, updated, available.
    assert "successfully rolled out" in kubectl(data_dir, "rollout", "status", "deployment/roll",
                                                "--timeout=60s")
    (first,) = apps.list_namespaced_replica_set("default", label_selector="app=roll").items
    assert first.metadata.annotations["deployment.kubernetes.io/revision"] == "1"

    kubectl(data_dir, "set", "env", "deployment/roll", "VERSION=v2")
    assert "successfully rolled out" in kubectl(data_dir, "rollout", "status", "deployment/roll",
                                                "--timeout=60s")
    sets = {rs.metadata.name: rs for rs in
            apps.list_namespaced_replica_set("default", label_selector="app=roll").items}
    assert len(sets) == 2, sorted(sets)
    second = next(rs for name, rs in sets.items() if name != first.metadata.name)
    assert second.metadata.annotations["deployment.kubernetes.io/revision"] == "2"
    assert sets[first.metadata.name].spec.replicas == 0
    pods = wait_for(v1.list_namespaced_pod, lambda items: running(items, 2) and all(
        p.metadata.owner_references[0].name == second.metadata.name for p in items.values()),
        timeout=60, namespace="default", label_selector="app=roll")
    for pod in pods.values():
        assert containers_env(pod) == {"VERSION": "v2"}
    # The program prints its environment: the running workload has the new template.
    assert kubectl(data_dir, "logs", "deploy/roll") == "VERSION=v2\n"
    history = kubectl(data_dir, "rollout", "history", "deployment/roll")
    assert "1 " in history and "2 " in history, history

    kubectl(data_dir, "rollout", "undo", "deployment/roll")
    assert "successfully rolled out" in kubectl(data_dir, "rollout", "status", "deployment/roll",
                                                "--timeout=60s")
    # Undo brings the first ReplicaSet back as revision 3; no third set is made.
    sets = {rs.metadata.name: rs for rs in
            apps.list_namespaced_replica_set("default", label_selector="app=roll").items}
    assert len(sets) == 2, sorted(sets)
    back = sets[first.metadata.name]
    assert back.metadata.annotations["deployment.kubernetes.io/revision"] == "3"
    assert back.spec.replicas == 2 and sets[second.metadata.name].spec.replicas == 0
    pods = wait_for(v1.list_namespaced_pod, lambda items: running(items, 2) and all(
        p.metadata.owner_references[0].name == first.metadata.name for p in items.values()),
        timeout=60, namespace="default", label_selector="app=roll")
    for pod in pods.values():
        assert containers_env(pod) == {"VERSION": "v1"}
    assert kubectl(data_dir, "logs", "deploy/roll") == "VERSION=v1\n"
    kubectl(data_dir, "delete", "deployment", "roll")
    wait_for(v1.list_namespaced_pod, lambda items: not items, timeout=60,
             namespace="default", label_selector="app=roll")


def test_a_crashing_container_backs_off_and_keeps_its_previous_log(up):
    api, data_dir = up
    v1 = client.CoreV1Api(api)
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "crash"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "crash"}},
                 "template": {"metadata": {"labels": {"app": "crash"}}, "spec": {
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": f"file://{WORKLOAD}",
                                     "args": ["echo", "starting", "--", "exit", "3"]}]}}},
    }
    kubectl(data_dir, "apply", "-f", "-", stdin=yaml.safe_dump(deployment))

    def backing_off(items):
        statuses = [s for p in items.values() for s in (p.status.container_statuses or [])]
        return any(s.restart_count >= 2 and s.state.waiting is not None
                   and s.state.waiting.reason == "CrashLoopBackOff" for s in statuses)
    pods = wait_for(v1.list_namespaced_pod, backing_off, timeout=60,
                    namespace="default", label_selector="app=crash")
    (pod,) = pods.values()
    (status,) = pod.status.container_statuses
    assert status.last_state.terminated.exit_code == 3, status.last_state
    assert status.last_state.terminated.reason == "Error", status.last_state
    assert pod.status.phase == "Running", pod.status.phase
    assert not status.ready
    # The third back-off is 4 s: kubectl reads the pod within it.
    table = kubectl(data_dir, "get", "pods", "-l", "app=crash", "--no-headers")
    assert "CrashLoopBackOff" in table, table
    assert kubectl(data_dir, "logs", pod.metadata.name, "--previous") == "starting\n"
    reasons = [e.reason for e in v1.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={pod.metadata.name}").items]
    assert "BackOff" in reasons, reasons
    kubectl(data_dir, "delete", "deployment", "crash")
    wait_for(v1.list_namespaced_pod, lambda items: not items, timeout=60,
             namespace="default", label_selector="app=crash")


def test_evictions_keep_a_disruption_budget_and_kubectl_drain_waits_on_it(up):
    api, data_dir = up
    v1, policy = client.CoreV1Api(api), client.PolicyV1Api(api)
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "kept"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "kept"}},
                 "template": {"metadata": {"labels": {"app": "kept"}}, "spec": {
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": f"file://{WORKLOAD}",
                                     "args": ["sleep", "600000"]}]}}},
    }
    budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "kept"},
              "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "kept"}}}}
    kubectl(data_dir, "apply", "-f", "-", stdin=yaml.safe_dump_all([deployment, budget]))
    wait_for(v1.list_namespaced_pod, lambda items: running(items, 2), timeout=60,
             namespace="default", label_selector="app=kept")
    # The disruption controller: 2 expected, 1 must stay, 1 may go.
    wait_for(policy.list_namespaced_pod_disruption_budget,
             lambda items: "kept" in items and items["kept"].status is not None
             and items["kept"].status.disruptions_allowed == 1
             and items["kept"].status.current_healthy == 2, timeout=30, namespace="default")
    first, second = sorted(v1.list_namespaced_pod("default", label_selector="app=kept").items,
                           key=lambda p: p.metadata.name)

    client.CoreV1Api(api).create_namespaced_pod_eviction(
        first.metadata.name, "default",
        client.V1Eviction(metadata=client.V1ObjectMeta(name=first.metadata.name, namespace="default")))
    # The budget's one disruption is spent: the second eviction is refused with 429.
    with pytest.raises(client.ApiException) as refused:
        client.CoreV1Api(api).create_namespaced_pod_eviction(
            second.metadata.name, "default",
            client.V1Eviction(metadata=client.V1ObjectMeta(name=second.metadata.name, namespace="default")))
    assert refused.value.status == 429, refused.value.body
    status = yaml.safe_load(refused.value.body)
    assert status["message"] == "Cannot evict pod as it would violate the pod's disruption budget.", status
    assert status["details"]["causes"][0]["reason"] == "DisruptionBudget", status
    assert v1.read_namespaced_pod(second.metadata.name, "default").metadata.deletion_timestamp is None

    # The first one's replacement runs; then kubectl drain cordons the node and evicts
    # one pod, but the budget holds the other: no replacement can start on the cordoned
    # node, and drain gives up when its timeout runs out.
    wait_for(v1.list_namespaced_pod, lambda items: running(items, 2) and first.metadata.name not in items,
             timeout=60, namespace="default", label_selector="app=kept")
    try:
        drain = subprocess.run(
            [shutil.which("kubectl") or "kubectl", "--kubeconfig", str(data_dir / "admin.kubeconfig"),
             "drain", "local", "--pod-selector", "app=kept", "--timeout", "3s"],
            capture_output=True, text=True, timeout=60)
        assert drain.returncode != 0, drain.stdout
        assert "disruption budget" in drain.stderr, drain.stderr
        assert v1.read_node("local").spec.unschedulable
    finally:
        kubectl(data_dir, "uncordon", "local")
    kubectl(data_dir, "delete", "deployment", "kept")
    kubectl(data_dir, "delete", "pdb", "kept")
    wait_for(v1.list_namespaced_pod, lambda items: not items, timeout=60,
             namespace="default", label_selector="app=kept")
