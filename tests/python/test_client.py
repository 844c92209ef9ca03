"""The official Python client (`kubernetes` on PyPI) against `trellis server`.

Every test asserts what Kubernetes' own API server answers. When Trellis answers
differently the test fails: the server is what gets fixed, not the test.

Watches from revisions the server no longer keeps (410 Gone), bookmarks and bad
input are in test_wire.py.
"""

import json
import threading
import time

import pytest
from kubernetes import client, watch
from kubernetes.client import ApiException

from conftest import ADMIN_TOKEN, BOB_TOKEN, names, raw_json

CRD_GROUP = "example.com"
CRD_VERSION = "v1"
CRD_PLURAL = "widgets"


# ---- helpers ---------------------------------------------------------------


def config_map(name, data=None, labels=None):
    return client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        data=data,
    )


def status_of(error: ApiException) -> dict:
    """The `Status` object in an error's body."""
    assert error.body, f"HTTP {error.status} without a body"
    status = json.loads(error.body)
    assert status.get("kind") == "Status", status
    assert status.get("apiVersion") == "v1", status
    assert status.get("status") == "Failure", status
    assert status.get("code") == error.status, status
    return status


def wait_for(predicate, timeout=5.0, interval=0.05):
    """Calls `predicate` until it returns something truthy; returns that."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(interval)


def deployment(name, labels, image="nginx:1.27"):
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1DeploymentSpec(
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(containers=[client.V1Container(name="web", image=image)]),
            ),
        ),
    )


# ---- CRUD ------------------------------------------------------------------


def test_config_maps_are_created_read_replaced_patched_and_deleted(api_client, namespace):
    v1 = client.CoreV1Api(api_client)

    created = v1.create_namespaced_config_map(namespace, config_map("settings", {"color": "blue"}))
    assert created.metadata.name == "settings"
    assert created.metadata.namespace == namespace
    assert created.metadata.uid
    assert created.metadata.resource_version
    assert created.metadata.creation_timestamp is not None
    assert created.data == {"color": "blue"}

    read = v1.read_namespaced_config_map("settings", namespace)
    assert read.metadata.uid == created.metadata.uid
    assert read.metadata.resource_version == created.metadata.resource_version
    assert read.data == {"color": "blue"}

    read.data = {"color": "green", "size": "L"}
    replaced = v1.replace_namespaced_config_map("settings", namespace, read)
    assert replaced.data == {"color": "green", "size": "L"}
    assert replaced.metadata.uid == created.metadata.uid
    assert int(replaced.metadata.resource_version) > int(created.metadata.resource_version)

    # A dict body goes as a strategic merge patch, a list as a JSON patch.
    merged = v1.patch_namespaced_config_map(
        "settings", namespace, {"metadata": {"labels": {"tier": "web"}}, "data": {"size": None}}
    )
    assert merged.data == {"color": "green"}
    assert merged.metadata.labels == {"tier": "web"}
    patched = v1.patch_namespaced_config_map(
        "settings", namespace, [{"op": "add", "path": "/data/shape", "value": "round"}]
    )
    assert patched.data == {"color": "green", "shape": "round"}
    assert int(patched.metadata.resource_version) > int(merged.metadata.resource_version)

    v1.delete_namespaced_config_map("settings", namespace)
    with pytest.raises(ApiException) as error:
        v1.read_namespaced_config_map("settings", namespace)
    assert error.value.status == 404
    assert status_of(error.value)["reason"] == "NotFound"


APPLY = "application/apply-patch+yaml"


def test_server_side_apply_needs_a_field_manager_and_reports_conflicts(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "applied"},
        "data": {"color": "blue"},
    }
    with pytest.raises(ApiException) as missing:
        v1.patch_namespaced_config_map("applied", namespace, body, _content_type=APPLY)
    assert missing.value.status == 422
    status = status_of(missing.value)
    assert status["reason"] == "Invalid"
    assert status["message"] == (
        'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: '
        "is required for apply patch"
    )

    created = v1.patch_namespaced_config_map(
        "applied", namespace, body, field_manager="alice", _content_type=APPLY
    )
    assert created.data == {"color": "blue"}
    assert [(e.manager, e.operation) for e in created.metadata.managed_fields] == [("alice", "Apply")]
    assert created.metadata.managed_fields[0].fields_v1 == {"f:data": {"f:color": {}}}

    body["data"]["color"] = "red"
    with pytest.raises(ApiException) as conflict:
        v1.patch_namespaced_config_map(
            "applied", namespace, body, field_manager="bob", _content_type=APPLY
        )
    assert conflict.value.status == 409
    status = status_of(conflict.value)
    assert status["reason"] == "Conflict"
    assert status["message"] == 'Apply failed with 1 conflict: conflict with "alice": .data.color'
    assert status["details"]["causes"] == [
        {"reason": "FieldManagerConflict", "message": 'conflict with "alice"', "field": ".data.color"}
    ]

    forced = v1.patch_namespaced_config_map(
        "applied", namespace, body, field_manager="bob", force=True, _content_type=APPLY
    )
    assert forced.data == {"color": "red"}
    assert [e.manager for e in forced.metadata.managed_fields] == ["bob"]


def test_writes_without_a_field_manager_are_named_by_the_user_agent(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    created = v1.create_namespaced_config_map(namespace, config_map("agent", {"a": "b"}))
    # kube-apiserver names the manager by the User-Agent up to its first "/".
    agent = api_client.user_agent.split("/")[0]
    assert [(e.manager, e.operation) for e in created.metadata.managed_fields] == [(agent, "Update")]
    with pytest.raises(ApiException) as error:
        v1.patch_namespaced_config_map("agent", namespace, {"data": {"a": "c"}}, force=True)
    assert error.value.status == 422
    assert status_of(error.value)["details"]["causes"][0]["field"] == "force"


def test_an_empty_list_has_an_empty_items_array(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    raw = raw_json(v1.list_namespaced_config_map(namespace, _preload_content=False))
    assert raw["kind"] == "ConfigMapList"
    assert raw["apiVersion"] == "v1"
    assert raw["items"] == []
    assert raw["metadata"]["resourceVersion"]
    assert v1.list_namespaced_config_map(namespace).items == []


def test_a_deployment_is_read_back_with_kubernetes_defaults(api_client, namespace):
    apps = client.AppsV1Api(api_client)
    labels = {"app": "web"}
    created = apps.create_namespaced_deployment(namespace, deployment("web", labels))
    assert created.metadata.generation == 1

    read = apps.read_namespaced_deployment("web", namespace)
    spec = read.spec
    assert spec.replicas == 1
    assert spec.strategy.type == "RollingUpdate"
    assert spec.strategy.rolling_update.max_surge == "25%"
    assert spec.strategy.rolling_update.max_unavailable == "25%"
    assert spec.revision_history_limit == 10
    assert spec.progress_deadline_seconds == 600
    assert spec.selector.match_labels == labels
    pod = spec.template.spec
    assert pod.restart_policy == "Always"
    assert pod.dns_policy == "ClusterFirst"
    assert pod.termination_grace_period_seconds == 30
    assert pod.scheduler_name == "default-scheduler"
    container = pod.containers[0]
    assert container.image == "nginx:1.27"
    assert container.image_pull_policy == "IfNotPresent"
    assert container.termination_message_path == "/dev/termination-log"
    assert container.termination_message_policy == "File"

    read.spec.replicas = 3
    replaced = apps.replace_namespaced_deployment("web", namespace, read)
    assert replaced.spec.replicas == 3
    assert replaced.metadata.generation == 2

    # Strategic merge on the container list, keyed by name.
    patched = apps.patch_namespaced_deployment(
        "web",
        namespace,
        {"spec": {"template": {"spec": {"containers": [{"name": "web", "image": "nginx:1.28"}]}}}},
    )
    assert [(c.name, c.image) for c in patched.spec.template.spec.containers] == [("web", "nginx:1.28")]
    assert patched.metadata.generation == 3

    # Metadata alone is not a spec change.
    relabelled = apps.patch_namespaced_deployment("web", namespace, {"metadata": {"labels": {"team": "a"}}})
    assert relabelled.metadata.labels == {"team": "a"}
    assert relabelled.metadata.generation == 3

    apps.delete_namespaced_deployment("web", namespace)
    with pytest.raises(ApiException) as error:
        apps.read_namespaced_deployment("web", namespace)
    assert error.value.status == 404


def test_replacing_with_a_stale_resource_version_is_a_conflict(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    v1.create_namespaced_config_map(namespace, config_map("contested", {"n": "0"}))
    stale = v1.read_namespaced_config_map("contested", namespace)

    fresh = v1.read_namespaced_config_map("contested", namespace)
    fresh.data = {"n": "1"}
    v1.replace_namespaced_config_map("contested", namespace, fresh)

    stale.data = {"n": "2"}
    with pytest.raises(ApiException) as error:
        v1.replace_namespaced_config_map("contested", namespace, stale)
    assert error.value.status == 409
    assert error.value.reason == "Conflict"
    status = status_of(error.value)
    assert status["reason"] == "Conflict"
    assert status["details"]["name"] == "contested"
    assert status["details"]["kind"] == "configmaps"
    assert status["message"] == (
        'Operation cannot be fulfilled on configmaps "contested": '
        "the object has been modified; please apply your changes to the latest version and try again"
    )
    assert v1.read_namespaced_config_map("contested", namespace).data == {"n": "1"}


# ---- lists -----------------------------------------------------------------


def test_lists_filter_by_label_and_field_selectors(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    for name, labels in {
        "a": {"env": "prod", "tier": "web"},
        "b": {"env": "dev", "tier": "web"},
        "c": {"env": "prod"},
        "d": {"env": "test", "tier": "db"},
        "e": None,
    }.items():
        v1.create_namespaced_config_map(namespace, config_map(name, labels=labels))

    def listed(**selectors):
        return names(v1.list_namespaced_config_map(namespace, **selectors).items)

    assert listed() == ["a", "b", "c", "d", "e"]
    assert listed(label_selector="env=prod") == ["a", "c"]
    assert listed(label_selector="env==prod") == ["a", "c"]
    assert listed(label_selector="env!=prod") == ["b", "d", "e"]
    assert listed(label_selector="env in (dev,test)") == ["b", "d"]
    assert listed(label_selector="env notin (prod,dev)") == ["d", "e"]
    assert listed(label_selector="tier") == ["a", "b", "d"]
    assert listed(label_selector="!tier") == ["c", "e"]
    assert listed(label_selector="env=prod,tier=web") == ["a"]
    assert listed(label_selector="env=staging") == []
    assert listed(field_selector="metadata.name=c") == ["c"]
    assert listed(field_selector="metadata.name!=c") == ["a", "b", "d", "e"]
    assert listed(label_selector="env=prod", field_selector="metadata.name=a") == ["a"]

    raw = raw_json(
        v1.list_namespaced_config_map(namespace, label_selector="env=staging", _preload_content=False)
    )
    assert raw["items"] == []

    with pytest.raises(ApiException) as error:
        v1.list_namespaced_config_map(namespace, field_selector="data.color=blue")
    assert error.value.status == 400
    assert status_of(error.value)["reason"] == "BadRequest"


def test_pagination_visits_every_object_once_from_one_snapshot(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    expected = [f"cm-{i}" for i in range(7)]
    for name in expected:
        v1.create_namespaced_config_map(namespace, config_map(name))

    first = v1.list_namespaced_config_map(namespace, limit=2)
    snapshot = first.metadata.resource_version
    assert len(first.items) == 2
    assert first.metadata._continue

    # Changes after the first page are not seen by the rest of the pages.
    v1.delete_namespaced_config_map("cm-6", namespace)
    v1.create_namespaced_config_map(namespace, config_map("cm-7"))

    seen = [item.metadata.name for item in first.items]
    pages = [first]
    token = first.metadata._continue
    while token:
        page = v1.list_namespaced_config_map(namespace, limit=2, _continue=token)
        assert page.metadata.resource_version == snapshot
        assert len(page.items) <= 2
        seen += [item.metadata.name for item in page.items]
        pages.append(page)
        token = page.metadata._continue
        assert len(pages) <= 4, "more pages than 7 objects need"

    assert seen == expected
    assert [len(p.items) for p in pages] == [2, 2, 2, 1]

    current = names(v1.list_namespaced_config_map(namespace).items)
    assert current == [f"cm-{i}" for i in range(6)] + ["cm-7"]


def test_a_page_counts_the_items_that_remain(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    for i in range(5):
        v1.create_namespaced_config_map(namespace, config_map(f"cm-{i}", labels={"n": str(i)}))

    first = v1.list_namespaced_config_map(namespace, limit=2)
    assert first.metadata.remaining_item_count == 3
    second = v1.list_namespaced_config_map(namespace, limit=2, _continue=first.metadata._continue)
    assert second.metadata.remaining_item_count == 1
    last = v1.list_namespaced_config_map(namespace, limit=2, _continue=second.metadata._continue)
    assert len(last.items) == 1
    assert last.metadata._continue is None
    assert last.metadata.remaining_item_count is None
    # With a selector the count is unknown, and left out.
    selected = v1.list_namespaced_config_map(namespace, limit=2, label_selector="n")
    assert selected.metadata._continue
    assert selected.metadata.remaining_item_count is None


# ---- watches ---------------------------------------------------------------


def test_a_watch_without_resource_version_sends_existing_objects_then_changes(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    v1.create_namespaced_config_map(namespace, config_map("one", {"v": "1"}))
    v1.create_namespaced_config_map(namespace, config_map("two", {"v": "1"}))

    failures = []

    def change():
        try:
            v1.patch_namespaced_config_map("one", namespace, {"data": {"v": "2"}})
            v1.delete_namespaced_config_map("two", namespace)
            v1.create_namespaced_config_map(namespace, config_map("three"))
        except Exception as e:  # reported by the main thread
            failures.append(e)

    changer = threading.Thread(target=change)
    events = []
    w = watch.Watch()
    try:
        for event in w.stream(v1.list_namespaced_config_map, namespace, timeout_seconds=10):
            events.append((event["type"], event["object"].metadata.name))
            assert isinstance(event["object"], client.V1ConfigMap)
            if len(events) == 2:
                changer.start()
            if len(events) == 5:
                w.stop()
    finally:
        w.stop()
        if changer.is_alive():
            changer.join()

    assert not failures, f"changing the config maps failed: {failures}"
    assert sorted(events[:2]) == [("ADDED", "one"), ("ADDED", "two")]
    assert events[2:] == [("MODIFIED", "one"), ("DELETED", "two"), ("ADDED", "three")]


def test_a_watch_from_a_resource_version_returns_exactly_the_later_events(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    v1.create_namespaced_config_map(namespace, config_map("before"))
    start = v1.create_namespaced_config_map(namespace, config_map("x", {"v": "1"})).metadata.resource_version
    modified = v1.patch_namespaced_config_map("x", namespace, {"data": {"v": "2"}})
    v1.create_namespaced_config_map(namespace, config_map("y"))
    v1.delete_namespaced_config_map("x", namespace)

    # With timeout_seconds the client does not reconnect: the stream ends when the
    # server closes it, so the list holds everything the server sent.
    started = time.monotonic()
    events = [
        (event["type"], event["object"].metadata.name, event["object"].data)
        for event in watch.Watch().stream(
            v1.list_namespaced_config_map, namespace, resource_version=start, timeout_seconds=1
        )
    ]
    assert time.monotonic() - started < 5
    assert events == [
        ("MODIFIED", "x", {"v": "2"}),
        ("ADDED", "y", None),
        ("DELETED", "x", {"v": "2"}),
    ]

    after_modify = [
        (event["type"], event["object"].metadata.name)
        for event in watch.Watch().stream(
            v1.list_namespaced_config_map,
            namespace,
            resource_version=modified.metadata.resource_version,
            timeout_seconds=1,
        )
    ]
    assert after_modify == [("ADDED", "y"), ("DELETED", "x")]


def test_a_watch_with_a_label_selector_sees_objects_leave_the_selection(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    start = v1.create_namespaced_config_map(
        namespace, config_map("m", labels={"pick": "yes"})
    ).metadata.resource_version
    v1.create_namespaced_config_map(namespace, config_map("other", labels={"pick": "no"}))
    v1.patch_namespaced_config_map("m", namespace, {"metadata": {"labels": {"pick": "no"}}})
    v1.patch_namespaced_config_map("other", namespace, {"metadata": {"labels": {"pick": "yes"}}})

    events = [
        (event["type"], event["object"].metadata.name)
        for event in watch.Watch().stream(
            v1.list_namespaced_config_map,
            namespace,
            label_selector="pick=yes",
            resource_version=start,
            timeout_seconds=1,
        )
    ]
    assert events == [("DELETED", "m"), ("ADDED", "other")]


# ---- custom resources ------------------------------------------------------


def widget_crd():
    schema = client.V1JSONSchemaProps(
        type="object",
        properties={
            "spec": client.V1JSONSchemaProps(
                type="object",
                required=["size"],
                properties={
                    "size": client.V1JSONSchemaProps(type="integer", minimum=1, maximum=10),
                    "color": client.V1JSONSchemaProps(type="string", enum=["red", "blue"]),
                },
            ),
        },
    )
    return client.V1CustomResourceDefinition(
        metadata=client.V1ObjectMeta(name=f"{CRD_PLURAL}.{CRD_GROUP}"),
        spec=client.V1CustomResourceDefinitionSpec(
            group=CRD_GROUP,
            scope="Namespaced",
            names=client.V1CustomResourceDefinitionNames(
                plural=CRD_PLURAL, singular="widget", kind="Widget", list_kind="WidgetList"
            ),
            versions=[
                client.V1CustomResourceDefinitionVersion(
                    name=CRD_VERSION,
                    served=True,
                    storage=True,
                    schema=client.V1CustomResourceValidation(open_apiv3_schema=schema),
                )
            ],
        ),
    )


@pytest.fixture(scope="module")
def widgets(api_client):
    """The `widgets.example.com` CRD, created once for the module."""
    ext = client.ApiextensionsV1Api(api_client)
    created = ext.create_custom_resource_definition(widget_crd())
    yield created
    try:
        ext.delete_custom_resource_definition(created.metadata.name)
    except ApiException:
        pass


def widget(name, size, **spec):
    return {
        "apiVersion": f"{CRD_GROUP}/{CRD_VERSION}",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"size": size, **spec},
    }


def test_a_custom_resource_definition_becomes_established(api_client, widgets):
    ext = client.ApiextensionsV1Api(api_client)

    def established():
        crd = ext.read_custom_resource_definition(widgets.metadata.name)
        conditions = {c.type: c.status for c in (crd.status.conditions or [])} if crd.status else {}
        return crd if conditions.get("Established") == "True" else None

    crd = wait_for(established)
    assert crd is not None, "the CRD has no Established=True condition"
    conditions = {c.type: c.status for c in crd.status.conditions}
    assert conditions["NamesAccepted"] == "True"
    assert crd.status.accepted_names.kind == "Widget"
    assert crd.status.accepted_names.plural == CRD_PLURAL
    assert crd.status.stored_versions == [CRD_VERSION]


def test_custom_objects_are_created_listed_read_and_patched(api_client, widgets, namespace):
    custom = client.CustomObjectsApi(api_client)

    def served():
        try:
            return custom.list_namespaced_custom_object(CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    empty = wait_for(served)
    assert empty is not None, "custom resources are not served"
    assert empty["kind"] == "WidgetList"
    assert empty["items"] == []

    created = custom.create_namespaced_custom_object(
        CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL, widget("w1", 3, color="red", unknown="dropped")
    )
    assert created["kind"] == "Widget"
    assert created["metadata"]["namespace"] == namespace
    assert created["metadata"]["uid"]
    assert created["metadata"]["generation"] == 1
    assert created["spec"] == {"size": 3, "color": "red"}, "fields outside the schema are pruned"
    custom.create_namespaced_custom_object(CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL, widget("w2", 7))

    listed = custom.list_namespaced_custom_object(CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL)
    assert listed["apiVersion"] == f"{CRD_GROUP}/{CRD_VERSION}"
    assert sorted(item["metadata"]["name"] for item in listed["items"]) == ["w1", "w2"]
    small = custom.list_namespaced_custom_object(
        CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL, field_selector="metadata.name=w1"
    )
    assert [item["metadata"]["name"] for item in small["items"]] == ["w1"]

    got = custom.get_namespaced_custom_object(CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL, "w1")
    assert got["metadata"]["uid"] == created["metadata"]["uid"]
    assert got["spec"] == {"size": 3, "color": "red"}

    patched = custom.patch_namespaced_custom_object(
        CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL, "w1", {"spec": {"size": 5}}
    )
    assert patched["spec"] == {"size": 5, "color": "red"}
    assert patched["metadata"]["generation"] == 2
    assert int(patched["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])

    custom.delete_namespaced_custom_object(CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL, "w2")
    with pytest.raises(ApiException) as error:
        custom.get_namespaced_custom_object(CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL, "w2")
    assert error.value.status == 404
    assert status_of(error.value)["details"] == {"name": "w2", "group": CRD_GROUP, "kind": CRD_PLURAL}


def invalid_widget(custom, namespace, body) -> dict:
    """Creates `body`, which must be refused as Invalid; returns the Status."""
    with pytest.raises(ApiException) as error:
        custom.create_namespaced_custom_object(CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL, body)
    assert error.value.status == 422
    status = status_of(error.value)
    assert status["reason"] == "Invalid"
    assert status["details"]["name"] == body["metadata"]["name"]
    assert status["details"]["group"] == CRD_GROUP
    assert status["details"]["kind"] == "Widget"
    return status


def test_a_custom_object_that_violates_its_schema_is_invalid(api_client, widgets, namespace):
    custom = client.CustomObjectsApi(api_client)
    assert wait_for(lambda: _served(custom, namespace)), "custom resources are not served"

    too_small = invalid_widget(custom, namespace, widget("tiny", 0))
    assert [c["field"] for c in too_small["details"]["causes"]] == ["spec.size"]
    unsupported = invalid_widget(custom, namespace, widget("green", 2, color="green"))
    assert [c["field"] for c in unsupported["details"]["causes"]] == ["spec.color"]

    custom.create_namespaced_custom_object(CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL, widget("ok", 1))
    with pytest.raises(ApiException) as error:
        custom.patch_namespaced_custom_object(
            CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL, "ok", {"spec": {"size": 11}}
        )
    assert error.value.status == 422
    assert status_of(error.value)["reason"] == "Invalid"
    got = custom.get_namespaced_custom_object(CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL, "ok")
    assert got["spec"] == {"size": 1}


def test_schema_violations_are_reported_in_kubernetes_words(api_client, widgets, namespace):
    """The causes and message kubectl prints, as kube-openapi's validator words them."""
    custom = client.CustomObjectsApi(api_client)
    assert wait_for(lambda: _served(custom, namespace)), "custom resources are not served"

    too_small = invalid_widget(custom, namespace, widget("tiny", 0))
    unsupported = invalid_widget(custom, namespace, widget("green", 2, color="green"))
    missing = invalid_widget(custom, namespace, {**widget("sizeless", 1), "spec": {}})

    causes = [
        (c["reason"], c["field"], c["message"])
        for status in (too_small, unsupported, missing)
        for c in status["details"]["causes"]
    ]
    assert causes == [
        ("FieldValueInvalid", "spec.size", "Invalid value: 0: spec.size in body should be greater than or equal to 1"),
        ("FieldValueNotSupported", "spec.color", 'Unsupported value: "green": supported values: "red", "blue"'),
        ("FieldValueRequired", "spec.size", "Required value"),
    ]
    assert too_small["message"] == (
        'Widget.example.com "tiny" is invalid: spec.size: Invalid value: 0: '
        "spec.size in body should be greater than or equal to 1"
    )


