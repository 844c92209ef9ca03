"""Services in `trellis up`, as a user meets them: `kubectl expose deployment web --port
80 --target-port 8080` gives the Deployment a ClusterIP from the Service range
(10.43.0.0/16) and `kubectl get svc,endpointslices` shows the Service and its slice;
the official Python client makes a NodePort Service, and a nodePort already taken is
refused with Kubernetes' "provided port is already allocated"; a pod reaches the
Deployment by `http://web`, through the node's DNS server and service proxy.

The pods are `process` pods running python3 on the local node's pod network. Needs
root, `nft` and python3 (the node runs the proxy and DNS only then); skipped otherwise.
"""

import ipaddress
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from conftest import kubectl_up as kubectl, trellis_up
from test_controller_plugins import wait_for

SERVICE_RANGE = ipaddress.ip_network("10.43.0.0/16")
# A server that answers every GET with the pod's name.
WEB = ("import http.server, os\n"
       "class H(http.server.BaseHTTPRequestHandler):\n"
       "    def do_GET(self):\n"
       "        body = os.environ['POD_NAME'].encode()\n"
       "        self.send_response(200)\n"
       "        self.send_header('Content-Length', str(len(body)))\n"
       "        self.end_headers()\n"
       "        self.wfile.write(body)\n"
       "http.server.ThreadingHTTPServer(('', 8080), H).serve_forever()\n")
# Asks http://web until it answers (the Service may take a moment to be served).
CLIENT = ("import time, urllib.request\n"
          "opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
          "for _ in range(100):\n"
          "    try:\n"
          "        print(opener.open('http://web', timeout=2).read().decode(), flush=True)\n"
          "        break\n"
          "    except Exception as e:\n"
          "        print('retry:', e, flush=True)\n"
          "        time.sleep(0.1)\n")
# What the node makes on this machine besides what conftest removes: the proxy's table
@pytest.fixture(scope="module")
def up():
    missing = [what for what, found in [("root", os.geteuid() == 0), ("nft", shutil.which("nft")),
                                        ("python3", Path("/usr/bin/python3").exists())] if not found]
    if missing:
        pytest.skip(f"Services need {', '.join(missing)} on the node")
    with trellis_up("trellis-svc-", "--relist-period", "0.1", "--proxy-min-sync-period", "0") as running:
        yield running


def process_pod_spec(name_env, code, **spec):
    return {"runtimeClassName": "process", "terminationGracePeriodSeconds": 1, **spec,
            # The image is the program run: a shell that runs python3 with the code.
            "containers": [{"name": "main", "image": "file:///bin/sh",
                            "command": ["/bin/sh", "-c", 'exec /usr/bin/python3 -c "$CODE"'],
                            "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": name_env}}},
                                    {"name": "CODE", "value": code}]}]}


