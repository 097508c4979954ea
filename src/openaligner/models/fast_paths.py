"""Which speed path runs for a model: the one place that picks the decoder generation steps and the
context the scoring and training forwards run in.

Owns the selection rules only; the paths themselves live in :mod:`openaligner.models.decoders` and
:mod:`openaligner.models.fast_forward`. A new engine (GPU kernels, a sharded model) plugs in here
with one rule. Knows nothing of sampling, log-probs or losses.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn
from transformers import GPT2LMHeadModel, PreTrainedModel

from openaligner.models.decoders.base import CacheKind, Decoder
from openaligner.models.decoders.gpt2 import GPT2Decoder, gpt2_fast_path_supported
from openaligner.models.decoders.hf import HFDecoder
from openaligner.models.fast_forward import fused_tanh_gelu


def make_decoder(
    model: PreTrainedModel,
    attention: torch.Tensor,
    total: int,
    cache: CacheKind = "static",
    fast_path: bool = True,
) -> Decoder:
    """The GPT-2 decoder when ``fast_path`` and :func:`gpt2_fast_path_supported`, else the model's
    forward with a Hugging Face ``cache``. ``attention`` [B, total]: 0 on left padding, 1 elsewhere."""
    if cache not in ("static", "dynamic"):
        raise ValueError(f"unknown cache kind {cache!r}; expected 'static' or 'dynamic'")
    if fast_path and gpt2_fast_path_supported(model):
        assert isinstance(model, GPT2LMHeadModel)
        return GPT2Decoder(model, attention, total)
    return HFDecoder(model, attention, total, cache)


def scoring_forward(model: nn.Module) -> AbstractContextManager[None]:
    """The context a full-sequence forward of ``model`` that scores tokens (log-probs, the training
    loss) runs in: every ``gelu_new`` fused (:func:`fused_tanh_gelu`; a no-op without one)."""
    return fused_tanh_gelu(model)
