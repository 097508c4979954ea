"""Shaping a formed batch for the forward pass, and undoing it for the answers.

Owns four pure steps on torch tensors: merge the requests Triton formed into one right-padded
batch, strip trailing padding columns to a multiple, pad the batch dimension so every rank gets
whole micro-batches, split results back per request without the padded rows; and an endpoint's
counters of what it batched (:class:`EndpointStats`). Fixed shapes live in ``models/fixed_shapes.py``.
Must not know about PyTriton, validation, model classes or torch.distributed (the data-parallel
size is a plain integer here).

Shapes: B rows, S columns; ``tokens`` [B, S] int64 right-padded, ``lengths`` [B] int64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from openaligner.models.fixed_shapes import PAD_ROW_LENGTH, PAD_TOKEN_ID


def merge_rows(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate several ``(tokens [b_i, S_i], lengths [b_i])`` into one batch.

    Narrower parts are right-padded with :data:`PAD_TOKEN_ID` to the widest ``S_i``.

    Returns:
        ``tokens`` [sum b_i, max S_i] and ``lengths`` [sum b_i].
    """
    width = max(t.shape[1] for t, _ in parts)
    padded = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=PAD_TOKEN_ID) for t, _ in parts]
    tokens = torch.cat(padded)
    return tokens, torch.cat([n.reshape(-1) for _, n in parts])


def strip_columns(tokens: torch.Tensor, lengths: torch.Tensor, multiple: int | None) -> torch.Tensor:
    """Drop trailing padding columns, keeping a width that is a multiple of ``multiple``.

    The new width — the width the model computes at — is ``ceil(max(lengths) / multiple) *
    multiple``, never wider than ``S``; ``multiple=None`` strips to exactly ``max(lengths)`` (the
    fewest FLOPs). A multiple gives a few distinct widths, which keeps kernels (and CUDA
    graphs, compiled shapes) warm while most padding is still skipped.

    Example: lengths [3, 5], S = 16: multiple 4 → width 8; None → width 5.
    """
    if tokens.shape[0] == 0:
        return tokens
    longest = int(lengths.max())
    step = multiple or 1
    width = -(-longest // step) * step
    return tokens[:, :width] if width < tokens.shape[1] else tokens


def padding_multiple(rows: int, forward_micro_batch_size: int, dp_size: int) -> int:
    """The multiple the batch dimension is padded to before it is split over ranks.

    A batch that fits in one micro-batch per rank (``rows <= mbs * dp``) is padded only to a
    multiple of ``dp``, so each rank runs one micro-batch of ``rows / dp`` rows. A larger batch is
    padded to a multiple of ``mbs * dp``, so each rank runs whole micro-batches.

    Example: mbs 4, dp 2 → 5 rows pad to 6 (two chunks of 3); 11 rows pad to 16.
    """
    if rows <= forward_micro_batch_size * dp_size:
        return dp_size
    return forward_micro_batch_size * dp_size


def pad_rows(
    tokens: torch.Tensor, lengths: torch.Tensor, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Append filler rows so the batch dimension is a multiple of ``multiple``.

    Returns:
        ``tokens`` [B', S], ``lengths`` [B'] and the number of rows added, ``B' - B``.
    """
    extra = -tokens.shape[0] % multiple
    if extra == 0:
        return tokens, lengths, 0
    tokens = torch.cat([tokens, tokens.new_full((extra, tokens.shape[1]), PAD_TOKEN_ID)])
    lengths = torch.cat([lengths, lengths.new_full((extra,), PAD_ROW_LENGTH)])
    return tokens, lengths, extra


def split_rows(values: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """Split the leading dimension into consecutive pieces of ``counts`` rows, dropping any rows
    after ``sum(counts)`` (the padded ones)."""
    total = sum(counts)
    if values.shape[0] < total:
        raise ValueError(f"got {values.shape[0]} result rows for {total} requested rows")
    return list(torch.split(values[:total], list(counts)))


@dataclass
class EndpointStats:
    """Counters of what the endpoint has served (calls = formed batches)."""

    calls: int = 0
    requests: int = 0
    rows: int = 0
    padded_rows: int = 0

    @property
    def mean_formed_batch_rows(self) -> float:
        return self.rows / self.calls if self.calls else 0.0
