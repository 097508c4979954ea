"""Metric sinks: JSONL (always), TensorBoard and Weights & Biases (when enabled and installed).

Metric names are namespaced (``rollout/…``, ``policy/…``, ``value/…``, ``timing/…``); values are
plain floats. Owns where metrics go, and rolling every sink that can be rolled back to a resumed
checkpoint's step (:func:`open_run_logs`: the JSONL files and TensorBoard's event files, so that
steps run again appear once); knows nothing of how metrics are computed. Every trainer opens its
logs through :func:`open_run_logs`, with the same defaults: JSONL and TensorBoard on, W&B when a
project is named.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from openaligner.io.checkpoint import write_text_atomic

log = logging.getLogger(__name__)


class PhaseTimer:
    """Wall-clock seconds per named phase, summed over repeats: ``with timer("generate"): ...``.

    ``seconds`` keeps the phases in the order they first ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.start = time.perf_counter()  # when this timer was made

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        """The seconds so far, and start again from none."""
        out = dict(self.seconds)
        self.seconds.clear()
        return out


class MetricsLogger:
    """Writes scalar metrics and sample tables of one run.

    Args:
        log_dir: run directory; ``metrics.jsonl``, ``tables.jsonl`` and (once rollouts are logged)
            ``rollouts.jsonl`` go there, TensorBoard events under ``tensorboard/``.
        tensorboard: also write TensorBoard events.
        wandb_project: if set and ``wandb`` is importable, also log to W&B.
        enabled: ``False`` on non-zero data-parallel ranks so that only one process writes.
    """

    def __init__(
        self,
        log_dir: str | Path,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        run_name: str | None = None,
        enabled: bool = True,
        append: bool = True,
    ) -> None:
        self.enabled = enabled
        self.log_dir = Path(log_dir)
        self._mode = "a" if append else "w"
        self._rollouts: IO[str] | None = None  # opened by the first log_rollouts
        self._tb: Any = None
        self._wandb: Any = None
        if not enabled:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.log_dir / "metrics.jsonl").open(self._mode)
        self._tables = (self.log_dir / "tables.jsonl").open(self._mode)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.log_dir / TENSORBOARD_DIR))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                log.warning("wandb_project is set but wandb is not installed; skipping W&B")
            else:
                self._wandb = wandb.init(project=wandb_project, name=run_name, dir=str(self.log_dir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record scalars at ``step``. Non-finite values are kept in JSONL as null."""
        if not self.enabled:
            return
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if v is not None:
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def log_table(self, name: str, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        """Record a table of samples (e.g. prompt, response, reward) at ``step``."""
        if not self.enabled:
            return
        self._tables.write(json.dumps({"step": step, "table": name, "rows": list(rows)}) + "\n")
        self._tables.flush()
        if self._tb is not None:
            text = "\n".join("| " + " | ".join(str(v) for v in r.values()) + " |" for r in rows)
            if rows:
                header = "| " + " | ".join(rows[0].keys()) + " |\n|" + "---|" * len(rows[0]) + "\n"
                self._tb.add_text(name, header + text, step)
        if self._wandb is not None and rows:
            import wandb

            cols = list(rows[0].keys())
            self._wandb.log(
                {name: wandb.Table(columns=cols, data=[list(r.values()) for r in rows])}, step=step
            )

    def log_rollouts(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Append per-sample records (flat, each with its ``step``) to ``rollouts.jsonl``, one JSON
        object a line; non-finite floats are written as null (NaN is not JSON). JSONL only: a step's
        rollouts are too many for a TensorBoard text panel."""
        if not self.enabled or not records:
            return
        if self._rollouts is None:
            self._rollouts = (self.log_dir / "rollouts.jsonl").open(self._mode)
        lines = (json.dumps({k: _finite_or_none(v) for k, v in r.items()}, allow_nan=False) for r in records)
        self._rollouts.write("".join(line + "\n" for line in lines))
        self._rollouts.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        self._tables.close()
        if self._rollouts is not None:
            self._rollouts.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSONL metrics file (for reports, plots and tests)."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


LOG_FILES = ("metrics.jsonl", "tables.jsonl", "rollouts.jsonl")
"""The JSONL logs of a run, each line a record with its ``step``."""


def open_run_logs(
    log_dir: str | Path,
    resumed_step: int | None,
    *,
    tensorboard: bool = True,
    wandb_project: str | None = None,
    run_name: str | None = None,
    enabled: bool = True,
    final_step: int | None = None,
) -> MetricsLogger:
    """A run's :class:`MetricsLogger`, its logs first rolled back to ``resumed_step`` (the step of
    the checkpoint the run resumed from; None for a run that starts afresh, whose old logs in
    ``log_dir`` are all dropped) by :func:`rewind_logs`. Only the ``enabled`` process touches files.

    ``final_step`` is the step the run ends at (its max steps). A run resumed at or past it runs no
    step again (e.g. a rerun with a lower ``max_steps`` to export an earlier checkpoint), so its
    later records stay: they are the only record of those steps."""
    log_dir = Path(log_dir)
    if enabled and resumed_step is not None and final_step is not None and resumed_step >= final_step:
        log.info("resumed at step %d, the run's last: no step runs again; logs kept", resumed_step)
    elif enabled:
        dropped = rewind_logs(log_dir, resumed_step if resumed_step is not None else -1)
        if dropped and resumed_step is not None:
            log.info("dropped %d log record(s) after step %d: those steps run again", dropped, resumed_step)
    return MetricsLogger(log_dir, tensorboard, wandb_project, run_name, enabled=enabled, append=True)


TENSORBOARD_DIR = "tensorboard"
"""Where under a run's log directory :class:`MetricsLogger` writes TensorBoard event files."""


def rewind_logs(log_dir: Path, step: int) -> int:
    """Keep only the records of steps ``<= step`` in the :data:`LOG_FILES` and in the TensorBoard
    event files under ``log_dir/tensorboard`` (a negative ``step`` drops them all).

    A run resumed from the checkpoint of ``step`` runs the later steps again; their old records,
    and a last line cut short by a crash, are dropped (TensorBoard would otherwise draw those
    steps twice). Returns how many records were dropped.
    """
    dropped = _rewind_tensorboard(log_dir / TENSORBOARD_DIR, step)
    for name in LOG_FILES:
        path = log_dir / name
        if not path.is_file():
            continue
        lines = path.read_text().splitlines()
        kept = [line + "\n" for line in lines if _step_of(line) <= step]
        if len(kept) < len(lines):
            dropped += len(lines) - len(kept)
            write_text_atomic(path, "".join(kept))
    return dropped


def _rewind_tensorboard(directory: Path, step: int) -> int:
    """Rewrite each event file under ``directory`` without the events of steps ``> step`` (a file
    left with nothing but its header is removed); how many events were dropped. Each file is
    rewritten to a temporary sibling and moved into place, so a crash leaves old or new, whole."""
    files = sorted(directory.glob("**/events.out.tfevents.*")) if directory.is_dir() else []
    if not files:
        return 0
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.summary.writer.record_writer import RecordWriter

    dropped = 0
    for path in files:
        events = list(EventFileLoader(str(path)).Load())
        kept = [e for e in events if e.step <= step]
        if len(kept) == len(events):
            continue
        dropped += len(events) - len(kept)
        if all(e.HasField("file_version") for e in kept):
            path.unlink()
            continue
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("wb") as f:
            writer = RecordWriter(f)
            for e in kept:
                writer.write(e.SerializeToString())
        os.replace(tmp, path)
    return dropped


def _step_of(line: str) -> float:
    """The step of one JSONL record; infinity for a line that is not one (e.g. cut short)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")
