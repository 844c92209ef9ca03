"""`trellis controllers` as separate processes, the control plane on etcd with two API
servers: each component talks to a different server, exactly one leads its Lease, its
built-in controllers work through the server with ServiceAccount tokens of their own
(a Deployment becomes a ReplicaSet and pods; a foreground delete from the Python
client removes them in order), a standby takes over once a killed leader's lease has
run out, a leader stopped by SIGTERM hands the lease back, and each process's /metrics
says whether it leads. On the same two servers, the whole flow with every component a
process of its own: the controllers on one server, the scheduler and a `trellis node`
on the other, a second node on the first; a Deployment's pods run one on each node,
and `kubectl logs` reads either pod through either server."""

import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client, config, watch

from conftest import REPO_ROOT, SHARED_NETNS, remove_data_dir, start_server, stop_server, trellis_binary, wait_ready
from test_controller_plugins import wait_for
from test_node import node_kubeconfig

LEASE = "kube-controller-manager"
FAST = [
    "--leader-elect-lease-duration", "2",
    "--leader-elect-renew-deadline", "1.5",
    "--leader-elect-retry-period", "0.2",
]
LEADING = f'leader_election_master_status{{name="{LEASE}"}}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_etcd_serving(etcd: subprocess.Popen, timeout: float = 10.0) -> None:
    """Reads etcd's log until it says it serves clients (and keeps draining it, so
    that etcd never blocks on a full pipe)."""
    serving = threading.Event()

    def read():
        for line in etcd.stderr:
            if "serving client traffic" in line:
                serving.set()

    threading.Thread(target=read, daemon=True).start()
    assert serving.wait(timeout), f"etcd not serving after {timeout} s (exit {etcd.poll()})"


