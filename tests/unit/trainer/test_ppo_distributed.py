"""Two data-parallel ranks (torchrun, gloo) equal one process on the same global batch, keep one
adaptive KL coefficient, and all stop at once when rank 0's critic request fails."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("ppo_dp_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.mark.slow
def test_two_ranks_match_one_rank(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    subprocess.run([sys.executable, str(WORKER), str(one)], check=True, timeout=300)
    subprocess.run([*TORCHRUN, str(WORKER), str(two)], check=True, timeout=300)
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert len(a["history"]) == len(b["history"]) == 2
    for m1, m2 in zip(a["history"], b["history"], strict=True):
        for key in (
            "rollout/rewards",
            "rollout/init_policy_kl",
            "rollout/advantages_std",
            "rollout/values_mean",
            "rollout/kl_coef",
            "rollout/sequence_kl",
            "policy/loss",
            "policy/ppo_ratio",
            "policy/grad_norm",
            "value/loss",
            "value/rows",
            "value/explained_variance",
        ):
            assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-5), key
    # the trained weights agree too (SGD, so any gradient difference would show)
    assert a["weights_sum"] == pytest.approx(b["weights_sum"], rel=1e-5)
    # and training happened: policy changed between the steps
    assert a["history"][1]["policy/ppo_ratio"] != 1.0
    # adaptive KL: every rank holds the same β, the one a single process computes
    assert b["betas"][0] == b["betas"][1]
    assert b["betas"][0] == pytest.approx(a["betas"][0], rel=1e-6)
    assert a["betas"][0] != 0.05  # and β did move


@pytest.mark.slow
def test_a_failed_critic_train_stops_every_rank_at_once(tmp_path):
    out = tmp_path / "fail.json"
    started = time.monotonic()
    # the second critic_train fails; without sharing the failure, rank 1 would wait in its next
    # collective for the 30-minute process-group timeout (the subprocess timeout fails the test)
    run = subprocess.run([*TORCHRUN, str(WORKER), str(out), "2"], timeout=240, capture_output=True)
    elapsed = time.monotonic() - started
    assert run.returncode != 0
    rank0 = json.loads(Path(f"{out}.rank0").read_text())
    rank1 = json.loads(Path(f"{out}.rank1").read_text())
    assert rank0["error"] == "CriticTrainFailed"
    assert rank1["error"] == "PeerFailedError"
    assert "rank 0's critic_train failed" in rank1["message"] and "400: bad request" in rank1["message"]
    assert rank1["after_s"] < 60 and elapsed < 200
