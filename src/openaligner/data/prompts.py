"""Prompt datasets for PPO and a deterministic, resumable per-epoch sampler.

Prompts are :class:`~openaligner.data.formats.PromptRecord`s (text or a conversation, read from
JSONL or a ``datasets`` directory by :mod:`openaligner.data.records` and
:mod:`openaligner.data.formats`) tokenized by a :class:`~openaligner.data.render.Renderer`.
Prompts too long to leave room for the response are dropped and counted. Knows nothing of models.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from openaligner.data.formats import Prompt, PromptRecord, prompt_record
from openaligner.data.records import read_records
from openaligner.data.render import Renderer, located

log = logging.getLogger(__name__)


@dataclass
class PromptDataset:
    """Tokenized prompts that fit ``max_prompt_length``."""

    prompts: list[list[int]]  # token ids of each kept prompt
    sources: list[Prompt]  # the prompts as read (text or conversation), aligned with ``prompts``
    dropped_too_long: int  # prompts longer than max_prompt_length
    dropped_empty: int  # prompts that tokenized to nothing
    metadata: list[Mapping[str, Any]] = field(default_factory=list)  # per kept prompt (data.metadata_keys)

    def __len__(self) -> int:
        return len(self.prompts)


def read_prompts(
    path: str | Path,
    prompt_key: str = "prompt",
    messages_key: str = "messages",
    split: str | None = None,
    metadata_keys: Sequence[str] = (),
) -> list[PromptRecord]:
    """The prompts of a JSONL file or a ``datasets`` directory (its ``split`` if a DatasetDict),
    each with its ``metadata_keys`` fields as metadata.

    Raises:
        DataFileError: the file or directory cannot be read, holds no record, or a record is not a
            prompt (:func:`~openaligner.data.formats.prompt_record`).
    """
    return [prompt_record(r, prompt_key, messages_key, metadata_keys) for r in read_records(path, split)]


def build_prompt_dataset(
    records: Sequence[PromptRecord], renderer: Renderer, max_prompt_length: int
) -> PromptDataset:
    """Tokenize prompts; drop (and count) those longer than ``max_prompt_length`` or empty.

    Raises:
        LayoutError: a prompt cannot be rendered (named by its place in the file).
    """
    kept, sources, metadata, too_long, empty = [], [], [], 0, 0
    for record in records:
        with located(record.where):
            ids = renderer.prompt_ids(record.prompt)
        if not ids:
            empty += 1
        elif len(ids) > max_prompt_length:
            too_long += 1
        else:
            kept.append(ids)
            sources.append(record.prompt)
            metadata.append(record.metadata)
    if too_long or empty:
        log.warning(
            "dropped %d prompts longer than %d tokens and %d empty prompts; %d remain",
            too_long,
            max_prompt_length,
            empty,
            len(kept),
        )
    return PromptDataset(kept, sources, too_long, empty, metadata)


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
