"""A node as its own processes: a `trellis server`, a `trellis runtime` serving CRI on
its own socket, and a `trellis node` joined to the server with a node's certificate
(`system:node:py-node` in `system:nodes`, signed by the cluster CA with openssl, as
an administrator would make one) and driving that runtime
(`--container-runtime-endpoint`). Driven with kubectl and the Python client as a user
would:

- the Node registers Ready with its handlers;
- a WASM pod runs; `kubectl logs` (with `-f`) reads its output through the API
  server and the node; `kubectl get pod` shows it Running;
- a pod asking for a handler the node lacks (`gvisor`) fails and says why;
- `kubectl exec` runs a command in a `process` pod (its stdout, stderr, exit code and
  stdin), and says a WASM pod has no shell;
- `kubectl delete pod` waits while the node stops the pod, then it is gone.

The workload is `plugins/target/dist/workload.wasm` (plugins/build.sh).

Nodes run with `--pod-network=false`: a bare `trellis server` runs no node IPAM
controller, so no Node gets a pod CIDR for pods on a network of their own to wait for."""

import subprocess
import time

import pytest
import yaml
from kubernetes import client

from conftest import REPO_ROOT, SHARED_NETNS, own_server, trellis_binary
from test_controller_plugins import wait_for

WORKLOAD = REPO_ROOT / "plugins" / "target" / "dist" / "workload.wasm"
NODE = "py-node"


def node_kubeconfig(data_dir, node=NODE):
    """A kubeconfig for the node: a key and a certificate the cluster CA signed."""
    pki = data_dir / "pki"
    key, csr, crt = data_dir / f"{node}.key", data_dir / f"{node}.csr", data_dir / f"{node}.crt"
    # Extensions make it an X.509 v3 certificate, which TLS libraries require.
    ext = data_dir / "node.ext"
    ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n")
    subprocess.run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", csr, "-subj", f"/O=system:nodes/CN=system:node:{node}"],
                   check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", csr, "-CA", pki / "ca.crt", "-CAkey", pki / "ca.key",
                    "-CAcreateserial", "-days", "1", "-extfile", ext, "-out", crt], check=True, capture_output=True)
    admin = yaml.safe_load((data_dir / "admin.kubeconfig").read_text())
    admin["users"] = [{"name": node, "user": {"client-certificate": str(crt), "client-key": str(key)}}]
    admin["contexts"][0]["context"]["user"] = node
    path = data_dir / f"{node}.kubeconfig"
    path.write_text(yaml.safe_dump(admin))
    return path


