"""Turn one rollout (tokens, log-probs, scores, values) into training data and rollout metrics.

This is the trainer's ``generate_ppo_data`` step as plain functions (:func:`compute_ppo_data`):
the response mask, the per-token KL and the adjusted scores, then the advantages of the estimator
the registry (:mod:`openaligner.trainer.estimators`) holds under the run's name, its metrics and
the optional global whitening; all the math from :mod:`openaligner.algorithms`.
Cross-rank statistics go through a ``reduce`` callable (all-reduce SUM under torch.distributed,
identity on one process), so this module makes no distributed calls of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from openaligner.algorithms import (
    KLKind,
    Reduce,
    adjust_scores,
    explained_variance,
    kl_penalty,
    masked_mean,
    masked_mean_var,
    masked_sum,
    response_mask,
    returns_to_go,
    single_process,
    truncated_is_weights,
    value_error_by_position,
    wrong_sign_fraction,
)
from openaligner.trainer.estimators import EstimatorInputs, get_estimator


@dataclass
class RolloutBatch:
    """One rollout, local to this rank. ``S`` = padded sequence length."""

    sequence_tokens: torch.Tensor  # [B, S] int64, prompt + response, padded after the response
    sequence_lengths: torch.Tensor  # [B] int64, prompt + response
    prompt_lengths: torch.Tensor  # [B] int64
    is_end: torch.Tensor  # [B] bool, ended on a stop token
    # [B, S-1] policy log-probs at rollout time; None until an on-policy update fills in its own
    # (the rollout log-prob pass skipped: PPOConfig.on_policy_update)
    logprobs: torch.Tensor | None
    rewards: torch.Tensor  # [B] reward-model scores
    values: torch.Tensor  # [B, S-1] critic values
    init_logprobs: torch.Tensor | None = None  # [B, S-1] initial-policy log-probs (None: no KL)
    engine_logprobs: torch.Tensor | None = None  # [B, S-1] the rollout engine's own (None: hf engine)

    def __len__(self) -> int:
        return int(self.sequence_tokens.shape[0])


@dataclass
class PPOData:
    """What the actor update and the critic update consume; all [B, S-1] except tokens/is_end."""

    sequence_tokens: torch.Tensor  # [B, S]
    prompt_lengths: torch.Tensor  # [B] int64 (the actor bans stop ids where sampling did)
    is_end: torch.Tensor  # [B] bool
    mask: torch.Tensor  # [B, S-1] float, 1 on response positions
    prev_logprobs: torch.Tensor | None  # [B, S-1]; None: the update's own, detached (on-policy)
    advantages: torch.Tensor  # [B, S-1], whitened when requested
    returns: torch.Tensor  # [B, S-1]
    values: torch.Tensor  # [B, S-1] rollout values (the critic's prev_values; 0 without a critic)
    init_logprobs: torch.Tensor | None = None  # [B, S-1] initial-policy log-probs for a KL loss term
    is_weights: torch.Tensor | None = None  # [B, S-1] truncated importance-sampling weights (tis_cap)

    def __len__(self) -> int:
        return int(self.sequence_tokens.shape[0])

    def select(self, index: torch.Tensor) -> PPOData:
        """Rows ``index`` of every field (for minibatches)."""
        picked: dict[str, Any] = {k: v[index] if v is not None else None for k, v in self.__dict__.items()}
        return PPOData(**picked)


def compute_ppo_data(
    batch: RolloutBatch,
    *,
    estimator: str = "gae",
    group_size: int = 1,
    kl_coef: float,
    kl_kind: KLKind,
    gamma: float,
    lam: float = 1.0,
    critic_gamma: float | None = None,
    critic_lam: float | None = None,
    lam_length_alpha: float | None = None,
    normalize_advantages: bool = False,
    missing_eos_penalty: float | None = None,
    score_clip: float | None = None,
    tis_cap: float = 0.0,
    reduce: Reduce = single_process,
) -> tuple[PPOData, dict[str, torch.Tensor]]:
    """Mask, per-token KL and adjusted scores → the registered ``estimator``'s advantages
    (:mod:`openaligner.trainer.estimators`, docs/algorithms.md) → training data and NeMo-Aligner's
    rollout metrics.

    ``batch`` holds ``B = prompts × group_size`` rows, the ``group_size`` responses to one prompt
    contiguous (see :class:`~openaligner.trainer.ppo.PPOTrainer`). Scores are first adjusted
    (``score_clip``, ``missing_eos_penalty``); ``kl_coef`` > 0 puts the KL into the reward (pass 0
    to keep it out, e.g. when it is a loss term). ``gamma``, ``lam``, ``critic_gamma``,
    ``critic_lam`` (the critic's returns; None: ``gamma``, ``lam``), ``lam_length_alpha`` (the
    length-adaptive policy λ) and ``normalize_advantages`` go to the estimator, which may ignore
    them. ``tis_cap`` > 0 with ``batch.engine_logprobs`` gives the data truncated
    importance-sampling weights (:func:`truncated_is_weights`) and the metrics
    ``tis_weight_mean`` and ``tis_truncated_fraction`` (tokens whose ratio was capped).
    ``batch.logprobs`` None (the rollout pass skipped for an on-policy update) needs ``kl_coef``
    0 and no ``tis_cap``; ``data.prev_logprobs`` is then None and the KL metrics are left to
    :func:`kl_metrics` once the update has the log-probs.

    Metrics (global over ranks through ``reduce``; computed before whitening):
    ``init_policy_kl`` and ``rewards_with_kl`` are means over samples of each sample's token-mean
    KL and of the reward the estimator used; ``sequence_kl`` is the mean over samples of each
    sample's summed KL (what the adaptive KL controller tracks); ``advantages_{mean,std}`` and,
    for an estimator with a critic, ``{returns,values}_{mean,std}`` are the masked mean and
    uncorrected standard deviation over all valid tokens. An estimator with a critic that gives
    its per-token rewards adds the critic's diagnostics against the Monte-Carlo returns ``G``
    (:func:`returns_to_go` at ``critic_gamma``) of this rollout, which the critic has not trained
    on yet: ``value/explained_variance_mc``, ``value/error_{early,middle,late,final}`` (mean
    ``|V − G|`` by response position, :func:`value_error_by_position`) and
    ``value/wrong_sign_fraction`` (of the advantages before whitening, :func:`wrong_sign_fraction`).

    Returns:
        ``(data, metrics)``: ``data.advantages`` [B, S-1] (0 outside the mask); without a critic
        ``returns`` and ``values`` are zeros.

    Raises:
        ValueError: an unknown ``estimator``, or one with a critic that returned no returns.
    """
    spec = get_estimator(estimator)
    if batch.logprobs is None and (kl_coef != 0 or tis_cap > 0):
        raise ValueError("a KL in the reward or tis_cap needs the rollout log-probs (batch.logprobs)")
    mask, kl = _mask_and_kl(batch, kl_kind)
    scores = adjust_scores(
        batch.rewards.to(kl.dtype),
        is_end=batch.is_end,
        missing_eos_penalty=missing_eos_penalty,
        score_clip=score_clip,
    )
    zeros = torch.zeros_like(mask)
    inputs = EstimatorInputs(
        scores=scores,
        kl=kl,
        kl_coef=kl_coef,
        mask=mask,
        sequence_lengths=batch.sequence_lengths,
        is_end=batch.is_end,
        values=batch.values if spec.needs_critic else zeros,
        group_size=group_size,
        gamma=gamma,
        lam=lam,
        normalize_advantages=normalize_advantages,
        reduce=reduce,
        critic_gamma=critic_gamma,
        critic_lam=critic_lam,
        lam_length_alpha=lam_length_alpha,
    )
    estimate = spec.compute(inputs)
    if spec.needs_critic and estimate.returns is None:
        raise ValueError(f"estimator {estimator!r} needs a critic but returned no returns to train it on")

    metrics = _reward_metric(estimate.rewards, reduce)
    if batch.logprobs is not None:
        metrics |= _kl_metrics(kl, mask, reduce)
    tracked = [("advantages", estimate.advantages)]
    if estimate.returns is not None:
        tracked += [("returns", estimate.returns), ("values", inputs.values)]
    stats = {name: masked_mean_var(tensor, mask, reduce=reduce) for name, tensor in tracked}
    for name, (mean, var) in stats.items():
        metrics[f"{name}_mean"] = mean
        metrics[f"{name}_std"] = var.clamp_min(0).sqrt()

    if estimate.returns is not None and estimate.token_rewards is not None:
        mc = returns_to_go(estimate.token_rewards, mask, gamma if critic_gamma is None else critic_gamma)
        metrics |= _value_diagnostics(inputs.values, mc, estimate.advantages, mask, reduce)

    advantages = estimate.advantages
    if estimate.whiten:
        # Same as masked_whiten(advantages, mask, reduce=reduce), reusing the statistics above.
        mean, var = stats["advantages"]
        advantages = (advantages - mean) * torch.rsqrt(var + 1e-8)

    data = PPOData(
        sequence_tokens=batch.sequence_tokens,
        prompt_lengths=batch.prompt_lengths,
        is_end=batch.is_end,
        mask=mask,
        prev_logprobs=batch.logprobs,
        advantages=advantages,
        returns=estimate.returns if estimate.returns is not None else zeros,
        values=inputs.values,
    )
    if tis_cap > 0 and batch.engine_logprobs is not None:
        assert batch.logprobs is not None  # checked above
        weights = truncated_is_weights(batch.logprobs, batch.engine_logprobs, tis_cap)
        data.is_weights = weights * mask
        capped = (weights >= tis_cap).to(mask.dtype)
        sums = reduce(torch.stack([masked_sum(weights, mask), masked_sum(capped, mask), mask.sum()]).double())
        tokens = sums[2].clamp_min(1)
        metrics["tis_weight_mean"] = sums[0] / tokens
        metrics["tis_truncated_fraction"] = sums[1] / tokens
    return data, metrics


def _value_diagnostics(
    values: torch.Tensor, mc: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, reduce: Reduce
) -> dict[str, torch.Tensor]:
    """The critic against the Monte-Carlo returns ``mc`` of the same rollout (``value/`` names)."""
    out = {"value/explained_variance_mc": explained_variance(values, mc, mask, reduce=reduce)}
    for band, error in value_error_by_position(values, mc, mask, reduce=reduce).items():
        out[f"value/error_{band}"] = error
    out["value/wrong_sign_fraction"] = wrong_sign_fraction(advantages, values, mc, mask, reduce=reduce)
    return out


def _mask_and_kl(batch: RolloutBatch, kl_kind: KLKind) -> tuple[torch.Tensor, torch.Tensor]:
    """The response mask [B, S-1] and the per-token KL estimate [B, S-1] (zeros without initial-policy
    log-probs, or without rollout log-probs yet)."""
    width = (batch.logprobs if batch.logprobs is not None else batch.values).shape[-1]
    dtype = batch.logprobs.dtype if batch.logprobs is not None else torch.float32
    mask = response_mask(batch.prompt_lengths, batch.sequence_lengths, width, dtype=dtype)
    if batch.init_logprobs is None or batch.logprobs is None:
        return mask, torch.zeros_like(mask)
    return mask, kl_penalty(batch.logprobs, batch.init_logprobs, kl_kind)


def kl_metrics(
    batch: RolloutBatch, kl_kind: KLKind, reduce: Reduce = single_process
) -> dict[str, torch.Tensor]:
    """The KL metrics of :func:`compute_ppo_data` (``init_policy_kl``, ``sequence_kl``; zeros
    without initial-policy log-probs) of ``batch`` whose ``logprobs`` are set: for a batch whose
    on-policy update filled them in after :func:`compute_ppo_data`."""
    assert batch.logprobs is not None, "the rollout log-probs are set (by the update, if on-policy)"
    mask, kl = _mask_and_kl(batch, kl_kind)
    return _kl_metrics(kl, mask, reduce)


def _kl_metrics(kl: torch.Tensor, mask: torch.Tensor, reduce: Reduce) -> dict[str, torch.Tensor]:
    """Means over every rank's samples of each sample's token-mean KL (``init_policy_kl``) and its
    summed KL (``sequence_kl``)."""
    per_sample = torch.stack([masked_mean(kl, mask, dim=-1), masked_sum(kl, mask, dim=-1)])
    sums = reduce(torch.cat([per_sample.sum(dim=-1), torch.tensor([float(kl.shape[0])])]).double())
    return {"init_policy_kl": sums[0] / sums[2], "sequence_kl": sums[1] / sums[2]}


def _reward_metric(rewards: torch.Tensor, reduce: Reduce) -> dict[str, torch.Tensor]:
    """``rewards_with_kl``: the mean over every rank's samples of the reward [B] the estimator used."""
    sums = reduce(torch.stack([rewards.sum(), torch.tensor(float(rewards.shape[0]))]).double())
    return {"rewards_with_kl": sums[0] / sums[1]}
