"""Per-token rewards and the response mask, in the next-token-aligned layout.

Layout (NeMo-Aligner's): a sequence of ``L = response_length`` tokens (prompt + response, the
end token included) gives ``S-1`` next-token positions; position ``t`` is the prediction of
token ``t+1``. The response occupies positions ``[prompt_len-1, L-1)`` and the scalar score
sits at ``L-2``, the position that predicts the last token. For 5 tokens with a 3-token prompt:
mask ``[0 0 1 1]``, rewards ``[0 0 0 R]`` (before the KL term).
"""

from __future__ import annotations

import torch


def response_mask(
    prompt_lengths: torch.Tensor,
    sequence_lengths: torch.Tensor,
    width: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """1 on ``[prompt_len-1, sequence_len-1)`` of each row, else 0.

    Args:
        prompt_lengths: [B] number of prompt tokens.
        sequence_lengths: [B] prompt + response tokens (end token included).
        width: number of next-token positions, S-1.

    Returns:
        [B, width] mask of ``dtype``.
    """
    positions = torch.arange(width, device=prompt_lengths.device)
    start = (prompt_lengths - 1).unsqueeze(-1)
    end = (sequence_lengths - 1).unsqueeze(-1)
    return ((positions >= start) & (positions < end)).to(dtype)


def shape_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    sequence_lengths: torch.Tensor,
    beta: float | torch.Tensor,
    *,
    is_end: torch.Tensor | None = None,
    missing_eos_penalty: float | None = None,
    score_clip: float | None = None,
) -> torch.Tensor:
    """KL-shaped per-token rewards: ``−β·kl`` everywhere plus the score at ``response_length−2``.

    Args:
        scores: [B] scalar reward-model scores.
        kl: [B, S-1] per-token KL estimates (see :func:`kl_penalty`); zeros to disable.
        sequence_lengths: [B] prompt + response lengths; the score goes to index
            ``response_length − 2`` (clamped at 0).
        beta: KL coefficient.
        is_end: [B] bool, whether each sample ended on a stop token; needed by
            ``missing_eos_penalty``.
        missing_eos_penalty: if set, samples with ``is_end == False`` get this fixed score
            instead of the reward model's (the "EOS trick").
        score_clip: if set, scores are clipped to ``[−score_clip, score_clip]`` first.

    Returns:
        [B, S-1] rewards, same dtype as ``kl``. Positions outside the response mask carry
        ``−β·kl`` too; callers mask them.
    """
    s = adjust_scores(
        scores.to(kl.dtype), is_end=is_end, missing_eos_penalty=missing_eos_penalty, score_clip=score_clip
    )
    rewards = -beta * kl
    index = (sequence_lengths.long() - 2).clamp(min=0).unsqueeze(-1)
    return rewards.scatter_add(-1, index, s.unsqueeze(-1))


def adjust_scores(
    scores: torch.Tensor,
    *,
    is_end: torch.Tensor | None = None,
    missing_eos_penalty: float | None = None,
    score_clip: float | None = None,
) -> torch.Tensor:
    """The scores a reward uses: clipped to ``[−score_clip, score_clip]`` (when set), then, with
    ``missing_eos_penalty``, replaced by that fixed score where ``is_end`` is False.

    Shapes: ``scores`` [B], ``is_end`` [B] bool → [B]. Example: scores [3, −1], is_end [T, F],
    score_clip 2, missing_eos_penalty −5 → [2, −5].
    """
    s = scores
    if score_clip is not None:
        s = s.clamp(-score_clip, score_clip)
    if missing_eos_penalty is not None:
        if is_end is None:
            raise ValueError("missing_eos_penalty needs is_end ([B] bool)")
        s = torch.where(is_end.bool(), s, torch.full_like(s, missing_eos_penalty))
    return s
