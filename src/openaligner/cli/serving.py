"""What ``serve-reward`` and ``serve-critic`` share: the ``runtime`` section, the choice of model,
the keys they renamed, and the plumbing of a server process.

Owns :class:`RuntimeConfig` (where the served models run, in what precision, and the scale
rewards are served on), the rule that a server serves only a model someone named
(:func:`check_model_choice`), :data:`RENAMED_KEYS`, and the steps both commands take around their
server: logging, joining the torchrun job, device, threads and precision, the tokenizer, the
sequence limit, and stopping on SIGINT/SIGTERM. Must not know which server it serves; their models
are built as every command's are (:func:`~openaligner.trainer.model_build.build_trainable_model`).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from openaligner import distributed as dp
from openaligner.config import StartupError, as_startup_error
from openaligner.data.render import LayoutError, SequenceLayout, tokenizer_identity
from openaligner.models.precision import Precision, check_precision
from openaligner.models.source import (
    ModelSourceConfig,
    SourceError,
    TokenizerSourceConfig,
    find_tokenizer,
    pick_device,
    tokenizer_id_count,
)
from openaligner.protocol import tokenizer_description
from openaligner.servers.config import ServingConfig
from openaligner.servers.reward import make_render_func, make_tokenize_func
from openaligner.servers.transport.lifecycle import STOP_WHILE_STARTING_S, ServerLifecycle
from openaligner.servers.validation import RenderFn, TokenizeFn

RENAMED_KEYS: dict[str, str] = {
    "model.tiny=true": "model.tiny=gpt2",
    "model.tiny=false": "the default (leave model.tiny out and set model.path)",
    "model.seed": "model.tiny_seed",
    "model.tokenizer_path": "tokenizer.path",
    "model.device": "runtime.device",
    "model.precision": "runtime.precision",
    "model.reward_mean": "runtime.reward_mean",
    "model.reward_std": "runtime.reward_std",
}
"""Keys the server commands had before they shared ``ModelSourceConfig`` and :class:`RuntimeConfig`,
refused at start-up with their new names (see :data:`openaligner.config.loading.RENAMED_KEYS`)."""


@dataclass
class RuntimeConfig:
    """Where and how a server runs its models, and the scale it serves rewards on."""

    device: str = "auto"  # auto: this rank's CUDA device when there is one, else cpu; or cpu, cuda:1, ...
    precision: str = "auto"  # auto (bf16-mixed on CUDA, else fp32) | fp32 | bf16-mixed | fp16-mixed
    reward_mean: float | None = None  # with reward_std: serve (reward - mean) / std
    reward_std: float | None = None  # with reward_mean: serve (reward - mean) / std

    def __post_init__(self) -> None:
        # {section}: this section's key in the command's schema (runtime)
        check_precision(self.precision, "{section}.precision")
        if (self.reward_mean is None) != (self.reward_std is None):
            raise ValueError("set both {section}.reward_mean and {section}.reward_std, or neither")
        if self.reward_std is not None and self.reward_std <= 0:
            raise ValueError(f"{{section}}.reward_std must be > 0, got {self.reward_std}")

    @property
    def standardization(self) -> tuple[float, float] | None:
        """``(mean, std)`` of the fixed reward standardization, or None."""
        if self.reward_mean is None or self.reward_std is None:
            return None
        return self.reward_mean, self.reward_std


def no_model() -> ModelSourceConfig:
    """A server's ``model`` section before the user names one: neither a path nor a tiny model."""
    return ModelSourceConfig(tiny=None)


def check_model_choice(model: ModelSourceConfig) -> None:
    """A server serves exactly the model named: ``model.path``, or the tiny one only when asked for.

    Raises:
        ValueError: neither or both are set.
    """
    if model.path is None and model.tiny is None:
        raise ValueError(
            "no model to serve: set model.path=<HF directory> or model.tiny=gpt2 (the tiny test model)"
        )
    if model.path is not None and model.tiny is not None:
        raise ValueError("set one of model.path and model.tiny, not both")


