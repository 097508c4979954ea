"""Two data-parallel ranks (torchrun, gloo) equal one process on the same global batch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("ppo_dp_worker.py")


@pytest.mark.slow
def test_two_ranks_match_one_rank(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    subprocess.run([sys.executable, str(WORKER), str(one)], check=True, timeout=300)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(WORKER),
            str(two),
        ],
        check=True,
        timeout=300,
    )
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert len(a["history"]) == len(b["history"]) == 2
    for m1, m2 in zip(a["history"], b["history"], strict=True):
        for key in (
            "rollout/rewards",
            "rollout/init_policy_kl",
            "rollout/advantages_std",
            "rollout/values_mean",
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