@pytest.fixture(scope="module")
def cluster():
    if not WORKLOAD.exists():
        pytest.fail(f"{WORKLOAD} is missing: run plugins/build.sh")
    with own_server("trellis-node-") as (api, data_dir):
        node_dir = data_dir / "node-data"
        socket = data_dir / "cri.sock"
        log = open(data_dir / "node.log", "wb")
        runtime = subprocess.Popen(
            [str(trellis_binary()), "runtime", "--listen", f"unix://{socket}",
             "--root", str(data_dir / "runtime"), "--process-handler", "true"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        proc = subprocess.Popen(
            [str(trellis_binary()), "node", "--pod-network=false", *SHARED_NETNS, "--kubeconfig", str(node_kubeconfig(data_dir)),
             "--data-dir", str(node_dir), "--node-name", NODE, "--node-port", "0",
             "--relist-period", "0.1", "--container-runtime-endpoint", f"unix://{socket}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            yield api, data_dir
        finally:
            for p in (proc, runtime):
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            log.close()
            print((data_dir / "node.log").read_text()[-3000:])


def kubectl(data_dir, *args, check=True, timeout=30):
    result = subprocess.run(["kubectl", "--kubeconfig", str(data_dir / "admin.kubeconfig"), *args],
                            capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def ready_node(api):
    def ready(items):
        node = items.get(NODE)
        conditions = {c.type: c.status for c in (node.status.conditions or [])} if node and node.status else {}
        return conditions.get("Ready") == "True"
    return wait_for(client.CoreV1Api(api).list_node, ready, timeout=30)[NODE]


def wait_pod(api, name, accept, timeout=30):
    return wait_for(client.CoreV1Api(api).list_namespaced_pod,
                    lambda items: name in items and accept(items[name]),
                    timeout=timeout, namespace="default")[name]


def test_the_node_registers_ready_with_its_handlers(cluster):
    api, _ = cluster
    node = ready_node(api)
    handlers = sorted(h.name for h in node.status.runtime_handlers)
    assert handlers == ["process", "wasmtime"], handlers
    assert node.status.daemon_endpoints.kubelet_endpoint.port > 0
    assert node.metadata.labels["kubernetes.io/hostname"] == NODE


def test_a_wasm_pod_runs_and_kubectl_reads_its_log(cluster):
    api, data_dir = cluster
    ready_node(api)
    manifest = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ticker"},
        "spec": {"nodeName": NODE, "terminationGracePeriodSeconds": 2, "containers": [{
            "name": "main", "image": f"file://{WORKLOAD}",
            "args": ["echo", "tick 1", "--", "sleep", "300", "--", "echo", "tick 2", "--", "sleep", "600000"]}]},
    }
    subprocess.run(["kubectl", "--kubeconfig", str(data_dir / "admin.kubeconfig"), "apply", "-f", "-"],
                   input=yaml.safe_dump(manifest), text=True, check=True, capture_output=True)
    v1 = client.CoreV1Api(api)
    wait_pod(api, "ticker", lambda p: p.status.phase == "Running")
    # -f streams: the second line arrives while kubectl is attached.
    follow = subprocess.Popen(["kubectl", "--kubeconfig", str(data_dir / "admin.kubeconfig"), "logs", "-f", "ticker"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert follow.stdout.readline() == "tick 1\n"
        assert follow.stdout.readline() == "tick 2\n"
    finally:
        follow.kill()
        follow.wait()
    assert kubectl(data_dir, "logs", "ticker", "--tail", "1").stdout == "tick 2\n"
    row = kubectl(data_dir, "get", "pod", "ticker", "--no-headers").stdout.split()
    assert row[1:3] == ["1/1", "Running"], row

    # Deleted: kubectl waits while the node stops it, then it is gone.
    started = time.monotonic()
    kubectl(data_dir, "delete", "pod", "ticker", "--wait=true", timeout=60)
    with pytest.raises(client.ApiException) as gone:
        v1.read_namespaced_pod("ticker", "default")
    assert gone.value.status == 404
    assert time.monotonic() - started < 30


def test_a_pod_for_a_handler_the_node_lacks_fails_and_says_why(cluster):
    api, data_dir = cluster
    ready_node(api)
    v1 = client.CoreV1Api(api)
    client.NodeV1Api(api).create_runtime_class({"metadata": {"name": "gvisor"}, "handler": "gvisor"})
    v1.create_namespaced_pod("default", {
        "metadata": {"name": "sandboxed"},
        "spec": {"nodeName": NODE, "runtimeClassName": "gvisor",
                 "containers": [{"name": "main", "image": "file:///bin/true"}]},
    })
    pod = wait_pod(api, "sandboxed", lambda p: p.status.phase == "Failed")
    assert pod.status.reason == "UnsupportedRuntimeHandler", pod.status
    assert 'no runtime handler "gvisor"' in pod.status.message, pod.status.message
    events = kubectl(data_dir, "get", "events", "--field-selector", "involvedObject.name=sandboxed").stdout
    assert "FailedCreatePodSandBox" in events, events


def test_kubectl_exec_runs_commands_in_a_process_pod_and_refuses_a_wasm_one(cluster):
    api, data_dir = cluster
    ready_node(api)
    v1 = client.CoreV1Api(api)
    v1.create_namespaced_pod("default", {
        "metadata": {"name": "shell"},
        "spec": {"nodeName": NODE, "runtimeClassName": "process", "terminationGracePeriodSeconds": 2,
                 "containers": [{"name": "main", "image": "file:///bin/sleep", "args": ["600"]}]},
    })
    v1.create_namespaced_pod("default", {
        "metadata": {"name": "component"},
        "spec": {"nodeName": NODE, "terminationGracePeriodSeconds": 2,
                 "containers": [{"name": "main", "image": f"file://{WORKLOAD}", "args": ["sleep", "600000"]}]},
    })
    try:
        wait_pod(api, "shell", lambda p: p.status.phase == "Running")
        ran = kubectl(data_dir, "exec", "shell", "--", "sh", "-c", "echo out; echo err >&2; exit 3", check=False)
        # The last line is kubectl's, from the exit code the node sent.
        assert (ran.returncode, ran.stdout) == (3, "out\n"), ran
        assert ran.stderr == "err\ncommand terminated with exit code 3\n", ran

        cat = subprocess.run(["kubectl", "--kubeconfig", str(data_dir / "admin.kubeconfig"),
                              "exec", "-i", "shell", "--", "cat"],
                             input="hello", capture_output=True, text=True, timeout=30)
        assert (cat.returncode, cat.stdout) == (0, "hello"), cat

        wait_pod(api, "component", lambda p: p.status.phase == "Running")
        refused = kubectl(data_dir, "exec", "component", "--", "sh", check=False)
        assert refused.returncode != 0, refused
        assert "container main runs a WebAssembly component: it has no shell to exec into" in refused.stderr, refused
        # Refused before any upgrade: kubectl's SPDY fallback gets the same answer.
        missing = kubectl(data_dir, "exec", "nosuch", "--", "true", check=False)
        assert missing.returncode != 0 and 'pods "nosuch" not found' in missing.stderr, missing
    finally:
        kubectl(data_dir, "delete", "pod", "shell", "component", "--wait=true", timeout=60)
