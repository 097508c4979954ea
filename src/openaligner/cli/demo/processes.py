"""The demo's servers as child processes: started, awaited until ready, stopped (Ctrl-C and SIGTERM too).

Owns the server processes of one run (each in a session of its own, output to a log file) and
their orderly stop. Knows a server only by its command, the model it serves and the line it prints
once ready, which names the port it took (each is started with ``server.port=0``); nothing of what
it serves.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

READY_LINE = re.compile(r"server ready at http://\S+:(\d+)")
"""What a ``serve-*`` command prints once it answers; the group is the port it took."""


@dataclass(frozen=True)
class _Server:
    proc: subprocess.Popen[bytes]
    model: str  # the served model, for messages
    log_path: Path


class ServerProcesses:
    """The servers of one run: started in order, awaited in order, stopped together.

    Args:
        host: the address every server listens on.
        ready_timeout_s: how long :meth:`wait_ready` waits for each server.
    """

    def __init__(self, host: str, ready_timeout_s: float) -> None:
        self.host = host
        self.ready_timeout_s = ready_timeout_s
        self._servers: list[_Server] = []

    def start(self, command: str, yaml_path: Path, model: str, log_path: Path) -> None:
        """Start ``openaligner <command> <yaml_path>``, which serves ``model`` on the port it picks
        (the config says ``server.port=0``: ports picked here and bound later could be taken by
        then, even by the other server's Triton)."""
        # A session of its own: Ctrl-C in the terminal reaches the demo, which then stops the servers
        # in order, instead of hitting every process at once.
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "openaligner", command, str(yaml_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self._servers.append(_Server(proc, model, log_path))

    def wait_ready(self) -> list[int]:
        """Wait until every started server says it is ready, each for up to ``ready_timeout_s``;
        returns their ports, in the order they were started.

        Raises:
            RuntimeError: a server exited (the message holds the tail of its log).
            TimeoutError: a server was not ready in time.
        """
        return [self._wait_ready(server) for server in self._servers]

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to every server still running; SIGKILL to the session of any still there after
        ``timeout_s`` in all."""
        for server in self._servers:
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for server in self._servers:
            try:
                server.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(server.proc.pid, signal.SIGKILL)
                server.proc.wait()

    def _wait_ready(self, server: _Server) -> int:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            # the line is printed once the server answers (after its start returned)
            ready = READY_LINE.search(server.log_path.read_text(errors="replace"))
            if ready:
                return int(ready.group(1))
            if server.proc.poll() is not None:
                tail = server.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(
                    f"the server for {server.model} exited with code {server.proc.returncode}; "
                    f"log {server.log_path}:\n{tail}"
                )
            time.sleep(0.5)
        raise TimeoutError(
            f"the server for {server.model} was not ready after {self.ready_timeout_s:.0f} s; "
            f"see {server.log_path}"
        )


@contextmanager
def sigterm_as_keyboard_interrupt() -> Iterator[None]:
    """Inside, SIGTERM raises ``KeyboardInterrupt``: a terminated demo stops its servers as on Ctrl-C."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
