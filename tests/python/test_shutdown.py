"""`trellis server` stopping on SIGTERM: it ends open watches cleanly, exits 0, and a
restart on the same data directory has every acknowledged write."""

import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from kubernetes import client, config, watch

from conftest import remove_data_dir, start_server, stop_server, wait_ready


def ready_client(proc: subprocess.Popen, data_dir: Path) -> client.ApiClient:
    wait_ready(proc, data_dir)
    return config.new_client_from_config(config_file=str(data_dir / "admin.kubeconfig"))


def test_sigterm_ends_watches_exits_zero_and_keeps_every_write():
    data_dir = Path(tempfile.mkdtemp(prefix="trellis-py-stop-"))
    proc = start_server(data_dir)
    try:
        api = ready_client(proc, data_dir)
        v1 = client.CoreV1Api(api)
        names = [f"kept-{i}" for i in range(50)]
        for name in names:
            v1.create_namespaced_config_map(
                "default", client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name), data={"i": name})
            )
        revision = v1.list_namespaced_config_map("default").metadata.resource_version

        # A watch open when the signal comes: its stream must end, not hang or break.
        seen, ended, failure = [], threading.Event(), []

        def follow():
            try:
                for event in watch.Watch().stream(
                    v1.list_namespaced_config_map, "default",
                    resource_version=revision, timeout_seconds=60, _request_timeout=30,
                ):
                    seen.append(event["object"].metadata.name)
            except Exception as e:  # noqa: BLE001 - reported below
                failure.append(repr(e))
            ended.set()

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()
        time.sleep(0.5)
        v1.create_namespaced_config_map(
            "default", client.V1ConfigMap(metadata=client.V1ObjectMeta(name="last"), data={"i": "last"})
        )
        names.append("last")
        deadline = time.monotonic() + 10
        while "last" not in seen:
            assert time.monotonic() < deadline, f"the watch never saw the last create: {seen}"
            time.sleep(0.05)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, (data_dir / "server.log").read_text()[-3000:]
        assert ended.wait(timeout=10), "the watch did not end when the server stopped"
        assert not failure, failure
        api.close()

        # Everything acknowledged before the signal is there after a restart.
        proc = start_server(data_dir)
        api = ready_client(proc, data_dir)
        stored = {
            cm.metadata.name: cm.data["i"]
            for cm in client.CoreV1Api(api).list_namespaced_config_map("default").items
            if cm.metadata.name.startswith("kept-") or cm.metadata.name == "last"
        }
        assert stored == {name: name for name in names}
        api.close()
    finally:
        stop_server(proc)
        remove_data_dir(data_dir)
