"""Object behaviours of `trellis server` through the official Python client: the
`pods/binding`, `pods/log` and `scale` subresources, a custom resource's `/status`,
`generateName`, `ownerReferences`, dry runs of updates and patches, the `all`
discovery category as `kubectl get all` uses it, and `kubectl get --sort-by`, which
sorts Tables by the whole objects their rows carry.

Requests go through the official Python client where it can express them, else as
plain HTTPS requests on the client's own connection pool (its admin client
certificate and the cluster CA).

Every test asserts what Kubernetes' own API server answers; a difference is fixed in
the server, not the test.

Trellis has no garbage collector: deleting an owner leaves its dependents, so
cascading deletion (propagationPolicy Background/Foreground) is not tested here.
"""

import json
import re
import subprocess
import time

import pytest
from kubernetes import client
from kubernetes.client import ApiException

from conftest import Raw
from conftest import failure_status as status_of

# What `GET pods/{name}/log` answers until nodes run pods (docs/apiserver.md: "log is
# a placeholder"; routes.rs).

GADGET_GROUP = "objects.example.com"
GADGET_VERSION = "v1"
GADGET_PLURAL = "gadgets"

# The characters Kubernetes draws generated name suffixes from
# (k8s.io/apimachinery/pkg/util/rand), five of them.
GENERATED_SUFFIX = r"[bcdfghjklmnpqrstvwxz2456789]{5}"


# ---- helpers ---------------------------------------------------------------


def wait_for(predicate, timeout=5.0, interval=0.05):
    """Calls `predicate` until it returns something truthy; returns that."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(interval)


def pod(name, labels=None):
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1PodSpec(containers=[client.V1Container(name="web", image="nginx:1.27")]),
    )


def pod_template(labels):
    return client.V1PodTemplateSpec(
        metadata=client.V1ObjectMeta(labels=labels),
        spec=client.V1PodSpec(containers=[client.V1Container(name="web", image="nginx:1.27")]),
    )


def deployment(name, labels, replicas=1):
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1DeploymentSpec(
            replicas=replicas,
            selector=client.V1LabelSelector(match_labels=labels),
            template=pod_template(labels),
        ),
    )


def replica_set(name, labels, replicas=1):
    return client.V1ReplicaSet(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1ReplicaSetSpec(
            replicas=replicas,
            selector=client.V1LabelSelector(match_labels=labels),
            template=pod_template(labels),
        ),
    )


def binding(name, node, annotations=None):
    return client.V1Binding(
        metadata=client.V1ObjectMeta(name=name, annotations=annotations),
        target=client.V1ObjectReference(api_version="v1", kind="Node", name=node),
    )


def bind(v1: client.CoreV1Api, namespace, name, body):
    """POSTs `body` to `pods/{name}/binding`.

    The server answers a `Status` (201, Success), which the Python client tries to
    read as a `V1Binding` and refuses for its missing `target` (a known quirk of the
    generated client): that one ValueError means the request succeeded."""
    try:
        v1.create_namespaced_pod_binding(name, namespace, body)
    except ValueError as e:
        if "target" not in str(e):
            raise


# ---- pods/binding ----------------------------------------------------------


def test_a_binding_assigns_a_pod_to_a_node_once(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    created = v1.create_namespaced_pod(namespace, pod("unbound"))
    assert created.spec.node_name is None

    bind(v1, namespace, "unbound", binding("unbound", "node-a"))
    bound = v1.read_namespaced_pod("unbound", namespace)
    assert bound.spec.node_name == "node-a"
    assert bound.metadata.uid == created.metadata.uid
    assert int(bound.metadata.resource_version) > int(created.metadata.resource_version)

    # A second binding, to another node or the same one, is a conflict: a pod is
    # assigned once.
    for node in ("node-b", "node-a"):
        with pytest.raises(ApiException) as error:
            v1.create_namespaced_pod_binding("unbound", namespace, binding("unbound", node))
        status = status_of(error.value, 409, "Conflict")
        assert 'is already assigned to node "node-a"' in status["message"], status
    assert v1.read_namespaced_pod("unbound", namespace).spec.node_name == "node-a"

    # A missing pod cannot be bound.
    with pytest.raises(ApiException) as error:
        v1.create_namespaced_pod_binding("missing", namespace, binding("missing", "node-a"))
    status = status_of(error.value, 404, "NotFound")
    assert status["details"]["name"] == "missing"
    assert status["details"]["kind"] == "pods"


def test_a_binding_answers_a_success_status(api_client, namespace):
    """What the Python client cannot read: the binding's answer, on the wire."""
    v1 = client.CoreV1Api(api_client)
    v1.create_namespaced_pod(namespace, pod("wire"))
    body = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "wire"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "node-w"},
    }
    code, status = Raw(api_client).json(
        "POST",
        f"/api/v1/namespaces/{namespace}/pods/wire/binding",
        json.dumps(body),
        {"Content-Type": "application/json"},
    )
    assert code == 201, status
    assert status["kind"] == "Status", status
    assert status["status"] == "Success", status
    assert v1.read_namespaced_pod("wire", namespace).spec.node_name == "node-w"

    # A binding without a target node is invalid, and binds nothing.
    v1.create_namespaced_pod(namespace, pod("no-target"))
    body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "no-target"}, "target": {}}
    code, status = Raw(api_client).json(
        "POST",
        f"/api/v1/namespaces/{namespace}/pods/no-target/binding",
        json.dumps(body),
        {"Content-Type": "application/json"},
    )
    # Refused; Trellis answers 422 Invalid (target.name), kube-apiserver a 500 (its
    # BindingREST returns the field errors unconverted), so only the refusal is checked.
    assert code >= 400, status
    assert status["kind"] == "Status" and status["status"] == "Failure", status
    assert v1.read_namespaced_pod("no-target", namespace).spec.node_name is None


