"""Faults with real processes: SIGKILL of the trainer and of checkpoint writers, a corrupt
checkpoint, the critic server killed mid-run (with and without a restart), and what a server
killed with SIGKILL leaves behind.

The PPO runs are `openaligner train-ppo` subprocesses with a tiny actor against `openaligner
serve-critic` subprocesses (see fault_procs.py); one torch thread each, so two runs of the same
command give the same numbers and a resumed run can be compared with an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from fault_procs import (
    ENV,
    CriticServer,
    Served,
    Trainer,
    free_port,
    kill_tree,
    latest_step,
    stop_cleanly,
    wait_for,
    write_prompts,
)
from procs import short_tmp_dir
from safetensors.torch import load_file
from support import files_under

from openaligner.clients.critic import CriticAddress, RemoteCriticConfig, RemoteGPTRMCriticClient
from openaligner.io import checkpoint as checkpoint_module
from openaligner.io.checkpoint import CheckpointManager, verify_checkpoint
from openaligner.io.metrics import read_jsonl

pytestmark = pytest.mark.reliability  # the tests with real server and trainer processes are also `slow`


def _critic_step_of(trainer_checkpoint: Path) -> int:
    return int(json.loads((trainer_checkpoint / "trainer_state.json").read_text())["critic_step"])


def _same_metrics(a: list[dict], b: list[dict]) -> None:
    """Every metric of every step bit for bit (timings aside)."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key, value in x.items():
            if key.startswith("timing/"):
                continue
            assert y[key] == value, (x["step"], key, value, y[key])


def _same_weights(a: Path, b: Path) -> None:
    """Every tensor bit for bit."""
    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=0, msg=name)


# --------------------------------------------------------------------------- trainer killed (-9)
def _train_once_more(port: int, *, save: bool) -> None:
    """One more critic_train the dead trainer's run would have sent, and (``save``) a durable
    critic_save whose actor checkpoint is never published: a crash between the two halves."""
    cfg = RemoteCriticConfig(critic=CriticAddress(port=port), init_timeout_s=60)
    rows, width = 16, 8
    data = {
        "response_tokens": torch.ones(rows, width, dtype=torch.long),
        "returns": torch.ones(rows, width - 1),
        "values": torch.zeros(rows, width - 1),
        "mask": torch.ones(rows, width - 1),
    }
    with RemoteGPTRMCriticClient(cfg) as client:
        client.train(data).result()
        if save:
            client.save().result()


EVERY_2 = "trainer.save_interval=2"  # two steps between checkpoints: the kill lands between them