def _served(custom, namespace):
    try:
        custom.list_namespaced_custom_object(CRD_GROUP, CRD_VERSION, namespace, CRD_PLURAL)
        return True
    except ApiException:
        return False


# ---- authentication and authorization --------------------------------------


def test_a_wrong_bearer_token_is_unauthorized(bearer_client):
    v1 = client.CoreV1Api(bearer_client("not-a-token"))
    with pytest.raises(ApiException) as error:
        v1.list_namespaced_pod("default")
    assert error.value.status == 401
    status = status_of(error.value)
    assert status["reason"] == "Unauthorized"
    assert status["message"] == "Unauthorized"


def test_the_admin_token_from_tokens_csv_is_a_cluster_admin(bearer_client):
    v1 = client.CoreV1Api(bearer_client(ADMIN_TOKEN))
    namespaces = names(v1.list_namespace().items)
    assert {"default", "kube-system", "kube-public", "kube-node-lease"} <= set(namespaces)


def test_bob_is_forbidden_until_a_role_binding_lets_him_edit_default(api_client, bearer_client):
    bob = client.CoreV1Api(bearer_client(BOB_TOKEN))
    rbac = client.RbacAuthorizationV1Api(api_client)

    with pytest.raises(ApiException) as error:
        bob.list_namespaced_pod("default")
    assert error.value.status == 403
    status = status_of(error.value)
    assert status["reason"] == "Forbidden"
    assert status["message"] == (
        'pods is forbidden: User "bob" cannot list resource "pods" in API group "" in the namespace "default"'
    )
    assert status["details"]["kind"] == "pods"

    binding = client.V1RoleBinding(
        metadata=client.V1ObjectMeta(name="bob-edit"),
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name="edit"),
        subjects=[client.RbacV1Subject(kind="User", name="bob", api_group="rbac.authorization.k8s.io")],
    )
    rbac.create_namespaced_role_binding("default", binding)
    try:

        def allowed():
            try:
                return bob.list_namespaced_pod("default")
            except ApiException as e:
                if e.status == 403:
                    return None
                raise

        pods = wait_for(allowed)
        assert pods is not None, "bob is still forbidden after the RoleBinding"
        assert isinstance(pods.items, list)

        created = bob.create_namespaced_config_map("default", config_map("bobs", {"by": "bob"}))
        assert created.metadata.name == "bobs"
        bob.delete_namespaced_config_map("bobs", "default")

        with pytest.raises(ApiException) as error:
            bob.list_namespaced_pod("kube-system")
        assert error.value.status == 403
        assert status_of(error.value)["message"] == (
            'pods is forbidden: User "bob" cannot list resource "pods" in API group "" '
            'in the namespace "kube-system"'
        )

        with pytest.raises(ApiException) as error:
            bob.list_pod_for_all_namespaces()
        assert error.value.status == 403
        assert status_of(error.value)["message"] == (
            'pods is forbidden: User "bob" cannot list resource "pods" in API group "" at the cluster scope'
        )
    finally:
        rbac.delete_namespaced_role_binding("bob-edit", "default")

    def forbidden_again():
        try:
            bob.list_namespaced_pod("default")
            return False
        except ApiException as e:
            return e.status == 403

    assert wait_for(forbidden_again), "bob can still list pods after the RoleBinding is deleted"


