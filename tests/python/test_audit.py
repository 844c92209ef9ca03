"""The audit log: every request, allowed or refused, is a JSON line in
DATA_DIR/audit.log naming who asked what and how it ended."""

import json
import time
import uuid

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from conftest import BOB_TOKEN


def audit_lines(trellis, wanted, timeout: float = 10.0) -> list[dict]:
    """The audit records for which `wanted(record)` holds, once there are any (the log
    is written in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        path = trellis.data_dir / "audit.log"
        records = []
        if path.is_file():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if wanted(record):
                    records.append(record)
        if records or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def test_requests_allowed_and_refused_are_audited(trellis, api_client, bearer_client):
    name = f"audited-{uuid.uuid4().hex[:6]}"
    v1 = client.CoreV1Api(api_client)
    v1.create_namespaced_config_map(
        "default", client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name), data={"k": "v"})
    )
    with pytest.raises(ApiException) as unauthorized:
        client.CoreV1Api(bearer_client("not-a-token")).read_namespaced_config_map(name, "default")
    assert unauthorized.value.status == 401
    with pytest.raises(ApiException) as forbidden:
        client.CoreV1Api(bearer_client(BOB_TOKEN)).delete_namespaced_config_map(name, "default")
    assert forbidden.value.status == 403

    created = audit_lines(trellis, lambda r: r["name"] == name and r["verb"] == "create")
    assert len(created) == 1, created
    record = created[0]
    assert record["user"] == "admin"
    assert record["resource"] == "configmaps"
    assert record["namespace"] == "default"
    assert record["code"] == 201
    assert isinstance(record["latencyMs"], (int, float)) and record["latencyMs"] >= 0
    assert record["time"].endswith("Z")

    refused = audit_lines(trellis, lambda r: r["name"] == name and r["user"] == "bob")
    assert [(r["verb"], r["code"]) for r in refused] == [("delete", 403)], refused
    # A request nobody could be identified for is recorded with its 401.
    anonymous = audit_lines(trellis, lambda r: r["code"] == 401)
    assert anonymous, "no 401 in the audit log"
    # The refused delete left the object in place.
    assert v1.read_namespaced_config_map(name, "default").data == {"k": "v"}
