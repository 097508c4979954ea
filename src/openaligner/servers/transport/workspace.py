"""Where a Triton server's files and processes live on this machine, and what dead servers left.

Owns one directory per running server under ``server.workspace_dir`` (PyTriton's workspace,
tritonserver's log), telling live servers from dead ones by an ``flock``, finding a workspace's
processes through ``/proc``, and removing what dead servers left (:func:`remove_dead_servers`).
Must not know about PyTriton's API, HTTP, or what is served.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

LOGGER = logging.getLogger(__name__)

SERVER_PREFIX = "server-"
"""Name prefix of a live or dead server's directory under the workspace root."""
_STARTING_PREFIX = ".starting-"
"""A directory being set up (not yet locked); other servers leave it alone for a minute."""
LEGACY_PREFIX = "openaligner-triton-"
"""Earlier versions made ``<tmp>/openaligner-triton-*`` per server and let tritonserver copy
every model to ``/tmp/folderXXXXXX``; both are removed once no live process uses them."""
LEGACY_MIN_AGE_S = 60.0
"""A legacy leftover younger than this is left alone: its server may still be starting."""
SHM_PREFIX = "pytrtion"
"""(sic) PyTriton names the python backend's shared-memory regions ``/dev/shm/pytrtion<pid>-...``
after the pid of the process that started Triton; they stay behind when Triton is killed."""


def default_root() -> Path:
    """``<tmp>/openaligner-servers-<uid>``: one root per user, so users never share directories."""
    return Path(tempfile.gettempdir()) / f"openaligner-servers-{os.getuid()}"


@dataclass(frozen=True)
class Proc:
    """A process as seen at one moment: pid, the kernel's start time (so a reused pid is not taken
    for it) and its command name."""

    pid: int
    start_ticks: int
    name: str

    def alive(self) -> bool:
        """Whether this very process still runs (not a zombie, pid not reused)."""
        stat = _stat(self.pid)
        return stat is not None and stat[2] == self.start_ticks and stat[1] != "Z"


