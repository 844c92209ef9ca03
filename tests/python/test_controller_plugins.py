"""Controllers declared as Plugin objects of kind `controller`, run by a separate
`trellis controllers` process against a `trellis server` (one pair for the module):
the server grants the plugin the RBAC rules its spec declares (a ClusterRole owned by
the Plugin), the controller manager loads it under its own ServiceAccount and reports
`Loaded`; a new generation is loaded in place, a version that fails to load leaves
the last good one running, and deleting the Plugin removes its role through the
garbage collector. The greeting example is installed as its README says, with
kubectl.

The components are `plugins/fixtures/children` (for a ConfigMap annotated
`trellis.dev/children: N` it keeps N owned child ConfigMaps) and
`examples/controllers/greeting`, built by `plugins/build.sh`."""

import os
import re
import subprocess
import threading
import time

import pytest
from kubernetes import client, watch

from conftest import REPO_ROOT, own_server, trellis_binary

DIST = REPO_ROOT / "plugins" / "target" / "dist"
MODULE = DIST / "children.wasm"
GREETING = REPO_ROOT / "examples" / "controllers" / "greeting"


@pytest.fixture(scope="module")
def controlled():
    """A `trellis server` and a `trellis controllers` against it; yields the admin
    client and the data directory."""
    with own_server("trellis-ctlplugin-") as (api, data_dir):
        controllers = subprocess.Popen(
            [str(trellis_binary()), "controllers",
             "--kubeconfig", str(data_dir / "controller-manager.kubeconfig"),
             "--metrics-bind-address", "", "--plugin-status-interval", "0.2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        log: list[str] = []
        threading.Thread(
            target=lambda: [log.append(re.sub(r"\x1b\[[0-9;]*m", "", line))
                            for line in controllers.stderr],
            daemon=True).start()
        try:
            yield api, data_dir
        finally:
            controllers.terminate()
            try:
                controllers.wait(timeout=10)
            except subprocess.TimeoutExpired:
                controllers.kill()
            print("".join(log[-30:]))


def wait_for(list_fn, accept, timeout=20, **kwargs):
    """Lists, then watches, until `accept(items)` holds for the items listed and
    changed since; returns them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = list_fn(**kwargs)
        # Custom objects come as dicts, built-in ones as models.
        if isinstance(listed, dict):
            items = {i["metadata"]["name"]: i for i in listed["items"]}
            rv = listed["metadata"]["resourceVersion"]
        else:
            items = {i.metadata.name: i for i in listed.items}
            rv = listed.metadata.resource_version
        if accept(items):
            return items
        for event in watch.Watch().stream(
                list_fn, resource_version=rv,
                timeout_seconds=max(1, int(deadline - time.monotonic())), **kwargs):
            obj = event["object"]
            name = obj["metadata"]["name"] if isinstance(obj, dict) else obj.metadata.name
            if event["type"] == "DELETED":
                items.pop(name, None)
            else:
                items[name] = obj
            if accept(items):
                return items
    raise AssertionError(f"condition not met within {timeout} s")


def plugin_spec(url, configuration=None):
    return {
        "kind": "controller",
        "module": {"url": url},
        "configuration": configuration or {},
        "controller": {
            "for": {"version": "v1", "resource": "configmaps"},
            "owns": [{"version": "v1", "resource": "configmaps"}],
            "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                       "verbs": ["create", "update", "patch", "delete"]}],
        },
    }


def loaded(generation, status):
    """Whether a Plugin's Loaded condition for `generation` has `status`."""
    def accept(items):
        plugin = items.get("children")
        if not plugin:
            return False
        for c in (plugin.get("status") or {}).get("conditions") or []:
            if (c["type"] == "Loaded" and c["status"] == status
                    and c.get("observedGeneration") == generation):
                return True
        return False
    return accept


def test_a_controller_plugin_is_granted_its_rules_loaded_reloaded_and_removed(controlled):
    assert MODULE.is_file(), f"{MODULE}: run plugins/build.sh"
    api, _ = controlled
    custom = client.CustomObjectsApi(api)
    core = client.CoreV1Api(api)
    rbac = client.RbacAuthorizationV1Api(api)
    plugins = dict(group="trellis.dev", version="v1", plural="plugins")
    list_plugins = lambda **kw: custom.list_cluster_custom_object(**plugins, **kw)  # noqa: E731

    custom.create_cluster_custom_object(**plugins, body={
        "apiVersion": "trellis.dev/v1", "kind": "Plugin",
        "metadata": {"name": "children"},
        "spec": plugin_spec(f"file://{MODULE}")})
    wait_for(list_plugins, loaded(1, "True"))
    role = rbac.read_cluster_role("trellis:controller:children")
    assert role.metadata.owner_references[0].kind == "Plugin"
    assert any("configmaps" in (r.resources or []) for r in role.rules), role.rules

    def children(n, label="trellis.dev/parent"):
        def accept(items):
            kids = [m for name, m in items.items() if name.startswith("web-")]
            return len(kids) == n and all(
                (m.metadata.labels or {}).get(label) == "web"
                for name, m in items.items() if name == f"web-{n - 1}")
        return accept

    core.create_namespaced_config_map("default", {
        "metadata": {"name": "web", "annotations": {"trellis.dev/children": "2"}}})
    wait_for(core.list_namespaced_config_map, children(2), namespace="default")

    # A new generation (another label for the children) is loaded in place.
    custom.patch_cluster_custom_object(
        **plugins, name="children",
        body={"spec": {"configuration": {"label": "trellis.dev/owner"}}})
    wait_for(list_plugins, loaded(2, "True"))
    core.patch_namespaced_config_map(
        "web", "default", {"metadata": {"annotations": {"trellis.dev/children": "3"}}})
    wait_for(core.list_namespaced_config_map, children(3, "trellis.dev/owner"),
             namespace="default")

    # A version that cannot load: Loaded False, and the last good one runs on.
    custom.patch_cluster_custom_object(
        **plugins, name="children",
        body={"spec": {"module": {"url": "file:///nonexistent/children.wasm"}}})
    items = wait_for(list_plugins, loaded(3, "False"))
    condition = [c for c in items["children"]["status"]["conditions"]
                 if c["type"] == "Loaded"][0]
    assert "keeps running" in condition["message"], condition
    core.patch_namespaced_config_map(
        "web", "default", {"metadata": {"annotations": {"trellis.dev/children": "4"}}})
    wait_for(core.list_namespaced_config_map, children(4, "trellis.dev/owner"),
             namespace="default")

    # Deleted: the garbage collector removes the role it was granted.
    custom.delete_cluster_custom_object(**plugins, name="children")
    wait_for(rbac.list_cluster_role,
             lambda items: "trellis:controller:children" not in items)


def test_the_greeting_example_works_as_its_readme_says(controlled):
    module = DIST / "greeting.wasm"
    assert module.is_file(), f"{module}: run plugins/build.sh"
    _, data_dir = controlled
    env = {**os.environ, "KUBECONFIG": str(data_dir / "admin.kubeconfig")}

    def kubectl(*args, stdin=None):
        done = subprocess.run(["kubectl", *args], input=stdin, env=env, text=True,
                              capture_output=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout

    kubectl("apply", "-f", str(GREETING / "crd.yaml"))
    plugin = (GREETING / "plugin.yaml").read_text().replace("MODULE", f"file://{module}")
    kubectl("apply", "-f", "-", stdin=plugin)
    kubectl("wait", "plugin/greeting", "--for=condition=Loaded", "--timeout=20s")
    kubectl("apply", "-f", str(GREETING / "greeting.yaml"))
    kubectl("wait", "greeting/hello", "--for=jsonpath={.status.message}=Hello, world!",
            "--timeout=20s")
    assert kubectl("get", "configmap", "hello-message",
                   "-o", "jsonpath={.data.message}") == "Hello, world!"
    assert "Greeted" in kubectl("get", "events", "--field-selector",
                                "involvedObject.name=hello")
    # Deleting the Greeting takes its ConfigMap with it.
    kubectl("delete", "greeting", "hello")
    kubectl("wait", "configmap/hello-message", "--for=delete", "--timeout=20s")


def test_the_python_configmap_checksum_example_works_as_its_readme_says(controlled):
    module = DIST / "configmap-checksum.wasm"
    assert module.is_file(), f"{module}: run plugins/build.sh"
    api, data_dir = controlled
    env = {**os.environ, "KUBECONFIG": str(data_dir / "admin.kubeconfig")}
    example = REPO_ROOT / "examples" / "controllers" / "configmap-checksum"
    plugin = (example / "plugin.yaml").read_text().replace("MODULE", f"file://{module}")
    done = subprocess.run(["kubectl", "apply", "-f", "-"], input=plugin, env=env,
                          text=True, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    core = client.CoreV1Api(api)
    core.create_namespaced_config_map("default", {
        "metadata": {"name": "settings", "labels": {"trellis.dev/checksum": "true"}},
        "data": {"mode": "fast"}})
    annotation = "trellis.dev/sha256"

    def annotated(items):
        cm = items.get("settings")
        return cm is not None and (cm.metadata.annotations or {}).get(annotation)

    first = wait_for(core.list_namespaced_config_map, annotated, timeout=60,
                     namespace="default")["settings"].metadata.annotations[annotation]
    # New content, a new checksum.
    core.patch_namespaced_config_map("settings", "default", {"data": {"mode": "slow"}})
    wait_for(core.list_namespaced_config_map,
             lambda items: annotated(items) not in (None, False, first),
             namespace="default")


def test_every_namespace_gets_its_default_service_account_and_the_root_ca(controlled):
    api, data_dir = controlled
    core = client.CoreV1Api(api)
    ca = (data_dir / "pki" / "ca.crt").read_text()
    core.create_namespace({"metadata": {"name": "fresh"}})

    def account(items):
        return "default" in items

    def published(items):
        cm = items.get("kube-root-ca.crt")
        return cm is not None and (cm.data or {}).get("ca.crt", "").strip() == ca.strip()

    wait_for(core.list_namespaced_service_account, account, namespace="fresh")
    wait_for(core.list_namespaced_config_map, published, namespace="fresh")
    # Deleted or changed, they are put back.
    core.delete_namespaced_service_account("default", "fresh")
    core.patch_namespaced_config_map("kube-root-ca.crt", "fresh", {"data": {"ca.crt": "x"}})
    wait_for(core.list_namespaced_config_map, published, namespace="fresh")
    wait_for(core.list_namespaced_service_account, account, namespace="fresh")


def test_a_controller_refused_by_rbac_says_so_in_its_status_and_keeps_running(controlled):
    api, _ = controlled
    custom = client.CustomObjectsApi(api)
    core = client.CoreV1Api(api)
    plugins = dict(group="trellis.dev", version="v1", plural="plugins")
    spec = plugin_spec(f"file://{MODULE}", {"label": "trellis.dev/refused"})
    # It may read ConfigMaps (the controller manager's informers do) but not write.
    spec["controller"]["rules"] = [{"apiGroups": [""], "resources": ["configmaps"],
                                    "verbs": ["get"]}]
    custom.create_cluster_custom_object(**plugins, body={
        "apiVersion": "trellis.dev/v1", "kind": "Plugin",
        "metadata": {"name": "refused"}, "spec": spec})
    core.create_namespaced_config_map("default", {
        "metadata": {"name": "wants-kids", "annotations": {"trellis.dev/children": "1"}}})

    def refused(items):
        plugin = items.get("refused")
        status = (plugin or {}).get("status") or {}
        loaded = any(c["type"] == "Loaded" and c["status"] == "True"
                     for c in status.get("conditions") or [])
        return loaded and (status.get("denials") or 0) >= 1

    list_plugins = lambda **kw: custom.list_cluster_custom_object(**plugins, **kw)  # noqa: E731
    wait_for(list_plugins, refused)
    assert not [m for m in core.list_namespaced_config_map("default").items
                if m.metadata.name.startswith("wants-kids-")]
    # And in an event on the ConfigMap it was reconciling, as `kubectl describe` shows.
    wait_for(core.list_namespaced_event, lambda items: any(
        e.involved_object.name == "wants-kids" and e.reason == "Forbidden"
        and "the controller refused may not create configmaps" in e.message
        for e in items.values()), namespace="default")
    custom.delete_cluster_custom_object(**plugins, name="refused")


def test_kubectl_get_plugins_lists_the_built_in_controllers_and_their_calls(controlled):
    _, data_dir = controlled
    kubeconfig = str(data_dir / "admin.kubeconfig")
    table = subprocess.run(
        ["kubectl", "--kubeconfig", kubeconfig, "get", "plugins", "-l", "trellis.dev/builtin=true"],
        capture_output=True, text=True, check=True).stdout
    for name in ("deployment-controller", "replicaset-controller", "generic-garbage-collector",
                 "namespace-controller", "node-controller", "service-account-controller"):
        assert re.search(rf"^{name}\s+controller\s+True\s", table, re.M), table

    # The counters of the built-in running are copied into its entry: the
    # ServiceAccount controller has reconciled at least the initial namespaces.
    api, _ = controlled
    custom = client.CustomObjectsApi(api)
    list_plugins = lambda **kw: custom.list_cluster_custom_object(  # noqa: E731
        group="trellis.dev", version="v1", plural="plugins", **kw)
    items = wait_for(list_plugins, lambda items: (
        (items.get("service-account-controller", {}).get("status") or {}).get("calls", 0) > 0))
    entry = items["service-account-controller"]
    assert entry["spec"]["module"]["url"] == "builtin:serviceaccount"
    assert [c["reason"] for c in entry["status"]["conditions"] if c["type"] == "Loaded"] == ["Builtin"]

    # Any Plugin may run a bundled controller under its own name; an unknown one is
    # refused by name.
    custom.create_cluster_custom_object(
        group="trellis.dev", version="v1", plural="plugins", body={
            "apiVersion": "trellis.dev/v1", "kind": "Plugin", "metadata": {"name": "nosuch"},
            "spec": {"kind": "controller", "module": {"url": "builtin:nosuch"},
                     "controller": {"for": {"version": "v1", "resource": "configmaps"}}}})
    items = wait_for(list_plugins, lambda items: any(
        c["type"] == "Loaded" and c["status"] == "False"
        for c in (items.get("nosuch", {}).get("status") or {}).get("conditions") or []))
    condition = [c for c in items["nosuch"]["status"]["conditions"] if c["type"] == "Loaded"][0]
    assert "bundled controllers" in condition["message"] and "replicaset" in condition["message"]
    custom.delete_cluster_custom_object(
        group="trellis.dev", version="v1", plural="plugins", name="nosuch")
