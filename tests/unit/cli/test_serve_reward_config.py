"""configs/serve_reward.yaml documents every key of the serve-reward schema, and loads; the schema's
sections are the server's, the models' and the shared runtime's own dataclasses."""

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from openaligner.cli.serve_reward import SCHEMA, ServeRewardConfig, load_model
from openaligner.cli.serving import RuntimeConfig
from openaligner.config import ConfigError, load_config
from openaligner.models.builders import TinySize, build_tiny_sequence_classifier
from openaligner.models.precision import Precision
from openaligner.models.source import ModelSourceConfig, TokenizerSourceConfig
from openaligner.models.tokenizers import build_char_tokenizer
from openaligner.servers.reward import RewardServerConfig

YAML = Path(__file__).resolve().parents[3] / "configs" / "serve_reward.yaml"
CPU = torch.device("cpu")
FP32 = Precision.resolve("fp32", CPU)
LOG = logging.getLogger("test")


def test_reference_yaml_loads_with_a_model_choice():
    cfg = load_config(
        SCHEMA, YAML, ["model.tiny=gpt2", "server.port=6000", "server.inference_micro_batch_size=[2,8]"]
    )
    assert isinstance(cfg, ServeRewardConfig)
    assert cfg.server.port == 6000 and cfg.server.inference_micro_batch_size == [2, 8]
    assert cfg.server.host == "127.0.0.1" and cfg.server.model_name == "reward_model"


def test_sections_are_the_components_own_configs_not_copies():
    types = {f.name: f.type for f in dataclasses.fields(ServeRewardConfig)}
    assert types["server"] in ("RewardServerConfig", RewardServerConfig)
    assert types["model"] in ("ModelSourceConfig", ModelSourceConfig)
    assert types["tokenizer"] in ("TokenizerSourceConfig", TokenizerSourceConfig)
    assert types["runtime"] in ("RuntimeConfig", RuntimeConfig)
    cfg = load_config(SCHEMA, None, ["model.tiny=gpt2"])
    assert type(cfg.server) is RewardServerConfig and type(cfg.model) is ModelSourceConfig
    assert type(cfg.runtime) is RuntimeConfig and cfg.server == RewardServerConfig()


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ([], "no model to serve: set model.path=<HF directory> or model.tiny=gpt2"),
        (["model.tiny=null"], "no model to serve"),
        (["model.tiny=gpt2", "model.path=/x"], "model.path='/x' does not exist"),
        (["model.tiny=gpt2", "server.port=70000"], "server.port must be in 0..65535"),
        (["model.tiny=gpt2", "runtime.precision=int8"], "runtime.precision must be one of"),
        (["model.tiny=gpt2", "runtime.reward_mean=1.0"], "both runtime.reward_mean and runtime.reward_std"),
        (["model.tiny=gpt2", "server.inference_micro_batch_size=[0]"], "server.inference_micro_batch_size"),
        (["model.tiny=gpt2", "server.max_request_bytes=0"], "server.max_request_bytes must be >= 1"),
        (["model.tiny=gpt2", "server.heartbeat_s=0"], "server.heartbeat_s must be > 0"),
        (["model.tiny=bert"], "model.tiny must be one of"),
        (["reward.function=m:f", "reward.workers=0"], "reward.workers must be >= 1, e.g. 8; got 0"),
        (["model.tiny=gpt2", "parallel.strategy=zero3"], "parallel.strategy='zero3' is not one of ddp, fsdp"),
        (
            ["model.tiny=gpt2", "parallel.strategy=fsdp", "parallel.offload_init_policy=true"],
            "unknown key 'parallel.offload_init_policy'",
        ),
    ],
)
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("[", r"\[")):
        load_config(SCHEMA, YAML, overrides)


def test_both_a_path_and_a_tiny_model_are_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"set one of model\.path and model\.tiny, not both"):
        load_config(SCHEMA, None, [f"model.path={tmp_path}", "model.tiny=gpt2"])


@pytest.mark.parametrize(
    "old,message",
    [
        ("model.tiny=true", "model.tiny=true is now model.tiny=gpt2"),
        ("model.tiny=false", "model.tiny=false is now the default"),
        ("model.seed=3", "model.seed is now model.tiny_seed"),
        ("model.tokenizer_path=/tok", "model.tokenizer_path is now tokenizer.path"),
        ("model.device=cpu", "model.device is now runtime.device"),
        ("model.precision=fp32", "model.precision is now runtime.precision"),
        ("model.reward_mean=0.0", "model.reward_mean is now runtime.reward_mean"),
        ("model.reward_std=1.0", "model.reward_std is now runtime.reward_std"),
    ],
)
def test_old_keys_are_refused_naming_the_new_ones(old, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(SCHEMA, None, [old])


def test_old_keys_in_a_config_file_are_refused_too(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("model:\n  tiny: true\n  seed: 0\n")
    with pytest.raises(ConfigError, match="is now"):
        load_config(SCHEMA, path)


def test_the_tiny_model_served_is_the_seeded_tiny_gpt2_of_before():
    cfg = load_config(SCHEMA, None, ["model.tiny=gpt2"])
    model, tokenizer = load_model(cfg, CPU, FP32, LOG)
    char = build_char_tokenizer()
    assert tokenizer is not None and tokenizer.get_vocab() == char.get_vocab()
    before = build_tiny_sequence_classifier("gpt2", TinySize(len(char), 64, 2, 4), seed=0)
    assert model.hf_model.config.n_positions == before.config.n_positions
    served, expected = model.hf_model.state_dict(), before.state_dict()
    assert served.keys() == expected.keys()
    assert all(torch.equal(served[k], expected[k]) for k in expected)
    assert not any(p.requires_grad for p in model.parameters())
    other, _ = load_model(load_config(SCHEMA, None, ["model.tiny=gpt2", "model.tiny_seed=1"]), CPU, FP32, LOG)
    assert not torch.equal(other.hf_model.score.weight, expected["score.weight"])


def test_a_model_directory_without_a_tokenizer_serves_tokens_only(tmp_path, tiny, caplog):
    tiny.reward_model().save_pretrained(str(tmp_path / "rm"))
    cfg = load_config(SCHEMA, None, [f"model.path={tmp_path / 'rm'}"])
    with caplog.at_level(logging.INFO, logger="test"):
        _, tokenizer = load_model(cfg, CPU, FP32, LOG)
    assert tokenizer is None and "`sentences` requests will be refused" in caplog.text
    tiny.tokenizer.save_pretrained(str(tmp_path / "tok"))
    with_tokenizer = dataclasses.replace(cfg, tokenizer=TokenizerSourceConfig(path=str(tmp_path / "tok")))
    assert load_model(with_tokenizer, CPU, FP32, LOG)[1] is not None
    broken = dataclasses.replace(cfg, tokenizer=TokenizerSourceConfig(path=str(tmp_path)))  # no tokenizer
    with pytest.raises((OSError, ValueError)):
        load_model(broken, CPU, FP32, LOG)


def test_request_body_limit_default_is_the_servers():
    from openaligner.servers.transport.http_guard import DEFAULT_MAX_REQUEST_BYTES

    assert RewardServerConfig().max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
