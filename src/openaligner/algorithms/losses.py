"""The clipped PPO policy loss, the clipped value loss and their diagnostics.

Pure: tensors in, a scalar loss plus a frozen dataclass of detached scalar tensors out (no
``.item()``, so no device sync inside the training step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from openaligner.algorithms.kl import KLKind, kl_penalty
from openaligner.algorithms.masked import Reduce, masked_mean, masked_mean_var, masked_sum, select_valid

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)


@dataclass(frozen=True)
class PolicyLossStats:
    """Detached scalar diagnostics of one policy-loss call (over the response mask)."""

    clip_fraction: torch.Tensor  # share of tokens whose ratio left [1-ε, 1+ε_high]
    dual_clip_fraction: torch.Tensor  # share of negative-advantage tokens capped by the dual clip
    approx_kl: torch.Tensor  # k3 estimate of KL(old ‖ new): mean of (ratio − 1) − log ratio
    ratio_mean: torch.Tensor  # NeMo-Aligner's ppo_ratio
    ratio_clamped_mean: torch.Tensor  # NeMo-Aligner's ppo_ratio_clamped
    entropy: torch.Tensor  # mean per-token entropy (0 when none was given)
    pg_loss: torch.Tensor  # the policy-gradient part, before the entropy bonus
    kl_loss: torch.Tensor  # the KL term before its coefficient (0 when there is none)
    tokens: torch.Tensor  # valid tokens: the weight of the token means above when combining batches
    negative_tokens: torch.Tensor  # valid tokens with a negative advantage: dual_clip_fraction's weight


@dataclass(frozen=True)
class ValueLossStats:
    """Detached scalar diagnostics of one value-loss call."""

    clip_fraction: torch.Tensor  # share of tokens whose value moved more than the clip
    explained_variance: torch.Tensor  # 1 − Var(R − V) / Var(R), of the given values
    values_mean: torch.Tensor
    returns_mean: torch.Tensor


def aggregation_units(mask: torch.Tensor, aggregation: LossAggregation) -> torch.Tensor:
    """What ``aggregation`` divides by, counted in ``mask`` [B, S-1] (a 0-d tensor of ``mask``'s
    float dtype, float32 for an integer or bool mask).

    ``token_mean``: the valid tokens. ``seq_mean_token_mean`` and ``seq_mean_token_sum_norm``: the
    samples that have a valid token. Counts add up: the units of a batch are the sum of its
    micro-batches' (and ranks') units, which is what makes a step's loss independent of how the
    step is split (:func:`aggregate` with ``units``).
    """
    m = mask if mask.is_floating_point() else mask.to(torch.float32)
    if aggregation == "token_mean":
        return (m != 0).to(m.dtype).sum()
    if aggregation in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        return (m != 0).any(dim=-1).to(m.dtype).sum()
    raise ValueError(f"unknown loss aggregation {aggregation!r}; expected one of {LOSS_AGGREGATIONS}")


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    aggregation: LossAggregation,
    norm_length: int | None = None,
    units: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, S-1] to a scalar: a sum over the batch divided by ``units``.

    ``token_mean``: every valid token weighs the same (NeMo-Aligner, PPO2): the sum of the valid
    tokens' losses over the number of valid tokens.
    ``seq_mean_token_mean``: mean per sample, then mean over samples that have a valid token
    (each sample weighs the same regardless of length; GRPO).
    ``seq_mean_token_sum_norm``: each sample's token *sum* divided by the constant
    ``norm_length`` (the generation budget), then the mean over samples that have a valid token
    (Dr. GRPO, Liu et al. 2025: a token weighs the same in a long and a short response, without
    ``token_mean``'s dependence on the batch's total length). Example: losses [[1, 1, 0], [2, 0,
    0]], mask [[1, 1, 0], [1, 0, 0]], norm_length 4 → (2/4 + 2/4) / 2 = 0.5.

    ``units`` is the denominator: ``None`` counts it in this batch (:func:`aggregation_units`),
    so the result is the batch's own mean. A trainer that splits one optimizer step's batch into
    micro-batches (and ranks) passes the units of the *whole* step instead: each micro-batch then
    returns its share of the step's loss, and the shares sum to the loss — and their gradients to
    the gradient — of the step's batch in one piece, whatever the split. Example: token losses
    [1, 1, 1, 1] (one sample of 4 tokens) and [5] (one of 1), token_mean: alone they give 1 and
    5, whose mean is 3; with ``units`` = 5 they give 4/5 and 5/5, which sum to 9/5, the mean of
    the five tokens.
    """
    if aggregation == "token_mean":
        total = masked_sum(loss, mask)
    elif aggregation == "seq_mean_token_mean":
        total = masked_mean(loss, mask, dim=-1).sum()  # a sample without valid tokens adds 0
    elif aggregation == "seq_mean_token_sum_norm":
        if norm_length is None or norm_length < 1:
            raise ValueError(f"seq_mean_token_sum_norm needs norm_length >= 1, got {norm_length}")
        total = masked_sum(loss, mask, dim=-1).sum() / norm_length
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; expected one of {LOSS_AGGREGATIONS}")
    count = aggregation_units(mask, aggregation) if units is None else units
    return total / torch.as_tensor(count, dtype=total.dtype, device=total.device).clamp_min(1.0)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    *,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: LossAggregation = "token_mean",
    norm_length: int | None = None,
    is_end: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    init_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
    units: torch.Tensor | float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Clipped surrogate objective of PPO (Schulman et al. 2017, eq. 7), as a loss to minimise.

    ``ratio = exp(logprobs − old_logprobs)``; per token
    ``pg = max(−A·ratio, −A·clip(ratio, 1−ε, 1+ε_high))``; with ``dual_clip = c > 1`` the loss of
    negative-advantage tokens is further capped at ``−c·A`` (Ye et al. 2020). Inside the clip
    range the loss is exactly ``−A·ratio``.

    Args:
        logprobs: [B, S-1] log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: [B, S-1] the same under the rollout policy.
        advantages: [B, S-1].
        mask: [B, S-1], 1 on response tokens.
        clip_eps: ε (NeMo-Aligner's ``ratio_eps``, default there 0.2).
        clip_eps_high: upper ε ("clip-higher"); defaults to ``clip_eps``.
        dual_clip: the dual-clip constant c (> 1) or ``None``.
        aggregation: see :func:`aggregate` (``norm_length`` with it).
        is_end: [B] bool; when given, samples that never ended get no policy gradient
            (NeMo-Aligner's default gating).
        entropy: [B, S-1] per-token entropy of the current policy (with grad) for the bonus.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        init_logprobs: [B, S-1] log-probs of the sampled tokens under the initial policy; with
            ``kl_coef`` > 0, ``kl_coef · aggregate(KL_kind(logprobs, init_logprobs))`` is added to the
            loss: the KL as a loss term (GRPO, DeepSeekMath eq. 4, with ``k3``), its gradient
            through ``logprobs`` only.
        units: the denominator of the policy-gradient term, the entropy bonus and the KL term
            (see :func:`aggregate`): ``None`` is this batch's own count, so the loss is this
            batch's mean; a trainer passes the :func:`aggregation_units` of the whole optimizer
            step's batch (with the ``is_end`` gating, all micro-batches and ranks together), and
            the loss — ``pg_loss``, ``entropy`` and ``kl_loss`` in the stats too — is then this
            micro-batch's share of the step's, to be summed.
        is_weights: [B, S-1] per-token weights of the policy-gradient term after clipping
            (truncated importance sampling, :func:`~openaligner.algorithms.truncated_is_weights`;
            no gradient flows through them); ``None`` weighs every token 1.

    Returns:
        ``(loss, stats)``. With no valid token the loss is 0 with zero gradient. The other stats
        are means over this batch's valid tokens, whatever ``units``; ``tokens`` and
        ``negative_tokens`` weigh them when combining batches. Values outside
        the mask (even inf/NaN log-probs or advantages) change neither the loss, its gradient
        nor the stats: they are selected away before any arithmetic.
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    m = mask.to(logprobs.dtype)
    loss_mask = m * is_end.to(m.dtype).unsqueeze(-1) if is_end is not None else m
    advantages = select_valid(advantages, m)

    log_ratio = select_valid(logprobs - old_logprobs, m)
    ratio = torch.exp(log_ratio)
    ratio_clamped = ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)
    pg = torch.maximum(-advantages * ratio, -advantages * ratio_clamped)
    dual_capped = torch.zeros_like(pg, dtype=torch.bool)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual_capped = (advantages < 0) & (pg > cap)
        pg = torch.where(advantages < 0, torch.minimum(pg, cap), pg)
    if is_weights is not None:
        pg = pg * select_valid(is_weights.detach().to(pg.dtype), m)

    pg_loss = aggregate(pg, loss_mask, aggregation, norm_length, units)
    loss = pg_loss
    entropy_mean = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    if entropy is not None:
        entropy_mean = aggregate(select_valid(entropy, m), loss_mask, aggregation, norm_length, units)
        loss = loss - entropy_coef * entropy_mean
    kl_term = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    if init_logprobs is not None and kl_coef > 0:
        per_token = kl_penalty(select_valid(logprobs, m), select_valid(init_logprobs, m), kl_kind)
        kl_term = aggregate(select_valid(per_token, m), loss_mask, aggregation, norm_length, units)
        loss = loss + kl_coef * kl_term

    with torch.no_grad():
        clipped = (ratio < 1.0 - clip_eps) | (ratio > 1.0 + eps_high)
        negative = (advantages < 0).to(m.dtype) * m
        stats = PolicyLossStats(
            clip_fraction=masked_mean(clipped.to(m.dtype), m),
            dual_clip_fraction=masked_mean(dual_capped.to(m.dtype), negative),
            approx_kl=masked_mean(torch.expm1(log_ratio) - log_ratio, m),
            ratio_mean=masked_mean(ratio, m),
            ratio_clamped_mean=masked_mean(ratio_clamped, m),
            entropy=entropy_mean.detach(),
            pg_loss=pg_loss.detach(),
            kl_loss=kl_term.detach(),
            tokens=m.sum(),
            negative_tokens=negative.sum(),
        )
    return loss, stats


def explained_variance(
    predictions: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    """``1 − Var(targets − predictions) / Var(targets)`` over valid positions (a scalar).

    1 is a perfect critic, 0 predicts no better than the mean, negative is worse. Returns NaN
    when the targets have zero variance, as the quantity is undefined there. With ``reduce``
    (see :func:`masked_mean_var`) the variances are global across processes.

    Shapes: ``predictions``, ``targets`` and ``mask`` alike (e.g. [B, S-1]) → a 0-d tensor.
    """
    _, var_t = masked_mean_var(targets, mask, reduce=reduce)
    _, var_r = masked_mean_var(targets - predictions, mask, reduce=reduce)
    return torch.where(var_t > 0, 1.0 - var_r / var_t, torch.full_like(var_t, float("nan")))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    units: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, ValueLossStats]:
    """Clipped value loss of PPO2: ``0.5·masked_mean(max((V_clip − R)², (V − R)²))``.

    ``V_clip = old + clip(V − old, −clip, clip)``; ``clip`` of ``None`` or ≤ 0 disables clipping
    (plain ``0.5·masked_mean((V − R)²)``). Token mean over the mask (NeMo-Aligner's critic).

    Args:
        values: [B, S-1] current critic values (with grad).
        old_values: [B, S-1] values at rollout time.
        returns: [B, S-1] GAE returns (targets).
        mask: [B, S-1].
        units: the token count the loss divides by (see :func:`aggregate`, ``token_mean``):
            ``None`` counts this batch's valid tokens; a trainer passes those of the whole
            optimizer step, and the loss is then this micro-batch's share of the step's.

    Returns:
        ``(loss, stats)``; the stats are this batch's own. Positions outside the mask never
        change the loss, its gradient or the stats (selected away first, so inf/NaN there stays
        harmless).
    """
    values = select_valid(values, mask)
    old_values = select_valid(old_values, mask)
    returns = select_valid(returns, mask)
    unclipped = (values - returns).square()
    if clip is not None and clip > 0:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        per_token = torch.maximum((clipped_values - returns).square(), unclipped)
    else:
        per_token = unclipped
    loss = 0.5 * aggregate(per_token, mask, "token_mean", units=units)
    with torch.no_grad():
        moved = (
            (values - old_values).abs() > clip if clip is not None and clip > 0 else torch.zeros_like(mask)
        )
        stats = ValueLossStats(
            clip_fraction=masked_mean(moved.to(values.dtype), mask),
            explained_variance=explained_variance(values, returns, mask),
            values_mean=masked_mean(values, mask),
            returns_mean=masked_mean(returns, mask),
        )
    return loss, stats