def test_a_binding_marks_the_pod_scheduled_and_copies_its_annotations(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    v1.create_namespaced_pod(namespace, pod("scheduled"))
    bind(v1, namespace, "scheduled", binding("scheduled", "node-a", {"example.com/placed-by": "test"}))
    bound = v1.read_namespaced_pod("scheduled", namespace)
    assert bound.spec.node_name == "node-a"
    assert (bound.metadata.annotations or {}).get("example.com/placed-by") == "test"
    conditions = {c.type: c.status for c in (bound.status.conditions or [])}
    assert conditions.get("PodScheduled") == "True", conditions


def test_a_binding_named_for_another_pod_is_a_bad_request(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    v1.create_namespaced_pod(namespace, pod("target"))
    body = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "someone-else"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "node-a"},
    }
    code, status = Raw(api_client).json(
        "POST",
        f"/api/v1/namespaces/{namespace}/pods/target/binding",
        json.dumps(body),
        {"Content-Type": "application/json"},
    )
    assert (code, status.get("reason")) == (400, "BadRequest"), status
    assert v1.read_namespaced_pod("target", namespace).spec.node_name is None


# ---- pods/log --------------------------------------------------------------


def test_the_log_of_a_pod_is_empty_until_bound_then_asked_of_its_node(api_client, namespace):
    """A pod no node has taken has no log (204 No Content, as kube-apiserver answers);
    a bound one's log is asked of its node, so a node that does not exist is told
    (tests/python/test_node.py reads logs from a running node)."""
    v1 = client.CoreV1Api(api_client)
    v1.create_namespaced_pod(namespace, pod("logged"))
    raw = Raw(api_client).request("GET", f"/api/v1/namespaces/{namespace}/pods/logged/log")
    assert (raw.status, raw.data) == (204, b""), (raw.status, raw.data)
    bind(v1, namespace, "logged", binding("logged", "node-a"))
    with pytest.raises(ApiException) as error:
        v1.read_namespaced_pod_log("logged", namespace)
    status = status_of(error.value, 404, "NotFound")
    assert "node-a" in status["message"], status


