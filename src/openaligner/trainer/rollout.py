"""Rollouts outside the model: prompt batches per step, rank slices, micro-batches, collation, texts.

Knows prompt token lists (and the prompts as read, for :class:`RolloutConversations`), rollout
tensors and a ``decode`` callable; nothing of models, servers or PPO math.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch

from openaligner.data.formats import Prompt
from openaligner.data.prompts import EpochSampler

Collate = Callable[[Sequence[Sequence[int]]], dict[str, torch.Tensor]]


def make_prompt_collate(pad_id: int) -> Collate:
    """Collate prompts into ``text`` [B, P] (right-padded with ``pad_id``) and ``length`` [B]."""

    def collate(prompts: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        text = torch.full((len(prompts), int(lengths.max())), pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            text[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        return {"text": text, "length": lengths}

    return collate


class MicroBatchIterator:
    """Collated micro-batches of ``micro_batch_size`` prompts (the last one may be smaller)."""

    def __init__(self, prompts: Sequence[Sequence[int]], micro_batch_size: int, collate_fn: Collate) -> None:
        self.prompts = prompts
        self.micro_batch_size = micro_batch_size
        self.collate_fn = collate_fn

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for start in range(0, len(self.prompts), self.micro_batch_size):
            yield self.collate_fn(self.prompts[start : start + self.micro_batch_size])

    def __len__(self) -> int:
        return -(-len(self.prompts) // self.micro_batch_size)


class PromptLoader:
    """Builds, from a sample position, the stream of this rank's prompt batches.

    Each step draws one global batch of ``batch_size`` prompts from an :class:`EpochSampler`
    and keeps this rank's contiguous slice, so the union over ranks is the global batch and a run
    resumed at ``consumed_samples`` continues with the same prompts.
    """

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        batch_size: int,
        seed: int,
        shuffle: bool,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if batch_size % world_size:
            raise ValueError(f"batch size {batch_size} does not split over {world_size} ranks")
        self.prompts = prompts
        self.sampler = EpochSampler(len(prompts), batch_size, seed, shuffle)
        self.rank = rank
        self.local = batch_size // world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    def __call__(self, consumed_samples: int) -> Iterator[list[Sequence[int]]]:
        for _, indices in self.sampler.batches(consumed_samples):
            mine = indices[self.rank * self.local : (self.rank + 1) * self.local]
            yield [self.prompts[i] for i in mine]


def pad_and_stack(rows: Sequence[torch.Tensor], pad_value: float) -> torch.Tensor:
    """Stack 2-D tensors of different widths into one, right-padding with ``pad_value``."""
    width = max(r.shape[-1] for r in rows)
    return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[-1]), value=pad_value) for r in rows])


def rollout_texts(
    tokens: torch.Tensor,
    prompt_lengths: torch.Tensor,
    sequence_lengths: torch.Tensor,
    is_end: torch.Tensor,
    stop_ids: Collection[int],
    decode: Callable[[Sequence[int]], str],
) -> tuple[list[str], list[str]]:
    """The prompt and response texts of rollouts.

    Args:
        tokens: [B, S] right-padded prompt + response rows.
        prompt_lengths: [B] prompt tokens per row.
        sequence_lengths: [B] prompt + response tokens per row (stop token included).
        is_end: [B] bool: the response ended on a stop token id or a stop string.
        stop_ids: the stop token ids in effect; a stop id that ended a response is not part of its
            text (the last token of a response that a stop *string* ended is).
        decode: token ids → text.

    Returns:
        ``(prompts, responses)``: B texts each.
    """
    stop = set(stop_ids)
    prompts, responses = [], []
    for i in range(tokens.shape[0]):
        p, end = int(prompt_lengths[i]), int(sequence_lengths[i])
        if bool(is_end[i]) and int(tokens[i, end - 1]) in stop:
            end -= 1
        prompts.append(decode(tokens[i, :p].tolist()))
        responses.append(decode(tokens[i, p:end].tolist()))
    return prompts, responses


class RolloutConversations:
    """Rollouts as the conversations they continue, for a reward model with its own tokenizer
    (``remote.reward_input=text``): each row's prompt as read (a text prompt is one user message),
    found by its token ids, then the response decoded with the policy's tokenizer (special tokens
    and padding dropped) as the assistant's message.

    The prompt is looked up by its ids rather than carried through the sampler: the rollout already
    holds them, and a rendered prompt cannot be turned back into its conversation by decoding.

    Args:
        prompts: token ids of every prompt the run samples (train and validation).
        sources: the prompts as read, aligned with ``prompts``.
        decode: policy token ids → text (special tokens skipped).
        metadata: each prompt's metadata (``data.metadata_keys``), aligned with ``prompts``; None or
            empty: none. Two records with the same prompt ids share the metadata of the later one.
    """

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        sources: Sequence[Prompt],
        decode: Callable[[Sequence[int]], str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        if len(prompts) != len(sources):
            raise ValueError(f"{len(prompts)} prompts but {len(sources)} sources")
        if metadata and len(metadata) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(metadata)} metadata records")
        keys = [tuple(int(i) for i in ids) for ids in prompts]
        self._sources = dict(zip(keys, sources, strict=True))
        self._metadata = dict(zip(keys, metadata, strict=True)) if metadata else None
        self._decode = decode

    @property
    def has_metadata(self) -> bool:
        """Whether the prompts carry metadata (``data.metadata_keys`` named fields)."""
        return self._metadata is not None and any(self._metadata.values())

    def metadata(self, rollout_batch: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
        """``response_tokens`` [B, S] and ``prompt_lengths`` [B] → each row's prompt metadata ({} when
        the prompts carry none).

        Raises:
            KeyError: a row's prompt is not one of ``prompts``.
        """
        tokens = rollout_batch["response_tokens"].cpu()
        rows = []
        for i, p in enumerate(rollout_batch["prompt_lengths"].reshape(-1).tolist()):
            key = tuple(tokens[i, : int(p)].tolist())
            if key not in self._sources:
                raise KeyError(f"rollout row {i}: its prompt ids are not those of any prompt of the run")
            rows.append(dict(self._metadata[key]) if self._metadata is not None else {})
        return rows

    def __call__(self, rollout_batch: Mapping[str, torch.Tensor]) -> list[list[dict[str, str]]]:
        """``response_tokens`` [B, S], ``prompt_lengths`` [B], ``response_lengths`` [B] → B
        conversations ``[{"role", "content"}, ...]`` ending with the assistant's response.

        Raises:
            KeyError: a row's prompt is not one of ``prompts``.
        """
        tokens = rollout_batch["response_tokens"].cpu()
        prompt_lengths = rollout_batch["prompt_lengths"].reshape(-1).tolist()
        ends = rollout_batch["response_lengths"].reshape(-1).tolist()
        conversations = []
        for i, (p, end) in enumerate(zip(prompt_lengths, ends, strict=True)):
            key = tuple(tokens[i, : int(p)].tolist())
            if key not in self._sources:
                raise KeyError(f"rollout row {i}: its prompt ids are not those of any prompt of the run")
            source = self._sources[key]
            messages = (
                [{"role": "user", "content": source}]
                if isinstance(source, str)
                else [{"role": str(m["role"]), "content": str(m["content"])} for m in source]
            )
            response = self._decode(tokens[i, int(p) : int(end)].tolist())
            conversations.append([*messages, {"role": "assistant", "content": response}])
        return conversations
