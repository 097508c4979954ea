"""LoRA adapters through ``peft``: the ``lora`` section of a command, putting adapters on a model,
and the model with its adapters merged in.

Owns :class:`LoraConfig` (``r = 0``: off), :func:`add_lora`, :func:`merged_copy` (and the part
of it a step changes, :func:`merged_lora_blocks`), :func:`merged_state_dict` and
:func:`adapter_directory_problem`. Must not know about configs of other sections, trainers,
optimizers or servers; ``peft`` is imported only when adapters are asked for.
Design notes: docs/lora.md, "Module notes".
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast, overload

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

log = logging.getLogger(__name__)

MERGED_DIR = "merged"
"""Sub-directory of a LoRA run's final export holding the merged model (``lora.merge_on_save``)."""
ADAPTER_CONFIG = "adapter_config.json"
"""The file that marks a ``peft`` adapter directory."""
ALL_LINEAR = "all-linear"
"""``peft``'s name for every linear layer except the output head."""
INSTALL_HINT = "pip install 'openaligner[lora]' (or pip install peft)"


class LoraError(ValueError):
    """Adapters that cannot be put on this model; the message names the ``lora`` key and the fix."""


@dataclass
class LoraConfig:
    r: int = 0  # adapter rank; 0 = no LoRA (every weight trains); > 0 trains only the adapters (and heads)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / r (peft's lora_alpha)
    dropout: float = 0.0  # adapters' input dropout in training (> 0 refused where models train in eval mode)
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])  # layer names, or all-linear
    merge_on_save: bool = False  # final export also writes <export>/merged: a plain HF model, adapters merged

    def __post_init__(self) -> None:
        # {section}: this section's key in the command's schema (lora), filled in by the loader
        if self.r < 0:
            raise ValueError(f"{{section}}.r must be >= 0 (0 = no LoRA), got {self.r}")
        if self.r == 0:
            if self.merge_on_save:
                raise ValueError(
                    "{section}.merge_on_save=true needs {section}.r > 0: without adapters the export "
                    "already is the whole model"
                )
            return
        if self.alpha <= 0:
            raise ValueError(f"{{section}}.alpha must be > 0 (e.g. 16), got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{{section}}.dropout must lie in [0, 1), got {self.dropout}")
        if not self.target_modules or (ALL_LINEAR in self.target_modules and len(self.target_modules) > 1):
            raise ValueError(
                f"{{section}}.target_modules must be [{ALL_LINEAR}] or a non-empty list of layer names "
                f"(e.g. [q_proj, v_proj]), got {list(self.target_modules)}"
            )
        if not peft_installed():
            raise ValueError(
                f"{{section}}.r={self.r} needs the peft package, which is not installed: {INSTALL_HINT}"
            )

    @property
    def enabled(self) -> bool:
        """Whether adapters are put on the model (``r > 0``)."""
        return self.r > 0


class HoldsHFModel(Protocol):
    """A module that keeps its Hugging Face model as ``hf_model`` and computes through it (the
    reward model and the critic: :class:`~openaligner.models.reward.ScalarHeadModel`)."""

    hf_model: PreTrainedModel


_H = TypeVar("_H", bound=HoldsHFModel)


@overload
def add_lora(model: PreTrainedModel, cfg: LoraConfig) -> PreTrainedModel: ...


@overload
def add_lora(model: _H, cfg: LoraConfig) -> _H: ...


