"""What `trellis server` answers on the wire: bad input, deletecollection, watches
from revisions the server no longer keeps, bookmarks and field selectors.

Requests go through the official Python client where it can express them, else as
plain HTTPS requests on the client's own connection pool (its admin client
certificate and the cluster CA): a body with no Content-Type, malformed JSON or
YAML, a body type the client would not send.

Every test asserts what Kubernetes' own API server answers, with one difference
on purpose: a watch from a revision older than the watch cache's ring is served from
the store's history (as kube-apiserver serves it with its watch cache off), so only
a compacted revision is 410 Gone.
"""

import json
import time
import uuid

import pytest
from kubernetes import client, watch
from kubernetes.client import ApiException

from conftest import Raw, check_status, names, own_server, raw_json
from conftest import failure_status as status_of

# The server's body limit: the store's value limit (kube-apiserver's is 3 MiB, over
# etcd's 1.5 MiB; a larger body could only be refused after admission had run).
MAX_BODY = 1536 * 1024
# The ring of recent changes the session's server keeps for watches to resume from:
# `trellis server --watch-cache-events`, whose default the session fixture uses.
WATCH_CACHE_EVENTS = 2048


# ---- helpers ---------------------------------------------------------------


def config_map(name, data=None, labels=None, finalizers=None):
    return client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=name, labels=labels, finalizers=finalizers),
        data=data,
    )


def raw_names(items: list[dict]) -> list[str]:
    return sorted(item["metadata"]["name"] for item in items)


def assert_not_stored(v1: client.CoreV1Api, namespace: str, name: str):
    with pytest.raises(ApiException) as error:
        v1.read_namespaced_config_map(name, namespace)
    status_of(error.value, 404, "NotFound")


def watch_lines(raw: Raw, path: str, until, max_seconds: float = 15.0) -> list[dict]:
    """The event lines of a watch, read as they arrive until `until(events)` holds or
    the server ends the stream."""
    response = raw.request("GET", path, preload_content=False)
    assert response.status == 200, response.data
    events, buffer = [], b""
    deadline = time.monotonic() + max_seconds
    try:
        for chunk in response.stream(64 * 1024):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            events += [json.loads(line) for line in lines if line.strip()]
            if until(events) or time.monotonic() > deadline:
                break
    finally:
        response.close()
        response.release_conn()
    return events


# ---- bad input ---------------------------------------------------------------


def test_a_body_over_the_store_limit_is_request_entity_too_large(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    big = config_map("big", {"blob": "x" * (MAX_BODY + 1)})
    with pytest.raises(ApiException) as error:
        v1.create_namespaced_config_map(namespace, big)
    status = status_of(error.value, 413, "RequestEntityTooLarge")
    assert str(MAX_BODY) in status["message"], status
    assert_not_stored(v1, namespace, "big")


def test_a_name_over_253_characters_is_invalid(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    name = "a" * 254
    with pytest.raises(ApiException) as error:
        v1.create_namespaced_config_map(namespace, config_map(name))
    status = status_of(error.value, 422, "Invalid")
    assert status["details"]["name"] == name
    assert status["details"]["kind"] == "ConfigMap"
    causes = status["details"]["causes"]
    assert [(c["reason"], c["field"]) for c in causes] == [("FieldValueInvalid", "metadata.name")]
    assert "must be no more than 253 characters" in causes[0]["message"]
    assert status["message"].startswith(f'ConfigMap "{name}" is invalid: metadata.name: ')
    assert_not_stored(v1, namespace, name)


def test_an_unsupported_content_type_is_unsupported_media_type(api_client, namespace):
    raw = Raw(api_client)
    body = json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "csv"}})
    code, status = raw.json(
        "POST", f"/api/v1/namespaces/{namespace}/configmaps", body, {"Content-Type": "text/csv"}
    )
    assert code == 415
    check_status(status, 415, "UnsupportedMediaType")
    assert status["message"].startswith(
        "the body of the request was in an unknown format - accepted media types include: "
    ), status
    assert "application/json" in status["message"]
    assert_not_stored(client.CoreV1Api(api_client), namespace, "csv")


