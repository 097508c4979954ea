"""Numerical precision: which dtype each model is kept, computed and saved in.

Owns the one rule every command follows (``precision``: ``fp32``, ``bf16-mixed``, ``fp16-mixed``,
``auto``; float32 masters for trained models), loss scaling, and the saved dtypes
(:func:`save_pretrained_as`). Must not know about configs, trainers or servers: they resolve a
setting once with :meth:`Precision.resolve` and pass the :class:`Precision` down.
Design notes: docs/models.md, "Module notes" (and "Precision").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import Any, Literal, ParamSpec, TypeVar

import torch
from transformers import PreTrainedModel

from openaligner.io.checkpoint import give_default_modes
from openaligner.models.lora import is_peft_model
from openaligner.models.sharding import full_state_dict, is_sharded

PrecisionName = Literal["fp32", "bf16-mixed", "fp16-mixed"]
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16-mixed", "fp16-mixed")
"""The values of a command's ``precision`` key."""
SAVE_DTYPES: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")
"""The values of a command's ``save_dtype`` key."""

MASTER_DTYPE = torch.float32
"""What trained weights (and so their optimizer state and resume checkpoints) are kept in."""

_EXPLICIT: dict[str, PrecisionName] = {"fp32": "fp32", "bf16-mixed": "bf16-mixed", "fp16-mixed": "fp16-mixed"}
_COMPUTE: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "fp16-mixed": torch.float16,
}
_SAVE: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# How Hugging Face config.json files name the floating dtypes (its "dtype" / legacy "torch_dtype").
_HF_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

P = ParamSpec("P")
R = TypeVar("R")


def check_precision(value: str, key: str) -> None:
    """Refuse a ``precision`` setting that is not one of :data:`PRECISIONS`, naming ``key``."""
    if value not in PRECISIONS:
        raise ValueError(
            f"{key} must be one of {', '.join(PRECISIONS)}, got {value!r} "
            "(auto: bf16-mixed on CUDA, fp32 elsewhere; see docs/models.md, Precision)"
        )


def check_save_dtype(value: str, key: str) -> None:
    """Refuse a ``save_dtype`` setting that is not one of :data:`SAVE_DTYPES`, naming ``key``."""
    if value not in SAVE_DTYPES:
        raise ValueError(
            f"{key} must be one of {', '.join(SAVE_DTYPES)}, got {value!r} "
            "(auto: the dtype the source checkpoint was stored in)"
        )


@dataclass(frozen=True)
class Precision:
    """A resolved precision on one kind of device.

    Attributes:
        name: ``fp32``, ``bf16-mixed`` or ``fp16-mixed`` (never ``auto``).
        device_type: the autocast device type, e.g. ``cpu`` or ``cuda``.
    """

    name: PrecisionName = "fp32"
    device_type: str = "cpu"

    @classmethod
    def resolve(cls, setting: str, device: torch.device) -> Precision:
        """``setting`` (one of :data:`PRECISIONS`) for models on ``device``.

        ``auto`` is ``bf16-mixed`` on a CUDA device whose hardware has bfloat16 (Ampere and later),
        else ``fp32``: float16 needs loss scaling and can overflow, so it is never picked silently.
        """
        check_precision(setting, "precision")
        if setting == "auto":
            native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
            return cls("bf16-mixed" if native_bf16 else "fp32", device.type)
        return cls(_EXPLICIT[setting], device.type)

    @property
    def mixed(self) -> bool:
        """Whether forwards run under autocast (and trained weights are masters of another dtype)."""
        return self.name != "fp32"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype autocast computes matrix products in (float32 for ``fp32``)."""
        return _COMPUTE[self.name]

    @property
    def inference_dtype(self) -> torch.dtype:
        """What an inference-only model's weights are cast to: the compute dtype."""
        return self.compute_dtype

    def autocast(self) -> AbstractContextManager[object]:
        """The context a forward (and its backward) runs in: ``torch.autocast`` when mixed, else a
        no-op (``fp32`` must stay bit-identical to code that never heard of autocast)."""
        if not self.mixed:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def autocast_fn(self, fn: Callable[P, R]) -> Callable[P, R]:
        """``fn`` run under :meth:`autocast` (for a callable handed to a server); ``fn`` itself
        under ``fp32``."""
        if not self.mixed:
            return fn

        @wraps(fn)
        def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
            with self.autocast():
                return fn(*args, **kwargs)

        return wrapped

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A loss scaler: dynamic under ``fp16-mixed``; a pass-through otherwise (``scale``
        returns the loss unchanged, ``step`` is ``optimizer.step()``, ``update`` does nothing)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.name == "fp16-mixed")


