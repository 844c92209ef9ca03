# world: controller
"""configmap-checksum: a Trellis controller plugin in Python, built with componentize-py.

For each ConfigMap labelled `trellis.dev/checksum: "true"` it keeps the annotation
`trellis.dev/sha256` equal to the SHA-256 of the ConfigMap's data, so that a change of
content shows in its metadata (and anything that copies the annotation into a pod
template rolls its pods). The class below is the `handler` export of the WIT world
`controller`; `checksum.py` holds the rule.
"""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import cache, client, events, log
from wit_world.imports.trellis_controller_types import Action_Done, ApiError

import checksum


class Handler(exports.Handler):
    def validate_configuration(self, configuration: str) -> None:
        try:
            checksum.parse_configuration(configuration)
        except ValueError as e:
            raise Err(str(e))

    def reconcile(self, key, configuration):
        config = checksum.parse_configuration(configuration)
        found = cache.get(key.resource, key.namespace, key.name)
        if found is None:  # deleted: nothing to keep
            return Action_Done()
        configmap = json.loads(found)
        patch = checksum.wanted_patch(configmap, config)
        if patch is None:
            return Action_Done()
        try:
            client.patch(client.PatchRequest(
                resource=key.resource, namespace=key.namespace, name=key.name,
                patch_type=client.PatchType.MERGE, patch=json.dumps(patch),
                status=False, force=False))
        except Err as e:
            error: ApiError = e.value
            if error.code == 404:  # deleted meanwhile
                return Action_Done()
            # Failed: the host retries the key with back-off.
            raise Err(f"annotate {key.name}: {error.code} {error.reason}: {error.message}")
        digest = patch["metadata"]["annotations"][checksum.ANNOTATION]
        if digest is not None:
            events.record(found, events.EventType.NORMAL, "Checksummed",
                          f"sha256 {digest[:12]}…")
        log.log(log.Level.INFO, "annotated", [("configmap", key.name)])
        return Action_Done()
