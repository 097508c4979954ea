"""configs/serve_critic.yaml documents every key of the serve-critic schema with its default, and loads."""

from pathlib import Path

import pytest

from openaligner.cli.main import COMMANDS
from openaligner.cli.serve_critic import SCHEMA, ServeCriticConfig
from openaligner.config import ConfigError, load_config

YAML = Path(__file__).resolve().parents[3] / "configs" / "serve_critic.yaml"


def test_registered_and_loads_with_overrides():
    assert COMMANDS["serve-critic"][0] == "openaligner.cli.serve_critic"
    cfg = load_config(
        SCHEMA,
        YAML,
        [
            "model.path=/m",
            "server.port=6000",
            "server.combine_rm_and_critic_server=false",
            "train.micro_batch_size=2",
        ],
    )
    assert isinstance(cfg, ServeCriticConfig)
    assert cfg.server.port == 6000 and not cfg.server.combine_rm_and_critic_server
    assert (
        cfg.train.micro_batch_size == 2 and cfg.train.loss_clip_val == 0.2 and cfg.reward_model.path is None
    )


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ([], "exactly one of model.path"),
        (["model.tiny=true", "reward_model.path=/x"], "unset reward_model.path"),
        (["model.tiny=true", "server.port=70000"], "server.port must be in 1..65535"),
        (["model.tiny=true", "model.reward_std=1.0"], "both model.reward_mean and model.reward_std"),
        (["model.tiny=true", "optim.scheduler=step"], "optim.scheduler must be one of"),
        (["model.tiny=true", "checkpoint.resume_step=3"], "checkpoint.resume_step needs checkpoint.dir"),
        (["model.tiny=true", "train.loss_clip_val=-1"], "train.loss_clip_val"),
        (["model.tiny=true", "optim.min_lr=1.0"], "optim.min_lr"),
        (["model.tiny=true", "server.max_request_bytes=0"], "server.max_request_bytes must be >= 1"),
    ],
)
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(SCHEMA, YAML, overrides)


def test_critic_schedule_needs_its_length():
    with pytest.raises(ConfigError, match=r"optim\.decay_steps"):
        load_config(SCHEMA, YAML, ["model.tiny=true", "optim.decay_steps=null"])
    cfg = load_config(SCHEMA, YAML, ["model.tiny=true", "optim.decay_steps=null", "optim.scheduler=constant"])
    assert cfg.optim.decay_steps is None


def test_request_body_limit_default_is_the_servers():
    from openaligner.cli.serve_critic import CriticServerSettings as settings
    from openaligner.servers.transport.http_guard import DEFAULT_MAX_REQUEST_BYTES

    assert settings().max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
