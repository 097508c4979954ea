"""What a trainer's checkpoint holds, shared by the actor's and the critic's trainers: the trained
model, its optimizer, LR schedule, every rank's RNG states and the trainer's own state as JSON.

Owns the two layouts (whole: a Hugging Face directory + ``optimizer.pt``; sharded: a DCP
directory every rank writes), keys by the Hugging Face model's own parameter names (old
``hf_model.``-prefixed critic checkpoints still load). Publishing is :mod:`openaligner.io.checkpoint`'s.
Must not know about PPO, servers or particular models.
Design notes: docs/ppo.md, "Module notes".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from openaligner import distributed as dp
from openaligner.io.checkpoint import CheckpointManager, file_entry, set_rng_state
from openaligner.models.sharding import is_sharded
from openaligner.models.weights import load_weights_into

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
SHARDED_SUFFIX = ".dcp"
"""A sharded checkpoint's model and optimizer: ``<model_dir>.dcp/`` (docs/ppo.md, "Module notes")."""
CONFIG_FILE = "config.json"
"""A sharded checkpoint's Hugging Face config, inside ``<model_dir>.dcp/``."""
WRAPPED_MODEL = "hf_model"
"""The attribute under which a scalar-head wrapper holds its Hugging Face model."""

# Frozen parameters (a LoRA model's base) are left out, as the whole layout's adapter directory
# leaves them out: they never change, and the run rebuilds them from its model source.
_SAVE_OPTIONS = StateDictOptions(ignore_frozen_params=True)
# Not strict: the frozen parameters are absent by design; a trainable one the checkpoint lacks
# fails in dcp.load instead (it loads exactly the keys asked for).
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


class SavesPretrained(Protocol):
    def save_pretrained(self, directory: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write a Hugging Face directory holding the weights as they are (the float32 masters)."""
        ...


@dataclass(frozen=True)
class TrainingFiles:
    """The names of one trainer's files inside a checkpoint directory.

    Attributes:
        model_dir: the trained model as a Hugging Face directory (``actor``, ``critic``); a
            sharded model's checkpoint holds ``<model_dir>.dcp`` instead (:attr:`sharded_dir`).
        state_file: the trainer's own state as JSON (step counters and the like).
    """

    model_dir: str
    state_file: str

    @property
    def sharded_dir(self) -> str:
        """The DCP directory of a sharded model's weights and optimizer state."""
        return self.model_dir + SHARDED_SUFFIX

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
        (:meth:`write_state`), since a trainer may finish it only once the rest is written.

        ``model`` is the trained ``nn.Module`` or a wrapper holding it as ``.model`` (the actor,
        whose ``save_pretrained`` adds the tokenizer). When it is sharded this is a collective:
        every rank calls it with the same ``directory`` (one every rank sees, e.g. from
        :func:`stage_collective`); each writes its shards (:func:`save_sharded_state`) and rank 0
        the scheduler and RNG states. Otherwise one rank calls it and writes everything.
        """
        module = _sharded_module(model)
        if module is not None:
            keyed = hugging_face_module(module)
            save_sharded_state(directory / self.sharded_dir, keyed, optimizer)
            if not dp.is_leader():
                return
            config = getattr(keyed, "config", None)
            if config is not None and hasattr(config, "to_json_file"):
                config.to_json_file(directory / self.sharded_dir / CONFIG_FILE)
        else:
            model.save_pretrained(directory / self.model_dir)
            torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), directory / SCHEDULER_FILE)
        if rng_states is not None:
            torch.save(rng_states, directory / RNG_FILE)

    def write_state(self, directory: Path, state: Mapping[str, Any]) -> None:
        """Write the trainer's state (one rank: rank 0 when the model is sharded)."""
        (directory / self.state_file).write_text(json.dumps(dict(state), indent=1))

    def read_state(self, directory: Path) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((directory / self.state_file).read_text())
        return state

    def read(
        self,
        directory: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        device: torch.device,
    ) -> dict[str, Any]:
        """Load what :meth:`write` wrote into ``model`` (in place: an optimizer over its
        parameters stays valid), ``optimizer`` (its state onto ``device``; a sharded checkpoint's
        onto the optimizer's own tensors) and ``scheduler`` (when both exist); returns the
        trainer's state (:meth:`write_state`).

        Call on every rank that holds the model (when it is sharded, a collective: every rank with
        the same ``directory``). A sharded checkpoint loads on any number of ranks, sharded or
        not (DCP reshards); a whole checkpoint loads into a model that is not sharded only.

        Raises:
            ValueError: the checkpoint does not hold this model's weights (another model, a LoRA
                checkpoint for a run without LoRA or the reverse), or is a whole checkpoint and
                ``model`` is sharded — naming the directory and the fix.
        """
        if (directory / self.sharded_dir).is_dir():
            sharded = directory / self.sharded_dir
            keyed = model if keyed_by_wrapper(sharded) else hugging_face_module(model)
            load_sharded_state(sharded, keyed, optimizer)
        elif is_sharded(model):
            raise ValueError(
                f"{directory} was written by a model that was not sharded (parallel.strategy=ddp, or one "
                f"process): it holds {self.model_dir}/, a Hugging Face directory, not {self.sharded_dir}/, "
                "and a sharded model (parallel.strategy=fsdp under torchrun) resumes only from sharded "
                "checkpoints. Resume it with parallel.strategy=ddp, or start the sharded run from its "
                f"weights ({directory / self.model_dir} as the model path, no resume: the optimizer "
                "state starts afresh)"
            )
        else:
            load_weights_into(model, directory / self.model_dir)
            optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, map_location=device))
        if scheduler is not None and (directory / SCHEDULER_FILE).is_file():
            scheduler.load_state_dict(torch.load(directory / SCHEDULER_FILE))
        return self.read_state(directory)

    def read_weights(self, directory: Path, model: nn.Module) -> None:
        """Load only the model's weights from a checkpoint :meth:`write` wrote, into ``model`` (one
        process, not sharded; for an export): from ``<model_dir>.dcp`` (written by any number of
        ranks, either key naming, see :func:`keyed_by_wrapper`) or else ``<model_dir>/``.

        Raises:
            ValueError: the checkpoint does not hold ``model``'s trainable weights (another model,
                or LoRA adapters for a model without them).
        """
        sharded = directory / self.sharded_dir
        if not sharded.is_dir():
            load_weights_into(model, directory / self.model_dir)
            return
        keyed = model if keyed_by_wrapper(sharded) else hugging_face_module(model)
        state: dict[str, Any] = {"model": get_model_state_dict(keyed, options=_SAVE_OPTIONS)}
        try:
            dcp.load(state, checkpoint_id=sharded, no_dist=True)
        except dcp.CheckpointException as e:
            raise ValueError(
                f"cannot load the weights of {sharded} into the {type(model).__name__}: {_failures(e)}"
            ) from e
        set_model_state_dict(keyed, state["model"], options=_LOAD_OPTIONS)

    def restore_rng(self, directory: Path, rank: int) -> None:
        """Set this process's RNGs to those rank ``rank`` saved (a rank the checkpoint does not
        hold, from a run with fewer ranks, keeps its own)."""
        states = torch.load(directory / RNG_FILE, weights_only=False)
        if isinstance(states, dict):  # one process's states, as train-sft/train-rm wrote them before
            states = [states]
        if rank < len(states):
            set_rng_state(states[rank])


