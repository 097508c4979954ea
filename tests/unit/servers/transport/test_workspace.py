"""Server workspaces: one locked directory per live server; what dead servers left is removed, and
no process of a released workspace is left running.

Stand-in "Triton processes" are copies of ``sleep`` run from inside a workspace, as tritonserver
and its python-backend stubs run from the binaries PyTriton copies there.
"""

import os
import random
import shutil
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openaligner.servers.transport.workspace import (
    LEGACY_PREFIX,
    SERVER_PREFIX,
    SHM_PREFIX,
    ServerWorkspace,
    processes_under,
    remove_dead_servers,
    remove_legacy_leftovers,
    remove_unused_shared_memory,
)

NOT_A_PID = 10**8  # above any pid_max: no such process


def run_from(directory: Path, ignore_sigterm: bool = False) -> subprocess.Popen:
    """A process whose program lies in ``directory`` (a copy of ``sleep``)."""
    directory.mkdir(parents=True, exist_ok=True)
    program = directory / "sleep"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", program)
    handler = signal.SIG_IGN if ignore_sigterm else signal.SIG_DFL
    return subprocess.Popen([str(program), "60"], preexec_fn=lambda: signal.signal(signal.SIGTERM, handler))


def gone(proc: subprocess.Popen) -> bool:
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return False
    return True


def dead_server_dir(root: Path) -> Path:
    """A server directory whose server is gone: made and locked by a process that then exited."""
    script = (
        "import sys; from openaligner.servers.transport.workspace import ServerWorkspace; "
        "w = ServerWorkspace.create(sys.argv[1]); (w.path / 'workspace').mkdir(); print(w.path)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(root)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    return Path(out.stdout.strip())


def test_a_live_servers_directory_is_kept_and_a_dead_ones_removed(tmp_path):
    dead = dead_server_dir(tmp_path)
    assert dead.is_dir() and dead.name.startswith(SERVER_PREFIX)
    live = ServerWorkspace.create(tmp_path)
    try:
        assert not dead.exists()  # its lock was free: the server that held it is gone
        other = ServerWorkspace.create(tmp_path)
        assert live.path.is_dir() and other.path.is_dir()  # held locks: both alive
        other.release()
        assert not other.path.exists() and live.path.is_dir()
        assert live.triton_dir.parent == live.path and live.log_path.parent == live.path
    finally:
        live.release()
    assert not live.path.exists()
    live.release()  # twice is harmless


def test_processes_left_running_from_a_dead_servers_directory_are_killed(tmp_path):
    dead = dead_server_dir(tmp_path)
    orphan = run_from(dead / "workspace" / "bin", ignore_sigterm=True)
    try:
        time.sleep(0.1)
        assert [p.pid for p in processes_under(dead)] == [orphan.pid]
        assert remove_dead_servers(tmp_path) == [dead]
        assert gone(orphan) and not dead.exists()
    finally:
        orphan.kill()


def test_release_waits_for_the_processes_and_kills_those_that_stay(tmp_path):
    workspace = ServerWorkspace.create(tmp_path)
    polite = run_from(workspace.path / "a")
    stuck = run_from(workspace.path / "b", ignore_sigterm=True)
    stopped = run_from(workspace.path / "c")
    try:
        time.sleep(0.1)
        os.kill(stopped.pid, signal.SIGSTOP)  # a stopped process exits on nothing but SIGKILL
        known = workspace.processes()
        assert {p.pid for p in known} == {polite.pid, stuck.pid, stopped.pid}
        os.kill(polite.pid, signal.SIGTERM)
        started = time.monotonic()
        workspace.release(known, grace_s=0.3)
        assert time.monotonic() - started < 5
        assert all(gone(p) for p in (polite, stuck, stopped))
        assert stuck.returncode == -signal.SIGKILL and stopped.returncode == -signal.SIGKILL
        assert not workspace.path.exists()
    finally:
        for p in (polite, stuck, stopped):
            p.kill()


def test_leftovers_of_earlier_versions_are_removed_once_unused(tmp_path):
    old = time.time() - 3600
    dead = tmp_path / f"{LEGACY_PREFIX}dead1234"
    (dead / "workspace").mkdir(parents=True)
    in_use = tmp_path / f"{LEGACY_PREFIX}live5678"
    in_use.mkdir()
    young = tmp_path / f"{LEGACY_PREFIX}young000"
    young.mkdir()
    for path in (dead, in_use):
        os.utime(path, (old, old))
    copy = Path("/tmp") / ("folder" + "".join(random.choices(string.ascii_letters, k=6)))
    copy.mkdir()
    (copy / "config.pbtxt").write_text(f'parameters {{ string_value: "{dead}/workspace" }}')
    os.utime(copy, (old, old))
    user = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(in_use)])  # uses it
    try:
        cmdline = Path(f"/proc/{user.pid}/cmdline")
        while str(in_use).encode() not in cmdline.read_bytes():  # until its exec is visible
            time.sleep(0.01)
        removed = remove_legacy_leftovers(tmp_path)
        assert set(removed) == {dead, copy}
        assert not dead.exists() and not copy.exists() and in_use.is_dir() and young.is_dir()
    finally:
        user.kill()
        shutil.rmtree(copy, ignore_errors=True)


def test_shared_memory_of_gone_tritons_is_unlinked(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    of_dead = shm / f"{SHM_PREFIX}{NOT_A_PID}-feed-test"
    of_mine = shm / f"{SHM_PREFIX}{os.getpid()}-beef-test"
    for region in (of_dead, of_mine):
        region.write_bytes(b"\0" * 16)
    try:
        remove_dead_servers(tmp_path)
        assert not of_dead.exists() and of_mine.exists()  # this process is alive
        remove_unused_shared_memory(os.getpid())
        assert not of_mine.exists()  # none of this process's Tritons maps it
    finally:
        for region in (of_dead, of_mine):
            region.unlink(missing_ok=True)
