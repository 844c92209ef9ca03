"""The scheduler end to end: a `trellis server`, a `trellis controllers` (Deployments
and ReplicaSets only) and a `trellis scheduler` against it, one set for the module,
driven with kubectl and the Python client as a user would.

- The two examples under examples/scheduler, installed as their READMEs say: a Score
  plugin in Rust places a Deployment's pods on the labelled node; a Filter plugin in
  Python turns a pod away from a node until its label goes.
- An unschedulable pod becomes schedulable when a node with the label it selects
  joins.
- A plugin that traps or spins fails the pod's cycle under `failurePolicy: Fail`
  (FailedScheduling names it) and is left out under `Ignore`; the scheduler goes on.
  Replaced mid-run by a module that does not load, its last good version keeps
  running.
- Last: a standby `trellis scheduler` takes over once the leader is killed and its
  Lease has run out (the schedulers renew every 0.2 s, a Lease lasts 2 s).

The components are built by `plugins/build.sh` (plugins/target/dist)."""

import re
import subprocess
import threading

import pytest
from kubernetes import client

from conftest import REPO_ROOT, own_server, trellis_binary
from test_controller_plugins import wait_for

DIST = REPO_ROOT / "plugins" / "target" / "dist"
EXAMPLES = REPO_ROOT / "examples" / "scheduler"
PLUGINS = dict(group="trellis.dev", version="v1", plural="plugins")
FAST_LEASE = ["--leader-elect-lease-duration", "2", "--leader-elect-renew-deadline", "1.5",
              "--leader-elect-retry-period", "0.2"]


