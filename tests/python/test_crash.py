"""`trellis server` killed with SIGKILL: no acknowledged write is lost, and a namespace
deletion it was in the middle of finishes after the restart, leaving nothing behind."""

import signal
import tempfile
import threading
from pathlib import Path

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from conftest import remove_data_dir, start_server, stop_server, wait_ready


def ready_api(proc, data_dir: Path) -> client.ApiClient:
    wait_ready(proc, data_dir)
    return config.new_client_from_config(config_file=str(data_dir / "admin.kubeconfig"))


def test_sigkill_under_twenty_writers_keeps_every_acknowledged_create():
    data_dir = Path(tempfile.mkdtemp(prefix="trellis-py-crash-"))
    proc = start_server(data_dir)
    try:
        api = ready_api(proc, data_dir)
        acknowledged: dict[str, str] = {}
        lock = threading.Lock()
        enough = threading.Event()

        def writer(w: int):
            v1 = client.CoreV1Api(config.new_client_from_config(config_file=str(data_dir / "admin.kubeconfig")))
            i = 0
            while True:
                name = f"w{w}-{i}"
                try:
                    created = v1.create_namespaced_config_map(
                        "default", client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name), data={"i": name})
                    )
                except Exception:  # noqa: BLE001 - the server is gone: stop writing
                    return
                with lock:
                    acknowledged[name] = created.metadata.resource_version
                    if len(acknowledged) >= 400:
                        enough.set()
                i += 1

        writers = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(20)]
        for t in writers:
            t.start()
        assert enough.wait(timeout=60), f"only {len(acknowledged)} creates in 60 s"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        for t in writers:
            t.join(timeout=30)
        api.close()

        proc = start_server(data_dir)
        api = ready_api(proc, data_dir)
        stored = {
            cm.metadata.name: cm.metadata.resource_version
            for cm in client.CoreV1Api(api).list_namespaced_config_map("default").items
        }
        missing = {n: rv for n, rv in acknowledged.items() if stored.get(n) != rv}
        assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged creates lost or changed"
        api.close()
    finally:
        stop_server(proc)
        remove_data_dir(data_dir)


def test_sigkill_during_a_namespace_deletion_finishes_it_after_the_restart():
    data_dir = Path(tempfile.mkdtemp(prefix="trellis-py-crash-ns-"))
    proc = start_server(data_dir)
    try:
        api = ready_api(proc, data_dir)
        v1 = client.CoreV1Api(api)
        v1.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="doomed")))
        for i in range(300):
            v1.create_namespaced_config_map(
                "doomed", client.V1ConfigMap(metadata=client.V1ObjectMeta(name=f"cm-{i}"), data={"i": str(i)})
            )
            if i % 10 == 0:
                v1.create_namespaced_secret(
                    "doomed", client.V1Secret(metadata=client.V1ObjectMeta(name=f"s-{i}"), string_data={"k": "v"})
                )
        v1.delete_namespace("doomed")
        # Killed while the deletion runs: the namespace is marked, most objects remain.
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        api.close()

        proc = start_server(data_dir)
        api = ready_api(proc, data_dir)
        v1 = client.CoreV1Api(api)
        try:
            left = v1.read_namespace("doomed")
        except ApiException as e:
            assert e.status == 404, e
        else:
            assert left.status.phase == "Terminating", left
            # Wait for its removal on a watch from the state just read.
            gone = False
            for event in watch.Watch().stream(
                v1.list_namespace, field_selector="metadata.name=doomed",
                resource_version=left.metadata.resource_version, timeout_seconds=30,
            ):
                if event["type"] == "DELETED":
                    gone = True
                    break
            assert gone, "the namespace was never removed after the restart"
        # Re-created, it is empty: nothing of the old one comes back.
        v1.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="doomed")))
        assert v1.list_namespaced_config_map("doomed").items == []
        assert v1.list_namespaced_secret("doomed").items == []
        api.close()
    finally:
        stop_server(proc)
        remove_data_dir(data_dir)
