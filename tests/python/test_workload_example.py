"""examples/workloads/ticker on `trellis up`, as its README runs it: the Deployment and
its ConfigMap applied with kubectl, the Python program (a `wasi:cli/run` component)
printing the ConfigMap's message every TICK_SECONDS in `kubectl logs`; a changed
ConfigMap shows after `kubectl rollout restart`; a bad TICK_SECONDS makes the new pod
crash-loop with the error in `kubectl logs --previous` while the old one goes on.

The component is `plugins/target/dist/ticker.wasm` (plugins/build.sh). Its first start
compiles 18 MB of WebAssembly: ~16 s of CPU time with a debug build of trellis."""

import selectors
import shutil
import subprocess
import time

import pytest
from kubernetes import client

from conftest import REPO_ROOT
from test_controller_plugins import wait_for
from test_up import kubectl, up  # noqa: F401 (`up` is a fixture)

EXAMPLE = REPO_ROOT / "examples" / "workloads" / "ticker"
TICKER = REPO_ROOT / "plugins" / "target" / "dist" / "ticker.wasm"
# The first start compiles the component.
FIRST_START_SECONDS = 120


def manifest():
    return (EXAMPLE / "deployment.yaml").read_text().replace("IMAGE", f"file://{TICKER}")


def follow_until(data_dir, pod, wanted, timeout=30, extra=()):
    """`kubectl logs -f POD` until a line holds `wanted`; returns the lines so far."""
    proc = subprocess.Popen(
        [shutil.which("kubectl") or "kubectl", "--kubeconfig", str(data_dir / "admin.kubeconfig"),
         "logs", "-f", pod, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + timeout
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(timeout=deadline - time.monotonic()):
                    continue
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line.rstrip("\n"))
                if wanted in line:
                    return lines
    finally:
        proc.kill()
        proc.wait()
    raise AssertionError(f"no line with {wanted!r} in the logs of {pod}: {lines}")


def ready_pods(items):
    """The pods not being deleted whose containers are all ready."""
    def ready(pod):
        statuses = pod.status and pod.status.container_statuses or []
        return bool(statuses) and all(s.ready for s in statuses)
    return [p for p in items.values() if p.metadata.deletion_timestamp is None and ready(p)]


@pytest.fixture(scope="module")
def ticker(up):  # noqa: F811
    if not TICKER.exists():
        pytest.fail(f"{TICKER} is missing: run plugins/build.sh")
    api, data_dir = up
    v1 = client.CoreV1Api(api)
    kubectl(data_dir, "apply", "-f", "-", stdin=manifest())
    pods = wait_for(v1.list_namespaced_pod, lambda items: len(ready_pods(items)) == 1,
                    timeout=FIRST_START_SECONDS, namespace="default", label_selector="app=ticker")
    (pod,) = ready_pods(pods)
    yield api, data_dir, pod
    kubectl(data_dir, "delete", "-f", str(EXAMPLE / "deployment.yaml"))
    wait_for(v1.list_namespaced_pod, lambda items: not items, timeout=60,
             namespace="default", label_selector="app=ticker")


def test_the_ticker_prints_its_configuration_and_a_changed_configmap_after_a_restart(ticker):
    api, data_dir, pod = ticker
    name = pod.metadata.name
    assert pod.spec.node_name == "local"
    lines = follow_until(data_dir, name, "tick 2:")
    assert lines == [f"{name}: a line every 2 s, the message from /etc/ticker/message",
                     "tick 1: hello from a ConfigMap", "tick 2: hello from a ConfigMap"], lines

    kubectl(data_dir, "apply", "-f", "-", stdin=kubectl(
        data_dir, "create", "configmap", "ticker", "--from-literal=message=hello again",
        "--dry-run=client", "-o", "yaml"))
    kubectl(data_dir, "rollout", "restart", "deployment/ticker")
    # Done when the restarted pod is the only one: it has run minReadySeconds.
    pods = wait_for(client.CoreV1Api(api).list_namespaced_pod,
                    lambda items: len(items) == 1 and name not in items and len(ready_pods(items)) == 1,
                    timeout=60, namespace="default", label_selector="app=ticker")
    (restarted,) = pods
    follow_until(data_dir, restarted, "tick 1: hello again")


def test_a_bad_configuration_crash_loops_beside_the_running_pod(ticker):
    api, data_dir, _ = ticker
    v1 = client.CoreV1Api(api)
    (running,) = ready_pods({p.metadata.name: p for p in v1.list_namespaced_pod(
        "default", label_selector="app=ticker").items})
    kubectl(data_dir, "set", "env", "deployment/ticker", "TICK_SECONDS=soon")

    def crash_looping(items):
        return any(s.state.waiting is not None and s.state.waiting.reason == "CrashLoopBackOff"
                   for p in items.values() for s in p.status.container_statuses or [])
    pods = wait_for(v1.list_namespaced_pod, crash_looping, timeout=60,
                    namespace="default", label_selector="app=ticker")
    (crashing,) = [p for p in pods.values() if p.metadata.name != running.metadata.name]
    (status,) = crashing.status.container_statuses
    assert status.last_state.terminated.exit_code == 1, status.last_state
    assert kubectl(data_dir, "logs", crashing.metadata.name, "--previous") == (
        "ticker: bad configuration: TICK_SECONDS must be a number of seconds above 0, not 'soon'\n")
    # minReadySeconds: the old pod was kept, and goes on ticking.
    assert running.metadata.name in [p.metadata.name for p in ready_pods(pods)], pods
    follow_until(data_dir, running.metadata.name, "tick", timeout=10, extra=["--tail=0"])

    kubectl(data_dir, "rollout", "undo", "deployment/ticker")
    wait_for(v1.list_namespaced_pod, lambda items: list(items) == [running.metadata.name],
             timeout=60, namespace="default", label_selector="app=ticker")
