"""benchmarks/gpu_check.py in its dry mode (the CPU, tiny models), end to end: the one-GPU check
script runs the commands it checks, so a change that breaks one of them, or the script, fails
here instead of on the next lent GPU. Heavy tier: ~2 min on the 2-core machine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check import CHECKS  # noqa: E402


def test_the_dry_mode_runs_every_check_and_reports_it(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    result = json.loads((out / "gpu_check.json").read_text())
    checks = {c["name"]: c for c in result["checks"]}
    failed = {n: c["error"] for n, c in checks.items() if c["status"] == "failed"}
    assert done.returncode == 0 and not failed, (failed, done.stdout[-3000:], done.stderr[-3000:])
    assert result["mode"] == "dry"
    assert [c["name"] for c in result["checks"]] == list(CHECKS)
    for c in checks.values():
        assert c["status"] in ("ok", "skipped"), c
        assert c["status"] == "ok" or c["reason"], c  # a skip says why
        assert c["seconds"] >= 0
    # what the dry mode must run, not skip
    ran = {"train_sft", "train_rm", "serve_critic_train", "train_ppo", "nccl_fsdp", "ppo_hf"}
    assert {n for n, c in checks.items() if c["status"] == "ok"} >= ran
    assert checks["gpu_tests"]["status"] == "skipped" and "CUDA" in checks["gpu_tests"]["reason"]
    assert checks["nccl_fsdp"]["details"]["backend"] == "gloo"
    assert checks["nccl_fsdp"]["details"]["world_size"] == 1
    assert checks["serve_critic_train"]["details"]["critic_step"] >= 1
    ppo = checks["ppo_hf"]["details"]
    assert ppo["step"] == 2 and ppo["engine"] == "hf"
    assert ppo["rollout_tokens_per_s"] > 0 and 0 < ppo["actor_update_mfu"] < 1
    assert ppo["peak_gpu_bytes"] is None  # no GPU
    table = (out / "gpu_check.md").read_text()
    assert all(f"| {name} |" in table for name in CHECKS)
    assert "| hf | tiny |" in table
