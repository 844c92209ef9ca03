"""Plugin modules fetched over HTTPS: the digest is required and checked, and the
module serves once it matches.

The module is served by a small HTTPS file server with its own CA, made here with
`openssl`; a `trellis server` of this module's own trusts that CA through
`SSL_CERT_FILE`, as an operator would add a private CA to the system's roots.
"""

import hashlib
import http.server
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from kubernetes import client

from conftest import REPO_ROOT, own_server

MODULE = REPO_ROOT / "plugins" / "target" / "dist" / "pod-policy.wasm"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(dir: Path) -> None:
    """ca.pem (a CA) and server.pem/server.key (127.0.0.1, signed by it)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=trellis test CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=dir)
    openssl("req", "-new", *ec, "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=127.0.0.1", cwd=dir)
    (dir / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
    )
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "server.ext",
            cwd=dir)


@pytest.fixture(scope="module")
def https_modules():
    """An HTTPS server of plugins/target/dist; yields (base URL, CA file, request log)."""
    if not MODULE.is_file():
        pytest.fail(f"{MODULE} is missing: run plugins/build.sh")
    certs = Path(tempfile.mkdtemp(prefix="trellis-https-"))
    make_certificates(certs)
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(MODULE.parent), **kwargs)

        def do_GET(self):
            requested.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs / "server.pem", certs / "server.key")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", certs / "ca.pem", requested
    finally:
        server.shutdown()
        shutil.rmtree(certs, ignore_errors=True)


@pytest.fixture(scope="module")
def trusting_server(https_modules):
    """A `trellis server` that trusts the module server's CA; yields an ApiClient."""
    _, ca_file, _ = https_modules
    env = dict(os.environ, SSL_CERT_FILE=str(ca_file), RUST_LOG="info")
    with own_server("trellis-py-https-", env=env) as (api, _):
        yield api


def plugin_object(name: str, url: str, sha256: str | None) -> dict:
    module = {"url": url}
    if sha256 is not None:
        module["sha256"] = sha256
    return {
        "apiVersion": "trellis.dev/v1",
        "kind": "Plugin",
        "metadata": {"name": name},
        "spec": {
            "kind": "validating",
            "module": module,
            "configuration": {"allowedRegistries": ["registry.k8s.io"]},
            "failurePolicy": "Fail",
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                       "resources": ["pods"]}],
        },
    }


def loaded_condition(api: client.ApiClient, name: str, status: str) -> dict:
    """Waits until the Plugin's Loaded condition has `status`; returns the condition."""
    plugins = client.CustomObjectsApi(api)
    deadline = time.monotonic() + 30
    while True:
        obj = plugins.get_cluster_custom_object("trellis.dev", "v1", "plugins", name)
        for condition in obj.get("status", {}).get("conditions", []):
            if condition["type"] == "Loaded" and condition["status"] == status:
                return condition | {"digest": obj["status"].get("digest")}
        assert time.monotonic() < deadline, json.dumps(obj.get("status"))
        time.sleep(0.1)


def test_an_https_module_needs_its_digest(trusting_server, https_modules):
    base, _, _ = https_modules
    plugins = client.CustomObjectsApi(trusting_server)
    plugins.create_cluster_custom_object(
        "trellis.dev", "v1", "plugins", plugin_object("undigested", f"{base}/pod-policy.wasm", None)
    )
    condition = loaded_condition(trusting_server, "undigested", "False")
    assert "spec.module.sha256: Required value" in condition["message"], condition


def test_an_https_module_serves_when_its_digest_matches(trusting_server, https_modules):
    base, _, requested = https_modules
    actual = hashlib.sha256(MODULE.read_bytes()).hexdigest()
    plugins = client.CustomObjectsApi(trusting_server)

    # A digest the content does not have: not loaded, and the status says both digests.
    plugins.create_cluster_custom_object(
        "trellis.dev", "v1", "plugins", plugin_object("fetched", f"{base}/pod-policy.wasm", "0" * 64)
    )
    condition = loaded_condition(trusting_server, "fetched", "False")
    assert f"the module's digest is sha256:{actual}" in condition["message"], condition
    assert "/pod-policy.wasm" in requested

    # The right digest: fetched, loaded and judging pods.
    fixed = plugin_object("fetched", f"{base}/pod-policy.wasm", actual)
    current = plugins.get_cluster_custom_object("trellis.dev", "v1", "plugins", "fetched")
    fixed["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    plugins.replace_cluster_custom_object("trellis.dev", "v1", "plugins", "fetched", fixed)
    condition = loaded_condition(trusting_server, "fetched", "True")
    assert condition["digest"] == f"sha256:{actual}", condition

    v1 = client.CoreV1Api(trusting_server)
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="elsewhere"),
        spec=client.V1PodSpec(containers=[client.V1Container(name="web", image="quay.io/acme/web:1")]),
    )
    with pytest.raises(client.ApiException) as refused:
        v1.create_namespaced_pod("default", pod)
    assert refused.value.status == 403
    assert 'admission plugin "fetched" denied the request' in json.loads(refused.value.body)["message"]

    # Modules are cached by digest: a known digest loads without asking the URL.
    cached = plugin_object("cached", f"{base}/absent.wasm", actual)
    plugins.create_cluster_custom_object("trellis.dev", "v1", "plugins", cached)
    loaded_condition(trusting_server, "cached", "True")
    assert "/absent.wasm" not in requested

    # An unknown digest is fetched: a missing file is named with the URL and status.
    missing = plugin_object("absent", f"{base}/absent.wasm", "1" * 64)
    plugins.create_cluster_custom_object("trellis.dev", "v1", "plugins", missing)
    condition = loaded_condition(trusting_server, "absent", "False")
    assert f"{base}/absent.wasm: HTTP 404" in condition["message"], condition
