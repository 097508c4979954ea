"""The PPO run as a recipe: from a :class:`TrainPPOConfig` to a trained actor.

Owns turning the typed config into the trainer's parts — start-up checks (prompt files, batch
counts, the actor's positions: refused with :class:`~openaligner.config.StartupError` before any
weights load or server is contacted), the tokenizer and actor, the optimizer and its schedule,
the prompt loaders and the checkpoint manager — and running them against a reward/critic client
(resume, log rewinding, fit). Knows nothing of signals, exit codes or the command line
(``cli/train_ppo.py``), nor of the PPO loop itself (:class:`~openaligner.trainer.ppo.PPOTrainer`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from openaligner import distributed as dp
from openaligner.clients.critic import TokenizerIdentity
from openaligner.config import StartupError, as_startup_error, config_to_yaml
from openaligner.data.formats import prompt_shape
from openaligner.data.prompts import PromptDataset, build_prompt_dataset, read_prompts
from openaligner.data.records import DataFileError
from openaligner.data.render import (
    LayoutError,
    Renderer,
    SequenceLayout,
    tokenizer_identity,
    use_chat_template,
)
from openaligner.io.checkpoint import CheckpointManager
from openaligner.io.metrics import open_run_logs
from openaligner.models.actor import CausalLMActor
from openaligner.models.lora import MERGED_DIR, is_peft_model
from openaligner.models.precision import MASTER_DTYPE, Precision, resolve_save_dtype
from openaligner.models.sharding import (
    ActorParallelConfig,
    ShardingError,
    fill_from_leader,
    is_sharded,
    meta_copy,
    shard,
)
from openaligner.models.source import (
    SourceError,
    load_causal_lm,
    pick_device,
    position_limit_key,
    resolve_tokenizer,
    source_position_limit,
)
from openaligner.rollout.config import build_rollout_engine
from openaligner.rollout.engine import EngineSetupError, RolloutEngine
from openaligner.tasks import task_scorer
from openaligner.trainer.estimators import get_estimator
from openaligner.trainer.model_build import SharedState, build_trainable_model
from openaligner.trainer.optim import build_optimizer, check_schedule
from openaligner.trainer.policy_loss import PolicyLoss, PolicyLossConfig
from openaligner.trainer.ppo import (
    ActorOptim,
    PPOTrainer,
    Prompts,
    RewardClient,
    RunOutputs,
    RunTimer,
    critic_of,
    max_time_s,
)
from openaligner.trainer.ppo_checkpoint import restore_newest_checkpoint
from openaligner.trainer.ppo_config import TrainPPOConfig
from openaligner.trainer.rollout import PromptLoader, RolloutConversations, make_prompt_collate
from openaligner.trainer.startup import describe_model, model_source_name, starting

log = logging.getLogger(__name__)


@dataclass
class PPORun:
    """A PPO run's parts, built and checked, before any server is contacted."""

    cfg: TrainPPOConfig
    actor: CausalLMActor
    loss: PolicyLoss  # the actor's policy loss, built from the trainer section's loss settings
    engine: RolloutEngine  # generates the rollouts (rollout.engine); started and closed by run_ppo
    optim: ActorOptim
    prompts: Prompts
    decode: Callable[[Sequence[int]], str]  # token ids → text (special tokens skipped)
    checkpoints: CheckpointManager
    save_dtype: torch.dtype  # the final actor's dtype on disk
    layout: SequenceLayout  # how prompts were laid out; recorded with the final actor
    tokenizer: TokenizerIdentity  # the policy's tokenizer with ``layout``, for remote.reward_input
    conversations: RolloutConversations  # rollouts as conversations, for remote.reward_input=text

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.exp.output_dir)


