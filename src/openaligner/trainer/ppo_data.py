"""Turn one rollout (tokens, log-probs, scores, values) into training data and rollout metrics.

This is the trainer's ``generate_ppo_data`` step as plain functions: for PPO
(:func:`compute_ppo_data`) KL-shaped rewards, the response mask, GAE and global advantage
whitening; for the critic-free estimators (:func:`compute_critic_free_data`) the sequence or
token rewards and each estimator's baseline; all the math from :mod:`openaligner.algorithms`.
Cross-rank statistics go through a ``reduce`` callable (all-reduce SUM under torch.distributed,
identity on one process), so this module makes no distributed calls of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openaligner.algorithms import (
    Reduce,
    adjust_scores,
    broadcast_to_tokens,
    gae,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    masked_mean_var,
    masked_sum,
    reinforce_pp_advantages,
    response_mask,
    rloo_advantages,
    sequence_kl,
    shape_rewards,
    single_process,
)


@dataclass
class RolloutBatch:
    """One rollout, local to this rank. ``S`` = padded sequence length."""

    response_tokens: torch.Tensor  # [B, S] int64, prompt + response, padded after the response
    response_lengths: torch.Tensor  # [B] int64, prompt + response
    prompt_lengths: torch.Tensor  # [B] int64
    is_end: torch.Tensor  # [B] bool, ended on a stop token
    logprobs: torch.Tensor  # [B, S-1] policy log-probs at rollout time
    rewards: torch.Tensor  # [B] reward-model scores
    values: torch.Tensor  # [B, S-1] critic values
    init_logprobs: torch.Tensor | None = None  # [B, S-1] initial-policy log-probs (None: no KL)

    def __len__(self) -> int:
        return int(self.response_tokens.shape[0])


@dataclass
class PPOData:
    """What the actor update and the critic update consume; all [B, S-1] except tokens/is_end."""

    response_tokens: torch.Tensor  # [B, S]
    prompt_lengths: torch.Tensor  # [B] int64 (the actor bans stop ids where sampling did)
    is_end: torch.Tensor  # [B] bool
    mask: torch.Tensor  # [B, S-1] float, 1 on response positions
    prev_logprobs: torch.Tensor  # [B, S-1]
    advantages: torch.Tensor  # [B, S-1], whitened when requested
    returns: torch.Tensor  # [B, S-1]
    values: torch.Tensor  # [B, S-1] rollout values (the critic's prev_values; 0 without a critic)
    ref_logprobs: torch.Tensor | None = None  # [B, S-1] initial-policy log-probs for a KL loss term

    def __len__(self) -> int:
        return int(self.response_tokens.shape[0])

    def select(self, index: torch.Tensor) -> PPOData:
        """Rows ``index`` of every field (for minibatches)."""
        picked = {k: v[index] for k, v in self.__dict__.items() if v is not None}
        return PPOData(**picked)


def compute_ppo_data(
    batch: RolloutBatch,
    *,
    kl_coef: float,
    kl_kind: str,
    gamma: float,
    lam: float,
    normalize_advantages: bool,
    missing_eos_penalty: float | None = None,
    score_clip: float | None = None,
    reduce: Reduce = single_process,
) -> tuple[PPOData, dict[str, torch.Tensor]]:
    """KL-shaped rewards → mask → GAE → (global) whitening, plus NeMo-Aligner's rollout metrics.

    Metrics (global over ranks through ``reduce``; computed before whitening):
    ``init_policy_kl`` and ``rewards_with_kl`` are means over samples of each sample's token
    mean under the mask; ``sequence_kl`` is the mean over samples of each sample's summed KL
    (what the adaptive KL controller tracks); ``{advantages,returns,values}_{mean,std}`` are the
    masked mean and uncorrected standard deviation over all valid tokens.
    """
    mask, kl = _mask_and_kl(batch, kl_kind)
    token_rewards = shape_rewards(
        batch.rewards,
        kl,
        batch.response_lengths,
        kl_coef,
        is_end=batch.is_end,
        missing_eos_penalty=missing_eos_penalty,
        score_clip=score_clip,
    )
    advantages, returns = gae(batch.values, token_rewards, mask, gamma, lam)
    metrics = _kl_metrics(kl, mask, masked_mean(token_rewards, mask, dim=-1), reduce)
    stats = {
        name: masked_mean_var(tensor, mask, reduce=reduce)
        for name, tensor in (("advantages", advantages), ("returns", returns), ("values", batch.values))
    }
    for name, (mean, var) in stats.items():
        metrics[f"{name}_mean"] = mean
        metrics[f"{name}_std"] = var.clamp_min(0).sqrt()

    if normalize_advantages:
        # Same as masked_whiten(advantages, mask, reduce=reduce), reusing the statistics above.
        mean, var = stats["advantages"]
        advantages = (advantages - mean) * torch.rsqrt(var + 1e-8)

    data = PPOData(
        response_tokens=batch.response_tokens,
        prompt_lengths=batch.prompt_lengths,
        is_end=batch.is_end,
        mask=mask,
        prev_logprobs=batch.logprobs,
        advantages=advantages,
        returns=returns,
        values=batch.values,
    )
    return data, metrics


SEQUENCE_ESTIMATORS = ("reinforce", "rloo", "grpo", "dr_grpo")
"""Critic-free estimators whose advantage is one number per response, on every response token."""


def compute_critic_free_data(
    batch: RolloutBatch,
    *,
    estimator: str,
    group_size: int,
    kl_coef: float,
    kl_kind: str,
    gamma: float = 1.0,
    missing_eos_penalty: float | None = None,
    score_clip: float | None = None,
    reduce: Reduce = single_process,
) -> tuple[PPOData, dict[str, torch.Tensor]]:
    """Advantages without a critic (docs/algorithms.md), plus the rollout metrics of :func:`compute_ppo_data`.

    ``batch`` holds ``B = prompts × group_size`` rows, the ``group_size`` responses to one prompt
    contiguous (see :class:`~openaligner.trainer.ppo.PPOTrainer`). Scores are first adjusted
    (``score_clip``, ``missing_eos_penalty``); ``kl_coef`` > 0 puts the KL into the reward
    (pass 0 to keep it out, e.g. when it is a loss term):

    - ``reinforce`` (NeMo-Aligner): ``r − β·mean_t KL_t``; leave-one-out baseline among the
      group's responses that ended (``is_end``).
    - ``rloo``: ``r − β·Σ_t KL_t``; leave-one-out baseline over the whole group.
    - ``grpo`` / ``dr_grpo``: ``r − β·Σ_t KL_t``; group mean subtracted, divided by the group's std
      (``grpo`` only).
    - ``reinforce_pp``: per-token rewards ``−β·KL_t`` plus the score at the last response token;
      returns-to-go (``gamma``), whitened over every valid token of the global batch.

    Returns:
        ``(data, metrics)``: ``data.advantages`` [B, S-1] (0 outside the mask), ``returns`` and
        ``values`` zeros; metrics as :func:`compute_ppo_data`'s except ``returns_*``/``values_*``.
    """
    mask, kl = _mask_and_kl(batch, kl_kind)
    scores = adjust_scores(
        batch.rewards.to(kl.dtype),
        is_end=batch.is_end,
        missing_eos_penalty=missing_eos_penalty,
        score_clip=score_clip,
    )
    if estimator in SEQUENCE_ESTIMATORS:
        reduction = "mean" if estimator == "reinforce" else "sum"
        rewards = scores - kl_coef * sequence_kl(kl, mask, reduction)
        if estimator == "reinforce":
            per_sample = rloo_advantages(rewards, group_size, valid=batch.is_end.bool())
        elif estimator == "rloo":
            per_sample = rloo_advantages(rewards, group_size)
        else:
            per_sample = grpo_advantages(rewards, group_size, scale_by_std=estimator == "grpo")
        advantages = broadcast_to_tokens(per_sample, mask)
    elif estimator == "reinforce_pp":
        token_rewards = shape_rewards(scores, kl, batch.response_lengths, kl_coef)
        rewards = masked_sum(token_rewards, mask, dim=-1)
        advantages = reinforce_pp_advantages(token_rewards, mask, gamma, reduce=reduce)
    else:
        raise ValueError(f"unknown critic-free estimator {estimator!r}")

    metrics = _kl_metrics(kl, mask, rewards, reduce)
    mean, var = masked_mean_var(advantages, mask, reduce=reduce)
    metrics["advantages_mean"] = mean
    metrics["advantages_std"] = var.clamp_min(0).sqrt()
    zeros = torch.zeros_like(batch.logprobs)
    data = PPOData(
        response_tokens=batch.response_tokens,
        prompt_lengths=batch.prompt_lengths,
        is_end=batch.is_end,
        mask=mask,
        prev_logprobs=batch.logprobs,
        advantages=advantages,
        returns=zeros,
        values=zeros,
    )
    return data, metrics


def _mask_and_kl(batch: RolloutBatch, kl_kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The response mask [B, S-1] and the per-token KL estimate [B, S-1] (zeros without initial-policy
    log-probs)."""
    width = batch.logprobs.shape[-1]
    mask = response_mask(batch.prompt_lengths, batch.response_lengths, width, dtype=batch.logprobs.dtype)
    if batch.init_logprobs is None:
        return mask, torch.zeros_like(batch.logprobs)
    return mask, kl_penalty(batch.logprobs, batch.init_logprobs, kl_kind)


def _kl_metrics(
    kl: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor, reduce: Reduce
) -> dict[str, torch.Tensor]:
    """Means over every rank's samples: each sample's token-mean KL (``init_policy_kl``), its reward
    ``rewards`` [B] (``rewards_with_kl``) and its summed KL (``sequence_kl``)."""
    per_sample = torch.stack([masked_mean(kl, mask, dim=-1), rewards, masked_sum(kl, mask, dim=-1)])
    sums = reduce(torch.cat([per_sample.sum(dim=-1), torch.tensor([float(rewards.shape[0])])]).double())
    return {
        "init_policy_kl": sums[0] / sums[3],
        "rewards_with_kl": sums[1] / sums[3],
        "sequence_kl": sums[2] / sums[3],
    }