def component(args, name, log, leading=None):
    """Starts `trellis ARGS`; its log lines go to `log`, and `leading` is set when it
    says it leads."""
    proc = subprocess.Popen([str(trellis_binary()), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)

    def read():
        for line in proc.stderr:
            line = re.sub(r"\x1b\[[0-9;]*m", "", line)
            log.append(f"{name}: {line}")
            if leading is not None and "trellis_client::leader: leading" in line:
                leading.set()
    threading.Thread(target=read, daemon=True).start()
    return proc


def scheduler(data_dir, name, log, leading=None):
    return component(["scheduler", "--kubeconfig", str(data_dir / "scheduler.kubeconfig"),
                      "--metrics-bind-address", "", "--pod-initial-backoff", "0.1",
                      "--pod-max-backoff", "0.5", *FAST_LEASE], name, log, leading)


@pytest.fixture(scope="module")
def scheduling():
    """The three processes; yields the admin client, the data directory, and the
    processes and their log (for the failover test, which adds one)."""
    with own_server("trellis-sched-") as (api, data_dir):
        log: list[str] = []
        procs = [
            component(["controllers", "--kubeconfig", str(data_dir / "controller-manager.kubeconfig"),
                       "--metrics-bind-address", "", "--controllers", "deployment,replicaset"],
                      "controllers", log),
            scheduler(data_dir, "scheduler", log),
        ]
        try:
            yield api, data_dir, (procs, log)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            print("".join(log[-40:]))


def kubectl(data_dir, *args, stdin=None):
    return subprocess.run(["kubectl", "--kubeconfig", str(data_dir / "admin.kubeconfig"), *args],
                          input=stdin, capture_output=True, text=True, check=True).stdout


def node_yaml(name, labels=None):
    labels = labels or {}
    label_text = ", ".join(f"{k}: {v}" for k, v in labels.items())
    return f"""apiVersion: v1
kind: Node
metadata: {{name: {name}, labels: {{{label_text}}}}}
status:
  allocatable: {{cpu: "8", memory: 16Gi, pods: "110"}}
  capacity: {{cpu: "8", memory: 16Gi, pods: "110"}}
"""


def install(data_dir, example, module):
    text = (EXAMPLES / example / "plugin.yaml").read_text()
    kubectl(data_dir, "apply", "-f", "-", stdin=text.replace("MODULE", f"file://{module}"))


def loaded(name):
    def accept(items):
        status = (items.get(name) or {}).get("status") or {}
        return any(c["type"] == "Loaded" and c["status"] == "True"
                   for c in status.get("conditions") or [])
    return accept


def as_dict(obj):
    """A pod as JSON: the watch hands some as dicts, the list as models."""
    return obj if isinstance(obj, dict) else client.ApiClient().sanitize_for_serialization(obj)


def pods_where(core, namespace, accept, **kwargs):
    """Lists and watches pods until `accept` holds for them (as JSON, by name)."""
    return wait_for(lambda **kw: core.list_namespaced_pod(namespace, **kw),
                    lambda items: accept({n: as_dict(p) for n, p in items.items()}), **kwargs)


def node_of(items, name):
    pod = items.get(name)
    return pod and as_dict(pod).get("spec", {}).get("nodeName")


def events_for(core, name, reason):
    return [e for e in core.list_namespaced_event("default").items
            if e.involved_object.name == name and e.reason == reason]


def test_the_prefer_label_example_works_as_its_readme_says(scheduling):
    module = DIST / "prefer-label.wasm"
    assert module.is_file(), f"{module}: run plugins/build.sh"
    api, data_dir, _ = scheduling
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    for name in ("fast", "slow"):
        kubectl(data_dir, "apply", "-f", "-", stdin=node_yaml(name))
    kubectl(data_dir, "label", "node", "fast", "disktype=ssd")
    install(data_dir, "prefer-label", module)
    wait_for(lambda **kw: custom.list_cluster_custom_object(**PLUGINS, **kw), loaded("prefer-label"))
    kubectl(data_dir, "apply", "-f", str(EXAMPLES / "web.yaml"))

    def all_bound(items):
        web = [n for n in items if n.startswith("web-")]
        return len(web) == 3 and all(node_of(items, n) for n in web)
    items = pods_where(core, "default", all_bound)
    assert {node_of(items, n) for n in items if n.startswith("web-")} == {"fast"}
    table = kubectl(data_dir, "get", "events", "--field-selector", "reason=Scheduled")
    assert re.search(r"Successfully assigned default/web-\S+ to fast", table), table
    kubectl(data_dir, "delete", "deployment", "web")
    kubectl(data_dir, "delete", "plugin", "prefer-label")
    kubectl(data_dir, "delete", "node", "fast", "slow")


def test_the_avoid_nodes_example_works_as_its_readme_says(scheduling):
    module = DIST / "avoid-nodes.wasm"
    assert module.is_file(), f"{module}: run plugins/build.sh"
    api, data_dir, _ = scheduling
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    kubectl(data_dir, "apply", "-f", "-",
            stdin=node_yaml("spare", {"trellis.dev/avoid": "maintenance"}))
    install(data_dir, "avoid-nodes", module)
    wait_for(lambda **kw: custom.list_cluster_custom_object(**PLUGINS, **kw), loaded("avoid-nodes"),
             timeout=60)
    kubectl(data_dir, "apply", "-f", str(EXAMPLES / "visitor.yaml"))
    wanted = ("0/1 nodes are available: 1 node(s) are avoided (trellis.dev/avoid: maintenance)."
              " preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod..")
    wait_for(core.list_namespaced_event,
             lambda items: any(e.involved_object.name == "visitor" and e.message == wanted
                               for e in items.values()),
             namespace="default")
    kubectl(data_dir, "label", "node", "spare", "trellis.dev/avoid-")
    items = pods_where(core, "default", lambda items: node_of(items, "visitor"))
    assert node_of(items, "visitor") == "spare"
    kubectl(data_dir, "delete", "pod", "visitor", "--wait=false")
    kubectl(data_dir, "delete", "plugin", "avoid-nodes")
    kubectl(data_dir, "delete", "node", "spare")


def test_an_unschedulable_pod_is_bound_when_a_node_with_its_label_joins(scheduling):
    api, data_dir, _ = scheduling
    core = client.CoreV1Api(api)
    kubectl(data_dir, "apply", "-f", "-", stdin=node_yaml("red-1", {"team": "red"}))
    core.create_namespaced_pod("default", {
        "metadata": {"name": "picky"},
        "spec": {"nodeSelector": {"team": "blue"},
                 "containers": [{"name": "c", "image": "nginx"}]}})

    def scheduled_condition(items):
        pod = items.get("picky") or {}
        return next((c for c in pod.get("status", {}).get("conditions") or []
                     if c["type"] == "PodScheduled"), None)
    items = pods_where(core, "default", lambda items: (scheduled_condition(items) or {}).get(
        "reason") == "Unschedulable")
    condition = scheduled_condition({n: as_dict(p) for n, p in items.items()})
    assert condition["status"] == "False", condition
    message = condition["message"]
    assert message == ("0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
                       " preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling.."), message
    kubectl(data_dir, "apply", "-f", "-", stdin=node_yaml("blue-1", {"team": "blue"}))
    items = pods_where(core, "default", lambda items: node_of(items, "picky"))
    assert node_of(items, "picky") == "blue-1"
    kubectl(data_dir, "delete", "pod", "picky", "--wait=false")
    kubectl(data_dir, "delete", "node", "blue-1", "red-1")


def test_a_plugin_that_traps_or_spins_fails_the_cycle_by_its_failure_policy(scheduling):
    module = DIST / "scheduler-misbehave.wasm"
    assert module.is_file(), f"{module}: run plugins/build.sh"
    api, data_dir, _ = scheduling
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    kubectl(data_dir, "apply", "-f", "-", stdin=node_yaml("plain"))
    custom.create_cluster_custom_object(**PLUGINS, body={
        "apiVersion": "trellis.dev/v1", "kind": "Plugin", "metadata": {"name": "misbehave"},
        "spec": {"kind": "scheduler", "module": {"url": f"file://{module}"},
                 "failurePolicy": "Fail", "timeoutMs": 300}})
    wait_for(lambda **kw: custom.list_cluster_custom_object(**PLUGINS, **kw), loaded("misbehave"))
    for name, asked in (("trapper", "trap"), ("spinner", "spin")):
        core.create_namespaced_pod("default", {
            "metadata": {"name": name, "annotations": {"trellis.dev/misbehave": asked}},
            "spec": {"containers": [{"name": "c", "image": "nginx"}]}})
    # Under Fail, the cycle fails and says which plugin and how; the pods wait.
    wait_for(core.list_namespaced_event, lambda items: any(
        e.involved_object.name == "trapper" and e.reason == "FailedScheduling"
        and "plugin misbehave" in e.message and "trapped" in e.message
        for e in items.values()), namespace="default")
    wait_for(core.list_namespaced_event, lambda items: any(
        e.involved_object.name == "spinner" and e.reason == "FailedScheduling"
        and "plugin misbehave" in e.message and "timed out after 300ms" in e.message
        for e in items.values()), namespace="default")
    # A pod that asks for nothing odd is scheduled meanwhile: the scheduler goes on.
    core.create_namespaced_pod("default", {
        "metadata": {"name": "calm"}, "spec": {"containers": [{"name": "c", "image": "nginx"}]}})
    pods_where(core, "default", lambda items: node_of(items, "calm"))
    assert not core.read_namespaced_pod("trapper", "default").spec.node_name
    # Replaced mid-run by a module that does not load: the last good version keeps
    # running, and says so; a new pod that makes it trap still fails its cycle.
    custom.patch_cluster_custom_object(**PLUGINS, name="misbehave", body={
        "spec": {"module": {"url": f"file://{module.parent / 'no-such-plugin.wasm'}"}}})

    def kept(items):
        status = (items.get("misbehave") or {}).get("status") or {}
        return any(c["type"] == "Loaded" and c["status"] == "False"
                   and "last good version" in (c.get("message") or "")
                   for c in status.get("conditions") or [])
    wait_for(lambda **kw: custom.list_cluster_custom_object(**PLUGINS, **kw), kept)
    core.create_namespaced_pod("default", {
        "metadata": {"name": "trapper-again", "annotations": {"trellis.dev/misbehave": "trap"}},
        "spec": {"containers": [{"name": "c", "image": "nginx"}]}})
    wait_for(core.list_namespaced_event, lambda items: any(
        e.involved_object.name == "trapper-again" and e.reason == "FailedScheduling"
        and "plugin misbehave" in e.message and "trapped" in e.message
        for e in items.values()), namespace="default")
    # Under Ignore (and its module back), the plugin is left out of the failing
    # cycles: all are bound.
    custom.patch_cluster_custom_object(**PLUGINS, name="misbehave", body={
        "spec": {"failurePolicy": "Ignore", "module": {"url": f"file://{module}"}}})
    items = pods_where(core, "default", lambda items: all(
        node_of(items, n) for n in ("trapper", "spinner", "trapper-again")))
    assert node_of(items, "trapper") == "plain"
    for name in ("trapper", "spinner", "calm", "trapper-again"):
        kubectl(data_dir, "delete", "pod", name, "--wait=false")
    kubectl(data_dir, "delete", "plugin", "misbehave")
    kubectl(data_dir, "delete", "node", "plain")


def test_a_standby_scheduler_takes_over_when_the_leader_is_killed(scheduling):
    api, data_dir, (procs, log) = scheduling
    core = client.CoreV1Api(api)
    kubectl(data_dir, "apply", "-f", "-", stdin=node_yaml("solo"))
    core.create_namespaced_pod("default", {
        "metadata": {"name": "before"}, "spec": {"containers": [{"name": "c", "image": "nginx"}]}})
    pods_where(core, "default", lambda items: node_of(items, "before"))
    leading = threading.Event()
    procs.append(scheduler(data_dir, "standby", log, leading))
    # The first still leads: the standby waits.
    assert not leading.wait(1.0), "the standby leads beside a live leader"
    procs[1].kill()
    procs[1].wait()
    assert leading.wait(10), "the standby did not take over"
    core.create_namespaced_pod("default", {
        "metadata": {"name": "after"}, "spec": {"containers": [{"name": "c", "image": "nginx"}]}})
    items = pods_where(core, "default", lambda items: node_of(items, "after"))
    assert node_of(items, "after") == "solo"
    kubectl(data_dir, "delete", "pod", "before", "after", "--wait=false")
    kubectl(data_dir, "delete", "node", "solo")
