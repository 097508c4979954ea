"""Preference pairs: :class:`~openaligner.data.formats.PreferenceRecord`s tokenized for reward-model training.

Each side is the prompt part followed by that response's part, laid out by a
:class:`~openaligner.data.render.Renderer` (raw text: ``[BOS] + prompt + response + [EOS]``), the
layout the reward model is later served with (``servers/reward.make_tokenize_func`` uses the same
:class:`~openaligner.data.render.SequenceLayout`) and that the PPO actor's rollouts have. Knows
nothing of models.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from openaligner.data.formats import PreferenceRecord
from openaligner.data.render import Renderer, located

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreferencePair:
    """One tokenized comparison."""

    chosen: list[int]  # prompt + preferred response ids
    rejected: list[int]  # prompt + dispreferred response ids


def build_preference_pairs(
    records: Iterable[PreferenceRecord], renderer: Renderer, max_length: int
) -> list[PreferencePair]:
    """Tokenize records; pairs where either side exceeds ``max_length`` (or is empty) are
    dropped with a warning, as NeMo-Aligner's reward-model dataset does.

    Raises:
        LayoutError: a record cannot be rendered (named by its place in the file).
    """
    pairs, dropped = [], 0
    for record in records:
        with located(record.where):
            prompt, chosen = renderer.example_ids(record.prompt, record.chosen)
            _, rejected = renderer.example_ids(record.prompt, record.rejected)
        chosen, rejected = prompt + chosen, prompt + rejected
        if not chosen or not rejected or max(len(chosen), len(rejected)) > max_length:
            dropped += 1
        else:
            pairs.append(PreferencePair(chosen, rejected))
    if dropped:
        log.warning(
            "dropped %d preference pairs longer than %d tokens; %d remain", dropped, max_length, len(pairs)
        )
    return pairs


def collate_pairs(pairs: Sequence[PreferencePair], pad_id: int) -> dict[str, torch.Tensor]:
    """Stack chosen then rejected sequences on the batch axis.

    Returns:
        ``tokens`` [2B, S] int64 right-padded with ``pad_id`` (rows 0..B-1 chosen, B..2B-1
        rejected, pair i in rows i and B+i) and ``lengths`` [2B] int64.
    """
    sequences = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    width = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return {"tokens": tokens, "lengths": torch.tensor([len(s) for s in sequences], dtype=torch.long)}
