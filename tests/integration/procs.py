"""Process helpers shared by the integration tests: free ports, process trees, liveness, CLI servers."""

import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from openaligner.servers.transport.triton import free_loopback_port

free_port = free_loopback_port  # one free-port helper, in src (the demo uses it too)


@contextmanager
def short_tmp_dir() -> Iterator[Path]:
    """A fresh directory right under the temp root, removed afterwards: a server's workspace_dir
    must be short (Triton's Unix sockets live in it; pytest's tmp_path is too deep)."""
    path = Path(tempfile.mkdtemp(prefix="oa-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def descendants(pid: int) -> dict[int, str]:
    """pid → command name of every process below ``pid``."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        child = int(stat.parent.name)
        children.setdefault(ppid, []).append(child)
        names[child] = name
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = names[child]
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Served:
    """A CLI server subprocess whose output is collected in the background."""

    ready_pattern = r"ready at (http://\S+)"  # what the server prints once it answers
    ready_group = 1  # the part of the match wait_ready returns

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout_s: float = 90.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(self.ready_pattern, self.output)
            if match:
                return match.group(self.ready_group)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"server did not become ready:\n{self.output[-3000:]}")

    def ready_url(self) -> str | None:
        """What :meth:`wait_ready` returns once the server is ready, else None, without waiting.

        Raises:
            AssertionError: the process exited before it was ready.
        """
        match = re.search(self.ready_pattern, self.output)
        if match:
            return match.group(self.ready_group)
        if self.proc.poll() is not None:
            code = self.proc.returncode
            raise AssertionError(f"server exited ({code}) before it was ready:\n{self.output[-3000:]}")
        return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
