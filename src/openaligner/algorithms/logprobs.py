"""Log-probabilities of given tokens and entropies, from logits.

Pure tensor math; the models module calls these on its logits so that the numerics (temperature,
stability) are defined and tested in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch.utils.checkpoint import checkpoint


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


Head = Callable[[torch.Tensor, int], torch.Tensor]
"""``(hidden [B, t, H], first column c0) → logits [B, t, V]`` of those columns, as sampling saw
them (before the temperature)."""


def chunked_token_stats(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Head,
    temperature: float,
    chunk: int,
    *,
    entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` and entropies, computed ``chunk`` columns at a time from the hidden
    states that feed the output head: the [B, T, V] logits never exist at once.

    Each chunk's logits exist only while that chunk is computed. Under autograd each chunk is
    recomputed in the backward (activation checkpointing), so the backward holds one chunk's
    logits too, not all of them: peak logits memory is B × ``chunk`` × V floats instead of
    B × T × V. The numbers are those of :func:`logprobs_from_logits` and
    :func:`entropy_from_logits` on the whole logits (the same functions run on each chunk).

    Args:
        hidden: [B, T, H]; column ``c`` predicts ``targets[:, c]``.
        targets: [B, T] int64.
        head: the output head (see :data:`Head`).
        temperature: the sampling temperature.
        chunk: columns per chunk (≥ 1).
        entropy: whether to compute the entropies at all.
        entropy_grad: whether the entropies carry gradient; otherwise they are detached.

    Returns:
        ``(logprobs, entropy)``, both [B, T] float32 (float64 for float64 logits); ``entropy``
        None unless asked for.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    recompute = torch.is_grad_enabled() and hidden.requires_grad

    def stats(h: torch.Tensor, tgt: torch.Tensor, c0: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(h, c0)
        lp = logprobs_from_logits(logits, tgt, temperature)
        if not entropy:
            return lp, lp.new_zeros(())
        with nullcontext() if entropy_grad else torch.no_grad():
            ent = entropy_from_logits(logits, temperature)
        return lp, ent

    lps, ents = [], []
    for c0 in range(0, hidden.shape[1], chunk):
        h, tgt = hidden[:, c0 : c0 + chunk], targets[:, c0 : c0 + chunk]
        if recompute:
            lp, ent = checkpoint(stats, h, tgt, c0, use_reentrant=False)
        else:
            lp, ent = stats(h, tgt, c0)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(hidden.shape[:2], dtype=torch.float32)
        return empty, empty.clone() if entropy else None
    return torch.cat(lps, dim=1), torch.cat(ents, dim=1) if entropy else None


def logprob_mismatch(
    engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far a rollout engine's log-probs of the sampled tokens are from the trainer's own.

    With ``d = |engine − trainer|`` on the masked positions:
    ``logprob_diff_mean`` = mean d, ``logprob_diff_max`` = max d, and ``token_prob_error`` =
    mean exp(d), NeMo-RL's token-probability error (1 when they agree; 1.01 ≈ 1 % apart per token).
    E.g. d = [0.0, 0.1, 0.3] → mean 0.1333, max 0.3, error (1 + 1.1052 + 1.3499) / 3 = 1.1517.

    Args:
        engine_logprobs: [B, S-1].
        trainer_logprobs: [B, S-1].
        mask: [B, S-1], 1 = a position to compare.

    Returns:
        0-dim float64 tensors under the three names (0, 0 and 1 when the mask is empty).
    """
    keep = mask.bool()
    d = (engine_logprobs.double() - trainer_logprobs.double()).abs()[keep]
    if d.numel() == 0:
        zero = torch.zeros((), dtype=torch.float64)
        return {"logprob_diff_mean": zero, "logprob_diff_max": zero, "token_prob_error": zero + 1}
    return {"logprob_diff_mean": d.mean(), "logprob_diff_max": d.max(), "token_prob_error": d.exp().mean()}


def truncated_is_weights(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance-sampling weights for tokens a rollout engine sampled:
    ``min(exp(trainer − engine), cap)`` per token, i.e. ``min(π_trainer / π_engine, cap)`` (Yao et
    al. 2025, "truncated importance sampling", as in veRL and slime). The engine's sampler differs
    from the trainer's numerics (kernels, precision); these weights correct the policy gradient,
    computed as if the trainer had sampled, toward the engine's actual sampling distribution, and
    the cap bounds their variance. E.g. trainer ``[-1.0, -2.0]``, engine ``[-1.1, -1.0]``, cap 2
    → ``[exp(0.1), exp(-1.0)]`` = ``[1.1052, 0.3679]``; a ratio of 3 becomes 2.

    Shapes: ``trainer_logprobs`` and ``engine_logprobs`` [B, S-1] → [B, S-1] float32 weights,
    without gradient (masked positions are to be ignored by the caller).
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    with torch.no_grad():
        ratio = torch.exp(trainer_logprobs.double() - engine_logprobs.double())
        return ratio.clamp(max=cap).float()
