"""How a model's weights are laid over the ranks: replicas (``ddp``) or shards (``fsdp``, PyTorch's
FSDP2 ``fully_shard``), the ``parallel`` section of every command that holds a model.

Owns :class:`ParallelConfig` / :class:`ActorParallelConfig`, :func:`distribute`, :func:`shard`,
rank 0's load shared with the others (:func:`fill_from_leader`), :func:`gathered`,
:func:`full_state_dict` and the memory figures, with sharded training the same math as replicas.
Must not know about trainers, optimizers' configs, servers or checkpoints' layout.
Design notes (what each owns, the conventions): docs/scaling.md, "Module notes".
"""

from __future__ import annotations

import copy
import ctypes
import functools
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from openaligner import distributed as dp

log = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)
Strategy = Literal["ddp", "fsdp"]
STRATEGIES: tuple[str, ...] = ("ddp", "fsdp")
GENERATIONS: tuple[str, ...] = ("gathered", "layerwise")


class ShardingError(ValueError):
    """A ``parallel`` setting that cannot work with this model or run; the message names the key."""


@dataclass
class ParallelConfig:
    """The ``parallel`` section: how ranks hold the weights.

    Attributes:
        strategy: ``ddp`` — every rank holds a replica, gradients are summed over ranks in one flat
            all-reduce per step; ``fsdp`` — every rank holds 1/N of each weight, its gradient and
            its optimizer state (PyTorch FSDP2), weights are gathered layer by layer for each
            forward and backward. Without torchrun (one process) both are the same.
        offload: ``fsdp`` only: the model's shards (and, when trained, its gradients and optimizer
            state) live in CPU memory and the optimizer steps there (FSDP2 ``CPUOffloadPolicy``);
            each layer is copied to the device for its forward and backward.
        activation_checkpointing: recompute each decoder layer's activations in the backward
            instead of keeping them (less memory, about one more forward of compute); either
            strategy.
    """

    strategy: str = "ddp"
    offload: bool = False
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ShardingError(f"parallel.strategy={self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        self._needs_shards("offload")

    def _needs_shards(self, key: str) -> None:
        if self.strategy != "fsdp" and getattr(self, key):
            raise ShardingError(
                f"parallel.{key}=true offloads shards, which needs parallel.strategy=fsdp "
                f"(it is {self.strategy})"
            )

    @property
    def sharded(self) -> bool:
        """Whether models are sharded (``fsdp`` under a process group of more than one rank)."""
        return self.strategy == "fsdp" and dp.world_size() > 1

    def load_device(self, device: torch.device) -> torch.device:
        """Where to load a model these settings lay out for ``device``: the CPU when it will be
        sharded (each rank reads the whole model into CPU memory once; :func:`shard` moves only
        this rank's shards to ``device``), else ``device`` itself."""
        return torch.device("cpu") if self.sharded else device

    def check_precision(self, precision_name: str, key: str = "precision") -> None:
        """Refuse fp16 loss scaling with shards: the loss scaler's overflow check would see only this
        rank's shard of the gradients, so ranks could disagree about skipping a step.

        Raises:
            ShardingError: naming both keys and the fix.
        """
        if self.strategy == "fsdp" and precision_name.startswith("fp16"):
            raise ShardingError(
                f"{key}={precision_name} with parallel.strategy=fsdp is not supported: fp16 loss scaling "
                "checks overflow per shard; use bf16-mixed (no loss scaling) or parallel.strategy=ddp"
            )


@dataclass
class ActorParallelConfig(ParallelConfig):
    """train-ppo's ``parallel`` section: :class:`ParallelConfig` plus what only the PPO actor has.

    Attributes:
        offload_init_policy: ``fsdp`` only: the frozen initial policy keeps its shards in CPU memory
            (it only runs no-grad forwards).
        generation: ``fsdp`` only, how the actor generates: ``gathered`` — the whole weights are
            gathered once per rollout phase and every step is local (fast; needs the model's
            float32 weights to fit on each device beside the shards); ``layerwise`` — each step's
            forward gathers one layer at a time like training does, all ranks stepping together
            until every rank's rows have ended (memory of one layer; an all-gather of the whole
            model per generated token).
    """

    offload_init_policy: bool = False
    generation: str = "gathered"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._needs_shards("offload_init_policy")
        if self.generation not in GENERATIONS:
            raise ShardingError(
                f"parallel.generation={self.generation!r} is not one of {', '.join(GENERATIONS)}"
            )


# ----------------------------------------------------------------------------- sharding
def decoder_layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes of ``model``'s repeated blocks: every class named in the ``_no_split_modules``
    of a Hugging Face model inside ``model`` (a PEFT wrapper or a scalar-head model included)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """``model``'s repeated blocks (see :func:`decoder_layer_classes`), outermost first and never
    one inside another."""
    classes = decoder_layer_classes(model)
    layers: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, tuple(classes)) and not any(
            module is not outer and any(m is module for m in outer.modules()) for outer in layers
        ):
            layers.append(module)
    return layers


