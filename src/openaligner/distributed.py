"""The collective operations of openaligner's processes, over torch.distributed (gloo or NCCL).

Owns the one collective API of the trainers and the servers: rank, world size, the collective
device, joining a torchrun job; broadcast, all-reduce, gathering rows, gradients, barrier, and
``run_guarded`` (a step, on every rank or on rank 0 alone, whose failure on one rank fails all).
Every function is a collective all ranks call in the same order; with no process group each is
the identity. Tensors travel on :func:`collective_device` and come back on the input's device.

Must not know training, serving, models or HTTP: it imports nothing of openaligner.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

LOGGER = logging.getLogger(__name__)

T = TypeVar("T")

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
"""What :func:`broadcast_tensor` can send (its header carries the index)."""
_MAX_DIMS = 6


class CollectiveFailure(RuntimeError):
    """A step failed on at least one rank; every rank raises this so all stay in step."""


# ----------------------------------------------------------------------------- the world
def is_distributed() -> bool:
    """Whether a default process group is initialised (else every collective is the identity)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_leader() -> bool:
    """Rank 0: the process that decides, talks to the other processes' peers and writes files."""
    return rank() == 0


def init_from_env(timeout_s: float = 1800.0) -> bool:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1); returns whether one is joined.

    The backend is NCCL when CUDA is available, else gloo. ``timeout_s`` bounds every collective,
    so a dead peer ends the run with an error instead of a hang.
    """
    if is_distributed() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return is_distributed()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def shutdown() -> None:
    """Leave the process group in step with every rank (barrier, then destroy; no-op without one).

    A process that exits with its gloo/NCCL group still alive can abort in the library's
    destructors ("terminate called without an active exception", SIGABRT) after a run that
    otherwise succeeded.
    """
    global _LEFT_GROUP
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()
        _LEFT_GROUP = True


_LEFT_GROUP = False  # this process left a process group (see finish)


def finish(code: int) -> int:
    """End a process after its command returned ``code``: a process that was a rank of a process
    group (it called :func:`shutdown`) runs its ``atexit`` handlers, flushes logging and the
    standard streams, and leaves with ``os._exit(code)``; any other process just gets ``code``
    back to exit with as usual.

    Why: a rank whose work is done and written still holds objects that reference the destroyed
    group (a sharded model's DTensors keep their device mesh, and the mesh its gloo/NCCL group);
    they are finalised while the interpreter tears down, where a library thread destroyed while
    still joinable aborts the process ("terminate called without an active exception", SIGABRT),
    and torchrun then reports a successful run as failed. Nothing after the command needs those
    finalisers: files are closed by the trainers, and Python-level exit handlers still run here.
    """
    if not _LEFT_GROUP:
        return code
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or gone: nothing left to flush
            stream.flush()
    os._exit(code)


def collective_device() -> torch.device:
    """Where tensors must live for collectives: the current CUDA device under NCCL, else CPU."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if is_distributed():
        dist.barrier()


# ----------------------------------------------------------------------------- broadcast
def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (small picklable Python objects: decisions, states)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_int(value: int | None) -> int:
    """Rank 0's ``value`` on every rank (the others pass None); one small tensor, no pickling."""
    if not is_distributed():
        assert value is not None
        return int(value)
    t = torch.tensor([value if is_leader() else 0], dtype=torch.int64, device=collective_device())
    dist.broadcast(t, src=0)
    return int(t.item())


def broadcast_tensor(tensor: torch.Tensor | None) -> torch.Tensor:
    """Rank 0's tensor (any shape up to 6 dims, common dtypes) on every rank, on
    :func:`collective_device`; the other ranks pass None."""
    device = collective_device()
    if not is_distributed():
        assert tensor is not None
        return tensor.to(device)
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    if is_leader():
        assert tensor is not None
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ValueError(f"cannot broadcast a {tensor.dim()}-d {tensor.dtype} tensor")
        header[0] = _DTYPES.index(tensor.dtype)
        header[1] = tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    dist.broadcast(header, src=0)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    shape = [int(d) for d in header[2 : 2 + ndim].tolist()]
    if is_leader():
        assert tensor is not None
        data = tensor.to(device).contiguous()
    else:
        data = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(data, src=0)
    return data


# ----------------------------------------------------------------------------- reduce
def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over ranks (a new tensor; ``t`` is untouched). The ``reduce`` of the math core."""
    return _all_reduce(t, dist.ReduceOp.SUM)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of ``t`` over ranks (a new tensor; ``t`` is untouched)."""
    return _all_reduce(t, dist.ReduceOp.MAX)


def _all_reduce(t: torch.Tensor, op: Any) -> torch.Tensor:
    if not is_distributed():
        return t
    out = t.detach().clone().to(collective_device())
    dist.all_reduce(out, op=op)
    return out.to(t.device)


# ----------------------------------------------------------------------------- rows
def local_rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's equal contiguous share of the leading dimension (which must divide by the
    world size): rows ``[rank * n, (rank + 1) * n)`` of ``[world * n, ...]``."""
    rows, world = t.shape[0], world_size()
    if rows % world:
        raise ValueError(f"{rows} rows do not split evenly over {world} ranks")
    share = rows // world
    return t[rank() * share : (rank() + 1) * share]


def all_gather_rows(t: torch.Tensor, pad_value: float = 0, *, same_shape: bool = False) -> torch.Tensor:
    """Concatenate every rank's ``t`` along dim 0, in rank order, on ``t``'s device.

    Ranks may hold different numbers of rows and (for 2-D tensors) widths: widths are padded with
    ``pad_value`` to the global maximum first. Returns [sum of rows, max width, ...].

    Args:
        same_shape: every rank's ``t`` has the same shape (e.g. its :func:`local_rows`); skips the
            exchange of shapes, so one collective instead of two.
    """
    if not is_distributed():
        return t
    dev = collective_device()
    if same_shape:
        local = t.to(dev).contiguous()
        parts = [torch.empty_like(local) for _ in range(world_size())]
        dist.all_gather(parts, local)
        return torch.cat(parts).to(t.device)
    shape = torch.tensor(list(t.shape) + [0] * (2 - t.dim()), device=dev)
    shapes = [torch.zeros_like(shape) for _ in range(world_size())]
    dist.all_gather(shapes, shape)
    max_rows = int(max(s[0] for s in shapes))
    local = t.to(dev)
    if t.dim() == 2:
        width = int(max(s[1] for s in shapes))
        local = torch.nn.functional.pad(local, (0, width - t.shape[1]), value=pad_value)
    local = torch.nn.functional.pad(local, (0, 0) * (local.dim() - 1) + (0, max_rows - t.shape[0]))
    gathered = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(gathered, local)
    kept = [g[: int(s[0])] for g, s in zip(gathered, shapes, strict=True)]
    return torch.cat(kept).to(t.device)


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- gradients
def average_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Average ``.grad`` over ranks in one flat all-reduce (each rank's loss is a mean over its
    own rows)."""
    _all_reduce_gradients(list(params), average=True)