def test_the_log_of_a_missing_pod_is_not_found(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    with pytest.raises(ApiException) as error:
        v1.read_namespaced_pod_log("missing", namespace)
    status = status_of(error.value, 404, "NotFound")
    assert status["details"]["name"] == "missing"


def test_the_log_of_a_container_the_pod_does_not_have_is_a_bad_request(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    v1.create_namespaced_pod(namespace, pod("one-container"))
    with pytest.raises(ApiException) as error:
        v1.read_namespaced_pod_log("one-container", namespace, container="nope")
    status = status_of(error.value, 400, "BadRequest")
    assert "nope" in status["message"], status


def test_the_log_of_a_pod_is_not_a_json_document(api_client, namespace):
    client.CoreV1Api(api_client).create_namespaced_pod(namespace, pod("plain"))
    response = Raw(api_client).request("GET", f"/api/v1/namespaces/{namespace}/pods/plain/log")
    content_type = response.headers.get("Content-Type", "")
    if response.status == 204:
        assert response.data == b""
    else:
        assert response.status == 200, response.data
        assert content_type.startswith("text/plain"), response.headers
        assert not response.data.startswith(b'"'), response.data


# ---- custom resources: /status ----------------------------------------------


def gadget_crd():
    props = client.V1JSONSchemaProps
    schema = props(
        type="object",
        properties={
            "spec": props(
                type="object",
                properties={"size": props(type="integer"), "color": props(type="string")},
            ),
            "status": props(
                type="object",
                properties={"phase": props(type="string"), "ready": props(type="integer")},
            ),
        },
    )
    return client.V1CustomResourceDefinition(
        metadata=client.V1ObjectMeta(name=f"{GADGET_PLURAL}.{GADGET_GROUP}"),
        spec=client.V1CustomResourceDefinitionSpec(
            group=GADGET_GROUP,
            scope="Namespaced",
            names=client.V1CustomResourceDefinitionNames(
                plural=GADGET_PLURAL, singular="gadget", kind="Gadget", list_kind="GadgetList"
            ),
            versions=[
                client.V1CustomResourceDefinitionVersion(
                    name=GADGET_VERSION,
                    served=True,
                    storage=True,
                    schema=client.V1CustomResourceValidation(open_apiv3_schema=schema),
                    subresources=client.V1CustomResourceSubresources(status={}),
                )
            ],
        ),
    )


@pytest.fixture(scope="module")
def gadgets(api_client):
    """The `gadgets.objects.example.com` CRD, with a status subresource."""
    ext = client.ApiextensionsV1Api(api_client)
    created = ext.create_custom_resource_definition(gadget_crd())
    yield created
    try:
        ext.delete_custom_resource_definition(created.metadata.name)
    except ApiException:
        pass


def gadget(name, spec, status=None):
    obj = {
        "apiVersion": f"{GADGET_GROUP}/{GADGET_VERSION}",
        "kind": "Gadget",
        "metadata": {"name": name},
        "spec": spec,
    }
    if status is not None:
        obj["status"] = status
    return obj


def create_gadget(custom: client.CustomObjectsApi, namespace, body):
    """Creates a gadget, waiting (as a client must) until the new CRD is served."""

    def attempt():
        try:
            return custom.create_namespaced_custom_object(
                GADGET_GROUP, GADGET_VERSION, namespace, GADGET_PLURAL, body
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    created = wait_for(attempt)
    assert created is not None, "the gadgets CRD is not served"
    return created


def test_a_custom_resource_status_is_written_only_through_its_subresource(
    api_client, gadgets, namespace
):
    custom = client.CustomObjectsApi(api_client)
    where = (GADGET_GROUP, GADGET_VERSION, namespace, GADGET_PLURAL)

    # A create drops the status it carries.
    created = create_gadget(custom, namespace, gadget("g", {"size": 1}, {"phase": "Forged"}))
    assert created["spec"] == {"size": 1}
    assert "status" not in created, created
    assert created["metadata"]["generation"] == 1
    stored = custom.get_namespaced_custom_object(*where, "g")
    assert "status" not in stored, stored

    # A replace of /status changes the status, not the spec it also carries, and not
    # the generation.
    stored["spec"] = {"size": 5, "color": "red"}
    stored["status"] = {"phase": "Ready", "ready": 1}
    replaced = custom.replace_namespaced_custom_object_status(*where, "g", stored)
    assert replaced["status"] == {"phase": "Ready", "ready": 1}
    assert replaced["spec"] == {"size": 1}
    assert replaced["metadata"]["generation"] == 1
    assert int(replaced["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])

    # A patch of /status merges into the status; its spec is ignored too.
    patched = custom.patch_namespaced_custom_object_status(
        *where, "g", {"spec": {"size": 7}, "status": {"ready": 2}}
    )
    assert patched["status"] == {"phase": "Ready", "ready": 2}
    assert patched["spec"] == {"size": 1}
    assert patched["metadata"]["generation"] == 1

    # The status subresource reads the whole object.
    read = custom.get_namespaced_custom_object_status(*where, "g")
    assert read["status"] == {"phase": "Ready", "ready": 2}
    assert read["spec"] == {"size": 1}

    # A spec change through the main resource bumps the generation; the status it
    # carries is ignored.
    changed = custom.patch_namespaced_custom_object(
        *where, "g", {"spec": {"size": 3}, "status": {"phase": "Hacked"}}
    )
    assert changed["spec"] == {"size": 3}
    assert changed["status"] == {"phase": "Ready", "ready": 2}
    assert changed["metadata"]["generation"] == 2

    # So does a replace of the main resource.
    changed["spec"]["color"] = "blue"
    changed["status"] = {"phase": "Gone"}
    replaced = custom.replace_namespaced_custom_object(*where, "g", changed)
    assert replaced["spec"] == {"size": 3, "color": "blue"}
    assert replaced["status"] == {"phase": "Ready", "ready": 2}
    assert replaced["metadata"]["generation"] == 3

    # A status-only write through the main resource changes nothing at all.
    unchanged = custom.patch_namespaced_custom_object(*where, "g", {"status": {"phase": "Hacked"}})
    assert unchanged["status"] == {"phase": "Ready", "ready": 2}
    assert unchanged["metadata"]["generation"] == 3
    assert unchanged["metadata"]["resourceVersion"] == replaced["metadata"]["resourceVersion"]

    final = custom.get_namespaced_custom_object(*where, "g")
    assert final["spec"] == {"size": 3, "color": "blue"}
    assert final["status"] == {"phase": "Ready", "ready": 2}
    assert final["metadata"]["generation"] == 3


def test_the_status_of_a_missing_custom_object_is_not_found(api_client, gadgets, namespace):
    custom = client.CustomObjectsApi(api_client)
    create_gadget(custom, namespace, gadget("present", {"size": 1}))
    with pytest.raises(ApiException) as error:
        custom.patch_namespaced_custom_object_status(
            GADGET_GROUP, GADGET_VERSION, namespace, GADGET_PLURAL, "absent", {"status": {"ready": 1}}
        )
    status_of(error.value, 404, "NotFound")
    # Nor does a replace of /status create it, as a PUT of the main resource would.
    with pytest.raises(ApiException) as error:
        custom.replace_namespaced_custom_object_status(
            GADGET_GROUP,
            GADGET_VERSION,
            namespace,
            GADGET_PLURAL,
            "absent",
            gadget("absent", {"size": 1}, {"ready": 1}),
        )
    status_of(error.value, 404, "NotFound")


# ---- generateName ------------------------------------------------------------


def test_generate_name_gives_distinct_names_with_a_random_suffix(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    made = [
        v1.create_namespaced_config_map(
            namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(generate_name="gen-"), data={"n": str(i)})
        )
        for i in range(2)
    ]
    names = [m.metadata.name for m in made]
    for m in made:
        assert re.fullmatch(f"gen-{GENERATED_SUFFIX}", m.metadata.name), m.metadata.name
        assert m.metadata.generate_name == "gen-"
    assert names[0] != names[1], names
    # Both are stored under their generated names.
    for i, name in enumerate(names):
        stored = v1.read_namespaced_config_map(name, namespace)
        assert stored.data == {"n": str(i)}
        assert stored.metadata.generate_name == "gen-"
    listed = v1.list_namespaced_config_map(namespace).items
    assert sorted(names) == sorted(m.metadata.name for m in listed if m.metadata.name.startswith("gen-"))

    # A name, when given, wins over generateName.
    named = v1.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="fixed", generate_name="gen-"))
    )
    assert named.metadata.name == "fixed"


def test_a_create_without_name_or_generate_name_is_invalid(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    before = v1.list_namespaced_config_map(namespace).items
    with pytest.raises(ApiException) as error:
        v1.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta()))
    status = status_of(error.value, 422, "Invalid")
    assert status["details"]["kind"] == "ConfigMap"
    assert not status["details"].get("name")
    causes = status["details"]["causes"]
    assert [(c["reason"], c["field"]) for c in causes] == [("FieldValueRequired", "metadata.name")]
    assert "name or generateName is required" in causes[0]["message"]
    assert status["message"].startswith('ConfigMap "" is invalid: metadata.name: '), status
    after = v1.list_namespaced_config_map(namespace).items
    assert [m.metadata.uid for m in after] == [m.metadata.uid for m in before]


def test_a_missing_name_is_described_in_kubernetes_words(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    with pytest.raises(ApiException) as error:
        v1.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta()))
    status = status_of(error.value, 422, "Invalid")
    required = "Required value: name or generateName is required"
    assert status["details"]["causes"][0]["message"] == required, status
    assert status["message"] == f'ConfigMap "" is invalid: metadata.name: {required}', status


