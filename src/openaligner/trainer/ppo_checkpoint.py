"""The PPO run's checkpoint and resume protocol: two halves, the critic (saved by the critic server,
maybe on another host) and the actor's ``step_<N>``, published only once the critic's half is
durable; on resume, the newest step whose critic the server still holds.

Owns the actor's checkpoint files (:data:`ACTOR_FILES`), the order of the two halves, the critic
step recorded with them, and which checkpoint a run resumes from. Must not know the loop: it is
handed the trainer's state as a dict. Why this design: docs/ppo.md (*Checkpoints and exact resume*).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from openaligner import distributed as dp
from openaligner.io.checkpoint import CheckpointManager, rng_state
from openaligner.models.actor import CausalLMActor
from openaligner.models.sharding import is_sharded
from openaligner.trainer.checkpoint_files import TrainingFiles, checksums_collective, stage_collective

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
ACTOR_FILES = TrainingFiles(model_dir="actor", state_file=TRAINER_STATE)


class CriticCheckpoints(Protocol):
    """What the protocol needs of the critic's client: its half of a checkpoint."""

    def save(self) -> Future[Any]:
        """Settles once the critic's checkpoint is durable (``{"step": critic step saved, ...}``)."""
        ...

    def restore(self, step: int) -> Future[Any]:
        """Sends the critic server back to its checkpoint of critic ``step``; the future fails with
        a ``ValueError`` when the server does not hold it."""
        ...


class ResumeError(RuntimeError):
    """The run has complete checkpoints, but the critic server holds the critic of none of them."""


@dataclass(frozen=True)
class PPOCheckpoints:
    """Writes and reads the PPO run's checkpoints: the actor, its optimizer and schedule, every
    rank's RNG states, the trainer state and the run's config, with the critic's half first."""

    checkpoints: CheckpointManager | None  # the actor's directories; None: none are written
    critic: CriticCheckpoints | None  # the critic's client (asked to save even without directories)
    model: CausalLMActor
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    config_yaml: str  # the resolved run config, stored in every checkpoint

    def save(self, step: int, metrics: dict[str, float], state: dict[str, Any]) -> None:
        """Checkpoint the critic (through ``critic_save``) and the actor, the actor's published last.

        The actor's files are written while the critic server saves, but ``step_<N>`` is published
        only once the server has answered that the critic's checkpoint is durable; the trainer
        ``state`` is written with its ``critic_step`` replaced by the step the server saved. So a
        crash at any moment leaves every published actor checkpoint with its critic (the critic
        may be one checkpoint ahead, which :func:`restore_newest_checkpoint` handles). Rank 0
        talks to the server and writes the checkpoint — with a sharded actor, every rank writes
        its own shards first (:meth:`_save_sharded`). Any failure (the server, the disk, on any
        rank) is shared with every rank, which all raise at once. Every rank calls this.
        """
        rngs = dp.gather_objects(rng_state())
        if self.checkpoints is not None and is_sharded(self.model.model):
            self._save_sharded(self.checkpoints, step, metrics, state, rngs)
        else:
            dp.run_guarded(
                lambda: self._save_on_rank0(step, metrics, state, rngs), "checkpoint", leader_only=True
            )
        dp.barrier()

    def _save_on_rank0(
        self, step: int, metrics: dict[str, float], state: dict[str, Any], rngs: list[Any]
    ) -> None:
        critic_saved = self.critic.save() if self.critic is not None else None
        if self.checkpoints is None:
            if critic_saved is not None:
                _critic_step_saved(critic_saved.result(), step, state["critic_step"])
            return

        def write(d: Path) -> None:
            ACTOR_FILES.write(d, self.model, self.optimizer, self.scheduler, rngs)
            self._write_rest(d, step, state, critic_saved)

        self.checkpoints.save(step, write, _monitored(metrics))

    def _save_sharded(
        self,
        checkpoints: CheckpointManager,
        step: int,
        metrics: dict[str, float],
        state: dict[str, Any],
        rngs: list[Any],
    ) -> None:
        """The sharded actor's checkpoint: rank 0 asks the server to save and stages the directory,
        every rank writes its shards of the actor and its optimizer state (while the server
        saves) and hashes a share of the files, then rank 0 writes the rest and publishes as
        :meth:`_save_on_rank0` does."""
        critic_saved: list[Future[Any]] = []
        if self.critic is not None:
            critic = self.critic
            dp.run_guarded(lambda: critic_saved.append(critic.save()), "critic_save", leader_only=True)
        tmp = stage_collective(checkpoints, step)
        dp.run_guarded(
            lambda: ACTOR_FILES.write(tmp, self.model, self.optimizer, self.scheduler, rngs),
            "checkpoint write",
        )
        checksums = checksums_collective(tmp)

        def finish() -> None:
            self._write_rest(tmp, step, state, critic_saved[0] if critic_saved else None)
            checkpoints.publish(step, tmp, _monitored(metrics), checksums)

        dp.run_guarded(finish, "checkpoint", leader_only=True)

    def _write_rest(
        self, d: Path, step: int, state: dict[str, Any], critic_saved: Future[Any] | None
    ) -> None:
        """The run's config and the trainer state, once the critic's half is durable (the manager
        publishes the directory only after this returns); ``critic_saved`` None: no critic."""
        (d / "config.yaml").write_text(self.config_yaml)
        saved = critic_saved.result() if critic_saved is not None else None
        ACTOR_FILES.write_state(
            d, state | {"critic_step": _critic_step_saved(saved, step, state["critic_step"])}
        )

    def load(self, path: Path) -> dict[str, Any]:
        """Restore the actor, optimizer, scheduler and this rank's RNGs from ``path``; returns the
        trainer state. Every rank calls it (a collective for a sharded actor, see
        :meth:`TrainingFiles.read`: a sharded checkpoint loads on any number of ranks; a checkpoint
        written without shards does not load into a sharded actor — ValueError, naming
        ``parallel.strategy`` and the fix)."""
        state = ACTOR_FILES.read(path, self.model.model, self.optimizer, self.scheduler, self.model.device)
        ACTOR_FILES.restore_rng(path, dp.rank())
        return state


