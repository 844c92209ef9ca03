"""Joining nodes as kubeadm does: a `trellis server`, a bootstrap token from
`trellis token create`, and three `trellis node` processes started with the join command
it prints (`--server`, `--token`, `--discovery-token-ca-cert-hash`), each with a data
directory of its own and its own ports, on loopback:

- all three nodes become Ready, under the names their certificates carry;
- `kubectl get csr` shows their requests, made by the token's user, approved and issued;
- each node kept its credentials in `DATA_DIR/node.kubeconfig`, readable by its owner
  alone;
- a node given another CA's hash refuses to join, and says why;
- a pod bound to a joined node runs there;
- a node renews its certificate, as itself, before it expires, and once the first has
  expired still runs a pod, over connections that present the new one;
- with two API servers on etcd, a token made through one joins a node through the
  other.

Nodes run with `--pod-network=false`: a bare `trellis server` runs no node IPAM
controller, so no Node gets a pod CIDR for pods on a network of their own to wait for."""

import base64
import calendar
import re
import shlex
import stat
import subprocess
import time

import pytest
import yaml
from kubernetes import client, config

from conftest import SHARED_NETNS, own_server, trellis_binary
from test_components import two_servers_on_etcd  # noqa: F401 (a fixture)
from test_controller_plugins import wait_for

NODES = ["join-a", "join-b", "join-c"]


def kubectl(data_dir, *args, check=True):
    result = subprocess.run(["kubectl", "--kubeconfig", str(data_dir / "admin.kubeconfig"), *args],
                            capture_output=True, text=True, timeout=30)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def not_after(certificate):
    """When a CSR's issued certificate (base64 PEM, as the client returns it) expires,
    in Unix seconds."""
    pem = base64.b64decode(certificate)
    out = subprocess.run(["openssl", "x509", "-noout", "-enddate"], input=pem, capture_output=True,
                         check=True, timeout=10).stdout.decode()
    stamp = out.strip().removeprefix("notAfter=")
    return calendar.timegm(time.strptime(stamp, "%b %d %H:%M:%S %Y %Z"))


def join_command(data_dir):
    """The join command `trellis token create` prints, as a list of arguments."""
    result = subprocess.run(
        [str(trellis_binary()), "token", "--kubeconfig", str(data_dir / "admin.kubeconfig"), "create",
         "--ttl", "1h"], capture_output=True, text=True, timeout=30, check=True)
    line = result.stdout.strip()
    assert re.fullmatch(
        r"trellis node --server https://127\.0\.0\.1:\d+ --token [a-z0-9]{6}\.[a-z0-9]{16} "
        r"--discovery-token-ca-cert-hash sha256:[0-9a-f]{64} --data-dir \S+", line), line
    args = shlex.split(line)[2:]
    # Each node gets a data directory of its own below.
    return args[:args.index("--data-dir")]


