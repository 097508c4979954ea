"""One optimizer step of a data-parallel model, shared by the actor's and the critic's trainers.

Owns what happens between a step's last backward and the next step: gradient sync over ranks,
unscaling (fp16 loss scaling), clipping the global gradient norm, skipping the step when that
norm is inf/NaN, the optimizer and LR-schedule step, and the loss scaler's update. How gradients
are synchronised (replicas: one all-reduce here; shards: the backward's reduce-scatter) is decided
here once for all trainers. Must not
know about losses, batches, PPO, servers, or what a trainer does about a skipped step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from openaligner import distributed as dp
from openaligner.models.sharding import grad_norm_value, has_sharded_params

_NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)
"""A pass-through loss scaler (``step`` is ``optimizer.step()``)."""

GradientReduction = Literal["mean", "sum"]
"""How ranks' gradients combine: ``mean`` when each rank's loss is a mean over its own rows,
``sum`` when each rank's loss is already weighted by its share of the global batch."""


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did."""

    grad_norm: float  # global gradient norm before clipping, the same on every rank
    loss_scale: float  # the scale this step's gradients were scaled by (1.0 without loss scaling)

    @property
    def stepped(self) -> bool:
        """Whether the optimizer and scheduler stepped (the norm was finite)."""
        return math.isfinite(self.grad_norm)


def optimizer_step(
    params: Sequence[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    scaler: torch.amp.GradScaler,
    *,
    max_grad_norm: float,
    gradients: GradientReduction,
    scale: float = 1.0,
) -> StepOutcome:
    """Sync gradients, scale them, unscale, clip, step unless the norm is inf/NaN, update the loss
    scaler.

    Call on every rank after the step's backward passes; gradients are left in place (zero them
    before the next step).

    Args:
        params: the trainable parameters (the same list, in the same order, on every rank).
        optimizer: over ``params``.
        scheduler: stepped with the optimizer; None keeps the learning rate.
        scaler: the loss scaler the backward passes scaled with (disabled: none).
        max_grad_norm: clip the global gradient norm to this; 0 disables clipping.
        gradients: see :data:`GradientReduction`.
        scale: multiplies the synced gradients (after the sum or mean over ranks, before unscaling
            and clipping): ``1 / units`` turns the gradients of per-unit loss sums, summed over
            ranks, into those of the global per-unit mean, with replicas and shards alike.

    Returns:
        The gradient norm (0.0 when no parameter has a gradient) and the loss scale before its
        update. The optimizer and scheduler stepped if and only if the norm is finite; otherwise
        weights, optimizer state and schedule are untouched, and a dynamic loss scaler has
        lowered its scale.
    """
    if has_sharded_params(params):
        # Shards: the backward's reduce-scatter already summed the gradients over ranks.
        if gradients == "mean" and dp.world_size() > 1:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(dp.world_size())
    elif gradients == "mean":
        dp.average_gradients(params)
    else:
        dp.sum_gradients(params)
    if scale != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    loss_scale = float(scaler.get_scale())
    with_grad = [p for p in params if p.grad is not None]
    # A step without any gradient (a rank of mask-0 rows only, on one process): a loss scaler
    # cannot step or update without having checked a gradient for overflow, so it goes without.
    if not with_grad:
        scaler = _NO_SCALER
    scaler.unscale_(optimizer)  # a no-op unless fp16 loss scaling is on
    max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
    norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(with_grad, max_norm)) if with_grad else 0.0
    # The norm is the same on every rank (gradients are synced first), so all ranks skip alike.
    if math.isfinite(norm):
        scaler.step(optimizer)
        if scheduler is not None:
            scheduler.step()
    scaler.update()  # fp16: lowers the scale after an overflow
    return StepOutcome(grad_norm=norm, loss_scale=loss_scale)
