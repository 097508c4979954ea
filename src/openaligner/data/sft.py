"""Supervised fine-tuning examples: :class:`~openaligner.data.formats.SFTRecord`s tokenized for a causal LM.

Each example is a prompt part and a response part laid out by a
:class:`~openaligner.data.render.Renderer` (raw text: ``[BOS] + prompt | response + [EOS]``; with a
chat template: the rendered conversation up to the generation prompt | the assistant turn +
``[EOS]``); the loss covers the response part only. Knows nothing of models.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from openaligner.data.formats import SFTRecord
from openaligner.data.render import Renderer, located

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTExample:
    """One tokenized example."""

    tokens: list[int]  # prompt ids followed by response ids
    prompt_length: int  # number of leading prompt ids (no loss on them)


def build_sft_examples(records: Iterable[SFTRecord], renderer: Renderer, max_length: int) -> list[SFTExample]:
    """Tokenize records; examples longer than ``max_length`` or with an empty side are dropped
    with a warning (never truncated, so no response loses its end).

    Raises:
        LayoutError: a record cannot be rendered (named by its place in the file).
    """
    examples, too_long, empty = [], 0, 0
    for record in records:
        with located(record.where):
            prompt, response = renderer.example_ids(record.prompt, record.response)
        if not response or not prompt:
            empty += 1
        elif len(prompt) + len(response) > max_length:
            too_long += 1
        else:
            examples.append(SFTExample(prompt + response, len(prompt)))
    if too_long or empty:
        log.warning(
            "dropped %d SFT examples longer than %d tokens and %d with an empty side; %d remain",
            too_long,
            max_length,
            empty,
            len(examples),
        )
    return examples


def collate_sft(examples: Sequence[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch.

    Returns:
        ``tokens`` [B, S] int64 (padded with ``pad_id``), ``lengths`` [B] int64 and
        ``prompt_lengths`` [B] int64; S = the longest example.
    """
    width = max(len(e.tokens) for e in examples)
    tokens = torch.full((len(examples), width), pad_id, dtype=torch.long)
    for i, e in enumerate(examples):
        tokens[i, : len(e.tokens)] = torch.tensor(e.tokens, dtype=torch.long)
    return {
        "tokens": tokens,
        "lengths": torch.tensor([len(e.tokens) for e in examples], dtype=torch.long),
        "prompt_lengths": torch.tensor([e.prompt_length for e in examples], dtype=torch.long),
    }