# ---- ownerReferences -----------------------------------------------------------


def test_owner_references_are_stored_and_read_back_intact(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    owner = v1.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
    )
    reference = client.V1OwnerReference(
        api_version="v1",
        kind="ConfigMap",
        name="owner",
        uid=owner.metadata.uid,
        controller=True,
        block_owner_deletion=True,
    )
    expected = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": "owner",
            "uid": owner.metadata.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    dependent = v1.create_namespaced_secret(
        namespace,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name="dependent", owner_references=[reference]),
            string_data={"token": "t"},
        ),
    )
    assert dependent.metadata.owner_references == [reference]

    raw = Raw(api_client)
    code, stored = raw.json("GET", f"/api/v1/namespaces/{namespace}/secrets/dependent")
    assert code == 200
    assert stored["metadata"]["ownerReferences"] == expected

    # Writes that do not touch the references keep them.
    v1.patch_namespaced_secret("dependent", namespace, {"metadata": {"labels": {"tier": "db"}}})
    code, stored = raw.json("GET", f"/api/v1/namespaces/{namespace}/secrets/dependent")
    assert stored["metadata"]["ownerReferences"] == expected
    assert stored["metadata"]["labels"] == {"tier": "db"}
    listed = v1.list_namespaced_secret(namespace, field_selector="metadata.name=dependent").items
    assert [s.metadata.owner_references for s in listed] == [[reference]]

    # A second, non-controller reference is added beside the first (merged by uid).
    other = v1.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="other-owner"))
    )
    second = {"apiVersion": "v1", "kind": "ConfigMap", "name": "other-owner", "uid": other.metadata.uid}
    v1.patch_namespaced_secret("dependent", namespace, {"metadata": {"ownerReferences": [second]}})
    code, stored = raw.json("GET", f"/api/v1/namespaces/{namespace}/secrets/dependent")
    by_name = sorted(stored["metadata"]["ownerReferences"], key=lambda r: r["name"])
    assert by_name == sorted([expected[0], second], key=lambda r: r["name"])


