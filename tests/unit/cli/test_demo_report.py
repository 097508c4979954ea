"""The demo's report without running the demo: report.md / report.json contents, metrics lookup."""

from __future__ import annotations

import json

import pytest

from openaligner.cli.demo import report


def test_report_files_hold_the_evaluation_the_gain_and_the_stage_times(tmp_path):
    metrics = {"gold": 40.0, "gold_greedy": 60.0, "rm_score": 0.1, "kl_to_sft": 0.0}
    metrics |= {"response_tokens": 6.0, "properly_ended": 1.0}
    evaluation = {"sft": metrics, "ppo": {**metrics, "gold": 55.5, "kl_to_sft": 3.0}}
    seconds = {"sft": 1.0, "total": 2.0}
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "val/accuracy": 0.5}\n{"step": 2, "loss": 1}\n')
    rm_metrics = report.last_metrics(tmp_path / "metrics.jsonl", "val/")
    assert rm_metrics == {"val/accuracy": 0.5}
    assert report.plot_ppo_curves(tmp_path / "missing.jsonl", tmp_path / "plot.png") is None

    report.write_report(tmp_path, evaluation, rm_metrics, seconds, None, "Seed 0.")
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved == {"eval": evaluation, "rm": rm_metrics, "seconds": seconds}
    text = (tmp_path / "report.md").read_text()
    assert "Gold-score gain: **+15.5 points** (sampled)." in text
    assert "Reward model on held-out pairs: accuracy 0.500" in text
    assert report.gold_gain(evaluation) == pytest.approx(15.5)
