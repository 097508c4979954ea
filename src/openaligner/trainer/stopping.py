"""Stopping a training run early and cleanly: the request a loop polls, and what it raises.

Owns :class:`StopRequest` (a flag that something outside the loop sets — the command's signal
handler — and that a training loop reads at step boundaries) and :class:`TrainingStopped` (what a
stopped run raises once its checkpoint is on disk). Knows nothing of signals, exit codes or the
command line: :mod:`openaligner.cli.training` sets the flag from SIGINT/SIGTERM and turns
:class:`TrainingStopped` into one line and an exit code.
"""

from __future__ import annotations

from pathlib import Path


class StopRequest:
    """Ask a training loop to stop after the step it is in, save a checkpoint, and raise
    :class:`TrainingStopped`.

    ``accepting`` is true while a loop polls the request (between its first and last step); a
    request made while it is false cannot be honoured soon (the run is loading a model, or
    exporting), and the caller should stop at once instead (see :mod:`openaligner.cli.training`).
    """

    def __init__(self) -> None:
        self.reason: str | None = None  # what asked, e.g. "SIGINT"; None: nothing asked yet
        self.accepting = False

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def request(self, reason: str) -> None:
        """Ask the loop to stop after its current step (the first reason is kept)."""
        if self.reason is None:
            self.reason = reason


class TrainingStopped(Exception):
    """A run stopped before its last step at a :class:`StopRequest` (or at once, by a second
    signal).

    Attributes:
        reason: what asked it to stop (``"SIGINT"``, ``"SIGTERM"``).
        step: the optimizer steps done; None when unknown.
        checkpoint: the checkpoint the run continues from (just written for ``step``, or the
            newest earlier one); None when there is none and a new run starts over.
        note: says what was kept or lost, for the one line the command prints.
    """

    def __init__(self, reason: str, step: int | None, checkpoint: Path | None, note: str) -> None:
        super().__init__(note)
        self.reason, self.step, self.checkpoint, self.note = reason, step, checkpoint, note
