"""`openaligner serve-tinker` driven by the real clients: the ``tinker`` 0.38.0 SDK and the
``tinker-cookbook`` 0.5.8 recipes, unmodified, from their own venv (``make tinker-setup``; set
``OPENALIGNER_TINKER_PYTHON`` to use another one), against a tiny Llama saved as a Hugging Face
directory with a tokenizer ``AutoTokenizer`` loads (the cookbook's ``get_tokenizer``).

One server for the module (started once); the kill -9 test starts its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import procs
import pytest

pytestmark = [pytest.mark.heavy, pytest.mark.tinker]

REPO = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).with_name("tinker_client.py")
API_KEY = "serve-tinker-tests"  # the SDK sends tml-<this>


def tinker_python() -> Path:
    configured = os.environ.get("OPENALIGNER_TINKER_PYTHON")
    return Path(configured) if configured else REPO / ".venv-tinker" / "bin" / "python"


@pytest.fixture(scope="module")
def sdk() -> Path:
    python = tinker_python()
    if not python.is_file():
        pytest.skip(f"the Tinker SDK's venv is missing ({python}): run `make tinker-setup`")
    return python


@pytest.fixture(scope="module")
def model_dir(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.save_causal_lm(tmp_path_factory.mktemp("tiny-llama"), "llama")


class TinkerServer(procs.Served):
    ready_pattern = r"tinker server ready at (http://\S+) "

    def __init__(self, checkpoint_dir: Path, *extra: str) -> None:
        super().__init__(
            [
                sys.executable,
                "-m",
                "openaligner",
                "serve-tinker",
                "server.port=0",
                f"server.token={API_KEY}",
                f"checkpoint_dir={checkpoint_dir}",
                "threads=1",
                *extra,
            ]
        )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, sdk: Path) -> Iterator[str]:
    served = TinkerServer(tmp_path_factory.mktemp("tinker-checkpoints"))
    try:
        yield served.wait_ready(timeout_s=180)
    finally:
        served.kill()


def in_sdk(sdk: Path, *args: str, timeout_s: float = 540, **env: str) -> subprocess.CompletedProcess[str]:
    """``args`` run by the SDK venv's Python, without telemetry, on one thread (``env``: more
    variables); its output captured."""
    return subprocess.run(
        [str(sdk), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "TINKER_TELEMETRY": "0", "OMP_NUM_THREADS": "1", **env},
    )


def client(sdk: Path, command: str, url: str, arg: str, timeout_s: float = 540) -> dict:
    """Run one command of tinker_client.py in the SDK's venv; its RESULT line."""
    done = in_sdk(sdk, str(CLIENT), command, url, arg, timeout_s=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def test_supervised_loop_loss_falls(sdk, server, model_dir):
    out = client(sdk, "sl", server, str(model_dir))
    losses = out["losses"]
    assert losses[-1] < 0.8 * losses[0], losses
    # forward: the same loss without a step, per-datum log-probs whose weighted NLL is that loss
    assert out["forward_loss"] == pytest.approx(losses[0], rel=1e-5)
    assert out["forward_nll_sum"] == pytest.approx(out["forward_loss"], rel=1e-5)
    assert out["output_keys"] == ["elementwise_loss", "logprobs"]
    assert out["model_name"] == str(model_dir)  # get_info echoes the name the client sent
    assert out["reloaded_loss"] == pytest.approx(out["forward_loss"], rel=1e-5)  # load_state: the start again


def test_arithmetic_recipe_runs_unchanged(sdk, server, model_dir, tmp_path):
    log_path = tmp_path / "rl"
    done = in_sdk(
        sdk,
        "-m",
        "tinker_cookbook.recipes.math_rl.train",
        "env=arithmetic",
        "loss_fn=importance_sampling",
        f"base_url={server}",
        f"model_name={model_dir}",
        "renderer_name=role_colon",
        "groups_per_batch=2",
        "group_size=2",
        "max_tokens=4",
        "max_steps=2",
        "lora_rank=4",
        f"log_path={log_path}",
        "behavior_if_log_dir_exists=delete",
        TINKER_API_KEY=f"tml-{API_KEY}",
    )
    assert done.returncode == 0, done.stderr[-5000:]
    steps = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["progress/batch"] for s in steps] == [0, 1]
    assert all(s["env/all/total_episodes"] == 4 for s in steps)
    checkpoints = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    final = checkpoints[-1]
    assert final["name"] == "final" and final["state_path"].startswith("tinker://")
    assert "Training completed successfully" in done.stderr + done.stdout