def setup_logging(level: str, name: str) -> logging.Logger:
    """Log lines tagged with this process's rank; PyTriton's INFO lines (which repeat ours) only
    at DEBUG."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=level.upper(), format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s"
    )
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("pytriton").setLevel(logging.WARNING)
    return logging.getLogger(name)


@contextmanager
def process_group() -> Iterator[None]:
    """Inside, this process is in the torchrun job if there is one (gloo on CPU, NCCL with CUDA on
    ``LOCAL_RANK``'s device); a group joined here is left at the end."""
    joined_here = not dp.is_distributed() and dp.init_from_env()
    try:
        yield
    finally:
        if joined_here and dist.is_initialized():
            dist.destroy_process_group()  # no barrier (dp.shutdown): after a failure peers may be gone


def check_batching(server: ServingConfig, world_size: int) -> None:
    """Refuse, before any model loads, a ``server`` section whose batcher Triton cannot load on
    ``world_size`` ranks (the config loader checked one rank; see
    :meth:`~openaligner.servers.config.ServingConfig.check_batching`).

    Raises:
        StartupError: naming ``server.max_batch_size`` and the smallest value that works.
    """
    try:
        server.check_batching(world_size, key="server")
    except ValueError as e:
        raise StartupError(str(e)) from None


def prepare_runtime(
    runtime: RuntimeConfig, threads: int | None, log: logging.Logger
) -> tuple[torch.device, Precision]:
    """``(device, precision)`` for this rank, and torch's CPU threads: ``threads``, else on CPU
    cores - 1 (Triton, its python backend and the clients need CPU too; an OpenMP pool as wide
    as the machine spins against them and latency collapses: docs/benchmarks.md, Reward server)."""
    device = pick_device(runtime.device)
    if threads is None and device.type == "cpu":
        threads = max(1, (os.cpu_count() or 2) - 1)
    if threads is not None:
        torch.set_num_threads(threads)
    precision = Precision.resolve(runtime.precision, device)
    log.info("precision: %s on %s", precision.name, device)
    return device, precision


def serving_tokenizer(
    model: ModelSourceConfig, tokenizer: TokenizerSourceConfig, log: logging.Logger
) -> PreTrainedTokenizerBase | None:
    """The tokenizer of ``sentences`` requests (see :func:`~openaligner.models.source.find_tokenizer`),
    or None when ``model.path`` holds none: the server then takes token ids only."""
    with as_startup_error(SourceError):
        found = find_tokenizer(model, tokenizer)
    if found is None:
        log.info("no tokenizer in %s (set tokenizer.path); `sentences` requests will be refused", model.path)
    return found


def sentences_tokenizer(
    tokenizer: PreTrainedTokenizerBase | None, reward_model_dir: str | None, max_length: int | None
) -> TokenizeFn | None:
    """How ``sentences`` requests become token ids: laid out as the reward model was trained
    (the ``sequence_layout.json`` train-rm wrote into ``reward_model_dir``; train-rm's default
    layout when there is none, e.g. a reward model from elsewhere), cut to ``max_length``. None
    without a tokenizer (token ids only).

    Raises:
        StartupError: the layout file cannot be read.
    """
    if tokenizer is None:
        return None
    return make_tokenize_func(tokenizer, max_length=max_length, layout=recorded_layout(reward_model_dir))


def recorded_layout(model_dir: str | None) -> SequenceLayout | None:
    """The layout train-rm recorded next to the model in ``model_dir`` (None: none recorded, or no
    directory).

    Raises:
        StartupError: the layout file cannot be read.
    """
    with as_startup_error(LayoutError):
        return SequenceLayout.load(model_dir) if model_dir is not None else None


def served_tokenizer(
    tokenizer: PreTrainedTokenizerBase | None, model_dir: str | None
) -> tuple[RenderFn | None, dict[str, object]]:
    """How ``messages`` requests are laid out (with the layout recorded in ``model_dir``, as in
    :func:`sentences_tokenizer`) and what the tokenizer route says: ``(None, no tokenizer)``
    without a tokenizer.

    Raises:
        StartupError: the layout file cannot be read.
    """
    if tokenizer is None:
        return None, tokenizer_description(None, None, None)
    layout = recorded_layout(model_dir)
    try:
        render: RenderFn | None = make_render_func(tokenizer, layout)
    except LayoutError as e:  # e.g. add_eos without an EOS token: `sentences` still work
        logging.getLogger(__name__).warning("`messages` requests will be refused: %s", e)
        render = None
    name, fingerprint, vocab_fingerprint = tokenizer_identity(tokenizer, layout)
    return render, tokenizer_description(name, fingerprint, vocab_fingerprint)


def sequence_limit(configured: int | None, model_limits: list[int | None]) -> int | None:
    """The longest sequence to accept: ``server.max_sequence_length``, else the models' position
    limit (None: no limit known).

    Raises:
        StartupError: ``configured`` is beyond a model's positions.
    """
    known = [n for n in model_limits if n is not None]
    limit = min(known) if known else None
    if configured is not None and limit is not None and configured > limit:
        raise StartupError(
            f"server.max_sequence_length={configured} is beyond the model's {limit} positions; "
            f"lower it to at most {limit}, or null for the model's limit"
        )
    return configured or limit


def install_signal_handlers(server: ServerLifecycle, log: logging.Logger) -> None:
    """SIGINT/SIGTERM: rank 0 stops ``server``; other ranks keep following until rank 0's STOP."""

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


def loader_vocab_size(tokenizer: PreTrainedTokenizerBase | None) -> int:
    """The vocabulary a tiny model is built with: the tokenizer's (a tiny model always has one;
    a model directory ignores it), every id it can emit."""
    return tokenizer_id_count(tokenizer) if tokenizer is not None else 0
