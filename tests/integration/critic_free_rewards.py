"""Reward functions the tests serve with ``serve-reward reward.function=...`` (imported by the
server's worker process, by module name or by path)."""

from __future__ import annotations

import os
import time
from typing import Any


def letter_share(prompts: list[str], responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
    """The share of the prompt record's ``letter`` (metadata) among each response's characters."""
    return [r.count(m["letter"]) / max(len(r), 1) for r, m in zip(responses, metadata, strict=True)]


def behave(prompts: list[str], responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
    """Scores ``len(response)``, unless a row's metadata says ``do``: ``raise`` (ValueError),
    ``hang`` (sleeps 60 s), ``exit`` (kills its process), ``short`` (one score too few), ``nan``."""
    todo = {m.get("do") for m in metadata}
    if "raise" in todo:
        raise ValueError("this response cannot be scored")
    if "hang" in todo:
        time.sleep(60)
    if "exit" in todo:
        os._exit(7)
    scores = [float(len(r)) for r in responses]
    if "short" in todo:
        return scores[:-1]
    if "nan" in todo:
        return [float("nan")] * len(scores)
    return scores


def two_arguments(prompts: list[str], responses: list[str]) -> list[int]:
    """A function without metadata: the prompt's length (integers are scores too)."""
    return [len(p) for p in prompts]
