"""Sharded servers (parallel.strategy=fsdp over 2 gloo ranks) answer as replicas over 2 ranks and
as one process: the critic's values, rewards, training results and weights after three
critic_train calls, and the reward server's rewards (a bfloat16 reward model, cast before it was
sharded). A checkpoint's round trip (save, restore, resume) gives the same state back. Bad requests are
refused on rank 0 and leave the ranks in step. Then one HTTP round trip against `openaligner
serve-critic parallel.strategy=fsdp` under torchrun."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import Served, alive, descendants, free_port

from openaligner.clients.critic import CriticAddress, RemoteCriticConfig, RemoteGPTRMCriticClient
from openaligner.clients.errors import BadRequestError

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("sharded_server_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
TRAIN_KEYS = ("loss_mean", "clip_fraction", "explained_variance", "grad_norm", "lr")


def run_worker(out: Path, ranks: int, strategy: str, micro_batch: int = 1) -> dict:
    env = os.environ | {"STRATEGY": strategy, "OMP_NUM_THREADS": "1", "MICRO_BATCH": str(micro_batch)}
    command = [*TORCHRUN, str(WORKER), str(out)] if ranks == 2 else [sys.executable, str(WORKER), str(out)]
    subprocess.run(command, check=True, timeout=240, env=env, capture_output=True)
    return torch.load(out, weights_only=False)


def assert_same_critic(got: dict, want: dict) -> None:
    """The answers before training are equal bit for bit; after it, within float32 rounding (see
    the test's docstring)."""
    torch.testing.assert_close(got["first"], want["first"], rtol=0, atol=0)
    torch.testing.assert_close(got["second"], want["second"], rtol=1e-5, atol=1e-6)
    trained = zip([*got["trained"], got["after_save"]], [*want["trained"], want["after_save"]], strict=True)
    for g, w in trained:
        assert int(g["step"][0]) == int(w["step"][0])
        assert int(g["optimizer_steps"][0]) == int(w["optimizer_steps"][0])
        for key in TRAIN_KEYS:
            assert float(g[key][0]) == pytest.approx(float(w[key][0]), rel=1e-5, abs=1e-6), key


@pytest.mark.timeout(300)
def test_sharded_servers_answer_and_train_as_replicas_and_one_process(tmp_path):
    """FSDP over 2 ranks is the same computation as replicas over 2 ranks: the same float32
    weights all-gathered for each forward, the same rows per rank, gradients summed over the same
    ranks. What differs is float32 rounding: the reduce-scatter after each micro-batch's backward
    sums (a1+b1)+(a2+b2) where replicas all-reduce (a1+a2)+(b1+b2), and the gradient norm is
    summed over shards. Measured after 5 SGD-with-momentum steps: weights within 8e-9 (absolute;
    they are ~0.02-1), train results within 3e-7 absolute (1.5e-6 relative), values after training
    within 1.2e-7; the tolerances are 5x-10x that. One process trains each global batch of 4 rows
    in one micro-batch, against 2 ranks × 2 micro-batches of 1 row: the value loss is a token mean
    over the whole global batch, so it differs from both by the same kind of rounding only (the
    same rows in other forward shapes, their gradients summed in another order). Inference before
    training and the reward server's rewards are bitwise equal: the same weights, the same rows
    per micro-batch."""
    runs = {
        "one": run_worker(tmp_path / "one.pt", 1, "ddp", micro_batch=4),
        "ddp": run_worker(tmp_path / "ddp.pt", 2, "ddp"),
        "fsdp": run_worker(tmp_path / "fsdp.pt", 2, "fsdp"),
    }
    fsdp = runs["fsdp"]
    assert [r["world"] for r in runs.values()] == [1, 2, 2]
    assert fsdp["sharded"] and not runs["ddp"]["sharded"]

    for want in (runs["ddp"], runs["one"]):
        assert_same_critic(fsdp["critic"], want["critic"])
        assert fsdp["weights"].keys() == want["weights"].keys()  # the same names: one state dict
        for name, tensor in want["weights"].items():
            torch.testing.assert_close(fsdp["weights"][name], tensor, rtol=1e-5, atol=1e-7, msg=name)
        for how in ("merged", "alone"):  # one formed batch of three requests, and each alone
            for got, expected in zip(fsdp["rewards"][how], want["rewards"][how], strict=True):
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
    trained = fsdp["critic"]["trained"]
    assert [int(t["step"][0]) for t in trained] == [2, 4, 5]  # 7, 5, 3 rows in global batches of 4
    assert not np.allclose(fsdp["critic"]["second"]["values"], fsdp["critic"]["first"]["values"])

    for name, run in runs.items():
        critic = run["critic"]
        # a checkpoint's round trip gives the same state back (weights, momentum, step) bit for bit
        assert (critic["saved"], critic["restored"]) == (5, [5, 5])
        assert int(critic["after_save"]["step"][0]) == 7
        torch.testing.assert_close(critic["after_restore"], critic["after_save"], rtol=0, atol=0)
        step, values = run["resumed"]  # a new server on every rank, resumed from step_5
        assert step == 5
        torch.testing.assert_close(values, critic["second"], rtol=0, atol=0)
        layout = "critic.dcp" if name == "fsdp" else "critic"  # DCP shards, or a whole HF directory
        assert (tmp_path / f"{name}.pt.ckpt" / "step_5" / layout).is_dir()

    # refused on rank 0 before any rank computed: the answers after them are still right
    refused = fsdp["critic"]["refused"]
    assert len(refused) == 2 and refused == runs["ddp"]["critic"]["refused"]
    assert "a mask holds only 0" in refused[0] and "outside the vocabulary" in refused[1]
    assert "each length must lie in" in fsdp["rewards"]["refused"]


class ServedCritic(Served):
    ready_pattern = r"critic server ready at (http://\S+) \(.*"
    ready_group = 0


@pytest.mark.timeout(400)  # a bound on a hang, not a speed check: 2 ranks start slowly beside the other tier
def test_cli_sharded_critic_server_over_http(tiny, tmp_path):
    """`openaligner serve-critic parallel.strategy=fsdp` under torchrun (2 ranks): the original
    values and rewards, a training pass whose last step is padding only on rank 1, bad requests
    refused with 400 and the ranks still in step after them, critic_save and a restore_step (a
    sharded checkpoint), and a clean stop on SIGTERM."""
    port = free_port()
    cmd = [
        *TORCHRUN, "-m", "openaligner", "serve-critic", "model.tiny=gpt2", f"server.port={port}", "threads=1",
        "parallel.strategy=fsdp", "server.inference_micro_batch_size=[2]",
        "server.model_forward_micro_batch_size=2", "train.global_batch_size=4", "train.micro_batch_size=2",
        "optim.lr=1e-3", "optim.warmup_steps=0", f"checkpoint.dir={tmp_path}",
    ]  # fmt: skip
    g = torch.Generator().manual_seed(5)
    batch = {"response_tokens": torch.randint(4, 100, (6, 20), generator=g),
             "response_lengths": torch.tensor([20, 2, 7, 13, 9, 16])}  # fmt: skip
    want_rewards = tiny.reward_model().infer(batch["response_tokens"], batch["response_lengths"])
    want_values = tiny.critic().infer(batch["response_tokens"], batch["response_lengths"])[:, :-1]
    cfg = RemoteCriticConfig(pad_to_length=32, critic=CriticAddress(port=port), init_timeout_s=10)
    served = ServedCritic(cmd)
    try:
        ready = served.wait_ready(timeout_s=240)  # torchrun + 2 ranks: >90 s at load 9 (failed so)
        assert "2 rank(s), sharded" in ready, ready
        tree = descendants(served.proc.pid)
        with RemoteGPTRMCriticClient(cfg) as client:
            rewards, values = client.infer_rm_critic(batch).result()
            torch.testing.assert_close(rewards, want_rewards, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(values, want_values, atol=1e-5, rtol=1e-5)
            mask = (torch.arange(19)[None, :] < (batch["response_lengths"] - 1)[:, None]).float()
            data = {**batch, "returns": torch.ones(6, 19), "values": values, "mask": mask}
            with pytest.raises(BadRequestError, match="a mask holds only 0"):
                client.train({**data, "mask": mask * 2}).result()
            # 6 rows pad to 2 global batches of 4: rank 1's share of the second is padding only
            assert client.train(data).result()["critic_step"] == 2.0
            assert client.save().result() == {"status": 0, "step": 2}
            rewards2, values2 = client.infer_rm_critic(batch).result()
            assert client.train({**data, "values": values2}).result()["critic_step"] == 4.0
            with pytest.raises(BadRequestError, match="cannot go back to critic step 3"):
                client.restore(3).result()
            assert client.restore(2).result() == {"status": 0, "step": 2}
            _, values3 = client.infer_rm_critic(batch).result()
        torch.testing.assert_close(rewards2, rewards, atol=0, rtol=0)  # the frozen reward model
        assert not torch.allclose(values2, values)
        torch.testing.assert_close(values3, values2, atol=0, rtol=0)  # both ranks went back to step 2
        assert (tmp_path / "step_2" / "critic.dcp").is_dir()
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(timeout=60)
        time.sleep(0.5)  # let orphaned children (if any) be seen before checking
        left = {pid: name for pid, name in tree.items() if alive(pid)}
        assert not left, f"processes left behind after SIGTERM: {left}"
        output = served.output
        # torchrun itself exits 1 on SIGTERM; the ranks stopped cleanly
        assert "critic server stopped at step 2" in output, output[-3000:]
        assert re.search(r"rank 1: STOP received after [1-9]\d* call\(s\)", output), output[-3000:]
    finally:
        served.kill()
