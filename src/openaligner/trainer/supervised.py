"""The shared loop of the supervised trainers (SFT and reward-model training) and their common config.

Owns the configs every supervised run shares, resolving model and tokenizer sources, the
optimizer and schedule, gradient accumulation, validation, progress, metrics, resumable
checkpoints and the final export, under any precision, with LoRA and over data-parallel ranks.
What is learned comes from an :class:`Objective`; must not know SFT or preference losses.
Design notes (precision, LoRA, data parallelism): docs/models.md, "Module notes".
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Generic, Protocol, TypeVar

import torch
from torch import nn
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from openaligner import distributed as dp
from openaligner.config import StartupError, as_startup_error
from openaligner.data.prompts import EpochSampler
from openaligner.data.records import DataFileError, Record, read_records, split_holdout
from openaligner.data.render import LayoutError, SequenceLayout, use_chat_template
from openaligner.io.checkpoint import CheckpointManager, rng_state
from openaligner.io.metrics import open_run_logs
from openaligner.models.lora import MERGED_DIR, LoraConfig, merged_export_copy
from openaligner.models.precision import (
    Precision,
    check_precision,
    check_save_dtype,
    resolve_save_dtype,
    save_pretrained_as,
)
from openaligner.models.sharding import ParallelConfig, is_sharded
from openaligner.models.source import (
    ModelSourceConfig,
    SourceError,
    TokenizerSourceConfig,
    position_limit_key,
    source_position_limit,
)
from openaligner.trainer.checkpoint_files import TrainingFiles, save_collective
from openaligner.trainer.optim import OptimConfig, build_optimizer
from openaligner.trainer.optim_step import optimizer_step
from openaligner.trainer.startup import RunEstimate, describe_model
from openaligner.trainer.stopping import StopRequest, TrainingStopped

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
Batch = dict[str, torch.Tensor]

SUPERVISED_FILES = TrainingFiles(model_dir="model", state_file="trainer_state.json")
"""A checkpoint's files (``model/`` is :meth:`SupervisedTrainer.save_pretrained`'s directory)."""


# ---------------------------------------------------------------------- configs
@dataclass
class LoopConfig:
    max_steps: int = 100  # optimizer steps; -1 = run max_epochs
    max_epochs: int = 1000  # upper bound in passes over the training set
    global_batch_size: int = 8  # examples (SFT) or pairs (RM) per optimizer step, all ranks together
    micro_batch_size: int = 8  # per forward/backward on each rank; ranks × it divides global_batch_size
    val_check_interval: int = 50  # validate every this many steps (and at the end); 0 = only at the end
    val_micro_batch_size: int = 16  # examples per validation forward pass (on each rank)
    save_interval: int = 50  # checkpoint every this many steps (and at the end); 0 = only at the end
    save_every_minutes: float = 0.0  # also checkpoint once this many minutes passed since the last; 0 = off
    keep_last: int = 1  # checkpoints to keep (0 = all); each costs ~12 bytes per trainable parameter
    log_interval: int = 1  # write training metrics every this many steps
    gradient_clip_val: float = 1.0  # clip the global gradient norm to this; 0 disables
    seed: int = 0  # seeds data order, initialisation of new heads and dropout

    def __post_init__(self) -> None:
        if self.global_batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError("trainer.global_batch_size and trainer.micro_batch_size must be ≥ 1")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"trainer.micro_batch_size={self.micro_batch_size} must divide "
                f"trainer.global_batch_size={self.global_batch_size}"
            )
        if self.gradient_clip_val < 0:
            raise ValueError(
                f"trainer.gradient_clip_val must be >= 0 (0 disables), got {self.gradient_clip_val}"
            )
        if self.max_steps == 0 or self.max_steps < -1 or self.max_epochs < 1:
            raise ValueError("trainer.max_steps must be ≥ 1 or -1, and trainer.max_epochs ≥ 1")
        for key in ("val_check_interval", "save_interval"):
            if getattr(self, key) < 0:
                raise ValueError(
                    f"trainer.{key} must be >= 0 (0 = only at the end), got {getattr(self, key)}"
                )
        for key in ("val_micro_batch_size", "log_interval"):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer.{key} must be >= 1 (e.g. 1), got {getattr(self, key)}")
        if self.save_every_minutes < 0:
            raise ValueError(
                f"trainer.save_every_minutes must be >= 0 (0 = off), got {self.save_every_minutes}"
            )


@dataclass
class SupervisedRunConfig:
    """What train-sft and train-rm share; each adds its ``data`` section and names its output_dir."""

    RENAMED_KEYS: ClassVar[dict[str, str]] = {"optim.max_grad_norm": "trainer.gradient_clip_val"}

    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)  # the model to train
    tokenizer: TokenizerSourceConfig = field(default_factory=TokenizerSourceConfig)  # how to tokenize
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))  # AdamW and LR schedule
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters instead of full fine-tuning
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # ddp replicas or fsdp shards (torchrun)
    trainer: LoopConfig = field(default_factory=LoopConfig)  # steps, batch sizes, validation, checkpoints
    output_dir: str = "runs/supervised"  # final HF model + tokenizer, checkpoints/ and metrics.jsonl
    resume: bool = True  # continue from the newest complete checkpoint in output_dir
    device: str = "auto"  # auto (CUDA if available), cpu, cuda, cuda:1, ...
    precision: str = "auto"  # auto (bf16-mixed on CUDA, else fp32) | fp32 | bf16-mixed | fp16-mixed
    save_dtype: str = "auto"  # final model dtype: auto (as model.path is stored, fp32 tiny), fp32, bf16, fp16
    progress: bool = True  # tqdm progress bar
    tensorboard: bool = True  # also write TensorBoard events under output_dir/tensorboard
    wandb_project: str | None = None  # also log to this W&B project (when wandb is installed)

    def __post_init__(self) -> None:
        check_precision(self.precision, "precision")
        self.parallel.check_precision(self.precision)
        check_save_dtype(self.save_dtype, "save_dtype")
        steps = self.trainer.max_steps
        if steps > 0 and self.optim.warmup_steps >= steps:  # -1: known once the data is read
            raise ValueError(
                f"optim.warmup_steps={self.optim.warmup_steps} is not shorter than trainer.max_steps="
                f"{steps}, so the learning rate would never reach optim.lr={self.optim.lr:g}; set "
                f"optim.warmup_steps < {steps} (e.g. {steps // 10})"
            )


# ---------------------------------------------------------------------- sources
def check_data_lengths(max_length: int, val_fraction: float) -> None:
    """Refuse, at load, a ``data.max_length`` or ``data.val_fraction`` (of train-sft and train-rm)
    that no run can use."""
    if max_length < 0:
        raise ValueError(f"data.max_length must be >= 0 (0 = the model's position limit), got {max_length}")
    if not 0 <= val_fraction < 1:
        raise ValueError(
            f"data.val_fraction must lie in [0, 1) (e.g. 0.1; 0 = no holdout), got {val_fraction}"
        )


def load_train_val_records(
    train_path: str,
    val_path: str | None,
    parse: Callable[[Record], R],
    shape: str,
    val_fraction: float,
    seed: int,
    split: str = "train",
    val_split: str = "test",
) -> tuple[list[R], list[R]]:
    """Training and validation records, each read by ``parse`` (a :mod:`openaligner.data.formats`
    reader): ``val_path`` when given, else a seeded holdout of ``train_path``. Either path is a JSONL
    file or a ``datasets`` directory (``split`` / ``val_split`` of a DatasetDict).

    Raises:
        StartupError: naming ``data.train_path`` or ``data.val_path``, when that file is missing,
            unreadable, empty or has a record that is not ``shape``.
    """
    records = _read_data_file("data.train_path", train_path, "data.split", split, parse, shape)
    if val_path is not None:
        return records, _read_data_file("data.val_path", val_path, "data.val_split", val_split, parse, shape)
    return split_holdout(records, val_fraction, seed)


def _read_data_file(
    key: str, path: str, split_key: str, split: str, parse: Callable[[Record], R], shape: str
) -> list[R]:
    try:
        return [parse(r) for r in read_records(path, split)]
    except DataFileError as e:
        raise StartupError(
            f"{key}={e}; {key} must name a JSONL file with one record per line, or a datasets directory "
            f"(save_to_disk; {split_key} picks the split of a DatasetDict), with records {shape}"
        ) from None


def sequence_layout(
    tokenizer: PreTrainedTokenizerBase, chat_template: str, add_bos: bool, add_eos: bool
) -> SequenceLayout:
    """The layout of ``data.chat_template`` / ``data.add_bos`` / ``data.add_eos`` with ``tokenizer``.

    Raises:
        StartupError: ``data.chat_template=true`` and the tokenizer has no template.
    """
    with as_startup_error(LayoutError):
        return SequenceLayout(add_bos, add_eos, use_chat_template(chat_template, tokenizer))


def resolve_max_length(max_length: int, source: ModelSourceConfig) -> int:
    """``data.max_length``, or the model's position limit when it is 0, read from the ``model``
    source without loading weights.

    Raises:
        StartupError: ``max_length`` is beyond the model's positions, or 0 for a model that states
            no position limit.
    """
    with as_startup_error(SourceError):
        limit = source_position_limit(source)
    where = position_limit_key(source)
    if limit is None:
        if max_length == 0:
            raise StartupError(
                f"data.max_length=0 means the model's position limit, but {where} states no position "
                "limit (no n_positions or max_position_embeddings); set data.max_length"
            )
        return max_length
    if max_length > limit:
        raise StartupError(
            f"data.max_length={max_length} is beyond the model's {limit} positions ({where}); lower "
            f"data.max_length to at most {limit} (0 = the model's limit)"
        )
    return max_length or limit


def require_full_batch(
    kept: int, read: int, held_out: int, max_length: int, global_batch_size: int, unit: str
) -> None:
    """Refuse a training set that cannot fill one global batch, saying where the rest went.

    Args:
        kept: training ``unit``s (examples, pairs) left after dropping long or empty ones.
        read: training ``unit``s read; held_out: those held out of ``data.train_path`` for
            validation (``data.val_fraction``).

    Raises:
        StartupError: ``kept < global_batch_size``.
    """
    if kept >= global_batch_size:
        return
    if kept == 0 and read > 0:
        raise StartupError(
            f"all {read} {unit} to train on in data.train_path were dropped as longer than "
            f"data.max_length={max_length} tokens or empty; raise data.max_length (0 = the model's limit) "
            "or shorten the data"
        )
    notes = (
        [f"{read - kept} dropped as longer than data.max_length={max_length} or empty"] if kept < read else []
    )
    notes += [f"{held_out} held out for validation (data.val_fraction)"] if held_out else []
    raise StartupError(
        f"data.train_path leaves {kept} {unit} to train on{' (' + '; '.join(notes) + ')' if notes else ''}, "
        f"fewer than one batch of trainer.global_batch_size={global_batch_size}; lower "
        "trainer.global_batch_size (and trainer.micro_batch_size) or add data"
    )


# ---------------------------------------------------------------------- data parallelism
def rank_share(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """The examples (SFT) or pairs (RM) each of ``world_size`` ranks trains on per step: its equal
    share of the global batch, a whole number of micro-batches, so that every rank runs the same
    number of forwards and backwards.

    Raises:
        StartupError: ``global_batch_size`` is not a multiple of ``world_size × micro_batch_size``;
            the message names both keys, the world size and the nearest sizes that work.
    """
    per_step = world_size * micro_batch_size
    if global_batch_size % per_step == 0:
        return global_batch_size // world_size
    lower, higher = (global_batch_size // per_step) * per_step, (global_batch_size // per_step + 1) * per_step
    fixes = [f"trainer.global_batch_size={n}" for n in (lower, higher) if n > 0]
    if global_batch_size % world_size == 0:
        share = global_batch_size // world_size
        fixes.append(f"a trainer.micro_batch_size that divides {share}")
    raise StartupError(
        f"trainer.global_batch_size={global_batch_size} does not split over {world_size} ranks in "
        f"micro-batches of trainer.micro_batch_size={micro_batch_size}: every rank takes an equal share "
        f"in whole micro-batches, so the global batch must be a multiple of ranks × micro_batch_size = "
        f"{world_size} × {micro_batch_size} = {per_step}; set {' or '.join(fixes)}"
    )


def even_split(count: int, world_size: int, rank: int) -> tuple[range, int]:
    """Rank ``rank``'s contiguous share of ``count`` items and how many repeats pad it to every
    rank's count, ``ceil(count / world_size)`` (the last ranks may get fewer items, even none).

    Example: 5 items over 2 ranks → rank 0: ``range(0, 3)``, 0 repeats; rank 1: ``range(3, 5)``, 1.
    """
    per_rank = -(-count // world_size)
    start, stop = min(rank * per_rank, count), min((rank + 1) * per_rank, count)
    return range(start, stop), per_rank - (stop - start)


# ---------------------------------------------------------------------- the loop
class Objective(Protocol):
    """What a supervised trainer optimises.

    ``loss(batch)`` returns ``(loss_sum, count, metric_sums)``: the loss summed over the batch's
    units (tokens for SFT, pairs for RM), the number of units, and per-unit metric sums. The loop
    divides by the unit count of the whole global batch, so gradient accumulation is exact.
    """

    @property
    def module(self) -> nn.Module: ...

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]: ...

    def save(self, directory: Path, dtype: torch.dtype | None = None) -> None:
        """Write the module as a Hugging Face directory, weights as ``dtype`` (None: as they are)."""


@dataclass
class TrainerState:
    """What a checkpoint restores besides weights and optimizer."""

    step: int = 0  # optimizer steps done
    consumed_samples: int = 0  # training examples drawn so far (the data position)


class SupervisedTrainer(Generic[T]):
    """Runs an :class:`Objective` over a dataset with resumable checkpoints.

    Args:
        objective: the model and its loss.
        train_items / val_items: dataset items; ``collate`` turns a list of them into a batch.
        tokenizer: saved with the final model and every checkpoint.
        output_dir: final model, ``checkpoints/``, ``metrics.jsonl`` and ``tensorboard/`` go here.
        tensorboard / wandb_project: the metric sinks besides JSONL (:func:`open_run_logs`).
        resume: continue from the newest complete checkpoint in ``output_dir`` if there is one.
        precision: autocast and loss scaling of the training and validation forwards (default
            ``fp32``: neither).
        save_dtype: dtype of the final export's weights (None: as trained, float32).
        export_merged: the objective's module carries LoRA adapters, and the final export also
            writes ``output_dir/merged``, the model with the adapters merged in
            (:func:`openaligner.models.lora.merged_copy`), weights as ``save_dtype``.
        layout: the sequence layout the data was built with, recorded in every export as
            ``sequence_layout.json`` (the reward server reads it); None writes none.

    Under torchrun every rank constructs the trainer with the same arguments (the objective's
    module already sharded by :func:`~openaligner.models.sharding.distribute` for
    ``parallel.strategy=fsdp``) and calls the
    same methods in the same order: :meth:`fit`, :meth:`validate`, :meth:`save_checkpoint` and
    :meth:`export` are collectives.

    Raises:
        StartupError: the global batch does not split over the ranks (:func:`rank_share`).
    """

    @classmethod
    def for_run(
        cls,
        cfg: SupervisedRunConfig,
        objective: Objective,
        train_items: Sequence[T],
        val_items: Sequence[T],
        collate: Callable[[Sequence[T]], Batch],
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        layout: SequenceLayout,
    ) -> SupervisedTrainer[T]:
        """The trainer of a train-sft or train-rm run: every setting but the data from ``cfg``."""
        return cls(
            objective,
            train_items,
            val_items,
            collate,
            cfg.trainer,
            cfg.optim,
            cfg.output_dir,
            tokenizer,
            device,
            resume=cfg.resume,
            progress=cfg.progress,
            tensorboard=cfg.tensorboard,
            wandb_project=cfg.wandb_project,
            precision=Precision.resolve(cfg.precision, device),
            save_dtype=resolve_save_dtype(cfg.save_dtype, cfg.model.path),
            export_merged=cfg.lora.merge_on_save,
            layout=layout,
        )

    def __init__(
        self,
        objective: Objective,
        train_items: Sequence[T],
        val_items: Sequence[T],
        collate: Callable[[Sequence[T]], Batch],
        loop: LoopConfig,
        optim: OptimConfig,
        output_dir: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        *,
        resume: bool = True,
        progress: bool = True,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        precision: Precision | None = None,
        save_dtype: torch.dtype | None = None,
        export_merged: bool = False,
        layout: SequenceLayout | None = None,
    ) -> None:
        self.objective = objective
        self.train_items, self.val_items = train_items, val_items
        self.collate = collate
        self.loop, self.optim_cfg = loop, optim
        self.output_dir = Path(output_dir)
        self.tokenizer = tokenizer
        self.device = device
        self.resume, self.progress, self.tensorboard = resume, progress, tensorboard
        self.wandb_project = wandb_project
        self.precision = precision if precision is not None else Precision()
        self.scaler = self.precision.grad_scaler()
        self.save_dtype = save_dtype
        self.export_merged = export_merged
        self.layout = layout
        self.sampler = EpochSampler(len(train_items), loop.global_batch_size, loop.seed)
        if self.sampler.steps_per_epoch == 0:
            raise ValueError(
                f"{len(train_items)} training examples cannot fill one batch of trainer.global_batch_size="
                f"{loop.global_batch_size}; lower it or add data"
            )
        self.rank_batch_size = rank_share(loop.global_batch_size, loop.micro_batch_size, dp.world_size())
        by_epochs = self.sampler.steps_per_epoch * loop.max_epochs
        self.max_steps = by_epochs if loop.max_steps < 0 else min(loop.max_steps, by_epochs)
        if not is_sharded(objective.module):  # shards are where sharding put them (maybe CPU memory)
            objective.module.to(device)
        params = [p for p in objective.module.parameters() if p.requires_grad]
        self.params = params
        self.optimizer, self.scheduler = build_optimizer(params, optim, self.max_steps)
        self.checkpoints = CheckpointManager(self.output_dir / "checkpoints", keep_last=loop.keep_last)
        self.state = TrainerState()
        if dp.is_leader():
            log.info("%s", describe_model(objective.module, device, self.precision))
            log.info(
                "data: %d training and %d validation items; %d step(s) of %d (%d epoch(s) at most)",
                len(train_items),
                len(val_items),
                self.max_steps,
                loop.global_batch_size,
                -(-self.max_steps // self.sampler.steps_per_epoch),
            )
        self.start_step = 0  # the step fit() started from (after a resume: the checkpoint's)

    # ------------------------------------------------------------------ the recipe
    def fit(self, stop: StopRequest | None = None) -> list[dict[str, float]]:
        """Train to ``max_steps``; returns the metrics of every step (validation merged in).

        ``stop``: polled after every step; once requested (on any rank), the step's checkpoint is
        written and :class:`TrainingStopped` raised instead of going on (no final export).
        """
        self.output_dir.mkdir(parents=True, exist_ok=True)
        resumed = self._maybe_resume()
        self.start_step = self.state.step
        leader = dp.is_leader()
        logger = open_run_logs(  # rolled back to the checkpoint's step: steps run again appear once
            self.output_dir,
            self.state.step if resumed else None,
            tensorboard=self.tensorboard,
            wandb_project=self.wandb_project,
            enabled=leader,
            final_step=self.max_steps,
        )
        history: list[dict[str, float]] = []
        bar = tqdm(
            total=self.max_steps,
            initial=self.state.step,
            disable=not (self.progress and leader),
            desc="train",
        )
        stop = stop if stop is not None else StopRequest()
        last_save = time.monotonic()
        estimate = RunEstimate(self.state.step, self.max_steps)
        try:
            batches = self.sampler.batches(self.state.consumed_samples)
            stop.accepting = True
            while self.state.step < self.max_steps:
                epoch, indices = next(batches)
                metrics = self._train_step(indices)  # 1. forward/backward over micro-batches, 2. step
                self.state.step += 1
                self.state.consumed_samples += len(indices)
                metrics["train/epoch"] = float(epoch)
                last = self.state.step == self.max_steps
                if self._due(self.loop.val_check_interval, last) and self.val_items:
                    metrics |= self.validate()  # 3. validation
                if self._due(self.loop.log_interval, last):
                    logger.log(metrics, self.state.step)
                history.append(metrics)
                bar.set_postfix({_short(k): f"{v:.4g}" for k, v in metrics.items() if "loss" in k})
                bar.update(1)
                estimate.step_done(self.state.step)
                # 4. resumable checkpoint: by steps, by wall time, or because a stop was asked
                stopping, timed = self._stop_or_timed_save(stop, last_save, last)
                if self._due(self.loop.save_interval, last) or timed or stopping:
                    path = self.save_checkpoint()
                    last_save = time.monotonic()
                if stopping:
                    raise TrainingStopped(
                        stop.reason or "a stop request",
                        self.state.step,
                        path,
                        f"checkpoint of step {self.state.step} written to {path}",
                    )
        finally:
            stop.accepting = False
            bar.close()
            logger.close()
        # 5. final Hugging Face model (or LoRA adapter, and the merged model) + tokenizer
        self.export(self.output_dir, dtype=self.save_dtype, merged=self.export_merged)
        return history

    def _stop_or_timed_save(self, stop: StopRequest, last_save: float, last: bool) -> tuple[bool, bool]:
        """``(stop now, checkpoint by wall time)`` after a step, the same on every rank (a stop asked
        on any rank stops all; rank 0's clock decides the timed save); neither at the last step,
        which saves and ends anyway."""
        minutes = self.loop.save_every_minutes
        timed = minutes > 0 and time.monotonic() - last_save >= minutes * 60
        flags = torch.tensor([float(stop.requested), float(timed and dp.is_leader())], dtype=torch.float64)
        if dp.is_distributed():
            flags = dp.all_reduce_max(flags)
        wants_stop, wants_save = bool(flags[0]), bool(flags[1])
        if wants_stop and stop.reason is None:
            stop.request("a stop request on another rank")
        return wants_stop and not last, wants_save and not last

    def _train_step(self, indices: list[int]) -> dict[str, float]:
        """One optimizer step on the global batch ``indices`` (the same on every rank)."""
        start = time.perf_counter()
        self.objective.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        units = 0.0
        share = self.rank_batch_size
        mine = indices[dp.rank() * share : (dp.rank() + 1) * share]
        for batch in self._micro_batches(mine, self.loop.micro_batch_size):
            with self.precision.autocast():
                loss_sum, count, metric_sums = self.objective.loss(batch)
            self.scaler.scale(loss_sum).backward()  # gradients of sums; divided by the unit count below
            units += float(count)
            for k, v in metric_sums.items():
                sums[k] += float(v)
        units, sums = _sum_over_ranks(units, sums)
        # Gradients of sums, summed over ranks, become those of the global per-unit mean (before
        # unscaling: the same product).
        scale = 1.0 / max(units, 1.0)
        lr = float(self.scheduler.get_last_lr()[0])
        outcome = optimizer_step(
            self.params,
            self.optimizer,
            self.scheduler,
            self.scaler,
            max_grad_norm=self.loop.gradient_clip_val,
            gradients="sum",
            scale=scale,
        )
        if not outcome.stepped and dp.is_leader():
            log.warning(
                "step %d skipped: the gradient norm is %s (weights, optimizer state and schedule unchanged)",
                self.state.step + 1,
                outcome.grad_norm,
            )
        metrics = {f"train/{k}": v * scale for k, v in sums.items()}
        metrics |= {
            "train/grad_norm": outcome.grad_norm,
            "train/lr": lr,
            "timing/step_s": time.perf_counter() - start,
        }
        if self.scaler.is_enabled():
            metrics["train/loss_scale"] = float(self.scaler.get_scale())
        return metrics

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Per-unit means of the objective's metrics over the whole validation set (the same on
        every rank). Its micro-batches are split over the ranks (:func:`even_split`); a rank with
        fewer runs repeats of the first one, whose results are discarded, so that every rank runs
        the same number of forwards."""
        self.objective.module.eval()
        sums: dict[str, float] = defaultdict(float)
        units = 0.0
        size = self.loop.val_micro_batch_size
        chunks = [
            list(range(i, min(i + size, len(self.val_items)))) for i in range(0, len(self.val_items), size)
        ]
        mine, repeats = even_split(len(chunks), dp.world_size(), dp.rank())
        for index, kept in [(i, True) for i in mine] + [(0, False)] * repeats:
            with self.precision.autocast():
                _, count, metric_sums = self.objective.loss(self._batch(chunks[index], train=False))
            units += float(count) if kept else 0.0
            for k, v in metric_sums.items():  # a repeat's keys too: every rank sums the same keys
                sums[k] += float(v) if kept else 0.0
        units, sums = _sum_over_ranks(units, sums)
        return {f"val/{k}": v / max(units, 1.0) for k, v in sums.items()}

    # ------------------------------------------------------------------ checkpoints
    @property
    def model(self) -> nn.Module:
        """The trained module (the objective's), for :class:`TrainingFiles`."""
        return self.objective.module

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_<N>`` atomically: the model, optimizer, scheduler, every rank's
        RNG states and the trainer state (:data:`SUPERVISED_FILES`: a whole model's ``model/`` is
        :meth:`save_pretrained`'s directory of float32 masters, a sharded model's ``model.dcp/``
        is written by every rank). A collective; a failure on any rank raises on every rank."""
        rngs = dp.gather_objects(rng_state())
        step, leader = self.state.step, dp.is_leader()

        def write(d: Path) -> None:
            SUPERVISED_FILES.write(d, self, self.optimizer, self.scheduler, rngs)
            if leader:
                SUPERVISED_FILES.write_state(d, self.state.__dict__)

        if is_sharded(self.model):
            return save_collective(self.checkpoints, step, write)
        dp.run_guarded(lambda: self.checkpoints.save(step, write) if leader else None, "checkpoint")
        return self.checkpoints.root / f"step_{step}"

    def _maybe_resume(self) -> bool:
        """Restore the newest complete checkpoint rank 0 finds (every rank the same one, each its
        own RNG states); whether there was one. A collective."""
        path = dp.broadcast_object(self.checkpoints.latest() if self.resume and dp.is_leader() else None)
        if path is None:
            return False
        try:
            state = SUPERVISED_FILES.read(path, self.model, self.optimizer, self.scheduler, self.device)
        except ValueError as e:  # e.g. a LoRA checkpoint for a run without lora.r, or the reverse
            raise StartupError(
                f"resume=true cannot continue from {path}: {e} (or set resume=false, or another output_dir)"
            ) from None
        SUPERVISED_FILES.restore_rng(path, dp.rank())
        self.state = TrainerState(**state)
        log.info("resumed from %s at step %d", path, self.state.step)
        return True

    def export(
        self, directory: Path, atomic: bool = True, dtype: torch.dtype | None = None, merged: bool = False
    ) -> None:
        """Save the model and tokenizer as a Hugging Face directory (:meth:`save_pretrained`), and
        with ``merged`` also ``directory/merged``, the model with its LoRA adapters merged in
        (weights as ``dtype``) and the tokenizer. With ``atomic`` the files are written to a
        temporary sibling first and moved in one by one with ``os.replace``.

        A collective: rank 0 writes (a sharded model's weights gathered to it first by every
        rank); a failure on any rank raises on every rank."""
        takes_part = dp.is_leader() or is_sharded(self.model)
        dp.run_guarded(
            lambda: self._write_export(directory, atomic, dtype, merged) if takes_part else None, "export"
        )

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write the model (a LoRA model: its adapter directory), the tokenizer and the sequence
        layout into ``directory``, weights as ``dtype`` (None: the float32 masters, as checkpoints
        need). A model that is not sharded: on the calling rank alone. A sharded one: every rank
        calls it, its weights are gathered to rank 0, which alone writes."""
        directory = Path(directory)
        self.objective.save(directory, dtype)  # sharded: gathered first, so rank 0 writes after every rank
        if is_sharded(self.model) and not dp.is_leader():
            return
        self.tokenizer.save_pretrained(str(directory))
        if self.layout is not None:
            self.layout.save(directory)

    def _write_export(self, directory: Path, atomic: bool, dtype: torch.dtype | None, merged: bool) -> None:
        """:meth:`export` on rank 0, and on the other ranks of a sharded model (which only take part
        in gathering the weights: the files are rank 0's alone)."""
        leader = dp.is_leader()
        if not atomic:
            self.save_pretrained(directory, dtype)
            if merged:
                merged_model = merged_export_copy(self.model)  # a collective when sharded
                if leader:
                    assert merged_model is not None
                    save_pretrained_as(merged_model, directory / MERGED_DIR, dtype)
                    self.tokenizer.save_pretrained(str(directory / MERGED_DIR))
                    if self.layout is not None:
                        self.layout.save(directory / MERGED_DIR)
            return
        tmp = directory / f".export-{os.getpid()}"
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
        self._write_export(tmp, atomic=False, dtype=dtype, merged=merged)
        if not leader:
            return
        for f in tmp.iterdir():
            if f.is_dir() and (directory / f.name).is_dir():  # os.replace cannot replace a directory
                shutil.rmtree(directory / f.name)
            os.replace(f, directory / f.name)
        tmp.rmdir()

    # ------------------------------------------------------------------ helpers
    def _micro_batches(self, indices: list[int], size: int) -> Iterator[Batch]:
        for start in range(0, len(indices), size):
            yield self._batch(indices[start : start + size])

    def _batch(self, indices: list[int], train: bool = True) -> Batch:
        items = self.train_items if train else self.val_items
        batch = self.collate([items[i] for i in indices])
        return {k: v.to(self.device) for k, v in batch.items()}

    def _due(self, interval: int, last: bool) -> bool:
        return last or (interval > 0 and self.state.step % interval == 0)


def _sum_over_ranks(units: float, sums: dict[str, float]) -> tuple[float, dict[str, float]]:
    """``units`` and each of ``sums`` summed over ranks, in float64 (one all-reduce; the keys are
    the objective's, the same on every rank; the identity on one process)."""
    keys = sorted(sums)
    total = dp.all_reduce_sum(torch.tensor([units, *(sums[k] for k in keys)], dtype=torch.float64))
    values = total.tolist()
    return values[0], dict(zip(keys, values[1:], strict=True))


def _short(name: str) -> str:
    """Progress-bar label of a metric: ``train/loss`` → ``loss``, ``val/loss`` → ``val_loss``."""
    return name.removeprefix("train/").replace("/", "_")