@pytest.fixture(scope="module")
def cluster():
    with own_server("trellis-join-") as (api, data_dir):
        join = join_command(data_dir)
        procs, logs = [], []
        for name in NODES:
            log = open(data_dir / f"{name}.log", "wb")
            logs.append(log)
            procs.append(subprocess.Popen(
                [str(trellis_binary()), "node", "--pod-network=false", *SHARED_NETNS, *join, "--data-dir", str(data_dir / name),
                 "--node-name", name, "--node-port", "0", "--process-handler", "true"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        try:
            yield api, data_dir, join
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            for log, name in zip(logs, NODES):
                log.close()
                print(name, (data_dir / f"{name}.log").read_text(errors="replace")[-2000:])


def run_sleeper(api, data_dir, name, node):
    """Applies a pod bound to `node` that sleeps, with kubectl; returns the pods once it
    is Running."""
    manifest = f"""
apiVersion: v1
kind: Pod
metadata: {{name: {name}}}
spec:
  nodeName: {node}
  runtimeClassName: process
  terminationGracePeriodSeconds: 1
  containers:
  - name: main
    image: file:///bin/sleep
    args: ["300"]
"""
    subprocess.run(["kubectl", "--kubeconfig", str(data_dir / "admin.kubeconfig"), "apply", "-f", "-"],
                   input=manifest, text=True, check=True, capture_output=True)
    return wait_for(client.CoreV1Api(api).list_namespaced_pod,
                    lambda items: name in items and items[name].status.phase == "Running",
                    timeout=30, namespace="default")


def ready_nodes(api):
    def ready(items):
        def is_ready(node):
            conditions = {c.type: c.status for c in (node.status.conditions or [])} if node.status else {}
            return conditions.get("Ready") == "True"
        return all(name in items and is_ready(items[name]) for name in NODES)
    return wait_for(client.CoreV1Api(api).list_node, ready, timeout=30)


def test_joined_nodes_become_ready(cluster):
    api, _, _ = cluster
    nodes = ready_nodes(api)
    for name in NODES:
        assert nodes[name].metadata.labels["kubernetes.io/hostname"] == name


def test_kubectl_get_csr_shows_the_approved_requests(cluster):
    api, data_dir, join = cluster
    ready_nodes(api)
    token_id = join[join.index("--token") + 1].split(".")[0]
    rows = kubectl(data_dir, "get", "csr", "--no-headers").stdout.splitlines()
    node_rows = [r for r in rows if r.startswith("node-csr-")]
    assert len(node_rows) == len(NODES), rows
    for row in node_rows:
        assert "kubernetes.io/kube-apiserver-client-kubelet" in row, row
        assert f"system:bootstrap:{token_id}" in row, row
        assert row.split()[-1] == "Approved,Issued", row


def test_each_node_keeps_its_credentials_private(cluster):
    api, data_dir, _ = cluster
    ready_nodes(api)
    for name in NODES:
        kubeconfig = data_dir / name / "node.kubeconfig"
        assert stat.S_IMODE(kubeconfig.stat().st_mode) == 0o600
        assert f"system:node:{name}" in kubeconfig.read_text()


def test_a_node_refuses_a_server_without_the_pinned_ca(cluster):
    _, data_dir, join = cluster
    wrong = list(join)
    wrong[wrong.index("--discovery-token-ca-cert-hash") + 1] = "sha256:" + "0" * 64
    result = subprocess.run(
        [str(trellis_binary()), "node", "--pod-network=false", *SHARED_NETNS, *wrong, "--data-dir", str(data_dir / "impostor"),
         "--node-name", "impostor", "--node-port", "0"],
        capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert "matches --discovery-token-ca-cert-hash" in result.stderr, result.stderr
    assert not (data_dir / "impostor" / "node.kubeconfig").exists()


def test_a_pod_runs_on_a_joined_node(cluster):
    api, data_dir, _ = cluster
    ready_nodes(api)
    pods = run_sleeper(api, data_dir, "joined-sleeper", "join-b")
    assert pods["joined-sleeper"].spec.node_name == "join-b"


def test_a_node_rotates_its_certificate_before_it_expires():
    """With the signer's certificates cut to 6 s, the node asks for a new one at
    70–90 % of its lifetime, authenticated as itself, and stays Ready on it. Once its
    first certificate has expired it still runs a pod and reports it: the server
    refuses an expired certificate on a connection that outlived it, so the node must
    have moved its connections to the new one."""
    with own_server("trellis-rotate-", "--csr-signing-duration", "6", "--csr-min-duration", "5") as (api, data_dir):
        join = join_command(data_dir)
        node_dir = data_dir / "rotor"
        with open(data_dir / "rotor.log", "wb") as log:
            proc = subprocess.Popen(
                [str(trellis_binary()), "node", "--pod-network=false", *SHARED_NETNS, *join, "--data-dir", str(node_dir), "--node-name", "rotor",
                 "--node-port", "0", "--process-handler", "true"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            certificates = client.CertificatesV1Api(api)
            renewed = wait_for(
                certificates.list_certificate_signing_request,
                lambda items: any(c.spec.username == "system:node:rotor" and c.status
                                  and c.status.certificate for c in items.values()),
                timeout=30)
            renewal = next(c for c in renewed.values() if c.spec.username == "system:node:rotor")
            assert any(c.type == "Approved" and c.reason == "AutoApproved" for c in renewal.status.conditions)
            nodes = wait_for(client.CoreV1Api(api).list_node, lambda items: "rotor" in items, timeout=10)
            conditions = {c.type: c.status for c in nodes["rotor"].status.conditions}
            assert conditions.get("Ready") == "True", conditions
            first = min((c for c in renewed.values() if c.spec.username.startswith("system:bootstrap:")),
                        key=lambda c: c.metadata.creation_timestamp)
            # Waiting for a certificate to expire is waiting on the clock itself.
            time.sleep(max(0.0, not_after(first.status.certificate) + 1 - time.time()))
            run_sleeper(api, data_dir, "rotor-sleeper", "rotor")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            print((data_dir / "rotor.log").read_text(errors="replace")[-2000:])


def test_nodes_join_through_either_of_two_api_servers_on_etcd(two_servers_on_etcd):
    """A token made through one server joins a node through the other; both servers
    run the approver and signer, and each request is signed once."""
    first, second = two_servers_on_etcd
    join = join_command(first)
    second_url = yaml.safe_load((second / "admin.kubeconfig").read_text())["clusters"][0]["cluster"]["server"]
    procs = []
    try:
        for name, server_dir in [("etcd-a", first), ("etcd-b", second)]:
            args = list(join)
            if server_dir == second:
                args[args.index("--server") + 1] = second_url
            log = open(first / f"{name}.log", "wb")
            procs.append((subprocess.Popen(
                [str(trellis_binary()), "node", "--pod-network=false", *SHARED_NETNS, *args, "--data-dir", str(first / name), "--node-name", name,
                 "--node-port", "0"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL), log))
        api = config.new_client_from_config(config_file=str(second / "admin.kubeconfig"))
        try:
            def ready(items):
                def is_ready(node):
                    conditions = node.status.conditions if node.status else None
                    return any(c.type == "Ready" and c.status == "True" for c in conditions or [])
                return all(n in items and is_ready(items[n]) for n in ("etcd-a", "etcd-b"))
            wait_for(client.CoreV1Api(api).list_node, ready, timeout=30)
            csrs = client.CertificatesV1Api(api).list_certificate_signing_request().items
            issued = [c for c in csrs if c.status and c.status.certificate]
            assert len(issued) == 2, [c.metadata.name for c in csrs]
        finally:
            api.close()
    finally:
        for proc, log in procs:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
