"""SIGINT / SIGTERM during train-sft and train-rm: the step in progress is finished and
checkpointed, one line names the checkpoint and the command that resumes, the exit code is 130
(SIGINT) or 143 (SIGTERM), and running that command ends exactly where an uninterrupted run ends
(weights bit for bit, the same metrics).

The signal is a real one, sent to this process from inside a training step's loss (the handler
runs in the main thread at the next bytecode, in the middle of the step)."""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from openaligner.cli.main import main
from openaligner.trainer.rm import RMObjective
from openaligner.trainer.sft import SFTObjective

STEPS = 6
SIGNAL_AT_STEP = 3  # not a save_interval step: the checkpoint is the stop's own


def _write_sft(path: Path) -> Path:
    with path.open("w") as f:
        for i in range(48):
            f.write(json.dumps({"prompt": f"repeat {i % 10}:", "response": f" {i % 10}" * 3}) + "\n")
    return path


def _write_pairs(path: Path) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(48):
            row = {
                "prompt": f"q{rng.randint(0, 99)}?",
                "chosen": rng.choice(["yes", "yes!"]),
                "rejected": "no",
            }
            f.write(json.dumps(row) + "\n")
    return path


COMMANDS = {
    "train-sft": (SFTObjective, _write_sft, "sft.jsonl"),
    "train-rm": (RMObjective, _write_pairs, "pairs.jsonl"),
}


def _args(command: str, tmp_path: Path, out: str) -> list[str]:
    _, write, name = COMMANDS[command]
    data = tmp_path / name
    if not data.exists():
        write(data)
    return [
        command,
        f"data.train_path={data}",
        f"output_dir={tmp_path / out}",
        "model.tiny=llama",
        "model.tiny_hidden_size=32",
        "model.tiny_num_layers=1",
        "model.tiny_num_heads=2",
        "model.tiny_max_positions=64",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4",
        f"trainer.max_steps={STEPS}",
        "trainer.save_interval=4",
        "trainer.val_check_interval=0",  # only at the end: the loss's calls are training steps
        "optim.lr=3e-3",
        "progress=false",
        "device=cpu",
    ]


def _signal_in_step(monkeypatch: pytest.MonkeyPatch, objective: type, step: int, signum: int) -> None:
    """Send ``signum`` to this process from the first micro-batch's loss of ``step`` (2 a step)."""
    calls = {"n": 0}
    original = objective.loss

    def loss(self, batch):
        calls["n"] += 1
        if calls["n"] == 2 * (step - 1) + 1:
            os.kill(os.getpid(), signum)
        return original(self, batch)

    monkeypatch.setattr(objective, "loss", loss)


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in rows]


@pytest.mark.parametrize(
    ("command", "signum", "code"),
    [("train-sft", signal.SIGINT, 130), ("train-rm", signal.SIGTERM, 143)],
)
def test_a_signal_checkpoints_the_step_and_the_printed_command_resumes_exactly(
    tmp_path, monkeypatch, capsys, command, signum, code
):
    assert main(_args(command, tmp_path, "straight")) == 0
    capsys.readouterr()

    with monkeypatch.context() as m:
        _signal_in_step(m, COMMANDS[command][0], SIGNAL_AT_STEP, signum)
        assert main(_args(command, tmp_path, "stopped")) == code
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    checkpoint = tmp_path / "stopped" / "checkpoints" / f"step_{SIGNAL_AT_STEP}"
    name = signal.Signals(signum).name
    said = f"stopped by {name}; checkpoint of step {SIGNAL_AT_STEP} written to {checkpoint}"
    assert line.startswith(f"openaligner {command}: {said}"), err
    assert "Traceback" not in err and checkpoint.is_dir()
    assert not (tmp_path / "stopped" / "model.safetensors").exists()  # no final export of a stopped run

    resume = shlex.split(line.split("resume with: ", 1)[1])
    assert resume[0] == "openaligner"
    assert main(resume[1:]) == 0
    assert f"steps {SIGNAL_AT_STEP} → {STEPS}" in capsys.readouterr().out

    straight, resumed = (load_file(tmp_path / d / "model.safetensors") for d in ("straight", "stopped"))
    assert straight.keys() == resumed.keys()
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], rtol=0, atol=0)
    assert _metrics(tmp_path / "stopped") == _metrics(tmp_path / "straight")


def test_a_stop_asked_with_resume_off_prints_a_command_that_resumes(tmp_path, monkeypatch, capsys):
    with monkeypatch.context() as m:
        _signal_in_step(m, SFTObjective, 2, signal.SIGINT)
        assert main([*_args("train-sft", tmp_path, "off"), "resume=false"]) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert "resume=false" not in command and command[-1] == "resume=true"


def test_a_signal_before_the_first_step_stops_at_once_and_says_so(tmp_path, monkeypatch, capsys):
    from openaligner.cli.train_supervised import TRAIN_SFT

    def interrupted_build(cfg):
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the signal stops the command before this line")

    monkeypatch.setattr(TRAIN_SFT, "build", interrupted_build)
    assert main(_args("train-sft", tmp_path, "early")) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    said = "stopped by SIGINT; no checkpoint was written yet, so the same command starts over"
    assert line.startswith(f"openaligner train-sft: {said}"), line


@pytest.mark.parametrize("command", ["train-sft", "train-rm"])
def test_tensorboard_has_no_duplicate_steps_after_a_kill_and_resume(tmp_path, capsys, command):
    """Killed after step 6's metrics were logged but before its checkpoint (the newest is step 4):
    the resumed run runs steps 5 and 6 again, and TensorBoard (on by default) shows each step once."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    args = [*_args(command, tmp_path, "killed"), "trainer.keep_last=0"]
    assert main(args) == 0
    ckpts = tmp_path / "killed" / "checkpoints"
    shutil.rmtree(ckpts / "step_6")
    (ckpts / "latest").write_text("step_4\n")
    assert main(args) == 0
    assert "steps 4 → 6" in capsys.readouterr().out
    steps: dict[str, list[int]] = {}
    files = sorted((tmp_path / "killed" / "tensorboard").glob("events.out.tfevents.*"))
    assert files, "TensorBoard is on by default"
    for path in files:
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                steps.setdefault(value.tag, []).append(event.step)
    assert sorted(steps["train/loss"]) == list(range(1, STEPS + 1)), steps  # files may sort either way
    assert all(len(s) == len(set(s)) for s in steps.values()), steps


def test_save_every_minutes_checkpoints_by_wall_time(tmp_path):
    """With checkpoints by steps only at the end, a tiny wall-time interval checkpoints every step."""
    args = _args("train-sft", tmp_path, "timed")
    extra = ["trainer.save_interval=0", "trainer.save_every_minutes=1e-9", "trainer.keep_last=0"]
    assert main([*args, *extra]) == 0
    steps = sorted(
        int(p.name.removeprefix("step_")) for p in (tmp_path / "timed" / "checkpoints").glob("step_*")
    )
    assert steps == list(range(1, STEPS + 1))
