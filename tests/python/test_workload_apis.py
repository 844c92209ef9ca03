"""The workload, batch, storage, autoscaling and aggregation APIs of `trellis server`
through the official Python client's typed APIs: what the server defaults and
generates, the scale subresource of a StatefulSet, the same autoscaler read at both
versions, and validation answered as Kubernetes answers it (422, a cause per field).

The session's server runs no controllers: the objects stay as the server wrote them.
"""

import json

import pytest
from kubernetes import client
from kubernetes.client import ApiException

from conftest import failure_status


def causes_of(call) -> list[str]:
    """The fields of the causes of the 422 a call is refused with."""
    with pytest.raises(ApiException) as refused:
        call()
    status = failure_status(refused.value, 422, "Invalid")
    return [c["field"] for c in status["details"]["causes"]]


def pod_template(labels, restart_policy=None):
    return client.V1PodTemplateSpec(
        metadata=client.V1ObjectMeta(labels=labels),
        spec=client.V1PodSpec(
            restart_policy=restart_policy,
            containers=[client.V1Container(name="main", image="busybox:1.36")],
        ),
    )


def test_a_job_gets_its_selector_and_keeps_its_pods_restart_policy(api_client, namespace):
    batch = client.BatchV1Api(api_client)
    job = batch.create_namespaced_job(
        namespace,
        client.V1Job(
            metadata=client.V1ObjectMeta(name="pi"),
            spec=client.V1JobSpec(template=pod_template(None, "Never")),
        ),
    )
    uid = job.metadata.uid
    assert job.spec.selector.match_labels == {"batch.kubernetes.io/controller-uid": uid}
    labels = job.spec.template.metadata.labels
    assert labels["controller-uid"] == uid and labels["batch.kubernetes.io/job-name"] == "pi"
    assert (job.spec.completions, job.spec.parallelism, job.spec.backoff_limit) == (1, 1, 6)
    assert job.spec.completion_mode == "NonIndexed" and job.spec.suspend is False

    always = client.V1Job(
        metadata=client.V1ObjectMeta(name="forever"),
        spec=client.V1JobSpec(template=pod_template(None)),
    )
    assert causes_of(lambda: batch.create_namespaced_job(namespace, always)) == [
        "spec.template.spec.restartPolicy"
    ]
    cron = client.V1CronJob(
        metadata=client.V1ObjectMeta(name="hourly"),
        spec=client.V1CronJobSpec(
            schedule="0 * * *",
            time_zone="Nowhere/Special",
            job_template=client.V1JobTemplateSpec(
                spec=client.V1JobSpec(template=pod_template(None, "OnFailure"))
            ),
        ),
    )
    assert causes_of(lambda: batch.create_namespaced_cron_job(namespace, cron)) == [
        "spec.schedule",
        "spec.timeZone",
    ]
    cron.spec.schedule, cron.spec.time_zone = "@hourly", "Etc/UTC"
    made = batch.create_namespaced_cron_job(namespace, cron)
    assert made.spec.concurrency_policy == "Allow"
    assert (made.spec.successful_jobs_history_limit, made.spec.failed_jobs_history_limit) == (3, 1)


def test_a_stateful_sets_scale_names_its_selector(api_client, namespace):
    apps = client.AppsV1Api(api_client)
    selector = client.V1LabelSelector(match_labels={"app": "web"})
    made = apps.create_namespaced_stateful_set(
        namespace,
        client.V1StatefulSet(
            metadata=client.V1ObjectMeta(name="web"),
            spec=client.V1StatefulSetSpec(
                service_name="web", selector=selector, template=pod_template({"app": "web"})
            ),
        ),
    )
    assert made.spec.pod_management_policy == "OrderedReady"
    assert made.spec.update_strategy.rolling_update.partition == 0
    apps.patch_namespaced_stateful_set_scale("web", namespace, {"spec": {"replicas": 4}})
    scale = apps.read_namespaced_stateful_set_scale("web", namespace)
    assert (scale.spec.replicas, scale.status.selector) == (4, "app=web")

    daemons = apps.create_namespaced_daemon_set(
        namespace,
        client.V1DaemonSet(
            metadata=client.V1ObjectMeta(name="agent"),
            spec=client.V1DaemonSetSpec(selector=selector, template=pod_template({"app": "web"})),
        ),
    )
    assert daemons.spec.update_strategy.type == "RollingUpdate"
    assert daemons.spec.update_strategy.rolling_update.max_unavailable == 1


def test_storage_defaults_and_refusals(api_client, namespace):
    storage = client.StorageV1Api(api_client)
    name = f"{namespace}-class"
    made = storage.create_storage_class(
        client.V1StorageClass(metadata=client.V1ObjectMeta(name=name), provisioner="example.com/disk")
    )
    try:
        assert (made.reclaim_policy, made.volume_binding_mode) == ("Delete", "Immediate")
        changed = {"provisioner": "example.com/other"}
        assert causes_of(lambda: storage.patch_storage_class(name, changed)) == ["provisioner"]
    finally:
        # Kubernetes answers with the deleted class, which the client parses.
        assert storage.delete_storage_class(name).metadata.name == name

    core = client.CoreV1Api(api_client)
    claim = client.V1PersistentVolumeClaim(
        metadata=client.V1ObjectMeta(name="data"),
        spec=client.V1PersistentVolumeClaimSpec(
            access_modes=[], resources=client.V1VolumeResourceRequirements(requests={"storage": "0"})
        ),
    )
    assert causes_of(lambda: core.create_namespaced_persistent_volume_claim(namespace, claim)) == [
        "spec.accessModes",
        "spec.resources[storage]",
    ]


def test_an_autoscaler_reads_at_both_versions(api_client, namespace):
    v2 = client.AutoscalingV2Api(api_client)
    v2.create_namespaced_horizontal_pod_autoscaler(
        namespace,
        client.V2HorizontalPodAutoscaler(
            metadata=client.V1ObjectMeta(name="web"),
            spec=client.V2HorizontalPodAutoscalerSpec(
                scale_target_ref=client.V2CrossVersionObjectReference(
                    api_version="apps/v1", kind="StatefulSet", name="web"
                ),
                max_replicas=5,
                metrics=[
                    client.V2MetricSpec(
                        type="Resource",
                        resource=client.V2ResourceMetricSource(
                            name="cpu",
                            target=client.V2MetricTarget(type="Utilization", average_utilization=60),
                        ),
                    )
                ],
            ),
        ),
    )
    v1 = client.AutoscalingV1Api(api_client).read_namespaced_horizontal_pod_autoscaler("web", namespace)
    assert (v1.spec.min_replicas, v1.spec.max_replicas) == (1, 5)
    assert v1.spec.target_cpu_utilization_percentage == 60


def test_an_api_service_is_named_after_its_group_version(api_client):
    registration = client.ApiregistrationV1Api(api_client)
    service = client.V1APIService(
        metadata=client.V1ObjectMeta(name="metrics"),
        spec=client.V1APIServiceSpec(
            group="example.com",
            version="v1alpha1",
            group_priority_minimum=100,
            version_priority=100,
            insecure_skip_tls_verify=True,
            service=client.ApiregistrationV1ServiceReference(namespace="default", name="example"),
        ),
    )
    with pytest.raises(ApiException) as refused:
        registration.create_api_service(service)
    status = failure_status(refused.value, 422, "Invalid")
    assert status["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "message": 'Invalid value: "metrics": must be v1alpha1.example.com',
            "field": "metadata.name",
        }
    ], json.dumps(status)
