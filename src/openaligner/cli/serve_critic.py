"""``openaligner serve-critic [CONFIG] [key=value ...]``: serve a trainable critic (and the reward model).

Owns the command: load the critic (and, combined, a frozen reward model), build its
:class:`~openaligner.trainer.critic.CriticTrainer`, resume, and run
:class:`~openaligner.servers.critic.CriticServerTrainer` on every rank until SIGINT or SIGTERM.
Must not know the value loss, the endpoints' logic or the transport.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, closing
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import ClassVar

import torch
from transformers import PreTrainedTokenizerBase

from openaligner.cli import serving
from openaligner.cli.serving import RuntimeConfig
from openaligner.config import StartupError, as_startup_error
from openaligner.models.critic import CriticModel
from openaligner.models.lora import LoraConfig
from openaligner.models.precision import Precision
from openaligner.models.reward import RewardModel
from openaligner.models.sharding import ParallelConfig
from openaligner.models.source import ModelSourceConfig, SourceError, TokenizerSourceConfig, check_model_dir
from openaligner.servers.critic import CriticServerConfig
from openaligner.trainer.critic import CriticTrainConfig
from openaligner.trainer.model_build import build_trainable_model
from openaligner.trainer.optim import OptimConfig


@dataclass
class RewardModelSource:
    path: str | None = None  # HF directory of the reward model served in combined mode; null: model.path

    def __post_init__(self) -> None:
        if self.path is not None:
            check_model_dir(self.path, "reward_model.path")


@dataclass
class CheckpointSettings:
    dir: str | None = None  # critic_save writes step_<N> here, start-up resumes; null: saving refused
    keep_last: int = 2  # checkpoints kept (0 keeps all); train-ppo resumes only from critics still kept
    resume: bool = True  # start from the latest complete checkpoint in dir
    resume_step: int | None = (
        None  # with resume: start from step_<N> instead of the latest (refused if incomplete)
    )

    def __post_init__(self) -> None:
        if self.resume_step is not None and (self.dir is None or not self.resume):
            raise ValueError("checkpoint.resume_step needs checkpoint.dir and checkpoint.resume=true")


CRITIC_VOCAB_FIX = (
    "the critic reads the policy's token ids, so start it from the policy's model: serve-critic "
    "model.path=<the policy's SFT directory> server.combine_rm_and_critic_server=false (a fresh value "
    "head on the policy's backbone, with its tokenizer), and serve a reward model with its own "
    "tokenizer apart (serve-reward model.path=<reward model>) so that it reads text"
)
"""What to do when the tokenizer has ids the critic cannot embed (e.g. ``tokenizer.path`` names
the policy's tokenizer and ``model.path`` a reward model with its own, smaller one)."""

COMBINED_RM_VOCAB_FIX = (
    "a reward model with its own tokenizer cannot score the policy's ids: serve it apart (serve-reward "
    "model.path=<reward model>; here server.combine_rm_and_critic_server=false) so that it reads text"
)
"""What to do when the tokenizer has ids the combined mode's reward model cannot embed."""


def _train_defaults() -> CriticTrainConfig:
    return CriticTrainConfig(global_batch_size=64, micro_batch_size=8)


@dataclass
class ServeCriticConfig:
    RENAMED_KEYS: ClassVar[dict[str, str]] = serving.RENAMED_KEYS | {"optim.max_steps": "optim.decay_steps"}

    model: ModelSourceConfig = field(default_factory=serving.no_model)  # the critic's initial weights
    tokenizer: TokenizerSourceConfig = field(default_factory=TokenizerSourceConfig)  # for `sentences`
    reward_model: RewardModelSource = field(default_factory=RewardModelSource)  # the RM served when combined
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # device, precision, reward scale
    server: CriticServerConfig = field(default_factory=CriticServerConfig)  # how to serve
    train: CriticTrainConfig = field(default_factory=_train_defaults)  # how critic_train trains
    optim: OptimConfig = field(  # optimizer and LR schedule; decay_steps is the schedule's length
        default_factory=lambda: OptimConfig(
            lr=9e-6,
            min_lr=9e-7,
            weight_decay=0.1,
            betas=[0.9, 0.98],
            scheduler="cosine",
            warmup_steps=10,
            decay_steps=10000,
        )
    )
    lora: LoraConfig = field(
        default_factory=LoraConfig
    )  # LoRA critic: adapters on the backbone, head in full
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # replicas (ddp) or shards (fsdp)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)  # where to save and resume
    log_dir: str | None = None  # train/* metrics (JSONL) go here; null: <checkpoint.dir>/logs, or none
    tensorboard: bool = False  # also write TensorBoard events under log_dir
    threads: int | None = None  # torch CPU threads per rank; null: on CPU, cores - 1 (Triton needs one)
    log_level: str = "INFO"  # Python logging level of this process

    def __post_init__(self) -> None:
        serving.check_model_choice(self.model)
        self.parallel.check_precision(self.runtime.precision, "runtime.precision")
        if self.model.tiny is not None and self.reward_model.path is not None:
            raise ValueError("model.tiny serves the tiny reward model too; unset reward_model.path")
        if self.optim.decay_steps is None and self.optim.scheduler != "constant":
            raise ValueError(
                f"optim.scheduler={self.optim.scheduler} needs optim.decay_steps: the critic server "
                "cannot know how many steps training will take"
            )
        if self.lora.enabled and self.lora.dropout > 0:
            raise ValueError(
                f"lora.dropout={self.lora.dropout:g} would never apply: the critic trains in eval mode "
                "(the values it regresses are those critic_infer serves); set lora.dropout=0"
            )
        if self.lora.merge_on_save:
            raise ValueError(
                "lora.merge_on_save does not apply to the critic server: it has no final export "
                "(critic_save writes adapter checkpoints)"
            )


SCHEMA = ServeCriticConfig


def run(cfg: ServeCriticConfig) -> int:
    from openaligner import distributed as dp
    from openaligner.io.checkpoint import CheckpointManager
    from openaligner.io.metrics import MetricsLogger
    from openaligner.models.positions import position_limit
    from openaligner.servers.critic import CriticServerTrainer
    from openaligner.trainer.critic import CriticTrainer
    from openaligner.trainer.optim import build_optimizer

    log = serving.setup_logging(cfg.log_level, "openaligner.serve_critic")
    with serving.process_group(), ExitStack() as cleanup:
        serving.check_batching(cfg.server, dp.world_size())
        device, precision = serving.prepare_runtime(cfg.runtime, cfg.threads, log)
        critic, reward_model, tokenizer = load_models(cfg, device, precision, log)
        limits = [position_limit(m.hf_model.config) for m in (critic, reward_model) if m is not None]
        max_len = serving.sequence_limit(cfg.server.max_sequence_length, limits)
        # sentences are laid out as the reward model was trained (the critic starts from it)
        tokenize = serving.sentences_tokenizer(tokenizer, cfg.reward_model.path or cfg.model.path, max_len)
        # The server does not know how long training runs: the schedule's length is optim.decay_steps.
        optimizer, scheduler = build_optimizer(critic.parameters(), cfg.optim, run_steps=None)
        ck = cfg.checkpoint
        checkpoints = CheckpointManager(ck.dir, keep_last=ck.keep_last) if ck.dir else None
        log_dir = cfg.log_dir or (str(Path(ck.dir) / "logs") if ck.dir else None)
        logger = None
        if log_dir is not None:
            logger = MetricsLogger(log_dir, tensorboard=cfg.tensorboard, enabled=dp.is_leader())
            cleanup.enter_context(closing(logger))  # closed before the process group is left
        trainer = CriticTrainer(
            cfg.train,
            critic,
            optimizer,
            scheduler,
            precision=precision,
            logger=logger,
            checkpoints=checkpoints,
            batch_invariant_multiple=cfg.server.fixed_width_multiple(),
        )
        server = CriticServerTrainer(
            cfg.server,
            trainer,
            tokenize,
            reward_model=reward_model,
            tokenizer_info=serving.served_tokenizer(tokenizer, cfg.reward_model.path or cfg.model.path)[1],
            resume=ck.resume,
            resume_step=ck.resume_step,
        )
        serving.install_signal_handlers(server, log)
        if dp.is_leader() and server.start():  # False: stopped while starting
            mode = "values and rewards" if server.combined else "values only"
            guarded = ", train/save need the token" if server.token is not None else ""
            print(
                f"critic server ready at {server.url} (critic_infer: {mode}; critic_train, "
                f"critic_save; {dp.world_size()} rank(s){', sharded' if cfg.parallel.sharded else ''}; "
                f"step {server.step}{guarded}); "
                "stop with Ctrl-C or SIGTERM",
                flush=True,
            )
        server.run_server()
        if dp.is_leader():
            print(f"critic server stopped at step {server.step}", flush=True)
    return 0


def warn_of_a_borrowed_tokenizer(
    model: ModelSourceConfig,
    source: TokenizerSourceConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    log: logging.Logger,
) -> None:
    """Warn when ``tokenizer.path`` lends the critic a vocabulary other than the one saved with
    ``model.path``: the critic would read those ids through embeddings learnt for other tokens.
    (Ids past the embedding table are refused outright, see
    :func:`~openaligner.models.source.check_vocab`; ids within it still mean the wrong tokens.)"""
    from openaligner.models.source import find_tokenizer

    if tokenizer is None or source.path is None or model.path is None:
        return
    own = find_tokenizer(model, TokenizerSourceConfig())
    if own is not None and own.get_vocab() != tokenizer.get_vocab():
        log.warning(
            "tokenizer.path=%s is not the tokenizer model.path=%s was trained with: the critic reads its "
            "ids through embeddings learnt for other tokens; %s",
            source.path,
            model.path,
            CRITIC_VOCAB_FIX,
        )


def load_models(
    cfg: ServeCriticConfig, device: torch.device, precision: Precision, log: logging.Logger
) -> tuple[CriticModel, RewardModel | None, PreTrainedTokenizerBase | None]:
    """The critic (float32 masters, with ``cfg.lora``'s adapters, laid over the ranks: ready for
    its optimizer), the frozen reward model (combined mode, else None; in the precision's
    inference dtype, so that its shards hold the weights as served) and the tokenizer of
    ``sentences`` requests (None when there is none). The reward model always comes from
    ``reward_model.path`` or the critic's source (the same seed for the tiny model), never from a
    critic checkpoint: it stays the original reward model. A collective when ``cfg.parallel``
    shards (see :func:`~openaligner.trainer.model_build.build_trainable_model`).

    Raises:
        StartupError: the tokenizer emits ids the critic or the reward model has no embedding for,
            the adapters cannot be added, or the models cannot be sharded.
    """
    from openaligner.models.source import load_critic, load_reward_model

    tokenizer = serving.serving_tokenizer(cfg.model, cfg.tokenizer, log)
    warn_of_a_borrowed_tokenizer(cfg.model, cfg.tokenizer, tokenizer, log)
    vocab_size = serving.loader_vocab_size(tokenizer)
    standardization = cfg.runtime.standardization
    critic = build_trainable_model(
        partial(load_critic, cfg.model, vocab_size, standardization=standardization),
        cfg.parallel,
        device,
        name="critic",
        tokenizer=tokenizer,
        vocab_fix=CRITIC_VOCAB_FIX,
        lora=cfg.lora,  # adapters on the backbone, the head trained in full
        lora_seed=0,  # the same adapters on every rank (each holds a replica) and every restart
    )
    reward_model = None
    if cfg.server.combine_rm_and_critic_server:
        rm_path = cfg.reward_model.path
        source = cfg.model if rm_path is None else replace(cfg.model, path=rm_path)
        if rm_path is not None:
            check_shared_tokenizer(tokenizer, rm_path)

        def load_frozen(load_device: torch.device, *, skeleton: bool) -> RewardModel:
            return load_reward_model(
                source,
                vocab_size,
                load_device,
                standardization,
                dtype=precision.inference_dtype,
                skeleton=skeleton,
            ).requires_grad_(False)

        reward_model = build_trainable_model(
            load_frozen,
            cfg.parallel,
            device,
            name="reward model",
            tokenizer=tokenizer,
            vocab_key="reward_model" if rm_path is not None else "model",
            vocab_fix=COMBINED_RM_VOCAB_FIX,
        )
    return critic, reward_model, tokenizer


def check_shared_tokenizer(critic_tokenizer: PreTrainedTokenizerBase | None, rm_path: str) -> None:
    """Refuse a combined reward model whose directory holds a tokenizer with other ids than the
    critic's: the combined server scores the critic's token ids with both models, so such a reward
    model (e.g. an encoder with its own WordPiece tokenizer) would read ids that mean other tokens.

    Raises:
        StartupError: naming both tokenizers and the fix (serve it apart, where it reads text).
    """
    from openaligner.data.render import tokenizer_fingerprint, tokenizer_name
    from openaligner.models.source import find_tokenizer

    if critic_tokenizer is None:
        return
    with as_startup_error(SourceError):
        rm_tokenizer = find_tokenizer(ModelSourceConfig(path=rm_path), TokenizerSourceConfig())
    if rm_tokenizer is None:
        return
    if tokenizer_fingerprint(rm_tokenizer, template=False) != tokenizer_fingerprint(
        critic_tokenizer, template=False
    ):
        raise StartupError(
            f"reward_model.path={rm_path!r} has its own tokenizer ({tokenizer_name(rm_tokenizer)}), unlike "
            f"the critic's ({tokenizer_name(critic_tokenizer)}); the combined server would score the "
            "critic's token ids with it. Serve it with serve-reward, where it reads text "
            "(server.combine_rm_and_critic_server=false here, remote.combine_rm_and_critic_server=false "
            "in train-ppo), or use a critic with the reward model's tokenizer (tokenizer.path)"
        )
