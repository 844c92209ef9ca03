"""The rule of require-team-label, free of component bindings so it runs anywhere.

Every object must carry a `team` label (the label name is configurable), and, when
the configuration lists teams, its value must be one of them.
"""

import json
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Config:
    label: str = "team"
    teams: list[str] = field(default_factory=list)


def parse_configuration(text: str) -> Config:
    """Decodes `spec.configuration`; raises ValueError with a message for the user."""
    try:
        raw = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"configuration is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("configuration must be a JSON object")
    unknown = sorted(set(raw) - {"label", "teams"})
    if unknown:
        raise ValueError(f"configuration: unknown field {unknown[0]!r}, expected 'label' or 'teams'")
    label = raw.get("label", "team")
    if not isinstance(label, str) or not label:
        raise ValueError("configuration: label must be a non-empty string")
    teams = raw.get("teams", [])
    if not isinstance(teams, list) or not all(isinstance(t, str) and t for t in teams):
        raise ValueError("configuration: teams must be a list of team names")
    return Config(label=label, teams=teams)


def denial(obj: dict, config: Config) -> Optional[str]:
    """Why `obj` is refused, in words for `kubectl`, or None when it may pass."""
    metadata = obj.get("metadata") or {}
    name = metadata.get("name") or (metadata.get("generateName", "") + "*")
    kind = obj.get("kind", "object")
    value = (metadata.get("labels") or {}).get(config.label)
    if not value:
        example = config.teams[0] if config.teams else "payments"
        return (
            f'{kind} "{name}" has no "{config.label}" label; every object must name the team '
            f"that owns it (add metadata.labels.{config.label}: {example})"
        )
    if config.teams and value not in config.teams:
        return (
            f'{kind} "{name}" has {config.label}={value}, which is not a known team '
            f"(known: {', '.join(config.teams)})"
        )
    return None
