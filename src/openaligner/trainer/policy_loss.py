"""The actor's policy loss as a component: built once from a frozen :class:`PolicyLossConfig`,
called by the trainer on each micro-batch with the policy that scores it.

Owns the loss settings (clip ε, dual clip, entropy bonus, aggregation, the KL term's estimator,
the ``is_end`` gate), the micro-batch → scoring forward → loss → metrics path and the step's loss
denominator. The math is :func:`~openaligner.algorithms.ppo_policy_loss`; the forward is the
policy's (:class:`ScoringPolicy`). Must not know about optimizers, ranks, rollouts or the YAML
schema beyond :meth:`PolicyLossConfig.from_ppo`. Adding a loss: docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from openaligner.algorithms import (
    LOSS_AGGREGATIONS,
    KLKind,
    LossAggregation,
    aggregation_units,
    ppo_policy_loss,
)
from openaligner.trainer.ppo_config import PPOConfig


class ScoringPolicy(Protocol):
    """What a policy loss needs of the policy (:class:`~openaligner.models.actor.CausalLMActor`)."""

    @property
    def device(self) -> torch.device: ...

    def training_logprobs(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor | None,
        prompt_lengths: torch.Tensor | None,
        *,
        first_position: int = 0,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class PolicyLossConfig:
    """The settings of the clipped PPO policy loss (docs/algorithms.md, "The policy loss")."""

    clip_eps: float = 0.2  # PPO ratio clip ε (trainer.ratio_eps)
    clip_eps_high: float | None = None  # upper ε, "clip-higher"; None: clip_eps (trainer.ratio_eps_high)
    dual_clip: float | None = None  # dual-clip constant c > 1, or None (trainer.dual_clip)
    entropy_coef: float = 0.0  # weight of the entropy bonus; < 0 penalises entropy (trainer.entropy_bonus)
    aggregation: LossAggregation = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
    norm_length: int | None = None  # the token count seq_mean_token_sum_norm divides by (the budget)
    kl_kind: KLKind = "k3"  # the KL estimator of the KL loss term (trainer.kl_kind with kl_in=loss)
    gate_unfinished: bool = True  # samples that never ended get no policy gradient (NeMo-Aligner)

    def __post_init__(self) -> None:
        if self.aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {LOSS_AGGREGATIONS}, got {self.aggregation!r}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip}")

    @classmethod
    def from_ppo(cls, c: PPOConfig) -> PolicyLossConfig:
        """The loss settings of a run's ``trainer`` section (resolved at load)."""
        return cls(
            clip_eps=c.ratio_eps,
            clip_eps_high=c.ratio_eps_high,
            dual_clip=c.dual_clip,
            entropy_coef=c.entropy_bonus,
            aggregation=c.aggregation,
            norm_length=c.length.max_length,
            kl_kind=c.kl_kind,
            gate_unfinished=c.gate_unfinished,
        )


