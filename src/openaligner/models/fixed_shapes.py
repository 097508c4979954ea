"""The batch-invariant forward: every row computed in a shape that depends on that row alone.

Owns :class:`FixedShapes` (rows grouped by their own width rounded up to a multiple, each forward
exactly ``rows`` rows, topped up with filler rows) and the filler both it and the servers' batch
shaping use (:data:`PAD_TOKEN_ID`, :data:`PAD_ROW_LENGTH`). The inference servers run
``critic_infer`` and the reward model through :meth:`FixedShapes.run`; the critic's trainer builds
its training forwards from :meth:`FixedShapes.groups` and :meth:`FixedShapes.block`. Pure torch:
must not know about servers, trainers, models' classes or torch.distributed. Design notes:
docs/serving.md, "Batch-invariant serving".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

PAD_TOKEN_ID = 0
"""Filler for padded rows and columns; never read, since every row is cut at its length (or
masked out of the loss)."""
PAD_ROW_LENGTH = 1
"""Length given to padded rows: 1 keeps them legal for models that refuse a length of 0."""

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

    def block(
        self, t: torch.Tensor, index: torch.Tensor, fill: float, width: int | None = None
    ) -> torch.Tensor:
        """The rows ``index`` of ``t`` ([B] or [B, S]) as one forward's input, [rows] or
        [rows, width]: each row cut to ``width`` columns or padded with ``fill`` to it (None: as
        ``t``), then filler rows of ``fill`` after them up to ``rows``."""
        out = t.new_full((self.rows, *t.shape[1:]) if width is None else (self.rows, width), fill)
        if t.dim() == 1:
            out[: index.numel()] = t[index]
        else:
            cut = min(out.shape[1], t.shape[1])
            out[: index.numel(), :cut] = t[index, :cut]
        return out

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
            cut = min(width, tokens.shape[1])
            block = self.block(tokens, index, PAD_TOKEN_ID, width)
            block_lengths = self.block(lengths, index, PAD_ROW_LENGTH)
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
