"""``openaligner train-ppo [CONFIG] [key=value ...]``: the PPO actor, connected to the served critic/RM.

Builds the actor, optimizer, scheduler, prompt loaders, client, logger and checkpoint manager
from the config, resumes automatically from the newest complete checkpoint whose critic the
critic server holds (sending the server back to that critic), and runs :class:`PPOTrainer`.
Under ``torchrun`` every rank runs this; rank 0 logs and saves.

Exit codes: 0 when the run finished (or reached ``max_time_per_run``, after saving); 1 when a
server failed or could not be reached (the message names host:port and model; under torchrun
every rank stops at once), the critic server holds the critic of none of the checkpoints, or the
actor's gradients were inf/NaN too many steps in a row; 2 when the run is refused at start-up,
before any weights load or a server is contacted (prompt files, too few prompts for one batch,
``data.seq_length`` beyond the actor's positions); 130 on SIGINT and
143 on SIGTERM, which stop the run at once without saving — the next run of the same command
resumes from the last checkpoint. Resuming also rewinds ``logs/metrics.jsonl`` and
``logs/tables.jsonl`` to the checkpoint's step, so steps that are run again appear once.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import torch

from openaligner.clients.critic import RemoteCriticConfig
from openaligner.config import StartupError, as_startup_error
from openaligner.data.jsonl import DataFileError
from openaligner.data.prompts import PromptDataset, build_prompt_dataset, read_prompt_texts
from openaligner.models.precision import check_precision, check_save_dtype
from openaligner.models.source import (
    ModelSourceConfig,
    SourceError,
    TokenizerSourceConfig,
    position_limit_key,
    source_position_limit,
)
from openaligner.trainer.ppo_config import PPOConfig

log = logging.getLogger("openaligner.train_ppo")


@dataclass
class OptimConfig:
    lr: float = 1e-5  # AdamW learning rate (> 0)
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    warmup_steps: int = 0  # linear warm-up, in optimizer steps
    scheduler: str = "constant"  # constant | cosine (decays to min_lr over the run)
    min_lr: float = 0.0  # cosine floor

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0 (e.g. 1e-5), got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= optim.min_lr <= optim.lr={self.lr}, got min_lr={self.min_lr}")
        if self.scheduler not in ("constant", "cosine"):
            raise ValueError(f"optim.scheduler must be 'constant' or 'cosine', got {self.scheduler!r}")
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas needs two values, got {self.betas}")


@dataclass
class DataConfig:
    train_path: str = "???"  # JSONL with {"prompt": ...} per line, or a datasets directory
    val_path: str | None = None  # validation prompts; null = the first num_val_samples training prompts
    prompt_key: str = "prompt"  # field holding the prompt text
    seq_length: int = 256  # longest prompt + response (≤ the actor's positions); longer prompts are dropped
    add_bos: bool = True  # prepend the tokenizer's BOS id to each prompt (as train-sft does by default)


@dataclass
class ExpConfig:
    output_dir: str = "runs/ppo"  # logs, checkpoints and the final actor go here
    save_dtype: str = "auto"  # final actor dtype: auto (as actor.path is stored, fp32 tiny), fp32, bf16, fp16
    keep_last: int = 2  # checkpoints kept besides the best one (0 keeps all)
    resume: bool = True  # continue from the newest checkpoint whose critic the critic server holds
    tensorboard: bool = True  # also write TensorBoard events
    wandb_project: str | None = None  # log to this W&B project when wandb is installed
    progress: bool = True  # progress bar on rank 0
    task_scorer: str | None = None  # a built-in task's gold scorer logged as rollout/score (e.g. sorting)
    # torch threads while the servers compute on the same cores (log-prob passes, update); null: unchanged
    server_overlap_threads: int | None = None


@dataclass
class TrainPPOConfig:
    actor: ModelSourceConfig = field(default_factory=ModelSourceConfig)  # the SFT policy to train
    tokenizer: TokenizerSourceConfig = field(default_factory=TokenizerSourceConfig)  # the actor's tokenizer
    device: str = "auto"  # auto (CUDA if available), cpu, cuda, cuda:1, ... (torchrun: cuda:LOCAL_RANK)
    precision: str = "auto"  # auto (bf16-mixed on CUDA, else fp32) | fp32 | bf16-mixed | fp16-mixed
    trainer: PPOConfig = field(default_factory=PPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    remote: RemoteCriticConfig = field(default_factory=RemoteCriticConfig)
    exp: ExpConfig = field(default_factory=ExpConfig)

    def __post_init__(self) -> None:
        check_precision(self.precision, "precision")
        check_save_dtype(self.exp.save_dtype, "exp.save_dtype")
        if self.exp.server_overlap_threads is not None and self.exp.server_overlap_threads < 1:
            raise ValueError(
                f"exp.server_overlap_threads must be >= 1 or null, got {self.exp.server_overlap_threads}"
            )
        if self.exp.task_scorer is not None:
            from openaligner.tasks import TASK_SCORERS

            if self.exp.task_scorer not in TASK_SCORERS:
                raise ValueError(f"exp.task_scorer must be one of {sorted(TASK_SCORERS)} or null")
        if self.trainer.length.max_length >= self.data.seq_length:
            raise ValueError(
                f"trainer.length.max_length={self.trainer.length.max_length} leaves no room for prompts in "
                f"data.seq_length={self.data.seq_length}; raise seq_length or lower max_length"
            )


SCHEMA = TrainPPOConfig


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant or cosine to ``min_lr``, stepped once per optimizer step."""
    from openaligner.algorithms.schedules import lr_factor

    min_ratio = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0

    def factor(step: int) -> float:
        return lr_factor(
            step,
            warmup_steps=cfg.warmup_steps,
            total_steps=total_steps,
            schedule=cfg.scheduler,
            min_ratio=min_ratio,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt (exit code 143)."""


def _raise_terminated(_signum: int, _frame: FrameType | None) -> None:
    raise Terminated


def run(cfg: TrainPPOConfig) -> int:
    """Train; see the module docstring for the exit codes."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _train(cfg)
    except KeyboardInterrupt as e:
        name, code = ("SIGTERM", 143) if isinstance(e, Terminated) else ("SIGINT", 130)
        print(
            f"openaligner train-ppo: stopped by {name}; {_resume_note(Path(cfg.exp.output_dir))}",
            file=sys.stderr,
            flush=True,
        )
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)


