"""FLOP accounting for the benchmarks: the machine's fp32 matmul peak and a GPT's training FLOPs.

Imported by the benchmark scripts in this folder (``python benchmarks/<script>.py`` puts the
folder on ``sys.path``).

Training FLOPs of a decoder-only transformer, per token of a sequence of S tokens
(Kaplan et al. 2020; Chowdhery et al. 2022, appendix B), forward + backward:

    6 · N + 12 · L · d · S

with N the parameters that take part in matrix multiplies (per layer 12·d² for GPT-2's QKV,
attention output and 4·d MLP, plus the d·V output head; embeddings are look-ups and count 0;
for Llama/Qwen2-style models with grouped key/value heads and a gated MLP, per layer
2·d² + 2·d·d_kv for the projections and 3·d·mlp for the MLP),
L layers, width d; the second term is the attention scores (Q·Kᵀ) and the weighted values (A·V),
2 · 2·S·d per token and layer in the forward pass, times 3 for forward + backward, counted over
the full S × S square (what the fused attention kernel computes with a padding mask). A forward
pass alone is a third of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GPTShape:
    """The dimensions that set a GPT's FLOPs."""

    layers: int  # L
    width: int  # d
    vocab: int  # V
    mlp: int  # MLP inner width (4·d for GPT-2)
    kv_width: int | None = None  # d_kv: key/value heads × head size (grouped-query attention); None = d
    gated: bool = False  # a gated MLP (gate, up and down projections: Llama, Qwen2) instead of two

    @property
    def matmul_params(self) -> int:
        """N: Q and attention output (2d²) + K and V (2·d·d_kv) + MLP (2 or 3 · d·mlp) per layer,
        plus the d·V head."""
        d = self.width
        kv = d if self.kv_width is None else self.kv_width
        mlp = (3 if self.gated else 2) * d * self.mlp
        return self.layers * (2 * d * d + 2 * d * kv + mlp) + d * self.vocab

    def train_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs per token: 6·N + 12·L·d·S."""
        return 6.0 * self.matmul_params + 12.0 * self.layers * self.width * seq_len

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token: 2·N + 4·L·d·S."""
        return self.train_flops_per_token(seq_len) / 3.0


def gpt2_shape(config: Any) -> GPTShape:
    """:class:`GPTShape` of a transformers ``GPT2Config``."""
    d = int(config.n_embd)
    return GPTShape(
        layers=int(config.n_layer), width=d, vocab=int(config.vocab_size), mlp=int(config.n_inner or 4 * d)
    )


def llama_shape(config: Any) -> GPTShape:
    """:class:`GPTShape` of a Llama-style transformers config (``LlamaConfig``, ``Qwen2Config``):
    grouped key/value heads and a gated MLP."""
    d = int(config.hidden_size)
    head = int(getattr(config, "head_dim", None) or d // int(config.num_attention_heads))
    return GPTShape(
        layers=int(config.num_hidden_layers),
        width=d,
        vocab=int(config.vocab_size),
        mlp=int(config.intermediate_size),
        kv_width=int(config.num_key_value_heads) * head,
        gated=True,
    )


def matmul_peak_flop_per_s(threads: int, n: int = 2048, repeats: int = 5) -> float:
    """Best fp32 FLOP/s of an ``n × n @ n × n`` matmul at ``threads`` torch threads.

    The best of ``repeats`` timed products after one warm-up, so that a burst of load from other
    processes lowers it as little as possible; the caller's thread setting is restored.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g)
        b = torch.randn(n, n, generator=g)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - t0)
        return 2.0 * n**3 / best
    finally:
        torch.set_num_threads(before)
