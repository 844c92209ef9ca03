"""Jobs and CronJobs in `trellis up` through the official Python client's BatchV1Api:
an Indexed Job's pods see their index, a failing Job ends with BackoffLimitExceeded,
a CronJob whose run was missed starts its Job at once, and a finished Job with
ttlSecondsAfterFinished goes. The pods run the WASM workload on the local node.

The workload is `plugins/target/dist/workload.wasm` (plugins/build.sh)."""

import datetime

import pytest
from kubernetes import client

from conftest import REPO_ROOT, trellis_up
from test_controller_plugins import wait_for

WORKLOAD = REPO_ROOT / "plugins" / "target" / "dist" / "workload.wasm"
NS = "default"


@pytest.fixture(scope="module")
def up():
    if not WORKLOAD.exists():
        pytest.fail(f"{WORKLOAD} is missing: run plugins/build.sh")
    with trellis_up("trellis-jobs-", "--relist-period", "0.1") as running:
        yield running


def template(*args):
    return {"spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": f"file://{WORKLOAD}", "args": list(args)}]}}


def condition(job, type_):
    """The reason of the Job's condition `type_` when it is true."""
    for c in (job.status and job.status.conditions) or []:
        if c.type == type_ and c.status == "True":
            return c.reason or ""
    return None


def job_until(batch, name, accept, timeout=60):
    return wait_for(batch.list_namespaced_job, lambda items: name in items and accept(items[name]),
                    timeout=timeout, namespace=NS)[name]


def test_an_indexed_job_runs_each_index_once_and_its_pods_see_it(up):
    api, _ = up
    batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
    batch.create_namespaced_job(NS, {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "indexed"},
        "spec": {"completions": 3, "parallelism": 3, "completionMode": "Indexed",
                 "template": template("env", "JOB_COMPLETION_INDEX")}})
    job = job_until(batch, "indexed", lambda j: condition(j, "Complete") is not None)
    assert job.status.succeeded == 3 and job.status.completed_indexes == "0-2", job.status
    pods = core.list_namespaced_pod(NS, label_selector="batch.kubernetes.io/job-name=indexed").items
    seen = set()
    for pod in pods:
        index = pod.metadata.annotations["batch.kubernetes.io/job-completion-index"]
        assert pod.spec.hostname == f"indexed-{index}"
        log = core.read_namespaced_pod_log(pod.metadata.name, NS)
        assert log.strip() == f"JOB_COMPLETION_INDEX={index}", log
        seen.add(index)
    assert seen == {"0", "1", "2"}


def test_a_failing_job_fails_with_backoff_limit_exceeded(up):
    api, _ = up
    batch = client.BatchV1Api(api)
    batch.create_namespaced_job(NS, {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "failing"},
        "spec": {"backoffLimit": 0, "template": template("exit", "3")}})
    job = job_until(batch, "failing", lambda j: condition(j, "Failed") is not None)
    assert condition(job, "Failed") == "BackoffLimitExceeded"
    assert job.status.failed == 1 and not job.status.active, job.status


def test_a_cronjob_starts_its_missed_run_at_once_and_a_finished_job_goes_after_its_ttl(up):
    api, _ = up
    batch = client.BatchV1Api(api)
    batch.create_namespaced_cron_job(NS, {
        "apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "nightly"},
        "spec": {"schedule": "0 3 * * *", "timeZone": "Europe/Paris",
                 "jobTemplate": {"spec": {"ttlSecondsAfterFinished": 2,
                                          "template": template("echo", "ran")}}}})
    # Its run of last night at 03:00 in Paris was missed (say the status): it starts.
    yesterday = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=2)
    batch.patch_namespaced_cron_job_status("nightly", NS, {
        "status": {"lastScheduleTime": yesterday.strftime("%Y-%m-%dT%H:%M:%SZ")}})

    def ran(items):
        cj = items.get("nightly")
        return cj is not None and cj.status.last_schedule_time is not None and \
            cj.status.last_schedule_time > yesterday
    cj = wait_for(batch.list_namespaced_cron_job, ran, namespace=NS)["nightly"]
    scheduled = cj.status.last_schedule_time
    # 03:00 in Paris is 01:00 or 02:00 UTC.
    assert scheduled.minute == 0 and scheduled.hour in (1, 2), scheduled
    name = f"nightly-{int(scheduled.timestamp()) // 60}"
    # It completes (the CronJob says so), then the TTL controller deletes it.
    job = job_until(batch, name, lambda j: condition(j, "Complete") is not None)
    wait_for(batch.list_namespaced_cron_job,
             lambda items: items["nightly"].status.last_successful_time is not None,
             timeout=60, namespace=NS)
    assert job.metadata.annotations["batch.kubernetes.io/cronjob-scheduled-timestamp"].endswith(
        ("T03:00:00+01:00", "T03:00:00+02:00")), job.metadata.annotations
    wait_for(batch.list_namespaced_job, lambda items: name not in items, timeout=60, namespace=NS)
