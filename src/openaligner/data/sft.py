"""Supervised fine-tuning examples: ``{"prompt", "response"}`` records tokenized for a causal LM.

Each example is ``[BOS] + prompt + response + [EOS]`` (BOS/EOS optional); the loss covers the
response tokens (EOS included) only. Knows nothing of models beyond a tokenizer's ids.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

Encode = Callable[[str], list[int]]
"""Text → token ids, without special tokens."""


@dataclass(frozen=True)
class SFTExample:
    """One tokenized example."""

    tokens: list[int]  # prompt ids followed by response ids
    prompt_length: int  # number of leading prompt ids (no loss on them)


def build_sft_examples(
    records: Sequence[dict[str, str]],
    encode: Encode,
    max_length: int,
    bos_id: int | None,
    eos_id: int | None,
) -> list[SFTExample]:
    """Tokenize records; examples longer than ``max_length`` or with an empty response are
    dropped with a warning (never truncated, so no response loses its end)."""
    examples, too_long, empty = [], 0, 0
    for record in records:
        prompt = ([bos_id] if bos_id is not None else []) + encode(record["prompt"])
        response = encode(record["response"]) + ([eos_id] if eos_id is not None else [])
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