def test_sampling_contract(sdk, server, model_dir):
    out = client(sdk, "sample", server, str(model_dir))
    letters = out["letters"]
    for seq in out["by_string"]:
        hits = sum(seq["text"].count(c) for c in letters)
        if seq["stop_reason"] == "stop":
            assert hits == 1 and seq["text"][-1] in letters, seq  # the stop string, once, at the end
        else:
            assert hits == 0 and len(seq["tokens"]) == 40, seq
        assert len(seq["logprobs"]) == len(seq["tokens"])
        assert all(lp <= 0 for lp in seq["logprobs"])
    assert any(s["stop_reason"] == "stop" for s in out["by_string"])
    assert [s["tokens"] for s in out["again"]] == [s["tokens"] for s in out["by_string"]]  # seeded
    ids = {s["sequence_id"] for s in out["by_string"] + out["again"]}
    assert len(ids) == 8  # one sequence id per sample
    for seq in out["by_id"]:
        if seq["stop_reason"] == "stop":
            assert seq["tokens"][-1] in out["stop_ids"]
            assert sum(t in out["stop_ids"] for t in seq["tokens"]) == 1
    assert [len(s["tokens"]) for s in out["short"]] == [2, 2]
    assert [s["stop_reason"] for s in out["short"]] == ["length", "length"]
    # compute_logprobs: None at position 0, then the model's log-probs (as forward computes them)
    assert out["prompt_logprobs"][0] is None
    assert out["prompt_logprobs"][1:] == pytest.approx(out["forward_logprobs"], abs=1e-4)


def test_refusals_name_the_cause_and_training_goes_on(sdk, server, model_dir):
    out = client(sdk, "errors", server, str(model_dir))
    assert "no/such-model" in out["unknown_base"] and "serves" in out["unknown_base"]
    assert "rank" in out["big_rank"]
    assert "vocabulary" in out["oov"] and "1000000" in out["oov"]
    assert "weights" in out["shape"] and "shape" in out["shape"]
    assert "stable_reinforce" in out["loss"] and "cross_entropy" in out["loss"]
    assert "vocabulary" in out["sample_strings"]
    assert out["after"] > 0


def test_state_survives_kill_9_and_resume_continues_as_uninterrupted(sdk, model_dir, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    first = TinkerServer(checkpoints)
    try:
        url = first.wait_ready(timeout_s=180)
        uninterrupted = client(sdk, "save", url, str(model_dir))
    finally:
        first.kill()  # SIGKILL: no chance to write anything more
    second = TinkerServer(checkpoints)
    try:
        url = second.wait_ready(timeout_s=180)
        resumed = client(sdk, "resume", url, uninterrupted["path"])
    finally:
        second.kill()
    assert resumed["continued"] == pytest.approx(uninterrupted["continued"], rel=1e-5, abs=1e-5)
    assert resumed["model_id"].endswith(":train:0")


def test_ppo_loop_with_a_served_critic(sdk, server, model_dir):
    """examples/tinker_ppo_critic.py: a policy and a critic (model_role critic) of one server, the
    critic's values through forward, its clipped value loss through forward_backward."""
    example = REPO / "examples" / "tinker_ppo_critic.py"
    done = in_sdk(
        sdk, str(example), "--base-url", server, "--model", str(model_dir), TINKER_API_KEY=f"tml-{API_KEY}"
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-5000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert len(out["rewards"]) == 3
    before, after = out["value_losses"][0]
    assert 0 < after < before  # the first critic step (fresh AdamW) lowers its loss on its batch
