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
import torch
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
    return json.loads(out.read_text()) | {"pt": out.with_suffix(".pt")}


def assert_adamw_step_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Weights after one AdamW step taken from the same state on gradients that differ in their
    last bits (1 process vs 2 ranks). AdamW's update lr · m̂ / (√v̂ + ε) is then equal to within
    lr × the gradients' relative rounding (≤ 1e-6 × lr = 2e-8) for every coordinate with a real
    gradient: atol 1e-6 (measured ≤ 1.2e-7, the weights' own rounding). GPT-2's attention key
    biases have a gradient of exactly zero in exact arithmetic (a key bias adds the same q·b to
    every score of a query, which softmax ignores), so their gradient is pure rounding noise whose
    AdamW step may be anything up to lr = 0.02 (measured 8e-6): they are held to that bound."""
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        got = actual[name]
        if name.endswith("attn.c_attn.bias"):  # [q | k | v] biases of a GPT-2 block
            (q, k, v), (q0, k0, v0) = got.chunk(3), tensor.chunk(3)
            torch.testing.assert_close(k, k0, rtol=0, atol=0.02, msg=name)
            got, tensor = torch.cat([q, v]), torch.cat([q0, v0])
        torch.testing.assert_close(got, tensor, rtol=0, atol=1e-6, msg=name)


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
    compared element by element (:func:`assert_adamw_step_close`)."""
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
    assert_adamw_step_close(torch.load(one["pt"]), torch.load(reference["pt"]))
    assert one["betas"][0] == pytest.approx(reference["betas"][0], rel=1e-6)
    # the final actor every sharded rank exported (rank 0 wrote it) holds the trained weights
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "actor").state_dict()
    assert {k: float(v.double().sum()) for k, v in exported.items()} == reference["weights"]
    assert (tmp_path / "one" / "step_2" / "actor").is_dir()  # 1 process shards nothing: a whole checkpoint


@pytest.mark.slow
def test_a_sharded_critic_free_run_checkpoints_without_a_critic(tmp_path):
    """Without a critic (grpo) the trainer asks no client to save one: each rank writes its shards
    and the published checkpoint records no critic step."""
    run_worker(tmp_path / "grpo.json", 2, tmp_path / "ckpt", steps=1, ESTIMATOR="grpo")
    assert (tmp_path / "ckpt" / "step_1" / "actor.dcp").is_dir()
    state = json.loads((tmp_path / "ckpt" / "step_1" / "trainer_state.json").read_text())
    assert state["critic_step"] is None and state["step"] == 1
