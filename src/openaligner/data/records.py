"""Records of a data file: the JSON objects of a JSONL file, or the rows of a Hugging Face
``datasets`` directory saved with ``save_to_disk``, each with where it came from; and the seeded
validation holdout.

Owns the file formats only, with errors that name the file and the line (or split and row). What
a record must hold is :mod:`openaligner.data.formats`'s; knows nothing of tokenizers or models.
``datasets`` is imported only to read a directory (``pip install datasets``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class DataFileError(ValueError):
    """A data file that cannot be used: missing, unreadable, empty, or with a bad record.
    ``str()`` is where, then the problem: ``data.jsonl does not exist``,
    ``data.jsonl:3: not valid JSON (...)``, ``ds split 'train' row 4: missing field 'prompt' ...``."""

    def __init__(self, where: str | Path, problem: str) -> None:
        super().__init__(f"{where} {problem}")


@dataclass(frozen=True)
class Record:
    """One record of a data file and where it is (for error messages)."""

    fields: Mapping[str, Any]  # the JSON object of a JSONL line, or a datasets row
    path: Path  # the file or datasets directory
    line: int | None = None  # JSONL: 1-based line number
    row: int | None = None  # datasets directory: 0-based row index (within ``split``)
    split: str | None = None  # datasets directory holding a DatasetDict: the split read

    @property
    def where(self) -> str:
        """``data.jsonl:3`` or ``ds split 'train' row 4`` (``ds row 4`` for a single Dataset)."""
        if self.line is not None:
            return f"{self.path}:{self.line}"
        split = f" split {self.split!r}" if self.split is not None else ""
        return f"{self.path}{split} row {self.row}"

    def error(self, problem: str) -> DataFileError:
        """A :class:`DataFileError` naming this record: ``<where>: <problem>``."""
        return DataFileError(f"{self.where}:", problem)


def read_records(path: str | Path, split: str | None = None) -> list[Record]:
    """Every record of ``path``: each non-blank line of a JSONL file (a JSON object), or each row of
    a ``datasets`` directory (of its split ``split`` when it holds a ``DatasetDict``).

    Raises:
        DataFileError: ``path`` is missing, not a file nor a datasets directory, unreadable
            (permissions, not UTF-8), holds no record, has a line that is not a JSON object, or
            is a ``DatasetDict`` without ``split``.
    """
    p = Path(path)
    if not p.exists():
        raise DataFileError(p, "does not exist")
    if p.is_dir():
        return _read_datasets_dir(p, split)
    if not p.is_file():
        raise DataFileError(p, "is not a file")
    records = []
    try:
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    records.append(Record(_json_object(p, lineno, line), p, line=lineno))
    except (OSError, UnicodeDecodeError) as e:
        raise DataFileError(p, f"cannot be read ({type(e).__name__}: {e})") from None
    if not records:
        raise DataFileError(p, "is empty (no JSON line)")
    return records


def _json_object(p: Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataFileError(f"{p}:{lineno}:", f"not valid JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise DataFileError(f"{p}:{lineno}:", f"expected a JSON object, got {type(value).__name__}")
    return value


def _read_datasets_dir(p: Path, split: str | None) -> list[Record]:
    try:
        import datasets
    except ImportError:
        raise DataFileError(
            p,
            "is a directory; reading a datasets directory (save_to_disk) needs `pip install datasets` "
            "(the `data` extra)",
        ) from None
    try:
        ds = datasets.load_from_disk(str(p))
    except (OSError, ValueError) as e:
        raise DataFileError(
            p, f"is a directory but not a datasets directory saved with save_to_disk ({e})"
        ) from None
    chosen: str | None = None
    if isinstance(ds, datasets.DatasetDict):
        if split is None or split not in ds:
            raise DataFileError(p, f"holds the splits {sorted(ds)}, and no split {split!r}")
        ds, chosen = ds[split], split
    rows = ds.to_list()
    if not rows:
        raise DataFileError(
            p, "is empty (no rows)" if chosen is None else f"split {chosen!r} is empty (no rows)"
        )
    return [Record(r, p, row=i, split=chosen) for i, r in enumerate(rows)]


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
