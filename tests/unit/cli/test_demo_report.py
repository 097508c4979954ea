"""The demo's report without running the demo: report.md / report.json contents, metrics lookup."""

from __future__ import annotations

import json

import pytest

from openaligner.cli.demo import report
from openaligner.cli.demo.presets import Variant


def test_report_files_hold_the_evaluation_the_gain_and_the_stage_times(tmp_path):
    metrics = {"gold": 40.0, "gold_greedy": 60.0, "rm_score": 0.1, "kl_to_sft": 0.0}
    metrics |= {"response_tokens": 6.0, "properly_ended": 1.0}
    evaluation = {"sft": metrics, "ppo": {**metrics, "gold": 55.5, "kl_to_sft": 3.0}}
    seconds = {"sft": 1.0, "total": 2.0}
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "val/accuracy": 0.5}\n{"step": 2, "loss": 1}\n')
    rm_metrics = report.last_metrics(tmp_path / "metrics.jsonl", "val/")
    assert rm_metrics == {"val/accuracy": 0.5}
    assert report.plot_ppo_curves(tmp_path / "missing.jsonl", tmp_path / "plot.png", Variant()) is None

    (tmp_path / "ppo.jsonl").write_text(
        '{"step": 1, "rollout/score": 40.0}\n{"step": 2, "rollout/score": 45.0}\n'
    )
    report.write_report(
        tmp_path, Variant(), evaluation, rm_metrics, seconds, None, "Seed 0.", tmp_path / "ppo.jsonl"
    )
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved == {
        "algorithm": "ppo",
        "reward": "model",
        "rollout_engine": "hf",
        "eval": evaluation,
        "rm": rm_metrics,
        "seconds": seconds,
        "rollout_score": [[1, 40.0], [2, 45.0]],
    }
    text = (tmp_path / "report.md").read_text()
    assert "Algorithm: **ppo** (trainer.advantage_estimator=gae); reward: **model**" in text
    assert "Gold-score gain: **+15.5 points** (sampled)." in text
    assert "Reward model on held-out pairs: accuracy 0.500" in text
    assert "| reward-model score |" in text
    assert report.gold_gain(evaluation) == pytest.approx(15.5)


def test_a_critic_free_run_against_the_gold_scorer_is_reported_under_its_own_names(tmp_path):
    metrics = {"gold": 40.0, "gold_greedy": 60.0, "rm_score": 40.0, "kl_to_sft": 0.0}
    metrics |= {"response_tokens": 6.0, "properly_ended": 1.0}
    evaluation = {"sft": metrics, "ppo": {**metrics, "gold": 80.0}}
    variant = Variant("grpo", "gold")
    report.write_report(tmp_path, variant, evaluation, {}, {"ppo": 1.0}, None, "Seed 0.", tmp_path / "none")
    assert not (tmp_path / "report.md").exists()  # the original run's report is left alone
    text = (tmp_path / "report-grpo-gold.md").read_text()
    assert "Algorithm: **grpo** (trainer.advantage_estimator=grpo); reward: **gold**" in text
    assert "| metric | SFT policy | GRPO policy |" in text
    # the reward server's score is the gold function's, and no reward model was trained
    assert "| gold function reward (0–1) |" in text
    assert "No reward model" in text and "train-rm" not in text and "serve-critic" not in text
    saved = json.loads((tmp_path / "report-grpo-gold.json").read_text())
    assert (saved["algorithm"], saved["reward"], saved["rollout_score"]) == ("grpo", "gold", [])
