"""The shared loop of the supervised trainers (SFT and reward-model training) and their common config.

Owns: the configs every supervised run shares (model and tokenizer source, optimizer, loop),
resolving a model/tokenizer source into objects, the optimizer and LR schedule, gradient
accumulation over micro-batches, validation, tqdm progress, metrics, resumable checkpoints
(``<output_dir>/checkpoints/step_<N>``: model, optimizer, scheduler, step, data position and
RNG, written atomically by :class:`openaligner.io.checkpoint.CheckpointManager`) and the final
Hugging Face export into ``output_dir``. What is being learned comes from an
:class:`Objective`; this module knows nothing of SFT or preference losses.

Precision (:mod:`openaligner.models.precision`): the objective's module holds the float32 master
weights; its loss is computed under the precision's autocast and backpropagated through the
precision's loss scaler. Checkpoints hold the masters (exact resume); the final export is
written in ``save_dtype``.

LoRA (:mod:`openaligner.models.lora`): a module with adapters trains only what requires
gradients; its checkpoints and export are its adapter directory, and on request the export also
holds ``merged/``, the model with its adapters merged in.
"""

from __future__ import annotations

import json
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

from openaligner.config import StartupError, as_startup_error
from openaligner.data.prompts import EpochSampler
from openaligner.data.records import DataFileError, Record, read_records, split_holdout
from openaligner.data.render import LayoutError, SequenceLayout, use_chat_template
from openaligner.io.checkpoint import CheckpointManager, rng_state, set_rng_state
from openaligner.io.metrics import MetricsLogger
from openaligner.models.lora import MERGED_DIR, LoraConfig, merged_copy
from openaligner.models.precision import Precision, check_precision, check_save_dtype, save_pretrained_as
from openaligner.models.source import (
    ModelSourceConfig,
    SourceError,
    TokenizerSourceConfig,
    position_limit_key,
    source_position_limit,
)
from openaligner.models.weights import load_weights_into
from openaligner.trainer.optim import OptimConfig, build_optimizer
from openaligner.trainer.optim_step import optimizer_step

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
Batch = dict[str, torch.Tensor]


# ---------------------------------------------------------------------- configs
@dataclass
class LoopConfig:
    max_steps: int = 100  # optimizer steps; -1 = run max_epochs
    max_epochs: int = 1000  # upper bound in passes over the training set
    global_batch_size: int = 8  # examples (SFT) or pairs (RM) per optimizer step
    micro_batch_size: int = (
        8  # examples per forward/backward (gradient accumulation); divides global_batch_size
    )
    val_check_interval: int = 50  # validate every this many steps (and at the end); 0 = only at the end
    val_micro_batch_size: int = 16  # examples per validation forward pass
    save_interval: int = 50  # checkpoint every this many steps (and at the end); 0 = only at the end
    keep_last: int = 2  # checkpoints to keep (0 = all)
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


@dataclass
class SupervisedRunConfig:
    """What train-sft and train-rm share; each adds its ``data`` section and names its output_dir."""

    RENAMED_KEYS: ClassVar[dict[str, str]] = {"optim.max_grad_norm": "trainer.gradient_clip_val"}

    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)  # the model to train
    tokenizer: TokenizerSourceConfig = field(default_factory=TokenizerSourceConfig)  # how to tokenize
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))  # AdamW and LR schedule
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters instead of full fine-tuning
    trainer: LoopConfig = field(default_factory=LoopConfig)  # steps, batch sizes, validation, checkpoints
    output_dir: str = "runs/supervised"  # final HF model + tokenizer, checkpoints/ and metrics.jsonl
    resume: bool = True  # continue from the newest complete checkpoint in output_dir
    device: str = "auto"  # auto (CUDA if available), cpu, cuda, cuda:1, ...
    precision: str = "auto"  # auto (bf16-mixed on CUDA, else fp32) | fp32 | bf16-mixed | fp16-mixed
    save_dtype: str = "auto"  # final model dtype: auto (as model.path is stored, fp32 tiny), fp32, bf16, fp16
    progress: bool = True  # tqdm progress bar
    tensorboard: bool = False  # also write TensorBoard events under output_dir/tensorboard

    def __post_init__(self) -> None:
        check_precision(self.precision, "precision")
        check_save_dtype(self.save_dtype, "save_dtype")