def add_lora(model: PreTrainedModel | HoldsHFModel, cfg: LoraConfig) -> PreTrainedModel | HoldsHFModel:
    """``model`` with LoRA adapters of ``cfg`` (``cfg.r = 0``: ``model`` itself, untouched).

    Args:
        model: a causal LM (returned as a ``peft`` ``PeftModelForCausalLM``, which forwards every
            attribute and call to it: use it where the model was used), or a scalar-head model
            (returned itself, its ``hf_model`` now a ``PeftModelForSequenceClassification`` whose
            head ``score`` trains in full). Wrap before building the optimizer.
        cfg: the ``lora`` section.

    Only the adapters (and a scalar head) require gradients afterwards; the base weights keep
    their values, dtype and device, and are not copied.

    Raises:
        LoraError: ``peft`` is missing, or no layer of the model matches ``cfg.target_modules``.
        TypeError: ``model`` is neither a causal LM nor a scalar-head model.
    """
    if not cfg.enabled:
        return model
    if isinstance(model, PreTrainedModel):
        if not model.can_generate():
            raise TypeError(
                f"{type(model).__name__} is not a causal LM; put LoRA on a reward model or critic "
                "(RewardModel, CriticModel) rather than on its Hugging Face classifier"
            )
        return _wrap(model, cfg, "CAUSAL_LM")
    if isinstance(getattr(model, "hf_model", None), PreTrainedModel):
        # SEQ_CLS: peft keeps a trained copy of the head (modules_to_save: classifier, score).
        model.hf_model = _wrap(model.hf_model, cfg, "SEQ_CLS")
        return model
    raise TypeError(
        f"cannot put LoRA adapters on a {type(model).__name__}: expected a causal LM or a ScalarHeadModel"
    )


@contextmanager
def _peft_wrapping() -> Iterator[None]:
    """Around peft's wrapping of a model: peft reads ``PreTrainedModel.is_gradient_checkpointing``
    there, a property transformers 5 deprecates with a FutureWarning at every read, so every LoRA
    command printed it at start although neither it nor the user calls the property. Only that
    warning, only here: a deprecation in anything else still shows."""
    with warnings.catch_warnings():
        deprecated = r"`is_gradient_checkpointing` is deprecated"
        warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)
        yield


def _wrap(model: PreTrainedModel, cfg: LoraConfig, task_type: str) -> PreTrainedModel:
    peft = require_peft(f"lora.r={cfg.r}")
    targets: str | list[str] = ALL_LINEAR if cfg.target_modules == [ALL_LINEAR] else list(cfg.target_modules)
    config = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        task_type=task_type,
        # GPT-2's linear layers are Conv1D (weights stored transposed); peft would warn and set it
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
    )
    try:
        with _peft_wrapping():
            wrapped = peft.get_peft_model(model, config)
    except ValueError as e:
        if "not found in the base model" not in str(e) and "no target modules" not in str(e).lower():
            raise
        raise LoraError(
            f"lora.target_modules={list(cfg.target_modules)} matches no layer of the "
            f"{type(model).__name__}; its linear layers are named {sorted(_linear_names(model))} "
            f"(or use lora.target_modules=[{ALL_LINEAR}])"
        ) from None
    trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    log.info(
        "LoRA r=%d on %s: %d of %d parameters train (%.2f%%)",
        cfg.r,
        targets,
        trained,
        total,
        100.0 * trained / max(total, 1),
    )
    # PeftModel forwards attributes and calls to the model it wraps: typed as that model.
    return cast(PreTrainedModel, wrapped)


def _linear_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear | Conv1D)}


def peft_installed() -> bool:
    """Whether ``peft`` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("peft") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules holds peft without a spec (or None)
        return False


def require_peft(what: str) -> Any:
    """The ``peft`` module; :class:`LoraError` naming ``what`` (the setting that needs it) if missing."""
    try:
        import peft
    except ImportError:
        raise LoraError(f"{what} needs the peft package, which is not installed: {INSTALL_HINT}") from None
    return peft


def is_peft_model(model: object) -> bool:
    """Whether ``model`` is a ``peft`` ``PeftModel`` (False whenever ``peft`` was never imported:
    then nothing can be one)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def unwrap(model: nn.Module) -> nn.Module:
    """The model a ``PeftModel`` wraps (its layers carry the adapters), or ``model`` itself."""
    if not is_peft_model(model):
        return model
    wrapper: Any = model  # a peft PeftModel (its API is untyped here)
    return cast(nn.Module, wrapper.get_base_model())