def _critic_step_saved(saved: Any, step: int, critic_step: int | None) -> int | None:
    """The critic step the ``critic_save`` answer names (else the run's ``critic_step``), warning
    when it is not the run's."""
    saved_step = saved.get("step") if isinstance(saved, dict) else None
    if saved_step is None:
        return critic_step
    if critic_step is not None and int(saved_step) != critic_step:
        log.warning(
            "checkpoint step_%d: the critic server saved critic step %s, but this run's critic is "
            "at step %d; resuming from this checkpoint will not be an exact continuation",
            step,
            saved_step,
            critic_step,
        )
    return int(saved_step)


def _monitored(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics a checkpoint's manifest records (validation ones, for the best checkpoint)."""
    return {k.replace("/", "_"): v for k, v in metrics.items() if k.startswith("val/")}


def restore_newest_checkpoint(
    checkpoints: CheckpointManager, critic: CriticCheckpoints | None
) -> Path | None:
    """The newest complete actor checkpoint whose critic the critic server holds, with the server
    sent back to that critic (``critic.restore``): the newest step both halves have. Without a
    critic (None, see :func:`~openaligner.trainer.ppo.critic_of`), the newest complete checkpoint,
    as it is.

    Checkpoints are tried newest first (:meth:`CheckpointManager.complete`); one whose critic step
    the server refuses (pruned by its ``checkpoint.keep_last``, damaged, or saved under another
    ``checkpoint.dir``) is skipped with a warning saying why. One that records no critic step (a
    critic that reports none) is taken as it is. Call on every rank at the same point: rank 0
    talks to the server and shares the choice.

    Returns:
        The checkpoint for :meth:`PPOTrainer.load_checkpoint`, or ``None`` when there is none.

    Raises:
        ResumeError: there are complete checkpoints, but the server holds none of their critics.
    """

    def pick() -> str | None:
        refused: list[str] = []
        for path in checkpoints.complete():
            critic_step = ACTOR_FILES.read_state(path).get("critic_step")
            if critic_step is not None and critic is not None:
                try:
                    critic.restore(int(critic_step)).result()
                except ValueError as e:  # the server does not hold it
                    log.warning("not resuming from %s: %s", path, e)
                    refused.append(f"{path.name} (critic step {critic_step})")
                    continue
                log.info("the critic server went back to critic step %d, saved with %s", critic_step, path)
            return str(path)
        if refused:
            raise ResumeError(
                f"the critic server holds the critic of none of this run's checkpoints under "
                f"{checkpoints.root}: {', '.join(refused)} (its refusals are logged above). Start "
                "serve-critic with the checkpoint.dir those critics were saved in, or start this run "
                "over (exp.resume=false, or another exp.output_dir)."
            )
        return None

    chosen = dp.run_guarded(pick, "resume", leader_only=True)
    return Path(chosen) if chosen is not None else None
