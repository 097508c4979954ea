"""Multi-process serving: rank 0 answers HTTP and leads, every other rank follows an opcode.

Owns :class:`Opcode`, :class:`Rank0Dispatcher` (one lock around "broadcast, then run"; a NOOP
heartbeat while idle; STOP on shutdown) and :func:`run_subscriber_loop`. A handler runs on every
rank, the payload on rank 0 only, and must run the same collectives in the same order everywhere.
Must not know about PyTriton, HTTP, models or particular endpoints.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from enum import IntEnum
from typing import Any

from openaligner import distributed as dp
from openaligner.distributed import CollectiveFailure

LOGGER = logging.getLogger(__name__)


class Opcode(IntEnum):
    """What rank 0 asks every rank to do next."""

    STOP = 0
    """Leave the loop: the server is shutting down."""
    NOOP = 1
    """Heartbeat while idle; does nothing."""
    FORWARD = 2
    """Inference on a broadcast batch."""
    TRAIN = 3
    """One training pass on a broadcast batch (critic server)."""
    SAVE = 4
    """Write a checkpoint (critic server)."""
    RESTORE = 5
    """Load a checkpoint named by a broadcast step (critic server)."""


Handler = Callable[[Any], Any]
"""Runs on every rank for one opcode: payload on rank 0, ``None`` on the others."""


class Rank0Dispatcher:
    """Rank 0's side of the loop: broadcast an opcode, then run its handler here too.

    A world of one works too: nothing is broadcast.

    Args:
        handlers: opcode → handler, the same table the subscribers use.
        heartbeat_s: while idle, send NOOP this often so the subscribers' pending broadcast never
            reaches the process-group timeout (default 30 min for gloo, 10 min for NCCL);
            ``None`` disables it.
    """

    def __init__(self, handlers: Mapping[int, Handler], heartbeat_s: float | None = 60.0) -> None:
        reserved = {int(Opcode.STOP), int(Opcode.NOOP)} & {int(k) for k in handlers}
        if reserved:
            raise ValueError(f"opcodes {sorted(reserved)} are reserved (STOP, NOOP)")
        self._handlers = {int(k): v for k, v in handlers.items()}
        self._lock = threading.Lock()
        self._stopped = False
        self._last_call = time.monotonic()
        self._heartbeat_s = heartbeat_s
        self._stop_event = threading.Event()
        self._heartbeat: threading.Thread | None = None
        if heartbeat_s is not None and dp.is_distributed():
            self._heartbeat = threading.Thread(target=self._beat, name="openaligner-heartbeat", daemon=True)
            self._heartbeat.start()

    def call(self, opcode: int, payload: Any) -> Any:
        """Have every rank run ``handlers[opcode]``; return rank 0's result."""
        handler = self._handlers[int(opcode)]
        with self._lock:
            if self._stopped:
                raise RuntimeError("the server is stopping; no more requests are served")
            dp.broadcast_int(int(opcode))
            try:
                return handler(payload)
            finally:
                self._last_call = time.monotonic()

    def stop(self) -> None:
        """Send STOP to the subscribers (once); later calls raise. Never raises itself."""
        self._stop_event.set()
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                dp.broadcast_int(int(Opcode.STOP))
            except Exception as e:  # a dead peer must not turn shutdown into a crash
                LOGGER.warning("could not tell the other ranks to stop (%s); they may already be gone", e)
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=5.0)

    def _beat(self) -> None:
        assert self._heartbeat_s is not None
        while not self._stop_event.wait(self._heartbeat_s / 2):
            with self._lock:
                if self._stopped or time.monotonic() - self._last_call < self._heartbeat_s / 2:
                    continue
                try:
                    dp.broadcast_int(int(Opcode.NOOP))
                except Exception as e:
                    LOGGER.error("heartbeat to the other ranks failed (%s); they are probably gone", e)
                    return
                self._last_call = time.monotonic()


def run_subscriber_loop(handlers: Mapping[int, Handler]) -> None:
    """On a rank other than 0: follow rank 0's opcodes until STOP.

    A :class:`CollectiveFailure` in a handler was raised on every rank alike, so the loop logs
    it and goes on; any other exception ends the loop (and the process).

    Raises:
        RuntimeError: an opcode this rank has no handler for (rank 0 runs different code).
    """
    table = {int(k): v for k, v in handlers.items()}
    names = ", ".join(_opcode_name(k) for k in sorted(table))
    LOGGER.info("rank %d: following rank 0 (handles %s)", dp.rank(), names)
    served = 0
    while True:
        opcode = dp.broadcast_int(None)
        if opcode == Opcode.STOP:
            LOGGER.info("rank %d: STOP received after %d call(s)", dp.rank(), served)
            return
        if opcode == Opcode.NOOP:
            continue
        handler = table.get(opcode)
        if handler is None:
            raise RuntimeError(
                f"rank {dp.rank()} received opcode {opcode} but only knows {sorted(table)}: "
                "rank 0 and this rank are running different server code"
            )
        served += 1
        try:
            handler(None)
        except CollectiveFailure as e:
            LOGGER.warning("rank %d: %s", dp.rank(), e)


def _opcode_name(opcode: int) -> str:
    try:
        return Opcode(opcode).name
    except ValueError:
        return str(opcode)