def shard(
    model: M,
    cfg: ParallelConfig,
    *,
    offload: bool | None = None,
    name: str = "model",
) -> M:
    """Apply ``cfg`` to ``model`` in place (its class changes; parameters become DTensor shards
    under ``fsdp``) and return it.

    Call after the model is on its device and after LoRA adapters are added, and before an
    optimizer is built over its parameters (sharding replaces them). Without sharding
    (:attr:`ParallelConfig.sharded` false) only activation checkpointing applies. Sharding also
    sets this process's allocator policy (:func:`return_large_frees_to_os`).

    Args:
        offload: whether the shards live in CPU memory (default ``cfg.offload``; the initial
            policy passes ``cfg.offload_init_policy``).
        name: what the model is, for messages.

    Raises:
        ShardingError: ``fsdp`` and ``model`` lists no decoder-layer class (``_no_split_modules``).
    """
    layers = decoder_layers(model)
    if cfg.activation_checkpointing:
        if not layers:
            raise ShardingError(
                f"parallel.activation_checkpointing=true: the {name} ({type(model).__name__}) names no "
                "decoder-layer class in _no_split_modules, so there is no layer to checkpoint"
            )
        for layer in layers:
            _checkpoint_activations(layer)
    if not cfg.sharded:
        return model
    if not layers:
        raise ShardingError(
            f"parallel.strategy=fsdp: the {name} ({type(model).__name__}) names no decoder-layer class in "
            "_no_split_modules, so it cannot be sharded layer by layer; use parallel.strategy=ddp"
        )
    return_large_frees_to_os()
    use_offload = cfg.offload if offload is None else offload
    policy: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if use_offload else OffloadPolicy()
    )
    for layer in layers:
        fully_shard(layer, offload_policy=policy)
    # The root too is resharded after each forward (FSDP's default keeps it whole): a root left
    # whole by a no-grad forward (log-probs, generation) would feed the next forward stale
    # embeddings once the optimizer has stepped the shards.
    fully_shard(model, offload_policy=policy, reshard_after_forward=True)
    for module in _fsdp_modules(model):
        # Sum over ranks (as replicas do); gloo has no pre-multiplied sum, hence sum-only comms.
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    log.info(
        "%s sharded over %d ranks in %d layer units (+1)%s",
        name,
        dp.world_size(),
        len(layers),
        ", shards on the CPU" if use_offload else "",
    )
    return model


# glibc's mallopt parameter number of M_MMAP_THRESHOLD (malloc.h), and the value set: glibc's own default.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 128 * 1024