def stored_dtype(model_path: str | Path | None) -> torch.dtype:
    """The dtype a Hugging Face directory's ``config.json`` says its weights are stored in
    (``dtype``, or the older ``torch_dtype``); float32 when it says nothing or names no floating
    dtype, and for ``None`` (a built-in tiny model, built in float32)."""
    if model_path is None:
        return torch.float32
    config = json.loads((Path(model_path) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    return _HF_NAMES.get(str(name), torch.float32)


def resolve_save_dtype(setting: str, model_path: str | Path | None) -> torch.dtype:
    """The dtype a final export is written in: ``setting`` (one of :data:`SAVE_DTYPES`), where
    ``auto`` is :func:`stored_dtype` of the source ``model_path`` — what came in goes out."""
    check_save_dtype(setting, "save_dtype")
    return stored_dtype(model_path) if setting == "auto" else _SAVE[setting]


def save_pretrained_as(
    model: PreTrainedModel,
    directory: str | Path,
    dtype: torch.dtype | None = None,
    *,
    max_shard_size: int | str | None = None,
) -> None:
    """:func:`_write_pretrained` (see there), then the weight files given the directory's usual
    mode (:func:`~openaligner.io.checkpoint.give_default_modes`: safetensors writes them ``0o600``)."""
    _write_pretrained(model, directory, dtype, max_shard_size=max_shard_size)
    if Path(directory).is_dir():  # not on a rank whose shards went to rank 0
        give_default_modes(Path(directory))


def _write_pretrained(
    model: PreTrainedModel,
    directory: str | Path,
    dtype: torch.dtype | None = None,
    *,
    max_shard_size: int | str | None = None,
) -> None:
    """``model.save_pretrained(directory)`` with its floating weights written as ``dtype`` (None:
    as they are). The live model is not touched; tied weights stay tied (cast once), integer
    buffers keep their dtype, and ``config.json`` states ``dtype`` so that loaders with
    ``dtype="auto"`` read the weights back in it. Weights beyond ``max_shard_size`` (bytes, or
    ``"5GB"``-style; None: ``transformers``' default, 50 GB in ``transformers`` 5) are split into
    ``model-0000i-of-0000n.safetensors`` files with a ``model.safetensors.index.json``, which
    ``from_pretrained`` (and :func:`~openaligner.models.weights.load_weights_into`) follows.

    A sharded model (:func:`openaligner.models.sharding.is_sharded`) makes this a collective:
    every rank calls it with the same ``directory``; the whole weights are gathered to rank 0 on
    the CPU (:func:`~openaligner.models.sharding.full_state_dict`, so rank 0 needs the CPU memory
    of the float32 model) and rank 0 alone writes. Any other model: call it on the rank that writes.

    A LoRA model (a ``peft`` ``PeftModel``, :mod:`openaligner.models.lora`) writes its adapter
    directory (``adapter_config.json`` + ``adapter_model.safetensors``) with the adapters (and a
    trained head) as they are, float32 masters, whatever ``dtype``: they are small, and a merge
    into the base should start from the masters; ``dtype`` applies to the merged model."""
    # None leaves save_pretrained's own default (which a caller may have bound, e.g. a test's partial).
    sizes: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    state: dict[str, torch.Tensor] | None = None
    if is_sharded(model):
        state = full_state_dict(model)
        if state is None:  # not rank 0: its shards went to rank 0
            return
    if is_peft_model(model):
        # No embedding layers unless adapted ("auto" may look the base up by name to compare vocabularies).
        model.save_pretrained(str(directory), save_embedding_layers=False, state_dict=state)
        return
    if state is None:
        if dtype is None or all(p.dtype == dtype for p in model.parameters()):
            model.save_pretrained(str(directory), **sizes)
            return
        state = model.state_dict()
    if dtype is None:  # a sharded model's gathered masters, as they are
        model.save_pretrained(str(directory), state_dict=state, **sizes)
        return
    cast: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    def convert(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        key = (t.data_ptr(), t.dtype, tuple(t.shape))  # tied tensors share one cast copy
        if key not in cast:
            cast[key] = t.detach().to(dtype)
        return cast[key]

    model.save_pretrained(
        str(directory),
        state_dict={name: convert(t) for name, t in state.items()},
        **sizes,
    )
    # save_pretrained writes the live model's dtype into config.json; the file holds ``dtype``.
    config_path = Path(directory) / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
