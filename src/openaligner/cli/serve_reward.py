"""``openaligner serve-reward [CONFIG] [key=value ...]``: serve a frozen reward model over HTTP.

Loads the reward model the config names (a Hugging Face directory, or the tiny seeded test model
when asked for), starts :class:`openaligner.servers.reward.RewardModelServer` and serves until
SIGINT or SIGTERM. Under ``torchrun`` every rank loads the model and computes a share of each
batch; with ``parallel.strategy=fsdp`` each then keeps only its shard of the weights (every rank
takes part in every forward). Rank 0 runs Triton and the others follow it. Prints the URL once
the server answers, and stops Triton (no process left behind) on either signal.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers import PreTrainedTokenizerBase

from openaligner.cli import serving
from openaligner.cli.serving import RuntimeConfig
from openaligner.models.precision import Precision
from openaligner.models.reward import RewardModel
from openaligner.models.sharding import ParallelConfig
from openaligner.models.source import ModelSourceConfig, TokenizerSourceConfig
from openaligner.servers.reward import RewardServerConfig


@dataclass
class ServeRewardConfig:
    RENAMED_KEYS: ClassVar[dict[str, str]] = serving.RENAMED_KEYS

    model: ModelSourceConfig = field(default_factory=serving.no_model)  # the reward model: path or tiny
    tokenizer: TokenizerSourceConfig = field(default_factory=TokenizerSourceConfig)  # for `sentences`
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # device, precision, reward scale
    server: RewardServerConfig = field(default_factory=RewardServerConfig)  # how to serve it
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # replicas (ddp) or shards (fsdp)
    threads: int | None = None  # torch CPU threads per rank; null: on CPU, cores - 1 (Triton needs one)
    log_level: str = "INFO"  # Python logging level of this process

    def __post_init__(self) -> None:
        serving.check_model_choice(self.model)


SCHEMA = ServeRewardConfig


def run(cfg: ServeRewardConfig) -> int:
    from openaligner import distributed as dp
    from openaligner.models.positions import position_limit
    from openaligner.servers.reward import RewardModelServer

    log = serving.setup_logging(cfg.log_level, "openaligner.serve_reward")
    with serving.process_group():
        device, precision = serving.prepare_runtime(cfg.runtime, cfg.threads, log)
        model, tokenizer = load_model(cfg, device, precision, log)
        # sharded after the cast to the inference dtype: the shards hold the weights as served
        model = serving.shard_served(model, cfg.parallel, "reward model")
        hf_config = model.hf_model.config
        max_len = serving.sequence_limit(cfg.server.max_sequence_length, [position_limit(hf_config)])
        tokenize = serving.sentences_tokenizer(tokenizer, cfg.model.path, max_len)
        render, described = serving.served_tokenizer(tokenizer, cfg.model.path)
        server = RewardModelServer(
            precision.autocast_fn(model.infer),
            tokenize,
            cfg.server,
            render_func=render,
            tokenizer_info=described,
            vocab_size=int(hf_config.vocab_size),
            max_sequence_length=max_len,
        )
        serving.install_signal_handlers(server, log)
        if dp.is_leader() and server.start():  # False: stopped while starting
            print(
                f"reward model server ready at {server.url} (model '{cfg.server.model_name}', "
                f"{dp.world_size()} rank(s){', sharded' if cfg.parallel.sharded else ''}); "
                "stop with Ctrl-C or SIGTERM",
                flush=True,
            )
        server.run_server()
        if dp.is_leader():
            print("reward model server stopped", flush=True)
    return 0


def load_model(
    cfg: ServeRewardConfig, device: torch.device, precision: Precision, log: logging.Logger
) -> tuple[RewardModel, PreTrainedTokenizerBase | None]:
    """The reward model (eval mode, frozen, on ``device``, backbone in the precision's inference
    dtype) and the tokenizer of ``sentences`` requests (None when there is none)."""
    from openaligner.models.sharding import builds_skeleton
    from openaligner.models.source import load_reward_model

    tokenizer = serving.serving_tokenizer(cfg.model, cfg.tokenizer, log)
    model = load_reward_model(
        cfg.model,
        serving.loader_vocab_size(tokenizer),
        cfg.parallel.load_device(device),  # sharded: read on the CPU, shards go to the device
        cfg.runtime.standardization,
        dtype=precision.inference_dtype,
        skeleton=builds_skeleton(cfg.parallel),  # sharded: rank 0 alone reads, the others get shards
    )
    return model.requires_grad_(False), tokenizer
