"""`trellis controllers` as separate processes against one server: exactly one leads
its Lease, a standby takes over once a killed leader's lease has run out, and a
leader stopped by SIGTERM hands the lease back."""

import signal
import subprocess
import threading
import time

from kubernetes import client, config, watch

from conftest import trellis_binary

LEASE = "kube-controller-manager"
FAST = [
    "--leader-elect-lease-duration", "2",
    "--leader-elect-renew-deadline", "1.5",
    "--leader-elect-retry-period", "0.2",
]


class Component:
    """One `trellis controllers` process; `running` is set when it logs that its loops
    run (it leads)."""

    def __init__(self, trellis, anyone_running: threading.Event):
        self.proc = subprocess.Popen(
            [str(trellis_binary()), "controllers",
             "--kubeconfig", str(trellis.data_dir / "controller-manager.kubeconfig"), *FAST],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.running = threading.Event()
        self.anyone_running = anyone_running
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.log.append(line)
            if "running;" in line:
                self.running.set()
                self.anyone_running.set()


def holder_becomes(coordination, accept, timeout=15) -> str:
    """Watches the Lease until its holder is one `accept` takes; returns it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stream = watch.Watch().stream(
            coordination.list_namespaced_lease, "kube-system",
            field_selector=f"metadata.name={LEASE}",
            timeout_seconds=max(1, int(deadline - time.monotonic())))
        for event in stream:
            holder = event["object"].spec.holder_identity
            if event["type"] != "DELETED" and accept(holder):
                return holder
    raise AssertionError(f"the {LEASE} lease never got the holder expected")


def test_one_leader_a_standby_takes_over_and_sigterm_hands_back(trellis, api_client):
    coordination = client.CoordinationV1Api(api_client)
    anyone_running = threading.Event()
    components = [Component(trellis, anyone_running), Component(trellis, anyone_running)]
    try:
        first = holder_becomes(coordination, bool)
        assert anyone_running.wait(10), [c.log for c in components]
        leader = 0 if components[0].running.is_set() else 1
        standby = 1 - leader
        assert not components[standby].running.is_set(), components[standby].log

        # The components act as their own user, not as the admin.
        component = config.new_client_from_config(
            config_file=str(trellis.data_dir / "controller-manager.kubeconfig"))
        review = client.AuthenticationV1Api(component).create_self_subject_review(
            client.V1SelfSubjectReview())
        assert review.status.user_info.username == "system:kube-controller-manager"
        assert "system:masters" not in (review.status.user_info.groups or [])

        components[leader].proc.send_signal(signal.SIGKILL)
        components[leader].proc.wait()
        killed = time.monotonic()
        second = holder_becomes(coordination, lambda h: bool(h) and h != first)
        takeover = time.monotonic() - killed
        assert 1.5 <= takeover < 5.0, takeover
        assert components[standby].running.wait(10), components[standby].log
        lease = coordination.read_namespaced_lease(LEASE, "kube-system")
        assert lease.spec.lease_transitions >= 1

        components[standby].proc.send_signal(signal.SIGTERM)
        assert components[standby].proc.wait(timeout=10) == 0, components[standby].log
        lease = coordination.read_namespaced_lease(LEASE, "kube-system")
        assert lease.spec.holder_identity in (None, ""), second
    finally:
        for c in components:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
