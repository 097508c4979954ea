"""A causal LM's final hidden states and output head, apart: the path that scores tokens a few
positions at a time without the whole [B, S, V] logits of a large vocabulary.

Owns the body/head split (``base_model`` + ``get_output_embeddings``, LoRA and tied weights
included), the head as the model's own forward applies it (Gemma 2's soft-capping), the budget
rule that picks the positions per chunk (``logits_chunk_mb``), and the once-per-model check that
body + head reproduce the model's own logits. The actor and the SFT loss both score through it;
the chunked math is :func:`openaligner.algorithms.chunked_token_stats`. Must not know about
sampling, losses, trainers or configs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from openaligner.models.lora import unwrap
from openaligner.models.precision import Precision
from openaligner.models.sharding import is_sharded

LOGITS_CHUNK_MB = 256.0
"""Default largest float32 logits block built at once (``logits_chunk_mb``): a 262,144-token
vocabulary fills it with 256 positions."""


def check_logits_chunk_mb(logits_chunk_mb: float | None) -> None:
    """Refuse a budget that is neither > 0 (MiB) nor None (always the whole logits)."""
    if logits_chunk_mb is not None and not logits_chunk_mb > 0:
        raise ValueError(f"logits_chunk_mb must be > 0 or None, got {logits_chunk_mb}")


def body_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module, int]:
    """A causal LM's body (``base_model``: embeddings, layers, final norm), its output layer (with
    LoRA, the adapted model's, possibly itself adapted) and the vocabulary size it scores.

    Raises:
        TypeError: the model has no such parts.
    """
    inner: Any = unwrap(model)
    body, layer = getattr(inner, "base_model", None), inner.get_output_embeddings()
    weight = getattr(getattr(layer, "base_layer", layer), "weight", None)
    if not isinstance(body, nn.Module) or not isinstance(layer, nn.Module) or weight is None or body is inner:
        raise TypeError(f"{type(inner).__name__} has no body and output layer to score in chunks")
    return body, layer, int(weight.shape[0])


def attention_mask(tokens: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """[B, S] int64 attention mask of right-padded ``tokens`` [B, S] with ``lengths`` [B]."""
    if lengths is None:
        return torch.ones_like(tokens)
    col = torch.arange(tokens.shape[1], device=tokens.device)
    return (col < lengths.to(tokens.device).unsqueeze(-1)).long()


def chunk_columns(logits_chunk_mb: float | None, model: nn.Module, rows: int, columns: int) -> int | None:
    """Positions per chunk of the output head for ``rows`` × ``columns`` scored positions, or
    None: the whole logits at once (they fit ``logits_chunk_mb``, there is no budget, the model is
    sharded — FSDP's root module owns the output head and gathers it only inside the model's own
    forward — or it has no body and head to split)."""
    if logits_chunk_mb is None or rows * columns == 0 or is_sharded(model):
        return None
    try:
        _, _, vocab = body_and_head(model)
    except TypeError:
        return None  # the whole logits, as the model's own forward gives them
    fit = int(logits_chunk_mb * 2**20) // (rows * vocab * 4)
    return None if fit >= columns else max(1, fit)


def final_hidden(
    model: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor | None, first_position: int = 0
) -> torch.Tensor:
    """The final hidden states feeding the output head at positions ``first_position`` … S-2 of
    right-padded ``tokens`` [B, S]: [B, S-1-first_position, H] (the model's body alone: no logits).
    Runs under whatever context (autocast, fused kernels) the caller holds."""
    body, _, _ = body_and_head(model)
    out = body(input_ids=tokens, attention_mask=attention_mask(tokens, lengths), use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    assert isinstance(hidden, torch.Tensor)
    return hidden[:, first_position : tokens.shape[1] - 1]


def output_head(
    model: nn.Module, precision: Precision | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """[..., H] → [..., V]: the output layer (under ``precision``'s autocast when given), soft-capped
    as the model's own forward does (Gemma 2's ``final_logit_softcapping``)."""
    _, layer, _ = body_and_head(model)
    cap = getattr(unwrap(model).config, "final_logit_softcapping", None)
    autocast = (precision or Precision()).autocast

    def head(hidden: torch.Tensor) -> torch.Tensor:
        with autocast():
            logits = layer(hidden)
        assert isinstance(logits, torch.Tensor)
        return torch.tanh(logits / cap) * cap if cap else logits

    return head


def check_output_head(
    model: nn.Module,
    precision: Precision | None = None,
    context: Callable[[], AbstractContextManager[object]] = nullcontext,
) -> None:
    """That body + head give the model's own logits, on 8 positions (an architecture that scales or
    post-processes its logits in a way :func:`output_head` does not know is refused instead of
    scored wrong). Meant to run once per model; runs in eval mode (no dropout) without gradient,
    both forwards under ``context()`` (e.g. the caller's fused kernels) and ``precision``'s autocast.

    Raises:
        RuntimeError: they differ (beyond 1e-4 of the largest logit in float32, 2e-2 under a mixed
            precision); the message names ``trainer.logits_chunk_mb=null``.
    """
    precision = precision or Precision()
    _, _, vocab = body_and_head(model)
    device = next(iter(model.parameters())).device
    tokens = (torch.arange(9, device=device) * 7919 % vocab).unsqueeze(0)
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), context(), precision.autocast():
            out = model(input_ids=tokens, attention_mask=torch.ones_like(tokens), use_cache=False)
            own = out.logits[:, :-1].float()
            mine = output_head(model, precision)(final_hidden(model, tokens, None)).float()
    finally:
        model.train(training)
    scale = float(own.abs().max()) + 1.0
    tolerance = (1e-4 if precision.compute_dtype == torch.float32 else 2e-2) * scale
    if not torch.allclose(mine, own, rtol=0.0, atol=tolerance):
        raise RuntimeError(
            f"{type(unwrap(model)).__name__}: its body and output head do not reproduce its own "
            f"logits (max difference {float((mine - own).abs().max()):.3g}), so chunked log-probs "
            "would be wrong for it; set trainer.logits_chunk_mb=null (the whole logits at once)"
        )
