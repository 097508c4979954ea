"""``openaligner serve-reward [CONFIG] [key=value ...]``: serve a frozen reward model, a Python
reward function, or both, over HTTP.

Owns the command: load the model and/or the function, start
:class:`~openaligner.servers.reward.RewardModelServer` on every rank and serve until SIGINT or
SIGTERM. Must not know how rewards are computed or the transport.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers import PreTrainedTokenizerBase

from openaligner.cli import serving
from openaligner.cli.serving import RuntimeConfig
from openaligner.config import StartupError, as_startup_error
from openaligner.models.precision import Precision
from openaligner.models.reward import RewardModel
from openaligner.models.sharding import ParallelConfig
from openaligner.models.source import ModelSourceConfig, TokenizerSourceConfig
from openaligner.servers.reward import RewardServerConfig

if TYPE_CHECKING:
    from openaligner.servers.reward_function import FunctionRunner


@dataclass
class RewardFunctionConfig:
    """A Python reward function served instead of, or with, the reward model (docs/serving.md)."""

    function: str | None = None  # "package.module:function" or "path/to/file.py:function"; null: none
    model_weight: float = (
        1.0  # with a model and a function: reward = model_weight·model + function_weight·function
    )
    function_weight: float = 1.0  # weight of the function's score
    timeout_s: float = 60.0  # a call still running after this long fails; its worker is restarted
    workers: int = 8  # worker processes calling the function; up to workers-1 hanging calls delay no other

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"{{section}}.timeout_s must be > 0, got {self.timeout_s}")
        if self.workers < 1:
            raise ValueError(f"{{section}}.workers must be >= 1, e.g. 8; got {self.workers}")


@dataclass
class ServeRewardConfig:
    RENAMED_KEYS: ClassVar[dict[str, str]] = serving.RENAMED_KEYS

    model: ModelSourceConfig = field(default_factory=serving.no_model)  # the reward model: path or tiny
    tokenizer: TokenizerSourceConfig = field(default_factory=TokenizerSourceConfig)  # for `sentences`
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # device, precision, reward scale
    server: RewardServerConfig = field(default_factory=RewardServerConfig)  # how to serve it
    reward: RewardFunctionConfig = field(default_factory=RewardFunctionConfig)  # a reward function
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # replicas (ddp) or shards (fsdp)
    threads: int | None = None  # torch CPU threads per rank; null: on CPU, cores - 1 (Triton needs one)
    log_level: str = "INFO"  # Python logging level of this process

    def __post_init__(self) -> None:
        has_model = self.model.path is not None or self.model.tiny is not None
        if self.reward.function is None or has_model:
            serving.check_model_choice(self.model)
        _check_weights(self.reward, has_model)


def _check_weights(r: RewardFunctionConfig, has_model: bool) -> None:
    """Refuse reward weights that would be ignored, or that would silence what is served."""
    weights = {"model_weight": r.model_weight, "function_weight": r.function_weight}
    if r.function is None:
        for key, w in weights.items():
            if w != 1.0:  # a model alone answers its own score
                raise ValueError(
                    f"reward.{key}={w:g} weighs a reward function against the model, and does nothing "
                    "without reward.function: leave it 1.0 (runtime.reward_mean/reward_std rescale a "
                    "model's reward)"
                )
        return
    if r.function_weight == 0:
        rewards = "the model's alone" if has_model else "0"
        raise ValueError(
            f"reward.function_weight=0 ignores reward.function (every reward would be {rewards}): set "
            "a weight other than 0 (e.g. 1.0), or reward.function=null"
        )
    if not has_model and r.model_weight != 1.0:
        raise ValueError(
            f"reward.model_weight={r.model_weight:g} does nothing with no reward model (model.path/"
            "model.tiny unset): leave it 1.0"
        )
    if has_model and r.model_weight == 0:
        raise ValueError(
            "reward.model_weight=0 loads the reward model to ignore it: set a weight other than 0 "
            "(e.g. 1.0), or serve the function alone (no model.path/model.tiny)"
        )


SCHEMA = ServeRewardConfig


def run(cfg: ServeRewardConfig) -> int:
    from openaligner import distributed as dp
    from openaligner.models.positions import position_limit
    from openaligner.servers.reward import RewardModelServer

    log = serving.setup_logging(cfg.log_level, "openaligner.serve_reward")
    has_model = cfg.model.path is not None or cfg.model.tiny is not None
    with serving.process_group():
        serving.check_batching(cfg.server, dp.world_size())
        device, precision = serving.prepare_runtime(cfg.runtime, cfg.threads, log)
        runner = start_reward_function(cfg.reward) if dp.is_leader() else None
        try:
            settings: dict[str, Any] = {}
            if has_model:
                model, tokenizer = load_model(cfg, device, precision, log)
                hf_config = model.hf_model.config
                max_len = serving.sequence_limit(cfg.server.max_sequence_length, [position_limit(hf_config)])
                render, described = serving.served_tokenizer(tokenizer, cfg.model.path)
                if runner is not None and render is None:
                    raise StartupError(
                        "reward.function with a reward model needs the model's tokenizer to lay text out for "
                        "it: set tokenizer.path (or serve a model directory that holds its tokenizer)"
                    )
                settings = {
                    "infer_fn": precision.autocast_fn(model.infer),
                    "tokenize_func": serving.sentences_tokenizer(tokenizer, cfg.model.path, max_len),
                    "render_func": render,
                    "tokenizer_info": described,
                    "vocab_size": int(hf_config.vocab_size),
                    "max_sequence_length": max_len,
                    "chat_template": bool(
                        getattr(serving.recorded_layout(cfg.model.path), "chat_template", False)
                    ),
                }
            server = RewardModelServer(
                settings.pop("infer_fn", None),
                settings.pop("tokenize_func", None),
                cfg.server,
                reward_function=runner,
                function_name=cfg.reward.function or "",
                model_weight=cfg.reward.model_weight,
                function_weight=cfg.reward.function_weight,
                **settings,
            )
            serving.install_signal_handlers(server, log)
            if dp.is_leader() and server.start():  # False: stopped while starting
                served = [f"model '{cfg.server.model_name}'"]
                if cfg.reward.function is not None:
                    served.append(f"function {cfg.reward.function}")
                print(
                    f"reward model server ready at {server.url} ({', '.join(served)}, "
                    f"{dp.world_size()} rank(s){', sharded' if cfg.parallel.sharded else ''}); "
                    "stop with Ctrl-C or SIGTERM",
                    flush=True,
                )
            server.run_server()
        finally:
            if runner is not None:
                runner.close()
        if dp.is_leader():
            print("reward model server stopped", flush=True)
    return 0


def start_reward_function(cfg: RewardFunctionConfig) -> FunctionRunner | None:
    """The worker processes of ``reward.function`` (None without one), once they have loaded it.

    Raises:
        StartupError: the function cannot be imported, or is not callable.
    """
    if cfg.function is None:
        return None
    from openaligner.servers.reward_function import FunctionRunner, RewardFunctionLoadError

    with as_startup_error(RewardFunctionLoadError):
        return FunctionRunner(cfg.function, timeout_s=cfg.timeout_s, workers=cfg.workers)


def load_model(
    cfg: ServeRewardConfig, device: torch.device, precision: Precision, log: logging.Logger
) -> tuple[RewardModel, PreTrainedTokenizerBase | None]:
    """The reward model (eval mode, frozen, backbone in the precision's inference dtype, laid over
    the ranks: sharded after that cast, so that the shards hold the weights as served) and the
    tokenizer of ``sentences`` requests (None when there is none). A collective when
    ``cfg.parallel`` shards (see :func:`~openaligner.trainer.model_build.build_trainable_model`).

    Raises:
        StartupError: the tokenizer emits ids the model has no embedding for, or the model cannot
            be sharded.
    """
    from openaligner.models.source import load_reward_model
    from openaligner.trainer.model_build import build_trainable_model

    tokenizer = serving.serving_tokenizer(cfg.model, cfg.tokenizer, log)

    def load_frozen(load_device: torch.device, *, skeleton: bool) -> RewardModel:
        return load_reward_model(
            cfg.model,
            serving.loader_vocab_size(tokenizer),
            load_device,
            cfg.runtime.standardization,
            dtype=precision.inference_dtype,
            skeleton=skeleton,
        ).requires_grad_(False)

    model = build_trainable_model(load_frozen, cfg.parallel, device, name="reward model", tokenizer=tokenizer)
    return model, tokenizer
