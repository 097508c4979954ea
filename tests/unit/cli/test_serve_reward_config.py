"""configs/serve_reward.yaml documents every key of the serve-reward schema, and loads."""

from pathlib import Path

import pytest

from openaligner.cli.serve_reward import SCHEMA, ServeRewardConfig
from openaligner.config import ConfigError, load_config

YAML = Path(__file__).resolve().parents[3] / "configs" / "serve_reward.yaml"


def test_reference_yaml_loads_with_a_model_choice():
    cfg = load_config(
        SCHEMA, YAML, ["model.tiny=true", "server.port=6000", "server.inference_micro_batch_size=[2,8]"]
    )
    assert isinstance(cfg, ServeRewardConfig)
    assert cfg.server.port == 6000 and cfg.server.inference_micro_batch_size == [2, 8]
    assert cfg.server.host == "127.0.0.1" and cfg.server.model_name == "reward_model"


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ([], "exactly one of model.path"),
        (["model.tiny=true", "model.path=/x"], "exactly one of model.path"),
        (["model.tiny=true", "server.port=70000"], "server.port must be in 1..65535"),
        (["model.tiny=true", "model.precision=int8"], "model.precision must be one of"),
        (["model.tiny=true", "model.reward_mean=1.0"], "both model.reward_mean and model.reward_std"),
        (["model.tiny=true", "server.inference_micro_batch_size=[0]"], "inference_micro_batch_size"),
        (["model.tiny=true", "server.max_request_bytes=0"], "server.max_request_bytes must be >= 1"),
    ],
)
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(SCHEMA, YAML, overrides)


def test_request_body_limit_default_is_the_servers():
    from openaligner.cli.serve_reward import RewardServerSettings as settings
    from openaligner.servers.transport.http_guard import DEFAULT_MAX_REQUEST_BYTES

    assert settings().max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
