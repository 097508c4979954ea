"""Generalized Advantage Estimation (Schulman et al. 2016), vectorised, plus the slow reference loop.

Pure tensor math over [B, S-1] next-token-aligned tensors with a 1 = valid mask.
"""

from __future__ import annotations

import torch

from openaligner.algorithms.masked import select_valid


def td_errors(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """One-step TD errors ``δ_t = r_t + γ·V_{t+1} − V_t`` on masked values and rewards.

    ``V_{T}`` (after the last column) is 0, and since values are masked first the value after a
    sample's last valid token is 0 as well: the episode ends there. Shapes: [B, S-1] in and out.
    """
    v = select_valid(values, mask)
    r = select_valid(rewards, mask)
    next_v = torch.nn.functional.pad(v[:, 1:], (0, 1))
    return r + gamma * next_v - v


def gae(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns by GAE: ``A_t = Σ_l (γλ)^l δ_{t+l}``, ``returns = A + V``.

    Args:
        values: [B, S-1] critic values.
        rewards: [B, S-1] per-token rewards (e.g. from :func:`shape_rewards`).
        mask: [B, S-1], 1 on the response positions.
        gamma: discount factor γ.
        lam: GAE λ.

    Returns:
        ``(advantages, returns)``, both [B, S-1]. ``returns`` uses the masked values. Positions
        outside the mask hold finite values that callers mask; changing ``values`` or
        ``rewards`` there — even to inf or NaN — never changes the valid positions (masked
        positions are selected away before the matmul, which would otherwise spread a NaN
        along the row).

    Vectorised as one matmul with the upper-triangular discount matrix ``D[k, t] = (γλ)^{k−t}``
    (k ≥ t), which equals :func:`gae_reference` to float rounding. Worked example: values
    [0, 1, 2, 3], rewards [0, 0, 1, 0], γ=0.5, λ=0 → advantages [0.5, 0, 0.5, −3].
    """
    delta = td_errors(values, rewards, mask, gamma)
    width = delta.shape[-1]
    steps = torch.arange(width, device=delta.device)
    lag = steps.unsqueeze(1) - steps.unsqueeze(0)  # lag[k, t] = k - t
    base = torch.tensor(gamma * lam, dtype=torch.float64, device=delta.device)
    # float64 powers: (γλ)^lag underflows gracefully to 0 instead of becoming inf·0 = NaN.
    discount = torch.where(lag >= 0, base.pow(lag.clamp(min=0).to(torch.float64)), 0.0)
    advantages = delta @ discount.to(delta.dtype)
    returns = advantages + select_valid(values, mask)
    return advantages, returns


def gae_reference(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain backwards loop that :func:`gae` must equal (NeMo-Aligner's formulation)."""
    v = select_valid(values, mask)
    r = select_valid(rewards, mask)
    width = v.shape[-1]
    advantages = torch.zeros_like(v)
    running = torch.zeros_like(v[:, 0])
    for t in reversed(range(width)):
        next_v = v[:, t + 1] if t + 1 < width else torch.zeros_like(running)
        delta = r[:, t] + gamma * next_v - v[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + v
