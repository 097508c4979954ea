"""The life of a served model on every rank: start on rank 0, serve until asked, stop everything.

A mixin shared by the reward server and the critic server. The class that uses it provides
``handlers()`` (its opcode table), ``url``, ``_describe`` (for messages) and ``start()`` (rank 0:
create ``_dispatcher`` and ``_host``); the ranks are those of :mod:`openaligner.distributed`.
Knows nothing of what the endpoints compute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from openaligner import distributed as dp
from openaligner.servers.distributed import Rank0Dispatcher, run_subscriber_loop
from openaligner.servers.triton import TritonHost


class ServerLifecycle:
    _describe: str  # "the reward model server": for messages
    _dispatcher: Rank0Dispatcher | None
    _host: TritonHost | None
    _stop_requested: threading.Event

    def _init_lifecycle(self) -> None:
        self._dispatcher = None
        self._host = None
        self._stop_requested = threading.Event()

    @property
    def url(self) -> str:
        raise NotImplementedError

    def handlers(self) -> dict[int, Callable[[Any], Any]]:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    @property
    def triton(self) -> TritonHost | None:
        """The running Triton host on rank 0 (None elsewhere or before :meth:`start`)."""
        return self._host

    def request_stop(self) -> None:
        """Ask :meth:`run_server` to return (safe from signal handlers and other threads)."""
        self._stop_requested.set()

    def stop(self) -> None:
        """Rank 0: stop Triton, then release the other ranks with STOP. Safe to call twice."""
        self._stop_requested.set()
        if self._host is not None:
            self._host.stop()
        if self._dispatcher is not None:
            self._dispatcher.stop()

    def run_server(self) -> None:
        """Serve until :meth:`request_stop` (rank 0) or STOP from rank 0 (other ranks).

        Raises:
            RuntimeError: tritonserver exited on its own (after the other ranks were released).
        """
        if not dp.is_leader():
            run_subscriber_loop(self.handlers())
            return
        self.start()
        assert self._host is not None
        died = False
        try:
            while not self._stop_requested.wait(0.5):
                if not self._host.is_alive():
                    died = True
                    break
        finally:
            self.stop()
        if died:
            raise RuntimeError(
                f"tritonserver of {self._describe} at {self.url} exited unexpectedly; see its log"
            )

    def __exit__(self, *_: object) -> None:
        self.stop()
