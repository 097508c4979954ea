"""What the training commands (train-sft, train-rm, train-ppo) share at the command line: stopping on
SIGINT/SIGTERM and the one line that says how to resume.

Owns the signal handling (finish the step and checkpoint when the loop polls, else stop at once)
and :class:`~openaligner.trainer.stopping.TrainingStopped`'s one line and exit code (128 + the
signal). Must not know what is trained.
Design notes: docs/reliability.md, "Module notes".
"""

from __future__ import annotations

import logging
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from openaligner import distributed as dp
from openaligner.config import save_config
from openaligner.io.checkpoint import CheckpointManager, human_size
from openaligner.trainer.stopping import StopRequest, TrainingStopped
from openaligner.trainer.supervised import SupervisedRunConfig, SupervisedTrainer

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}
"""Exit code of a run stopped by each signal."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's ``KeyboardInterrupt``."""


@contextmanager
def stop_on_signals(
    command: str, latest: Callable[[], Path | None], advice: str = "", stop: StopRequest | None = None
) -> Iterator[StopRequest]:
    """Inside, SIGINT and SIGTERM either set ``stop`` (while its loop accepts requests: the loop
    saves and raises :class:`TrainingStopped` itself) or stop at once; stopping at once is raised
    as :class:`TrainingStopped` naming ``latest()``, the checkpoint a new run would resume from,
    and ``advice`` (e.g. " and sends the critic server back to ...") said of resuming from it.

    Outside the main thread (where handlers cannot be installed) signals keep their handlers.
    """
    request = stop if stop is not None else StopRequest()

    def handle(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if request.accepting and not request.requested:
            request.request(name)
            print(
                f"openaligner {command}: {name} received: finishing the current step, then writing a "
                "checkpoint of it (send it again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
            return
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    installed = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)} if installed else {}
    try:
        yield request
    except KeyboardInterrupt as e:
        reason = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
        checkpoint = latest()
        if checkpoint is None:
            note = "no checkpoint was written yet, so the same command starts over"
        else:
            note = (
                f"the same command resumes from {checkpoint}{advice} (stopped at once: later steps are lost)"
            )
        raise TrainingStopped(reason, None, checkpoint, note) from None
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def resume_command(argv: Sequence[str], resume_key: str, resume_on: bool) -> str:
    """The command line that resumes a stopped run: ``openaligner`` and ``argv`` (the command, its
    config file and overrides) with any ``<resume_key>=…`` override replaced by ``<resume_key>=true``
    when the run had resume off (``resume_on`` false), so that it does not start over."""
    if resume_on:
        return shlex.join(["openaligner", *argv])
    kept = [a for a in argv if not a.startswith(f"{resume_key}=")]
    return shlex.join(["openaligner", *kept, f"{resume_key}=true"])


def stopped_line(
    command: str, stopped: TrainingStopped, argv: Sequence[str], resume_key: str, resume_on: bool
) -> str:
    """The one line a stopped run prints (see the module docstring)."""
    return (
        f"openaligner {command}: stopped by {stopped.reason}; {stopped.note}; resume with: "
        f"{resume_command(argv, resume_key, resume_on)}"
    )


def run_supervised(
    command: str,
    cfg: SupervisedRunConfig,
    build: Callable[[Any], SupervisedTrainer[Any]],
    summary: Callable[[dict[str, float]], str],
) -> int:
    """train-sft and train-rm: build the trainer (``build(cfg)``), save the resolved config next to
    the outputs, train — a signal in the loop stops it after a checkpoint of the step it was in
    (:func:`stop_on_signals`) — and print ``<command>: steps A → B; <summary(last metrics)>; model
    saved to <output_dir>``. Under torchrun every rank calls it; rank 0 writes and prints."""
    configure_logging()
    dp.init_from_env()
    leader = dp.is_leader()
    checkpoints = CheckpointManager(Path(cfg.output_dir) / "checkpoints")
    with stop_on_signals(command, checkpoints.latest) as stop:
        trainer = build(cfg)
        if leader:
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            save_config(cfg, Path(cfg.output_dir) / "config.yaml")
        history = trainer.fit(stop=stop)
    dp.shutdown()
    if not leader:
        return 0
    weights = human_size(weights_size(Path(cfg.output_dir)))
    if history:
        steps = f"steps {trainer.start_step} → {trainer.state.step}; {summary(history[-1]) or 'no metrics'}"
    else:  # resumed at the run's last step: nothing ran, nothing to summarise
        steps = f"step {trainer.state.step}: no step left to run (it resumed from the run's last step)"
    print(f"{command}: {steps}; model saved to {cfg.output_dir} (weights {weights})")
    return 0


def configure_logging() -> None:
    """INFO lines with a time stamp on stderr, for what a run does besides its progress bar
    (loading, resuming, each checkpoint written and its size)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def weights_size(directory: Path) -> int:
    """Bytes of the model weights (``*.safetensors``, ``*.bin``) an export wrote into ``directory``
    and its ``merged/`` copy; checkpoints and logs are not counted."""
    found = [p for d in (directory, directory / "merged") for p in d.glob("*.safetensors")]
    found += [p for d in (directory, directory / "merged") for p in d.glob("*.bin")]
    return sum(p.stat().st_size for p in found if p.is_file())