class Uninterrupted:
    """The uninterrupted 6-step run both cases compare with (one command, so one run for the
    module): its critic server and trainer start when the first case does and run beside it."""

    def __init__(self, root: Path) -> None:
        self.server = CriticServer(root / "critic")
        self.run = Trainer(root / "run", write_prompts(root / "prompts.jsonl"), self.server.port, 6, EVERY_2)
        self.code: int | None = None

    def finish(self) -> Trainer:
        """The run once it has ended (exit code 0), its critic server stopped."""
        if self.code is None:
            try:
                self.code = self.run.wait()
            finally:
                kill_tree(self.server)
        assert self.code == 0, self.run.output[-3000:]
        return self.run

    def kill(self) -> None:
        self.run.kill()
        kill_tree(self.server)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uninterrupted]:
    ref = Uninterrupted(tmp_path_factory.mktemp("uninterrupted"))
    try:
        yield ref
    finally:
        ref.kill()


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["restarted-a-checkpoint-ahead", "kept-running"])
def test_trainer_killed_after_a_checkpoint_resumes_and_matches_the_uninterrupted_run(
    tmp_path, critic, uninterrupted
):
    """kill -9 of train-ppo right after checkpoint 2 (of a 6-step run), then the same command again;
    the uninterrupted run of the same command (one for both cases: ``uninterrupted``) runs beside
    the first case (each loads the other).
    The interrupted run's critic server merges each step's two critic_infer requests into one
    formed batch (it waits up to 2 s for a batch of 16 rows); the uninterrupted run's answers
    each as it comes (the default 2 ms). Both repeat bit for bit: every metric of every step,
    every response, reward, value and advantage, the actor of every checkpoint and at the end,
    the critic of every checkpoint kept. Without batch-invariant serving the runs differ from
    step 1 (the merged rows are computed at another width).

    Exact resume needs both halves of step 2: the actor checkpoint and the critic the critic
    server saved with it (``trainer_state.json`` records its critic step); the resumed trainer
    sends the server back to that critic (``critic_save`` with ``restore_step``). The server is
    ahead of it in both cases:

    * ``restarted-a-checkpoint-ahead``: a machine crash. The critic server is killed too, and its
      newest checkpoint is one whose actor half was never published (a crash between the two
      halves; made here with one more train and save); restarted, it resumes from that one.
    * ``kept-running``: only the trainer died; the server, never restarted, had trained on (one
      more train, made here: the kill lands before the run's own next train reaches the server).
    """
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    every_2 = EVERY_2
    merging = ("server.inference_micro_batch_size=[16]", "server.max_queue_delay_microseconds=2000000")
    server = CriticServer(tmp_path / "cut" / "critic", None, *merging)
    cut = Trainer(tmp_path / "cut" / "run", prompts, server.port, 6, every_2)
    restarted: list[CriticServer] = []
    try:
        # kill as soon as step 2 is checkpointed on both sides (the trainer goes on meanwhile)
        wait_for(
            lambda: latest_step(server.ckpt_dir) >= 2 and cut.latest_step() >= 2,
            timeout_s=240,
            what="checkpoint 2 of the actor and the critic",
            poll_s=0.005,
        )
        kill_tree(cut)
        assert cut.latest_step() == 2, "the kill came too late: step 4 was already checkpointed"
        assert _critic_step_of(cut.checkpoints / "step_2") == latest_step(server.ckpt_dir) == 2
        if critic == "restarted-a-checkpoint-ahead":
            kill_tree(server)
            restarted.append(CriticServer(server.ckpt_dir, server.port, *merging))
            assert restarted[-1].wait_ready() == "2"
            _train_once_more(server.port, save=True)
            kill_tree(restarted[-1])
            restarted.append(CriticServer(server.ckpt_dir, server.port, *merging))
            assert restarted[-1].wait_ready() == "3"  # ahead of the actor's step_2
        else:
            _train_once_more(server.port, save=False)  # at critic step 3, in memory only
        again = Trainer(cut.out, prompts, server.port, 6, every_2)  # the same command
        assert again.wait() == 0, again.output[-3000:]
        ref = uninterrupted.finish()
    finally:
        for s in (server, *restarted):
            kill_tree(s)
        cut.kill()
    assert "resumed from" in again.output and "step_2" in again.output
    assert "not an exact continuation" not in again.output  # the critic server matched the checkpoint
    # the resumed run's metrics are the uninterrupted run's, every step once (steps logged before
    # the kill and run again were dropped at resume)
    straight = read_jsonl(ref.out / "logs" / "metrics.jsonl")
    resumed = read_jsonl(cut.out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    _same_metrics(straight, resumed)
    # the rollout log too: each step's 16 responses once, those of the uninterrupted run
    ref_rollouts = read_jsonl(ref.out / "logs" / "rollouts.jsonl")
    cut_rollouts = read_jsonl(cut.out / "logs" / "rollouts.jsonl")
    every_response = [(s, i) for s in range(1, 7) for i in range(16)]
    assert [(r["step"], r["sample"]) for r in cut_rollouts] == every_response
    for a, b in zip(ref_rollouts, cut_rollouts, strict=True):
        assert (a["prompt"], a["response"]) == (b["prompt"], b["response"]), (a["step"], a["sample"])
        for key in ("reward", "kl", "value", "advantage"):
            assert b[key] == a[key], (a["step"], a["sample"], key)
    _same_weights(ref.out / "actor" / "model.safetensors", cut.out / "actor" / "model.safetensors")
    for step in (2, 4, 6):  # every actor checkpoint, before the kill and after the resume
        _same_weights(
            ref.checkpoints / f"step_{step}" / "actor" / "model.safetensors",
            cut.checkpoints / f"step_{step}" / "actor" / "model.safetensors",
        )
    ref_critic = uninterrupted.server.ckpt_dir
    kept = sorted(p.name for p in ref_critic.glob("step_*"))  # the critic keeps the newest
    assert "step_6" in kept
    for name in kept:
        _same_weights(
            ref_critic / name / "critic" / "model.safetensors",
            server.ckpt_dir / name / "critic" / "model.safetensors",
        )
    assert "the critic server went back to critic step 2, saved with" in again.output


# --------------------------------------------------------------------------- checkpoint writes killed
FILES = {"model.safetensors": 6 << 20, "optimizer.pt": 3 << 20, "sub/state.json": 64}
"""A checkpoint's files and sizes (~9 MB): big enough that a write takes a while."""


def _contents(step: int, size: int) -> bytes:
    unit = f"step {step}|".encode()
    return (unit * (size // len(unit) + 1))[:size]


def _write(step: int, stall: Callable[[], None] | None = None) -> Callable[[Path], None]:
    """Fills a checkpoint directory in 1 MB chunks; ``stall`` is called halfway through the second file."""

    def write(d: Path) -> None:
        for i, (name, size) in enumerate(FILES.items()):
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            data = _contents(step, size)
            with (d / name).open("wb") as f:
                for start in range(0, size, 1 << 20):
                    if stall is not None and i == 1 and start >= size // 2:
                        stall()
                    f.write(data[start : start + (1 << 20)])

    return write


def _holds(path: Path, step: int) -> bool:
    return all((path / name).read_bytes() == _contents(step, size) for name, size in FILES.items())


def _stop_here(conn) -> None:
    """In the writer process: tell the test where it is, then wait to be killed."""
    conn.send("here")
    time.sleep(60)


def _writer(root: Path, step: int, conn, where: str, keep_last: int) -> None:
    """The process killed mid-save: saves ``step`` under ``root`` and stops at ``where``.

    The hooks replace functions of this process only (it is a fork of the test), so the code that
    runs is the real CheckpointManager.save up to the chosen point.
    """
    cm = checkpoint_module
    stall = None
    if where == "writing files":
        stall = lambda: _stop_here(conn)  # noqa: E731
    elif where == "hashing files":
        real_sha = cm._sha256
        calls = []

        def sha(p: Path) -> str:
            calls.append(p)
            if len(calls) == 2:
                _stop_here(conn)
            return real_sha(p)

        cm._sha256 = sha
    elif where in ("sealed, not renamed", "renamed, latest not updated"):
        real_fsync = cm._fsync

        def sealed(p: Path) -> bool:  # the temporary directory, synced once its manifest is in
            return p.name.startswith(".tmp-step_") and (p / "manifest.json").is_file()

        def renamed(p: Path) -> bool:  # the root, synced after the rename into place
            return p == root and (root / f"step_{step}").is_dir()

        def fsync(p: Path) -> None:
            real_fsync(p)
            if (sealed if where == "sealed, not renamed" else renamed)(p):
                _stop_here(conn)

        cm._fsync = fsync
    elif where == "replacing the same step":
        real_replace = os.replace

        def replace(src, dst) -> None:
            real_replace(src, dst)
            if Path(dst).name.startswith(".old-step_"):
                _stop_here(conn)

        cm.os.replace = replace
    elif where == "writing the latest pointer":
        real_replace = os.replace

        def replace(src, dst) -> None:
            if Path(dst).name == "latest":
                _stop_here(conn)  # the new pointer is written next to the old one, not yet in place
            real_replace(src, dst)

        cm.os.replace = replace
    elif where == "pruning old checkpoints":
        real_rmtree = cm.shutil.rmtree

        def rmtree(p, *args, **kwargs) -> None:
            if Path(p).name.startswith("step_"):
                (Path(p) / "model.safetensors").unlink()  # the deletion is under way
                _stop_here(conn)
            real_rmtree(p, *args, **kwargs)

        cm.shutil.rmtree = rmtree
    CheckpointManager(root, keep_last=keep_last).save(step, _write(step, stall))
    conn.send("finished")


KILL_POINTS = [
    # (where the writer is killed, step it saves, the step `latest()` must return afterwards)
    ("writing files", 3, 2),
    ("hashing files", 3, 2),
    ("sealed, not renamed", 3, 2),
    ("renamed, latest not updated", 3, 2),  # step_3 is complete but was never named latest
    ("writing the latest pointer", 3, 2),
    ("replacing the same step", 2, 1),  # a re-save of step 2: the old copy moved aside, the new not in
    ("pruning old checkpoints", 3, 3),  # step_3 published; step_1 half deleted
]


@pytest.mark.parametrize(
    ("where", "step", "expected"),
    KILL_POINTS,
    ids=[k[0].replace(", ", "-").replace(" ", "-") for k in KILL_POINTS],
)
def test_sigkill_during_a_checkpoint_write_leaves_a_complete_checkpoint(
    tmp_path, caplog, where, step, expected
):
    root = tmp_path / "ckpt"
    keep_last = 2 if where == "pruning old checkpoints" else 0
    for s in (1, 2):
        CheckpointManager(root, keep_last=keep_last).save(s, _write(s))
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    writer = ctx.Process(target=_writer, args=(root, step, theirs, where, keep_last))
    writer.start()
    try:
        assert ours.poll(60) and ours.recv() == "here", f"the writer never reached {where!r}"
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)
    finally:
        if writer.is_alive():
            writer.kill()
    assert writer.exitcode == -signal.SIGKILL
    manager = CheckpointManager(root, keep_last=keep_last)
    with caplog.at_level(logging.WARNING, logger="openaligner.io.checkpoint"):
        latest = manager.latest()
    assert latest == root / f"step_{expected}" and _holds(latest, expected)
    if where == "replacing the same step":  # `latest` names the step that is missing now
        assert f"skipping checkpoint {root / 'step_2'}: no manifest (the write did not finish)" in caplog.text
    else:
        assert caplog.text == ""
    if where == "writing the latest pointer":
        assert list(root.glob(".latest.tmp-*"))  # the pointer that never replaced `latest`
    # the next save of the restarted run works and removes what the killed writer left behind
    manager.save(4, _write(4))
    assert manager.latest() == root / "step_4" and _holds(root / "step_4", 4)
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # no leftover of any kind
    for _, path in manager.checkpoints():
        assert verify_checkpoint(path) is None, path


def _save_forever(root: Path, first_step: int) -> None:
    manager = CheckpointManager(root, keep_last=2)
    for step in range(first_step, first_step + 10_000):
        manager.save(step, _write(step))


def test_sigkill_at_random_moments_of_repeated_saves_never_loses_the_last_complete_checkpoint(tmp_path):
    """Like a training run killed and restarted over and over: each writer continues after the
    checkpoint its predecessor left, and is killed at a random moment."""
    rng = random.Random(0)
    ctx = multiprocessing.get_context("fork")
    root = tmp_path / "ckpt"
    CheckpointManager(root).save(0, _write(0))
    saved = 0
    for trial in range(6):
        writer = ctx.Process(target=_save_forever, args=(root, saved + 1))
        writer.start()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)
        latest = CheckpointManager(root, keep_last=2).latest()
        assert latest is not None, f"trial {trial}: no checkpoint survived"
        previous, saved = saved, int(latest.name.removeprefix("step_"))
        assert saved >= previous and _holds(latest, saved), (trial, latest)
        for step, path in CheckpointManager(root).checkpoints():
            if verify_checkpoint(path) is None:
                assert _holds(path, step), (trial, path)
    assert saved > 0  # the writers made progress between the kills


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("flip a byte", "model.safetensors does not match its checksum"),
        ("truncate", f"model.safetensors has {1 << 20} bytes, expected {6 << 20}"),
        ("delete a file", "missing file optimizer.pt"),
        ("garble the manifest", "unreadable manifest"),
    ],
    ids=["flipped-byte", "truncated", "missing-file", "garbled-manifest"],
)
def test_corrupt_latest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path, caplog, damage, reason):
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root)
    manager.save(1, _write(1))
    bad = manager.save(2, _write(2))
    weights = bad / "model.safetensors"
    if damage == "flip a byte":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        with weights.open("r+b") as f:
            f.truncate(1 << 20)
    elif damage == "delete a file":
        (bad / "optimizer.pt").unlink()
    else:
        (bad / "manifest.json").write_text('{"files": ')
    with caplog.at_level(logging.WARNING, logger="openaligner.io.checkpoint"):
        assert manager.latest() == root / "step_1"
    assert f"skipping checkpoint {bad}: {reason}" in caplog.text