def _resume_note(out: Path) -> str:
    from openaligner.io.checkpoint import CheckpointManager

    latest = CheckpointManager(out / "checkpoints").latest()
    if latest is None:
        return "no checkpoint was written yet, so the same command starts over"
    return (
        f"the same command resumes from {latest} and sends the critic server back to the critic saved "
        f"with it (restart serve-critic with the same checkpoint.dir if it is not running)"
    )


def rewind_logs(log_dir: Path, step: int) -> int:
    """Keep only the records of steps ``<= step`` in ``metrics.jsonl`` and ``tables.jsonl``.

    A run resumed from the checkpoint of ``step`` runs the later steps again; their old records,
    and a last line cut short by a crash, are dropped. Returns how many lines were dropped.
    """
    from openaligner.io.checkpoint import write_text_atomic

    dropped = 0
    for name in ("metrics.jsonl", "tables.jsonl"):
        path = log_dir / name
        if not path.is_file():
            continue
        lines = path.read_text().splitlines()
        kept = [line + "\n" for line in lines if _step_of(line) <= step]
        if len(kept) < len(lines):
            dropped += len(lines) - len(kept)
            write_text_atomic(path, "".join(kept))
    return dropped


def _step_of(line: str) -> float:
    """The step of one JSONL record; infinity for a line that is not one (e.g. cut short)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


def check_seq_length(cfg: TrainPPOConfig) -> None:
    """Refuse ``data.seq_length`` beyond the actor's positions, read from its ``config.json`` (or
    ``actor.tiny_max_positions``) before any weights load.

    Raises:
        StartupError: naming data.seq_length, the limit and the key it comes from.
    """
    with as_startup_error(SourceError):
        limit = source_position_limit(cfg.actor, key="actor")
    if limit is not None and cfg.data.seq_length > limit:
        raise StartupError(
            f"data.seq_length={cfg.data.seq_length} is beyond the actor's {limit} positions "
            f"({position_limit_key(cfg.actor, 'actor')}); lower data.seq_length to at most {limit} (prompts "
            f"get data.seq_length − trainer.length.max_length={cfg.trainer.length.max_length} tokens)"
        )


def load_prompt_sets(
    cfg: TrainPPOConfig, encode: Callable[[str], list[int]]
) -> tuple[list[list[int]], list[list[int]]]:
    """The training prompts and the validation prompts (``trainer.num_val_samples`` of them), as
    token ids; prompts longer than ``data.seq_length − trainer.length.max_length`` are dropped.

    Raises:
        StartupError: a prompt file is missing, unreadable, empty or has a bad line; or too few
            prompts remain for one rollout batch (or, with validation on, one validation batch).
    """
    c, d = cfg.trainer, cfg.data
    max_prompt = d.seq_length - c.length.max_length

    def read(key: str, path: str) -> PromptDataset:
        try:
            texts = read_prompt_texts(path, d.prompt_key)
        except DataFileError as e:
            raise StartupError(
                f'{key}={e}; {key} must name a JSONL file with one {{"{d.prompt_key}": ...}} per line '
                "(data.prompt_key) or a datasets directory"
            ) from None
        return build_prompt_dataset(texts, encode, max_prompt)

    train = read("data.train_path", d.train_path)
    _require_prompts(train, "data.train_path", "trainer.num_rollout_samples", c.num_rollout_samples, cfg)
    val = read("data.val_path", d.val_path) if d.val_path else train
    if c.val_check_interval > 0:
        _require_prompts(
            val,
            "data.val_path" if d.val_path else "data.train_path",
            "trainer.num_val_samples",
            c.val_samples,
            cfg,
            " (null: trainer.num_rollout_samples)" if c.num_val_samples is None else "",
        )
    return train.prompts, val.prompts[: c.val_samples]


def _require_prompts(
    prompts: PromptDataset, key: str, need_key: str, need: int, cfg: TrainPPOConfig, need_note: str = ""
) -> None:
    """Refuse ``prompts`` (read from ``key``) when fewer than one batch of ``need`` remain."""
    if len(prompts) >= need:
        return
    length = cfg.trainer.length.max_length
    limit = f"{cfg.data.seq_length - length} tokens = data.seq_length − trainer.length.max_length ({length})"
    if len(prompts) == 0 and prompts.dropped_too_long:
        empty = f" ({prompts.dropped_empty} more were empty)" if prompts.dropped_empty else ""
        raise StartupError(
            f"all {prompts.dropped_too_long} prompts in {key} are longer than {limit}, so every one was "
            f"dropped{empty}; raise data.seq_length or lower trainer.length.max_length"
        )
    reasons = [f"{prompts.dropped_too_long} longer than {limit}"] if prompts.dropped_too_long else []
    reasons += [f"{prompts.dropped_empty} empty"] if prompts.dropped_empty else []
    dropped = prompts.dropped_too_long + prompts.dropped_empty
    note = f" ({dropped} were dropped: {', '.join(reasons)})" if dropped else ""
    raise StartupError(
        f"{key} has {len(prompts)} prompts{note}, fewer than one batch of {need_key}={need}{need_note}; "
        f"add prompts or lower {need_key}"
    )


def _train(cfg: TrainPPOConfig) -> int:
    from openaligner.clients.critic import RemoteGPTRMCriticClient
    from openaligner.clients.errors import ClientError
    from openaligner.config import config_to_yaml
    from openaligner.io.checkpoint import CheckpointManager
    from openaligner.io.metrics import MetricsLogger
    from openaligner.models.actor import GPTActorModel
    from openaligner.models.precision import MASTER_DTYPE, Precision, resolve_save_dtype
    from openaligner.models.source import check_vocab, load_causal_lm, pick_device, resolve_tokenizer
    from openaligner.tasks import task_scorer
    from openaligner.trainer import distributed as dp
    from openaligner.trainer.ppo import (
        NonFiniteTrainingError,
        PeerFailedError,
        PPOTrainer,
        ResumeError,
        RunTimer,
        max_time_s,
        restore_newest_checkpoint,
    )
    from openaligner.trainer.rollout import MicroBatchIterator, PromptLoader, make_prompt_collate

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dp.init_from_env()
    rank, world = dp.rank(), dp.world_size()
    c = cfg.trainer
    torch.manual_seed(c.seed + rank)
    out = Path(cfg.exp.output_dir)

    # Start-up checks (StartupError: exit 2) come before any weights load or server is contacted.
    check_seq_length(cfg)
    with as_startup_error(SourceError):
        tokenizer = resolve_tokenizer(cfg.actor, cfg.tokenizer, key="actor")
    bos = [tokenizer.bos_token_id] if cfg.data.add_bos and tokenizer.bos_token_id is not None else []

    def encode(text: str) -> list[int]:
        return bos + list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    train_prompts, val_prompts = load_prompt_sets(cfg, encode)

    device = pick_device(cfg.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", torch.cuda.current_device())
    precision = Precision.resolve(cfg.precision, device)
    save_dtype = resolve_save_dtype(cfg.exp.save_dtype, cfg.actor.path)
    log.info("precision: %s on %s", precision.name, device)
    model = load_causal_lm(cfg.actor, len(tokenizer), device, dtype=MASTER_DTYPE)
    with as_startup_error(SourceError):
        check_vocab(tokenizer, model, key="actor")
    actor = GPTActorModel(
        model,
        tokenizer,
        forward_micro_batch_size=c.forward_micro_batch_size or c.rollout_micro_batch_size,
        clip_eps=c.ratio_eps,
        clip_eps_high=c.ratio_eps_high,
        dual_clip=c.dual_clip,
        entropy_coef=c.entropy_bonus,
        loss_aggregation=c.loss_aggregation,
        init_policy=None if c.initial_policy_kl_penalty > 0 else False,
        precision=precision,
    )

    train_loader = PromptLoader(train_prompts, c.num_rollout_samples, c.seed, True, rank, world)
    val_loader = None
    if c.val_check_interval > 0:
        val_loader = PromptLoader(val_prompts, c.val_samples, c.seed, False, rank, world)

    beta1, beta2 = cfg.optim.betas
    optimizer = torch.optim.AdamW(
        actor.parameters(),
        lr=cfg.optim.lr,
        betas=(beta1, beta2),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
        # One fused kernel per step instead of several small ops per tensor: 3–10 % of the actor
        # update on CPU (docs/benchmarks.md).
        fused=True,
    )
    steps = c.total_steps(train_loader.steps_per_epoch)
    total_optim_steps = steps * c.ppo_epochs * (c.num_rollout_samples // c.global_batch_size)
    scheduler = build_scheduler(optimizer, cfg.optim, total_optim_steps)
    ckpt = CheckpointManager(out / "checkpoints", keep_last=cfg.exp.keep_last, best_metric="val_rewards")

    if cfg.remote.pad_to_length is None:
        # Requests of one fixed width merge in Triton's dynamic batcher (NeMo-Aligner's default).
        cfg.remote.pad_to_length = cfg.data.seq_length
    trainer: PPOTrainer | None = None
    logger: MetricsLogger | None = None
    try:
        with RemoteGPTRMCriticClient(cfg.remote) as client:
            # the newest step both halves have: the actor's checkpoint and the server's critic
            latest = restore_newest_checkpoint(ckpt, client) if cfg.exp.resume else None
            if cfg.exp.resume and rank == 0:  # before the logger opens the logs
                resumed_step = int(latest.name.removeprefix("step_")) if latest is not None else 0
                if dropped := rewind_logs(out / "logs", resumed_step):
                    log.info(
                        "dropped %d log record(s) after step %d: those steps run again", dropped, resumed_step
                    )
            logger = MetricsLogger(
                out / "logs", cfg.exp.tensorboard, cfg.exp.wandb_project, enabled=rank == 0
            )
            trainer = PPOTrainer(
                cfg=c,
                model=actor,
                optimizer=optimizer,
                scheduler=scheduler,
                train_dataloader_builder=train_loader,
                val_dataloader_builder=val_loader,
                collate_fn=make_prompt_collate(actor.pad_id),
                rm_critic=client,
                batch_iterator_cls=MicroBatchIterator,
                logger=logger,
                ckpt_callback=ckpt,
                run_timer=RunTimer(max_time_s(c)),
                decode=decode,
                config_yaml=config_to_yaml(cfg),
                progress=cfg.exp.progress,
                response_scorer=task_scorer(cfg.exp.task_scorer) if cfg.exp.task_scorer else None,
                server_overlap_threads=cfg.exp.server_overlap_threads,
                grad_scaler=precision.grad_scaler(),
            )
            if latest is not None:
                trainer.load_checkpoint(latest)
            trainer.fit()
    except (ClientError, PeerFailedError, NonFiniteTrainingError, ResumeError) as e:
        stopped = (
            f" The run stopped at step {trainer.step}; {_resume_note(out)}." if trainer is not None else ""
        )
        print(f"openaligner train-ppo: {e}{stopped}", file=sys.stderr, flush=True)
        return 1
    finally:
        if logger is not None:
            logger.close()
    if rank == 0:
        actor.save_pretrained(out / "actor", dtype=save_dtype)
        log.info("final actor written to %s (%s)", out / "actor", str(save_dtype).removeprefix("torch."))
    dp.barrier()
    return 0
