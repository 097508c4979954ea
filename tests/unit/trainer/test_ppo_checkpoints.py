"""Exact resume of PPO with a sharded actor (parallel.strategy=fsdp, 2 torchrun ranks, gloo): from
its own checkpoint on 2 ranks, and on 1 process (DCP reshards the checkpoint on load)
(ppo_dp_worker.py with CHECKPOINTS). The refusal of a checkpoint written without shards, and exact
reloads of the files alone, are test_sharded_files.py's."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

WORKER = Path(__file__).with_name("ppo_dp_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def run_worker(out: Path, ranks: int, checkpoints: Path, steps: int, **extra: str) -> dict:
    env = (
        os.environ
        | extra
        | {
            "STRATEGY": "fsdp",
            "OPTIM": "adamw",
            "CHECKPOINTS": str(checkpoints),
            "STEPS": str(steps),
        }
    )
    command = [*TORCHRUN, str(WORKER), str(out)] if ranks == 2 else [sys.executable, str(WORKER), str(out)]
    subprocess.run(command, check=True, timeout=300, env=env)
    return json.loads(out.read_text())


def first_checkpoint_only(source: Path, target: Path) -> Path:
    """``target`` holding a copy of ``source``'s step_1 alone (no ``latest``: the newest is found)."""
    shutil.copytree(source / "step_1", target / "step_1")
    return target


@pytest.mark.slow
def test_sharded_ppo_resumes_exactly_on_two_ranks_and_on_one_process(tmp_path):
    """2 steps uninterrupted on 2 sharded ranks against step 1's checkpoint resumed for step 2.

    On 2 ranks the resume is exact (no tolerance): the checkpoint holds the float32 shards, AdamW's
    moments and step, the LR schedule, the adaptive KL state and every rank's RNG, and the same
    ranks run the same float operations. On 1 process the same checkpoint resumes (DCP gathers the
    two ranks' shards) and step 2 differs only as 1 process differs from 2 ranks: float sums
    associated differently (measured: metrics rel 6e-7, tolerance rel 1e-5). The final weights are
    compared at abs 1e-4 (measured 3e-5): AdamW divides each gradient by its running RMS, so
    weights whose true gradient is 0 (the attention key biases, to which softmax is invariant)
    move by about the learning rate whatever their gradient's rounding noise is."""
    reference = run_worker(
        tmp_path / "ref.json", 2, tmp_path / "ref", steps=2, EXPORT=str(tmp_path / "actor")
    )
    assert (tmp_path / "ref" / "step_1" / "actor.dcp").is_dir()
    resumed = run_worker(
        tmp_path / "two.json", 2, first_checkpoint_only(tmp_path / "ref", tmp_path / "two"), 2
    )
    one = run_worker(tmp_path / "one.json", 1, first_checkpoint_only(tmp_path / "ref", tmp_path / "one"), 2)
    assert len(reference["history"]) == 2 and len(resumed["history"]) == len(one["history"]) == 1
    step2 = {k: v for k, v in reference["history"][1].items() if not k.startswith("timing/")}
    assert step2["policy/ppo_ratio"] != 1.0 and reference["betas"][0] != 0.05  # it trained; β moved
    assert {k: resumed["history"][0][k] for k in step2} == step2
    assert resumed["weights"] == reference["weights"] and resumed["betas"] == reference["betas"]
    for key, value in step2.items():
        assert one["history"][0][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for name, total in reference["weights"].items():
        assert one["weights"][name] == pytest.approx(total, rel=1e-5, abs=1e-4), name
    assert one["betas"][0] == pytest.approx(reference["betas"][0], rel=1e-6)
    # the final actor every sharded rank exported (rank 0 wrote it) holds the trained weights
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "actor").state_dict()
    assert {k: float(v.double().sum()) for k, v in exported.items()} == reference["weights"]
    assert (tmp_path / "one" / "step_2" / "actor").is_dir()  # 1 process shards nothing: a whole checkpoint
