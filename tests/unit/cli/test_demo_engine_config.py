"""The demo's ``rollout_engine`` and ``model_heads`` without running it: the vllm engine gets tiny
models it can serve (head size 32, not 16), train-ppo is asked for it, its RL stage writes beside
the hf one's, and the default (hf) demo's stage settings are what they were before the key existed.
"""

from __future__ import annotations

import pytest

from openaligner.cli.demo import DemoConfig
from openaligner.cli.demo.presets import Variant, ppo_overrides, sft_overrides
from openaligner.cli.main import main
from openaligner.config import ConfigError, load_config
from openaligner.trainer.ppo_config import TrainPPOConfig


def _heads(overrides: list[str]) -> int:
    (heads,) = [o.split("=")[1] for o in overrides if o.startswith("model.tiny_num_heads=")]
    return int(heads)


def test_the_default_demo_keeps_four_heads_and_trains_with_the_hf_engine(tmp_path):
    cfg = load_config(DemoConfig)
    assert (cfg.rollout_engine, cfg.heads, cfg.variant) == ("hf", 4, Variant("ppo", "model", "hf"))
    assert _heads(sft_overrides(tmp_path, 0, 10, cfg.heads)) == 4
    assert sft_overrides(tmp_path, 0, 10, cfg.heads) == sft_overrides(tmp_path, 0, 10)  # the old call
    ppo = ppo_overrides(tmp_path, 0, 10, "127.0.0.1", 2, 3, cfg.variant, 5e-4)
    assert not any(o.startswith("rollout.") for o in ppo)  # train-ppo's own default: the YAML is unchanged
    assert (cfg.variant.tag, cfg.variant.rl_dir) == ("", "ppo")


def test_the_vllm_engine_gets_head_size_32_and_its_own_rl_stage_directory(tmp_path):
    cfg = load_config(DemoConfig, None, ["rollout_engine=VLLM", "algorithm=grpo"])
    assert (cfg.rollout_engine, cfg.heads) == ("vllm", 2)  # 64 / 2 = 32: vLLM's CPU attention serves it
    variant = cfg.variant
    assert (variant.tag, variant.rl_dir) == ("-grpo-model-vllm", "ppo-grpo-model-vllm")
    assert Variant(engine="vllm").rl_dir == "ppo-vllm" and "vllm rollouts" in variant.title
    assert _heads(sft_overrides(tmp_path, 0, 10, cfg.heads)) == 2
    (tmp_path / "sft").mkdir()  # train-ppo's config refuses a missing actor or tokenizer
    (tmp_path / "sft" / "config.json").write_text("{}")
    (tmp_path / "tokenizer").mkdir()
    ppo = load_config(
        TrainPPOConfig, None, ppo_overrides(tmp_path, 0, 10, "127.0.0.1", None, 3, variant, 5e-4)
    )
    assert ppo.rollout.engine == "vllm" and ppo.rollout.vllm.python == ".venv-rollout/bin/python"
    own = Variant("ppo", "model", "vllm", "/opt/rollout/bin/python")
    own_ppo = load_config(TrainPPOConfig, None, ppo_overrides(tmp_path, 0, 10, "127.0.0.1", 2, 3, own, 5e-4))
    assert own_ppo.rollout.vllm.python == "/opt/rollout/bin/python"
    assert ppo.exp.output_dir == str(tmp_path / "ppo-grpo-model-vllm")
    # hf on the vllm run's models (the comparison of engines on one SFT and reward model)
    same = load_config(DemoConfig, None, ["model_heads=2"])
    assert same.heads == 2 and same.variant.rl_dir == "ppo"
    assert sft_overrides(tmp_path, 0, 10, same.heads) == sft_overrides(tmp_path, 0, 10, cfg.heads)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout_engine=sglang"], "rollout_engine must be one of hf, vllm"),
        (["rollout_engine=vllm", "model_heads=4"], "model_heads=4 is head size 16"),
        (["model_heads=3"], "model_heads must be 0"),
    ],
)
def test_an_engine_or_head_count_that_cannot_run_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DemoConfig, None, overrides)


def test_the_command_line_refuses_vllm_with_four_heads_exit_2(capsys):
    assert main(["demo", "rollout_engine=vllm", "model_heads=4", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "model_heads=2" in err and len(err.strip().splitlines()) == 1


def test_a_missing_engine_interpreter_is_refused_before_any_stage_runs(tmp_path, capsys):
    out = tmp_path / "demo"
    missing = tmp_path / "no-venv" / "bin" / "python"
    assert main(["demo", "rollout_engine=vllm", f"rollout_python={missing}", f"output_dir={out}"]) == 2
    assert "make rollout-setup" in capsys.readouterr().out
    assert not out.exists()  # no data, no SFT: refused first
