import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from openaligner.io import checkpoint
from openaligner.io.checkpoint import (
    CheckpointManager,
    file_entry,
    rng_state,
    set_rng_state,
    verify_checkpoint,
)


def _writer(payload: str):
    def write(d):
        (d / "weights.bin").write_text(payload)
        (d / "sub").mkdir()
        (d / "sub" / "state.json").write_text("{}")

    return write


def test_stage_and_publish_take_the_checksums_other_writers_computed(tmp_path, monkeypatch):
    """What a sharded save does: other processes fill the staged directory and hash their files."""
    mgr = CheckpointManager(tmp_path)
    staged = mgr.stage(3)
    _writer("a")(staged)
    known = {"weights.bin": file_entry(staged / "weights.bin")}  # hashed by the writer
    hashed, sha256 = [], checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda p: hashed.append(p.name) or sha256(p))
    final = mgr.publish(3, staged, {"val_rewards": 1.0}, known)
    assert hashed == ["state.json"]  # only what no writer hashed
    assert final == tmp_path / "step_3" and mgr.latest() == final and not staged.exists()
    assert verify_checkpoint(final) is None and mgr.metrics_of(final) == {"val_rewards": 1.0}


def test_save_publishes_complete_checkpoint_and_latest(tmp_path):
    mgr = CheckpointManager(tmp_path)
    p1 = mgr.save(1, _writer("a"))
    p2 = mgr.save(2, _writer("b"))
    assert verify_checkpoint(p1) is None and verify_checkpoint(p2) is None
    assert mgr.latest() == p2
    assert (tmp_path / "latest").read_text().strip() == "step_2"
    assert not list(tmp_path.glob(".tmp-*"))


def test_crash_inside_write_leaves_previous_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path)
    good = mgr.save(1, _writer("a"))

    def crashing(d):
        (d / "weights.bin").write_text("partial")
        raise KeyboardInterrupt  # the process dies mid-write

    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, crashing)
    assert mgr.latest() == good
    assert not (tmp_path / "step_2").exists()
    # the next successful save cleans the leftover temporary directory
    mgr.save(3, _writer("c"))
    assert not list(tmp_path.glob(".tmp-*"))


def test_corrupt_or_incomplete_checkpoints_are_skipped_with_warning(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _writer("a"))
    p2 = mgr.save(2, _writer("bbbb"))
    (p2 / "weights.bin").write_text("bxbb")  # same size, different bytes
    with caplog.at_level(logging.WARNING):
        assert mgr.latest() == tmp_path / "step_1"
    assert "checksum" in caplog.text
    (tmp_path / "step_3").mkdir()  # a directory with no manifest, e.g. copied by hand halfway
    assert mgr.latest() == tmp_path / "step_1"
    (tmp_path / "step_1" / "sub" / "state.json").unlink()
    assert mgr.latest() is None
    assert "missing file" in caplog.text


def test_keep_last_keeps_best(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, best_metric="val_rewards", best_mode="max")
    for step, reward in [(1, 0.1), (2, 0.9), (3, 0.2), (4, 0.3), (5, 0.4)]:
        mgr.save(step, _writer(str(step)), {"val_rewards": reward})
    assert [s for s, _ in mgr.checkpoints()] == [2, 4, 5]
    assert mgr.best() == tmp_path / "step_2"
    assert mgr.latest() == tmp_path / "step_5"


def test_resave_same_step_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _writer("a"))
    p = mgr.save(1, _writer("zz"))
    assert (p / "weights.bin").read_text() == "zz" and verify_checkpoint(p) is None


def test_rng_state_round_trip():
    state = rng_state()
    a = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(2))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_save_fsyncs_files_directories_the_rename_and_the_pointer(tmp_path, monkeypatch):
    """Atomic is not durable: after a power loss a renamed directory can hold empty files unless
    the data, the directories and the renames were flushed. Every os.fsync is recorded by the
    path its descriptor names."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name a descriptor's path")
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(1, _writer("a"))
    synced: list[Path] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    root = mgr.root
    mgr.save(2, _writer("b"))
    tmp = [p for p in synced if p.parent == root and p.name.startswith(".tmp-step_2")]
    assert tmp, f"the temporary directory was never synced: {synced}"
    tmp_dir = tmp[0]
    for rel in ("weights.bin", "sub/state.json", "sub"):
        assert tmp_dir / rel in synced, rel  # the data, and the directory entry of sub/
    manifest = [i for i, p in enumerate(synced) if p.parent == tmp_dir and p.name.startswith(".manifest")]
    # the data is on the disk before the manifest that vouches for it, and the manifest's rename
    assert manifest and synced.index(tmp_dir / "weights.bin") < manifest[0]
    sealed = synced.index(tmp_dir, manifest[0])
    renamed = synced.index(root, sealed)  # the parent after the rename into place
    pointer = [i for i, p in enumerate(synced) if p.name.startswith(".latest.tmp-")]
    assert pointer and renamed < pointer[0], "the pointer was not flushed after the rename"
    assert synced[-1] == root, "the pointer's rename was not flushed"
    assert (root / "step_2" / "weights.bin").read_text() == "b" and mgr.latest() == root / "step_2"


def test_complete_lists_complete_checkpoints_newest_first(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        mgr.save(step, _writer(str(step)))
    (tmp_path / "step_3" / "weights.bin").write_text("x")  # corrupt the newest
    with caplog.at_level(logging.WARNING):
        assert list(mgr.complete()) == [tmp_path / "step_2", tmp_path / "step_1"]
    assert f"skipping checkpoint {tmp_path / 'step_3'}" in caplog.text
