"""What a training run says before its first step: each start-up phase and its time, a progress
bar over long tokenizations, and one line on the model it trains; and, once its first steps have
run, how long the rest will take (:class:`RunEstimate`).

Owns those messages (rank 0 writes them, at INFO); knows nothing of what a phase does. A run with
a real model is otherwise silent for minutes between its start and step 1 (loading weights,
tokenizing a data set, copying the initial policy).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn
from tqdm import tqdm

from openaligner import distributed as dp
from openaligner.io.checkpoint import human_size
from openaligner.models.precision import Precision
from openaligner.models.source import ModelSourceConfig

log = logging.getLogger(__name__)

R = TypeVar("R")


@contextmanager
def starting(what: str) -> Iterator[None]:
    """Log ``what…`` before a start-up phase (reading data, loading the model) and how long it
    took after it, on rank 0: a run with a real model is otherwise silent for minutes before its
    first step."""
    leader = dp.is_leader()
    if leader:
        log.info("%s…", what)
    start = time.perf_counter()
    yield
    if leader:
        log.info("%s: done in %.1f s", what, time.perf_counter() - start)


def model_source_name(source: ModelSourceConfig, key: str = "model") -> str:
    """``<key>.path=…`` with the size of its weight files, or the built-in tiny model's name."""
    if source.path is None:
        return f"{key}.tiny={source.tiny}"
    weights = [p for pattern in ("*.safetensors", "*.bin") for p in Path(source.path).glob(pattern)]
    size = sum(p.stat().st_size for p in weights)
    named = f"{key}.path={source.path}"
    return f"{named}, {human_size(size)} of weights" if weights else named


def tokenizing(records: Sequence[R], what: str, progress: bool) -> Iterable[R]:
    """``records`` behind a progress bar on rank 0 (``progress``), for the tokenization of a data
    set large enough to take a while."""
    show = progress and dp.is_leader() and len(records) >= 1000
    return tqdm(records, desc=f"tokenizing {what}", unit=" records", disable=not show, mininterval=1.0)


def count(n: int) -> str:
    """A parameter count for a reader: ``36.9 k``, ``268 M``, ``1.24 B``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def describe_model(module: nn.Module, device: torch.device, precision: Precision) -> str:
    """One line on the model a run trains: parameters (all and trained), the masters' dtype, the
    device and precision, what each checkpoint costs, and the memory the weights, gradients and
    AdamW state take before activations (16 bytes per trained parameter, 4 per frozen one)."""
    params = list(module.parameters())
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
    state_bytes = 16 * trained + 4 * (total - trained)
    return (
        f"model: {count(total)} parameters ({count(trained)} trained), {'/'.join(dtypes)} "
        f"masters on {device}, precision {precision.name}; each checkpoint ≈ {human_size(12 * trained)}; "
        f"weights, gradients and AdamW state ≈ {human_size(state_bytes)} of memory, plus activations"
    )


class RunEstimate:
    """Says, once the first steps have run, how long the rest of the run will take at their
    measured speed: a busy machine can be ten times slower than a quiet one, and nothing else
    warns of it.

    The first step is left out of the speed (it pays one-time costs: allocator warm-up, lazy
    initialisation); the speed is that of the next ``measure_steps`` steps. Call :meth:`step_done`
    after every step; it logs once, on rank 0.
    """

    def __init__(
        self,
        start_step: int,
        total_steps: int,
        measure_steps: int = 2,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.start_step, self.total_steps = start_step, total_steps
        self.measure_steps = measure_steps
        self.clock, self.wall_clock = clock, wall_clock
        self._first_done: float | None = None  # when the first step of this run finished
        self.said: str | None = None  # the estimate, once made

    def step_done(self, step: int) -> None:
        """Note that ``step`` (counted from the start of training, as the checkpoints count) ended."""
        now = self.clock()
        ran = step - self.start_step
        if ran == 1:
            self._first_done = now
            return
        if self.said is not None or self._first_done is None or ran != 1 + self.measure_steps:
            return
        per_step = (now - self._first_done) / self.measure_steps
        left = self.total_steps - step
        if left <= 0:
            return
        ends = time.strftime("%H:%M", time.localtime(self.wall_clock() + per_step * left))
        self.said = (
            f"speed: {per_step:.3g} s/step over steps {step - self.measure_steps + 1}-{step}; the remaining "
            f"{left} step(s) take about {duration(per_step * left)} (done around {ends}, at this speed)"
        )
        if dp.is_leader():
            log.info("%s", self.said)


def duration(seconds: float) -> str:
    """``seconds`` for a reader: ``45 s``, ``12 min``, ``3.5 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
