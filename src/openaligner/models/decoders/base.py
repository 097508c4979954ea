"""The interface between the sampling loop and a decoder: the :class:`Decoder` protocol.

Owns the contract only (what a decoder is called with and returns, who owns the KV cache); knows no
architecture and no sampling rule.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

CacheKind = Literal["static", "dynamic"]
"""The Hugging Face KV cache of the general decoder: preallocated (``static``) or growing (``dynamic``)."""


class Decoder(Protocol):
    """Steps a causal LM over the left-padded token buffer of
    :func:`openaligner.models.generation.generate`, owning its KV cache.

    A decoder is made for one batch with the ``attention`` mask [B, T] (0 on left padding, 1
    elsewhere) and ``T = max(prompt_lengths) + max_new_tokens``; its rows are the mask's rows minus
    those dropped by :meth:`select_rows`. It returns logits in any floating dtype; the sampling
    loop picks the tokens.
    """

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run the left-padded prompts [B, P] at position ids [B, P]; next-token logits [B, V]."""
        ...

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, column: int) -> torch.Tensor:
        """Append ``tokens`` [B] at buffer ``column`` with position ids [B]; logits [B, V]."""
        ...

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` [B'] (indices into the current rows) of the cache and the mask."""
        ...
