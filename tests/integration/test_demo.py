"""`openaligner demo quick=true`: the whole pipeline as a user runs it, in CI size."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


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


def test_quick_demo_improves_the_gold_score_and_cleans_up(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "openaligner", "demo", "quick=true", f"output_dir={out}"],
        capture_output=True,
        text=True,
        timeout=900,
    )
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
