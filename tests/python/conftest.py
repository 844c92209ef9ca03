"""Fixtures for the end-to-end tests with the official Python client.

One `trellis server` runs for the whole session on a fresh data directory and a
port the kernel picks (`--listen 127.0.0.1:0`; the address is read back from the
kubeconfig the server writes). `tokens.csv` is written before the start with an
admin token and a user `bob` without groups, so that the tests can authenticate
with bearer tokens as well as with the admin client certificate.

The binary is `$TRELLIS_BIN`, else `target/debug/trellis` under the repository
root; it is not built here.
"""

import base64
import contextlib
import json
import os
import re
import select
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config

REPO_ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "admintoken"
BOB_TOKEN = "bobtoken"
TOKENS_CSV = f'{ADMIN_TOKEN},admin,admin,"system:masters"\n{BOB_TOKEN},bob,bob\n'
READY_TIMEOUT_SECONDS = 10.0


@dataclass
class Trellis:
    """A running `trellis server`."""

    url: str
    data_dir: Path
    kubeconfig: Path
    ca_file: Path
    log_file: Path


def trellis_binary() -> Path:
    path = Path(os.environ.get("TRELLIS_BIN", REPO_ROOT / "target" / "debug" / "trellis"))
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not path.is_file():
        pytest.exit(f"no trellis binary at {path}: run `cargo build -p trellis` or set TRELLIS_BIN", 2)
    return path


def _read_cluster(kubeconfig: Path) -> tuple[str, bytes]:
    """The server URL and the CA certificate (PEM) of the kubeconfig's only cluster."""
    doc = yaml.safe_load(kubeconfig.read_text())
    cluster = doc["clusters"][0]["cluster"]
    return cluster["server"], base64.b64decode(cluster["certificate-authority-data"])


def _log_tail(log_file: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log_file.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_ready(proc: subprocess.Popen, kubeconfig: Path, log_file: Path) -> tuple[str, bytes]:
    """Waits until `/readyz` answers 200 `ok`; returns the URL and the CA."""
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    last_error = "admin.kubeconfig not written"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"trellis server exited with {proc.returncode} before it was ready:\n{_log_tail(log_file)}"
            )
        if kubeconfig.is_file():
            try:
                url, ca_pem = _read_cluster(kubeconfig)
                context = ssl.create_default_context(cadata=ca_pem.decode())
                request = urllib.request.Request(
                    f"{url}/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
                )
                with urllib.request.urlopen(request, context=context, timeout=1) as response:
                    body = response.read().decode()
                    if response.status == 200:
                        return url, ca_pem
                    last_error = f"/readyz: {response.status} {body}"
            except (OSError, urllib.error.URLError, KeyError, TypeError, yaml.YAMLError) as e:
                last_error = repr(e)
        time.sleep(0.05)
    raise RuntimeError(
        f"trellis server not ready after {READY_TIMEOUT_SECONDS} s ({last_error}):\n{_log_tail(log_file)}"
    )


