# world: admission
"""require-team-label: a validating Trellis plugin in Python, built with componentize-py.

The class below is the `admission-handler` export of the WIT world `admission`;
`policy.py` holds the rule itself.
"""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports.admission_handler import AdmissionRequest, AdmissionResponse
from wit_world.imports import log, types

import policy


class AdmissionHandler(exports.AdmissionHandler):
    def validate_configuration(self, configuration: str) -> None:
        try:
            policy.parse_configuration(configuration)
        except ValueError as e:
            raise Err(str(e))

    def admit(self, request: AdmissionRequest) -> AdmissionResponse:
        allowed = AdmissionResponse(allowed=True, status=None, warnings=[], patch=None)
        if request.object is None:  # a delete: nothing to label
            return allowed
        try:
            config = policy.parse_configuration(request.configuration)
        except ValueError as e:
            # The host checks the configuration before it serves; answer rather
            # than trap should one slip through.
            status = types.Status(code=500, reason="InternalError", message=str(e))
            return AdmissionResponse(allowed=False, status=status, warnings=[], patch=None)
        message = policy.denial(json.loads(request.object), config)
        if message is None:
            return allowed
        log.log(log.Level.INFO, "denied", [("uid", request.uid), ("name", request.name)])
        return AdmissionResponse(
            allowed=False,
            status=types.Status(code=403, reason="Forbidden", message=message),
            warnings=[],
            patch=None,
        )