def return_large_frees_to_os() -> bool:
    """Make every allocation of at least 128 KiB a mapping of its own, returned to the OS when it is
    freed, for the rest of this process (glibc's ``mallopt(M_MMAP_THRESHOLD)``); whether it was set.

    Why: a sharded rank allocates and frees whole layers in every forward and backward (the
    all-gathered weights, the unsharded gradients before their reduce-scatter). glibc's default
    threshold is dynamic: once a mapped block of a layer's size is freed, it raises the threshold
    to that size (up to 32 MiB), so later layers come from the heap, where freed blocks stay
    resident and fragment. Measured at 74 M parameters on 2 CPU ranks, that kept ~0.5 GiB per rank
    above the live tensors (``benchmarks/bench_sharding_memory.py``; docs/benchmarks.md). A fixed
    threshold turns the dynamic rule off. Only the C allocator's host memory is concerned; CUDA
    memory has its own caching allocator. Without glibc (no ``mallopt``) nothing changes: False.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES))


def distribute(model: M, parallel: ParallelConfig, seed: int, name: str = "model") -> M:
    """``model`` laid over the ranks as ``parallel`` says (:func:`shard`; call after LoRA and before
    the optimizer), and this rank's own RNG streams from here on.

    Every rank must build ``model`` from the same seed (a new head, LoRA's initial adapters): the
    replicas start equal and the shards come from one model. Dropout and sampling then draw from
    ``seed + rank`` on each rank, so ranks do not repeat each other's draws; one process keeps its
    streams.

    Raises:
        ShardingError: ``parallel`` cannot shard this model.
    """
    model = shard(model, parallel, name=name)
    if dp.world_size() > 1:
        torch.manual_seed(seed + dp.rank())
    return model


def builds_skeleton(parallel: ParallelConfig) -> bool:
    """Whether this rank builds its model as a skeleton (meta device, nothing read or drawn) and
    receives its shards from rank 0 (:func:`fill_from_leader`): every rank but 0 of a sharded run,
    so that the host holds one whole copy of the weights instead of one per rank."""
    return parallel.sharded and not dp.is_leader()


def state_to_share(model: nn.Module, parallel: ParallelConfig) -> dict[str, torch.Tensor] | None:
    """Rank 0's whole state dict of ``model`` for :func:`fill_from_leader` (references to its
    tensors, no copy; take it before sharding), when the model will be sharded; else None."""
    if not (parallel.sharded and dp.is_leader()):
        return None
    return dict(model.state_dict())


def fill_from_leader(
    model: nn.Module, state: Mapping[str, torch.Tensor] | None, parallel: ParallelConfig, *, offload: bool
) -> None:
    """Give every rank its shards of rank 0's weights (a collective when ``parallel`` shards; call
    right after :func:`shard`; a no-op otherwise).

    Rank 0 passes :func:`state_to_share`'s dict and holds its shards, or parameters on the meta
    device (a copy made by :func:`meta_copy`, receiving its shards from ``state`` like the other
    ranks, its buffers kept); every other rank built ``model`` as a skeleton
    (:func:`builds_skeleton`) and passes None. Shards on the meta device are allocated on the
    collective device (the CPU with ``offload``) and receive their part of rank 0's tensors, then
    every buffer (rotary frequencies and others a state dict leaves out) is sent whole from rank
    0. Tied weights stay tied. When rank 0 passes None too, every rank built its whole model
    itself and nothing is sent.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not parallel.sharded or not is_sharded(model):
        return
    # Rank 0 decides: no state there means every rank built the whole model itself (nothing to send).
    if not dp.broadcast_int(int(state is not None) if dp.is_leader() else None):
        return
    if any(p.is_meta for p in model.parameters()):
        # rank 0's buffers are real also in a meta copy; allocating its parameters must not lose them
        kept = {n: b.detach().clone() for n, b in model.named_buffers()} if dp.is_leader() else {}
        model.to_empty(device=torch.device("cpu") if offload else dp.collective_device())
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in kept:
                    buffer.copy_(kept[name].to(buffer.device))
    full: dict[str, Any] = dict(state) if dp.is_leader() and state is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    for _, buffer in model.named_buffers():
        received = dp.broadcast_tensor(buffer if dp.is_leader() else None)
        if not dp.is_leader():
            buffer.copy_(received.to(buffer.device))


