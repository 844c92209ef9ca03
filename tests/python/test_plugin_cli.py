"""`trellis plugin`: offline runs and benches of a component, and the Plugin objects
of the session's server managed from the command line.

The components are the ones `plugins/build.sh` puts in plugins/target/dist (the test
command builds them first).
"""

import json
import re
import subprocess
import time

import pytest
from kubernetes import client

from conftest import REPO_ROOT, trellis_binary

DIST = REPO_ROOT / "plugins" / "target" / "dist"
POD_POLICY_DATA = REPO_ROOT / "examples" / "plugins" / "pod-policy" / "testdata"


def wasm(name: str) -> str:
    path = DIST / f"{name}.wasm"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run plugins/build.sh")
    return str(path)


def plugin(*args: str, check: bool = True, log: str = "warn") -> subprocess.CompletedProcess:
    """Runs `trellis plugin ARGS` with `RUST_LOG=log`; with `check`, fails the test on a
    non-zero exit."""
    done = subprocess.run(
        [str(trellis_binary()), "plugin", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"RUST_LOG": log, "PATH": "/usr/bin:/bin", "NO_COLOR": "1"},
    )
    if check and done.returncode != 0:
        pytest.fail(f"trellis plugin {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done


def test_plugin_run_prints_the_answer_and_names_a_failure(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"allowedRegistries": ["registry.k8s.io", "docker.io/library", "ghcr.io/acme/"]}')
    args = ["run", wasm("pod-policy"), "--kind", "validating", "--config", str(config)]

    denied = json.loads(plugin(*args, "--input", str(POD_POLICY_DATA / "privileged-pod.json")).stdout)
    assert denied["kind"] == "AdmissionReview"
    response = denied["response"]
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert 'container "app" is privileged' in response["status"]["message"]
    assert 'init container "setup" is privileged' in response["status"]["message"]

    good = json.loads(plugin(*args, "--input", str(POD_POLICY_DATA / "good-pod.json")).stdout)
    assert good["response"]["allowed"] is True

    # A plugin that never returns is stopped at its deadline and named.
    loop_config = tmp_path / "loop.json"
    loop_config.write_text('{"mode": "loop"}')
    stopped = plugin(
        "run", wasm("misbehave"), "--kind", "validating", "--config", str(loop_config),
        "--input", str(POD_POLICY_DATA / "good-pod.json"), "--timeout-ms", "200",
        check=False,
    )
    assert stopped.returncode != 0
    assert "plugin misbehave (validating, v sha256:" in stopped.stderr
    assert "timed out after 200ms" in stopped.stderr


def run_misbehave(mode: str, tmp_path, log: str = "warn") -> tuple[dict, str]:
    """misbehave's answer in `mode`, offline, and the log it wrote (colours removed)."""
    config = tmp_path / f"{mode}.json"
    config.write_text(json.dumps({"mode": mode}))
    done = plugin(
        "run", wasm("misbehave"), "--kind", "validating", "--config", str(config),
        "--input", str(POD_POLICY_DATA / "good-pod.json"), log=log,
    )
    return json.loads(done.stdout)["response"], re.sub(r"\x1b\[[0-9;]*m", "", done.stderr)


def test_wasi_grants_a_plugin_no_files_environment_or_arguments(tmp_path):
    response, _ = run_misbehave("escape", tmp_path)
    message = response["status"]["message"]
    assert "read /etc/hostname: error:" in message, message
    assert "read_dir /: error:" in message, message
    assert "env vars: 0; args: 0" in message, message


def test_plugin_logs_and_output_reach_the_host_log_tagged(tmp_path):
    response, log = run_misbehave("log", tmp_path, log="info")
    assert response["allowed"] is True
    line = next(l for l in log.splitlines() if "misbehave saw a request" in l)
    assert "INFO" in line and 'plugin="misbehave"' in line and "name=web" in line, line

    response, log = run_misbehave("print", tmp_path, log="info")
    assert response["allowed"] is True
    for stream in ("stdout", "stderr"):
        line = next(l for l in log.splitlines() if f"misbehave prints to {stream}" in l)
        assert "plugin=misbehave" in line and f'stream="{stream}"' in line, line
    # At warn, neither is shown: both are logged at info.
    _, quiet = run_misbehave("print", tmp_path, log="warn")
    assert "misbehave prints" not in quiet, quiet


def test_plugin_bench_prints_per_call_latency():
    done = plugin(
        "bench", wasm("noop"), "--kind", "validating",
        "--input", str(POD_POLICY_DATA / "good-pod.json"), "--calls", "300", "--json",
    )
    report = json.loads(done.stdout)
    assert report["plugin"] == "noop"
    assert report["digest"].startswith("sha256:")
    assert report["calls"] == 300
    assert report["tier"] == "optimized"
    assert 0 < report["p50_us"] <= report["p99_us"] <= report["max_us"]
    assert report["calls_per_sec"] > 0


def nginx_pod(name: str) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(containers=[client.V1Container(name="web", image="nginx:1.27")]),
    )


def test_plugin_install_list_describe_and_uninstall(trellis, api_client, namespace, tmp_path):
    kubeconfig = ["--kubeconfig", str(trellis.kubeconfig)]
    config = tmp_path / "config.yaml"
    config.write_text("allowedRegistries: [registry.k8s.io]\n")
    installed = plugin(
        "install", "cli-policy", wasm("pod-policy"), "--kind", "validating",
        "--resource", "pods", "--config", str(config), *kubeconfig,
    )
    assert "plugin cli-policy serving sha256:" in installed.stdout

    rows = [line.split() for line in plugin("list", *kubeconfig).stdout.splitlines()]
    assert rows[0][:4] == ["NAME", "KIND", "POLICY", "LOADED"]
    row = next(r for r in rows if r[0] == "cli-policy")
    assert row[1:4] == ["validating", "Fail", "True"]

    v1 = client.CoreV1Api(api_client)
    try:
        with pytest.raises(client.ApiException) as refused:
            v1.create_namespaced_pod(namespace, nginx_pod("web"))
        assert refused.value.status == 403
        message = json.loads(refused.value.body)["message"]
        assert 'admission plugin "cli-policy" denied the request' in message
        assert "not from an allowed registry" in message

        # The status counts the denial (written back within a few seconds).
        deadline = time.monotonic() + 15
        while True:
            described = plugin("describe", "cli-policy", *kubeconfig).stdout
            if "1 denied" in described:
                break
            assert time.monotonic() < deadline, described
            time.sleep(0.5)
        assert "Kind:            validating" in described
        assert '{"allowedRegistries":["registry.k8s.io"]}' in described
        assert "Loaded:          True" in described
    finally:
        removed = plugin("uninstall", "cli-policy", *kubeconfig, check=False)
    assert removed.returncode == 0, removed.stderr
    assert "plugin cli-policy uninstalled" in removed.stdout

    assert all(r[0] != "cli-policy" for r in (line.split() for line in plugin("list", *kubeconfig).stdout.splitlines()))
    missing = plugin("describe", "cli-policy", *kubeconfig, check=False)
    assert missing.returncode != 0
    assert "not found" in missing.stderr
    # Without the plugin the same pod is admitted.
    deadline = time.monotonic() + 10
    while True:
        try:
            v1.create_namespaced_pod(namespace, nginx_pod("web"))
            break
        except client.ApiException as e:
            assert e.status == 403 and time.monotonic() < deadline, e.body
            time.sleep(0.2)
