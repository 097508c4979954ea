"""Per-sample rollout records: one JSON-ready dict per response of a PPO step (``logs/rollouts.jsonl``).

Owns which per-sample figures are logged and how the step's tensors become them, so that a user
can audit what the policy was rewarded for (reward hacking) sample by sample: the decoded prompt
and response, the reward exactly as the trainer received it, and the KL, value, return and
advantage the update used. The fields and their units are documented in docs/ppo.md (*Rollout
log*). Knows the rollout batch and its training data; not where records go (the metrics logger)
nor ranks (the trainer passes each rank's offset in the step's global batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from openaligner.algorithms import KLKind, kl_penalty, masked_mean, masked_sum
from openaligner.trainer.ppo_data import PPOData, RolloutBatch


@dataclass
class DecodedRollouts:
    """The texts of a rollout batch's rows (this rank's), and their task scores when a scorer runs."""

    prompts: list[str]  # [B]
    responses: list[str]  # [B], cut at the stop token
    scores: list[float] | None = None  # [B] the task's gold scores, or None without a scorer


def rollout_records(
    step: int,
    batch: RolloutBatch,
    data: PPOData,
    *,
    kl_kind: KLKind,
    group_size: int,
    with_values: bool,
    first_sample: int = 0,
    decoded: DecodedRollouts | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """One record per row of ``batch`` whose global index is below ``limit``.

    Args:
        step: the PPO step these rollouts trained (the step ``metrics.jsonl`` logs them under).
        batch: this rank's rollouts, B rows ([B, S] tokens, [B] rewards, [B, S-1] log-probs and values).
        data: the training data made from ``batch`` ([B, S-1] mask, advantages, returns).
        kl_kind: the per-token KL estimator of the run (``PPOConfig.kl_kind``).
        group_size: responses per prompt; a prompt's responses are contiguous rows.
        with_values: the run has a critic: write ``value`` and ``return``.
        first_sample: the global index of this rank's first row (rank-major global batch).
        decoded: the rows' texts (and scores); None writes no text.
        limit: records per step over all ranks (the first ``limit`` global rows); None: all.

    Returns:
        Flat dicts of ints, bools, strings and floats, in row order; the fields are documented in
        docs/ppo.md. Per-sample KL, value, return and advantage are reduced over the response's
        tokens (``data.mask``): the KL summed (nats), the others averaged.
    """
    rows = len(batch)
    if limit is not None:
        rows = max(0, min(rows, limit - first_sample))
    if rows == 0:
        return []
    mask = data.mask[:rows]
    per_sample: dict[str, torch.Tensor] = {"reward": batch.rewards[:rows]}
    if decoded is not None and decoded.scores is not None:
        per_sample["score"] = torch.tensor(decoded.scores[:rows], dtype=torch.float64)
    if batch.init_logprobs is not None and batch.logprobs is not None:  # (an on-policy update sets them)
        kl = kl_penalty(batch.logprobs[:rows], batch.init_logprobs[:rows], kl_kind)
        per_sample["kl"] = masked_sum(kl, mask, dim=-1)
    if with_values:
        per_sample["value"] = masked_mean(data.values[:rows], mask, dim=-1)
        per_sample["return"] = masked_mean(data.returns[:rows], mask, dim=-1)
    per_sample["advantage"] = masked_mean(data.advantages[:rows], mask, dim=-1)
    columns = {k: _floats(v) for k, v in per_sample.items()}

    prompt_tokens = batch.prompt_lengths[:rows].tolist()
    response_tokens = (batch.sequence_lengths[:rows] - batch.prompt_lengths[:rows]).tolist()
    ended = batch.is_end[:rows].bool().tolist()
    records = []
    for i in range(rows):
        sample = first_sample + i
        record: dict[str, Any] = {"step": step, "sample": sample, "group": sample // group_size}
        if decoded is not None:
            record["prompt"] = decoded.prompts[i]
            record["response"] = decoded.responses[i]
        record["prompt_tokens"] = int(prompt_tokens[i])
        record["response_tokens"] = int(response_tokens[i])
        record["ended"] = bool(ended[i])
        record |= {k: column[i] for k, column in columns.items()}
        records.append(record)
    return records


def _floats(values: torch.Tensor) -> list[float]:
    """[B] → Python floats at the tensor's full precision (no rounding)."""
    return [float(v) for v in values.detach().double().cpu().tolist()]
