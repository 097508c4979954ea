"""What a trainer's checkpoint holds, shared by the actor's and the critic's trainers: the trained
model as a Hugging Face directory, its optimizer, LR schedule, every rank's RNG states and the
trainer's own state as JSON — written into a directory and read back.

Where the directory lives, how it is published atomically and verified is
:mod:`openaligner.io.checkpoint`'s; what goes into the JSON state is each trainer's. Must not know
about PPO, servers or particular models.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from openaligner.io.checkpoint import set_rng_state
from openaligner.models.weights import load_weights_into

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"


class SavesPretrained(Protocol):
    def save_pretrained(self, directory: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write a Hugging Face directory holding the weights as they are (the float32 masters)."""
        ...


@dataclass(frozen=True)
class TrainingFiles:
    """The names of one trainer's files inside a checkpoint directory.

    Attributes:
        model_dir: the trained model as a Hugging Face directory (``actor``, ``critic``).
        state_file: the trainer's own state as JSON (step counters and the like).
    """

    model_dir: str
    state_file: str

    def write(
        self,
        directory: Path,
        model: SavesPretrained,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        rng_states: list[Any] | None = None,
    ) -> None:
        """Write the model, the optimizer, the scheduler (when there is one) and ``rng_states``
        (when given: every rank's, in rank order), in that order; the state comes separately
        (:meth:`write_state`), since a trainer may finish it only once the rest is written."""
        model.save_pretrained(directory / self.model_dir)
        torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), directory / SCHEDULER_FILE)
        if rng_states is not None:
            torch.save(rng_states, directory / RNG_FILE)

    def write_state(self, directory: Path, state: Mapping[str, Any]) -> None:
        (directory / self.state_file).write_text(json.dumps(dict(state), indent=1))

    def read_state(self, directory: Path) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((directory / self.state_file).read_text())
        return state

    def read(
        self,
        directory: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        device: torch.device,
    ) -> dict[str, Any]:
        """Load what :meth:`write` wrote into ``model`` (in place: an optimizer over its
        parameters stays valid), ``optimizer`` (its state onto ``device``) and ``scheduler`` (when
        both exist); returns the trainer's state (:meth:`write_state`)."""
        load_weights_into(model, directory / self.model_dir)
        optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, map_location=device))
        if scheduler is not None and (directory / SCHEDULER_FILE).is_file():
            scheduler.load_state_dict(torch.load(directory / SCHEDULER_FILE))
        return self.read_state(directory)

    def restore_rng(self, directory: Path, rank: int) -> None:
        """Set this process's RNGs to those rank ``rank`` saved (a rank the checkpoint does not
        hold, from a run with fewer ranks, keeps its own)."""
        states = torch.load(directory / RNG_FILE, weights_only=False)
        if isinstance(states, dict):  # one process's states, as train-sft/train-rm wrote them before
            states = [states]
        if rank < len(states):
            set_rng_state(states[rank])
