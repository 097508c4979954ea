"""The critic's trainer: value-regression passes of a critic replicated or sharded over
data-parallel ranks, and its checkpoints.

Owns :class:`CriticTrainer` (the critic, its optimizer, schedule, loss scaler and step count;
:meth:`~CriticTrainer.train_pass`; writing, checking and loading its checkpoints) and
:func:`export_checkpoint`. Shapes: ``tokens`` [N, S]; ``returns``, ``prev_values``, ``mask``
[N, S-1]. Must not know about HTTP, Triton, opcodes or PPO.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from openaligner import distributed as dp
from openaligner.algorithms import explained_variance, value_loss
from openaligner.io.checkpoint import CheckpointManager, verify_checkpoint
from openaligner.io.metrics import MetricsLogger
from openaligner.models.critic import CriticModel
from openaligner.models.fixed_shapes import PAD_TOKEN_ID, FixedShapes
from openaligner.models.precision import Precision
from openaligner.models.sharding import is_sharded
from openaligner.trainer.checkpoint_files import TrainingFiles, save_collective
from openaligner.trainer.optim_step import optimizer_step

LOGGER = logging.getLogger(__name__)

CRITIC_DIR = "critic"
"""Checkpoint sub-directory holding the critic as a Hugging Face directory (safetensors)."""
STATE_FILE = "critic_state.json"
CRITIC_FILES = TrainingFiles(model_dir=CRITIC_DIR, state_file=STATE_FILE)


def export_checkpoint(
    checkpoint: Path, out: Path, dtype: torch.dtype | None = None, config_dir: Path | None = None
) -> None:
    """Write the critic of ``checkpoint`` (a ``step_<N>`` directory :meth:`CriticTrainer.write_checkpoint`
    wrote, by one process or by every rank of a sharded critic) to ``out`` as a Hugging Face
    ``*ForSequenceClassification`` directory (``config.json`` with one label + safetensors), its
    weights as ``dtype`` (None: as stored, the float32 masters). One process, on the CPU; it holds
    the whole float32 critic.

    The architecture comes from the checkpoint (``critic/config.json``, or the ``config.json``
    sharded checkpoints carry beside their shards); ``config_dir`` (the model directory the critic
    server started from) supplies it for sharded checkpoints written before they carried one.

    Raises:
        ValueError: ``checkpoint`` holds no critic, its architecture is unknown, or it holds LoRA
            adapters only (export the adapters' directory instead, or merge them first) — naming
            what was found and the fix.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from openaligner.trainer.checkpoint_files import CONFIG_FILE

    whole, sharded = checkpoint / CRITIC_FILES.model_dir, checkpoint / CRITIC_FILES.sharded_dir
    if not whole.is_dir() and not sharded.is_dir():
        raise ValueError(
            f"{checkpoint} holds no critic: neither {CRITIC_FILES.model_dir}/ nor "
            f"{CRITIC_FILES.sharded_dir}/ (name a step_<N> directory under the critic server's "
            "checkpoint.dir)"
        )
    lora = (whole / "adapter_config.json").is_file() or (sharded.is_dir() and _holds_adapters(sharded))
    if lora:
        raise ValueError(
            f"{checkpoint} is a LoRA critic's checkpoint: it holds the adapters and the head, not the "
            "base weights, so it is no standalone model; load the base model with the adapters (peft)"
        )
    source = whole if not sharded.is_dir() else (config_dir or sharded)
    if not (source / CONFIG_FILE).is_file():
        raise ValueError(
            f"{sharded} carries no {CONFIG_FILE} (written before sharded checkpoints carried one): pass "
            "the model directory the critic server started from (its model.path) as the config directory"
        )
    config = AutoConfig.from_pretrained(str(source), local_files_only=True)
    config.num_labels = 1
    hf_model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    critic = CriticModel(hf_model)
    CRITIC_FILES.read_weights(checkpoint, critic)
    critic.save_pretrained(out, dtype=dtype)


def _holds_adapters(sharded: Path) -> bool:
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(sharded)).read_metadata().state_dict_metadata
    return any("lora_" in key for key in stored)


