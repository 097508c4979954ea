"""The advantage estimators: each is one function plus one registration (docs/algorithms.md).

Owns the registry that the config (defaults, refusals), the data path (the advantages) and the
trainer (whether a critic exists) ask by ``trainer.advantage_estimator``, and the built-in
estimators' registrations. Each function adapts one rollout's tensors (:class:`EstimatorInputs`)
to the math in :mod:`openaligner.algorithms`; must not know the loop, models, clients, servers,
nor the config's class (the config imports the registry, never the other way).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from openaligner.algorithms import (
    LossAggregation,
    Reduce,
    broadcast_to_tokens,
    decoupled_gae,
    grpo_advantages,
    length_adaptive_lambda,
    masked_mean,
    masked_sum,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_kl,
    shape_rewards,
)

KLPlacement = Literal["reward", "loss"]
"""Where the KL to the initial policy goes: −β·KL in the reward, or +β·KL in the loss."""


@dataclass(frozen=True)
class EstimatorInputs:
    """One rollout as an estimator sees it, local to this rank. ``B = prompts × group_size`` rows,
    the ``group_size`` responses to one prompt contiguous; per-token tensors are [B, S-1], next-token
    aligned, mask 1 = valid."""

    scores: torch.Tensor  # [B] reward scores, after score_clip and missing_eos_penalty
    kl: torch.Tensor  # [B, S-1] per-token KL to the initial policy (zeros without it)
    kl_coef: float  # β of the KL in the reward (0 when the KL is a loss term or off)
    mask: torch.Tensor  # [B, S-1] float, 1 on response positions
    sequence_lengths: torch.Tensor  # [B] int64, prompt + response (the score sits at length − 2)
    is_end: torch.Tensor  # [B] bool, ended on a stop token
    values: torch.Tensor  # [B, S-1] the critic's values (zeros without a critic)
    group_size: int  # responses per prompt (trainer.n_samples_per_prompt)
    gamma: float  # trainer.discount_factor
    lam: float  # trainer.gae_lambda
    normalize_advantages: bool  # trainer.normalize_advantages (an estimator may ignore it)
    reduce: Reduce  # sums a tensor over ranks (identity on one process): global statistics
    critic_gamma: float | None = None  # trainer.critic_discount_factor, resolved; None: gamma
    critic_lam: float | None = None  # trainer.critic_gae_lambda, resolved; None: lam
    lam_length_alpha: float | None = None  # trainer.gae_lambda_length_alpha: policy λ = 1 − 1/(α·l)


@dataclass(frozen=True)
class Estimate:
    """What an estimator returns; the data path logs it and builds the training data from it."""

    advantages: torch.Tensor  # [B, S-1], 0 outside the mask
    rewards: torch.Tensor  # [B] each response's reward as the estimator used it (rollout/rewards_with_kl)
    returns: torch.Tensor | None = None  # [B, S-1] the critic's targets; None without a critic
    whiten: bool = False  # whiten advantages over the global batch after their statistics are logged
    token_rewards: torch.Tensor | None = None  # [B, S-1] the per-token rewards (value diagnostics)


EstimatorFn = Callable[[EstimatorInputs], Estimate]


class TrainerSettings(Protocol):
    """The ``trainer`` section as a refusal reads it: the config passes its own section (every key
    of docs/ppo.md, defaults resolved); these are the keys the built-in refusals read. A refusal of
    one's own may read any other key of the section by name."""

    normalize_advantages: bool

    @property
    def rollout_rows(self) -> int:
        """Responses per step (``num_rollout_samples × n_samples_per_prompt``)."""
        ...


Refusal = Callable[[TrainerSettings], "tuple[str, str] | None"]
"""``trainer section → (key below trainer., why)`` for a setting this estimator refuses, else None."""


