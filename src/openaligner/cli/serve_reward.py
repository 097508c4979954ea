"""``openaligner serve-reward [CONFIG] [key=value ...]``: serve a frozen reward model over HTTP.

Loads a reward model (a Hugging Face directory, or the tiny seeded test model), starts
:class:`openaligner.servers.reward.RewardModelServer` and serves until SIGINT or SIGTERM. Under
``torchrun`` every rank loads a replica; rank 0 runs Triton and the others follow it. Prints the
URL once the server answers, and stops Triton (no process left behind) on either signal.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field
from types import FrameType
from typing import Any


@dataclass
class RewardModelSource:
    path: str | None = None  # Hugging Face directory of a reward model (sequence classifier, num_labels=1)
    tokenizer_path: str | None = None  # tokenizer for `sentences` requests; default: model.path if it has one
    tiny: bool = False  # serve the tiny seeded GPT-2 test model (char tokenizer) instead of model.path
    seed: int = 0  # seed of the tiny model
    device: str = "auto"  # auto: this rank's CUDA device when there is one, else cpu
    precision: str = "auto"  # auto (bf16-mixed on CUDA, else fp32) | fp32 | bf16-mixed | fp16-mixed
    reward_mean: float | None = None  # with reward_std: serve (reward - mean) / std
    reward_std: float | None = None  # with reward_mean: serve (reward - mean) / std

    def __post_init__(self) -> None:
        from openaligner.models.precision import check_precision  # here: it loads transformers

        check_precision(self.precision, "model.precision")
        if (self.reward_mean is None) != (self.reward_std is None):
            raise ValueError("set both model.reward_mean and model.reward_std, or neither")
        if self.reward_std is not None and self.reward_std <= 0:
            raise ValueError(f"model.reward_std must be > 0, got {self.reward_std}")


@dataclass
class RewardServerSettings:
    host: str = "127.0.0.1"  # address to bind; anything but loopback is logged as a warning
    port: int = 5555  # HTTP port
    model_name: str = "reward_model"  # Triton model name that clients ask for
    inference_micro_batch_size: list[int] = field(default_factory=lambda: [4])  # preferred rows per rank
    model_forward_micro_batch_size: int = 4  # rows per forward pass on one rank
    strip_sequence_length_to_multiple: int | None = None  # compute width multiple (null: longest row)
    max_queue_delay_microseconds: int = 2000  # how long Triton holds a request for others to merge with
    max_batch_size: int = 1024  # most rows per request and per formed batch
    max_sequence_length: int | None = None  # longest accepted sequence; default: the model's position limit
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
        if self.max_batch_size < 1:
            raise ValueError("server.max_batch_size must be >= 1")
        if self.heartbeat_s <= 0:
            raise ValueError("server.heartbeat_s must be > 0")
        if self.max_request_bytes < 1:
            raise ValueError(f"server.max_request_bytes must be >= 1, got {self.max_request_bytes}")


@dataclass
class ServeRewardConfig:
    model: RewardModelSource = field(default_factory=RewardModelSource)  # which reward model to serve
    server: RewardServerSettings = field(default_factory=RewardServerSettings)  # how to serve it
    threads: int | None = None  # torch CPU threads per rank; null: on CPU, cores - 1 (Triton needs one)
    log_level: str = "INFO"  # Python logging level of this process

    def __post_init__(self) -> None:
        if self.model.tiny == (self.model.path is not None):
            raise ValueError("set exactly one of model.path=<HF directory> or model.tiny=true")


SCHEMA = ServeRewardConfig


def run(cfg: ServeRewardConfig) -> int:
    import torch
    import torch.distributed as dist

    from openaligner import distributed as dp
    from openaligner.models.positions import position_limit
    from openaligner.models.precision import Precision
    from openaligner.servers.reward import RewardModelServer, make_tokenize_func

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=cfg.log_level.upper(), format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s"
    )
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("pytriton").setLevel(logging.WARNING)  # its INFO lines repeat what we print
    log = logging.getLogger("openaligner.serve_reward")
    initialised_here = _init_distributed()
    try:
        device = _device(cfg.model.device)
        threads = cfg.threads
        if threads is None and device.type == "cpu":
            # Triton, its python backend and the clients need CPU too; an OpenMP pool as wide as the
            # machine spins against them and latency collapses (docs/benchmarks.md, Reward server).
            threads = max(1, (os.cpu_count() or 2) - 1)
        if threads is not None:
            torch.set_num_threads(threads)
        precision = Precision.resolve(cfg.model.precision, device)
        log.info("precision: %s on %s", precision.name, device)
        model, tokenizer = _load(cfg.model, device, precision.inference_dtype)
        hf_config = model.hf_model.config
        max_len = sequence_limit(cfg.server.max_sequence_length, [position_limit(hf_config)])
        tokenize = make_tokenize_func(tokenizer, max_length=max_len) if tokenizer is not None else None
        s = cfg.server
        server = RewardModelServer(
            infer_fn=precision.autocast_fn(model.infer),
            tokenize_func=tokenize,
            model_name=s.model_name,
            port=s.port,
            inference_micro_batch_size=list(s.inference_micro_batch_size),
            model_forward_micro_batch_size=s.model_forward_micro_batch_size,
            strip_sequence_length_to_multiple=s.strip_sequence_length_to_multiple,
            max_queue_delay_microseconds=s.max_queue_delay_microseconds,
            host=s.host,
            vocab_size=int(hf_config.vocab_size),
            max_sequence_length=max_len,
            max_batch_size=s.max_batch_size,
            heartbeat_s=s.heartbeat_s,
            max_request_bytes=s.max_request_bytes,
            exit_timeout_s=s.exit_timeout_s,
            log_file=s.log_file,
            workspace_dir=s.workspace_dir,
        )
        _install_signal_handlers(server, log)
        if dp.is_leader() and server.start():  # False: stopped while starting
            ranks = dp.world_size()
            print(
                f"reward model server ready at {server.url} (model '{s.model_name}', {ranks} rank(s)); "
                "stop with Ctrl-C or SIGTERM",
                flush=True,
            )
        server.run_server()
        if dp.is_leader():
            print("reward model server stopped", flush=True)
        return 0
    finally:
        if initialised_here and dist.is_initialized():
            dist.destroy_process_group()


def sequence_limit(configured: int | None, model_limits: list[int | None]) -> int | None:
    """The longest sequence to accept: ``server.max_sequence_length``, else the models' position
    limit (None: no limit known).

    Raises:
        StartupError: ``configured`` is beyond a model's positions.
    """
    from openaligner.config import StartupError

    known = [n for n in model_limits if n is not None]
    limit = min(known) if known else None
    if configured is not None and limit is not None and configured > limit:
        raise StartupError(
            f"server.max_sequence_length={configured} is beyond the model's {limit} positions; "
            f"lower it to at most {limit}, or null for the model's limit"
        )
    return configured or limit


def _init_distributed() -> bool:
    """Join the torchrun job if there is one (gloo on CPU, NCCL with CUDA)."""
    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return True


def _device(name: str) -> Any:
    import torch

    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _load(source: RewardModelSource, device: Any, dtype: Any) -> tuple[Any, Any]:
    """The reward model (eval mode, on ``device``, backbone in ``dtype``: the precision's inference
    dtype) and its tokenizer (None when there is none)."""
    from openaligner.models.reward import RewardModel
    from openaligner.models.tokenizers import load_tokenizer

    tokenizer: Any = None
    standardization = None
    if source.reward_mean is not None and source.reward_std is not None:
        standardization = (source.reward_mean, source.reward_std)
    if source.tiny:
        from openaligner.models.builders import TinySize, build_tiny_sequence_classifier
        from openaligner.models.tokenizers import build_char_tokenizer

        tokenizer = build_char_tokenizer()
        size = TinySize(vocab_size=len(tokenizer), hidden_size=64, num_layers=2, num_heads=4)
        hf = build_tiny_sequence_classifier("gpt2", size, seed=source.seed)
        model = RewardModel(hf.to(dtype), standardization=standardization)
    else:
        assert source.path is not None
        model = RewardModel.from_pretrained(source.path, dtype=dtype, standardization=standardization)
        tok_dir = source.tokenizer_path or source.path
        try:
            tokenizer = load_tokenizer(tok_dir)
        except (OSError, ValueError) as e:
            if source.tokenizer_path is not None:
                raise
            logging.getLogger("openaligner.serve_reward").info(
                "no tokenizer in %s (%s); `sentences` requests will be refused", tok_dir, type(e).__name__
            )
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


def _install_signal_handlers(server: Any, log: logging.Logger) -> None:
    """SIGINT/SIGTERM: rank 0 stops the server; other ranks keep following until rank 0's STOP."""

    from openaligner import distributed as dp
    from openaligner.servers.transport.lifecycle import STOP_WHILE_STARTING_S

    def handle(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if dp.is_leader():
            log.info("%s received: stopping", name)
            # this process is the server's: a stop stuck in Triton's start ends it within seconds
            server.request_stop(exit_process_after_s=STOP_WHILE_STARTING_S)
        else:
            log.info("%s received: waiting for rank 0 to stop the server", name)

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)