@dataclass
class CriticTrainConfig:
    """How the critic trains (the optimizer and its schedule come built): the ``train`` section of
    ``openaligner serve-critic``."""

    global_batch_size: int  # rows per optimizer step, over all ranks; a batch pads to a multiple
    micro_batch_size: int = 1  # training rows per forward/backward on one rank
    loss_clip_val: float = 0.2  # value clipping around prev_values; 0 disables
    gradient_clip_val: float = 1.0  # clip the global gradient norm; 0 disables

    def __post_init__(self) -> None:
        # {section}: this section's key in the command's schema (serve-critic: train), filled in
        # by the config loader
        if self.global_batch_size < 1:
            raise ValueError(f"{{section}}.global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.micro_batch_size < 1:
            raise ValueError(f"{{section}}.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.loss_clip_val < 0 or self.gradient_clip_val < 0:
            raise ValueError(
                "{section}.loss_clip_val and {section}.gradient_clip_val must be >= 0 (0 disables)"
            )


@dataclass(frozen=True)
class CriticBatch:
    """Rows the critic regresses toward their returns."""

    tokens: torch.Tensor  # [N, S] int64
    returns: torch.Tensor  # [N, S-1] float32
    prev_values: torch.Tensor  # [N, S-1] float32: the values the rollout saw (the clip's centre)
    mask: torch.Tensor  # [N, S-1] float32, 1 = trained, 0 = ignored


@dataclass(frozen=True)
class TrainResult:
    """What one training pass did."""

    loss_mean: float  # clipped value loss, mean over this pass's optimizer steps
    clip_fraction: float  # share of valid positions whose value moved more than the clip
    explained_variance: float  # of the values before each step against the returns
    grad_norm: float  # gradient norm before clipping, mean over the steps
    lr: float  # learning rate of the last step
    step: int  # optimizer steps taken so far, all passes included
    optimizer_steps: int  # steps taken by this pass
    explained_variance_after: float = float("nan")  # of the values after the pass (same rows, no grad)


def pad_to_multiple(batch: CriticBatch, multiple: int) -> CriticBatch:
    """Append rows (token 0, mask 0: they train nothing) so N is a multiple of ``multiple``."""
    extra = -batch.tokens.shape[0] % multiple
    if extra == 0:
        return batch

    def grow(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((extra, t.shape[1]))])

    return CriticBatch(grow(batch.tokens), grow(batch.returns), grow(batch.prev_values), grow(batch.mask))


def trained_width(mask: torch.Tensor) -> int:
    """Tokens a forward needs for ``mask`` [n, S-1]: up to the last valid position (0 if none)."""
    used = mask.any(0).nonzero()
    return int(used[-1]) + 1 if used.numel() else 0


def row_widths(mask: torch.Tensor) -> torch.Tensor:
    """:func:`trained_width` of each row of ``mask`` [n, S-1] alone: [n] int64 (0: nothing trained)."""
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return torch.where(mask != 0, positions, 0).amax(1)


def trained_groups(shapes: FixedShapes, mask: torch.Tensor) -> list[tuple[list[int], int]]:
    """The batch-invariant training forwards of the rows ``mask`` [n, S-1] trains: ``(row
    indices, width)`` each, as :meth:`FixedShapes.groups` forms them from each row's own
    :func:`row_widths`; rows that train nothing are in none (a forward of them adds nothing)."""
    widths = row_widths(mask)
    trained = widths.nonzero().reshape(-1)
    return [([int(trained[i]) for i in members], width) for members, width in shapes.groups(widths[trained])]


class CriticTrainer:
    """Trains a critic, replicated or sharded over the ranks, and checkpoints it.

    Create it on every rank after ``torch.distributed`` is initialised (if used at all); every
    rank holds a replica of the critic and its optimizer state, or its shard of each (a critic
    sharded by :func:`~openaligner.models.sharding.shard` before the optimizer was built). :meth:`train_pass`,
    :meth:`resume` and :meth:`sync_replicas` are collectives: every rank calls them at the same
    point. Nothing is resumed at construction.

    Args:
        cfg: batch sizes and clipping.
        model: the critic (initialised from a reward model).
        optimizer: over ``model``'s trainable parameters.
        scheduler: stepped once per optimizer step; None keeps the learning rate.
        precision: autocast of the training forward and loss scaling of the backward (default
            ``fp32``: neither).
        logger: receives ``train/loss``, ``train/grad_norm``, ``train/lr``, ``train/step_time_s``,
            ``train/clip_fraction`` per optimizer step (rank 0 only); None logs nothing.
        checkpoints: where checkpoints are written and found; None: there are none.
        batch_invariant_multiple: the batch-invariant training forward (the critic server's
            ``server.batch_invariant``: its config's ``fixed_width_multiple()``): every trained
            row is computed in a forward of exactly ``micro_batch_size`` rows (filler rows of
            mask 0 after the real ones) at its own trained width rounded up to this multiple,
            beside rows of that width only (:func:`trained_groups`), with nothing past that width
            in its tokens; so its values are bitwise those it gets alone, whatever rows and padding
            the request had. The loss and gradients are the same sums (of other groupings); rows
            that train nothing run no forward. None: each micro-batch of ``micro_batch_size``
            consecutive rows runs at its trained width.
    """

    def __init__(
        self,
        cfg: CriticTrainConfig,
        model: CriticModel,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        *,
        precision: Precision | None = None,
        logger: MetricsLogger | None = None,
        checkpoints: CheckpointManager | None = None,
        batch_invariant_multiple: int | None = None,
    ) -> None:
        gbs, world = cfg.global_batch_size, dp.world_size()
        if batch_invariant_multiple is not None and batch_invariant_multiple < 1:
            raise ValueError(f"batch_invariant_multiple must be >= 1 or None, got {batch_invariant_multiple}")
        if gbs % world:
            raise ValueError(f"global batch size {gbs} must be a positive multiple of the {world} rank(s)")
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.precision = precision if precision is not None else Precision()
        self.scaler = self.precision.grad_scaler()
        self.logger = logger
        self.checkpoints = checkpoints
        self.step = 0
        """Optimizer steps taken (skipped steps not counted), all passes and resumes included."""
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._sharded = is_sharded(model)
        self.batch_invariant_multiple = batch_invariant_multiple
        self.fixed_shapes = (
            FixedShapes(rows=cfg.micro_batch_size, multiple=batch_invariant_multiple)
            if batch_invariant_multiple is not None
            else None
        )
        """The training forward's fixed shapes (``batch_invariant_multiple``), or None."""

    # -- training ------------------------------------------------------------------------------
    def train_pass(self, batch: CriticBatch) -> TrainResult:
        """One pass over ``batch`` (the same on every rank) in order: ``ceil(N / gbs)`` optimizer
        steps.

        The batch is padded to a multiple of ``gbs`` with mask-0 rows. Within a step, each rank
        takes an equal contiguous share of the ``gbs`` rows and accumulates gradients over
        micro-batches of ``micro_batch_size`` rows; each micro-batch's loss is its share of the
        step's token mean (its token sum over the valid tokens of the whole ``gbs`` rows, every
        rank's), so the summed gradient — after the sum over ranks — is the gradient of the
        token-mean loss over the whole global batch, and the logged loss that loss, whatever the
        number of ranks and the micro-batch size. Then the shared optimizer step (clip, skip if inf/NaN,
        optimizer and scheduler step). Every rank runs the same number of micro-batches per step
        (a sharded critic's forwards and backwards are collectives): a micro-batch of padding rows
        only trains nothing, and a sharded critic still runs it (see :meth:`_join_shards`). With
        ``batch_invariant_multiple``, a rank's share of a step runs in fixed shapes instead (see
        :func:`trained_groups`), the same token-mean sum grouped otherwise; a sharded critic's
        ranks then all run as many forwards as the busiest one.
        """
        gbs = self.cfg.global_batch_size
        batch = pad_to_multiple(batch, gbs)
        losses, norms = [], []
        lr = self._lr()
        kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        clipped = torch.zeros(2, dtype=torch.float64)  # [clipped positions, positions]
        self.model.eval()  # no dropout: the values regressed are those critic_infer serves
        for start in range(0, batch.tokens.shape[0], gbs):
            started = time.perf_counter()
            total = batch.mask[start : start + gbs].sum().to(torch.float64)
            local = self._rank_share(batch, start)
            forwards = self._forwards_per_rank(batch.mask[start : start + gbs])
            self.optimizer.zero_grad(set_to_none=True)
            sums = dp.run_guarded(partial(self._accumulate, local, total, kept, forwards))
            sums = dp.all_reduce_sum(sums)
            lr = self._lr()
            outcome = optimizer_step(
                self._params,
                self.optimizer,
                self.scheduler,
                self.scaler,
                max_grad_norm=self.cfg.gradient_clip_val,
                gradients="sum",  # each micro-batch's loss is weighted by its share of the global batch
            )
            norm = outcome.grad_norm
            if outcome.stepped:
                self.step += 1
            elif self.scaler.is_enabled():  # fp16: the loss scale was too high; it was lowered
                LOGGER.info("critic step %d: fp16 gradients overflowed; step skipped", self.step)
            else:  # inputs are checked finite, so only an overflow in the model gets here
                LOGGER.warning("critic step %d: gradient norm is %s; step skipped", self.step, norm)
            self.optimizer.zero_grad(set_to_none=True)
            loss = float(sums[0])
            clipped += sums[1:3]
            losses.append(loss)
            norms.append(norm)
            step_s = time.perf_counter() - started
            if self.logger is not None and dp.is_leader():
                self.logger.log(
                    {
                        "train/loss": loss,
                        "train/grad_norm": norm,
                        "train/lr": lr,
                        "train/step_time_s": step_s,
                        "train/clip_fraction": float(sums[1] / sums[2].clamp_min(1.0)),
                    },
                    step=self.step,
                )
        return TrainResult(
            loss_mean=float(np.mean(losses)),
            clip_fraction=float(clipped[0] / clipped[1].clamp_min(1.0)),
            explained_variance=self._explained_variance(kept),
            explained_variance_after=self._explained_variance_after(batch),
            grad_norm=float(np.mean(norms)),
            lr=lr,
            step=self.step,
            optimizer_steps=len(losses),
        )

    def _rank_share(self, batch: CriticBatch, start: int) -> CriticBatch:
        """This rank's equal contiguous share of the step of ``batch`` whose ``gbs`` rows begin at
        ``start``, on the critic's device."""
        share = self.cfg.global_batch_size // dp.world_size()
        rows = slice(start + dp.rank() * share, start + (dp.rank() + 1) * share)
        fields = (batch.tokens, batch.returns, batch.prev_values, batch.mask)
        return CriticBatch(*(t[rows].to(self.model.device) for t in fields))

    def _forwards_per_rank(self, step_mask: torch.Tensor) -> int:
        """With fixed shapes and a sharded critic: the most training forwards any rank runs on its
        share of this step's ``step_mask`` [gbs, S-1] (at least 1), which every rank runs (a
        sharded critic's forwards and backwards are collectives); else 0."""
        if self.fixed_shapes is None or not self._sharded:
            return 0
        shares = step_mask.chunk(dp.world_size())
        return max(1, *(len(trained_groups(self.fixed_shapes, share)) for share in shares))

    def _micro_batches(self, local: CriticBatch, forwards: int) -> Iterator[CriticBatch | None]:
        """This rank's training forwards over ``local``, each cut to the width it is computed at
        (tokens [m, w], the rest [m, w]); None: one that only joins a sharded critic's collectives
        (its rows train nothing). Fixed shapes: :func:`trained_groups` (then None until
        ``forwards`` have run); else consecutive micro-batches at their trained width."""
        shapes = self.fixed_shapes
        if shapes is None:
            mbs = self.cfg.micro_batch_size
            for i in range(0, local.tokens.shape[0], mbs):
                width = trained_width(local.mask[i : i + mbs])
                if width == 0:  # padding rows only: nothing to learn
                    if self._sharded:
                        yield None
                    continue
                fields = (local.tokens, local.returns, local.prev_values, local.mask)
                yield CriticBatch(*(t[i : i + mbs, :width] for t in fields))
            return
        groups = trained_groups(shapes, local.mask)
        widths = row_widths(local.mask)
        for members, width in groups:
            index = torch.tensor(members, dtype=torch.long, device=local.tokens.device)
            block = CriticBatch(
                shapes.block(local.tokens, index, PAD_TOKEN_ID, width),
                *(shapes.block(t, index, 0.0, width) for t in (local.returns, local.prev_values, local.mask)),
            )
            # nothing past a row's own trained width reaches the forward: its values there are
            # masked out, and the tokens there (the client's padding) are not the row's
            own = torch.arange(width, device=index.device) < shapes.block(widths, index, 0)[:, None]
            yield dataclasses.replace(block, tokens=torch.where(own, block.tokens, PAD_TOKEN_ID))
        for _ in range(forwards - len(groups)):
            yield None

    def _accumulate(
        self,
        local: CriticBatch,
        total_tokens: torch.Tensor,
        kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        forwards: int = 0,
    ) -> torch.Tensor:
        """Forward/backward over this rank's micro-batches (:meth:`_micro_batches`); returns
        [loss share, clipped, positions]."""
        sums = torch.zeros(3, dtype=torch.float64)
        weight_denominator = total_tokens.clamp_min(1.0)
        for micro in self._micro_batches(local, forwards):
            if micro is None:
                self._join_shards(local.tokens[: self.cfg.micro_batch_size])
                continue
            mask, returns, prev = micro.mask, micro.returns, micro.prev_values
            # values at tokens 0..width-1 = critic(tokens)[:, :-1] restricted to those positions
            with self.precision.autocast():
                values = self.model.standardize(self.model(micro.tokens))
                # this micro-batch's share of the step's token mean
                loss, stats = value_loss(
                    values, prev, returns, mask, self.cfg.loss_clip_val, units=weight_denominator
                )
            tokens = mask.sum().to(torch.float64)
            self.scaler.scale(loss).backward()
            sums += torch.stack(
                [
                    loss.detach().to(torch.float64).cpu(),
                    stats.clip_fraction.detach().to(torch.float64).cpu() * tokens.cpu(),
                    tokens.cpu(),
                ]
            )
            kept.append((values.detach().float(), returns, mask))
        return sums

    def _join_shards(self, tokens: torch.Tensor) -> None:
        """A forward and backward that change nothing, for a micro-batch of padding rows only: every
        forward and backward of a sharded critic is a collective (weights gathered, gradients
        reduce-scattered), so a rank whose share of a step is padding still runs each of them. The
        gradient it adds is exactly 0 (the loss times 0), as a replica's skipped micro-batch adds
        nothing to the all-reduce."""
        with self.precision.autocast():
            values = self.model(tokens[:, :1])
        self.scaler.scale(values.sum() * 0.0).backward()

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def schedule_spent(self) -> bool:
        """Whether the schedule has brought the learning rate to 0 for good, so that a further
        pass would train at rate 0: a decay to ``optim.min_lr=0`` whose ``optim.decay_steps`` have
        passed (warm-up never starts at 0, and a constant rate is never 0)."""
        return self.scheduler is not None and self._lr() == 0.0

    def _explained_variance(self, kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> float:
        """Explained variance over every rank's trained positions (values before each step)."""
        if kept:
            values = torch.cat([v.reshape(-1) for v, _, _ in kept]).cpu()
            returns = torch.cat([r.reshape(-1) for _, r, _ in kept]).cpu()
            mask = torch.cat([m.reshape(-1) for _, _, m in kept]).cpu()
        else:  # this rank trained only padding; it still joins the reductions
            values = returns = mask = torch.zeros(1)
        return float(explained_variance(values, returns, mask, reduce=dp.all_reduce_sum))

    def _explained_variance_after(self, batch: CriticBatch) -> float:
        """Explained variance of the values after this pass over the rows it trained on (every
        rank's; a collective): one forward without gradients over this rank's share of each step of
        ``batch`` (already padded to a multiple of ``gbs``), in the training pass's own forwards
        (:meth:`_micro_batches`: the same shapes, so fixed shapes stay fixed, and as many on every
        rank of a sharded critic). Beside the values before each step (``explained_variance``), it
        says whether the critic can fit its targets at all."""
        gbs = self.cfg.global_batch_size
        kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for start in range(0, batch.tokens.shape[0], gbs):
                local = self._rank_share(batch, start)
                forwards = self._forwards_per_rank(batch.mask[start : start + gbs])
                for micro in self._micro_batches(local, forwards):
                    with self.precision.autocast():
                        if micro is None:  # joins a sharded critic's collectives only
                            self.model(local.tokens[: self.cfg.micro_batch_size, :1])
                            continue
                        values = self.model.standardize(self.model(micro.tokens))
                    kept.append((values.float(), micro.returns, micro.mask))
        return self._explained_variance(kept)

    def sync_replicas(self) -> None:
        """Every rank's critic takes rank 0's weights (replicas must start equal); a sharded critic
        has no replicas (each rank holds its own shard), so nothing happens."""
        if not dp.is_distributed() or is_sharded(self.model):
            return
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(dp.broadcast_tensor(p.detach() if dp.is_leader() else None).to(p.device, p.dtype))

    # -- checkpoints ---------------------------------------------------------------------------
    def write_checkpoint(self, extra_state: dict[str, object] | None = None) -> Path:
        """Write ``step_<N>`` atomically: critic, optimizer, scheduler, state (``step`` and
        ``extra_state``) — :class:`~openaligner.trainer.checkpoint_files.TrainingFiles`' layouts.

        Replicas: call on one rank (they are equal); it writes the critic as a Hugging Face
        directory. A sharded critic: a collective — every rank calls it, each writes its shards
        of the critic and the optimizer state in parallel, rank 0 the rest, and a failure on any
        rank is raised on every rank (:func:`~openaligner.trainer.checkpoint_files.save_collective`).
        """
        if self.checkpoints is None:
            raise RuntimeError("no checkpoint directory configured")

        def write(d: Path) -> None:
            CRITIC_FILES.write(d, self.model, self.optimizer, self.scheduler)
            if dp.is_leader():
                CRITIC_FILES.write_state(d, {"step": self.step, **(extra_state or {})})

        metrics = {"step": float(self.step)}
        if is_sharded(self.model):
            path = save_collective(self.checkpoints, self.step, write, metrics)
        else:
            path = self.checkpoints.save(self.step, write, metrics)
        if dp.is_leader():
            LOGGER.info("critic checkpoint written to %s", path)
        return path

    def restorable(self, step: int) -> str | None:
        """``None`` when a complete checkpoint of critic ``step`` is held, else why not (naming the
        steps held)."""
        if self.checkpoints is None:
            return "this server has no checkpoint directory"
        root = self.checkpoints.root
        path = root / f"step_{step}"
        if step < 0:
            problem = "steps are >= 0"
        elif not path.is_dir():
            problem = f"there is no {path}"
        else:
            incomplete = verify_checkpoint(path)
            if incomplete is None:
                return None
            problem = f"{path} is not complete ({incomplete})"
        held = [s for s, _ in self.checkpoints.checkpoints()]
        kept = self.checkpoints.keep_last
        return (
            f"{problem}; this server holds checkpoints of critic steps {held} under {root} "
            f"(checkpoint.keep_last={kept} keeps {'every one' if kept <= 0 else f'the newest {kept}'})"
        )

    def restore(self, step: int) -> None:
        """Load the checkpoint of critic ``step`` on this rank (check :meth:`restorable` first); a
        collective for a sharded critic (every rank, the same step). A checkpoint of a sharded
        critic loads on any number of ranks, sharded or not."""
        assert self.checkpoints is not None
        self.load_checkpoint(self.checkpoints.root / f"step_{step}")

    def resume(self, step: int | None = None) -> None:
        """Load the latest complete checkpoint, or that of critic ``step`` (rank 0 picks it; every
        rank loads the same one). Without checkpoints, nothing happens.

        Raises:
            ValueError: ``step`` was named and cannot be restored.
        """
        refused = -2  # every rank learns that rank 0 refused, so that none waits in a collective
        chosen, problem = -1, "refused on rank 0"
        if dp.is_leader() and step is not None:
            why = self.restorable(step)
            chosen, problem = (step, problem) if why is None else (refused, why)
        elif dp.is_leader() and self.checkpoints is not None:
            latest = self.checkpoints.latest()
            if latest is not None:
                chosen = int(CRITIC_FILES.read_state(latest)["step"])
        chosen = dp.broadcast_int(chosen)
        if chosen == refused:
            raise ValueError(f"checkpoint.resume_step={step}: {problem}")
        if chosen < 0 or self.checkpoints is None:
            return
        self.restore(chosen)

    def load_checkpoint(self, path: Path) -> None:
        """Critic weights, optimizer, scheduler and step from a directory :meth:`write_checkpoint` made."""
        state = CRITIC_FILES.read(path, self.model, self.optimizer, self.scheduler, self.model.device)
        self.step = int(state["step"])
        LOGGER.info("critic resumed from %s at step %d", path, self.step)
