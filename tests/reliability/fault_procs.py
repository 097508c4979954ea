"""Real processes for the fault tests: tiny critic/reward servers and `openaligner train-ppo` runs.

Everything runs as the user would run it (``python -m openaligner ...`` on free loopback ports),
one torch thread per process and batch-invariant serving (``server.batch_invariant``), so that two
runs of the same command compute the same numbers bit for bit, whatever Triton merges.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from procs import Served, alive, descendants, free_port  # on sys.path through conftest.py

ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""One thread per process: with batch-invariant serving, runs of the same command repeat bit for bit."""


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.02) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


class CriticServer(Served):
    """`openaligner serve-critic` with the tiny combined reward model + critic, saving to ``ckpt_dir``."""

    ready_pattern = r"critic server ready at (http://\S+) \(.*step (\d+)"
    ready_group = 2

    def __init__(self, ckpt_dir: Path, port: int | None = None, *extra: str) -> None:
        self.port = port if port is not None else free_port()
        self.ckpt_dir = ckpt_dir
        args = [
            "model.tiny=gpt2", "model.tiny_seed=0", f"server.port={self.port}", f"checkpoint.dir={ckpt_dir}",
            "train.global_batch_size=16", "train.micro_batch_size=16", "optim.lr=1e-3",
            "optim.warmup_steps=0", "optim.scheduler=constant", "server.inference_micro_batch_size=[8]",
            "server.model_forward_micro_batch_size=8", "server.batch_invariant=true", "threads=1", *extra,
        ]  # fmt: skip
        super().__init__([sys.executable, "-m", "openaligner", "serve-critic", *args], env=ENV)

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        """The critic step the server started at (its resumed checkpoint, or 0)."""
        return super().wait_ready(timeout_s)


class RewardServer(Served):
    """`openaligner serve-reward` with the tiny reward model."""

    def __init__(self) -> None:
        self.port = free_port()
        args = ["model.tiny=gpt2", f"server.port={self.port}", "threads=1"]
        super().__init__([sys.executable, "-m", "openaligner", "serve-reward", *args], env=ENV)


def latest_step(root: Path) -> int:
    """The step named by ``root/latest`` (0 before the first checkpoint is published)."""
    try:
        return int((root / "latest").read_text().strip().removeprefix("step_"))
    except (OSError, ValueError):
        return 0


def write_prompts(path: Path) -> Path:
    """48 short prompts (three PPO steps of 16 per epoch)."""
    words = ["add", "sort", "the", "list", "now", "please", "of", "numbers"]
    rows = [{"prompt": " ".join(words[(i + k) % len(words)] for k in range(1 + i % 3))} for i in range(48)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Trainer(Served):
    """`openaligner train-ppo` with a tiny actor against the critic server on ``port``.

    Steps are 16 rollouts of at most 6 new tokens; every step is checkpointed (actor under
    ``out/checkpoints``, critic through ``critic_save``).
    """

    def __init__(self, out: Path, prompts: Path, port: int, steps: int, *extra: str) -> None:
        self.out = out
        args = [
            "actor.tiny=gpt2", "actor.tiny_hidden_size=32", "actor.tiny_num_layers=1",
            "actor.tiny_num_heads=2", "actor.tiny_seed=1", "device=cpu", f"data.train_path={prompts}",
            "data.seq_length=64", f"trainer.max_steps={steps}", "trainer.max_epochs=5",
            "trainer.num_rollout_samples=16", "trainer.rollout_micro_batch_size=8",
            "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.val_check_interval=0",
            "trainer.save_interval=1", "trainer.length.max_length=6",
            "trainer.initial_policy_kl_penalty=0.05", "trainer.seed=3", "optim.lr=1e-3",
            f"remote.critic.port={port}", "remote.pad_to_length=32", "remote.init_timeout_s=120",
            f"exp.output_dir={out}", "exp.progress=false", "exp.tensorboard=false", "exp.keep_last=0",
            *extra,
        ]  # fmt: skip
        super().__init__([sys.executable, "-m", "openaligner", "train-ppo", *args], env=ENV)

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    def latest_step(self) -> int:
        """The step of the newest published actor checkpoint (0 before the first)."""
        return latest_step(self.checkpoints)

    def wait(self, timeout_s: float = 400.0) -> int:
        """The exit code; fails after ``timeout_s``: a bound on a hang (180 s was missed at load 9)."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except Exception:
            self.kill()
            raise AssertionError(
                f"train-ppo did not finish in {timeout_s:g} s:\n{self.output[-3000:]}"
            ) from None


def stop_cleanly(served: Served, sig: signal.Signals, within_s: float = 30.0) -> tuple[int, float]:
    """Send ``sig`` to ``served`` only; return (exit code, seconds to exit) once no process of its tree
    is left. Fails if it does not exit within ``within_s`` or leaves a descendant (e.g. tritonserver)."""
    tree = descendants(served.proc.pid)
    started = time.monotonic()
    served.proc.send_signal(sig)
    try:
        code = served.proc.wait(timeout=within_s)
    except Exception:
        served.kill()
        raise AssertionError(
            f"no exit within {within_s:g} s of {sig.name}:\n{served.output[-3000:]}"
        ) from None
    took = time.monotonic() - started
    wait_for(lambda: not any(alive(p) for p in tree), 10, f"the children of pid {served.proc.pid} to exit")
    return code, took


def kill_tree(served: Served) -> None:
    """SIGKILL a process group (a machine or container failure), and wait until nothing of it is left."""
    tree = descendants(served.proc.pid)
    if served.proc.poll() is None:
        os.killpg(served.proc.pid, signal.SIGKILL)
        served.proc.wait(timeout=30)
    wait_for(lambda: not any(alive(p) for p in tree), 30, "the killed process tree to go")


__all__ = [
    "ENV",
    "CriticServer",
    "RewardServer",
    "Served",
    "Trainer",
    "alive",
    "descendants",
    "free_port",
    "kill_tree",
    "latest_step",
    "stop_cleanly",
    "wait_for",
    "write_prompts",
]
