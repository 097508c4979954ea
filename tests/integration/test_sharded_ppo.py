"""A Llama PPO run with everything sharded (``parallel.strategy=fsdp`` over 2 ranks each): the actor
trainer, the critic server and a separate reward server, all under torchrun. It runs to a
checkpoint, stops, resumes on the same servers to one more step, and exports a Hugging Face actor
directory that ``from_pretrained`` loads — with the logits of the actor's sharded checkpoint read
back by one process (resharded from 2 ranks to 1)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import procs
import pytest
import torch
from procs import free_port
from transformers import AutoModelForCausalLM

from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.trainer.checkpoint_files import load_sharded_state

# heavy tier (make test-heavy, CI's second step): minutes of whole-process runs, kept out of `make test`
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
TOKEN = "sharded-secret"
TINY = ["tiny=llama", "tiny_hidden_size=32", "tiny_num_layers=2", "tiny_num_heads=2"]
SHARDED = ["parallel.strategy=fsdp"]


class Server(procs.Served):
    """A server CLI under torchrun (2 ranks), sharded."""

    def __init__(self, command: str, ready: str, args: list[str]) -> None:
        self.ready_pattern = ready
        self.ready_group = 0
        super().__init__(
            [*TORCHRUN, "-m", "openaligner", command, *args, *SHARDED, "runtime.device=cpu", "threads=1"],
            env={"OPENALIGNER_TOKEN": TOKEN},
        )

    def stop(self, stopped: str) -> None:
        """SIGTERM to torchrun, which forwards it to both ranks (and exits non-zero by its own
        convention); the server says it stopped."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        assert stopped in self.output, self.output[-3000:]


def _prompts(path: Path) -> Path:
    words = ["sort", "the", "list", "now", "please", "of", "numbers", "add"]
    rows = [{"prompt": " ".join(words[(i + k) % len(words)] for k in range(1 + i % 3))} for i in range(32)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(out: Path, prompts: Path, critic_port: int, reward_port: int, steps: int) -> str:
    args = [
        *(f"actor.{t}" for t in TINY),
        "actor.tiny_seed=1",
        "device=cpu",
        *SHARDED,
        f"data.train_path={prompts}",
        "data.seq_length=48",
        f"trainer.max_steps={steps}",
        "trainer.num_rollout_samples=8",
        "trainer.rollout_micro_batch_size=4",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2",
        "trainer.val_check_interval=0",
        "trainer.save_interval=2",
        "trainer.length.max_length=6",
        "trainer.initial_policy_kl_penalty=0.05",
        "optim.lr=1e-3",
        "remote.combine_rm_and_critic_server=false",
        f"remote.critic.port={critic_port}",
        f"remote.reward_model.port={reward_port}",
        "remote.pad_to_length=32",
        f"exp.output_dir={out}",
        "exp.progress=false",
        "exp.tensorboard=false",
    ]
    env = {**os.environ, "OPENALIGNER_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [*TORCHRUN, "-m", "openaligner", "train-ppo", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return run.stdout + run.stderr


def test_a_llama_ppo_run_sharded_everywhere_completes_resumes_and_exports(tmp_path):
    critic_port, reward_port = free_port(), free_port()
    reward = Server(
        "serve-reward",
        r"reward model server ready at http://\S+",
        [*(f"model.{t}" for t in TINY), f"server.port={reward_port}"],
    )
    critic = Server(
        "serve-critic",
        r"critic server ready at http://\S+",
        [
            *(f"model.{t}" for t in TINY),
            "server.combine_rm_and_critic_server=false",
            f"server.port={critic_port}",
            f"checkpoint.dir={tmp_path / 'critic'}",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            "optim.lr=1e-3",
        ],
    )
    try:
        reward.wait_ready(180)
        critic.wait_ready(180)
        prompts, out = _prompts(tmp_path / "prompts.jsonl"), tmp_path / "run"
        first = _train(out, prompts, critic_port, reward_port, steps=2)
        assert "resumed from" not in first
        second = _train(out, prompts, critic_port, reward_port, steps=3)
        assert "resumed from" in second and "at step 2" in second, second[-3000:]
        critic.stop("critic server stopped at step 3")
        reward.stop("reward model server stopped")
    finally:
        critic.kill()
        reward.kill()
    steps = [json.loads(line)["step"] for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_2", "step_3"]
    exported = AutoModelForCausalLM.from_pretrained(out / "actor", local_files_only=True)
    assert exported.config.model_type == "llama"
    tokens = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = exported(input_ids=tokens).logits
    # the step-3 checkpoint (written by 2 ranks) read back by one process: the exported weights
    model = build_tiny_causal_lm(
        "llama",
        TinySize(vocab_size=exported.config.vocab_size, hidden_size=32, num_layers=2, num_heads=2),
        seed=7,
    )
    load_sharded_state(
        out / "checkpoints" / "step_3" / "actor.dcp", model, torch.optim.AdamW(model.parameters())
    )
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, logits)
