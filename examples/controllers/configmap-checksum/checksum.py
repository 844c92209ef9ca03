"""The rule of configmap-checksum, in plain Python (no WIT types): what annotation a
ConfigMap should carry. Tested natively by test_checksum.py."""

import hashlib
import json

ANNOTATION = "trellis.dev/sha256"
DEFAULT_LABEL = "trellis.dev/checksum"


def parse_configuration(text: str) -> dict:
    """`{"label": "..."}`: which label (set to "true") selects ConfigMaps."""
    config = json.loads(text or "{}")
    if not isinstance(config, dict):
        raise ValueError("configuration: expected an object")
    unknown = set(config) - {"label"}
    if unknown:
        raise ValueError(f"configuration: unknown field(s) {sorted(unknown)}")
    label = config.get("label", DEFAULT_LABEL)
    if not isinstance(label, str) or not label:
        raise ValueError("configuration.label: expected a non-empty string")
    return {"label": label}


def checksum(configmap: dict) -> str:
    """The SHA-256 of the ConfigMap's data and binaryData, keys in order."""
    content = {
        "data": configmap.get("data") or {},
        "binaryData": configmap.get("binaryData") or {},
    }
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def wanted_patch(configmap: dict, config: dict):
    """The merge patch that brings the annotation up to date, or None."""
    metadata = configmap.get("metadata") or {}
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    if labels.get(config["label"]) != "true":
        # Not (or no longer) selected: drop an annotation we put there.
        if ANNOTATION in annotations:
            return {"metadata": {"annotations": {ANNOTATION: None}}}
        return None
    digest = checksum(configmap)
    if annotations.get(ANNOTATION) == digest:
        return None
    return {"metadata": {"annotations": {ANNOTATION: digest}}}