def test_malformed_json_is_a_bad_request(api_client, namespace):
    raw = Raw(api_client)
    code, status = raw.json(
        "POST",
        f"/api/v1/namespaces/{namespace}/configmaps",
        '{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "broken"',
        {"Content-Type": "application/json"},
    )
    assert code == 400
    check_status(status, 400, "BadRequest")
    assert "json" in status["message"].lower(), status
    assert_not_stored(client.CoreV1Api(api_client), namespace, "broken")


def test_malformed_yaml_is_a_bad_request(api_client, namespace):
    raw = Raw(api_client)
    body = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: broken\n  labels: [a\n"
    code, status = raw.json(
        "POST", f"/api/v1/namespaces/{namespace}/configmaps", body, {"Content-Type": "application/yaml"}
    )
    assert code == 400
    check_status(status, 400, "BadRequest")
    assert "yaml" in status["message"].lower(), status
    assert_not_stored(client.CoreV1Api(api_client), namespace, "broken")


def test_yaml_bodies_are_accepted_with_a_yaml_content_type(api_client, namespace):
    """The counterpart of the malformed YAML: the same document, well formed."""
    raw = Raw(api_client)
    body = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: fine\n  labels: {tier: web}\ndata:\n  color: blue\n"
    code, created = raw.json(
        "POST", f"/api/v1/namespaces/{namespace}/configmaps", body, {"Content-Type": "application/yaml"}
    )
    assert code == 201, created
    read = client.CoreV1Api(api_client).read_namespaced_config_map("fine", namespace)
    assert read.metadata.labels == {"tier": "web"}
    assert read.data == {"color": "blue"}


def test_a_body_of_another_api_version_is_a_bad_request(api_client, namespace):
    raw = Raw(api_client)
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "elsewhere"},
        "spec": {
            "selector": {"matchLabels": {"app": "x"}},
            "template": {
                "metadata": {"labels": {"app": "x"}},
                "spec": {"containers": [{"name": "c", "image": "nginx"}]},
            },
        },
    }
    code, status = raw.json(
        "POST", f"/api/v1/namespaces/{namespace}/configmaps", json.dumps(body),
        {"Content-Type": "application/json"},
    )
    assert code == 400
    check_status(status, 400, "BadRequest")
    assert status["message"] == (
        "the API version in the data (apps/v1) does not match the expected API version (v1)"
    )
    assert_not_stored(client.CoreV1Api(api_client), namespace, "elsewhere")


def test_a_body_of_another_kind_is_a_bad_request(api_client, namespace):
    raw = Raw(api_client)
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "secretive"}}
    code, status = raw.json(
        "POST", f"/api/v1/namespaces/{namespace}/configmaps", json.dumps(body),
        {"Content-Type": "application/json"},
    )
    assert code == 400
    check_status(status, 400, "BadRequest")
    # kube-apiserver: `Secret in version "v1" cannot be handled as a ConfigMap: …`.
    assert "Secret" in status["message"] and "ConfigMap" in status["message"], status
    assert_not_stored(client.CoreV1Api(api_client), namespace, "secretive")
    # Nor did it become a Secret.
    with pytest.raises(ApiException) as error:
        client.CoreV1Api(api_client).read_namespaced_secret("secretive", namespace)
    status_of(error.value, 404, "NotFound")


def test_patching_a_missing_object_is_not_found_and_creates_nothing(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    for patch in ({"data": {"a": "b"}}, [{"op": "add", "path": "/data", "value": {"a": "b"}}]):
        with pytest.raises(ApiException) as error:
            v1.patch_namespaced_config_map("nowhere", namespace, patch)
        status = status_of(error.value, 404, "NotFound")
        assert status["message"] == 'configmaps "nowhere" not found'
        assert status["details"] == {"name": "nowhere", "kind": "configmaps"}
    assert_not_stored(v1, namespace, "nowhere")


def test_a_post_without_content_type_is_read_as_json(api_client, namespace):
    raw = Raw(api_client)
    body = json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "plain"}, "data": {"a": "b"}})
    # urllib3 adds no Content-Type to a bare body.
    response = raw.request("POST", f"/api/v1/namespaces/{namespace}/configmaps", body=body.encode())
    assert response.status == 201, response.data
    created = json.loads(response.data)
    assert created["kind"] == "ConfigMap"
    assert created["metadata"]["uid"]
    read = client.CoreV1Api(api_client).read_namespaced_config_map("plain", namespace)
    assert read.data == {"a": "b"}
    assert read.metadata.uid == created["metadata"]["uid"]