def merged_copy(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> PreTrainedModel:
    """A plain Hugging Face model (the class :func:`add_lora` wrapped) on the CPU, with the
    adapters merged into its weights (``W + alpha / r · B A``) and a trained head in place.

    Args:
        model: what :func:`add_lora` returned: a ``peft`` model, or a scalar-head model holding
            one as ``hf_model`` (the merged model is then that ``*ForSequenceClassification``).
        state: ``model``'s whole state dict (its ``state_dict()`` keys) to merge instead of its
            live tensors — for a sharded model, whose tensors are shards: what
            :func:`~openaligner.models.sharding.full_state_dict` gathered. A fresh ``peft`` model
            is then built on the CPU from ``model``'s configs (the caller's RNG untouched) and
            loaded from it.

    ``model`` is not changed: its tensors are copied to the CPU one by one (no second copy on its
    device), and the copy is merged. Its logits equal the adapted model's to float rounding.
    """
    peft_model = model if is_peft_model(model) else getattr(model, "hf_model", None)
    if not is_peft_model(peft_model):
        raise TypeError(f"{type(model).__name__} has no LoRA adapters to merge")
    if state is None:
        copied = _cpu_copy(cast(nn.Module, peft_model))
    else:
        prefix = "" if peft_model is model else "hf_model."
        own = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        copied = _rebuilt(peft_model, own)
    merged = copied.merge_and_unload()
    assert isinstance(merged, PreTrainedModel)
    return merged


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of ``model`` (a causal LM, or what :func:`add_lora` made of one) as the plain
    model holds them: each adapted layer's ``weight`` is ``W + alpha / r · B A`` (a new tensor),
    every other tensor is the model's own (not copied), adapters' own tensors left out.

    Unlike :func:`merged_copy`, an adapter on an output head tied to the input embedding changes
    only the head: the result then holds ``lm_head.weight`` apart from the embedding (as the
    adapted model computes), so whoever loads it must not tie them again. ``merged_copy`` merges
    into the one shared tensor and so changes the embedding too.
    """
    if not is_peft_model(model):
        return dict(model.state_dict())
    peft = require_peft("merging LoRA adapters")
    inner = unwrap(model)
    layers = {
        name: module
        for name, module in inner.named_modules()
        if isinstance(module, peft.tuners.lora.LoraLayer)
    }
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in inner.state_dict().items():
            if ".lora_" in key:
                continue
            out[key.replace(".base_layer.", ".")] = value
        for name, layer in layers.items():
            base = layer.get_base_layer().weight
            delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
            out[f"{name}.weight"] = (base + delta).detach()
    return out


def merged_export_copy(model: nn.Module) -> PreTrainedModel | None:
    """:func:`merged_copy` of ``model``'s whole weights, for writing the merged export. For a sharded
    model a collective (every rank calls it; the weights are gathered to rank 0, and the other ranks
    get None); otherwise the model's own tensors, on the caller's rank."""
    from openaligner.models.sharding import full_state_dict, is_sharded

    if not is_sharded(model):
        return merged_copy(model)
    state = full_state_dict(model)
    return None if state is None else merged_copy(model, state)


def merged_lora_blocks(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """What an optimizer step changes in :func:`merged_copy`'s state dict, for an engine that holds
    the merged weights already: the merged weights of the adapted layers (merged as
    :func:`merged_copy` merges them: the same values, bit for bit) and every other tensor of the
    modules that hold them (an engine may fuse siblings — q/k/v into one qkv — and reload a fused
    layer only whole), under :func:`merged_copy`'s names; CPU copies, ``model`` unchanged.

    ``model``: a ``peft`` model, not sharded. None when that is not all that trains: a trainable
    tensor outside the adapters (``modules_to_save``), or an adapted module at the top level."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if any(p.requires_grad and ".lora_" not in n for n, p in model.named_parameters()):
        return None
    base = unwrap(model)
    adapted = [n for n, m in base.named_modules() if isinstance(m, BaseTunerLayer)]
    parents = sorted({n.rpartition(".")[0] for n in adapted})
    if "" in parents:
        return None
    # a parent inside another one is already part of it
    parents = [p for p in parents if not any(p.startswith(q + ".") for q in parents)]
    out: dict[str, torch.Tensor] = {}
    for parent in parents:
        block = _cpu_copy(base.get_submodule(parent))
        for module in block.modules():
            if isinstance(module, BaseTunerLayer):
                module.merge()
        for name, tensor in block.state_dict().items():
            if ".lora_" not in f".{name}":
                # peft's wrappers hold the base tensor as base_layer (once per wrapped parameter)
                out[re.sub(r"(\.base_layer)+\.", ".", f"{parent}.{name}")] = tensor
    return out


def _rebuilt(peft_model: Any, state: dict[str, torch.Tensor]) -> Any:
    """A fresh CPU ``peft`` model like ``peft_model`` (its ``default`` adapter), holding ``state``.

    The wrapped model's class is its own: sharding (:mod:`openaligner.models.sharding`) makes
    only the decoder layers and the outermost module its units, so it is not a sharded class."""
    peft = require_peft("merging LoRA adapters")
    base = unwrap(peft_model)
    with torch.random.fork_rng(devices=[]):
        fresh = type(base)(copy.deepcopy(base.config))
        with _peft_wrapping():
            rebuilt = peft.get_peft_model(fresh, copy.deepcopy(peft_model.peft_config["default"]))
    rebuilt.load_state_dict(state)
    return rebuilt.eval()


def _cpu_copy(module: nn.Module) -> Any:
    """A deep copy of ``module`` whose parameters and buffers are CPU copies (tied ones stay tied)."""
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for p in module.parameters():
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=p.requires_grad)
        for b in module.buffers():
            if id(b) not in memo:
                memo[id(b)] = b.detach().to("cpu", copy=True)
    return copy.deepcopy(module, memo)


