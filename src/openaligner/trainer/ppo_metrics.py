"""What a PPO step reports: rollout and validation metrics, the actor update's ``policy/`` metrics,
per-phase timings, and the step's rollouts as a preview table and in the rollout log.

Owns how those figures are reduced over ranks (one collective each) and when the table and the
log are written. Must not know the loop (it is called with the step's batch and data), the
checkpoint protocol, the servers, or how records are shaped (:mod:`~openaligner.trainer.rollout_log`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from openaligner import distributed as dp
from openaligner.algorithms import KLKind
from openaligner.io.metrics import MetricsLogger
from openaligner.trainer.ppo_data import PPOData, RolloutBatch
from openaligner.trainer.rollout import rollout_texts
from openaligner.trainer.rollout_log import DecodedRollouts, rollout_records


def rollout_metrics(b: RolloutBatch, prefix: str, decoded: DecodedRollouts | None) -> dict[str, float]:
    """``{prefix}/*`` means over every rank's rollouts (sizes, lengths, rewards, ended fraction,
    and the task's ``score`` when ``decoded`` has scores); with ``prefix="rollout"`` also
    ``_tokens``, the tokens processed (for tokens/s; not logged). A collective."""
    gen_len = (b.sequence_lengths - b.prompt_lengths).double()
    sums = dp.all_reduce_sum(
        torch.stack(
            [
                torch.tensor(float(len(b)), dtype=torch.float64),
                b.sequence_lengths.double().sum(),
                b.prompt_lengths.double().sum(),
                gen_len.sum(),
                b.rewards.double().sum(),
                b.is_end.double().sum(),
                b.sequence_lengths.double().sum(),  # tokens processed, for tokens/s
            ]
        )
    )
    n = float(sums[0])
    metrics = {
        f"{prefix}/rollout_size": n,
        f"{prefix}/response_lengths": float(sums[1]) / n,
        f"{prefix}/prompt_lengths": float(sums[2]) / n,
        f"{prefix}/generation_length": float(sums[3]) / n,
        f"{prefix}/rewards": float(sums[4]) / n,
        f"{prefix}/fraction_of_samples_properly_ended": float(sums[5]) / n,
    }
    if prefix == "rollout":
        metrics["_tokens"] = float(sums[6])
    if decoded is not None and decoded.scores is not None:
        scores = decoded.scores
        total = dp.all_reduce_sum(torch.tensor([sum(scores), float(len(scores))], dtype=torch.float64))
        metrics[f"{prefix}/score"] = float(total[0] / total[1])
    return metrics


def decode_rollouts(
    b: RolloutBatch,
    decode: Callable[[Sequence[int]], str],
    stop_ids: Sequence[int],
    scorer: Callable[[list[str], list[str]], list[float]] | None,
) -> DecodedRollouts:
    """Prompt and response texts (see :func:`rollout_texts`) and the task's scores of them."""
    prompts, responses = rollout_texts(
        b.sequence_tokens, b.prompt_lengths, b.sequence_lengths, b.is_end, stop_ids, decode
    )
    scores = scorer(prompts, responses) if scorer is not None else None
    return DecodedRollouts(prompts, responses, [float(s) for s in scores] if scores is not None else None)


@dataclass(frozen=True)
class RolloutLog:
    """A step's rollouts in the logs: a 4-row preview table in ``tables.jsonl`` and TensorBoard,
    and every rank's rollouts (up to ``rollout_log_rows``) in ``rollouts.jsonl``."""

    logger: MetricsLogger
    sample_table_interval: int  # a preview table every N steps (0: none)
    rollout_log_rows: int | None  # rollouts per step in the rollout log (None: all, 0: none)
    kl_kind: KLKind  # the KL estimator whose per-sample KL is logged
    group_size: int  # responses per prompt (contiguous rows)
    with_values: bool  # log values and returns (an estimator with a critic)

    def table(self, name: str, step: int, b: RolloutBatch, decoded: DecodedRollouts | None) -> None:
        """A preview of rank 0's first 4 rollouts (prompt, response, reward) at ``step`` (the
        rollout log has them all)."""
        if decoded is None or dp.rank() != 0:
            return
        rows = [
            {"prompt": p, "response": r, "reward": float(b.rewards[i])}
            for i, (p, r) in enumerate(zip(decoded.prompts[:4], decoded.responses[:4], strict=True))
        ]
        self.logger.log_table(name, rows, step)

    def step(self, step: int, batch: RolloutBatch, data: PPOData, decoded: DecodedRollouts | None) -> None:
        """The step just run (``step``, as its metrics): the preview table every
        ``sample_table_interval`` steps and the rollout log. Called on every rank (the records are
        gathered to rank 0)."""
        if self.sample_table_interval > 0 and step % self.sample_table_interval == 0:
            self.table("table/train_rollouts", step, batch, decoded)
        if self.rollout_log_rows == 0:
            return
        records = rollout_records(
            step,
            batch,
            data,
            kl_kind=self.kl_kind,
            group_size=self.group_size,
            with_values=self.with_values,
            first_sample=dp.rank() * len(batch),  # ranks hold equal shares of the global batch
            decoded=decoded,
            limit=self.rollout_log_rows,
        )
        self.logger.log_rollouts([r for per_rank in dp.gather_objects(records) for r in per_rank])


_SHARES = ("loss", "pg_loss", "entropy", "kl_loss")
"""Actor metrics that are a micro-batch's share of its step's loss terms: they add up."""
_TOKEN_MEANS = ("ppo_ratio", "ppo_ratio_clamped", "clip_fraction", "approx_kl")
"""Actor metrics that are means over a micro-batch's ``response_tokens``."""
STEP_SUMS = (*_SHARES, *_TOKEN_MEANS, "dual_clip_fraction", "response_tokens", "negative_tokens")
"""What a rank sums over a step's micro-batches: shares, and the token means times their weight."""


def step_sums(metrics: dict[str, float]) -> torch.Tensor:
    """One micro-batch's contribution to its step's :data:`STEP_SUMS` (float64 [len(STEP_SUMS)])."""
    tokens, negative = metrics["response_tokens"], metrics["negative_tokens"]
    weighted = {k: metrics[k] * tokens for k in _TOKEN_MEANS}
    weighted["dual_clip_fraction"] = metrics["dual_clip_fraction"] * negative
    counts = {"response_tokens": tokens, "negative_tokens": negative}
    values = {k: metrics[k] for k in _SHARES} | weighted | counts
    return torch.tensor([values[k] for k in STEP_SUMS], dtype=torch.float64)


def step_metrics(sums: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each step's metrics ([steps] per name) from its :data:`STEP_SUMS` over every rank [steps, K]."""
    col = {k: sums[:, i] for i, k in enumerate(STEP_SUMS)}
    out = {k: col[k] for k in _SHARES}
    out |= {k: col[k] / col["response_tokens"].clamp_min(1.0) for k in _TOKEN_MEANS}
    out["dual_clip_fraction"] = col["dual_clip_fraction"] / col["negative_tokens"].clamp_min(1.0)
    return out


def max_over_ranks(seconds: dict[str, float]) -> dict[str, float]:
    """Per-phase seconds as ``timing/<phase>_s``, the slowest rank's (what the step waited for)."""
    merged: dict[str, float] = defaultdict(float)
    for per_rank in dp.gather_objects(seconds):
        for k, v in per_rank.items():
            merged[k] = max(merged[k], v)
    return {f"timing/{k}_s": v for k, v in sorted(merged.items())}


def progress_postfix(m: dict[str, float]) -> str:
    """The progress bar's summary of a step's metrics."""
    parts = [
        ("reward", m.get("rollout/rewards")),
        ("score", m.get("rollout/score")),
        ("kl", m.get("rollout/init_policy_kl")),
        ("len", m.get("rollout/generation_length")),
        ("val", m.get("val/rewards")),
    ]
    return " ".join(f"{k}={v:.3g}" for k, v in parts if v is not None)