def run_optimizer_steps(cfg: TrainPPOConfig, steps_per_epoch: int) -> int:
    """The actor's optimizer steps in a run whose prompts fill ``steps_per_epoch`` rollout batches,
    checked against the learning-rate schedule (:func:`~openaligner.trainer.optim.check_schedule`).

    Raises:
        StartupError: value pretraining (at its cap) takes every rollout of ``max_epochs``, so the actor would
            never train; or the schedule does not fit the run.
    """
    c = cfg.trainer
    steps = c.total_steps(steps_per_epoch)
    if steps == 0:  # steps_per_epoch ≥ 1 (load_prompt_sets) and max_steps ≥ 1: only warm-up is left
        rollouts = steps_per_epoch * c.max_epochs
        key = "critic_warmup_steps" if c.critic_warmup_steps else "value_pretrain.max_steps"
        raise StartupError(
            f"trainer.{key}={c.value_pretrain_cap} takes all {rollouts} rollouts of "
            f"trainer.max_epochs={c.max_epochs} ({steps_per_epoch} per epoch of data.train_path), so the "
            f"actor would never train; set trainer.{key} < {rollouts} or raise trainer.max_epochs"
        )
    optim_steps = steps * c.ppo_epochs * (c.rollout_rows // c.global_batch_size)
    check_schedule(cfg.optim, optim_steps)
    return optim_steps


def prepare_ppo_run(cfg: TrainPPOConfig) -> PPORun:
    """Build every part of the run (call after ``dp.init_from_env()`` under torchrun).

    Raises:
        StartupError: the run cannot work (see :func:`check_seq_length`, :func:`load_prompt_sets`,
            :func:`run_optimizer_steps`,
            and the tokenizer/vocabulary checks), raised before the actor's weights load.
    """
    c = cfg.trainer
    rank, world = dp.rank(), dp.world_size()
    torch.manual_seed(c.seed)  # every rank builds the same model and adapters (distribute reseeds)
    # 1. start-up checks: positions, tokenizer, prompts (nothing heavy is loaded yet)
    check_seq_length(cfg)
    with as_startup_error(SourceError):
        tokenizer = resolve_tokenizer(cfg.actor, cfg.tokenizer, key="actor")
    layout = prompt_layout(cfg, tokenizer)

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    with as_startup_error(LayoutError):
        train_set, val_set = load_prompt_sets(cfg, Renderer(tokenizer, layout))
    train_prompts, val_prompts = train_set.prompts, val_set.prompts
    optim_steps = run_optimizer_steps(cfg, len(train_prompts) // c.num_rollout_samples)
    conversations = RolloutConversations(
        train_prompts + val_prompts,
        train_set.sources + val_set.sources,
        decode,
        train_set.metadata + val_set.metadata,
    )
    # 2. the actor (float32 masters, computing in the precision's dtype) and its policy loss
    device = pick_device(cfg.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", torch.cuda.current_device())
    precision = Precision.resolve(cfg.precision, device)
    log.info("precision: %s on %s", precision.name, device)
    init_policy: PreTrainedModel | bool | None = False  # False: no KL penalty, no initial policy

    def copy_init_policy(model: PreTrainedModel, state: SharedState) -> None:
        # with LoRA the initial policy is this same model with its adapters disabled: no second copy
        nonlocal init_policy
        with starting("building the initial policy (the frozen anchor of the KL penalty)"):
            if c.initial_policy_kl_penalty > 0:
                init_policy = build_init_policy(model, cfg.parallel, state)

    model = build_trainable_model(
        partial(load_causal_lm, cfg.actor, len(tokenizer), dtype=MASTER_DTYPE),
        cfg.parallel,
        device,
        name="actor",
        tokenizer=tokenizer,
        vocab_key="actor",
        loading=f"the actor ({model_source_name(cfg.actor, 'actor')})",
        lora=cfg.lora,
        rank_seed=c.seed,
        before_sharding=copy_init_policy,
    )
    if rank == 0:
        log.info("%s", describe_model(model, device, precision).replace("model:", "actor:", 1))
    actor = CausalLMActor(
        model,
        tokenizer,
        forward_micro_batch_size=c.forward_micro_batch_size or c.rollout_micro_batch_size,
        init_policy=init_policy,
        precision=precision,
        gather_for_generation=cfg.parallel.generation == "gathered",
        logits_chunk_mb=c.logits_chunk_mb,
    )
    loss = PolicyLoss(PolicyLossConfig.from_ppo(c))
    with as_startup_error(EngineSetupError):
        engine = build_rollout_engine(cfg.rollout, actor)
    # 3. prompts: this rank's share of every global batch
    train_loader = PromptLoader(train_prompts, c.num_rollout_samples, c.seed, True, rank, world)
    val_loader = None
    if c.val_check_interval > 0:
        val_loader = PromptLoader(val_prompts, c.val_samples, c.seed, False, rank, world)
    prompts = Prompts(train=train_loader, val=val_loader, collate=make_prompt_collate(actor.pad_id))
    # 4. optimizer and schedule over the run's optimizer steps (counted and checked in 1.)
    optimizer, scheduler = build_optimizer(actor.parameters(), cfg.optim, optim_steps)
    optim = ActorOptim(optimizer, scheduler, precision.grad_scaler())
    # 5. checkpoints
    out = Path(cfg.exp.output_dir)
    keep_last = cfg.exp.keep_last
    checkpoints = CheckpointManager(out / "checkpoints", keep_last=keep_last, best_metric="val_rewards")
    save_dtype = resolve_save_dtype(cfg.exp.save_dtype, cfg.actor.path)
    identity = TokenizerIdentity(*tokenizer_identity(tokenizer, layout))
    return PPORun(
        cfg,
        actor,
        loss,
        engine,
        optim,
        prompts,
        decode,
        checkpoints,
        save_dtype,
        layout,
        identity,
        conversations,
    )


def build_init_policy(
    model: PreTrainedModel,
    parallel: ActorParallelConfig,
    state: Mapping[str, torch.Tensor] | None = None,
) -> PreTrainedModel | None:
    """The frozen initial policy: a float32 copy of ``model`` (call before ``model`` is sharded),
    sharded alike (its shards on the CPU with ``parallel.offload_init_policy``; ``state``: rank 0's
    weights for the other ranks' skeletons, see :func:`~openaligner.models.sharding.fill_from_leader`);
    None for a LoRA policy, whose initial policy is itself with the adapters disabled (the actor's
    default)."""
    if is_peft_model(model):
        return None
    # rank 0 sharing its weights: a copy without weights, filled from ``state`` as the other ranks'
    # skeletons are (a whole second float32 copy there would be rank 0's peak at start-up)
    frozen = meta_copy(model) if state is not None else copy.deepcopy(model)
    frozen.requires_grad_(False)
    frozen.eval()
    with as_startup_error(ShardingError):
        shard(frozen, parallel, offload=parallel.offload_init_policy, name="initial policy")
    fill_from_leader(frozen, state, parallel, offload=parallel.offload_init_policy)
    return frozen


def run_ppo(
    run: PPORun, rm_critic: RewardClient, on_trainer: Callable[[PPOTrainer], None] | None = None
) -> None:
    """Resume (the newest step whose critic the server holds), train, and write the final actor.

    ``on_trainer`` sees the trainer once it exists (e.g. to report its step if the run fails).
    """
    cfg, out, rank = run.cfg, run.output_dir, dp.rank()
    # 1. the newest step both halves have: the actor's checkpoint and the server's critic
    critic = critic_of(rm_critic, get_estimator(cfg.trainer.advantage_estimator))
    latest = restore_newest_checkpoint(run.checkpoints, critic) if cfg.exp.resume else None
    # 2. the trainer, restored from that checkpoint; its logs rolled back to the checkpoint's step
    resumed_step = int(latest.name.removeprefix("step_")) if latest is not None else None
    logger = open_run_logs(
        out / "logs",
        resumed_step,
        tensorboard=cfg.exp.tensorboard,
        wandb_project=cfg.exp.wandb_project,
        enabled=rank == 0,
        final_step=cfg.trainer.total_steps(int(run.prompts.train.steps_per_epoch)),
    )
    try:
        run.engine.start()  # before the checkpoint: a restored actor's weights go to the engine
        outputs = RunOutputs(
            logger=logger,
            checkpoints=run.checkpoints,
            config_yaml=config_to_yaml(cfg),
            progress=cfg.exp.progress,
            decode=run.decode,
            response_scorer=task_scorer(cfg.exp.task_scorer) if cfg.exp.task_scorer else None,
        )
        trainer = PPOTrainer(
            cfg.trainer,
            run.actor,
            run.optim,
            run.prompts,
            rm_critic,
            outputs,
            loss=run.loss,
            engine=run.engine,
            run_timer=RunTimer(max_time_s(cfg.trainer)),
            server_overlap_threads=cfg.exp.server_overlap_threads,
        )
        if on_trainer is not None:
            on_trainer(trainer)
        if latest is not None:
            try:
                trainer.load_checkpoint(latest)
            except ValueError as e:  # e.g. a LoRA checkpoint for a run without lora.r, or the reverse
                raise StartupError(
                    f"exp.resume=true cannot continue from {latest}: {e} (or set exp.resume=false, or "
                    "another exp.output_dir)"
                ) from None
        # 3. train
        trainer.fit()
    finally:
        run.engine.close()
        logger.close()
    # 4. the final actor, in the documented dtype (with LoRA: its adapter, and the merged actor if
    #    asked); a sharded actor is gathered to rank 0 by every rank, and rank 0 writes
    if rank == 0 or is_sharded(run.actor.model):
        run.actor.save_pretrained(out / "actor", dtype=run.save_dtype)
        if cfg.lora.merge_on_save:
            run.actor.save_merged(out / "actor" / MERGED_DIR, dtype=run.save_dtype)
    if rank == 0:
        if cfg.lora.merge_on_save:
            run.layout.save(out / "actor" / MERGED_DIR)
        run.layout.save(out / "actor")
        log.info("final actor written to %s (%s)", out / "actor", str(run.save_dtype).removeprefix("torch."))
    dp.barrier()


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


def prompt_layout(cfg: TrainPPOConfig, tokenizer: PreTrainedTokenizerBase) -> SequenceLayout:
    """The layout of the run's prompts (``data.add_bos``, ``data.chat_template``); responses end
    with the EOS the actor stops on (``add_eos``: the tokenizer has one), as train-rm's ``add_eos``
    ends them. Warns when ``actor.path``
    records (``sequence_layout.json``, from train-sft) another BOS or chat-template choice.

    Raises:
        StartupError: ``data.chat_template=true`` and the tokenizer has no template, or the
            actor's layout record cannot be read.
    """
    with as_startup_error(LayoutError):
        use_template = use_chat_template(cfg.data.chat_template, tokenizer)
        layout = SequenceLayout(cfg.data.add_bos, tokenizer.eos_token_id is not None, use_template)
        trained = SequenceLayout.load(cfg.actor.path) if cfg.actor.path is not None else None
    if trained is not None and (trained.add_bos, trained.chat_template) != (
        layout.add_bos,
        layout.chat_template,
    ):
        log.warning(
            "the actor in %s was trained with add_bos=%s, chat_template=%s, but this run lays prompts out "
            "with data.add_bos=%s, chat template %s: the policy sees prompts unlike its training data",
            cfg.actor.path,
            trained.add_bos,
            trained.chat_template,
            layout.add_bos,
            "on" if layout.chat_template else "off",
        )
    return layout


def load_prompt_sets(cfg: TrainPPOConfig, renderer: Renderer) -> tuple[PromptDataset, PromptDataset]:
    """The training prompts and the validation prompts (``trainer.num_val_samples`` of them), as
    token ids laid out by ``renderer`` with the prompts as read; prompts longer than
    ``data.seq_length − trainer.length.max_length`` are dropped.

    Raises:
        StartupError: a prompt file is missing, unreadable, empty or has a bad record; or too few
            prompts remain for one rollout batch (or, with validation on, one validation batch).
        LayoutError: a prompt cannot be rendered (a conversation without a chat template, ...).
    """
    c, d = cfg.trainer, cfg.data
    max_prompt = d.seq_length - c.length.max_length

    def read(key: str, path: str, split_key: str, split: str) -> PromptDataset:
        try:
            records = read_prompts(path, d.prompt_key, d.messages_key, split, d.metadata_keys)
        except DataFileError as e:
            raise StartupError(
                f"{key}={e}; {key} must name a JSONL file with one record per line, or a datasets "
                f"directory (save_to_disk; {split_key} picks the split of a DatasetDict), with records "
                f"{prompt_shape(d.prompt_key, d.messages_key)} (data.prompt_key, data.messages_key)"
            ) from None
        return build_prompt_dataset(records, renderer, max_prompt)

    train = read("data.train_path", d.train_path, "data.split", d.split)
    _require_prompts(train, "data.train_path", "trainer.num_rollout_samples", c.num_rollout_samples, cfg)
    val = read("data.val_path", d.val_path, "data.val_split", d.val_split) if d.val_path else train
    if c.val_check_interval > 0:
        _require_prompts(
            val,
            "data.val_path" if d.val_path else "data.train_path",
            "trainer.num_val_samples",
            c.val_samples,
            cfg,
            " (null: trainer.num_rollout_samples)" if c.num_val_samples is None else "",
        )
    n = c.val_samples
    return train, replace(val, prompts=val.prompts[:n], sources=val.sources[:n], metadata=val.metadata[:n])


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
