"""Generalized Advantage Estimation (Schulman et al. 2016), vectorised, plus the slow reference loop;
decoupled GAE (separate γ and λ for the critic's returns and the policy's advantages, VC-PPO) and the
length-adaptive policy λ (VAPO).

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
    values: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns by GAE: ``A_t = Σ_l (γλ)^l δ_{t+l}``, ``returns = A + V``.

    Args:
        values: [B, S-1] critic values.
        rewards: [B, S-1] per-token rewards (e.g. from :func:`shape_rewards`).
        mask: [B, S-1], 1 on the response positions.
        gamma: discount factor γ.
        lam: GAE λ: one float, or a [B] tensor of one λ per row (e.g.
            :func:`length_adaptive_lambda`), computed by :func:`gae_per_row_lambda`.

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
    if isinstance(lam, torch.Tensor):
        return gae_per_row_lambda(values, rewards, mask, gamma, lam)
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


def gae_per_row_lambda(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with one λ per row: ``lam`` [B] (each in [0, 1]); otherwise as :func:`gae`.

    The backwards recursion ``A_t = δ_t + γ·λ_b·A_{t+1}``, vectorised over rows (a per-row discount
    matrix would be [B, S-1, S-1]). Equals :func:`gae` with every row's λ the same to float rounding;
    masked positions never change valid ones (values and rewards are selected first).
    """
    if lam.shape != values.shape[:1]:
        raise ValueError(f"a per-row λ must be [B] = [{values.shape[0]}], got {list(lam.shape)}")
    delta = td_errors(values, rewards, mask, gamma)
    factor = (gamma * lam).to(delta.dtype)
    advantages = torch.zeros_like(delta)
    running = torch.zeros_like(delta[:, 0])
    for t in reversed(range(delta.shape[-1])):
        running = delta[:, t] + factor * running
        advantages[:, t] = running
    return advantages, advantages + select_valid(values, mask)


def length_adaptive_lambda(response_lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive policy λ: ``λ = 1 − 1/(α·l)`` per response of ``l`` tokens, clamped
    to [0, 1] (a response of ``l ≤ 1/α`` tokens gets λ = 0, the one-step TD error).

    Longer responses get a λ nearer 1, so that the score at the end still reaches their early
    tokens (with a fixed λ < 1 it decays as λ^l). Shapes: [B] lengths (any number type) → [B]
    float64. Worked example: lengths [2, 4, 10], α = 0.5 → 1 − 1/1 = 0, 1 − 1/2 = 0.5, 1 − 1/5 = 0.8.
    """
    if not alpha > 0:
        raise ValueError(f"the length-adaptive λ's α must be > 0, got {alpha}")
    lengths = response_lengths.to(torch.float64)
    lam = 1.0 - 1.0 / (alpha * lengths.clamp_min(1e-12))
    return lam.clamp(0.0, 1.0)


def decoupled_gae(
    values: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float | torch.Tensor,
    critic_gamma: float,
    critic_lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled GAE (VC-PPO): the policy's advantages with ``(gamma, lam)``, the critic's returns
    with ``(critic_gamma, critic_lam)``.

    The critic's targets want λ = 1 (unbiased Monte-Carlo returns: a critic that starts biased
    does not feed its bias back into its own targets), the policy's advantages a λ < 1 (lower
    variance). ``lam`` may be a [B] tensor of one λ per row (:func:`length_adaptive_lambda`).
    With ``critic_gamma = gamma`` and ``critic_lam = lam`` (a float) this is one :func:`gae` call
    and returns its outputs exactly. Shapes and masking: as :func:`gae`.

    Returns:
        ``(advantages, returns)``, both [B, S-1].
    """
    same = not isinstance(lam, torch.Tensor) and (critic_gamma, critic_lam) == (gamma, lam)
    advantages, returns = gae(values, rewards, mask, gamma, lam)
    if not same:
        _, returns = gae(values, rewards, mask, critic_gamma, critic_lam)
    return advantages, returns
