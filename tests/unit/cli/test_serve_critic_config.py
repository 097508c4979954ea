"""configs/serve_critic.yaml documents every key of the serve-critic schema with its default, and
loads; the schema's sections are the server's, the trainer's and the models' own dataclasses."""

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from openaligner.cli import serve_critic
from openaligner.cli.main import COMMANDS
from openaligner.cli.serve_critic import SCHEMA, ServeCriticConfig
from openaligner.cli.serving import RuntimeConfig
from openaligner.config import ConfigError, load_config
from openaligner.models.builders import TinySize, build_tiny_sequence_classifier
from openaligner.models.precision import Precision
from openaligner.models.source import ModelSourceConfig, TokenizerSourceConfig
from openaligner.models.tokenizers import build_char_tokenizer
from openaligner.servers.critic import CriticServerConfig
from openaligner.trainer.critic import CriticTrainConfig

YAML = Path(__file__).resolve().parents[3] / "configs" / "serve_critic.yaml"
CPU = torch.device("cpu")
FP32 = Precision.resolve("fp32", CPU)
LOG = logging.getLogger("test")


def test_registered_and_loads_with_overrides(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert COMMANDS["serve-critic"][0] == "openaligner.cli.serve_critic"
    cfg = load_config(
        SCHEMA,
        YAML,
        [
            f"model.path={tmp_path}",
            "server.port=6000",
            "server.combine_rm_and_critic_server=false",
            "train.micro_batch_size=2",
        ],
    )
    assert isinstance(cfg, ServeCriticConfig)
    assert cfg.server.port == 6000 and not cfg.server.combine_rm_and_critic_server
    assert cfg.train.micro_batch_size == 2 and cfg.train.global_batch_size == 64
    assert cfg.train.loss_clip_val == 0.2 and cfg.reward_model.path is None


def test_sections_are_the_components_own_configs_not_copies():
    types = {f.name: f.type for f in dataclasses.fields(ServeCriticConfig)}
    assert types["server"] in ("CriticServerConfig", CriticServerConfig)
    assert types["train"] in ("CriticTrainConfig", CriticTrainConfig)
    assert types["model"] in ("ModelSourceConfig", ModelSourceConfig)
    assert types["tokenizer"] in ("TokenizerSourceConfig", TokenizerSourceConfig)
    assert types["runtime"] in ("RuntimeConfig", RuntimeConfig)
    cfg = load_config(SCHEMA, None, ["model.tiny=gpt2"])
    assert type(cfg.server) is CriticServerConfig and cfg.server == CriticServerConfig()
    assert type(cfg.train) is CriticTrainConfig and type(cfg.model) is ModelSourceConfig


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ([], "no model to serve: set model.path=<HF directory> or model.tiny=gpt2"),
        (["model.tiny=gpt2", "reward_model.path=/x"], "reward_model.path='/x' does not exist"),
        (["model.tiny=gpt2", "server.port=70000"], "server.port must be in 0..65535"),
        (["model.tiny=gpt2", "runtime.reward_std=1.0"], "both runtime.reward_mean and runtime.reward_std"),
        (["model.tiny=gpt2", "optim.scheduler=step"], "optim.scheduler must be one of"),
        (["model.tiny=gpt2", "checkpoint.resume_step=3"], "checkpoint.resume_step needs checkpoint.dir"),
        (["model.tiny=gpt2", "train.loss_clip_val=-1"], "train.loss_clip_val"),
        (["model.tiny=gpt2", "train.global_batch_size=0"], "train.global_batch_size must be >= 1"),
        (["model.tiny=gpt2", "optim.min_lr=1.0"], "optim.min_lr"),
        (["model.tiny=gpt2", "server.max_request_bytes=0"], "server.max_request_bytes must be >= 1"),
        (["model.tiny=gpt2", "server.max_train_rows=0"], "server.max_train_rows must be >= 1"),
        (["model.tiny=gpt2", "server.model_forward_micro_batch_size=0"], "server.model_forward_micro"),
        (["model.tiny=true"], "model.tiny=true is now model.tiny=gpt2"),
        (["model.seed=0"], "model.seed is now model.tiny_seed"),
        (["model.tokenizer_path=/tok"], "model.tokenizer_path is now tokenizer.path"),
        (["model.tiny=gpt2", "parallel.strategy=zero3"], "parallel.strategy='zero3' is not one of ddp, fsdp"),
        (["model.tiny=gpt2", "parallel.offload=true"], "parallel.offload=true offloads shards, which needs"),
        (
            ["model.tiny=gpt2", "parallel.strategy=fsdp", "parallel.offload_init_policy=true"],
            "unknown key 'parallel.offload_init_policy'",
        ),
        (
            ["model.tiny=gpt2", "parallel.strategy=fsdp", "runtime.precision=fp16-mixed"],
            "runtime.precision=fp16-mixed with parallel.strategy=fsdp is not supported",
        ),
    ],
)
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(SCHEMA, YAML, overrides)


