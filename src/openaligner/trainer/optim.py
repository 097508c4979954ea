"""The optimizer and learning-rate schedule of every trained model: one config, one builder.

Owns :class:`OptimConfig` (the ``optim`` section of train-sft, train-rm, train-ppo and
serve-critic; each command picks its own defaults) and :func:`build_optimizer` (AdamW over the
trainable parameters, with a warm-up + decay ``LambdaLR``). The schedule's shape is the pure
:func:`openaligner.algorithms.schedules.lr_factor`; what happens at each step is
:mod:`openaligner.trainer.optim_step`. Must not know about models, losses or servers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

import torch

from openaligner.algorithms.schedules import SCHEDULES, Schedule, lr_factor
from openaligner.config import StartupError


@dataclass
class OptimConfig:
    lr: float = 1e-5  # AdamW peak learning rate (> 0)
    min_lr: float = 0.0  # learning rate at the end of the cosine/linear decay
    weight_decay: float = 0.0  # AdamW weight decay (>= 0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas, each in [0, 1)
    eps: float = 1e-8  # AdamW epsilon (> 0)
    warmup_steps: int = 0  # linear warm-up over this many optimizer steps
    scheduler: str = "constant"  # after warm-up: constant, or cosine / linear decay to min_lr
    decay_steps: int | None = None  # steps warm-up + decay span (> warmup_steps); null: the whole run

    def __post_init__(self) -> None:
        # {section}: this section's key in the command's schema (optim), filled in by the loader
        if self.lr <= 0:
            raise ValueError(f"{{section}}.lr must be > 0 (e.g. 1e-5), got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(
                f"need 0 <= {{section}}.min_lr <= {{section}}.lr={self.lr}, got min_lr={self.min_lr}"
            )
        if self.scheduler not in SCHEDULES:
            raise ValueError(f"{{section}}.scheduler must be one of {SCHEDULES}, got {self.scheduler!r}")
        if len(self.betas) != 2:
            raise ValueError(f"{{section}}.betas needs two values, got {self.betas}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(
                f"{{section}}.betas must each lie in [0, 1) (e.g. [0.9, 0.999]), got {self.betas}"
            )
        if self.weight_decay < 0:
            raise ValueError(f"{{section}}.weight_decay must be >= 0 (0 = none), got {self.weight_decay}")
        if not self.eps > 0:  # 0 divides 0 by 0 for a parameter that never had a gradient
            raise ValueError(f"{{section}}.eps must be > 0 (e.g. 1e-8), got {self.eps}")
        if self.warmup_steps < 0:
            raise ValueError(f"{{section}}.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"{{section}}.decay_steps must be >= 1 or null, got {self.decay_steps}")
        if (
            self.scheduler != "constant"
            and self.decay_steps is not None
            and self.warmup_steps >= self.decay_steps
        ):
            # the decay would never run: the rate would fall from its peak to min_lr in one step
            raise ValueError(
                f"{{section}}.warmup_steps={self.warmup_steps} must be < {{section}}.decay_steps="
                f"{self.decay_steps} (the warm-up is part of the decay's span), e.g. warmup_steps="
                f"{self.decay_steps // 10}"
            )


def check_schedule(cfg: OptimConfig, run_steps: int) -> None:
    """Refuse a schedule that would train part of a run of ``run_steps`` optimizer steps (≥ 1) at
    less than asked: a warm-up that never reaches ``optim.lr``, or a decay to ``optim.min_lr=0``
    that ends before the run does (its last steps would train at learning rate 0).

    Raises:
        StartupError: naming the key and a value that works.
    """
    if cfg.warmup_steps >= run_steps:
        raise StartupError(
            f"optim.warmup_steps={cfg.warmup_steps} is not shorter than the run's {run_steps} optimizer "
            f"steps, so the learning rate would never reach optim.lr={cfg.lr:g}; set optim.warmup_steps "
            f"< {run_steps} (e.g. {run_steps // 10})"
        )
    decays = cfg.scheduler != "constant" and cfg.decay_steps is not None
    if decays and cfg.min_lr == 0 and cfg.decay_steps is not None and cfg.decay_steps < run_steps:
        raise StartupError(
            f"optim.decay_steps={cfg.decay_steps} ends the {cfg.scheduler} decay to optim.min_lr=0 "
            f"before the run's {run_steps} optimizer steps, so the last {run_steps - cfg.decay_steps} "
            f"would train at learning rate 0; set optim.decay_steps >= {run_steps} or null (the whole "
            "run), or optim.min_lr > 0"
        )


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimConfig, run_steps: int | None
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the parameters of ``params`` that require gradients, and its schedule.

    The schedule is stepped once per optimizer step: linear warm-up, then constant or a decay to
    ``min_lr`` at ``cfg.decay_steps`` (else ``run_steps``, the run's optimizer steps).

    Raises:
        ValueError: neither ``cfg.decay_steps`` nor ``run_steps`` says how long a decay runs.
        StartupError: the schedule does not fit the ``run_steps`` (:func:`check_schedule`).
    """
    if run_steps:
        check_schedule(cfg, run_steps)
    total = cfg.decay_steps if cfg.decay_steps is not None else run_steps
    if total is None and cfg.scheduler != "constant":
        raise ValueError(f"optim.scheduler={cfg.scheduler} needs optim.decay_steps (the decay's length)")
    trainable = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable,
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        # One fused kernel per step instead of several small ops per tensor: 3–10 % of the actor
        # update on CPU (docs/benchmarks.md).
        fused=True,
    )
    min_ratio = cfg.min_lr / cfg.lr

    def factor(step: int) -> float:
        return lr_factor(
            step,
            warmup_steps=cfg.warmup_steps,
            total_steps=total or 1,
            schedule=cast("Schedule", cfg.scheduler),  # checked in __post_init__
            min_ratio=min_ratio,
        )

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