@dataclass(frozen=True)
class Estimator:
    """One registered estimator: its function, what it needs and the defaults it brings."""

    name: str
    compute: EstimatorFn
    needs_critic: bool  # reads the critic server's values and trains the critic on its returns
    needs_groups: bool  # compares the responses to one prompt: refused with < 2 of them or greedy
    default_samples_per_prompt: int  # trainer.n_samples_per_prompt when null
    default_kl_in: KLPlacement  # trainer.kl_in when null: reward | loss
    default_loss_aggregation: LossAggregation  # trainer.loss_aggregation when null
    refuse: Refusal | None = None  # settings refused besides the ones needs_* imply
    title: str = ""  # what a run with it is called (progress bar, closing line); "" = the name


ESTIMATORS: dict[str, Estimator] = {}
"""Every registered estimator by name, in registration order (the order config errors list them)."""

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register_estimator(
    name: str,
    *,
    needs_critic: bool = False,
    needs_groups: bool = False,
    samples_per_prompt: int | None = None,
    kl_in: KLPlacement = "reward",
    loss_aggregation: LossAggregation = "token_mean",
    refuse: Refusal | None = None,
    title: str | None = None,
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: register ``fn`` as ``trainer.advantage_estimator=name``.

    Args:
        name: lower-case identifier; a name registered twice is refused.
        needs_critic: the run trains a critic (``Estimate.returns`` must be given) and reads its
            values; without, the trainer calls no critic and values are zeros.
        needs_groups: compares each response with the others to its prompt.
        samples_per_prompt: default responses per prompt (null: 4 with ``needs_groups``, else 1).
        kl_in, loss_aggregation: the defaults of ``trainer.kl_in`` / ``trainer.loss_aggregation``.
        refuse: further config refusals (see :data:`Refusal`).
        title: what a run with it is called in the progress bar and the closing line (default:
            ``name`` in capitals).

    Raises:
        ValueError: a bad or already registered name.
    """
    if not _NAME.match(name):
        raise ValueError(f"estimator name must be a lower-case identifier (e.g. my_rloo), got {name!r}")
    if name in ESTIMATORS:
        raise ValueError(f"an estimator named {name!r} is already registered")

    def register(fn: EstimatorFn) -> EstimatorFn:
        ESTIMATORS[name] = Estimator(
            name=name,
            compute=fn,
            needs_critic=needs_critic,
            needs_groups=needs_groups,
            default_samples_per_prompt=samples_per_prompt or (4 if needs_groups else 1),
            default_kl_in=kl_in,
            default_loss_aggregation=loss_aggregation,
            refuse=refuse,
            title=title or name.upper(),
        )
        return fn

    return register


def get_estimator(name: str) -> Estimator:
    """The estimator registered as ``name``; ValueError naming the registered ones otherwise."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        known = ", ".join(ESTIMATORS)
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {known}") from None


# ---------------------------------------------------------------- the built-in estimators
def _one_response_whitened(c: TrainerSettings) -> bool:
    """Whether a step whitens the advantages of one response only: whitened over its own tokens,
    it loses its mean advantage, and with it the reward: REINFORCE++ without KL gives every token
    the score as its return, so all become 0; GAE at γ = λ = 1 keeps only the values' deviations."""
    return c.rollout_rows == 1


def _refuse_gae(c: TrainerSettings) -> tuple[str, str] | None:
    if c.normalize_advantages and _one_response_whitened(c):
        return (
            "normalize_advantages",
            "whitening the advantages of one response per step (num_rollout_samples × "
            "n_samples_per_prompt = 1) subtracts that response's own mean advantage, so its reward "
            "is lost: set num_rollout_samples ≥ 2, or normalize_advantages=false",
        )
    return None


def _refuse_reinforce_pp(c: TrainerSettings) -> tuple[str, str] | None:
    if _one_response_whitened(c):
        return (
            "num_rollout_samples",
            "REINFORCE++ whitens the returns over the step's responses; with one (num_rollout_samples "
            "× n_samples_per_prompt = 1) its own score is subtracted and it learns nothing of the "
            "reward: set num_rollout_samples ≥ 2",
        )
    return None


@register_estimator("gae", needs_critic=True, refuse=_refuse_gae, title="PPO")
def gae_estimate(x: EstimatorInputs) -> Estimate:
    """PPO (Schulman et al. 2016/2017; NeMo-Aligner): KL-shaped per-token rewards, GAE over the
    critic's values (decoupled: the critic's returns with their own γ and λ, the policy's λ fixed
    or length-adaptive), whitened over the global batch with ``normalize_advantages``."""
    token_rewards = shape_rewards(x.scores, x.kl, x.sequence_lengths, x.kl_coef)
    lam: float | torch.Tensor = x.lam
    if x.lam_length_alpha is not None:
        lam = length_adaptive_lambda(x.mask.sum(-1), x.lam_length_alpha)
    advantages, returns = decoupled_gae(
        x.values,
        token_rewards,
        x.mask,
        gamma=x.gamma,
        lam=lam,
        critic_gamma=x.gamma if x.critic_gamma is None else x.critic_gamma,
        critic_lam=x.lam if x.critic_lam is None else x.critic_lam,
    )
    rewards = masked_mean(token_rewards, x.mask, dim=-1)
    return Estimate(
        advantages, rewards, returns=returns, whiten=x.normalize_advantages, token_rewards=token_rewards
    )


@register_estimator("reinforce", needs_groups=True)
def reinforce_estimate(x: EstimatorInputs) -> Estimate:
    """NeMo-Aligner's REINFORCE: ``r − β·mean_t KL_t``; leave-one-out baseline among the group's
    responses that ended."""
    rewards = x.scores - x.kl_coef * sequence_kl(x.kl, x.mask, "mean")
    per_sample = rloo_advantages(rewards, x.group_size, valid=x.is_end.bool())
    return Estimate(broadcast_to_tokens(per_sample, x.mask), rewards)


@register_estimator("rloo", needs_groups=True)
def rloo_estimate(x: EstimatorInputs) -> Estimate:
    """RLOO (Ahmadian et al. 2024): ``r − β·Σ_t KL_t``; leave-one-out baseline over the group."""
    rewards = x.scores - x.kl_coef * sequence_kl(x.kl, x.mask, "sum")
    return Estimate(broadcast_to_tokens(rloo_advantages(rewards, x.group_size), x.mask), rewards)


@register_estimator("grpo", needs_groups=True, kl_in="loss", loss_aggregation="seq_mean_token_mean")
def grpo_estimate(x: EstimatorInputs) -> Estimate:
    """GRPO (Shao et al. 2024): ``r − β·Σ_t KL_t``; the group's mean subtracted, divided by its std."""
    rewards = x.scores - x.kl_coef * sequence_kl(x.kl, x.mask, "sum")
    per_sample = grpo_advantages(rewards, x.group_size, scale_by_std=True)
    return Estimate(broadcast_to_tokens(per_sample, x.mask), rewards)


@register_estimator(
    "dr_grpo", needs_groups=True, title="Dr. GRPO", kl_in="loss", loss_aggregation="seq_mean_token_sum_norm"
)
def dr_grpo_estimate(x: EstimatorInputs) -> Estimate:
    """Dr. GRPO (Liu et al. 2025): GRPO without the std division (token sums over a fixed length
    come from its default loss aggregation)."""
    rewards = x.scores - x.kl_coef * sequence_kl(x.kl, x.mask, "sum")
    per_sample = grpo_advantages(rewards, x.group_size, scale_by_std=False)
    return Estimate(broadcast_to_tokens(per_sample, x.mask), rewards)


@register_estimator("reinforce_pp", refuse=_refuse_reinforce_pp, title="REINFORCE++")
def reinforce_pp_estimate(x: EstimatorInputs) -> Estimate:
    """REINFORCE++ (Hu 2025): per-token rewards ``−β·KL_t`` plus the score at the last response
    token; returns-to-go (``gamma``), whitened over every valid token of the global batch."""
    token_rewards = shape_rewards(x.scores, x.kl, x.sequence_lengths, x.kl_coef)
    advantages = reinforce_pp_advantages(token_rewards, x.mask, x.gamma, reduce=x.reduce)
    return Estimate(advantages, masked_sum(token_rewards, x.mask, dim=-1))