def _sharded_module(model: SavesPretrained | nn.Module) -> nn.Module | None:
    """The sharded ``nn.Module`` a trainer optimizes — ``model`` itself, or the module a wrapper
    holds as ``.model`` (:class:`~openaligner.models.actor.CausalLMActor`) — or None when it is
    not sharded."""
    module = model if isinstance(model, nn.Module) else getattr(model, "model", None)
    return module if isinstance(module, nn.Module) and is_sharded(module) else None


def hugging_face_module(module: nn.Module) -> nn.Module:
    """The module whose parameter names key ``module``'s sharded checkpoint: the Hugging Face model a
    scalar-head wrapper holds as ``hf_model`` (the critic), else ``module`` itself (the actor's
    Hugging Face model, with or without a ``peft`` wrapper)."""
    wrapped = getattr(module, WRAPPED_MODEL, None)
    return wrapped if isinstance(wrapped, nn.Module) else module


def keyed_by_wrapper(directory: Path) -> bool:
    """Whether the sharded checkpoint in ``directory`` was keyed by a scalar-head wrapper's own names
    (``hf_model.``-prefixed: critic checkpoints written before keys became the Hugging Face
    model's); reads DCP's ``.metadata`` only."""
    stored = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return any(key.startswith(f"model.{WRAPPED_MODEL}.") for key in stored)


