"""Shaping a formed batch for the forward pass, and undoing it for the answers.

Owns four pure steps on torch tensors: merge the requests Triton formed into one right-padded
batch, strip trailing padding columns to a multiple, pad the batch dimension so every rank gets
whole micro-batches, split results back per request without the padded rows; the batch-invariant
forward (:class:`FixedShapes`); and an endpoint's counters of what it batched (:class:`EndpointStats`).
Must not know about PyTriton, validation, models or torch.distributed (the data-parallel size is a
plain integer here).

Shapes: B rows, S columns; ``tokens`` [B, S] int64 right-padded, ``lengths`` [B] int64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

PAD_TOKEN_ID = 0
"""Filler for padded rows and columns; never read, since every row is cut at its length."""
PAD_ROW_LENGTH = 1
"""Length given to padded rows: 1 keeps them legal for models that refuse a length of 0."""


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


INVARIANT_WIDTH_MULTIPLE = 16
"""The compute-width multiple of the batch-invariant forward when
``strip_sequence_length_to_multiple`` is null."""

RowsForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(tokens [R, W] int64, lengths [R] int64) -> [R]`` (one score per row) or ``[R, W]`` (a value
per position)."""


@dataclass(frozen=True)
class FixedShapes:
    """The batch-invariant forward: every row is computed in a micro-batch of exactly ``rows`` rows
    at a width of its own length rounded up to ``multiple``, whatever it was merged with.

    On a CPU (and on GPUs without batch-invariant kernels) a matrix product's rounding depends on
    its shape: the same row scored alone and beside 31 others differs in its last bits, because the
    kernel blocks and sums its reduction by the whole product's size (measured on the canonical
    GPT-2 reward model: 1.5e-7 between a row alone at its length and in a batch stripped to a
    longer row's length; rows 1–3 vs 4+ at one width differ too). Here the shape of each forward
    is a function of the row alone — rows of equal compute width share micro-batches, which are
    topped up with filler rows — so its outputs are bitwise those it gets alone, in any position,
    beside any rows, at any padding width the request had (tested, fp32 and bf16). The price is
    the filler rows (a formed batch smaller than ``rows`` is computed as ``rows`` rows) and the
    width rounding: docs/benchmarks.md, "Batch-invariant serving".

    Args:
        rows: rows per forward (the server's ``model_forward_micro_batch_size``).
        multiple: compute-width multiple (``strip_sequence_length_to_multiple``, else
            :data:`INVARIANT_WIDTH_MULTIPLE`).
    """

    rows: int
    multiple: int

    def width(self, length: int) -> int:
        """The compute width of a row of ``length`` tokens: ``ceil(length / multiple) * multiple``."""
        return -(-max(length, 1) // self.multiple) * self.multiple

    def groups(self, lengths: torch.Tensor) -> list[tuple[list[int], int]]:
        """The forwards for ``lengths`` [B]: ``(row indices, width)`` each, at most ``rows`` rows,
        rows of one width together in their order, widths in the order their first row comes."""
        by_width: dict[int, list[int]] = {}  # insertion-ordered: the same batch, the same forwards
        for i, n in enumerate(lengths.reshape(-1).tolist()):
            by_width.setdefault(self.width(int(n)), []).append(i)
        return [
            (members[k : k + self.rows], width)
            for width, members in by_width.items()
            for k in range(0, len(members), self.rows)
        ]

    def forwards(self, lengths: torch.Tensor, world: int) -> int:
        """The most forwards any of ``world`` ranks runs on its equal contiguous share of
        ``lengths`` (a sharded model's forwards are collectives: every rank runs this many)."""
        if lengths.numel() == 0:
            return 0
        return max(len(self.groups(share)) for share in lengths.reshape(-1).chunk(world))

    def run(
        self, forward: RowsForward, tokens: torch.Tensor, lengths: torch.Tensor, forwards: int = 0
    ) -> torch.Tensor:
        """``forward`` over ``tokens`` [B, S] / ``lengths`` [B] in fixed shapes, put back in order.

        ``forwards``: run filler-only forwards until this many have run (see :meth:`forwards`).

        Returns:
            [B] when ``forward`` gives one value per row, else [B, S]: each row's values at its
            first ``min(width, S)`` positions, 0 beyond (``forward`` gives 0 past a row's length).
        """
        lengths = lengths.reshape(-1)
        groups = self.groups(lengths)
        out: torch.Tensor | None = None
        for members, width in groups:
            index = torch.tensor(members, dtype=torch.long, device=tokens.device)
            block = tokens.new_full((self.rows, width), PAD_TOKEN_ID)
            cut = min(width, tokens.shape[1])
            block[: len(members), :cut] = tokens[index, :cut]
            block_lengths = lengths.new_full((self.rows,), PAD_ROW_LENGTH)
            block_lengths[: len(members)] = lengths[index]
            result = forward(block, block_lengths)[: len(members)]
            if out is None:
                shape = (tokens.shape[0],) if result.dim() == 1 else (tokens.shape[0], tokens.shape[1])
                out = result.new_zeros(shape)
            if result.dim() == 1:
                out[index.to(out.device)] = result
            else:
                out[index.to(out.device), :cut] = result[:, :cut]
        for _ in range(forwards - len(groups)):  # a sharded model's collectives, nothing to keep
            forward(tokens.new_full((self.rows, self.multiple), PAD_TOKEN_ID), lengths.new_ones(self.rows))
        if out is None:  # no rows: the forward's own answer to an empty batch
            return forward(tokens, lengths)
        return out


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
