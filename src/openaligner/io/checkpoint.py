"""Atomic, verifiable checkpoint directories with a ``latest`` pointer, retention and best-by-metric.

Owns the file layout (``<root>/step_<N>``, ``manifest.json`` with sizes and SHA-256, ``latest``)
and crash safety (written aside, fsynced, renamed into place). Must not know what the files
contain. Design notes: docs/reliability.md, "Module notes".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    """Flush ``path`` to the disk: a file's data, or a directory's entries (names created,
    renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file under ``root``, then every directory, the deepest first, ``root`` last."""
    paths = sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True)
    for p in paths:
        if p.is_file():
            _fsync(p)
    for p in paths:
        if p.is_dir():
            _fsync(p)
    _fsync(root)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new content, never a mix.

    Durable once it returns: the new file is flushed before the rename and its directory after.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` can only set it, and setting it
    even for a moment would race with another thread creating a file)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc (not Linux): the only portable way to read it
    os.umask(mask)
    return mask


def give_default_modes(root: Path) -> None:
    """Give the weight files (``*.safetensors``) under ``root`` the mode every other file there has:
    ``0o666`` less the umask (``0o644`` as usual).

    safetensors (0.8) writes a file through a temporary file and renames it into place, and a
    temporary file is created ``0o600``: model weights came out ``0o600`` beside ``0o644`` configs and
    tokenizers, so a reader of the directory in the same group (a serving user, a shared cache)
    found the config but not the weights.
    """
    mode = 0o666 & ~_umask()
    for p in Path(root).rglob("*.safetensors"):
        if p.is_file() and p.stat().st_mode & 0o777 != mode:
            os.chmod(p, mode)


def human_size(n_bytes: float) -> str:
    """``n_bytes`` for a reader, in decimal units as disks are sold: ``3.24 GB``, ``512 kB``."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n_bytes) < 1000:
            return f"{n_bytes:.3g} {unit}"
        n_bytes /= 1000
    return f"{n_bytes:.3g} TB"


def directory_size(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def file_entry(path: Path) -> dict[str, Any]:
    """A manifest's entry for one file: its size in bytes and its SHA-256."""
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def verify_checkpoint(path: Path) -> str | None:
    """``None`` if ``path`` is a complete checkpoint, else the reason it is not."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the write did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"unreadable manifest: {e}"
    for rel, entry in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            return f"missing file {rel}"
        if f.stat().st_size != entry["size"]:
            return f"{rel} has {f.stat().st_size} bytes, expected {entry['size']}"
        if _sha256(f) != entry["sha256"]:
            return f"{rel} does not match its checksum"
    return None


class CheckpointManager:
    """Writes and finds checkpoints under ``root``.

    Args:
        root: directory holding ``step_<N>`` checkpoints and the ``latest`` pointer.
        keep_last: keep this many newest checkpoints (plus the best one); ``0`` keeps all.
        best_metric: name of the metric that picks the best checkpoint (e.g. ``val_rewards``);
            ``None`` disables best tracking.
        best_mode: ``max`` or ``min``.
    """

    def __init__(
        self, root: str | Path, keep_last: int = 0, best_metric: str | None = None, best_mode: str = "max"
    ) -> None:
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.best_metric = best_metric
        self.best_mode = best_mode

    def save(self, step: int, write: Callable[[Path], None], metrics: dict[str, float] | None = None) -> Path:
        """Create ``step_<step>`` by calling ``write(tmp_dir)``, then seal and publish it.

        ``write`` fills a fresh temporary directory; only after it returns are checksums
        recorded, the directory renamed into place and ``latest`` updated. A crash at any point
        leaves the previous checkpoint and pointer intact. When it returns the checkpoint is
        durable: its files and directories, the rename and the pointer are fsynced.

        The two halves, :meth:`stage` and :meth:`publish`, are public for writers that fill the
        directory from several processes (every rank of a sharded model writes its own files).
        """
        tmp = self.stage(step)
        write(tmp)
        return self.publish(step, tmp, metrics)

    def stage(self, step: int) -> Path:
        """A fresh, empty temporary directory for ``step_<step>`` (a hidden sibling of the
        checkpoints, replaced if a crashed writer left one); fill it, then :meth:`publish` it."""
        if not self.root.is_dir():
            self.root.mkdir(parents=True)
            _fsync(self.root.parent)
        tmp = self.root / f".tmp-step_{step}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        return tmp

    def publish(
        self,
        step: int,
        tmp: Path,
        metrics: dict[str, float] | None = None,
        checksums: Mapping[str, dict[str, Any]] | None = None,
    ) -> Path:
        """Seal ``tmp`` (a filled :meth:`stage` directory) as ``step_<step>``: checksum every file
        into the manifest, fsync, rename it into place, point ``latest`` at it, prune; returns it.
        Every file must be complete when this is called (writers on other processes included).

        Args:
            checksums: :func:`file_entry` of files already hashed (by the processes that wrote
                them, in parallel), by path relative to ``tmp``; the other files are hashed here.
        """
        final = self.root / f"step_{step}"
        known = checksums or {}
        give_default_modes(tmp)
        files: dict[str, dict[str, Any]] = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_file():
                rel = str(p.relative_to(tmp))
                files[rel] = known.get(rel) or file_entry(p)
        # Data before the manifest that vouches for it: a power loss must not leave a manifest
        # that names files the disk never received.
        _fsync_tree(tmp)
        manifest = {"step": step, "metrics": metrics or {}, "files": files}
        write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        if final.exists():
            # Re-saving a step (e.g. after a resume) replaces it; move the old one aside first so
            # the rename below is atomic.
            trash = self.root / f".old-step_{step}-{os.getpid()}"
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
        _fsync(self.root)
        write_text_atomic(self.root / LATEST, final.name + "\n")
        self._prune()
        kept = len(self.checkpoints())
        keep = f"keep_last={self.keep_last}" if self.keep_last > 0 else "keep_last=0 keeps all"
        log.info(
            "checkpoint %s written: %s (%d checkpoint(s) kept, %s)",
            final,
            human_size(directory_size(final)),
            kept,
            keep,
        )
        return final

    def checkpoints(self) -> list[tuple[int, Path]]:
        """All ``step_<N>`` directories, complete or not, sorted by step."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or ``None``; incomplete ones are skipped with a warning."""
        return next(self.complete(), None)

    def complete(self) -> Iterator[Path]:
        """Complete checkpoints, newest first: the one ``latest`` names, then the others by step,
        newest first. Each is verified when reached; incomplete ones are skipped with a warning."""
        pointer = self.root / LATEST
        candidates = [p for _, p in reversed(self.checkpoints())]
        if pointer.is_file():
            named = self.root / pointer.read_text().strip()
            candidates = [named] + [p for p in candidates if p != named]
        for path in candidates:
            problem = verify_checkpoint(path)
            if problem is None:
                yield path
            else:
                log.warning("skipping checkpoint %s: %s", path, problem)

    def metrics_of(self, path: Path) -> dict[str, Any]:
        return dict(json.loads((path / MANIFEST).read_text()).get("metrics", {}))

    def best(self) -> Path | None:
        """The complete checkpoint with the best ``best_metric``, or ``None``."""
        if self.best_metric is None:
            return None
        scored = []
        for _, p in self.checkpoints():
            if verify_checkpoint(p) is None:
                value = self.metrics_of(p).get(self.best_metric)
                if value is not None:
                    scored.append((float(value), p))
        if not scored:
            return None
        return (max if self.best_mode == "max" else min)(scored, key=lambda t: t[0])[1]

    def _prune(self) -> None:
        # Leftovers of writers that crashed: never published, safe to delete.
        for pattern in (".tmp-step_*", ".old-step_*"):
            for leftover in self.root.glob(pattern):
                if leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
        for leftover in self.root.glob(f".{LATEST}.tmp-*"):
            leftover.unlink(missing_ok=True)
        if self.keep_last <= 0:
            return
        all_ckpts = self.checkpoints()
        keep = {p for _, p in all_ckpts[-self.keep_last :]}
        best = self.best()
        if best is not None:
            keep.add(best)
        for _, p in all_ckpts:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    """Every RNG a run draws from: Python, NumPy, torch CPU and (when present) CUDA."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