def load_adapter_merged(adapter_dir: str | Path, base_dir: str | Path, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM of ``base_dir`` with the LoRA adapter of ``adapter_dir`` (a run's ``actor/`` or
    a checkpoint's ``step_<N>/actor/``) merged into its weights, in ``dtype``, on the CPU: what the
    run's merged export of that step would hold, for evaluating an intermediate checkpoint.

    Raises:
        LoraError: ``adapter_dir`` holds no adapter (no ``adapter_config.json``).
    """
    if not (Path(adapter_dir) / ADAPTER_CONFIG).is_file():
        raise LoraError(f"{adapter_dir} holds no LoRA adapter ({ADAPTER_CONFIG})")
    peft = require_peft("loading a LoRA adapter over its base")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype, local_files_only=True)
    with _peft_wrapping():
        adapted = peft.PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False)
    merged = adapted.merge_and_unload()
    assert isinstance(merged, PreTrainedModel)
    return merged.eval()


def adapter_directory_problem(path: str | Path) -> str | None:
    """What is wrong with ``path`` as a model directory if it holds a LoRA adapter without a model
    (``None`` otherwise): a next stage loads whole models, so it is pointed at the merged directory
    a LoRA run writes (its base is not loaded from the adapter's ``base_model_name_or_path``: a
    built-in tiny base has none)."""
    p = Path(path)
    if not (p / ADAPTER_CONFIG).is_file() or (p / "config.json").is_file():
        return None
    merged = p / MERGED_DIR
    if (merged / "config.json").is_file():
        return f"holds a LoRA adapter, not a whole model: use the merged directory {merged}"
    return (
        f"holds a LoRA adapter, not a whole model, and no merged model ({merged}); run the stage that "
        "wrote it with lora.merge_on_save=true (adapters are not loaded over a base here)"
    )
