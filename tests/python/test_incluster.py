"""In-cluster configuration in `trellis up`, as a pod meets it: the official client's
`config.load_incluster_config()` inside a `process` pod on the local node's pod network
reads `KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT` (the `kubernetes` Service,
10.43.0.1:443) and the token, CA and namespace mounted at
`/var/run/secrets/kubernetes.io/serviceaccount`, and lists the pods of its namespace
through the Service (the node's service proxy sends it to the API server's advertise
address, which `trellis up` also serves). The API server's certificate is valid for
10.43.0.1, or the client would refuse it.

The pod runs this test's own Python (it has the client) as root. Needs root, `nft` and
CNI's bridge plugin (the node runs the proxy and gives pods a network then); skipped
otherwise.
"""

import os
import shutil
import sys
from pathlib import Path

import pytest
import kubernetes
from kubernetes import client, config

from conftest import kubectl_up as kubectl, trellis_up
from test_controller_plugins import wait_for

NAMESPACE = "incluster"
SITE_PACKAGES = str(Path(kubernetes.__file__).parent.parent)
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# Lists the pods of its own namespace through the in-cluster configuration; the
# Service may take a moment to be served after the node starts.
LISTER = ("import os, time\n"
          "from kubernetes import client, config\n"
          "config.load_incluster_config()\n"
          "print('host', os.environ['KUBERNETES_SERVICE_HOST'], os.environ['KUBERNETES_SERVICE_PORT'], flush=True)\n"
          f"namespace = open('{TOKEN_DIR}/namespace').read()\n"
          "for attempt in range(50):\n"
          "    try:\n"
          "        pods = client.CoreV1Api().list_namespaced_pod(namespace, _request_timeout=2)\n"
          "        print('pods', ' '.join(p.metadata.name for p in pods.items), flush=True)\n"
          "        break\n"
          "    except Exception as e:\n"
          "        print('retry:', e, flush=True)\n"
          "        time.sleep(0.2)\n"
          "else:\n"
          "    raise SystemExit(1)\n")


@pytest.fixture(scope="module")
def up():
    missing = [what for what, found in [("root", os.geteuid() == 0), ("nft", shutil.which("nft")),
                                        ("CNI's bridge plugin", Path("/usr/lib/cni/bridge").exists())]
               if not found]
    if missing:
        pytest.skip(f"a pod reaching the API through its Service needs {', '.join(missing)}")
    with trellis_up("trellis-incluster-", "--relist-period", "0.1") as running:
        yield running


def test_a_pod_lists_pods_with_the_in_cluster_configuration(up):
    api, data_dir = up
    v1 = client.CoreV1Api(api)
    kubernetes = v1.read_namespaced_service("kubernetes", "default")
    assert kubernetes.spec.cluster_ip == "10.43.0.1"
    assert [(p.name, p.port) for p in kubernetes.spec.ports] == [("https", 443)]

    # Privileged: the pod mounts the client from the node (a hostPath volume).
    v1.create_namespace({"metadata": {"name": NAMESPACE,
                                      "labels": {"pod-security.kubernetes.io/enforce": "privileged"}}})
    # The account and the CA the token volume holds come from the controllers.
    wait_for(v1.list_namespaced_service_account, lambda items: "default" in items, namespace=NAMESPACE)
    wait_for(v1.list_namespaced_config_map, lambda items: "kube-root-ca.crt" in items, namespace=NAMESPACE)
    client.RbacAuthorizationV1Api(api).create_namespaced_role_binding(NAMESPACE, {
        "metadata": {"name": "default-view"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": NAMESPACE}],
    })
    pod = v1.create_namespaced_pod(NAMESPACE, {
        "metadata": {"name": "lister"},
        "spec": {"runtimeClassName": "process", "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                 # The test's Python, with the client, may be under root's home.
                 "securityContext": {"runAsUser": 0},
                 # A process pod's image is the program it runs.
                 "containers": [{"name": "main", "image": f"file://{os.path.realpath(sys.executable)}",
                                 "args": ["-c", LISTER],
                                 # A pod's environment is its own: where the client is.
                                 "env": [{"name": "PYTHONPATH", "value": SITE_PACKAGES}],
                                 "volumeMounts": [{"name": "client", "mountPath": SITE_PACKAGES, "readOnly": True}]}],
                 # The sandbox shows the node's system directories only.
                 "volumes": [{"name": "client", "hostPath": {"path": SITE_PACKAGES}}]},
    })
    # Mounted by the ServiceAccount admission, as Kubernetes does.
    (volume,) = [v for v in pod.spec.volumes if v.name.startswith("kube-api-access-")]
    assert volume.projected.sources[0].service_account_token.path == "token"
    assert [(m.name, m.mount_path, m.read_only) for m in pod.spec.containers[0].volume_mounts] == \
        [("client", SITE_PACKAGES, True), (volume.name, TOKEN_DIR, True)]

    done = wait_for(v1.list_namespaced_pod, lambda items: items["lister"].status.phase in ("Succeeded", "Failed"),
                    timeout=60, namespace=NAMESPACE)
    logs = kubectl(data_dir, "logs", "-n", NAMESPACE, "lister")
    assert done["lister"].status.phase == "Succeeded", logs
    assert "host 10.43.0.1 443\n" in logs, logs
    assert "pods lister\n" in logs, logs
