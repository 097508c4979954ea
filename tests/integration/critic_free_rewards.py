"""A reward function the critic-free CLI test serves with ``serve-reward reward.function=...``."""

from __future__ import annotations

from typing import Any


def letter_share(prompts: list[str], responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
    """The share of the prompt record's ``letter`` (metadata) among each response's characters."""
    return [r.count(m["letter"]) / max(len(r), 1) for r, m in zip(responses, metadata, strict=True)]
