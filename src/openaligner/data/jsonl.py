"""Reading JSONL records with required string fields, with errors that name the file and line.

Owns the file format only; knows nothing of tokenizers or models.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class DataFileError(ValueError):
    """A data file that cannot be used: missing, not a file, unreadable, empty, or with a bad line.
    ``str()`` names the file (and line), then the problem: ``data.jsonl does not exist``,
    ``data.jsonl:3: not valid JSON (...)``."""

    def __init__(self, path: Path, problem: str, lineno: int | None = None) -> None:
        where = f"{path}:{lineno}:" if lineno is not None else str(path)
        super().__init__(f"{where} {problem}")


def read_records(path: str | Path, keys: Sequence[str]) -> list[dict[str, str]]:
    """Every non-blank line of ``path`` as a dict holding (at least) ``keys``, values as strings.

    Raises:
        DataFileError: the file is missing, not a file, unreadable (permissions, not UTF-8) or
            holds no record, or a line is not a JSON object with ``keys``.
    """
    p = Path(path)
    if not p.exists():
        raise DataFileError(p, "does not exist")
    if not p.is_file():
        raise DataFileError(p, "is not a file")
    records = []
    try:
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    records.append(_record(p, lineno, line, keys))
    except (OSError, UnicodeDecodeError) as e:
        raise DataFileError(p, f"cannot be read ({type(e).__name__}: {e})") from None
    if not records:
        raise DataFileError(p, "is empty (no JSON line)")
    return records


def _record(p: Path, lineno: int, line: str, keys: Sequence[str]) -> dict[str, str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataFileError(p, f"not valid JSON ({e.msg})", lineno) from None
    missing = [k for k in keys if not isinstance(record, dict) or k not in record]
    if missing:
        raise DataFileError(p, f"expected an object with fields {list(keys)}; missing {missing}", lineno)
    return {k: str(record[k]) for k in keys}


def split_holdout(items: Sequence[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """Seeded split into ``(train, validation)``; validation gets ``round(fraction * n)`` items,
    at least one when ``fraction > 0`` and there are two or more items."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation fraction must lie in [0, 1), got {fraction}")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_val = round(fraction * len(items))
    if fraction > 0 and len(items) >= 2:
        n_val = max(1, n_val)
    val = [items[i] for i in sorted(order[:n_val])]
    train = [items[i] for i in sorted(order[n_val:])]
    return train, val
