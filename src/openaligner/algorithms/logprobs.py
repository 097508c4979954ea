"""Log-probabilities of given tokens and entropies, from logits.

Pure tensor math; the models module calls these on its logits so that the numerics (temperature,
stability) are defined and tested in one place.
"""

from __future__ import annotations

import torch


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of ``tokens`` under ``softmax(logits / temperature)``.

    Computed as ``gathered_logit − logsumexp(logits)`` in float32 (or wider), which needs no
    [.., V] log-softmax buffer and is stable for large logits.

    Args:
        logits: [..., V].
        tokens: [...] int64 ids, same leading shape as ``logits``.
        temperature: the sampling temperature; log-probs must match the sampling distribution.

    Returns:
        [...] float log-probs (float32 for half-precision logits).
    """
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        x = x / temperature
    picked = x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(x, dim=-1)


def next_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Next-token-aligned log-probs: position ``t`` scores token ``t+1``.

    Args:
        logits: [B, S, V] logits of a forward pass over ``tokens``.
        tokens: [B, S].

    Returns:
        [B, S-1].
    """
    return logprobs_from_logits(logits[:, :-1], tokens[:, 1:], temperature)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` along the last axis: [..., V] → [...]."""
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        x = x / temperature
    log_p = torch.log_softmax(x, dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)