# --------------------------------------------------------------------------- critic server killed
@pytest.mark.slow
def test_critic_server_killed_and_not_restarted_stops_the_trainer_naming_the_server(tmp_path):
    """Two runs share a critic server that is SIGKILLed (its whole process group) mid-run and not
    restarted: with the default reconnect_grace_s=0 the trainer stops at once; with 3 s it stops
    3 s later. Both exit 1 with a message naming host:port and model and how to resume."""
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    server = CriticServer(tmp_path / "critic")
    at_once = Trainer(tmp_path / "at_once", prompts, server.port, 500)
    patient = Trainer(tmp_path / "patient", prompts, server.port, 500, "remote.reconnect_grace_s=3")
    try:
        wait_for(lambda: at_once.latest_step() >= 2 and patient.latest_step() >= 2, 240, "both runs to train")
        killed = time.monotonic()
        kill_tree(server)
        assert at_once.wait(60) == 1, at_once.output[-3000:]
        at_once_s = time.monotonic() - killed
        assert patient.wait(60) == 1, patient.output[-3000:]
        patient_s = time.monotonic() - killed
    finally:
        for p in (server, at_once, patient):
            kill_tree(p)
    where = f"critic server http://127.0.0.1:{server.port} (model 'critic_"
    for run in (at_once, patient):
        assert where in run.output, run.output[-3000:]
        assert "The run stopped at step" in run.output and "the same command resumes from" in run.output
        assert "Traceback" not in run.output
    assert "reconnect_grace_s=0: the client does not wait for a restarted server" in at_once.output, (
        at_once.output[-3000:]
    )
    grace_gone = "did not answer again within remote.reconnect_grace_s=3 s"
    assert grace_gone in patient.output, patient.output[-3000:]
    assert "Restart the server, or raise remote.reconnect_grace_s" in patient.output
    # the grace bounds the wait: at least the grace, at most the grace plus closing (5 s) and exit
    assert at_once_s < 20, at_once_s
    assert 3 <= patient_s < 3 + 20, patient_s


