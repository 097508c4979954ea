"""Learning-rate schedules as pure functions of the optimizer step (for ``LambdaLR``)."""

from __future__ import annotations

import math
from typing import Literal, get_args

Schedule = Literal["constant", "cosine", "linear"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)


def lr_factor(
    step: int, *, warmup_steps: int, total_steps: int, schedule: Schedule, min_ratio: float
) -> float:
    """Multiplier of the peak learning rate at optimizer ``step`` (0-based).

    Linear warm-up over ``warmup_steps`` (``(step + 1) / (warmup_steps + 1)``), then ``constant``,
    or ``cosine`` / ``linear`` decay from 1 to ``min_ratio`` at ``total_steps`` (and
    ``min_ratio`` after). Example: warm-up 1, total 3, cosine, min 0 → 0.5, 1.0, 0.5, 0.0.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * shape
