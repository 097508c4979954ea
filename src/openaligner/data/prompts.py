"""Prompt datasets for PPO and a deterministic, resumable per-epoch sampler.

Prompts come from JSONL (``{"prompt": ...}``) or a local Hugging Face ``datasets`` directory
(saved with ``save_to_disk``). Prompts too long to leave room for the response are dropped and
counted. Knows nothing of models beyond a tokenizer's ``encode``-like callable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from openaligner.data.jsonl import DataFileError, read_records

log = logging.getLogger(__name__)


@dataclass
class PromptDataset:
    """Tokenized prompts that fit ``max_prompt_length``."""

    prompts: list[list[int]]  # token ids of each kept prompt
    texts: list[str]  # the prompt strings, aligned with ``prompts``
    dropped_too_long: int  # prompts longer than max_prompt_length
    dropped_empty: int  # prompts that tokenized to nothing

    def __len__(self) -> int:
        return len(self.prompts)


def read_prompt_texts(path: str | Path, key: str = "prompt") -> list[str]:
    """Prompt strings from a JSONL file or a ``datasets`` directory saved with ``save_to_disk``.

    Raises:
        DataFileError: the file or directory cannot be read, has no prompt, or lacks ``key``.
    """
    p = Path(path)
    if not p.is_dir():
        return [r[key] for r in read_records(p, [key])]
    try:
        import datasets
    except ImportError:
        raise DataFileError(
            p, "is a directory; reading a datasets directory needs `pip install datasets`"
        ) from None
    try:
        ds = datasets.load_from_disk(str(p))
    except (OSError, ValueError) as e:
        raise DataFileError(p, f"is not a datasets directory saved with save_to_disk ({e})") from None
    if key not in ds.column_names:
        raise DataFileError(p, f"has no column {key!r}; columns are {ds.column_names}")
    if len(ds) == 0:
        raise DataFileError(p, "is empty (no rows)")
    return [str(x) for x in ds[key]]


def build_prompt_dataset(
    texts: Sequence[str], encode: Callable[[str], list[int]], max_prompt_length: int
) -> PromptDataset:
    """Tokenize ``texts``; drop (and count) prompts longer than ``max_prompt_length`` or empty."""
    kept, kept_texts, too_long, empty = [], [], 0, 0
    for text in texts:
        ids = list(encode(text))
        if not ids:
            empty += 1
        elif len(ids) > max_prompt_length:
            too_long += 1
        else:
            kept.append(ids)
            kept_texts.append(text)
    if too_long or empty:
        log.warning(
            "dropped %d prompts longer than %d tokens and %d empty prompts; %d remain",
            too_long,
            max_prompt_length,
            empty,
            len(kept),
        )
    return PromptDataset(kept, kept_texts, too_long, empty)


class EpochSampler:
    """Yields dataset indices in global batches; a fresh seeded permutation each epoch.

    The order is a pure function of ``(seed, epoch)``, so a run resumed at ``consumed_samples``
    sees exactly the prompts an uninterrupted run would. Incomplete last batches are dropped
    (every step has ``batch_size`` prompts), so epoch boundaries fall on step boundaries.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.batch_size

    def epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def batches(self, consumed_samples: int) -> Iterator[tuple[int, list[int]]]:
        """``(epoch, indices)`` for each global batch from ``consumed_samples`` on, forever."""
        if self.steps_per_epoch == 0:
            raise ValueError(f"{self.num_samples} prompts cannot fill one batch of {self.batch_size}")
        per_epoch = self.steps_per_epoch * self.batch_size
        epoch, offset = divmod(consumed_samples, per_epoch)
        while True:
            order = self.epoch_order(epoch)
            for start in range(offset, per_epoch, self.batch_size):
                yield epoch, order[start : start + self.batch_size]
            epoch, offset = epoch + 1, 0
