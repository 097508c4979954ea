"""How well the critic's values serve the policy: its error by response position against the
Monte-Carlo returns of the same rollout, and the share of tokens whose advantage has the wrong sign.

Pure tensor math over [B, S-1] next-token-aligned tensors with a 1 = valid mask; global statistics
through a ``reduce`` callable (sum over ranks; identity on one process).
"""

from __future__ import annotations

import torch

from openaligner.algorithms.masked import Reduce, select_valid, single_process

POSITION_BANDS = ("early", "middle", "late", "final")
"""The bands of :func:`value_error_by_position`: first, middle and last third of each response, and
its final token (where the score sits)."""


def position_bands(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """[B, S-1] 0/1 masks of each response's tokens by relative position ``r = k / (l − 1)`` of
    token ``k`` of ``l`` (``r = 1`` for ``l = 1``): ``early`` r < 1/3, ``middle`` 1/3 ≤ r < 2/3,
    ``late`` r ≥ 2/3, and ``final`` the last token (also in ``late``).

    Integer arithmetic (``3k < l − 1``, ``3k ≥ 2(l − 1)``), so the bands do not depend on float
    rounding. Example: l = 4 → k = 0 early, 1 middle, 2 and 3 late, 3 final.
    """
    valid = mask > 0
    k = valid.long().cumsum(-1) - 1  # the token's index within its response
    span = valid.long().sum(-1, keepdim=True) - 1  # l − 1
    early = valid & (3 * k < span)
    late = valid & (3 * k >= 2 * span)
    middle = valid & ~early & ~late
    final = valid & (k == span)
    return {"early": early, "middle": middle, "late": late, "final": final}


def value_error_by_position(
    values: torch.Tensor, mc_returns: torch.Tensor, mask: torch.Tensor, *, reduce: Reduce = single_process
) -> dict[str, torch.Tensor]:
    """Mean ``|V − G|`` over every rank's response tokens in each of :func:`position_bands`.

    ``G`` is the Monte-Carlo return of the same rollout (:func:`returns_to_go` of its per-token
    rewards), so this is the critic's error against what it should predict, before it trains on
    the rollout. A band with no token on any rank is NaN. Shapes: [B, S-1] in, 0-d float64 out.

    Worked example: V = [0, 1, 2], G = [1, 1, 1] (one response of 3 tokens): |V − G| = [1, 0, 1]
    → early 1 (k = 0), middle 0 (k = 1), late 1 (k = 2), final 1.
    """
    error = (select_valid(values, mask) - select_valid(mc_returns, mask)).abs().to(torch.float64)
    bands = position_bands(mask)
    sums = torch.stack([torch.stack([(error * b).sum(), b.sum().to(torch.float64)]) for b in bands.values()])
    sums = reduce(sums)
    means = torch.where(sums[:, 1] > 0, sums[:, 0] / sums[:, 1].clamp_min(1), float("nan"))
    return dict(zip(bands, means, strict=True))


def wrong_sign_fraction(
    advantages: torch.Tensor,
    values: torch.Tensor,
    mc_returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    reduce: Reduce = single_process,
) -> torch.Tensor:
    """The share of every rank's response tokens whose advantage has the opposite sign of the
    Monte-Carlo advantage ``A_MC = G − V`` (``A · A_MC < 0``; a zero on either side is not wrong).

    A token whose advantage has the wrong sign is pushed the wrong way by the policy gradient:
    the critic's bias (GAE with λ < 1 bootstraps from it) outweighs the reward there. NaN when no
    rank has a response token. Shapes: [B, S-1] in, 0-d float64 out.

    Worked example: A = [0.5, −0.2, 0.1, 0], V = [0, 0, 0, 0], G = [1, 1, −1, 1]: A_MC = G,
    products [0.5, −0.2, −0.1, 0] → 2 of 4 tokens wrong, 0.5.
    """
    mc_advantages = select_valid(mc_returns, mask) - select_valid(values, mask)
    wrong = (select_valid(advantages, mask) * mc_advantages < 0) & (mask > 0)
    sums = reduce(torch.stack([wrong.sum().to(torch.float64), (mask > 0).sum().to(torch.float64)]))
    return torch.where(sums[1] > 0, sums[0] / sums[1].clamp_min(1), float("nan"))