def start_server(data_dir: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """Starts `trellis server ARGS` on `data_dir` (with the tokens of TOKENS_CSV), its
    output appended to `data_dir/server.log`; wait for it with `wait_ready`."""
    tokens = data_dir / "tokens.csv"
    if not tokens.exists():
        tokens.write_text(TOKENS_CSV)
        tokens.chmod(0o600)
    with open(data_dir / "server.log", "ab") as log:
        return subprocess.Popen(
            [str(trellis_binary()), "server", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )


def wait_ready(proc: subprocess.Popen, data_dir: Path) -> tuple[str, bytes]:
    """Waits until the server on `data_dir` is ready; returns its URL and CA."""
    return _wait_ready(proc, data_dir / "admin.kubeconfig", data_dir / "server.log")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not stopped within 5 s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def release_namespaces(data_dir: Path) -> None:
    """Kills the processes left in the namespaces pinned below `data_dir` and unmounts
    the pins: a node that was killed, or stopped with its pods running, leaves them (a
    runtime keeps its pods across its own restarts), and with them their veths."""
    points = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split(" ")
            point = fields[4].replace("\\040", " ")
            if Path(point).is_relative_to(data_dir) and " - nsfs " in line:
                points.append(point)
    inodes = set()
    for point in points:
        try:
            inodes.add(os.stat(point).st_ino)
        except OSError:
            pass
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for kind in ("net", "ipc", "uts"):
            try:
                if os.stat(f"/proc/{pid}/ns/{kind}").st_ino in inodes:
                    os.kill(int(pid), signal.SIGKILL)
                    break
            except OSError:
                pass
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


@contextlib.contextmanager
def trellis_up(prefix: str, *args: str):
    """`trellis up` with its local node (`local`) on a fresh data directory, with this
    suite's tokens, until the block ends: yields the admin's client and the directory.
    The log's tail is printed at the end."""
    data_dir = Path(tempfile.mkdtemp(prefix=prefix))
    (data_dir / "tokens.csv").write_text(TOKENS_CSV)
    (data_dir / "tokens.csv").chmod(0o600)
    log = open(data_dir / "up.log", "wb")
    proc = subprocess.Popen(
        [str(trellis_binary()), "up", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0",
         "--node-port", "0", "--node-name", "local", "--metrics-bind-address", "", *args],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    api = None
    try:
        _wait_ready(proc, data_dir / "admin.kubeconfig", data_dir / "up.log")
        api = config.new_client_from_config(config_file=str(data_dir / "admin.kubeconfig"))
        yield api, data_dir
    finally:
        if api is not None:
            api.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        print((data_dir / "up.log").read_text(errors="replace")[-3000:])
        remove_data_dir(data_dir)


def kubectl_up(data_dir: Path, *args: str, stdin: str | None = None) -> str:
    """The current kubectl as the admin of the `trellis up` in `data_dir`; its output."""
    result = subprocess.run([shutil.which("kubectl") or "kubectl", "--kubeconfig", str(data_dir / "admin.kubeconfig"),
                             *args], input=stdin, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


# What a node's pod network makes on this machine: the default network's bridge and
# nftables table, the agent's masquerade table, the node-local DNS link and the service
# proxy's table.
NETWORK_OBJECTS = [("link", "trellis0"), ("table", "ip trellis0"), ("table", "inet trellis"),
                   ("link", "trellis-dns"), ("table", "ip trellis-proxy")]

# The flags of a further node on this machine's network namespace, where `trellis up`'s
# node serves Services and DNS: one proxy and one DNS server per namespace, as per node.
SHARED_NETNS = ["--service-proxy=false", "--node-local-dns=false"]


def _network_object(thing, verb):
    kind, name = thing
    if kind == "link":
        command = ["ip", "link", "show" if verb == "list" else "delete", name]
    else:
        command = ["nft", verb, "table", *name.split()]
    return subprocess.run(command, capture_output=True).returncode == 0


@pytest.fixture(scope="session", autouse=True)
def network_leftovers():
    """Removes at the end of the session the network objects its nodes made, unless
    they were on the machine before it."""
    made = [thing for thing in NETWORK_OBJECTS if not _network_object(thing, "list")]
    yield
    for thing in made:
        _network_object(thing, "delete")


CGROUP_MOUNTS = Path("/sys/fs/cgroup")


def _remove_cgroup_tree(top: Path) -> None:
    """Kills what is left in cgroup `top` (one hierarchy's directory), waits for it to
    exit (a pidfd each: woken by the exits), and removes the tree, children first."""
    dirs = sorted((d for d, _, _ in os.walk(top)), key=lambda d: -len(d))
    for _ in range(10):
        pidfds = []
        for d in dirs:
            with contextlib.suppress(OSError):
                for pid in (Path(d) / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        pidfds.append(os.pidfd_open(int(pid)))
        for fd in pidfds:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        for fd in pidfds:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll(2000)
            os.close(fd)
        for d in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(d)
        if not top.exists() or not pidfds:
            return


@pytest.fixture(scope="session", autouse=True)
def node_settings():
    """Every node the session starts (`trellis up`, `trellis node`) makes its pods'
    cgroups under a root of the session's own, removed at the end, and has eviction
    thresholds no machine meets: a test machine's full disk must not evict the tests'
    pods."""
    name = f"trellis-test-py-{uuid.uuid4().hex[:8]}"
    saved = {key: os.environ.get(key) for key in ("TRELLIS_CGROUP_ROOT", "TRELLIS_EVICTION_HARD")}
    os.environ["TRELLIS_CGROUP_ROOT"] = f"/{name}"
    os.environ["TRELLIS_EVICTION_HARD"] = (
        "memory.available<0,nodefs.available<0%,nodefs.inodesFree<0%,imagefs.available<0%,pid.available<0")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if CGROUP_MOUNTS.is_dir():
        for hierarchy in CGROUP_MOUNTS.iterdir():
            if (hierarchy / name).is_dir():
                _remove_cgroup_tree(hierarchy / name)
        if (CGROUP_MOUNTS / name).is_dir():
            _remove_cgroup_tree(CGROUP_MOUNTS / name)


def remove_data_dir(data_dir: Path) -> None:
    release_namespaces(data_dir)
    if os.environ.get("TRELLIS_KEEP_DATA"):
        print(f"trellis data directory kept: {data_dir}")
    else:
        shutil.rmtree(data_dir, ignore_errors=True)


@contextlib.contextmanager
def own_server(prefix: str, *args: str, env: dict | None = None):
    """A `trellis server ARGS` of a test's own on a fresh data directory; yields an
    admin `ApiClient` and the directory, and stops and removes both at the end."""
    data_dir = Path(tempfile.mkdtemp(prefix=prefix))
    proc = start_server(data_dir, *args, env=env)
    api = None
    try:
        wait_ready(proc, data_dir)
        api = config.new_client_from_config(config_file=str(data_dir / "admin.kubeconfig"))
        yield api, data_dir
    finally:
        if api is not None:
            api.close()
        stop_server(proc)
        remove_data_dir(data_dir)


@pytest.fixture(scope="session")
def trellis():
    """Starts `trellis server` for the session and stops it at the end."""
    data_dir = Path(tempfile.mkdtemp(prefix="trellis-py-"))
    proc = start_server(data_dir)
    try:
        url, ca_pem = wait_ready(proc, data_dir)
        ca_file = data_dir / "test-ca.crt"
        ca_file.write_bytes(ca_pem)
        yield Trellis(
            url=url,
            data_dir=data_dir,
            kubeconfig=data_dir / "admin.kubeconfig",
            ca_file=ca_file,
            log_file=data_dir / "server.log",
        )
    finally:
        stop_server(proc)
        remove_data_dir(data_dir)


@pytest.fixture(scope="session")
def api_client(trellis):
    """An `ApiClient` for the admin, from the server's `admin.kubeconfig`."""
    api = config.new_client_from_config(config_file=str(trellis.kubeconfig))
    yield api
    api.close()


def token_client(trellis: Trellis, token: str) -> client.ApiClient:
    """An `ApiClient` that authenticates with `token` and trusts the cluster CA."""
    configuration = client.Configuration()
    configuration.host = trellis.url
    configuration.ssl_ca_cert = str(trellis.ca_file)
    configuration.verify_ssl = True
    configuration.api_key = {"authorization": token}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(configuration)


@pytest.fixture
def bearer_client(trellis):
    """A factory of token clients, closed at the end of the test."""
    clients = []

    def make(token: str) -> client.ApiClient:
        api = token_client(trellis, token)
        clients.append(api)
        return api

    yield make
    for api in clients:
        api.close()


@pytest.fixture
def namespace(api_client, request):
    """A fresh namespace for one test, deleted after it."""
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower().removeprefix("test_"))[:40].strip("-")
    name = f"{stem}-{uuid.uuid4().hex[:6]}"
    v1 = client.CoreV1Api(api_client)
    v1.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    try:
        v1.delete_namespace(name)
    except client.ApiException:
        pass


def raw_json(response) -> dict:
    """The JSON body of a call made with `_preload_content=False`."""
    try:
        return json.loads(response.data)
    finally:
        response.release_conn()


def names(items) -> list[str]:
    return sorted(item.metadata.name for item in items)


class Raw:
    """Plain HTTPS requests on an `ApiClient`'s connection pool and credentials, for
    what the client cannot express (bodies it would not send, headers, streams)."""

    def __init__(self, api_client: client.ApiClient):
        self.pool = api_client.rest_client.pool_manager
        self.host = api_client.configuration.host

    def request(self, method, path, body=None, headers=None, **kwargs):
        return self.pool.request(
            method, self.host + path, body=body, headers=headers or {}, timeout=30, **kwargs
        )

    def json(self, method, path, body=None, headers=None):
        """The status and JSON body of a request."""
        response = self.request(method, path, body=body, headers=headers)
        return response.status, json.loads(response.data)


def check_status(status: dict, code: int, reason: str) -> dict:
    """Checks a failure `Status` of `code` and `reason`; returns it."""
    assert status.get("kind") == "Status", status
    assert status.get("apiVersion") == "v1", status
    assert status.get("status") == "Failure", status
    assert status.get("code") == code, status
    assert status.get("reason") == reason, status
    assert status.get("message"), f"a Status without a message: {status}"
    return status


def failure_status(error: client.ApiException, code: int, reason: str) -> dict:
    """The `Status` in an error's body, checked to be a failure of `code` and `reason`."""
    assert error.status == code, f"HTTP {error.status}, not {code}: {error.body}"
    assert error.body, f"HTTP {error.status} without a body"
    return check_status(json.loads(error.body), code, reason)
