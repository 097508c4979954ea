"""KL estimators between the policy and the frozen initial policy, and KL-coefficient controllers.

Pure: tensors and floats in, tensors and floats out. Knows nothing of models or configs.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

KLKind = Literal["k1", "abs", "k2", "k3"]
KL_KINDS: tuple[str, ...] = get_args(KLKind)


K3_MAX_LOG_RATIO = 20.0
"""|log-ratio| beyond which the k3 estimator is evaluated at the bound (keeps it finite)."""


def kl_penalty(logprobs: torch.Tensor, init_logprobs: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token KL estimate from sampled-token log-probs (Schulman, "Approximating KL", 2020).

    With Δ = logprobs − init_logprobs (both [B, S-1]):

    - ``k1``: Δ (unbiased, can be negative per token),
    - ``abs``: |Δ| (NeMo-Aligner's ``use_absolute_kl=True`` default),
    - ``k2``: ½Δ² (low variance, biased),
    - ``k3``: exp(−Δ) − 1 + Δ (unbiased, always ≥ 0), with Δ clamped to [−K3_MAX_LOG_RATIO,
      K3_MAX_LOG_RATIO] first: exp(−Δ) overflows float32 for Δ < −88 (and float16 for Δ < −11),
      and one inf would make the whole reward inf. The clamp is exact for |Δ| ≤ 20, where the
      estimate is already above 4.8e8 nats.

    Returns a tensor shaped like ``logprobs``.
    """
    delta = logprobs - init_logprobs
    if kind == "k1":
        return delta
    if kind == "abs":
        return delta.abs()
    if kind == "k2":
        return 0.5 * delta.square()
    if kind == "k3":
        # expm1 keeps precision when Δ is small, which is the common case near the initial policy.
        delta = delta.clamp(-K3_MAX_LOG_RATIO, K3_MAX_LOG_RATIO)
        return torch.expm1(-delta) + delta
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {', '.join(KL_KINDS)}")


class FixedKLController:
    """A constant KL coefficient β."""

    def __init__(self, value: float) -> None:
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Keeps β; returns it. Same signature as :class:`AdaptiveKLController`."""
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller that steers the measured KL toward a target (Ziegler et al. 2019, §2.2).

    ``e = clip(KL / target − 1, −0.2, 0.2)``; ``β ← β · (1 + e · n_steps / horizon)``, where
    ``n_steps`` is the number of samples (or steps) the KL was measured over.
    """

    def __init__(self, init_value: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target ({target}) and horizon ({horizon}) must be > 0")
        self.value = float(init_value)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Update β from the KL measured on the last rollout; returns the new β."""
        if not math.isfinite(current_kl):
            return self.value
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