def meta_copy(model: M) -> M:
    """A deep copy of ``model`` whose parameters are on the meta device (no memory; shapes, dtypes,
    ``requires_grad`` and ties kept) and whose buffers are real copies: a second model that
    :func:`fill_from_leader` fills from rank 0's state, without a second whole copy of the weights
    on rank 0."""
    memo: dict[int, Any] = {}
    for param in model.parameters():  # each once: tied weights stay one parameter
        memo[id(param)] = nn.Parameter(
            torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
        )
    return copy.deepcopy(model, memo)


def _checkpoint_activations(layer: nn.Module) -> None:
    """Recompute ``layer``'s activations in the backward. Its own ``forward`` is wrapped (not the
    module), so parameter names, state dicts and saved directories are unchanged; forwards without
    gradient (generation, log-probs) run as before."""
    forward = layer.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or a module inside it) is sharded by :func:`shard`."""
    return bool(_fsdp_modules(model))


@contextmanager
def gathered(model: nn.Module, whole: bool = True) -> Iterator[None]:
    """Whole weights on every rank inside the block (no-op for a model that is not sharded).

    On entry every rank all-gathers every layer once (a collective: all ranks enter together) and
    keeps it; forwards inside are then local, so ranks may run different numbers of them
    (generation stops when each rank's own rows end). On exit the weights are sharded again. The
    cost: the whole model's float32 weights in memory on every rank for the duration, and one
    all-gather of the model per entry instead of one per layer per forward.
    """
    modules = _fsdp_modules(model)
    if not modules:
        yield
        return
    if not whole:
        try:
            yield
        finally:
            for m in modules:
                m.reshard()
        return
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m in modules:
            m.set_reshard_after_forward(True)
            m.reshard()


def compute_device(model: nn.Module) -> torch.device:
    """Where ``model``'s forwards run: a sharded model's is the collective device (its shards may
    be offloaded to CPU memory), any other's is that of its first parameter."""
    if is_sharded(model):
        return dp.collective_device()
    return next(model.parameters()).device


def any_rank_going(ended_here: bool) -> bool:
    """Whether some rank has not ended, given whether this one has (a collective; for
    ``generate(step_together=...)``)."""
    if not dp.is_distributed():
        return not ended_here
    going = torch.tensor([0.0 if ended_here else 1.0], device=dp.collective_device())
    return bool(dp.all_reduce_max(going).item() > 0)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole state dict of ``model`` on the CPU, on rank 0 (None on the other ranks), tied
    weights sharing one tensor; for a model that is not sharded, its own state dict on every rank.
    A collective for a sharded model: every rank calls it."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    gathered_state = get_model_state_dict(model, options=options)
    if not dp.is_leader():
        return None
    state = {k: v for k, v in gathered_state.items() if isinstance(v, torch.Tensor)}
    # Tied weights (GPT-2's head and embedding) come back as separate copies; tie them again, as
    # the live model's own state_dict() would, so that save_pretrained writes the tie once.
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for names in names_of.values():
        present = [n for n in names if n in state]
        for name in present[1:]:
            state[name] = state[present[0]]
    return state


def grad_norm_value(norm: torch.Tensor) -> float:
    """A total gradient norm as a float: a sharded model's norm (a DTensor) is reduced over ranks."""
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def has_sharded_params(params: Iterable[nn.Parameter]) -> bool:
    """Whether any of ``params`` is a shard (a DTensor): its gradient is reduced by the backward."""
    return any(isinstance(p, DTensor) for p in params)


def training_state_bytes(
    params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes this rank holds for ``params`` (their local shards for a sharded model), their
    gradients and ``optimizer``'s state for them: ``{"params", "grads", "optimizer", "total"}``.

    Counts allocated storage (a shard's padding included), each storage once: what sharding
    divides, as opposed to the process's resident memory (activations, allocator caches, code).
    """
    seen: set[int] = set()

    def nbytes(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return int(storage.nbytes())

    plist = list(params)
    out = {
        "params": sum(nbytes(p.data if not isinstance(p, DTensor) else p) for p in plist),
        "grads": sum(nbytes(p.grad) for p in plist),
        "optimizer": 0,
    }
    if optimizer is not None:
        for p in plist:
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    out["optimizer"] += nbytes(value)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
