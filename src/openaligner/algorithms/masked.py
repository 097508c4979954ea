"""Masked statistics: mean, variance and whitening over the valid positions of a tensor.

Owns the one mask convention of the project (1 = valid, 0 = ignored; any float/bool/int dtype).
Masked positions are dropped by *selection* (``torch.where``), never by multiplying with the mask:
``inf · 0`` and ``NaN · 0`` are NaN, so a non-finite value at an ignored position (padding, an
overflowed log-prob) would otherwise poison the whole statistic.
Knows nothing of models, configs or torch.distributed: cross-rank statistics take a ``reduce``
callable (for example an all-reduce SUM) so that this module stays pure.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a small 1-D tensor of partial sums across processes (identity on a single process)."""


def single_process(t: torch.Tensor) -> torch.Tensor:
    """The :data:`Reduce` of one process: its partial sums are already the global ones."""
    return t


def _as_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def select_valid(x: torch.Tensor, mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``x`` where ``mask`` is non-zero, ``fill`` elsewhere (broadcast together).

    Unlike ``x * mask`` this keeps ignored positions finite whatever ``x`` holds there, and
    gives them zero gradient.
    """
    return torch.where(mask != 0, x, torch.as_tensor(fill, dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is 1; ``x`` and ``mask`` broadcast together."""
    picked = select_valid(x, mask)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid positions.

    Args:
        x: any shape, e.g. [B, S-1].
        mask: same shape as ``x`` (or broadcastable), 1 = valid.
        dim: reduce over this dimension only (e.g. ``dim=-1`` gives one mean per sample, [B]);
            ``None`` reduces everything to a scalar.

    Returns:
        The masked mean. A slice with no valid position gives 0 (not NaN), and its gradient is 0,
        so an empty micro-batch never poisons a loss.
    """
    m = _as_mask(mask, x)
    if dim is None:
        return masked_sum(x, m) / torch.broadcast_to(m, x.shape).sum().clamp_min(1.0)
    m = torch.broadcast_to(m, x.shape)
    return masked_sum(x, m, dim=dim) / m.sum(dim=dim).clamp_min(1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """Variance of ``x`` over all valid positions (a scalar).

    Two-pass (mean first) for accuracy. ``unbiased=True`` applies Bessel's correction n/(n-1);
    the default is the uncorrected variance, as NeMo-Aligner's whitening uses.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = _as_mask(mask, x).expand_as(x).sum()
        var = var * n / (n - 1).clamp_min(1.0)
    return var


def masked_mean_var(
    x: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None, unbiased: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked mean and variance of ``x``, global across processes when ``reduce`` is given.

    ``reduce`` receives the local partial sums ([sum, count], then [sum of squared deviations])
    and must return their sums over all processes. With ``reduce=None`` this equals
    ``(masked_mean(x, mask), masked_var(x, mask, unbiased))``.
    """
    reduce = reduce if reduce is not None else single_process
    m = torch.broadcast_to(_as_mask(mask, x), x.shape)
    sums = reduce(torch.stack([masked_sum(x, m), m.sum()]).detach().to(torch.float64))
    count = sums[1].clamp_min(1.0)
    mean = (sums[0] / count).to(x.dtype)
    sq = reduce(masked_sum((x - mean) ** 2, m).detach().to(torch.float64).reshape(1))[0]
    denom = (sums[1] - 1).clamp_min(1.0) if unbiased else count
    return mean, (sq / denom).to(x.dtype)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    reduce: Reduce | None = None,
) -> torch.Tensor:
    """Whiten ``x`` with the mean and (uncorrected) variance of its valid positions.

    ``(x - mean) * rsqrt(var + eps)``; with ``shift_mean=False`` the mean is added back (the
    "scale only" variant used for rewards). Every position is transformed (invalid ones too; they
    are masked downstream). With ``reduce`` the statistics are global across processes.

    Shapes: ``x`` and ``mask`` [B, S-1] (any shape works) → same shape as ``x``.
    """
    mean, var = masked_mean_var(x, mask, reduce=reduce)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean
