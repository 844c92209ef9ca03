"""StatefulSets in `trellis up`, through the official Python client's AppsV1Api and
kubectl: "should provide basic identity", as Kubernetes' conformance test has it.
The pods are made in order with stable names and hostnames, each reached by its own
DNS name through the headless Service (`web-0.nginx.default.svc.cluster.local`),
each with a claim of the default class from the set's `volumeClaimTemplates`; a pod
deleted comes back with its name and the same claim, whose data it finds again.

The pods are `process` pods running python3 on the local node's pod network. Needs
root, `nft` and python3 (the node runs the proxy and DNS only then); skipped otherwise.
"""

import os
import shutil
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from conftest import kubectl_up as kubectl, trellis_up
from test_controller_plugins import wait_for

NS = "default"
# Where the pods mount their claim: a directory every Debian machine has.
MOUNT_AT = "/mnt"
# Counts its starts in its claim; answers every GET with `<hostname> <starts>`.
WEB = ("import http.server, os, socket\n"
       f"path = '{MOUNT_AT}/starts'\n"
       "with open(path, 'a') as f:\n"
       "    f.write('start\\n')\n"
       "starts = len(open(path).read().splitlines())\n"
       "class H(http.server.BaseHTTPRequestHandler):\n"
       "    def do_GET(self):\n"
       "        body = f'{socket.gethostname()} {starts}'.encode()\n"
       "        self.send_response(200)\n"
       "        self.send_header('Content-Length', str(len(body)))\n"
       "        self.end_headers()\n"
       "        self.wfile.write(body)\n"
       "http.server.ThreadingHTTPServer(('', 8080), H).serve_forever()\n")
# Asks each pod by its own DNS name until it answers; prints the answers. It runs in a
# pod, where nothing tells it when the node's DNS server has the new record: a bounded
# retry of the real request, as Kubernetes' e2e dig loops.
CLIENT = ("import sys, time, urllib.request\n"
          "opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
          "for name in sys.argv[1:]:\n"
          "    for _ in range(100):\n"
          "        try:\n"
          "            print(opener.open(f'http://{name}:8080', timeout=2).read().decode(), flush=True)\n"
          "            break\n"
          "        except Exception as e:\n"
          "            print('retry:', e, file=sys.stderr, flush=True)\n"
          "            time.sleep(0.1)\n")


@pytest.fixture(scope="module")
def up():
    missing = [what for what, found in [("root", os.geteuid() == 0), ("nft", shutil.which("nft")),
                                        ("python3", Path("/usr/bin/python3").exists())] if not found]
    if missing:
        pytest.skip(f"StatefulSets' pods need {', '.join(missing)} on the node")
    with trellis_up("trellis-sts-", "--relist-period", "0.1", "--proxy-min-sync-period", "0") as running:
        yield running


def python_container(code, *args, **extra):
    return {"name": "main", "image": "file:///bin/sh",
            "command": ["/bin/sh", "-c", 'exec /usr/bin/python3 -c "$CODE" "$@"', "sh", *args],
            "env": [{"name": "CODE", "value": code}], **extra}


def ask(data_dir, v1, name, *targets):
    """Runs a client pod that asks each target by name; its output lines."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"runtimeClassName": "process", "terminationGracePeriodSeconds": 1,
                    "restartPolicy": "Never", "containers": [python_container(CLIENT, *targets)]}}
    kubectl(data_dir, "apply", "-f", "-", stdin=yaml.safe_dump(pod))
    done = wait_for(v1.list_namespaced_pod, lambda items: name in items and items[name].status.phase
                    in ("Succeeded", "Failed"), timeout=60, namespace=NS)
    log = kubectl(data_dir, "logs", name)
    assert done[name].status.phase == "Succeeded", log
    kubectl(data_dir, "delete", "pod", name, "--wait=false")
    return log.splitlines()


def test_should_provide_basic_identity(up):
    api, data_dir = up
    v1, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    v1.create_namespaced_service(NS, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "nginx"},
        "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8080}]}})
    container = python_container(WEB, ports=[{"containerPort": 8080}],
                                 readinessProbe={"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1},
                                 volumeMounts=[{"name": "www", "mountPath": MOUNT_AT}])
    apps.create_namespaced_stateful_set(NS, {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "web"},
        "spec": {"replicas": 2, "serviceName": "nginx", "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"runtimeClassName": "process", "terminationGracePeriodSeconds": 1,
                                       "containers": [container]}},
                 "volumeClaimTemplates": [{"metadata": {"name": "www"}, "spec": {
                     "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Mi"}}}}]}})

    try:
        sets = wait_for(apps.list_namespaced_stateful_set,
                        lambda items: "web" in items and items["web"].status is not None
                        and (items["web"].status.ready_replicas or 0) == 2,
                        timeout=90, namespace=NS)
    except AssertionError:
        print(kubectl(data_dir, "describe", "sts,pods,pvc,pv"))
        raise
    status = sets["web"].status
    assert status.current_revision == status.update_revision and status.updated_replicas == 2, status
    pods = {p.metadata.name: p for p in v1.list_namespaced_pod(NS, label_selector="app=web").items}
    assert sorted(pods) == ["web-0", "web-1"], sorted(pods)
    # In order: web-1 was made once web-0 was ready.
    ready_at = next(c.last_transition_time for c in pods["web-0"].status.conditions if c.type == "Ready")
    assert pods["web-1"].metadata.creation_timestamp >= ready_at
    for name, pod in pods.items():
        assert pod.spec.hostname == name and pod.spec.subdomain == "nginx"
        assert pod.metadata.labels["statefulset.kubernetes.io/pod-name"] == name
        assert pod.metadata.labels["apps.kubernetes.io/pod-index"] == name[-1]
        assert pod.metadata.labels["controller-revision-hash"] == status.update_revision
        (claim,) = [v.persistent_volume_claim.claim_name for v in pod.spec.volumes if v.persistent_volume_claim]
        assert claim == f"www-{name}"
    claims = {c.metadata.name: c for c in v1.list_namespaced_persistent_volume_claim(NS).items}
    assert {"www-web-0", "www-web-1"} <= set(claims), sorted(claims)
    assert all(claims[f"www-{n}"].status.phase == "Bound" for n in pods), claims

    # Each pod by its own name through the headless Service, with its own hostname.
    lines = ask(data_dir, v1, "ask-1", "web-0.nginx.default.svc.cluster.local", "web-1.nginx")
    assert lines == ["web-0 1", "web-1 1"], lines

    # web-0 deleted comes back as web-0 with the same claim, and finds its data.
    claim_uid = claims["www-web-0"].metadata.uid
    old_uid = pods["web-0"].metadata.uid
    v1.delete_namespaced_pod("web-0", NS)
    wait_for(v1.list_namespaced_pod,
             lambda items: "web-0" in items and items["web-0"].metadata.uid != old_uid
             and any(c.type == "Ready" and c.status == "True" for c in items["web-0"].status.conditions or []),
             timeout=60, namespace=NS, label_selector="app=web")
    assert v1.read_namespaced_persistent_volume_claim("www-web-0", NS).metadata.uid == claim_uid
    lines = ask(data_dir, v1, "ask-2", "web-0.nginx")
    assert lines == ["web-0 2"], lines

    # kubectl's view: the set's columns, and its revision history.
    shown = kubectl(data_dir, "get", "sts", "web")
    assert shown.split("\n")[1].split()[:2] == ["web", "2/2"], shown
    history = kubectl(data_dir, "rollout", "history", "sts/web")
    assert any(line.split()[:1] == ["1"] for line in history.splitlines()), history