# ---------------------------------------------------------------------- sources
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
        output_dir: final model, ``checkpoints/`` and ``metrics.jsonl`` go here.
        resume: continue from the newest complete checkpoint in ``output_dir`` if there is one.
        precision: autocast and loss scaling of the training and validation forwards (default
            ``fp32``: neither).
        save_dtype: dtype of the final export's weights (None: as trained, float32).
        export_merged: the objective's module carries LoRA adapters, and the final export also
            writes ``output_dir/merged``, the model with the adapters merged in
            (:func:`openaligner.models.lora.merged_copy`), weights as ``save_dtype``.
        layout: the sequence layout the data was built with, recorded in every export as
            ``sequence_layout.json`` (the reward server reads it); None writes none.
    """

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
        tensorboard: bool = False,
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
        by_epochs = self.sampler.steps_per_epoch * loop.max_epochs
        self.max_steps = by_epochs if loop.max_steps < 0 else min(loop.max_steps, by_epochs)
        objective.module.to(device)
        params = [p for p in objective.module.parameters() if p.requires_grad]
        self.params = params
        self.optimizer, self.scheduler = build_optimizer(params, optim, self.max_steps)
        self.checkpoints = CheckpointManager(self.output_dir / "checkpoints", keep_last=loop.keep_last)
        self.state = TrainerState()
        self.start_step = 0  # the step fit() started from (after a resume: the checkpoint's)

    # ------------------------------------------------------------------ the recipe
    def fit(self) -> list[dict[str, float]]:
        """Train to ``max_steps``; returns the metrics of every step (validation merged in)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        resumed = self._maybe_resume()
        self.start_step = self.state.step
        logger = MetricsLogger(self.output_dir, tensorboard=self.tensorboard, append=resumed)
        history: list[dict[str, float]] = []
        bar = tqdm(total=self.max_steps, initial=self.state.step, disable=not self.progress, desc="train")
        try:
            batches = self.sampler.batches(self.state.consumed_samples)
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
                if self._due(self.loop.save_interval, last):
                    self.save_checkpoint()  # 4. resumable checkpoint
        finally:
            bar.close()
            logger.close()
        # 5. final Hugging Face model (or LoRA adapter, and the merged model) + tokenizer
        self.export(self.output_dir, dtype=self.save_dtype, merged=self.export_merged)
        return history

    def _train_step(self, indices: list[int]) -> dict[str, float]:
        start = time.perf_counter()
        self.objective.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        units = 0.0
        for batch in self._micro_batches(indices, self.loop.micro_batch_size):
            with self.precision.autocast():
                loss_sum, count, metric_sums = self.objective.loss(batch)
            self.scaler.scale(loss_sum).backward()  # gradients of sums; divided by the unit count below
            units += float(count)
            for k, v in metric_sums.items():
                sums[k] += float(v)
        # Gradients of sums become gradients of per-unit means (before unscaling: the same product).
        scale = 1.0 / max(units, 1.0)
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
        lr = float(self.scheduler.get_last_lr()[0])
        outcome = optimizer_step(
            self.params,
            self.optimizer,
            self.scheduler,
            self.scaler,
            max_grad_norm=self.loop.gradient_clip_val,
            gradients="mean",
        )
        if not outcome.stepped:
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
        """Per-unit means of the objective's metrics over the whole validation set."""
        self.objective.module.eval()
        sums: dict[str, float] = defaultdict(float)
        units = 0.0
        indices = list(range(len(self.val_items)))
        for batch in self._micro_batches(indices, self.loop.val_micro_batch_size, train=False):
            with self.precision.autocast():
                _, count, metric_sums = self.objective.loss(batch)
            units += float(count)
            for k, v in metric_sums.items():
                sums[k] += float(v)
        return {f"val/{k}": v / max(units, 1.0) for k, v in sums.items()}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_<N>`` atomically."""

        def write(d: Path) -> None:
            self.export(d / "model", atomic=False)
            torch.save(self.optimizer.state_dict(), d / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), d / "scheduler.pt")
            torch.save(rng_state(), d / "rng.pt")
            (d / "trainer_state.json").write_text(json.dumps(self.state.__dict__))

        return self.checkpoints.save(self.state.step, write)

    def _maybe_resume(self) -> bool:
        path = self.checkpoints.latest() if self.resume else None
        if path is None:
            return False
        try:
            load_weights_into(self.objective.module, path / "model")
        except ValueError as e:  # e.g. a LoRA checkpoint for a run without lora.r, or the reverse
            raise StartupError(
                f"resume=true cannot continue from {path}: {e} (or set resume=false, or another output_dir)"
            ) from None
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.device))
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt"))
        set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        self.state = TrainerState(**json.loads((path / "trainer_state.json").read_text()))
        log.info("resumed from %s at step %d", path, self.state.step)
        return True

    def export(
        self, directory: Path, atomic: bool = True, dtype: torch.dtype | None = None, merged: bool = False
    ) -> None:
        """Save the model and tokenizer as a Hugging Face directory, weights as ``dtype`` (None: the
        float32 masters, as checkpoints need); a LoRA model saves its adapter directory, and with
        ``merged`` also ``directory/merged``, the model with its adapters merged in (weights as
        ``dtype``) and the tokenizer. With ``atomic`` the files are written to a temporary
        sibling first and moved in one by one with ``os.replace``."""
        if not atomic:
            directory.mkdir(parents=True, exist_ok=True)
            self.objective.save(directory, dtype)
            self.tokenizer.save_pretrained(str(directory))
            if self.layout is not None:
                self.layout.save(directory)
            if merged:
                save_pretrained_as(merged_copy(self.objective.module), directory / MERGED_DIR, dtype)
                self.tokenizer.save_pretrained(str(directory / MERGED_DIR))
                if self.layout is not None:
                    self.layout.save(directory / MERGED_DIR)
            return
        tmp = directory / f".export-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        self.export(tmp, atomic=False, dtype=dtype, merged=merged)
        for f in tmp.iterdir():
            if f.is_dir() and (directory / f.name).is_dir():  # os.replace cannot replace a directory
                shutil.rmtree(directory / f.name)
            os.replace(f, directory / f.name)
        tmp.rmdir()

    # ------------------------------------------------------------------ helpers
    def _micro_batches(self, indices: list[int], size: int, train: bool = True) -> Iterator[Batch]:
        items = self.train_items if train else self.val_items
        for start in range(0, len(indices), size):
            batch = self.collate([items[i] for i in indices[start : start + size]])
            yield {k: v.to(self.device) for k, v in batch.items()}

    def _due(self, interval: int, last: bool) -> bool:
        return last or (interval > 0 and self.state.step % interval == 0)


def _short(name: str) -> str:
    """Progress-bar label of a metric: ``train/loss`` → ``loss``, ``val/loss`` → ``val_loss``."""
    return name.removeprefix("train/").replace("/", "_")