# ----------------------------------------------------------------------------- sharded (DCP)
def save_sharded_state(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write ``model``'s trainable weights and ``optimizer``'s state into ``directory`` with
    ``torch.distributed.checkpoint``: each rank writes the pieces of its own shards
    (``__<rank>_0.distcp``), rank 0 also ``.metadata``; ranks write in parallel and each fsyncs
    its files.

    A collective when ``model`` is sharded: every rank calls it with the same ``directory``, which
    every rank must see (a shared filesystem across hosts); a failure on one rank is raised on
    all. Keys are the model's parameter names (``model.state_dict()``'s, e.g. Hugging Face's
    ``model.layers.0.mlp.up_proj.weight``) under ``model.`` and ``optimizer.``, so
    :func:`load_sharded_state` can reshard onto any number of ranks. Frozen parameters (a LoRA
    model's base) are left out.
    """
    model_state, optim_state = get_state_dict(model, optimizer, options=_SAVE_OPTIONS)
    try:
        dcp.save(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=directory,
            no_dist=not is_sharded(model),
        )
    except dcp.CheckpointException as e:  # a BaseException, raised on every rank
        raise OSError(f"writing {directory} failed: {_failures(e)}") from e


def load_sharded_state(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what :func:`save_sharded_state` wrote into ``model`` and ``optimizer``, in place (an
    optimizer over the parameters stays valid), whatever the number of ranks that wrote it.

    A sharded ``model``: a collective (every rank, the same ``directory``); each rank reads the
    pieces of its own shards. A model that is not sharded (replicas, one process): this rank
    reads the whole tensors, on its own. Frozen parameters keep their values.

    Raises:
        ValueError: the checkpoint lacks a trainable weight of ``model`` or holds it in another
            shape (another model; a LoRA checkpoint for a run without LoRA, or the reverse).
    """
    model_state, optim_state = get_state_dict(model, optimizer, options=_SAVE_OPTIONS)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, checkpoint_id=directory, no_dist=not is_sharded(model))
    except dcp.CheckpointException as e:  # a BaseException, raised on every rank
        raise ValueError(
            f"cannot load {directory} into the {type(model).__name__}: {_failures(e)} (a checkpoint of "
            "another model, or written with other lora settings; resume with the settings it was written "
            "with)"
        ) from e
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_LOAD_OPTIONS,
    )


def _failures(e: dcp.CheckpointException) -> str:
    """What failed on which rank, without DCP's tracebacks (they are chained)."""
    return "; ".join(
        f"rank {rank}: {type(error).__name__}: {error}" for rank, (error, _) in e.failures.items()
    )


def stage_collective(checkpoints: CheckpointManager, step: int) -> Path:
    """:meth:`CheckpointManager.stage` on rank 0, its directory on every rank (a collective).

    Raises:
        openaligner.distributed.CollectiveFailure: on every rank, when rank 0 could not make it.
    """
    staged = dp.run_guarded(
        lambda: str(checkpoints.stage(step)) if dp.is_leader() else None, "checkpoint staging"
    )
    return Path(dp.broadcast_object(staged))


def save_collective(
    checkpoints: CheckpointManager,
    step: int,
    write: Callable[[Path], None],
    metrics: dict[str, float] | None = None,
) -> Path:
    """:meth:`CheckpointManager.save` for a model sharded over ranks: a collective that every rank
    calls with the same arguments; returns ``step_<step>`` on every rank.

    1. rank 0 stages the temporary directory and every rank learns its path;
    2. every rank calls ``write(tmp)``, which writes that rank's share (e.g. :meth:`TrainingFiles.write`
       of a sharded model) and, on rank 0, the rest (the trainer's state);
    3. every rank hashes a share of the files (:func:`checksums_collective`); rank 0 seals the
       manifest with them, renames the directory into place and moves ``latest``.

    The checkpoint root must be on a filesystem every rank sees. A failure on any rank fails the
    phase on every rank (:class:`~openaligner.distributed.CollectiveFailure`, naming the rank
    and its error) and nothing is published; the staged directory is removed by a later save.
    """
    tmp = stage_collective(checkpoints, step)
    dp.run_guarded(lambda: write(tmp), "checkpoint write")
    checksums = checksums_collective(tmp)
    dp.run_guarded(
        lambda: checkpoints.publish(step, tmp, metrics, checksums) if dp.is_leader() else None,
        "checkpoint publish",
    )
    return checkpoints.root / f"step_{step}"


def checksums_collective(directory: Path) -> dict[str, dict[str, Any]]:
    """The manifest entries (:func:`~openaligner.io.checkpoint.file_entry`) of every file in
    ``directory``, hashed by all ranks in parallel (rank r takes every world-size-th file in sorted
    order: with DCP, about one rank's shard file each), on rank 0 ({} elsewhere); a collective,
    once every rank's files are written.

    Raises:
        openaligner.distributed.CollectiveFailure: on every rank, when a rank could not read a file.
    """

    def share() -> dict[str, dict[str, Any]]:
        files = sorted(p for p in directory.rglob("*") if p.is_file())
        return {str(p.relative_to(directory)): file_entry(p) for p in files[dp.rank() :: dp.world_size()]}

    shares = dp.gather_objects(dp.run_guarded(share, "checkpoint checksums"))
    return {rel: entry for part in shares for rel, entry in part.items()} if dp.is_leader() else {}