@pytest.mark.slow
def test_critic_server_restarted_within_the_grace_lets_the_run_finish(tmp_path):
    """The critic server is SIGKILLed mid-run and restarted on the same port; its newest checkpoint
    is corrupt (a flipped byte), so it resumes from the one before, with a warning. The trainer
    (reconnect_grace_s=120) waits, resends, and finishes; it reports that the critic went back."""
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    server = CriticServer(tmp_path / "critic")
    run = Trainer(tmp_path / "run", prompts, server.port, 8, "remote.reconnect_grace_s=120")
    restarted: list[CriticServer] = []
    try:
        wait_for(lambda: latest_step(server.ckpt_dir) >= 2, 240, "the critic's checkpoint 2")
        kill_tree(server)
        newest = server.ckpt_dir / f"step_{latest_step(server.ckpt_dir)}"
        weights = newest / "critic" / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0xFF
        weights.write_bytes(bytes(data))
        restarted.append(CriticServer(server.ckpt_dir, port=server.port))
        resumed_at = int(restarted[0].wait_ready())
        assert run.wait() == 0, run.output[-3000:]
    finally:
        for p in (server, run, *restarted):
            kill_tree(p)
    assert resumed_at == int(newest.name.removeprefix("step_")) - 1
    assert f"skipping checkpoint {newest}: critic/model.safetensors does not match its checksum" in (
        restarted[0].output
    )
    assert "waiting up to reconnect_grace_s=120 s" in run.output and "answers again" in run.output
    assert "not an exact continuation" in run.output  # the critic lost what it trained after resumed_at
    rows = read_jsonl(run.out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (run.out / "actor" / "model.safetensors").is_file()


# --------------------------------------------------------------------------- a server killed (-9)
@pytest.mark.slow
def test_what_a_killed_server_left_is_removed_when_the_next_one_starts():
    """SIGKILL of a whole server, Triton included (a machine or container failure), leaves its
    workspace behind; the next server started on the same machine removes it — and nothing of a
    live server. Both use a private temp directory, where the default workspace_dir lies."""
    with short_tmp_dir() as tmp:
        env = {**ENV, "TMPDIR": str(tmp)}
        args = [sys.executable, "-m", "openaligner", "serve-reward", "model.tiny=gpt2", "threads=1"]
        killed = Served([*args, f"server.port={free_port()}"], env=env)
        try:
            killed.wait_ready()
        finally:
            kill_tree(killed)
        left = files_under(tmp)
        assert left, "expected the killed server's workspace to be left behind"
        later = Served([*args, f"server.port={free_port()}"], env=env)
        try:
            later.wait_ready()
            after_start = files_under(tmp)
            copies = [c for c in Path("/tmp").glob("folder??????/config.pbtxt") if str(tmp) in c.read_text()]
            code, _ = stop_cleanly(later, signal.SIGTERM)
        finally:
            kill_tree(later)
        assert not left & after_start, sorted(left & after_start)[:5]  # the dead server's files are gone
        assert after_start and not copies  # the live server's are there, and only there
        assert code == 0 and not files_under(tmp)  # and removed when it stops