def test_invalid_owner_references_are_refused(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    without_uid = client.V1OwnerReference(api_version="v1", kind="ConfigMap", name="a", uid="")
    controllers = [
        client.V1OwnerReference(api_version="v1", kind="ConfigMap", name=n, uid=u, controller=True)
        for n, u in (("a", "0b6a1f1e-0000-4000-8000-000000000001"), ("b", "0b6a1f1e-0000-4000-8000-000000000002"))
    ]
    for name, refs in (("no-uid", [without_uid]), ("two-controllers", controllers)):
        with pytest.raises(ApiException) as error:
            v1.create_namespaced_config_map(
                namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name, owner_references=refs))
            )
        status = status_of(error.value, 422, "Invalid")
        assert all(c["field"].startswith("metadata.ownerReferences") for c in status["details"]["causes"]), status


# ---- dryRun on update and patch ---------------------------------------------------


def test_dry_run_updates_and_patches_answer_the_change_but_store_nothing(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    created = v1.create_namespaced_config_map(
        namespace,
        client.V1ConfigMap(metadata=client.V1ObjectMeta(name="dry", labels={"v": "1"}), data={"color": "blue"}),
    )
    rv = created.metadata.resource_version

    created.data = {"color": "red"}
    created.metadata.labels = {"v": "2"}
    replaced = v1.replace_namespaced_config_map("dry", namespace, created, dry_run="All")
    assert replaced.data == {"color": "red"}
    assert replaced.metadata.labels == {"v": "2"}
    assert replaced.metadata.uid == created.metadata.uid

    patched = v1.patch_namespaced_config_map(
        "dry", namespace, {"data": {"size": "L"}, "metadata": {"labels": {"v": "3"}}}, dry_run="All"
    )
    assert patched.data == {"color": "blue", "size": "L"}
    assert patched.metadata.labels == {"v": "3"}

    stored = v1.read_namespaced_config_map("dry", namespace)
    assert stored.data == {"color": "blue"}
    assert stored.metadata.labels == {"v": "1"}
    assert stored.metadata.resource_version == rv

    # A dry-run patch of a missing object is still a 404.
    with pytest.raises(ApiException) as error:
        v1.patch_namespaced_config_map("missing", namespace, {"data": {"a": "b"}}, dry_run="All")
    status_of(error.value, 404, "NotFound")
    # A real update after the dry runs starts from the stored object.
    real = v1.patch_namespaced_config_map("dry", namespace, {"data": {"size": "S"}})
    assert real.data == {"color": "blue", "size": "S"}
    assert int(real.metadata.resource_version) > int(rv)


def test_an_invalid_dry_run_patch_is_refused_as_the_real_one_would_be(api_client, namespace):
    apps = client.AppsV1Api(api_client)
    created = apps.create_namespaced_deployment(namespace, deployment("web", {"app": "web"}))
    patch = {"spec": {"template": {"metadata": {"labels": {"app": "other"}}}}}
    with pytest.raises(ApiException) as error:
        apps.patch_namespaced_deployment("web", namespace, patch, dry_run="All")
    status = status_of(error.value, 422, "Invalid")
    assert "spec.template.metadata.labels" in [c["field"] for c in status["details"]["causes"]]
    # A valid one answers the change and stores nothing.
    dry = apps.patch_namespaced_deployment("web", namespace, {"spec": {"replicas": 4}}, dry_run="All")
    assert dry.spec.replicas == 4
    assert dry.metadata.generation == created.metadata.generation + 1
    stored = apps.read_namespaced_deployment("web", namespace)
    assert stored.spec.replicas == 1
    assert stored.metadata.generation == created.metadata.generation
    assert stored.metadata.resource_version == created.metadata.resource_version


def test_a_dry_run_update_of_a_stale_version_is_a_conflict(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    created = v1.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="stale"), data={"a": "1"})
    )
    v1.patch_namespaced_config_map("stale", namespace, {"data": {"a": "2"}})
    created.data = {"a": "3"}
    with pytest.raises(ApiException) as error:
        v1.replace_namespaced_config_map("stale", namespace, created, dry_run="All")
    status_of(error.value, 409, "Conflict")
    assert v1.read_namespaced_config_map("stale", namespace).data == {"a": "2"}


