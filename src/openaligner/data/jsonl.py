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


def read_records(path: str | Path, keys: Sequence[str]) -> list[dict[str, str]]:
    """Every non-blank line of ``path`` as a dict holding (at least) ``keys``, values as strings.

    Raises:
        ValueError: the file is missing, a line is not a JSON object, or a key is absent.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {p} does not exist")
    records = []
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            missing = [k for k in keys if not isinstance(record, dict) or k not in record]
            if missing:
                raise ValueError(
                    f"{p}:{lineno}: expected an object with fields {list(keys)}; missing {missing}"
                )
            records.append({k: str(record[k]) for k in keys})
    return records


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
