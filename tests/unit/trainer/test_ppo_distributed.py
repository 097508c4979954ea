"""Two data-parallel ranks (torchrun, gloo) equal one process on the same global batch, with
replicas (ddp) and with shards (fsdp), keep one adaptive KL coefficient, and all stop at once when
rank 0's critic request fails."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from openaligner.io.metrics import read_jsonl

WORKER = Path(__file__).with_name("ppo_dp_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


KEYS = (
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
)


# SGD (lr 0.5, no momentum: nothing amplifies the rounding of the gradients as AdamW's
# g / (√v + ε) would) with the gradient norm clipped to 1: w = w₀ − lr·Σ g over 4 optimizer steps,
# every gradient element ≤ 1 after clipping; a step's gradient is a sum of ≤ 8 float32 terms in
# another order (u = 2⁻²⁴): |δw| ≤ 4 × 0.5 × 8u × 1 ≈ 1e-6, plus a rounding of w (|w| < 4: 2.4e-7).
# Measured: ≤ 3e-8 fsdp vs ddp, ≤ 1.2e-7 ddp vs one process (1 × 8 or 2 × 2). A missing gradient
# average moves weights by lr × |g| ~ 1e-2.
WEIGHTS_ATOL = 2e-6
# Logged metrics are float32 means and sums over a step's ≤ 16 × 8 tokens whose association
# differs between the runs: ≤ 128 terms × 6e-8 ≈ 8e-6 relative to the terms' magnitudes, and
# means near zero (a whitened advantage's loss) get an absolute floor. Measured ≤ 3e-7.
METRICS = {"rel": 1e-5, "abs": 1e-6}


def assert_same_weights(run: dict, expected: dict) -> None:
    """Every element of two runs' final weights (rank 0's ``.pt``) within :data:`WEIGHTS_ATOL`."""
    got, want = torch.load(run["pt"]), torch.load(expected["pt"])
    assert got.keys() == want.keys()  # the same names: an HF state dict
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=WEIGHTS_ATOL, msg=name)


def run_worker(
    out: Path,
    ranks: int,
    strategy: str = "ddp",
    arch: str = "gpt2",
    generation: str = "gathered",
    offload: bool = False,
    estimator: str = "",
    micro_batch: int = 2,
    global_batch: int = 8,
    reuse: bool = True,
) -> dict:
    env = os.environ | {
        "MICRO_BATCH": str(micro_batch),
        "GLOBAL_BATCH": str(global_batch),
        "REUSE": str(int(reuse)),
        "STRATEGY": strategy,
        "ARCH": arch,
        "GENERATION": generation,
        "OFFLOAD": str(int(offload)),
        "ESTIMATOR": estimator,
    }
    command = [*TORCHRUN, str(WORKER), str(out)] if ranks == 2 else [sys.executable, str(WORKER), str(out)]
    subprocess.run(command, check=True, timeout=300, env=env)
    return json.loads(out.read_text()) | {"pt": out.with_suffix(".pt")}


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


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_two_ranks_sharded_or_replicated_match_one_process(tmp_path, arch):
    """FSDP over 2 ranks is the same run as replicas over 2 ranks: the same all-gathered float32
    weights, the same forwards, gradients summed over the same two ranks; whether generation runs
    on weights gathered once (parallel.generation=gathered) or layer by layer with the ranks
    stepping together (layerwise: ranks whose rows end first keep stepping). With layer-by-layer
    generation the sharded root (embeddings) used to stay whole after the no-grad forwards and
    miss the optimizer's updates (PPO ratio and loss off at the first step). The tolerance (rel 1e-6)
    is the rounding of the two places that differ: the gradient norm is a sum of squares over
    shards (then over ranks) instead of over whole tensors, and with 2 micro-batches per rank the
    reduce-scatter after each backward associates the sums differently ((a1+b1)+(a2+b2) instead of
    (a1+a2)+(b1+b2)). One process differs from both by the same kind of rounding (rel 1e-4 above).
    Tolerances between these: :data:`METRICS` and :data:`WEIGHTS_ATOL`, derived where defined.

    Micro-batch and rank invariance: one process training each minibatch of 8 in one micro-batch
    (1 × 8) matches 2 ranks × 2 micro-batches of 2 — the loss of a step is normalised over its
    whole minibatch, not per micro-batch (responses here are 1 to 5 tokens; with per-micro-batch
    means, measured: policy/loss 62% apart, weights 4.8e-2). Tolerances: metrics rel 1e-6, abs
    1e-7 — 1e-6 for the policy loss, a mean of per-token terms of size ~1 (whitened advantages)
    that cancels to ~1e-2, so its rounding is relative to the terms (8 × 2⁻²⁴ ≈ 5e-7; measured
    1.2e-7); weights :data:`WEIGHTS_ATOL`."""
    one = run_worker(tmp_path / "one.json", 1, arch=arch)
    whole = run_worker(tmp_path / "whole.json", 1, arch=arch, micro_batch=8)
    ddp = run_worker(tmp_path / "ddp.json", 2, "ddp", arch)
    # gpt2 (tied embeddings) generates layer by layer; llama on gathered weights, with its shards,
    # gradients, AdamW state and initial policy in CPU memory (parallel.offload[_init_policy])
    if arch == "gpt2":
        fsdp = run_worker(tmp_path / "fsdp.json", 2, "fsdp", arch, "layerwise")
    else:
        fsdp = run_worker(tmp_path / "fsdp.json", 2, "fsdp", arch, "gathered", offload=True)
    assert len(fsdp["history"]) == 2
    for m_ddp, m_fsdp, m_one in zip(ddp["history"], fsdp["history"], one["history"], strict=True):
        for key in KEYS:
            assert m_fsdp[key] == pytest.approx(m_ddp[key], **METRICS), key
            assert m_fsdp[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-5), key
    assert_same_weights(fsdp, ddp)
    # replicas equal one process (a mean over 2 ranks' rows instead of one pass over all of them)
    assert_same_weights(ddp, one)
    assert fsdp["history"][1]["policy/ppo_ratio"] != 1.0  # it trained
    for m_whole, m_ddp, m_fsdp in zip(whole["history"], ddp["history"], fsdp["history"], strict=True):
        for key in KEYS:
            # the policy loss and explained variance (1 − a ratio of variances) cancel: their
            # rounding is relative to their terms, not to the result (measured up to 0.33 of
            # rel 1e-6 + abs 1e-7 on explained variance); every other key at rel 1e-6
            cancels = key in ("policy/loss", "value/explained_variance")
            tol = {"rel": 1e-6, "abs": 1e-6 if cancels else 1e-7}
            assert m_ddp[key] == pytest.approx(m_whole[key], **tol), key
            assert m_fsdp[key] == pytest.approx(m_whole[key], **tol), key
    w_whole = torch.load(tmp_path / "whole.pt")
    for name in ("ddp", "fsdp"):
        for key, tensor in torch.load(tmp_path / f"{name}.pt").items():
            torch.testing.assert_close(tensor, w_whole[key], rtol=0, atol=WEIGHTS_ATOL, msg=f"{name} {key}")
    # adaptive KL: every rank holds the same β, the one a single process computes, and β moved
    assert ddp["betas"][0] == ddp["betas"][1] == pytest.approx(one["betas"][0], rel=1e-6)
    assert fsdp["betas"][0] == fsdp["betas"][1] == pytest.approx(ddp["betas"][0], rel=1e-6)
    assert one["betas"][0] != 0.05


@pytest.mark.slow
@pytest.mark.parametrize(("estimator", "strategy"), [("grpo", "ddp"), ("reinforce_pp", "fsdp")])
def test_critic_free_estimators_on_two_ranks_match_one_process(tmp_path, estimator, strategy):
    """Each prompt's 4 responses stay on the rank that drew the prompt, so GRPO's group statistics
    are local; REINFORCE++ whitens over every rank's tokens (a global statistic): either way two
    ranks (replicas or shards) compute what one process does, with no critic_train sent."""
    one = run_worker(tmp_path / "one.json", 1, estimator=estimator)
    two = run_worker(tmp_path / "two.json", 2, strategy, estimator=estimator)
    keys = [k for k in KEYS if not k.startswith(("value/", "rollout/returns", "rollout/values"))]
    for m_two, m_one in zip(two["history"], one["history"], strict=True):
        assert m_two["rollout/rollout_size"] == 16
        for key in keys:
            assert m_two[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-5), key
    assert_same_weights(two, one)
    assert two["history"][1]["policy/ppo_ratio"] != 1.0  # it trained
    # the rollout log holds every rank's responses once, in global (rank-major) order, as one process
    one_rows, two_rows = (read_jsonl(tmp_path / f"{n}.logs" / "rollouts.jsonl") for n in ("one", "two"))
    assert [(r["step"], r["sample"], r["group"]) for r in two_rows] == [
        (step, i, i // 4) for step in (1, 2) for i in range(16)
    ]
    for r_two, r_one in zip(two_rows, one_rows, strict=True):
        assert r_two["response_tokens"] == r_one["response_tokens"]
        assert r_two["reward"] == pytest.approx(r_one["reward"], rel=1e-6)
        assert r_two["advantage"] == pytest.approx(r_one["advantage"], rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_an_on_policy_update_on_two_ranks_matches_one_process_with_the_pass(tmp_path):
    """GRPO with the whole rollout in one optimizer step skips the rollout log-prob pass: each
    rank's update scores its share of the global batch, and the rows are shared back so that every
    rank's rollout log and KL figures (and the adaptive β, updated after the update) are those of
    one process that ran the pass."""
    passed = run_worker(tmp_path / "pass.json", 1, estimator="grpo", global_batch=16, reuse=False)
    one = run_worker(tmp_path / "one.json", 1, estimator="grpo", global_batch=16)
    two = run_worker(tmp_path / "two.json", 2, "ddp", estimator="grpo", global_batch=16)
    keys = [k for k in KEYS if not k.startswith(("value/", "rollout/returns", "rollout/values"))]
    for m_two, m_one, m_pass in zip(two["history"], one["history"], passed["history"], strict=True):
        assert "timing/logprobs_s" in m_pass and "timing/logprobs_s" not in m_one | m_two
        assert m_one["policy/ppo_ratio"] == m_two["policy/ppo_ratio"] == 1.0
        for key in keys:
            assert m_two[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-5), key
            assert m_one[key] == pytest.approx(m_pass[key], rel=1e-6, abs=1e-7), key
    assert_same_weights(two, one)
    assert_same_weights(one, passed)
    assert two["betas"][0] == two["betas"][1] == pytest.approx(passed["betas"][0], rel=1e-6)
    assert passed["betas"][0] != 0.05  # β moved
    rows = {n: read_jsonl(tmp_path / f"{n}.logs" / "rollouts.jsonl") for n in ("pass", "one", "two")}
    assert len(rows["two"]) == 32
    for r_two, r_one, r_pass in zip(rows["two"], rows["one"], rows["pass"], strict=True):
        assert r_two["kl"] == pytest.approx(r_pass["kl"], rel=1e-4, abs=1e-6)
        assert r_one["kl"] == pytest.approx(r_pass["kl"], rel=1e-6, abs=1e-7)