def test_a_config_map_key_that_is_not_a_valid_key_is_invalid(api_client, namespace):
    v1 = client.CoreV1Api(api_client)
    for key in ("not a key!", "..data", "."):
        body = client.V1ConfigMap(metadata=client.V1ObjectMeta(name="bad-key"), data={key: "x"})
        with pytest.raises(ApiException) as error:
            v1.create_namespaced_config_map(namespace, body, dry_run="All")
        status = status_of(error.value, 422, "Invalid")
        assert [c["field"] for c in status["details"]["causes"]] == [f"data[{key}]"], status
    # A key in both data and binaryData is a duplicate.
    both = client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="both"), data={"k": "x"}, binary_data={"k": "eA=="}
    )
    with pytest.raises(ApiException) as error:
        v1.create_namespaced_config_map(namespace, both, dry_run="All")
    status = status_of(error.value, 422, "Invalid")
    assert [c["field"] for c in status["details"]["causes"]] == ["data[k]"], status
    # Keys Kubernetes accepts are stored.
    fine = client.V1ConfigMap(metadata=client.V1ObjectMeta(name="fine-keys"), data={"a.b_c-D9": "x", ".hidden": "y"})
    assert v1.create_namespaced_config_map(namespace, fine).data == {"a.b_c-D9": "x", ".hidden": "y"}


# ---- discovery categories: kubectl get all ------------------------------------------


