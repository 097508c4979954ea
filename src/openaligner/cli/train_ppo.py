"""``openaligner train-ppo [CONFIG] [key=value ...]``: the PPO actor, connected to the served critic/RM.

Builds the actor, optimizer, scheduler, prompt loaders, client, logger and checkpoint manager
from the config, resumes automatically from the newest complete checkpoint whose critic the
critic server holds (sending the server back to that critic), and runs :class:`PPOTrainer`.
Under ``torchrun`` every rank runs this; rank 0 logs and saves.

Exit codes: 0 when the run finished (or reached ``max_time_per_run``, after saving); 1 when a
server failed or could not be reached (the message names host:port and model; under torchrun
every rank stops at once), the critic server holds the critic of none of the checkpoints, or the
actor's gradients were inf/NaN too many steps in a row; 130 on SIGINT and
143 on SIGTERM, which stop the run at once without saving — the next run of the same command
resumes from the last checkpoint. Resuming also rewinds ``logs/metrics.jsonl`` and
``logs/tables.jsonl`` to the checkpoint's step, so steps that are run again appear once.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import torch

from openaligner.clients.critic import RemoteCriticConfig
from openaligner.models.source import ModelSourceConfig, TokenizerSourceConfig
from openaligner.trainer.ppo_config import PPOConfig

log = logging.getLogger("openaligner.train_ppo")


@dataclass
class OptimConfig:
    lr: float = 1e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    warmup_steps: int = 0  # linear warm-up, in optimizer steps
    scheduler: str = "constant"  # constant | cosine (decays to min_lr over the run)
    min_lr: float = 0.0  # cosine floor

    def __post_init__(self) -> None:
        if self.scheduler not in ("constant", "cosine"):
            raise ValueError(f"optim.scheduler must be 'constant' or 'cosine', got {self.scheduler!r}")
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas needs two values, got {self.betas}")


@dataclass
class DataConfig:
    train_path: str = "???"  # JSONL with {"prompt": ...} per line, or a datasets directory
    val_path: str | None = None  # validation prompts; null = the first num_val_samples training prompts
    prompt_key: str = "prompt"  # field holding the prompt text
    seq_length: int = 256  # longest prompt + response; longer prompts are dropped and counted
    add_bos: bool = True  # prepend the tokenizer's BOS id to each prompt (as train-sft does by default)


@dataclass
class ExpConfig:
    output_dir: str = "runs/ppo"  # logs, checkpoints and the final actor go here
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
    trainer: PPOConfig = field(default_factory=PPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    remote: RemoteCriticConfig = field(default_factory=RemoteCriticConfig)
    exp: ExpConfig = field(default_factory=ExpConfig)

    def __post_init__(self) -> None:
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


def _train(cfg: TrainPPOConfig) -> int:
    from openaligner.clients.critic import RemoteGPTRMCriticClient
    from openaligner.clients.errors import ClientError
    from openaligner.config import config_to_yaml
    from openaligner.data.prompts import build_prompt_dataset, read_prompt_texts
    from openaligner.io.checkpoint import CheckpointManager
    from openaligner.io.metrics import MetricsLogger
    from openaligner.models.actor import GPTActorModel
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

    tokenizer = resolve_tokenizer(cfg.actor, cfg.tokenizer)
    device = pick_device(cfg.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", torch.cuda.current_device())
    model = load_causal_lm(cfg.actor, len(tokenizer), device)
    check_vocab(tokenizer, model)
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
    )

    bos = [tokenizer.bos_token_id] if cfg.data.add_bos and tokenizer.bos_token_id is not None else []

    def encode(text: str) -> list[int]:
        return bos + list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    max_prompt = cfg.data.seq_length - c.length.max_length
    train_texts = read_prompt_texts(cfg.data.train_path, cfg.data.prompt_key)
    train_set = build_prompt_dataset(train_texts, encode, max_prompt)
    val_texts = (
        read_prompt_texts(cfg.data.val_path, cfg.data.prompt_key) if cfg.data.val_path else train_set.texts
    )
    val_set = build_prompt_dataset(val_texts[: c.val_samples], encode, max_prompt)
    train_loader = PromptLoader(train_set.prompts, c.num_rollout_samples, c.seed, True, rank, world)
    val_loader = None
    if c.val_check_interval > 0:
        val_loader = PromptLoader(val_set.prompts, c.val_samples, c.seed, False, rank, world)

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
        actor.save_pretrained(out / "actor")
        log.info("final actor written to %s", out / "actor")
    dp.barrier()
    return 0
