"""benchmarks/bench_real_engines.py: it runs section 4's commands of docs/real-model.md as written,
changing only what it says it changes (the model, the prompts' paths, the port, the step count,
the output directory and the engine), and reports the medians of the runs' step timings."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_real_engines import (
    DOC,
    engine_settings,
    section_four_commands,
    summarise,
    table,
    with_settings,
)
from openaligner.cli import serve_reward, train_ppo
from openaligner.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_engines_run_section_fours_grpo_command_with_only_the_named_changes(tmp_path):
    serve, train = section_four_commands(DOC.read_text())
    assert serve[:3] == ["openaligner", "serve-reward", "configs/serve_reward.yaml"]
    assert not any(a.startswith((">", "2>")) or a == "&" for a in serve)  # redirections dropped
    model = tmp_path / "gemma"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gemma3_text"}')
    data = {"train": tmp_path / "train.jsonl", "heldout": tmp_path / "heldout.jsonl"}
    for engine in ("hf", "vllm"):
        settings = engine_settings(engine, model, data, tmp_path, 6123, 5, "/venv/bin/python")
        argv = with_settings(train, settings)
        changed = [a for a in argv if a not in train]
        assert {a.split("=", 1)[0] for a in changed} == set(settings)  # nothing else differs
        assert len(argv) == len(train) + sum(k not in " ".join(train) for k in settings)
        cfg = load_config(train_ppo.SCHEMA, str(ROOT / argv[2]), argv[3:])
        assert cfg.trainer.advantage_estimator == "grpo" and cfg.lora.r == 16  # the walkthrough's run
        assert cfg.trainer.sampling.end_strings == ["\n"] and cfg.trainer.length.max_length == 24
        assert cfg.trainer.max_steps == 5 and cfg.rollout.engine == engine
        assert cfg.actor.path == str(model) and cfg.remote.reward_model.port == 6123
        assert cfg.exp.output_dir == str(tmp_path / engine)
        assert (cfg.rollout.vllm.python == "/venv/bin/python") == (engine == "vllm")
    served = load_config(
        serve_reward.SCHEMA, str(ROOT / serve[2]), with_settings(serve, {"server.port": "7"})[3:]
    )
    assert served.server.port == 7 and served.reward.function.endswith("reverse_text:gold_reward")


def test_the_summary_is_the_median_of_each_timing_over_the_step_rows(tmp_path):
    rows = [
        {"step": 1, "timing/step_s": 9.0, "timing/generate_s": 4.0, "timing/weight_sync_s": 2.0},
        {"step": 1, "val/score": 0.3},  # a validation row: no step timing, not counted
        {"step": 2, "timing/step_s": 7.0, "timing/generate_s": 2.0, "timing/weight_sync_s": 1.0},
        {"step": 3, "timing/step_s": 8.0, "timing/generate_s": 3.0, "timing/weight_sync_s": 3.0},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarise(metrics)
    assert s["steps"] == 3 and s["timing/step_s"] == 8.0 and s["timing/generate_s"] == 3.0
    assert (s["weight_push_min"], s["timing/weight_sync_s"], s["weight_push_max"]) == (1.0, 2.0, 3.0)
    assert "timing/train_s" not in s
    md = table({"vllm": {**s, "wall_s": 136.0, "peak_rss_gib": 5.6}})
    assert "| `vllm` | 8.0 s | 3.0 s | — |" in md and "136 s | 5.6 GiB |" in md
