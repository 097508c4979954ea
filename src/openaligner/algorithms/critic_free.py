"""Advantage estimators without a critic: leave-one-out and group baselines, returns-to-go.

Pure tensor math. Per-sample tensors are [B]; per-token tensors are [B, S-1], next-token aligned,
mask 1 = valid. A *group* is the ``G`` responses sampled for one prompt, laid out as ``G``
consecutive rows, so ``B = prompts × G``. Cross-rank statistics go through a ``reduce`` callable
(see :mod:`openaligner.algorithms.masked`); nothing here calls torch.distributed.
"""

from __future__ import annotations

from typing import Literal

import torch

from openaligner.algorithms.advantages import gae, gae_reference
from openaligner.algorithms.masked import Reduce, masked_mean_var, masked_sum, select_valid, single_process


def _groups(scores: torch.Tensor, group_size: int, needs: int) -> torch.Tensor:
    """``scores`` [B] → [B/G, G]; ValueError when B is not a multiple of G or G < ``needs``."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {list(scores.shape)}")
    if group_size < needs:
        raise ValueError(
            f"group_size={group_size}: a baseline from the other responses to a prompt needs at least "
            f"{needs} responses per prompt"
        )
    if scores.shape[0] % group_size:
        raise ValueError(
            f"{scores.shape[0]} rows do not split into groups of {group_size} (one group per prompt)"
        )
    return scores.reshape(-1, group_size)


KLReduction = Literal["sum", "mean"]
"""How :func:`sequence_kl` turns per-token KL into one figure per response."""


def sequence_kl(kl: torch.Tensor, mask: torch.Tensor, reduction: KLReduction) -> torch.Tensor:
    """One KL figure per response from per-token estimates: [B, S-1] → [B].

    ``sum``: Σ_t KL_t over the mask, the KL of the whole sequence (RLOO, Ahmadian et al. 2024);
    ``mean``: the masked token mean (NeMo-Aligner's REINFORCE). A row without valid tokens gives 0;
    masked positions, even inf or NaN, never matter.

    Worked example: kl [[0.1, 0.2, 9.0]], mask [[1, 1, 0]] → sum [0.3], mean [0.15].
    """
    if reduction == "sum":
        return masked_sum(kl, mask, dim=-1)
    if reduction == "mean":
        count = mask.sum(dim=-1)
        return masked_sum(kl, mask, dim=-1) / count.clamp_min(1)
    raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")


def rloo_advantages(scores: torch.Tensor, group_size: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"):
    ``A_i = r_i − mean_{j ≠ i, j valid} r_j`` within each group of ``group_size`` rows.

    Args:
        scores: [B] sequence rewards.
        group_size: G ≥ 2 responses per prompt (consecutive rows).
        valid: [B] bool; when given (NeMo-Aligner's REINFORCE: the responses that ended), only
            valid rows enter the other rows' baselines. A row with no *other* valid row in its
            group gets advantage 0 (NeMo-Aligner's baseline is then the row's own reward). An
            invalid row's own advantage is taken against its valid group-mates as any row's.

    Returns:
        [B] advantages. Worked example, G=2: scores [1, 0, 2, 1] → baselines [0, 1, 1, 2] →
        [1, −1, 1, −1]. With valid [T, T, T, F]: rows 3 and 4 see only row 3 as a valid
        mate: row 3 has no other valid row → 0; row 4: 1 − 2 = −1 → [1, −1, 0, −1].
    """
    g = _groups(scores, group_size, 2)
    w = torch.ones_like(g) if valid is None else valid.reshape(g.shape).to(g.dtype)
    total = (g * w).sum(dim=-1, keepdim=True)
    count = w.sum(dim=-1, keepdim=True)
    others_total = total - g * w  # leave this row out (when it counted)
    others = count - w
    baseline = others_total / others.clamp_min(1)
    advantages = torch.where(others > 0, g - baseline, torch.zeros_like(g))
    return advantages.reshape(-1)


def rloo_advantages_reference(
    scores: torch.Tensor, group_size: int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """The plain loop :func:`rloo_advantages` must equal."""
    out = torch.zeros_like(scores)
    for start in range(0, scores.shape[0], group_size):
        for i in range(start, start + group_size):
            mates = [
                float(scores[j])
                for j in range(start, start + group_size)
                if j != i and (valid is None or bool(valid[j]))
            ]
            out[i] = float(scores[i]) - sum(mates) / len(mates) if mates else 0.0
    return out


def grpo_advantages(
    scores: torch.Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages of GRPO (Shao et al. 2024, DeepSeekMath §4.1.2):
    ``A_i = (r_i − mean_g) / (std_g + eps)``, the std unbiased (n − 1) as DeepSeekMath and TRL
    compute it. ``scale_by_std=False`` is Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
    Training"): ``r_i − mean_g`` only, without the std's per-prompt difficulty weighting.

    Args:
        scores: [B] sequence rewards.
        group_size: G ≥ 2 responses per prompt (consecutive rows).

    Returns:
        [B] advantages; a group whose scores are all equal gives exactly 0.
        Worked example, G=2: scores [1, 0, 2, 2] → means [0.5, 2], stds [0.7071, 0] →
        [0.7071, −0.7071, 0, 0] (Dr. GRPO: [0.5, −0.5, 0, 0]).
    """
    g = _groups(scores, group_size, 2)
    centred = g - g.mean(dim=-1, keepdim=True)
    if scale_by_std:
        centred = centred / (g.std(dim=-1, keepdim=True) + eps)
    return centred.reshape(-1)


def grpo_advantages_reference(
    scores: torch.Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """The plain loop :func:`grpo_advantages` must equal."""
    out = torch.zeros_like(scores)
    for start in range(0, scores.shape[0], group_size):
        group = [float(x) for x in scores[start : start + group_size]]
        mean = sum(group) / group_size
        std = (sum((x - mean) ** 2 for x in group) / (group_size - 1)) ** 0.5
        for k, x in enumerate(group):
            out[start + k] = (x - mean) / (std + eps) if scale_by_std else x - mean
    return out


def returns_to_go(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted returns ``G_t = Σ_{k ≥ t} γ^{k−t} r_k`` over the masked per-token rewards: the
    REINFORCE++ return (Hu 2025), i.e. GAE with values 0 and λ = 1.

    Shapes: [B, S-1] in and out. Masked positions, even inf or NaN, never change valid ones.
    Worked example: rewards [0, −0.1, 1], mask [1, 1, 1], γ=1 → [0.9, 0.9, 1].
    """
    zeros = torch.zeros_like(token_rewards)
    advantages, _ = gae(zeros, select_valid(token_rewards, mask), mask, gamma, 1.0)
    return advantages


def returns_to_go_reference(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """The plain backwards loop :func:`returns_to_go` must equal."""
    zeros = torch.zeros_like(token_rewards)
    advantages, _ = gae_reference(zeros, select_valid(token_rewards, mask), mask, gamma, 1.0)
    return advantages


def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    *,
    reduce: Reduce = single_process,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ advantages (Hu 2025): returns-to-go of the per-token rewards (the KL penalty on
    every token, the score on the last), whitened over every valid token of the global batch —
    masked mean 0 and (uncorrected) variance 1, ``reduce`` making the statistics global over ranks,
    as PPO's advantage whitening.

    Shapes: [B, S-1] in and out; 0 outside the mask.
    Worked example: rewards [[0, 1], [0, 3]], all valid, γ=1 → returns [[1, 1], [3, 3]] → mean
    2, var 1 → [[−1, −1], [1, 1]].
    """
    returns = returns_to_go(token_rewards, mask, gamma)
    mean, var = masked_mean_var(returns, mask, reduce=reduce)
    whitened = (returns - mean) * torch.rsqrt(var + eps)
    return select_valid(whitened, mask)


def broadcast_to_tokens(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A sequence-level advantage on each of its valid tokens: [B] and [B, S-1] → [B, S-1], 0
    outside the mask. Example: [2, −1] with mask [[0, 1], [1, 1]] → [[0, 2], [−1, −1]]."""
    return select_valid(per_sample.to(mask.dtype).unsqueeze(-1).expand_as(mask), mask)
