"""The rule of avoid-nodes, plain Python: which nodes a pod may not use.

A node is avoided when it has the configured label (`trellis.dev/avoid` by default)
with a value the pod does not name in its own annotation of the same key: a node
labelled `trellis.dev/avoid: maintenance` takes only pods annotated
`trellis.dev/avoid: maintenance` (they accept it).
"""

import json

DEFAULT_LABEL = "trellis.dev/avoid"


def parse_configuration(text: str) -> str:
    """The label to look at; ValueError names what is wrong."""
    config = json.loads(text or "{}")
    if not isinstance(config, dict):
        raise ValueError("configuration: must be an object")
    unknown = set(config) - {"label"}
    if unknown:
        raise ValueError(f"configuration: unknown field {sorted(unknown)[0]!r}")
    label = config.get("label", DEFAULT_LABEL)
    if not isinstance(label, str) or not label:
        raise ValueError("configuration: label: must be a non-empty string")
    return label


def node_labels(node_json: str) -> dict:
    return json.loads(node_json).get("metadata", {}).get("labels") or {}


def accepted(pod: dict, label: str) -> str | None:
    """The value of the label this pod accepts, if any."""
    return (pod.get("metadata", {}).get("annotations") or {}).get(label)


def rejects(labels: dict, label: str, accepts: str | None) -> str | None:
    """Why a node with `labels` is avoided by a pod that accepts `accepts`, or None."""
    value = labels.get(label)
    if value is None or value == accepts:
        return None
    return f"node(s) are avoided ({label}: {value})"
