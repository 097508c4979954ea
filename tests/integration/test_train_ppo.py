"""`openaligner train-ppo` end to end against a real critic server (a subprocess on a free port):
metrics and checkpoints, a golden fixed-seed run, and exact resume with the servers restarted."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from procs import free_port

from openaligner.cli.main import main
from openaligner.io.metrics import read_jsonl

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).with_name("golden_ppo.json")


class CriticServer:
    """`openaligner serve-critic` (tiny combined RM + critic) in its own process."""

    def __init__(self, ckpt_dir: Path, log: Path) -> None:
        self.port = free_port()
        args = [
            "model.tiny=gpt2",
            "model.tiny_seed=0",
            f"server.port={self.port}",
            f"checkpoint.dir={ckpt_dir}",
            "train.global_batch_size=16",
            "train.micro_batch_size=16",
            "optim.lr=1e-3",
            "optim.warmup_steps=0",
            "optim.scheduler=constant",
            "server.inference_micro_batch_size=[8]",
            "server.model_forward_micro_batch_size=8",
            "threads=1",
        ]
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "openaligner", "serve-critic", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        url = f"http://127.0.0.1:{self.port}/v2/models/critic_infer/ready"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(log.read_text())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0
        self.log.close()


def _prompts(path: Path) -> Path:
    words = ["add", "sort", "the", "list", "now", "please", "of", "numbers"]
    rows = [{"prompt": " ".join(words[(i + k) % len(words)] for k in range(1 + i % 3))} for i in range(48)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run_ppo(out: Path, prompts: Path, port: int, steps: int) -> int:
    torch.set_num_threads(2)
    return main(
        [
            "train-ppo",
            "actor.tiny=gpt2",
            "actor.tiny_hidden_size=32",
            "actor.tiny_num_layers=1",
            "actor.tiny_num_heads=2",
            "actor.tiny_seed=1",
            "device=cpu",
            f"data.train_path={prompts}",
            "data.seq_length=64",
            f"trainer.max_steps={steps}",
            "trainer.max_epochs=5",
            "trainer.num_rollout_samples=16",
            "trainer.rollout_micro_batch_size=8",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=4",
            "trainer.num_val_samples=8",
            "trainer.val_check_interval=2",
            "trainer.save_interval=2",
            "trainer.length.max_length=6",
            "trainer.initial_policy_kl_penalty=0.05",
            "trainer.seed=3",
            "optim.lr=1e-3",
            f"remote.critic.port={port}",
            "remote.pad_to_length=32",
            f"exp.output_dir={out}",
            "exp.progress=false",
            "exp.tensorboard=false",
        ]
    )


def test_end_to_end_metrics_checkpoints_and_golden(tmp_path):
    server = CriticServer(tmp_path / "critic", tmp_path / "critic.log")
    try:
        assert _run_ppo(tmp_path / "run", _prompts(tmp_path / "p.jsonl"), server.port, steps=3) == 0
    finally:
        server.stop()
    rows = read_jsonl(tmp_path / "run" / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the rollout log: every response of each step, under the step's number, with the rewards the
    # critic server returned (their mean is the step's rollout/rewards)
    rollouts = read_jsonl(tmp_path / "run" / "logs" / "rollouts.jsonl")
    assert [(r["step"], r["sample"]) for r in rollouts] == [(s, i) for s in (1, 2, 3) for i in range(16)]
    for row in rows:
        rewards = [r["reward"] for r in rollouts if r["step"] == row["step"]]
        assert sum(rewards) / len(rewards) == pytest.approx(row["rollout/rewards"], rel=1e-6)
    assert all(isinstance(r["response"], str) and "value" in r and "kl" in r for r in rollouts)
    for key in (
        "rollout/rewards",
        "rollout/init_policy_kl",
        "policy/loss",
        "value/loss",
        "val/rewards",
        "value/explained_variance",
        "timing/critic_wait_s",
        "timing/tokens_per_s",
    ):
        assert rows[-1][key] is not None, key
    # actor checkpoints at steps 2 and 3 (the last), the final actor, and the critic saved in step
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert ckpts == ["step_2", "step_3"]
    assert (tmp_path / "run" / "actor" / "model.safetensors").is_file()
    # the critic saved in the same PPO steps: one critic optimizer step per PPO step (16 rows / gbs 16)
    assert sorted(p.name for p in (tmp_path / "critic").glob("step_*")) == ["step_2", "step_3"]
    golden = {
        k: [r[k] for r in rows] for k in ("rollout/rewards", "rollout/generation_length", "policy/loss")
    }
    if os.environ.get("OPENALIGNER_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(golden, indent=1))
    expected = json.loads(GOLDEN.read_text())
    for k, values in expected.items():
        assert golden[k] == pytest.approx(values, rel=1e-3, abs=1e-4), k


def test_resume_matches_uninterrupted_run(tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl")
    server = CriticServer(tmp_path / "critic_a", tmp_path / "a.log")
    try:
        assert _run_ppo(tmp_path / "a", prompts, server.port, steps=4) == 0
    finally:
        server.stop()
    # stopped after step 2 (its checkpoint); actor and critic both restart from there
    server = CriticServer(tmp_path / "critic_b", tmp_path / "b1.log")
    try:
        assert _run_ppo(tmp_path / "b", prompts, server.port, steps=2) == 0
    finally:
        server.stop()
    server = CriticServer(tmp_path / "critic_b", tmp_path / "b2.log")
    try:
        assert _run_ppo(tmp_path / "b", prompts, server.port, steps=4) == 0
    finally:
        server.stop()
    straight = read_jsonl(tmp_path / "a" / "logs" / "metrics.jsonl")
    resumed = read_jsonl(tmp_path / "b" / "logs" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight[2:], resumed[2:], strict=True):
        for k, v in a.items():
            if k.startswith("timing/") or v is None:
                continue
            assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (a["step"], k)