# ---- deletecollection ----------------------------------------------------------


def test_deletecollection_deletes_exactly_the_selected_objects(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    for name, labels in {"a": {"batch": "1"}, "b": {"batch": "1"}, "c": {"batch": "2"}, "d": None}.items():
        v1.create_namespaced_config_map(namespace, config_map(name, labels=labels))

    rehearsed = raw_json(
        v1.delete_collection_namespaced_config_map(
            namespace, label_selector="batch=1", dry_run="All", _preload_content=False
        )
    )
    assert rehearsed["kind"] == "ConfigMapList"
    assert raw_names(rehearsed["items"]) == ["a", "b"]
    assert names(v1.list_namespaced_config_map(namespace).items) == ["a", "b", "c", "d"]

    deleted = raw_json(
        v1.delete_collection_namespaced_config_map(
            namespace, label_selector="batch=1", _preload_content=False
        )
    )
    assert deleted["kind"] == "ConfigMapList"
    assert deleted["apiVersion"] == "v1"
    assert raw_names(deleted["items"]) == ["a", "b"]
    assert names(v1.list_namespaced_config_map(namespace).items) == ["c", "d"]

    # A selector nothing matches deletes nothing.
    none = raw_json(
        v1.delete_collection_namespaced_config_map(
            namespace, label_selector="batch=3", _preload_content=False
        )
    )
    assert none["items"] == []
    assert names(v1.list_namespaced_config_map(namespace).items) == ["c", "d"]


def test_deletecollection_only_marks_an_object_with_finalizers(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    held = v1.create_namespaced_config_map(
        namespace, config_map("held", labels={"batch": "1"}, finalizers=["example.com/hold"])
    )
    v1.create_namespaced_config_map(namespace, config_map("free", labels={"batch": "1"}))

    # A dry run marks nothing.
    raw_json(v1.delete_collection_namespaced_config_map(
        namespace, label_selector="batch=1", dry_run="All", _preload_content=False
    ))
    assert v1.read_namespaced_config_map("held", namespace).metadata.deletion_timestamp is None

    deleted = raw_json(
        v1.delete_collection_namespaced_config_map(namespace, label_selector="batch=1", _preload_content=False)
    )
    assert raw_names(deleted["items"]) == ["free", "held"]
    assert_not_stored(v1, namespace, "free")

    marked = v1.read_namespaced_config_map("held", namespace)
    assert marked.metadata.deletion_timestamp is not None
    assert marked.metadata.finalizers == ["example.com/hold"]
    assert marked.metadata.uid == held.metadata.uid
    assert names(v1.list_namespaced_config_map(namespace, label_selector="batch=1").items) == ["held"]

    v1.patch_namespaced_config_map("held", namespace, [{"op": "remove", "path": "/metadata/finalizers"}])
    assert_not_stored(v1, namespace, "held")
    assert v1.list_namespaced_config_map(namespace).items == []


# ---- watches from revisions the server no longer keeps --------------------------


@pytest.fixture(scope="module")
def evicted(api_client):
    """A namespace whose one ConfigMap changed more often than the session server's
    watch cache holds changes: its creation has fallen out of the cache's ring.
    Yields (namespace, the creation's resourceVersion, the updates' resourceVersions)."""
    v1 = client.CoreV1Api(api_client)
    namespace = f"evicted-{uuid.uuid4().hex[:6]}"
    v1.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    created = v1.create_namespaced_config_map(namespace, config_map("churn", {"n": "start"}))
    raw = Raw(api_client)
    path = f"/api/v1/namespaces/{namespace}/configmaps/churn"
    versions, failures = [], []
    for n in range(WATCH_CACHE_EVENTS + 100):
        response = raw.request(
            "PATCH", path, body=json.dumps({"data": {"n": str(n)}}),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        if response.status != 200:
            failures.append((n, response.status, response.data[:200]))
            break
        versions.append(json.loads(response.data)["metadata"]["resourceVersion"])
    assert not failures, failures
    yield namespace, created.metadata.resource_version, versions
    try:
        v1.delete_namespace(namespace)
    except ApiException:
        pass


def test_a_watch_resumed_past_the_watch_cache_gets_every_later_change(api_client, evicted):
    """A revision only seconds old is still served, in order and complete: kube-apiserver's
    watch cache grows to hold at least 75 s of changes (up to 102,400 of them); Trellis
    replays from the store what its ring of 2,048 no longer holds."""
    namespace, created, versions = evicted
    raw = Raw(api_client)
    started = time.monotonic()
    events = watch_lines(
        raw,
        f"/api/v1/namespaces/{namespace}/configmaps?watch=1&resourceVersion={created}&timeoutSeconds=15",
        until=lambda events: len(events) >= len(versions) or any(e["type"] != "MODIFIED" for e in events),
    )
    assert time.monotonic() - started < 15
    assert [e["type"] for e in events] == ["MODIFIED"] * len(versions)
    assert [e["object"]["data"]["n"] for e in events] == [str(n) for n in range(len(versions))]
    assert [e["object"]["metadata"]["resourceVersion"] for e in events] == versions


@pytest.fixture(scope="module")
def compacting():
    """A server of its own that keeps no history: `--history-window 0` compacts the
    store as it starts, and `--watch-cache-events 8` leaves the bootstrap's early
    revisions out of the watch cache. Yields an admin `ApiClient`."""
    with own_server(
        "trellis-py-compacting-", "--history-window", "0", "--watch-cache-events", "8"
    ) as (api, _):
        v1 = client.CoreV1Api(api)
        # The compactor's first pass runs as the server starts: wait until it has.
        deadline = time.monotonic() + 5
        while True:
            try:
                v1.list_namespaced_config_map("default", resource_version="1", resource_version_match="Exact")
            except ApiException as e:
                if e.status == 410:
                    break
                raise
            assert time.monotonic() < deadline, "the store was not compacted within 5 s"
            time.sleep(0.05)
        yield api


def test_a_list_at_a_compacted_resource_version_is_expired(compacting):
    v1 = client.CoreV1Api(compacting)
    with pytest.raises(ApiException) as error:
        v1.list_namespaced_config_map("default", resource_version="1", resource_version_match="Exact")
    status = status_of(error.value, 410, "Expired")
    assert "too old" in status["message"], status
    # The latest state is still there to list.
    assert v1.list_namespaced_config_map("default").metadata.resource_version


def test_a_watch_from_a_compacted_resource_version_ends_with_410(compacting):
    v1 = client.CoreV1Api(compacting)
    started = time.monotonic()
    w = watch.Watch()
    with pytest.raises(ApiException) as error:
        for event in w.stream(
            v1.list_namespaced_config_map, "default", resource_version="1", timeout_seconds=10
        ):
            w.stop()
            pytest.fail(f"a watch from a compacted resourceVersion sent {event['type']}")
    assert error.value.status == 410
    assert error.value.reason.startswith("Expired: too old resource version"), error.value.reason
    assert time.monotonic() - started < 5, "the watch ran on instead of ending with the error"

    # On the wire: an HTTP 410 Status, or (as kube-apiserver once the watch is
    # accepted) one ERROR event whose object is the Status, and then the end.
    response = Raw(compacting).request(
        "GET", "/api/v1/namespaces/default/configmaps?watch=1&resourceVersion=1&timeoutSeconds=10"
    )
    if response.status == 410:
        check_status(json.loads(response.data), 410, "Expired")
    else:
        assert response.status == 200
        lines = [json.loads(line) for line in response.data.splitlines() if line.strip()]
        assert [line["type"] for line in lines] == ["ERROR"], lines
        check_status(lines[0]["object"], 410, "Expired")


def test_a_watch_gone_names_the_resource_version_asked_for(compacting):
    response = Raw(compacting).request(
        "GET", "/api/v1/namespaces/default/configmaps?watch=1&resourceVersion=1&timeoutSeconds=10"
    )
    body = response.data
    status = json.loads(body) if response.status == 410 else json.loads(body.splitlines()[0])["object"]
    # kube-apiserver's watch cache: "too old resource version: %d (%d)", requested and oldest.
    assert status["message"].startswith("too old resource version: 1 ("), status


# ---- bookmarks ----------------------------------------------------------------


def check_bookmark(obj: dict, not_before: str):
    """A BOOKMARK's object: the watched kind with nothing but a resourceVersion."""
    assert obj["kind"] == "ConfigMap", obj
    assert obj["apiVersion"] == "v1", obj
    assert set(obj) <= {"kind", "apiVersion", "metadata"}, obj
    metadata = {k: v for k, v in obj["metadata"].items() if v is not None}
    # kube-apiserver may mark the end of initial events with an annotation.
    annotations = metadata.pop("annotations", {})
    assert set(annotations) <= {"k8s.io/initial-events-end"}, obj
    assert set(metadata) == {"resourceVersion"}, obj
    assert int(metadata["resourceVersion"]) >= int(not_before), obj


def test_a_watch_allowing_bookmarks_gets_one_before_its_timeout(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    start = v1.list_namespaced_config_map(namespace).metadata.resource_version
    v1.create_namespaced_config_map(namespace, config_map("seen"))
    # A change elsewhere moves the resource's revision past the last event this watch sees.
    other = v1.create_namespaced_config_map("default", config_map(f"bookmark-{uuid.uuid4().hex[:6]}"))
    try:
        started = time.monotonic()
        events = [
            (event["type"], event["object"])
            for event in watch.Watch().stream(
                v1.list_namespaced_config_map, namespace, resource_version=start,
                allow_watch_bookmarks=True, timeout_seconds=5, deserialize=False,
            )
        ]
        elapsed = time.monotonic() - started
    finally:
        v1.delete_namespaced_config_map(other.metadata.name, "default")
    types = [t for t, _ in events]
    assert types[0] == "ADDED" and events[0][1]["metadata"]["name"] == "seen", types
    bookmarks = [obj for t, obj in events if t == "BOOKMARK"]
    assert bookmarks, f"no BOOKMARK in a 5 s watch that allows them ({elapsed:.1f} s): {types}"
    for bookmark in bookmarks:
        check_bookmark(bookmark, other.metadata.resource_version)
    assert types.index("BOOKMARK") > 0


def test_a_watch_allowing_bookmarks_sends_its_changes_and_ends_at_its_timeout(api_client, namespace):
    """Asking for bookmarks changes nothing else: the changes come, the watch ends at
    its timeout, and any bookmark is well formed."""
    v1 = client.CoreV1Api(api_client)
    start = v1.list_namespaced_config_map(namespace).metadata.resource_version
    created = v1.create_namespaced_config_map(namespace, config_map("seen", {"v": "1"}))
    v1.patch_namespaced_config_map("seen", namespace, {"data": {"v": "2"}})
    started = time.monotonic()
    events = [
        (event["type"], event["object"])
        for event in watch.Watch().stream(
            v1.list_namespaced_config_map, namespace, resource_version=start,
            allow_watch_bookmarks=True, timeout_seconds=2, deserialize=False,
        )
    ]
    elapsed = time.monotonic() - started
    changes = [(t, obj["metadata"]["name"], obj["data"]["v"]) for t, obj in events if t != "BOOKMARK"]
    assert changes == [("ADDED", "seen", "1"), ("MODIFIED", "seen", "2")]
    for t, obj in events:
        if t == "BOOKMARK":
            check_bookmark(obj, created.metadata.resource_version)
    assert 1.5 <= elapsed < 6, f"a 2 s watch ended after {elapsed:.1f} s"


def test_a_long_watch_allowing_bookmarks_gets_a_periodic_bookmark():
    # A server of its own with bookmarks every second, rather than 30 s.
    with own_server("trellis-py-bookmarks-", "--bookmark-interval", "1") as (api, _):
        v1 = client.CoreV1Api(api)
        start = v1.list_namespaced_config_map("default").metadata.resource_version
        created = v1.create_namespaced_config_map("default", config_map("seen"))
        w = watch.Watch()
        events = []
        started = time.monotonic()
        for event in w.stream(
            v1.list_namespaced_config_map, "default", resource_version=start,
            allow_watch_bookmarks=True, timeout_seconds=10, deserialize=False,
        ):
            events.append((event["type"], event["object"]))
            if event["type"] == "BOOKMARK":
                w.stop()
        types = [t for t, _ in events]
        assert types == ["ADDED", "BOOKMARK"], types
        check_bookmark(events[1][1], created.metadata.resource_version)
        assert time.monotonic() - started < 5, "the bookmark came later than the interval asks"


# ---- field selectors ---------------------------------------------------------


def pod(name, node=None):
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            node_name=node, containers=[client.V1Container(name="c", image="busybox")]
        ),
    )


def test_pods_are_selected_by_phase_and_node_name(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    created = v1.create_namespaced_pod(namespace, pod("waiting"))
    assert created.status.phase == "Pending"
    v1.create_namespaced_pod(namespace, pod("placed", node="node-a"))
    v1.create_namespaced_pod(namespace, pod("running", node="node-b"))
    v1.patch_namespaced_pod_status("running", namespace, {"status": {"phase": "Running"}})

    def listed(selector):
        return names(v1.list_namespaced_pod(namespace, field_selector=selector).items)

    assert listed("status.phase=Pending") == ["placed", "waiting"]
    assert listed("status.phase=Running") == ["running"]
    assert listed("status.phase!=Pending") == ["running"]
    assert listed("spec.nodeName=") == ["waiting"]
    assert listed("spec.nodeName!=") == ["placed", "running"]
    assert listed("spec.nodeName=node-a") == ["placed"]
    assert listed("spec.nodeName=node-b,status.phase=Running") == ["running"]
    assert listed("spec.nodeName=node-c") == []

    with pytest.raises(ApiException) as error:
        v1.list_namespaced_pod(namespace, field_selector="spec.hostname=x")
    status = status_of(error.value, 400, "BadRequest")
    assert "spec.hostname" in status["message"], status


def event(namespace, name, reason, type_, kind, involved):
    return client.CoreV1Event(
        metadata=client.V1ObjectMeta(name=name),
        involved_object=client.V1ObjectReference(kind=kind, name=involved, namespace=namespace),
        reason=reason,
        type=type_,
        message=f"{reason} {kind}/{involved}",
    )


def test_events_are_selected_by_reason_type_and_involved_object(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    for args in [
        ("scheduled", "Scheduled", "Normal", "Pod", "web"),
        ("backoff", "BackOff", "Warning", "Pod", "web"),
        ("scaled", "ScalingReplicaSet", "Normal", "Deployment", "web"),
        ("failed", "Failed", "Warning", "Pod", "db"),
    ]:
        v1.create_namespaced_event(namespace, event(namespace, *args))

    def listed(selector):
        return names(v1.list_namespaced_event(namespace, field_selector=selector).items)

    assert listed("reason=BackOff") == ["backoff"]
    assert listed("reason!=BackOff") == ["failed", "scaled", "scheduled"]
    assert listed("type=Warning") == ["backoff", "failed"]
    assert listed("type=Normal") == ["scaled", "scheduled"]
    assert listed("involvedObject.name=web") == ["backoff", "scaled", "scheduled"]
    assert listed("involvedObject.kind=Deployment") == ["scaled"]
    assert listed("involvedObject.kind=Pod,type=Warning") == ["backoff", "failed"]
    assert listed("involvedObject.kind=Pod,involvedObject.name=web,reason=Scheduled") == ["scheduled"]
    assert listed("involvedObject.name=nothing") == []


def test_a_cluster_wide_list_is_selected_by_namespace(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    other = f"{namespace}-other"
    v1.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=other)))
    try:
        v1.create_namespaced_config_map(namespace, config_map("here"))
        v1.create_namespaced_config_map(other, config_map("there"))

        mine = v1.list_config_map_for_all_namespaces(field_selector=f"metadata.namespace={namespace}")
        assert [(c.metadata.namespace, c.metadata.name) for c in mine.items] == [(namespace, "here")]
        theirs = v1.list_config_map_for_all_namespaces(field_selector=f"metadata.namespace={other}")
        assert [(c.metadata.namespace, c.metadata.name) for c in theirs.items] == [(other, "there")]

        rest = v1.list_config_map_for_all_namespaces(field_selector=f"metadata.namespace!={namespace}")
        pairs = {(c.metadata.namespace, c.metadata.name) for c in rest.items}
        assert (other, "there") in pairs
        assert all(ns != namespace for ns, _ in pairs)

        both = v1.list_config_map_for_all_namespaces(
            field_selector=f"metadata.namespace={other},metadata.name=there"
        )
        assert [c.metadata.name for c in both.items] == ["there"]
    finally:
        try:
            v1.delete_namespace(other)
        except ApiException:
            pass
