"""Process helpers shared by the integration tests: free ports, process trees, liveness, CLI servers."""

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()
_pick = random.Random(os.getpid() ^ time.time_ns())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, below the system's ephemeral range, and never
    the same twice in this process.

    A test picks a port, then a server binds it seconds later, after loading its model. Ports the
    system hands out meanwhile (a bind to port 0, as every server does for its Triton, or an outgoing
    connection) come from the ephemeral range: a port below it cannot be handed to a neighbouring
    server in that window. (CI once failed when the critic's Triton took the reward server's port.)
    Where a test can, it starts the server with port 0 and reads the port it took instead.
    """
    low = int(_EPHEMERAL.read_text().split()[0]) if _EPHEMERAL.is_file() else 32768
    first = max(1024, low - 12000)
    for _ in range(1000):
        port = _pick.randrange(first, low)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {first}..{low - 1}")


def port_of(url: str) -> int:
    """The port of ``http://host:port``."""
    return int(url.rsplit(":", 1)[1].split("/")[0])


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

    def wait_ready(self, timeout_s: float = 180.0) -> str:
        """The ready line's group, once printed; fails if the process exits first or after
        ``timeout_s``: a bound on a hang, generous because CI runs both tiers side by side."""
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
