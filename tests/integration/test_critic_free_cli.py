"""`openaligner train-ppo trainer.advantage_estimator=...` end to end for every critic-free estimator,
against a served reward model (`serve-reward`, token ids) and against a served reward function
(`serve-reward reward.function=...`, text and prompt metadata): the run talks only to the reward
server, checkpoints, and a run resumed from its step-1 checkpoint repeats step 2 exactly."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from procs import Served, free_port

from openaligner.cli.main import main
from openaligner.io.metrics import read_jsonl
from openaligner.trainer import estimators

pytestmark = pytest.mark.slow

ESTIMATORS = ["reinforce", "rloo", "grpo", "dr_grpo", "reinforce_pp"]
HERE = Path(__file__).parent
ALGORITHMS_DOC = HERE.parents[1] / "docs" / "algorithms.md"


def _serve(args: list[str]) -> tuple[Served, int]:
    port = free_port()
    served = Served(
        [sys.executable, "-m", "openaligner", "serve-reward", f"server.port={port}", "threads=1", *args],
        env={"PYTHONPATH": f"{HERE}:{Path.cwd() / 'src'}"},
    )
    served.wait_ready()
    return served, port


class Servers:
    """The module's reward servers, each started on first use: a tiny reward model (char tokenizer,
    as the actor's) and a reward function."""

    ARGS: ClassVar[dict[str, list[str]]] = {
        "model": ["model.tiny=gpt2", "model.tiny_seed=0", "server.inference_micro_batch_size=[8]"],
        "function": ["reward.function=critic_free_rewards:letter_share"],
    }

    def __init__(self) -> None:
        self.started: dict[str, tuple[Served, int]] = {}

    def port(self, kind: str) -> int:
        if kind not in self.started:
            self.started[kind] = _serve(self.ARGS[kind])
        return self.started[kind][1]

    def stop(self) -> None:
        for served, _ in self.started.values():
            served.proc.send_signal(signal.SIGTERM)
            served.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def servers():
    s = Servers()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    letters = "abcdefgh"
    rows = [{"prompt": f"say {letters[i % 8]} {i}:", "letter": letters[i % 8]} for i in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(out: Path, prompts: Path, estimator: str, port: int, reward: str, *more: str) -> int:
    torch.set_num_threads(2)
    extra = [*(["data.metadata_keys=[letter]"] if reward == "function" else []), *more]
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
            "data.seq_length=48",
            f"trainer.advantage_estimator={estimator}",
            "trainer.n_samples_per_prompt=4",
            "trainer.max_steps=2",
            "trainer.max_epochs=5",
            "trainer.num_rollout_samples=4",
            "trainer.rollout_micro_batch_size=8",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=8",
            "trainer.num_val_samples=8",
            "trainer.val_check_interval=1",
            "trainer.save_interval=1",
            "trainer.length.max_length=6",
            "trainer.initial_policy_kl_penalty=0.05",
            "trainer.seed=3",
            "optim.lr=1e-3",
            f"remote.reward_model.port={port}",
            "remote.pad_to_length=48",
            f"exp.output_dir={out}",
            "exp.progress=false",
            "exp.tensorboard=false",
            *extra,
        ]
    )


@pytest.mark.parametrize("reward", ["model", "function"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_trains_against_a_served_reward_and_resumes_exactly(
    tmp_path, servers, prompts, estimator, reward
):
    out = tmp_path / "run"
    port = servers.port(reward)
    assert _train(out, prompts, estimator, port, reward) == 0
    rows = read_jsonl(out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["rollout/rollout_size"] == 16  # 4 prompts × 4 responses
    assert not any(k.startswith("value/") for k in rows[0])
    if reward == "function":  # the letters the prompts' metadata named were scored
        assert 0.0 <= rows[0]["rollout/rewards"] <= 1.0
    assert (out / "actor" / "model.safetensors").is_file()
    # drop step 2 and run again: it resumes from step 1 and repeats step 2 exactly
    shutil.rmtree(out / "checkpoints" / "step_2")
    assert _train(out, prompts, estimator, port, reward) == 0
    again = read_jsonl(out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in again] == [1, 2]
    for k, v in rows[1].items():
        if k.startswith("timing/") or v is None:
            continue
        assert again[1][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_the_docs_estimator_trains_from_the_command_line_as_a_plugin(tmp_path, servers, prompts):
    """docs/algorithms.md's worked estimator, saved as the user's own file, used by
    `openaligner train-ppo plugins=[group_mean_plugin.py] trainer.advantage_estimator=group_mean`."""
    import re

    section = ALGORITHMS_DOC.read_text().split("## Add your own estimator", 1)[1]
    estimator_code = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    plugin = tmp_path / "group_mean_plugin.py"
    plugin.write_text(estimator_code)
    estimators.ESTIMATORS.pop("group_mean", None)  # registered by another test of this process, if any
    sys.modules.pop("group_mean_plugin", None)
    try:
        out = tmp_path / "run"
        assert _train(out, prompts, "group_mean", servers.port("model"), "model", f"plugins=[{plugin}]") == 0
    finally:
        estimators.ESTIMATORS.pop("group_mean", None)
        sys.modules.pop("group_mean_plugin", None)
    rows = read_jsonl(out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["rollout/rollout_size"] == 16  # 4 prompts × 4 responses
    # group-mean baselines: each prompt's responses' advantages sum to 0 (per response, not per
    # token: the logged rollout/advantages_mean weights them by their lengths)
    groups: dict[tuple[int, int], list[float]] = {}
    for record in read_jsonl(out / "logs" / "rollouts.jsonl"):
        groups.setdefault((record["step"], record["group"]), []).append(record["advantage"])
    assert len(groups) == 8 and all(len(g) == 4 for g in groups.values())  # 2 steps × 4 prompts × 4
    for advantages in groups.values():
        assert sum(advantages) == pytest.approx(0.0, abs=1e-5)
    assert not any(k.startswith("value/") for k in rows[0])
    assert f"plugins:\n- {plugin}\n" in (out / "checkpoints" / "step_2" / "config.yaml").read_text()
