"""Multi-process serving: rank 0 answers HTTP and leads, every other rank follows an opcode.

Owns the "rank 0 serves, the rest subscribe" model that the reward and critic servers share:

* :class:`Collective` — the world as a server sees it (rank, size, device) and the few
  collectives it needs: broadcast an int or a tensor of any shape from rank 0, take this rank's
  share of rows, gather rows back, sum over ranks (gradients), and run a step so that a failure
  on one rank fails it on all.
* :class:`Rank0Dispatcher` — on rank 0, one lock around "broadcast an opcode, then run its
  handler"; a heartbeat (NOOP) while idle so that waiting ranks never hit the process-group
  timeout; STOP on shutdown.
* :func:`run_subscriber_loop` — on other ranks, receive an opcode and run the same handler.

A handler is called on every rank with the request payload on rank 0 and ``None`` elsewhere, and
must run the same collectives in the same order on all ranks. Validate requests before calling
the dispatcher: nothing that depends on one request's content may decide whether a rank joins a
collective. Works with gloo (CPU tensors) and NCCL (tensors on this rank's CUDA device).
Must not know about PyTriton, HTTP, models or particular endpoints.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from enum import IntEnum
from typing import Any, TypeVar

import torch
import torch.distributed as dist

LOGGER = logging.getLogger(__name__)

T = TypeVar("T")


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

_DTYPES: tuple[torch.dtype, ...] = (
    torch.int64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int32,
    torch.bool,
    torch.float64,
    torch.uint8,
)
_MAX_DIMS = 6


class CollectiveFailure(RuntimeError):
    """A step failed on at least one rank; every rank raises this so all stay in step."""


class Collective:
    """Rank, world size and device of the serving processes, plus the collectives they use.

    Uses the default torch.distributed process group when one is initialised, and behaves as a
    world of one otherwise (every collective is then the identity).

    Args:
        device: where collective tensors live; default CUDA (this rank's current device) for the
            NCCL backend, CPU otherwise.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if device is None:
            nccl = self.distributed and dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)

    @property
    def is_leader(self) -> bool:
        """Rank 0: the process that runs the HTTP server."""
        return self.rank == 0

    def broadcast_int(self, value: int | None) -> int:
        """Rank 0's ``value`` on every rank (others pass None)."""
        if not self.distributed:
            assert value is not None
            return int(value)
        t = torch.tensor([value if self.is_leader else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return int(t.item())

    def broadcast_tensor(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's tensor (any shape up to 6 dims, common dtypes) on every rank, on ``device``."""
        if not self.distributed:
            assert tensor is not None
            return tensor.to(self.device)
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        if self.is_leader:
            assert tensor is not None
            if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
                raise ValueError(f"cannot broadcast a {tensor.dim()}-d {tensor.dtype} tensor")
            header[0] = _DTYPES.index(tensor.dtype)
            header[1] = tensor.dim()
            header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        dist.broadcast(header, src=0)
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        shape = [int(d) for d in header[2 : 2 + ndim].tolist()]
        if self.is_leader:
            assert tensor is not None
            data = tensor.to(self.device).contiguous()
        else:
            data = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(data, src=0)
        return data

    def local_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's equal share of the leading dimension (which must divide by world size)."""
        rows = tensor.shape[0]
        if rows % self.world_size:
            raise ValueError(f"{rows} rows do not split evenly over {self.world_size} ranks")
        share = rows // self.world_size
        return tensor[self.rank * share : (self.rank + 1) * share]

    def gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's equally shaped ``local`` along dim 0, in rank order."""
        if not self.distributed:
            return local
        local = local.to(self.device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts)

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (on ``device``) over all ranks, in place; returns it."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def run_guarded(self, step: Callable[[], T]) -> T:
        """Run ``step`` on every rank; if it raises on any rank, raise on all.

        Without this, a rank whose step failed (a CUDA OOM, say) would skip the next collective
        and leave the others waiting until the process-group timeout.

        Raises:
            CollectiveFailure: naming the ranks that failed (the local error is chained).
        """
        error: BaseException | None = None
        result: T | None = None
        try:
            result = step()
        except Exception as e:
            error = e
            LOGGER.exception("rank %d: step failed", self.rank)
        if self.distributed:
            flags = self.gather_rows(torch.tensor([error is not None], dtype=torch.int64, device=self.device))
            failed = [r for r, f in enumerate(flags.tolist()) if f]
        else:
            failed = [0] if error is not None else []
        if failed:
            here = f" (rank {self.rank}: {type(error).__name__}: {error})" if error is not None else ""
            message = f"the step failed on rank(s) {failed}{here}; see the server log"
            raise CollectiveFailure(message) from error
        return result  # type: ignore[return-value]


class Rank0Dispatcher:
    """Rank 0's side of the loop: broadcast an opcode, then run its handler here too.

    Args:
        collective: the world (a world of one works: nothing is broadcast).
        handlers: opcode → handler, the same table the subscribers use.
        heartbeat_s: while idle, send NOOP this often so the subscribers' pending broadcast never
            reaches the process-group timeout (default 30 min for gloo, 10 min for NCCL);
            ``None`` disables it.
    """

    def __init__(
        self, collective: Collective, handlers: Mapping[int, Handler], heartbeat_s: float | None = 60.0
    ) -> None:
        reserved = {int(Opcode.STOP), int(Opcode.NOOP)} & {int(k) for k in handlers}
        if reserved:
            raise ValueError(f"opcodes {sorted(reserved)} are reserved (STOP, NOOP)")
        self.collective = collective
        self._handlers = {int(k): v for k, v in handlers.items()}
        self._lock = threading.Lock()
        self._stopped = False
        self._last_call = time.monotonic()
        self._heartbeat_s = heartbeat_s
        self._stop_event = threading.Event()
        self._heartbeat: threading.Thread | None = None
        if heartbeat_s is not None and collective.distributed:
            self._heartbeat = threading.Thread(target=self._beat, name="openaligner-heartbeat", daemon=True)
            self._heartbeat.start()

    def call(self, opcode: int, payload: Any) -> Any:
        """Have every rank run ``handlers[opcode]``; return rank 0's result."""
        handler = self._handlers[int(opcode)]
        with self._lock:
            if self._stopped:
                raise RuntimeError("the server is stopping; no more requests are served")
            self.collective.broadcast_int(int(opcode))
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
                self.collective.broadcast_int(int(Opcode.STOP))
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
                    self.collective.broadcast_int(int(Opcode.NOOP))
                except Exception as e:
                    LOGGER.error("heartbeat to the other ranks failed (%s); they are probably gone", e)
                    return
                self._last_call = time.monotonic()


def run_subscriber_loop(collective: Collective, handlers: Mapping[int, Handler]) -> None:
    """On a rank other than 0: follow rank 0's opcodes until STOP.

    A :class:`CollectiveFailure` in a handler was raised on every rank alike, so the loop logs
    it and goes on; any other exception ends the loop (and the process).

    Raises:
        RuntimeError: an opcode this rank has no handler for (rank 0 runs different code).
    """
    table = {int(k): v for k, v in handlers.items()}
    names = ", ".join(_opcode_name(k) for k in sorted(table))
    LOGGER.info("rank %d: following rank 0 (handles %s)", collective.rank, names)
    served = 0
    while True:
        opcode = collective.broadcast_int(None)
        if opcode == Opcode.STOP:
            LOGGER.info("rank %d: STOP received after %d call(s)", collective.rank, served)
            return
        if opcode == Opcode.NOOP:
            continue
        handler = table.get(opcode)
        if handler is None:
            raise RuntimeError(
                f"rank {collective.rank} received opcode {opcode} but only knows {sorted(table)}: "
                "rank 0 and this rank are running different server code"
            )
        served += 1
        try:
            handler(None)
        except CollectiveFailure as e:
            LOGGER.warning("rank %d: %s", collective.rank, e)


def _opcode_name(opcode: int) -> str:
    try:
        return Opcode(opcode).name
    except ValueError:
        return str(opcode)