# ---- errors ----------------------------------------------------------------


def test_errors_are_status_objects_with_reason_and_code(api_client, namespace):
    v1 = client.CoreV1Api(api_client)

    with pytest.raises(ApiException) as error:
        v1.read_namespaced_config_map("missing", namespace)
    assert error.value.status == 404
    status = status_of(error.value)
    assert status["reason"] == "NotFound"
    assert status["message"] == 'configmaps "missing" not found'
    assert status["details"] == {"name": "missing", "kind": "configmaps"}

    v1.create_namespaced_config_map(namespace, config_map("twice"))
    with pytest.raises(ApiException) as error:
        v1.create_namespaced_config_map(namespace, config_map("twice"))
    assert error.value.status == 409
    status = status_of(error.value)
    assert status["reason"] == "AlreadyExists"
    assert status["message"] == 'configmaps "twice" already exists'

    with pytest.raises(ApiException) as error:
        v1.create_namespaced_config_map(namespace, config_map("Not_A_Name"))
    assert error.value.status == 422
    status = status_of(error.value)
    assert status["reason"] == "Invalid"
    assert status["details"]["name"] == "Not_A_Name"
    assert status["details"]["kind"] == "ConfigMap"
    assert [(c["reason"], c["field"]) for c in status["details"]["causes"]] == [
        ("FieldValueInvalid", "metadata.name")
    ]

    with pytest.raises(ApiException) as error:
        v1.create_namespaced_config_map("no-such-namespace", config_map("orphan"))
    assert error.value.status == 404
    status = status_of(error.value)
    assert status["reason"] == "NotFound"
    assert status["message"] == 'namespaces "no-such-namespace" not found'

    # An unknown resource: Kubernetes answers with a 404 Status too.
    response = api_client.call_api(
        "GET", f"{api_client.configuration.host}/api/v1/namespaces/{namespace}/nosuchthings"
    )
    response.read()
    assert response.status == 404
    status = json.loads(response.data)
    assert status["kind"] == "Status"
    assert status["code"] == 404
    assert status["reason"] == "NotFound"