def sum_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Sum ``.grad`` over ranks in one flat all-reduce (each rank's loss is already weighted by
    its share of the global batch)."""
    _all_reduce_gradients(list(params), average=False)


def _all_reduce_gradients(params: list[torch.nn.Parameter], average: bool) -> None:
    """Parameters without a gradient contribute zeros (and get the reduced one), so every rank
    calls the same collective with the same shape whatever its data."""
    if not is_distributed():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads]).to(collective_device())
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    if average:
        flat /= world_size()
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.device, p.dtype)
        offset += n


# ----------------------------------------------------------------------------- failures
class PeerFailedError(CollectiveFailure):
    """Raised on the other ranks when a ``leader_only`` step failed on rank 0."""


def run_guarded(step: Callable[[], T], what: str = "step", *, leader_only: bool = False) -> T:
    """Run ``step`` on every rank (or, with ``leader_only``, on rank 0 alone, its result shared
    with every rank); if it raises on any rank, raise on all. Every rank calls this at the same point.

    Without this, a rank whose step failed (a CUDA OOM, say) would skip the next collective
    and leave the others waiting until the process-group timeout. ``step`` may itself run
    collectives only where a failure cannot leave a rank out of one (each rank's own work, then
    the collectives; or collectives that share their own failures, like
    ``torch.distributed.checkpoint``'s). A ``leader_only`` step runs no collectives: it is rank
    0's talk with a server or its write of a file, and its (picklable) result is broadcast.

    Args:
        what: names the step in the message (``checkpoint write``, ...).
        leader_only: run ``step`` on rank 0 only and return its result on every rank.

    Raises:
        CollectiveFailure: on every rank, naming the ranks that failed and each one's error (the
            local error is chained). The errors are exchanged only after a failure, so a step that
            succeeds costs one small all-gather.
        With ``leader_only``: on rank 0 the step's own exception (so that a caller can still tell
            a server's error from a disk's); :class:`PeerFailedError` with its message elsewhere.
    """
    error: BaseException | None = None
    result: T | None = None
    if not leader_only or is_leader():
        try:
            result = step()
        except Exception as e:
            error = e
            if not leader_only:  # a leader-only step's own exception propagates on rank 0
                LOGGER.exception("rank %d: %s failed", rank(), what)
    reason = f"{type(error).__name__}: {error}" if error is not None else None
    if leader_only:
        reason, result = broadcast_object((reason, result))
        failed = [0] if reason is not None else []
        reasons = [reason]
    elif is_distributed():
        flag = torch.tensor([error is not None], dtype=torch.int64, device=collective_device())
        flags = all_gather_rows(flag, same_shape=True)
        failed = [r for r, f in enumerate(flags.tolist()) if f]
        reasons = gather_objects(reason) if failed else []
    else:
        failed = [0] if error is not None else []
        reasons = [reason]
    if failed and leader_only:
        if error is not None:
            raise error
        raise PeerFailedError(f"rank 0's {what} failed, so this rank stops too: {reason}")
    if failed:
        said = "; ".join(f"rank {r}: {reasons[r]}" for r in failed)
        raise CollectiveFailure(f"the {what} failed on rank(s) {failed} ({said}); see the logs") from error
    return result  # type: ignore[return-value]
