"""benchmarks/bench_demo_algorithms.py: the demo runs it asks for are the ones its options name (the
engines included), and every engine's runs of a seed share one set of models."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_demo_algorithms import demo_args, group_name, shared_model_heads, summarise
from openaligner.cli.demo import DemoConfig
from openaligner.cli.demo.presets import Variant
from openaligner.config import load_config


def test_the_default_runs_are_the_default_demo_with_the_hf_engine(tmp_path):
    heads = shared_model_heads(["hf"], 0)
    args = demo_args(tmp_path / "seed0", 0, Variant("grpo", "gold"), False, False, heads)
    cfg = load_config(DemoConfig, None, args)
    assert (cfg.rollout_engine, cfg.heads, cfg.algorithm, cfg.reward, cfg.seed) == (
        "hf",
        4,
        "grpo",
        "gold",
        0,
    )
    assert not any(a.startswith(("model_heads=", "rollout_python=")) for a in args)


def test_comparing_engines_gives_both_engines_the_same_two_head_models(tmp_path):
    heads = shared_model_heads(["hf", "vllm"], 0)
    configs = [
        load_config(
            DemoConfig,
            None,
            demo_args(tmp_path, 1, Variant("ppo", "model", engine, python), True, True, heads),
        )
        for engine, python in (("hf", ""), ("vllm", "/opt/rollout/bin/python"))
    ]
    hf, vllm = configs
    assert (hf.rollout_engine, vllm.rollout_engine) == ("hf", "vllm")
    assert hf.heads == vllm.heads == 2  # one seed's SFT and reward models serve both engines' runs
    assert vllm.rollout_python == "/opt/rollout/bin/python" and hf.quick and hf.reuse_models
    assert hf.variant.rl_dir != vllm.variant.rl_dir  # their RL stages write beside each other
    assert shared_model_heads(["vllm"], 1) == 1  # an explicit --model-heads wins


def test_each_engine_is_summarised_on_its_own():
    runs = [
        {
            "algorithm": "ppo",
            "reward": "model",
            "engine": engine,
            "seed": seed,
            "gold": gold,
            "steps_to_target": None,
        }
        for engine, seed, gold in (("hf", 0, 60.0), ("hf", 1, 70.0), ("vllm", 0, 50.0), ("vllm", 1, 52.0))
    ]
    summary = summarise(runs, ("gold",))
    assert summary["ppo/model"]["gold"]["mean"] == 65.0
    assert summary["ppo/model/vllm"]["gold"]["mean"] == 51.0
    assert group_name({"algorithm": "grpo", "reward": "gold"}) == "grpo/gold"  # records from before the key