class ServerWorkspace:
    """One server's directory, locked for the life of the server.

    Create it with :meth:`create`; :meth:`release` ends every process of it, removes it and drops
    the lock.
    """

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._lock_fd: int | None = lock_fd
        self._python_envs_before = _python_envs()
        self._own_python_envs: set[Path] | None = None

    @classmethod
    def create(cls, root: str | Path | None = None) -> ServerWorkspace:
        """Remove what dead servers left under ``root`` (and in the temp directory, from earlier
        versions), then make and lock a new server directory there.

        Raises:
            OSError: ``root`` cannot be created or written.
        """
        root = Path(root) if root is not None else default_root()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        remove_dead_servers(root)
        remove_legacy_leftovers(Path(tempfile.gettempdir()))
        # Locked under a hidden name, then renamed: no other server ever sees it unlocked.
        starting = Path(tempfile.mkdtemp(prefix=_STARTING_PREFIX, dir=root))
        fd = os.open(starting, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = root / f"{SERVER_PREFIX}{os.getpid()}-{starting.name.removeprefix(_STARTING_PREFIX)}"
        starting.rename(path)
        return cls(path, fd)

    @property
    def triton_dir(self) -> Path:
        """PyTriton's workspace (it creates the directory itself, and must find it absent)."""
        return self.path / "workspace"

    @property
    def log_path(self) -> Path:
        """Where tritonserver writes its log unless told otherwise."""
        return self.path / "tritonserver.log"

    def started(self) -> None:
        """Note that Triton is up: the ``/tmp/python_env_*`` directories made since :meth:`create`
        are this server's (its python backend makes one at start and never removes it when Triton
        exits at once)."""
        self._own_python_envs = _python_envs() - self._python_envs_before

    def processes(self) -> list[Proc]:
        """The processes running a program from this workspace, and their descendants."""
        return processes_under(self.path)

    def release(self, known: list[Proc] | None = None, grace_s: float = 2.0) -> None:
        """Return once every process of this workspace has exited, then delete the directory.

        ``known`` are processes seen earlier (a python-backend stub's helpers re-parent to init
        when the stub dies and are no longer found from the workspace). Each gets ``grace_s`` to
        exit on its own, then SIGKILL. Also removes this server's ``/tmp/python_env_*`` directories
        (see :meth:`started`) when they are empty. Safe to call twice.
        """
        end_processes([*(known or []), *self.processes()], grace_s)
        shutil.rmtree(self.path, ignore_errors=True)
        remove_unused_shared_memory(os.getpid())
        own = self._own_python_envs
        for env in own if own is not None else _python_envs() - self._python_envs_before:
            with contextlib.suppress(OSError):
                env.rmdir()  # only if empty
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = None


def remove_dead_servers(root: Path) -> list[Path]:
    """Remove the server directories under ``root`` whose server is gone (its lock is free),
    after ending any process still running from them. Returns what was removed."""
    removed = []
    now = time.time()
    starting = [p for p in root.glob(f"{_STARTING_PREFIX}*") if not _young(p, now, LEGACY_MIN_AGE_S)]
    for path in sorted([*root.glob(f"{SERVER_PREFIX}*"), *starting]):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its server is alive
            end_processes(processes_under(path), grace_s=0.0)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        LOGGER.info("removed %d workspace(s) of stopped servers under %s", len(removed), root)
    for region in Path("/dev/shm").glob(f"{SHM_PREFIX}*"):
        owner = region.name.removeprefix(SHM_PREFIX).split("-", 1)[0]
        if owner.isdigit() and _stat(int(owner)) is None:  # the process that started that Triton is gone
            with contextlib.suppress(OSError):
                region.unlink()
    return removed


def remove_unused_shared_memory(owner_pid: int) -> None:
    """Unlink the python backend's shared-memory regions of Tritons started by ``owner_pid`` that
    no process of that Triton maps any more (others of the same process keep theirs)."""
    regions = list(Path("/dev/shm").glob(f"{SHM_PREFIX}{owner_pid}-*"))
    if not regions:
        return
    mapped: set[str] = set()
    for pid in _descendants_in(_process_table(), owner_pid):
        with contextlib.suppress(OSError):
            mapped.update(
                line.rsplit(" ", 1)[-1]
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                if "/dev/shm/" in line
            )
    for region in regions:
        if str(region) not in mapped:
            with contextlib.suppress(OSError):
                region.unlink()


def remove_legacy_leftovers(tmp: Path, min_age_s: float = LEGACY_MIN_AGE_S) -> list[Path]:
    """Remove ``tmp/openaligner-triton-*`` workspaces of earlier versions, and the ``/tmp/folder*``
    model copies tritonserver made for them, once no live process uses them. Returns what was
    removed."""
    if not any(tmp.glob(f"{LEGACY_PREFIX}*")) and not any(Path("/tmp").glob("folder??????")):
        return []
    in_use = _command_lines()
    now = time.time()
    removed = []
    for path in tmp.glob(f"{LEGACY_PREFIX}*"):
        if _young(path, now, min_age_s) or any(str(path) in c for c in in_use):
            continue
        end_processes(processes_under(path), grace_s=0.0)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for config in Path("/tmp").glob("folder??????/config.pbtxt"):
        copy = config.parent
        try:
            text = config.read_text(errors="replace")
        except OSError:
            continue
        owner = _legacy_owner(text, tmp)
        if owner is None or _young(copy, now, min_age_s) or owner.exists():
            continue  # not ours, too young, or its server's workspace is still there
        if any(str(copy) in c for c in in_use):
            continue
        shutil.rmtree(copy, ignore_errors=True)
        removed.append(copy)
    if removed:
        LOGGER.info("removed %d leftover(s) of stopped servers of an earlier version", len(removed))
    return removed


def _legacy_owner(config_text: str, tmp: Path) -> Path | None:
    """The legacy server directory a model copy's config names, if any."""
    marker = f"{tmp}/{LEGACY_PREFIX}"
    start = config_text.find(marker)
    if start < 0:
        return None
    end = config_text.find("/", start + len(marker))
    return Path(config_text[start:end]) if end > 0 else None


def _young(path: Path, now: float, min_age_s: float) -> bool:
    try:
        return now - path.stat().st_mtime < min_age_s
    except OSError:
        return True


def processes_under(path: Path) -> list[Proc]:
    """Processes whose program lies inside ``path``, and all their descendants (this process
    excepted)."""
    prefix = str(path).rstrip("/") + "/"
    table = _process_table()
    roots = [pid for pid, (_, argv0) in table.items() if argv0.startswith(prefix)]
    found = {}
    for pid in [*roots, *(d for r in roots for d in _descendants_in(table, r))]:
        if pid != os.getpid() and pid not in found:
            stat = table[pid][0]
            found[pid] = Proc(pid, stat[2], stat[3])
    return list(found.values())


def end_processes(procs: list[Proc], grace_s: float, kill_wait_s: float = 5.0) -> None:
    """Wait up to ``grace_s`` for ``procs`` to exit, SIGKILL those still running, and wait (up to
    ``kill_wait_s``) until they are gone."""
    deadline = time.monotonic() + grace_s
    left = [p for p in dict.fromkeys(procs) if p.alive()]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if p.alive()]
    if not left:
        return
    LOGGER.warning(
        "killing %d Triton process(es) that did not exit: %s",
        len(left),
        ", ".join(f"{p.name} (pid {p.pid})" for p in left),
    )
    for p in left:
        if p.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + kill_wait_s
    while left and time.monotonic() < deadline:  # a zombie counts as gone: its parent reaps it
        time.sleep(0.02)
        left = [p for p in left if p.alive()]
    if left:
        LOGGER.error("Triton process(es) %s would not exit after SIGKILL", [p.pid for p in left])


def _descendants_in(table: dict[int, tuple[tuple[int, str, int, str], str]], pid: int) -> list[int]:
    """Every process below ``pid`` in a :func:`_process_table`."""
    children: dict[int, list[int]] = {}
    for child, (stat, _) in table.items():
        children.setdefault(stat[0], []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stat(pid: int) -> tuple[int, str, int, str] | None:
    """(parent pid, state, start time in clock ticks, command name) of ``pid``; None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0], int(fields[19]), name


def _process_table() -> dict[int, tuple[tuple[int, str, int, str], str]]:
    """pid -> (stat, argv[0]) of every process we can see."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        stat = _stat(pid)
        if stat is None or stat[1] == "Z":
            continue
        try:
            argv0 = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        table[pid] = (stat, argv0)
    return table


def _command_lines() -> list[str]:
    """The whole command line of every process we can see."""
    lines = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return lines


def _python_envs() -> set[Path]:
    return set(Path("/tmp").glob("python_env_??????"))
