"""`trellis controllers` as separate processes against one server: exactly one leads
its Lease, a standby takes over once a killed leader's lease has run out, and a
leader stopped by SIGTERM hands the lease back."""

import signal
import subprocess
import time
from pathlib import Path

from kubernetes import client, config

from conftest import trellis_binary

LEASE = "kube-controller-manager"
FAST = [
    "--leader-elect-lease-duration", "2",
    "--leader-elect-renew-deadline", "1.5",
    "--leader-elect-retry-period", "0.2",
]


def start(trellis, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(trellis_binary()), "controllers",
         "--kubeconfig", str(trellis.data_dir / "controller-manager.kubeconfig"), *FAST],
        stdout=subprocess.DEVNULL, stderr=log.open("w"),
    )


def holder(coordination) -> str | None:
    try:
        lease = coordination.read_namespaced_lease(LEASE, "kube-system")
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise
    return lease.spec.holder_identity


def wait_for(what, condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_one_leader_a_standby_takes_over_and_sigterm_hands_back(trellis, api_client, tmp_path):
    coordination = client.CoordinationV1Api(api_client)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [start(trellis, log) for log in logs]
    try:
        first = wait_for("a leader", lambda: holder(coordination))
        running = lambda: [i for i, log in enumerate(logs) if "running;" in log.read_text()]
        leader = wait_for("the leader's loops", running)
        assert len(leader) == 1, [log.read_text() for log in logs]
        leader = leader[0]
        standby = 1 - leader
        # The components act as their own user, not as the admin.
        component = config.new_client_from_config(
            config_file=str(trellis.data_dir / "controller-manager.kubeconfig"))
        review = client.AuthenticationV1Api(component).create_self_subject_review(
            client.V1SelfSubjectReview())
        assert review.status.user_info.username == "system:kube-controller-manager"
        assert "system:masters" not in (review.status.user_info.groups or [])

        procs[leader].send_signal(signal.SIGKILL)
        procs[leader].wait()
        killed = time.monotonic()
        second = wait_for("a new holder", lambda: (h := holder(coordination)) != first and h, timeout=15)
        takeover = time.monotonic() - killed
        assert 1.5 <= takeover < 5.0, takeover
        wait_for("the standby's loops", lambda: "running;" in logs[standby].read_text())
        lease = coordination.read_namespaced_lease(LEASE, "kube-system")
        assert lease.spec.lease_transitions >= 1

        procs[standby].send_signal(signal.SIGTERM)
        assert procs[standby].wait(timeout=10) == 0, logs[standby].read_text()
        assert holder(coordination) in (None, ""), second
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