class PolicyLoss:
    """The clipped PPO policy loss (plus the entropy bonus and, with ``init_logprobs``, the KL loss
    term) of one micro-batch, with gradient, and its diagnostics.

    Args:
        cfg: the loss settings.
    """

    def __init__(self, cfg: PolicyLossConfig) -> None:
        self.cfg = cfg

    def gate(self, is_end: torch.Tensor) -> torch.Tensor:
        """[B] bool: the rows whose tokens the loss trains on (``gate_unfinished``: those that ended)."""
        return is_end.bool() if self.cfg.gate_unfinished else torch.ones_like(is_end, dtype=torch.bool)

    def units(self, mask: torch.Tensor, is_end: torch.Tensor) -> torch.Tensor:
        """The units (tokens or samples, float64 0-d) that rows with ``mask`` [B, S-1] and
        ``is_end`` [B] add to the denominator of a step's loss; summed over a step's micro-batches
        and ranks, the result is the ``loss_units`` of each of its micro-batches."""
        loss_mask = mask * self.gate(is_end).to(mask.dtype).unsqueeze(-1)
        return aggregation_units(loss_mask, self.cfg.aggregation).to(torch.float64)

    def __call__(
        self, policy: ScoringPolicy, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One forward of ``policy`` over the whole micro-batch, then the loss; the caller scales,
        accumulates and steps.

        Args:
            policy: scores the tokens (:meth:`ScoringPolicy.training_logprobs`).
            batch: ``sequence_tokens`` [B, S] int64, ``advantages`` [B, S-1], ``mask`` [B, S-1]
                (1 on response positions), ``prev_logprobs`` [B, S-1] (rollout-time log-probs;
                absent in an on-policy update: this forward's own, detached — the ratio is
                exactly 1 and the gradient that of the policy gradient),
                ``is_end`` [B] bool (gated by ``gate_unfinished``); optional ``sequence_lengths``
                [B] for the attention mask; ``prompt_lengths`` [B], required when the policy's
                sampling has ``min_new_tokens`` > 0; optional ``init_logprobs`` [B, S-1]
                (initial-policy log-probs) with ``kl_coef`` (a 0-d tensor β): adds ``β·KL`` of
                ``kl_kind`` (GRPO's KL term); optional ``is_weights`` [B, S-1] (truncated
                importance sampling: each token's policy-gradient term weighed); optional
                ``loss_units`` (a 0-d tensor, see :meth:`units`): the denominator of the whole
                optimizer step's loss, which makes the loss this micro-batch's share of the
                step's; without it, this batch's own mean.

        Returns:
            ``(loss, metrics)``: a scalar loss tensor and floats ``loss``, ``pg_loss``,
            ``entropy`` (per-token entropy over the gated mask, aggregated as the loss),
            ``kl_loss`` (the KL term before β; 0 without one) — shares of the step's with
            ``loss_units``, so they sum over micro-batches —; ``ppo_ratio``,
            ``ppo_ratio_clamped``, ``clip_fraction``, ``approx_kl`` (means over this batch's
            ``response_tokens``) and ``dual_clip_fraction`` (over its ``negative_tokens``, those
            with a negative advantage), with those two counts as their weights.
        """
        c = self.cfg
        device = policy.device
        tokens = batch["sequence_tokens"].to(device)
        mask = batch["mask"].to(device)
        # Positions before the first one any row scores (the shortest prompt) add nothing to the
        # loss; the policy's output head and log-softmax skip them.
        first = first_scored_position(mask)
        logprobs, entropy = policy.training_logprobs(
            tokens,
            batch.get("sequence_lengths"),
            batch.get("prompt_lengths"),
            first_position=first,
            entropy_grad=c.entropy_coef != 0,  # a negative weight trains toward lower entropy
        )  # [B, S-1-first] each
        init_lp = batch.get("init_logprobs")
        is_weights = batch.get("is_weights")
        prev = batch.get("prev_logprobs")
        loss, stats = ppo_policy_loss(
            logprobs,
            prev[:, first:].to(logprobs) if prev is not None else logprobs.detach(),
            batch["advantages"][:, first:].to(logprobs),
            mask[:, first:].to(logprobs),
            c.clip_eps,
            clip_eps_high=c.clip_eps_high,
            dual_clip=c.dual_clip,
            aggregation=c.aggregation,
            norm_length=c.norm_length,
            is_end=self.gate(batch["is_end"]).to(device),
            entropy=entropy,
            entropy_coef=c.entropy_coef,
            init_logprobs=init_lp[:, first:].to(logprobs) if init_lp is not None else None,
            kl_coef=float(batch["kl_coef"]) if init_lp is not None else 0.0,
            kl_kind=c.kl_kind,
            units=batch.get("loss_units"),
            is_weights=is_weights[:, first:].to(logprobs) if is_weights is not None else None,
        )
        metrics = {
            "loss": loss.detach(),
            "pg_loss": stats.pg_loss,
            "ppo_ratio": stats.ratio_mean,
            "ppo_ratio_clamped": stats.ratio_clamped_mean,
            "clip_fraction": stats.clip_fraction,
            "dual_clip_fraction": stats.dual_clip_fraction,
            "approx_kl": stats.approx_kl,
            "entropy": stats.entropy,
            "kl_loss": stats.kl_loss,
            "response_tokens": stats.tokens,
            "negative_tokens": stats.negative_tokens,
        }
        values = torch.stack([v.float() for v in metrics.values()]).tolist()  # one device sync
        return loss, dict(zip(metrics, values, strict=True))


def first_scored_position(mask: torch.Tensor) -> int:
    """The first column of ``mask`` [B, S-1] that is non-zero in some row (0 if none is)."""
    scored = mask.ne(0).any(dim=0).nonzero()
    return int(scored[0]) if scored.numel() else 0
