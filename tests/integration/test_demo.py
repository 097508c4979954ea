"""`openaligner demo quick=true`: the whole pipeline as a user runs it, in CI size; then GRPO against
the gold scorer on the same run directory's SFT model (`reuse_models=true`)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# heavy tier (make test-heavy, CI's second step): minutes of whole-process runs, kept out of `make test`
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(args)
    return found


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "openaligner", "demo", "quick=true", *args],
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("demo") / "demo"
    return out, _demo(f"output_dir={out}")


def test_quick_demo_improves_the_gold_score_and_cleans_up(quick_demo):
    out, proc = quick_demo
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    sft, ppo = report["eval"]["sft"], report["eval"]["ppo"]
    # PPO against the learned reward model raises the gold score of held-out prompts
    assert ppo["gold"] > sft["gold"], report["eval"]
    assert ppo["rm_score"] > sft["rm_score"]
    assert 0 < ppo["kl_to_sft"] < 50
    for name in ("report.md", "ppo_curves.png", "configs/ppo.yaml", "configs/serve_critic.yaml", "sft", "rm"):
        assert (out / name).exists(), name
    assert "gold-score gain" in proc.stdout
    # the servers were stopped: no process still refers to this run's configs
    assert _processes_mentioning(str(out)) == []


def test_grpo_against_the_gold_scorer_reuses_the_sft_model_and_serves_no_critic(quick_demo):
    out, _ = quick_demo
    sft_weights = (out / "sft" / "model.safetensors").stat().st_mtime_ns
    proc = _demo(f"output_dir={out}", "algorithm=grpo", "reward=gold", "reuse_models=true", "ppo_steps=4")
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: no gain in 4 steps
    assert (out / "sft" / "model.safetensors").stat().st_mtime_ns == sft_weights  # not trained again
    report = json.loads((out / "report-grpo-gold.json").read_text())
    assert (report["algorithm"], report["reward"]) == ("grpo", "gold")
    assert [step for step, _ in report["rollout_score"]] == [1, 2, 3, 4]
    for policy in report["eval"].values():  # the served function scores as the gold scorer (0–1)
        assert policy["rm_score"] == pytest.approx(policy["gold"] / 100, abs=1e-5)
    assert "GRPO against the gold scorer" in (out / "report-grpo-gold.md").read_text()
    assert "algorithm grpo, reward gold" in proc.stdout
    assert not (out / "configs" / "serve_critic-grpo-gold.yaml").exists()  # no critic server
    assert (out / "report.md").exists()  # the PPO run's report is still there
    assert _processes_mentioning(str(out)) == []


def test_ctrl_c_during_ppo_stops_the_servers(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "openaligner", "demo", "quick=true", f"output_dir={out}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # wait until both servers answer and train-ppo is building its run
        seen.append(line)
        if "ppo_recipe: precision:" in line:  # logged by stage 5 (PPO) as it loads the actor
            break
    assert _processes_mentioning(str(out)), "".join(seen)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, rest[-2000:]
    assert "interrupted" in rest
    assert _processes_mentioning(str(out)) == []
