"""The life of a served model on every rank: start on rank 0, serve until asked, stop everything.

Owns :class:`ServerLifecycle`, a mixin of the reward and critic servers (they provide
``handlers()``, ``url``, ``_describe`` and ``start()``), and stopping at any moment, also during
the start (:class:`StartInterrupted`, a watchdog after :data:`STOP_WHILE_STARTING_S`).
Must not know what the endpoints compute.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from openaligner import distributed as dp
from openaligner.servers.distributed import Rank0Dispatcher, run_subscriber_loop
from openaligner.servers.transport.triton import TritonHost

LOGGER = logging.getLogger(__name__)

STOP_WHILE_STARTING_S = 4.0
"""How long a stop requested during start-up may take before the watchdog ends the process."""


class StartInterrupted(KeyboardInterrupt):
    """A stop request that arrived while the server was starting; the start is abandoned.

    A ``KeyboardInterrupt`` so that nothing on the way catches it as an ordinary error (PyTriton's
    ``except Exception`` blocks, gevent's hub, which passes only system errors on to the waiting
    code).
    """


class ServerLifecycle:
    _describe: str  # "the reward model server": for messages
    _dispatcher: Rank0Dispatcher | None
    _host: TritonHost | None
    _stop_requested: threading.Event
    _start_interruptible: bool

    def _init_lifecycle(self) -> None:
        self._dispatcher = None
        self._host = None
        self._stop_requested = threading.Event()
        self._start_interruptible = False
        self._starting: TritonHost | None = None

    def _start_host(self, host: TritonHost) -> bool:
        """Start ``host`` unless a stop was requested; False when a stop request comes first or
        interrupts the start (``host`` is then stopped: no process, no files)."""
        if self._stop_requested.is_set():
            return False
        self._start_interruptible = True
        self._starting = host
        try:
            host.start()
            self._start_interruptible = False
        except StartInterrupted:
            self._start_interruptible = False
            host.stop()  # a no-op unless the interruption came after host.start() had returned
            return False
        except BaseException:
            self._start_interruptible = False
            raise
        self._host = host
        return True

    @property
    def url(self) -> str:
        raise NotImplementedError

    def handlers(self) -> dict[int, Callable[[Any], Any]]:
        raise NotImplementedError

    def start(self) -> bool:
        """Rank 0: start serving; True once serving, False if a stop request came first."""
        raise NotImplementedError

    @property
    def triton(self) -> TritonHost | None:
        """The running Triton host on rank 0 (None elsewhere or before :meth:`start`)."""
        return self._host

    def request_stop(self, exit_process_after_s: float | None = None) -> None:
        """Ask :meth:`run_server` to return (safe from signal handlers and other threads).

        From a signal handler while :meth:`start` is starting Triton (the handler runs in the main
        thread, inside the start), it also abandons the start: it raises :class:`StartInterrupted`
        there, once; :meth:`start` then returns False. With ``exit_process_after_s`` (a caller that
        owns the process), a stop of the start that has not finished by then ends the Triton tree
        and the process (exit code 0).
        """
        self._stop_requested.set()
        if self._start_interruptible and threading.current_thread() is threading.main_thread():
            self._start_interruptible = False  # a second signal must not interrupt the clean-up
            if exit_process_after_s is not None:
                self._arm_stop_watchdog(exit_process_after_s)
            raise StartInterrupted(f"{self._describe} was stopped while starting")

    def _arm_stop_watchdog(self, after_s: float) -> None:
        """End the Triton tree and this process if the stop has not finished in time (a daemon
        thread: a process that exits first takes it along)."""
        host = self._starting

        def force() -> None:
            time.sleep(after_s)
            LOGGER.warning(
                "%s was stopped while starting and has not exited after %.0f s; ending its Triton "
                "processes and exiting",
                self._describe,
                after_s,
            )
            if host is not None:
                host.kill()
            logging.shutdown()
            os._exit(0)  # the stop was asked for: exit as a stop does

        threading.Thread(target=force, name="stop-watchdog", daemon=True).start()

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
        died = False
        try:
            if not self.start():
                return  # stopped before it was ready
            assert self._host is not None
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