def test_expose_a_deployment_and_reach_it_by_name(up):
    api, data_dir = up
    v1 = client.CoreV1Api(api)
    spec = process_pod_spec("metadata.name", WEB)
    spec["containers"][0]["ports"] = [{"containerPort": 8080}]
    spec["containers"][0]["readinessProbe"] = {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}}, "spec": spec}},
    }
    kubectl(data_dir, "apply", "-f", "-", stdin=yaml.safe_dump(deployment))

    # kubectl expose: a ClusterIP from the Service range, port 80 to the pods' 8080.
    kubectl(data_dir, "expose", "deployment", "web", "--port", "80", "--target-port", "8080")
    service = v1.read_namespaced_service("web", "default")
    assert ipaddress.ip_address(service.spec.cluster_ip) in SERVICE_RANGE, service.spec
    assert service.spec.cluster_ips == [service.spec.cluster_ip]
    assert service.spec.type == "ClusterIP"
    assert [(p.port, p.target_port, p.protocol) for p in service.spec.ports] == [(80, 8080, "TCP")]

    # Its EndpointSlice lists both pods once they are ready, and kubectl shows both.
    def two_ready(items):
        return any(s.metadata.labels.get("kubernetes.io/service-name") == "web"
                   and sum(bool(e.conditions.ready) for e in s.endpoints or []) == 2
                   for s in items.values())
    slices = wait_for(client.DiscoveryV1Api(api).list_namespaced_endpoint_slice, two_ready,
                      timeout=60, namespace="default")
    (slice_name,) = [n for n, s in slices.items() if s.metadata.labels.get("kubernetes.io/service-name") == "web"]
    shown = kubectl(data_dir, "get", "svc,endpointslices")
    lines = {line.split()[0]: line for line in shown.splitlines()[1:] if line.strip()}
    assert "service/web" in lines and service.spec.cluster_ip in lines["service/web"], shown
    assert "80/TCP" in lines["service/web"], shown
    assert f"endpointslice.discovery.k8s.io/{slice_name}" in lines, shown
    assert "8080" in lines[f"endpointslice.discovery.k8s.io/{slice_name}"], shown

    # A pod reaches the Deployment by name: `web` through its resolv.conf's search list
    # and the node's DNS server, then the ClusterIP through the proxy.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "client"},
           "spec": process_pod_spec("metadata.name", CLIENT, restartPolicy="Never")}
    kubectl(data_dir, "apply", "-f", "-", stdin=yaml.safe_dump(pod))
    done = wait_for(v1.list_namespaced_pod, lambda items: "client" in items and items["client"].status.phase
                    in ("Succeeded", "Failed"), timeout=30, namespace="default")
    log = kubectl(data_dir, "logs", "client")
    assert done["client"].status.phase == "Succeeded", log
    assert log.splitlines()[-1].startswith("web-"), log
    kubectl(data_dir, "delete", "pod", "client", "--wait=false")

    # The node's proxy knows the service range `trellis up` allocates from: a new
    # connection to an address in it that no Service holds is dropped there (the
    # proxy's own test sends such traffic, in a namespace of its own).
    check = subprocess.run(["nft", "list", "chain", "ip", "trellis-proxy", "cluster-ips-check"],
                           capture_output=True, text=True)
    assert "10.43.0.0/16" in check.stdout, check


def test_a_nodeport_service_and_a_taken_nodeport(up):
    api, _ = up
    v1 = client.CoreV1Api(api)

    def nodeport_service(name, node_port=None):
        return client.V1Service(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1ServiceSpec(type="NodePort", selector={"app": "web"}, ports=[
                client.V1ServicePort(port=80, target_port=8080, node_port=node_port)]))

    first = v1.create_namespaced_service("default", nodeport_service("web-nodeport"))
    (port,) = first.spec.ports
    assert 30000 <= port.node_port <= 32767, port
    assert ipaddress.ip_address(first.spec.cluster_ip) in SERVICE_RANGE
    assert first.spec.external_traffic_policy == "Cluster"

    with pytest.raises(client.ApiException) as refused:
        v1.create_namespaced_service("default", nodeport_service("web-nodeport-2", port.node_port))
    assert refused.value.status == 422, refused.value.body
    assert "provided port is already allocated" in refused.value.body, refused.value.body
    assert str(port.node_port) in refused.value.body

    # Freed with its Service, the port can be asked for again.
    deleted = v1.delete_namespaced_service("web-nodeport", "default", _preload_content=False)
    second = v1.create_namespaced_service("default", nodeport_service("web-nodeport-2", port.node_port))
    assert second.spec.ports[0].node_port == port.node_port
    v1.delete_namespaced_service("web-nodeport-2", "default", _preload_content=False)
    # kube-apiserver answers a Service's delete with the Service (its storage's
    # ReturnDeletedObject), which the client reads as a V1Service.
    body = json.loads(deleted.data)
    assert body.get("kind") == "Service", f"DELETE of a Service answered {body}"