def test_critic_schedule_needs_its_length():
    with pytest.raises(ConfigError, match=r"optim\.decay_steps"):
        load_config(SCHEMA, YAML, ["model.tiny=gpt2", "optim.decay_steps=null"])
    cfg = load_config(SCHEMA, YAML, ["model.tiny=gpt2", "optim.decay_steps=null", "optim.scheduler=constant"])
    assert cfg.optim.decay_steps is None


def test_a_tiny_critic_takes_no_reward_model_path(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"model\.tiny serves the tiny reward model too; unset"):
        load_config(SCHEMA, None, ["model.tiny=gpt2", f"reward_model.path={tmp_path}"])


def test_the_tiny_critic_and_reward_model_are_the_seeded_tiny_gpt2_of_before():
    cfg = load_config(SCHEMA, None, ["model.tiny=gpt2"])
    critic, reward_model, tokenizer = serve_critic.load_models(cfg, CPU, FP32, LOG)
    char = build_char_tokenizer()
    assert tokenizer is not None and tokenizer.get_vocab() == char.get_vocab()
    expected = build_tiny_sequence_classifier("gpt2", TinySize(len(char), 64, 2, 4), seed=0).state_dict()
    for model in (critic, reward_model):
        served = model.hf_model.state_dict()
        assert served.keys() == expected.keys() and all(torch.equal(served[k], expected[k]) for k in expected)
    assert critic.hf_model is not reward_model.hf_model  # the critic trains; the reward model must not move
    assert all(p.requires_grad for p in critic.parameters())
    assert not any(p.requires_grad for p in reward_model.parameters())
    values_only = dataclasses.replace(cfg, server=CriticServerConfig(combine_rm_and_critic_server=False))
    assert serve_critic.load_models(values_only, CPU, FP32, LOG)[1] is None


def test_request_body_limit_default_is_the_servers():
    from openaligner.servers.transport.http_guard import DEFAULT_MAX_REQUEST_BYTES

    assert CriticServerConfig().max_request_bytes == DEFAULT_MAX_REQUEST_BYTES


def test_a_tokenizer_lent_to_a_model_trained_with_another_is_warned_of(tmp_path, tiny, caplog):
    """The ids fit the critic's embeddings, but they were learnt for other tokens."""
    from openaligner.models.tokenizers import build_word_tokenizer

    tiny.critic().hf_model.save_pretrained(str(tmp_path / "rm"))
    tiny.tokenizer.save_pretrained(str(tmp_path / "rm"))  # the reward model's own: the char tokenizer
    build_word_tokenizer([f"w{i}" for i in range(96)]).save_pretrained(
        str(tmp_path / "policy")
    )  # 100 ids too
    tiny.tokenizer.save_pretrained(str(tmp_path / "same"))
    overrides = [f"model.path={tmp_path / 'rm'}", "server.combine_rm_and_critic_server=false"]
    with caplog.at_level(logging.WARNING, logger="test"):
        cfg = load_config(SCHEMA, None, [*overrides, f"tokenizer.path={tmp_path / 'same'}"])
        serve_critic.load_models(cfg, CPU, FP32, LOG)
        assert not caplog.records  # the same vocabulary, from another directory
        cfg = load_config(SCHEMA, None, [*overrides, f"tokenizer.path={tmp_path / 'policy'}"])
        serve_critic.load_models(cfg, CPU, FP32, LOG)
    (record,) = caplog.records
    assert "not the tokenizer model.path=" in record.getMessage()
    assert "serve-critic model.path=<the policy's SFT directory>" in record.getMessage()