@pytest.fixture(scope="module")
def two_servers_on_etcd():
    """etcd on loopback and two `trellis server`s on it sharing one CA (the second
    gets the first's `pki/ca.*` and `pki/sa.key` before it starts); yields their data
    directories."""
    etcd_bin = shutil.which("etcd") or "/usr/bin/etcd"
    etcd_dir = Path(tempfile.mkdtemp(prefix="trellis-etcd-"))
    client_port, peer_port = free_port(), free_port()
    etcd = subprocess.Popen(
        [etcd_bin, "--data-dir", str(etcd_dir / "data"), "--name", "test",
         "--listen-client-urls", f"http://127.0.0.1:{client_port}",
         "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"test=http://127.0.0.1:{peer_port}",
         "--log-level", "info", "--logger", "zap"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    dirs, servers = [], []
    try:
        wait_etcd_serving(etcd)
        store = f"etcd://127.0.0.1:{client_port}"
        first = Path(tempfile.mkdtemp(prefix="trellis-py-etcd-a-"))
        dirs.append(first)
        servers.append(start_server(first, "--store", store))
        wait_ready(servers[0], first)
        second = Path(tempfile.mkdtemp(prefix="trellis-py-etcd-b-"))
        dirs.append(second)
        (second / "pki").mkdir(mode=0o700)
        for name in ("ca.crt", "ca.key", "sa.key"):
            shutil.copy2(first / "pki" / name, second / "pki" / name)
        servers.append(start_server(second, "--store", store))
        wait_ready(servers[1], second)
        yield dirs
    finally:
        for proc in servers:
            stop_server(proc)
        for d in dirs:
            remove_data_dir(d)
        etcd.terminate()
        etcd.wait(timeout=10)
        shutil.rmtree(etcd_dir, ignore_errors=True)


class Component:
    """One `trellis controllers` process; `running` is set when it logs that its loops
    run (it leads), `metrics_url` once it logs where its metrics are."""

    def __init__(self, data_dir: Path, anyone_running: threading.Event):
        self.proc = subprocess.Popen(
            [str(trellis_binary()), "controllers",
             "--kubeconfig", str(data_dir / "controller-manager.kubeconfig"),
             "--metrics-bind-address", "127.0.0.1:0", *FAST],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.running = threading.Event()
        self.serving = threading.Event()
        self.metrics_url = ""
        self.anyone_running = anyone_running
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            line = re.sub(r"\x1b\[[0-9;]*m", "", line)
            self.log.append(line)
            found = re.search(r"serving metrics address=(\S+)", line)
            if found:
                self.metrics_url = f"http://{found.group(1)}/metrics"
                self.serving.set()
            if "running;" in line:
                self.running.set()
                self.anyone_running.set()

    def metrics(self) -> str:
        assert self.serving.wait(10), self.log
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            return response.read().decode()

    def leading_metric(self) -> str:
        text = self.metrics()
        for line in text.splitlines():
            if line.startswith(LEADING):
                return line.split()[-1]
        return "absent"


def holder_becomes(coordination, accept, timeout=15) -> str:
    """Watches the Lease until its holder is one `accept` takes; returns it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stream = watch.Watch().stream(
            coordination.list_namespaced_lease, "kube-system",
            field_selector=f"metadata.name={LEASE}",
            timeout_seconds=max(1, int(deadline - time.monotonic())))
        for event in stream:
            holder = event["object"].spec.holder_identity
            if event["type"] != "DELETED" and accept(holder):
                return holder
    raise AssertionError(f"the {LEASE} lease never got the holder expected")


def pods_of_web(core, accept, timeout=15):
    """Watches the pods labelled app=web until `accept` takes their number."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = core.list_namespaced_pod("default", label_selector="app=web")
        names = {p.metadata.name for p in listed.items}
        if accept(len(names)):
            return
        stream = watch.Watch().stream(
            core.list_namespaced_pod, "default", label_selector="app=web",
            resource_version=listed.metadata.resource_version,
            timeout_seconds=max(1, int(deadline - time.monotonic())))
        for event in stream:
            name = event["object"].metadata.name
            if event["type"] == "DELETED":
                names.discard(name)
            else:
                names.add(name)
            if accept(len(names)):
                return
    raise AssertionError("the pods of web never reached the number expected")


def deployment_gone(apps, name, timeout=15):
    """Watches Deployment `name` until it is deleted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = apps.list_namespaced_deployment(
            "default", field_selector=f"metadata.name={name}")
        if not listed.items:
            return
        stream = watch.Watch().stream(
            apps.list_namespaced_deployment, "default",
            field_selector=f"metadata.name={name}",
            resource_version=listed.metadata.resource_version,
            timeout_seconds=max(1, int(deadline - time.monotonic())))
        for event in stream:
            if event["type"] == "DELETED":
                return
    raise AssertionError(f"Deployment {name} still there after {timeout} s")


def test_one_leader_across_two_api_servers_a_standby_takes_over_and_sigterm_hands_back(
        two_servers_on_etcd):
    first_dir, second_dir = two_servers_on_etcd
    admin = config.new_client_from_config(config_file=str(first_dir / "admin.kubeconfig"))
    coordination = client.CoordinationV1Api(admin)
    anyone_running = threading.Event()
    components = [Component(first_dir, anyone_running), Component(second_dir, anyone_running)]
    try:
        first = holder_becomes(coordination, bool)
        assert anyone_running.wait(10), [c.log for c in components]
        leader = 0 if components[0].running.is_set() else 1
        standby = 1 - leader
        assert not components[standby].running.is_set(), components[standby].log
        assert components[leader].leading_metric() == "1"
        assert components[standby].leading_metric() in ("0", "absent")

        # The components act as their own user, not as the admin, on either server.
        for data_dir in (first_dir, second_dir):
            component = config.new_client_from_config(
                config_file=str(data_dir / "controller-manager.kubeconfig"))
            review = client.AuthenticationV1Api(component).create_self_subject_review(
                client.V1SelfSubjectReview())
            assert review.status.user_info.username == "system:kube-controller-manager"
            assert "system:masters" not in (review.status.user_info.groups or [])

        # The leader's built-in controllers, each as its own ServiceAccount through its
        # own server: a Deployment becomes a ReplicaSet and its pods.
        apps, core = client.AppsV1Api(admin), client.CoreV1Api(admin)
        apps.create_namespaced_deployment("default", {
            "metadata": {"name": "web"},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                     "template": {"metadata": {"labels": {"app": "web"}},
                                  "spec": {"containers": [{"name": "c", "image": "i"}]}}}})
        pods_of_web(core, lambda n: n == 2)
        sets = apps.list_namespaced_replica_set("default", label_selector="app=web").items
        assert len(sets) == 1 and sets[0].metadata.owner_references[0].kind == "Deployment"
        # Their calls are counted on the leader's /metrics.
        calls = [line for line in components[leader].metrics().splitlines()
                 if line.startswith('trellis_plugin_calls_total{plugin="replicaset-controller"')]
        assert calls and int(calls[0].split()[-1]) > 0, calls
        accounts = {a.metadata.name for a in
                    core.list_namespaced_service_account("kube-system").items}
        assert {"deployment-controller", "replicaset-controller"} <= accounts, accounts
        # Foreground deletion through the Python client: the Deployment is held by the
        # `foregroundDeletion` finalizer until its ReplicaSet and pods are gone.
        # The answer is the marked Deployment, which the client's V1Status model
        # leaves as a dict.
        marked = apps.delete_namespaced_deployment(
            "web", "default", body=client.V1DeleteOptions(propagation_policy="Foreground"))
        finalizers = marked["metadata"].get("finalizers") or [] if isinstance(marked, dict) \
            else marked.metadata.finalizers or []
        assert "foregroundDeletion" in finalizers, marked
        pods_of_web(core, lambda n: n == 0)
        deployment_gone(apps, "web")
        assert not apps.list_namespaced_replica_set("default", label_selector="app=web").items

        components[leader].proc.send_signal(signal.SIGKILL)
        components[leader].proc.wait()
        killed = time.monotonic()
        second = holder_becomes(coordination, lambda h: bool(h) and h != first)
        takeover = time.monotonic() - killed
        print(f"takeover across API servers: {takeover:.2f} s (lease 2 s)")
        assert 1.5 <= takeover < 5.0, takeover
        assert components[standby].running.wait(10), components[standby].log
        assert components[standby].leading_metric() == "1"
        lease = coordination.read_namespaced_lease(LEASE, "kube-system")
        assert lease.spec.lease_transitions >= 1

        components[standby].proc.send_signal(signal.SIGTERM)
        assert components[standby].proc.wait(timeout=10) == 0, components[standby].log
        lease = coordination.read_namespaced_lease(LEASE, "kube-system")
        assert lease.spec.holder_identity in (None, ""), second
    finally:
        for c in components:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        admin.close()


WORKLOAD = REPO_ROOT / "plugins" / "target" / "dist" / "workload.wasm"


def test_a_deployment_runs_on_two_nodes_each_joined_to_another_api_server(two_servers_on_etcd):
    first_dir, second_dir = two_servers_on_etcd
    log = open(first_dir / "flow.log", "wb")
    trellis = str(trellis_binary())

    def start(*args):
        return subprocess.Popen([trellis, *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    procs = [
        start("controllers", "--kubeconfig", str(first_dir / "controller-manager.kubeconfig"),
              "--metrics-bind-address", "", *FAST),
        start("scheduler", "--kubeconfig", str(second_dir / "scheduler.kubeconfig"),
              "--metrics-bind-address", "", *FAST),
    ]
    for data_dir, node in ((first_dir, "node-a"), (second_dir, "node-b")):
        procs.append(start("node", "--kubeconfig", str(node_kubeconfig(data_dir, node)),
                           "--data-dir", str(data_dir / node), "--node-name", node,
                           "--node-port", "0", "--relist-period", "0.1", *SHARED_NETNS))
    admin_a = config.new_client_from_config(config_file=str(first_dir / "admin.kubeconfig"))
    admin_b = config.new_client_from_config(config_file=str(second_dir / "admin.kubeconfig"))
    try:
        core_a, core_b = client.CoreV1Api(admin_a), client.CoreV1Api(admin_b)

        def ready(items):
            return all(n in items and items[n].status and any(
                c.type == "Ready" and c.status == "True" for c in items[n].status.conditions or [])
                for n in ("node-a", "node-b"))
        wait_for(core_b.list_node, ready, timeout=30)
        client.AppsV1Api(admin_b).create_namespaced_deployment("default", {
            "metadata": {"name": "spread"},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "spread"}},
                     "template": {"metadata": {"labels": {"app": "spread"}}, "spec": {
                         "terminationGracePeriodSeconds": 1,
                         "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                             {"labelSelector": {"matchLabels": {"app": "spread"}},
                              "topologyKey": "kubernetes.io/hostname"}]}},
                         "containers": [{"name": "main", "image": f"file://{WORKLOAD}",
                                         "args": ["echo", "spread", "--", "sleep", "600000"]}]}}}})

        def running(items):
            return len(items) == 2 and all(p.status.phase == "Running" for p in items.values())
        pods = wait_for(core_a.list_namespaced_pod, running, timeout=60,
                        namespace="default", label_selector="app=spread")
        assert sorted(p.spec.node_name for p in pods.values()) == ["node-a", "node-b"]
        # Each server reaches each node for logs, whichever server the node talks to.
        for data_dir in (first_dir, second_dir):
            for name in pods:
                result = subprocess.run(
                    [shutil.which("kubectl") or "kubectl", "--kubeconfig",
                     str(data_dir / "admin.kubeconfig"), "logs", name],
                    capture_output=True, text=True, timeout=30)
                assert result.returncode == 0 and result.stdout == "spread\n", result.stderr

        client.AppsV1Api(admin_a).delete_namespaced_deployment("spread", "default")
        wait_for(core_b.list_namespaced_pod, lambda items: not items, timeout=60,
                 namespace="default", label_selector="app=spread")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        admin_a.close()
        admin_b.close()
        log.close()
        print((first_dir / "flow.log").read_text(errors="replace")[-3000:])