def test_kubectl_get_all_lists_the_resources_of_the_all_category(api_client, trellis, namespace, tmp_path):
    v1 = client.CoreV1Api(api_client)
    apps = client.AppsV1Api(api_client)
    v1.create_namespaced_pod(namespace, pod("web-pod", {"app": "web"}))
    v1.create_namespaced_service(
        namespace,
        client.V1Service(
            metadata=client.V1ObjectMeta(name="web-svc"),
            spec=client.V1ServiceSpec(selector={"app": "web"}, ports=[client.V1ServicePort(port=80)]),
        ),
    )
    apps.create_namespaced_deployment(namespace, deployment("web-deploy", {"app": "web"}))
    apps.create_namespaced_replica_set(namespace, replica_set("web-rs", {"app": "rs"}))
    v1.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="web-cm")))

    # Discovery puts the four in `all`, and not configmaps.
    raw = Raw(api_client)
    categories = {}
    for path in ("/api/v1", "/apis/apps/v1"):
        code, resources = raw.json("GET", path)
        assert code == 200
        for r in resources["resources"]:
            categories[r["name"]] = r.get("categories", [])
    for plural in ("pods", "services", "deployments", "replicasets"):
        assert "all" in categories[plural], (plural, categories[plural])
    assert "all" not in categories["configmaps"]

    result = subprocess.run(
        [
            "kubectl",
            "--kubeconfig",
            str(trellis.kubeconfig),
            "--cache-dir",
            str(tmp_path / "kube-cache"),
            "get",
            "all",
            "-n",
            namespace,
            "-o",
            "name",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    listed = set(result.stdout.split())
    assert {
        "pod/web-pod",
        "service/web-svc",
        "deployment.apps/web-deploy",
        "replicaset.apps/web-rs",
    } <= listed, result.stdout
    assert not any(line.startswith("configmap/") for line in listed), result.stdout


# ---- kubectl get --sort-by ------------------------------------------------------


def kubectl_rows(trellis, tmp_path, *args, stdin=None):
    """`kubectl ARGS --no-headers` as the admin: the rows printed, split into columns."""
    result = subprocess.run(
        ["kubectl", "--kubeconfig", str(trellis.kubeconfig), "--cache-dir", str(tmp_path / "kube-cache"),
         *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, (args, result.stderr)
    return [line.split() for line in result.stdout.splitlines()]


def test_kubectl_get_sort_by_sorts_by_fields_outside_metadata(api_client, trellis, namespace, tmp_path):
    """Regression: Table rows carried only the objects' metadata whatever
    `includeObject` asked for; `kubectl get --sort-by` asks for the whole objects and
    printed "No resources found" when sorting by `.status.startTime` or by an event's
    `.lastTimestamp`."""
    v1 = client.CoreV1Api(api_client)
    # Names in one order, start times in another.
    started = {"pod-a": "2024-01-03T00:00:00Z", "pod-b": "2024-01-01T00:00:00Z", "pod-c": "2024-01-02T00:00:00Z"}
    for name in ("pod-c", "pod-a", "pod-b"):
        v1.create_namespaced_pod(namespace, pod(name))
        kubectl_rows(trellis, tmp_path, "patch", "pod", name, "-n", namespace, "--subresource=status",
                     "--type=merge", "-p", json.dumps({"status": {"startTime": started[name]}}))

    by_name = kubectl_rows(trellis, tmp_path, "get", "pods", "-n", namespace, "--sort-by=.metadata.name",
                           "--no-headers")
    assert [row[0] for row in by_name] == ["pod-a", "pod-b", "pod-c"], by_name
    by_start = kubectl_rows(trellis, tmp_path, "get", "pods", "-n", namespace, "--sort-by=.status.startTime",
                            "--no-headers")
    assert [row[0] for row in by_start] == ["pod-b", "pod-c", "pod-a"], by_start
    # Every column is printed, not only the names.
    assert all(row[1:3] == ["0/1", "Pending"] for row in by_start), by_start

    # Events as `kubectl get events --sort-by=.lastTimestamp` lists them, oldest first.
    seen = {"first": "2024-02-01T00:00:00Z", "second": "2024-02-02T00:00:00Z", "third": "2024-02-03T00:00:00Z"}
    events = "---\n".join(
        f"""apiVersion: v1
kind: Event
metadata: {{name: {name}, namespace: {namespace}}}
involvedObject: {{apiVersion: v1, kind: Pod, name: {pod_name}, namespace: {namespace}}}
reason: {reason}
message: seen {reason}
type: Normal
count: 1
firstTimestamp: "{seen[reason]}"
lastTimestamp: "{seen[reason]}"
"""
        # Names sorted differently from the times.
        for name, pod_name, reason in (("ev-a", "pod-a", "third"), ("ev-b", "pod-b", "first"),
                                       ("ev-c", "pod-c", "second"))
    )
    kubectl_rows(trellis, tmp_path, "create", "-f", "-", stdin=events)
    by_time = kubectl_rows(trellis, tmp_path, "get", "events", "-n", namespace, "--sort-by=.lastTimestamp",
                           "--no-headers")
    # LAST SEEN, TYPE, REASON, OBJECT, MESSAGE.
    assert [row[2] for row in by_time] == ["first", "second", "third"], by_time
    assert [row[3] for row in by_time] == ["pod/pod-b", "pod/pod-c", "pod/pod-a"], by_time


# ---- scale -------------------------------------------------------------------


def test_the_scale_of_a_deployment_reads_and_writes_its_replicas(api_client, namespace):
    apps = client.AppsV1Api(api_client)
    created = apps.create_namespaced_deployment(namespace, deployment("web", {"app": "web"}, replicas=2))

    scale = apps.read_namespaced_deployment_scale("web", namespace)
    assert scale.kind == "Scale"
    assert scale.api_version == "autoscaling/v1"
    assert scale.metadata.name == "web"
    assert scale.metadata.namespace == namespace
    assert scale.metadata.uid == created.metadata.uid
    assert scale.spec.replicas == 2
    assert scale.status.selector == "app=web"

    patched = apps.patch_namespaced_deployment_scale("web", namespace, {"spec": {"replicas": 5}})
    assert patched.spec.replicas == 5
    stored = apps.read_namespaced_deployment("web", namespace)
    assert stored.spec.replicas == 5
    assert stored.metadata.generation == created.metadata.generation + 1
    assert patched.metadata.resource_version == stored.metadata.resource_version

    scale = apps.read_namespaced_deployment_scale("web", namespace)
    assert scale.spec.replicas == 5
    scale.spec.replicas = 0
    replaced = apps.replace_namespaced_deployment_scale("web", namespace, scale)
    assert replaced.spec.replicas == 0
    assert apps.read_namespaced_deployment("web", namespace).spec.replicas == 0

    # A scale from a stale resourceVersion is a conflict and changes nothing.
    scale.spec.replicas = 9
    with pytest.raises(ApiException) as error:
        apps.replace_namespaced_deployment_scale("web", namespace, scale)
    status_of(error.value, 409, "Conflict")
    assert apps.read_namespaced_deployment("web", namespace).spec.replicas == 0

    with pytest.raises(ApiException) as error:
        apps.read_namespaced_deployment_scale("missing", namespace)
    status_of(error.value, 404, "NotFound")


def test_the_scale_of_a_replica_set_reads_and_writes_its_replicas(api_client, namespace):
    apps = client.AppsV1Api(api_client)
    apps.create_namespaced_replica_set(namespace, replica_set("rs", {"app": "rs"}, replicas=1))

    scale = apps.read_namespaced_replica_set_scale("rs", namespace)
    assert scale.spec.replicas == 1
    assert scale.status.selector == "app=rs"

    patched = apps.patch_namespaced_replica_set_scale("rs", namespace, {"spec": {"replicas": 3}})
    assert patched.spec.replicas == 3
    assert apps.read_namespaced_replica_set("rs", namespace).spec.replicas == 3

    scale = apps.read_namespaced_replica_set_scale("rs", namespace)
    scale.spec.replicas = 4
    assert apps.replace_namespaced_replica_set_scale("rs", namespace, scale).spec.replicas == 4
    assert apps.read_namespaced_replica_set("rs", namespace).spec.replicas == 4

    # Negative replicas are invalid.
    with pytest.raises(ApiException) as error:
        apps.patch_namespaced_replica_set_scale("rs", namespace, {"spec": {"replicas": -1}})
    status = status_of(error.value, 422, "Invalid")
    assert "spec.replicas" in [c["field"] for c in status["details"]["causes"]], status
    assert apps.read_namespaced_replica_set("rs", namespace).spec.replicas == 4
