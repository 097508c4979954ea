"""Restoring a saved Hugging Face directory's weights into a model that already exists (resume).

Owns the one way openaligner reloads weights in place: the directory is loaded by the live
model's own class and config on the CPU (so ``transformers`` renames keys as ``from_pretrained``
would) and copied into the live tensors; a ``peft`` model from its adapter directory.
Must not know about trainers, optimizers or the checkpoint layout around the directory.
Design notes: docs/models.md, "Module notes".
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from openaligner.models.lora import ADAPTER_CONFIG, is_peft_model
from openaligner.models.reward import ScalarHeadModel


def load_weights_into(model: nn.Module, directory: str | Path) -> None:
    """Overwrite ``model``'s weights in place with those saved in ``directory``.

    Args:
        model: a ``PreTrainedModel`` (``directory`` is what its ``save_pretrained`` wrote: one
            ``model.safetensors`` or shards with an index, any architecture ``from_pretrained``
            loads); a :class:`~openaligner.models.reward.ScalarHeadModel` (its ``hf_model`` is
            loaded; the float32 head stays float32); or a ``peft.PeftModel`` (``directory`` is its
            adapter directory; only the adapter weights are loaded, the base model is untouched).
        directory: a local directory; nothing is downloaded.

    The parameters and buffers stay the same tensor objects, with their dtype and device, so an
    optimizer built over them remains valid. The caller's RNG state is not advanced. While
    loading, a second copy of the model is held on the CPU.

    Raises:
        ValueError: the directory does not hold weights for this model: names the directory and
            the missing, unexpected or mis-shaped keys.
    """
    path = Path(directory)
    if isinstance(model, ScalarHeadModel):
        model = model.hf_model
    if is_peft_model(model):
        _load_adapters(model, path)
    elif isinstance(model, PreTrainedModel):
        _load_full(model, path)
    else:
        raise TypeError(
            f"cannot load {path} into a {type(model).__name__}: expected a Hugging Face PreTrainedModel, "
            "a ScalarHeadModel or a peft PeftModel"
        )


def _load_full(model: PreTrainedModel, path: Path) -> None:
    """Load ``path`` with ``type(model).from_pretrained`` and copy its state into ``model``."""
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory; expected a Hugging Face model directory")
    if (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file():
        raise ValueError(
            f"{path} holds a LoRA adapter, but the model is a plain {type(model).__name__}: the "
            "checkpoint was written with LoRA; resume with the lora settings it was written with"
        )
    live = model.state_dict()
    # The widest live float dtype (e.g. float32 when a bfloat16 backbone has a float32 head), so
    # no saved tensor is rounded on its way into the live one.
    dtype = _widest_float_dtype(live.values())
    # from_pretrained initialises weights the directory lacks (reported below as missing); keep
    # that from moving the caller's RNG, which a resumed run must find as the checkpoint left it.
    with torch.random.fork_rng(devices=[]):
        try:
            # With output_loading_info, from_pretrained returns (model, info): typed as a model only.
            result: Any = type(model).from_pretrained(
                str(path),
                config=copy.deepcopy(model.config),
                dtype=dtype,
                local_files_only=True,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported in the loading info, refused below
            )
        except (OSError, RuntimeError, ValueError) as e:
            raise ValueError(f"cannot load {path} into the {type(model).__name__}: {e}") from e
    loaded, info = result
    problems = {
        "missing": sorted(info.get("missing_keys", ())),
        "unexpected": sorted(info.get("unexpected_keys", ())),
        "mis-shaped": sorted(str(k[0]) for k in info.get("mismatched_keys", ())),
    }
    saved = loaded.state_dict()
    # Same class and config give the same keys, unless the live model was altered after building.
    problems["not in the loaded model"] = sorted(set(live) - set(saved))
    _raise_on_mismatch(path, type(model).__name__, problems)
    with torch.no_grad():
        for name, tensor in live.items():
            tensor.copy_(saved[name])


def _load_adapters(model: nn.Module, path: Path) -> None:
    """Load every adapter of a ``PeftModel`` from the layout ``PeftModel.save_pretrained`` writes
    (``default`` in ``path``, any other adapter in ``path/<name>``)."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    names = list(getattr(model, "peft_config"))  # noqa: B009 (PEFT API, untyped here)
    live = model.state_dict()
    for name in names:
        adapter_dir = path if name == "default" else path / name
        if not (adapter_dir / ADAPTER_CONFIG).is_file():
            raise ValueError(
                f"{adapter_dir} has no {ADAPTER_CONFIG}; expected the LoRA adapter directory that "
                "PeftModel.save_pretrained writes (a checkpoint written without LoRA cannot resume a "
                "run with lora.r > 0)"
            )
        weights = load_peft_weights(str(adapter_dir), device="cpu")
        try:
            loaded: Any = set_peft_model_state_dict(model, weights, adapter_name=name)
        except RuntimeError as e:  # a shape mismatch (e.g. another LoRA rank)
            raise ValueError(f"cannot load the adapter {adapter_dir} into the PEFT model: {e}") from e
        # load_state_dict(strict=False) reports every base-model weight as missing; only this
        # adapter's own tensors (``….lora_A.<name>.weight``, ``….modules_to_save.<name>.…``) count.
        adapter_keys = {k for k in live if f".{name}." in f".{k}."}
        problems = {
            "missing": sorted(adapter_keys & set(loaded.missing_keys)),
            "unexpected": sorted(loaded.unexpected_keys),
        }
        _raise_on_mismatch(adapter_dir, f"adapter {name!r}", problems)


def _raise_on_mismatch(path: Path, what: str, problems: dict[str, list[str]]) -> None:
    found = {kind: keys for kind, keys in problems.items() if keys}
    if not found:
        return
    detail = "; ".join(
        f"{kind} {keys[:5]}{f' and {len(keys) - 5} more' if len(keys) > 5 else ''}"
        for kind, keys in found.items()
    )
    raise ValueError(
        f"checkpoint weights in {path} do not match the {what}: {detail}; "
        "was the model source changed since the checkpoint was written?"
    )


def _widest_float_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    return max(floats, key=lambda d: torch.finfo(d).bits, default=torch.float32)