def test_invalid_objects_are_described_in_kubernetes_words(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    apps = client.AppsV1Api(api_client)

    with pytest.raises(ApiException) as error:
        v1.create_namespaced_config_map(namespace, config_map("Not_A_Name"))
    status = status_of(error.value)
    rfc1123 = (
        'Invalid value: "Not_A_Name": a lowercase RFC 1123 subdomain must consist of lower case '
        "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
    )
    assert status["details"]["causes"][0]["message"].startswith(rfc1123)
    assert status["message"].startswith(f'ConfigMap "Not_A_Name" is invalid: metadata.name: {rfc1123}')

    # Kinds outside the core group are qualified with their group.
    mismatched = deployment("mismatched", {"app": "web"})
    mismatched.spec.template.metadata.labels = {"app": "other"}
    with pytest.raises(ApiException) as error:
        apps.create_namespaced_deployment(namespace, mismatched)
    assert error.value.status == 422
    status = status_of(error.value)
    assert status["reason"] == "Invalid"
    assert status["details"]["group"] == "apps"
    assert status["details"]["kind"] == "Deployment"
    assert status["details"]["name"] == "mismatched"
    assert "spec.template.metadata.labels" in [c["field"] for c in status["details"]["causes"]]
    assert status["message"].startswith(
        'Deployment.apps "mismatched" is invalid: spec.template.metadata.labels: Invalid value: '
    )
    assert status["message"].endswith("`selector` does not match template `labels`")
