"""The messages a newcomer meets first point the right way: each names the key as it is written
and what to do (issue 31, item 5)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from openaligner.cli.main import main
from openaligner.clients.critic import RemoteCriticConfig, RemoteGPTRMCriticClient
from openaligner.clients.errors import ServerTimeoutError
from openaligner.clients.reward_only import RemoteRewardOnlyClient
from openaligner.config import ConfigError, load_config
from openaligner.trainer.ppo_config import TrainPPOConfig
from openaligner.trainer.sft import SFTConfig

DATA = ["data.train_path=x.jsonl"]


@pytest.mark.parametrize(
    ("override", "meant"),
    [
        ("lr=1e-4", "optim.lr"),
        ("max_steps=3", "trainer.max_steps"),
        ("learning_rate=1e-4", "optim.lr"),  # the transformers / TRL name
        ("trainer.max_step=3", "trainer.max_steps"),
    ],
)
def test_an_unknown_key_names_the_dotted_key_it_may_mean(override, meant):
    with pytest.raises(ConfigError) as info:
        load_config(SFTConfig, overrides=[*DATA, override])
    message = str(info.value)
    assert f"unknown key '{override.split('=')[0]}'" in message and f"did you mean {meant}" in message
    assert "lora" not in message


def test_an_unknown_key_in_a_config_file_says_which_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("init_timeout_s: 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(TrainPPOConfig, path)
    assert f"unknown key 'init_timeout_s' (in {path}); did you mean remote.init_timeout_s" in str(info.value)


def test_dashed_overrides_are_read_as_key_value(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    assert main(["train-sft", f"--data.train_path={data}", "--trainer.max_steps=3", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert f"train_path: {data}" in out and "max_steps: 3" in out


def test_a_dashed_key_without_a_value_says_how_keys_are_written(capsys):
    assert main(["train-sft", "--data.train_path", "x.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "settings are written key=value, e.g. data.train_path=VALUE" in err
    assert len(err.strip().splitlines()) == 1


def test_version(capsys):
    from openaligner import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"openaligner {__version__}"


def test_a_missing_model_path_does_not_exist(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.path='.*nowhere' does not exist"):
        load_config(SFTConfig, overrides=[*DATA, f"model.path={tmp_path / 'nowhere'}"])
    (tmp_path / "weights.gguf").write_text("")
    with pytest.raises(ConfigError, match=r"is a file, not a Hugging Face model directory"):
        load_config(SFTConfig, overrides=[*DATA, f"model.path={tmp_path / 'weights.gguf'}"])
    with pytest.raises(ConfigError, match=r"not a Hugging Face model directory \(no config\.json\)"):
        load_config(SFTConfig, overrides=[*DATA, f"model.path={tmp_path}"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("client", [RemoteGPTRMCriticClient, RemoteRewardOnlyClient])
def test_servers_not_ready_names_train_ppo_keys_in_full(client):
    port = _free_port()  # nothing listens there
    cfg = RemoteCriticConfig(init_timeout_s=0.5)
    cfg.critic.port = cfg.reward_model.port = port
    with pytest.raises(ServerTimeoutError) as info, client(cfg):
        pass
    message = str(info.value)
    assert "remote.init_timeout_s=0.5" in message
    section = "remote.critic" if client is RemoteGPTRMCriticClient else "remote.reward_model"
    assert f"{section}.port" in message, message


@pytest.mark.parametrize(
    ("command", "record", "fixes"),
    [
        ("train-sft", {"question": "q", "answer": "a"}, "data.prompt_key=question data.response_key=answer"),
        ("train-sft", {"prompt": "q", "completion": "a"}, "data.response_key=completion"),
        ("train-rm", {"prompt": "q", "preferred": "a", "dispreferred": "b"}, "data.chosen_key=preferred"),
    ],
)
def test_a_record_with_other_field_names_suggests_the_keys_to_set(tmp_path, capsys, command, record, fixes):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(record) for _ in range(8)) + "\n")
    assert main([command, f"data.train_path={data}", f"output_dir={tmp_path / 'out'}", "device=cpu"]) == 2
    err = capsys.readouterr().err
    assert f"if the data names them differently, set {fixes}" in err, err
    assert not Path(tmp_path / "out").exists()
