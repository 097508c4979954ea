"""Data-parallel plumbing for the actor trainer over torch.distributed (gloo on CPU, NCCL on GPU).

Every helper here is a collective that *all* ranks call in the same order with tensors of the
same dtype; shapes that differ across ranks are exchanged first. With no process group (a plain
single-process run) each helper is the identity, so the trainer has one code path.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def init_from_env(timeout_s: float = 1800.0) -> bool:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1); returns whether it did.

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


def collective_device() -> torch.device:
    """Where tensors must live for collectives: the current CUDA device under NCCL, else CPU."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over ranks (a new tensor; ``t`` is untouched). The ``reduce`` of the math core."""
    if not is_distributed():
        return t
    out = t.detach().clone().to(collective_device())
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(t.device)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if not is_distributed():
        return t
    out = t.detach().clone().to(collective_device())
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.to(t.device)


def all_gather_rows(t: torch.Tensor, pad_value: float = 0) -> torch.Tensor:
    """Concatenate every rank's ``t`` along dim 0, in rank order.

    Ranks may hold different numbers of rows and (for 2-D tensors) widths: widths are padded with
    ``pad_value`` to the global maximum first. Returns [sum of rows, max width, ...].
    """
    if not is_distributed():
        return t
    dev = collective_device()
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
    parts = [g[: int(s[0])] for g, s in zip(gathered, shapes, strict=True)]
    return torch.cat(parts).to(t.device)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (small Python objects: decisions, states)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def average_gradients(params: list[torch.nn.Parameter]) -> None:
    """Average ``.grad`` over ranks in one flat all-reduce (data-parallel gradient sync).

    Parameters without a gradient contribute zeros, so every rank calls the same collective
    with the same shape whatever its data.
    """
    if not is_distributed():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads]).to(collective_device())
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size()
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.device, p.dtype)
        offset += n


def barrier() -> None:
    if is_distributed():
        dist.barrier()
