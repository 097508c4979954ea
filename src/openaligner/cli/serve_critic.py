"""``openaligner serve-critic [CONFIG] [key=value ...]``: serve a trainable critic (and the reward model).

Loads the critic (initialised from a reward-model Hugging Face directory, or the tiny seeded test
model) and, in combined mode, a frozen copy of the reward model; builds the optimizer, scheduler,
checkpoint manager and metrics logger into a :class:`openaligner.trainer.critic.CriticTrainer`;
resumes from the latest complete checkpoint (or the one ``checkpoint.resume_step`` names); and
runs :class:`openaligner.servers.critic.CriticServerTrainer` until SIGINT or SIGTERM. Under ``torchrun``
every rank holds a replica; rank 0 runs Triton and the others follow it. Prints the URL once the
server answers and stops Triton (no process left behind) on either signal.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openaligner.cli.serve_reward import _device, _init_distributed, _install_signal_handlers, sequence_limit
from openaligner.trainer.optim import OptimConfig


@dataclass
class CriticModelSource:
    path: str | None = None  # HF directory of a reward model (num_labels=1); initialises the critic
    tokenizer_path: str | None = None  # tokenizer for `sentences` requests; default: model.path if it has one
    tiny: bool = False  # serve the tiny seeded GPT-2 test model (char tokenizer) instead of model.path
    seed: int = 0  # seed of the tiny model
    device: str = "auto"  # auto: this rank's CUDA device when there is one, else cpu
    precision: str = "auto"  # auto (bf16-mixed on CUDA, else fp32) | fp32 | bf16-mixed | fp16-mixed
    reward_mean: float | None = None  # with reward_std: rewards and values are served as (x - mean) / std
    reward_std: float | None = None  # with reward_mean: the same standardization enters the critic loss

    def __post_init__(self) -> None:
        from openaligner.models.precision import check_precision  # here: it loads transformers

        check_precision(self.precision, "model.precision")
        if (self.reward_mean is None) != (self.reward_std is None):
            raise ValueError("set both model.reward_mean and model.reward_std, or neither")
        if self.reward_std is not None and self.reward_std <= 0:
            raise ValueError(f"model.reward_std must be > 0, got {self.reward_std}")


@dataclass
class RewardModelSource:
    path: str | None = None  # HF directory of the reward model served in combined mode; null: model.path


@dataclass
class CriticServerSettings:
    host: str = "127.0.0.1"  # address to bind; anything but loopback is logged as a warning
    port: int = 5556  # HTTP port
    combine_rm_and_critic_server: bool = True  # also serve rewards (critic_infer returns values and rewards)
    inference_micro_batch_size: list[int] = field(default_factory=lambda: [4])  # preferred infer rows/rank
    model_forward_micro_batch_size: int = 4  # infer rows per forward pass on one rank
    strip_sequence_length_to_multiple: int | None = None  # compute width multiple (null: longest row)
    max_queue_delay_microseconds: int = 2000  # how long Triton holds an infer request to merge it
    max_batch_size: int = 1024  # most rows per infer request and per formed batch
    max_train_rows: int = 16384  # most rows per critic_train request
    max_sequence_length: int | None = None  # longest accepted sequence; default: the model's position limit
    token: str | None = None  # secret for critic_train/critic_save; null: $OPENALIGNER_TOKEN, else open
    max_request_bytes: int = (
        256 * 2**20
    )  # largest HTTP request body in bytes (256 MiB); larger ones get HTTP 413
    exit_timeout_s: int = 3  # at stop, how long calls in progress may take to finish
    heartbeat_s: float = 60.0  # idle heartbeat to the other ranks, keeping them within the pg timeout
    log_file: str | None = None  # tritonserver's log file; default: a temporary file removed at stop
    workspace_dir: str | None = None  # root of the server's own files; null: <tmp>/openaligner-servers-<uid>

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"server.port must be in 1..65535, got {self.port}")
        if not self.inference_micro_batch_size or min(self.inference_micro_batch_size) < 1:
            raise ValueError("server.inference_micro_batch_size must be a list of sizes >= 1, e.g. [4]")
        if self.model_forward_micro_batch_size < 1:
            raise ValueError("server.model_forward_micro_batch_size must be >= 1")
        if self.max_batch_size < 1 or self.max_train_rows < 1:
            raise ValueError("server.max_batch_size and server.max_train_rows must be >= 1")
        if self.heartbeat_s <= 0:
            raise ValueError("server.heartbeat_s must be > 0")
        if self.max_request_bytes < 1:
            raise ValueError(f"server.max_request_bytes must be >= 1, got {self.max_request_bytes}")


@dataclass
class CriticTrainSettings:
    global_batch_size: int = 64  # rows per optimizer step over all ranks; requests pad to a multiple
    micro_batch_size: int = 8  # rows per forward/backward on one rank (gradients are accumulated)
    loss_clip_val: float = 0.2  # clip values to prev_values ± this in the value loss; 0 disables
    gradient_clip_val: float = 1.0  # clip the global gradient norm to this; 0 disables

    def __post_init__(self) -> None:
        if self.global_batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError("train.global_batch_size and train.micro_batch_size must be >= 1")
        if self.loss_clip_val < 0 or self.gradient_clip_val < 0:
            raise ValueError("train.loss_clip_val and train.gradient_clip_val must be >= 0 (0 disables)")


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


@dataclass
class ServeCriticConfig:
    model: CriticModelSource = field(default_factory=CriticModelSource)  # the critic's initial weights
    reward_model: RewardModelSource = field(default_factory=RewardModelSource)  # the RM served when combined
    server: CriticServerSettings = field(default_factory=CriticServerSettings)  # how to serve
    train: CriticTrainSettings = field(default_factory=CriticTrainSettings)  # how critic_train trains
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
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)  # where to save and resume
    log_dir: str | None = None  # train/* metrics (JSONL) go here; null: <checkpoint.dir>/logs, or none
    tensorboard: bool = False  # also write TensorBoard events under log_dir
    threads: int | None = None  # torch CPU threads per rank; null: on CPU, cores - 1 (Triton needs one)
    log_level: str = "INFO"  # Python logging level of this process

    def __post_init__(self) -> None:
        if self.model.tiny == (self.model.path is not None):
            raise ValueError("set exactly one of model.path=<HF directory> or model.tiny=true")
        if self.model.tiny and self.reward_model.path is not None:
            raise ValueError("model.tiny=true serves the tiny reward model too; unset reward_model.path")
        if self.optim.decay_steps is None and self.optim.scheduler != "constant":
            raise ValueError(
                f"optim.scheduler={self.optim.scheduler} needs optim.decay_steps: the critic server "
                "cannot know how many steps training will take"
            )


SCHEMA = ServeCriticConfig


def run(cfg: ServeCriticConfig) -> int:
    import torch
    import torch.distributed as dist

    from openaligner import distributed as dp
    from openaligner.io.checkpoint import CheckpointManager
    from openaligner.io.metrics import MetricsLogger
    from openaligner.models.positions import position_limit
    from openaligner.models.precision import Precision
    from openaligner.servers.critic import CriticServerConfig, CriticServerTrainer
    from openaligner.servers.reward import make_tokenize_func
    from openaligner.trainer.critic import CriticTrainConfig, CriticTrainer
    from openaligner.trainer.optim import build_optimizer

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=cfg.log_level.upper(), format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s"
    )
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("pytriton").setLevel(logging.WARNING)  # its INFO lines repeat what we print
    log = logging.getLogger("openaligner.serve_critic")
    initialised_here = _init_distributed()
    logger: MetricsLogger | None = None
    try:
        device = _device(cfg.model.device)
        threads = cfg.threads
        if threads is None and device.type == "cpu":
            threads = max(1, (os.cpu_count() or 2) - 1)  # leave a core to Triton and its python backend
        if threads is not None:
            torch.set_num_threads(threads)
        precision = Precision.resolve(cfg.model.precision, device)
        log.info("precision: %s on %s", precision.name, device)
        critic, reward_model, tokenizer = _load(cfg, device, precision)
        limits = [position_limit(m.hf_model.config) for m in (critic, reward_model) if m is not None]
        max_len = sequence_limit(cfg.server.max_sequence_length, limits)
        tokenize = make_tokenize_func(tokenizer, max_length=max_len) if tokenizer is not None else None
        t, s = cfg.train, cfg.server
        # The server does not know how long training runs: the schedule's length is optim.decay_steps.
        optimizer, scheduler = build_optimizer(critic.parameters(), cfg.optim, run_steps=None)
        ck = cfg.checkpoint
        checkpoints = CheckpointManager(ck.dir, keep_last=ck.keep_last) if ck.dir else None
        log_dir = cfg.log_dir or (str(Path(cfg.checkpoint.dir) / "logs") if cfg.checkpoint.dir else None)
        if log_dir is not None:
            logger = MetricsLogger(log_dir, tensorboard=cfg.tensorboard, enabled=rank == 0)
        server_cfg = CriticServerConfig(
            host=s.host,
            port=s.port,
            combine_rm_and_critic_server=s.combine_rm_and_critic_server,
            inference_micro_batch_size=list(s.inference_micro_batch_size),
            max_queue_delay_microseconds=s.max_queue_delay_microseconds,
            strip_sequence_length_to_multiple=s.strip_sequence_length_to_multiple,
            max_batch_size=s.max_batch_size,
            max_train_rows=s.max_train_rows,
            max_sequence_length=max_len,
            token=s.token,
            heartbeat_s=s.heartbeat_s,
            max_request_bytes=s.max_request_bytes,
            exit_timeout_s=s.exit_timeout_s,
            log_file=s.log_file,
            workspace_dir=s.workspace_dir,
        )
        train_cfg = CriticTrainConfig(
            global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size,
            loss_clip_val=t.loss_clip_val,
            gradient_clip_val=t.gradient_clip_val,
        )
        trainer = CriticTrainer(
            train_cfg,
            critic,
            optimizer,
            scheduler,
            precision=precision,
            logger=logger,
            checkpoints=checkpoints,
        )
        server = CriticServerTrainer(
            server_cfg,
            trainer,
            tokenize,
            model_forward_micro_batch_size=s.model_forward_micro_batch_size,
            reward_model=reward_model,
            resume=cfg.checkpoint.resume,
            resume_step=cfg.checkpoint.resume_step,
        )
        _install_signal_handlers(server, log)
        if dp.is_leader() and server.start():  # False: stopped while starting
            mode = "values and rewards" if s.combine_rm_and_critic_server else "values only"
            guarded = ", train/save need the token" if server.token is not None else ""
            print(
                f"critic server ready at {server.url} (critic_infer: {mode}; critic_train, critic_save; "
                f"{dp.world_size()} rank(s); step {server.step}{guarded}); "
                "stop with Ctrl-C or SIGTERM",
                flush=True,
            )
        server.run_server()
        if dp.is_leader():
            print(f"critic server stopped at step {server.step}", flush=True)
        return 0
    finally:
        if logger is not None:
            logger.close()
        if initialised_here and dist.is_initialized():
            dist.destroy_process_group()


def _load(cfg: ServeCriticConfig, device: Any, precision: Any) -> tuple[Any, Any, Any]:
    """The critic (on ``device``), the frozen reward model (combined mode, else None) and the
    tokenizer (None when there is none). The reward model always comes from its directory (or the
    tiny seed), never from a critic checkpoint: it stays the original reward model. The critic is
    trained, so it holds float32 masters; the reward model is cast to ``precision``'s inference
    dtype."""
    from openaligner.models.critic import CriticModel
    from openaligner.models.precision import MASTER_DTYPE
    from openaligner.models.reward import RewardModel
    from openaligner.models.tokenizers import load_tokenizer

    src = cfg.model
    standardization = None
    if src.reward_mean is not None and src.reward_std is not None:
        standardization = (src.reward_mean, src.reward_std)
    combined = cfg.server.combine_rm_and_critic_server
    tokenizer: Any = None
    reward_model: Any = None
    if src.tiny:
        from openaligner.models.builders import TinySize, build_tiny_sequence_classifier
        from openaligner.models.tokenizers import build_char_tokenizer

        tokenizer = build_char_tokenizer()
        size = TinySize(vocab_size=len(tokenizer), hidden_size=64, num_layers=2, num_heads=4)
        hf = build_tiny_sequence_classifier("gpt2", size, seed=src.seed)
        critic = CriticModel(copy.deepcopy(hf), standardization=standardization)
        if combined:
            reward_model = RewardModel(hf.to(precision.inference_dtype), standardization=standardization)
    else:
        assert src.path is not None
        critic = CriticModel.from_pretrained(src.path, dtype=MASTER_DTYPE, standardization=standardization)
        if combined:
            rm_path = cfg.reward_model.path or src.path
            reward_model = RewardModel.from_pretrained(
                rm_path, dtype=precision.inference_dtype, standardization=standardization
            )
        tok_dir = src.tokenizer_path or src.path
        try:
            tokenizer = load_tokenizer(tok_dir)
        except (OSError, ValueError) as e:
            if src.tokenizer_path is not None:
                raise
            logging.getLogger("openaligner.serve_critic").info(
                "no tokenizer in %s (%s); `sentences` requests will be refused", tok_dir, type(e).__name__
            )
    critic.to(device).eval()
    if reward_model is not None:
        reward_model.to(device).eval().requires_grad_(False)
    return critic, reward_model, tokenizer
