"""Weights by file: the policy's state dict as the vLLM engine loads it (``engine_state_dict``),
written as one ``model.safetensors`` that is never seen half-written, and placed into the
directory of an engine on this machine. The engine reloads it on ``POST /reload_weights``.

Must not talk to an engine (the link does) nor know its process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"
"""The file the engine loads its weights from (``vllm_worker.WEIGHTS_FILE``)."""


def engine_state_dict(
    state: dict[str, torch.Tensor], dtype: torch.dtype, tied: bool, *, own_copies: bool = True
) -> dict[str, torch.Tensor]:
    """``state`` as the engine loads it: floats cast to ``dtype``, every tensor contiguous, with an
    explicit ``lm_head.weight`` for a model whose head is tied to its input embedding (vLLM's CPU
    build keeps a packed copy of the head that a reload without that key leaves stale).

    ``own_copies`` (a file's tensors): each its own CPU copy, since safetensors refuses tensors
    that share memory, and tied weights do. Without it (a broadcast, which copies every tensor
    into its buckets anyway) tensors stay on their device and share memory where they can."""
    out = {}
    for name, t in state.items():
        t = t.detach().to(dtype=dtype if t.is_floating_point() else t.dtype)
        out[name] = t.to("cpu").clone().contiguous() if own_copies else t.contiguous()
    if tied and "lm_head.weight" not in out:
        embed = [n for n in out if n.endswith("embed_tokens.weight") or n.endswith("wte.weight")]
        if embed:
            head = out[embed[0]]
            out["lm_head.weight"] = head.clone() if own_copies else head
    return out


def write_weights(model_dir: Path, state: dict[str, torch.Tensor], dtype: torch.dtype, tied: bool) -> None:
    """``state`` as the engine loads it (:func:`engine_state_dict`) written to
    ``model_dir/model.safetensors``: through a temporary name, then renamed into place."""
    from safetensors.torch import save_file

    tensors = engine_state_dict(state, dtype, tied)
    tmp = model_dir / "model.safetensors.tmp"  # not *.safetensors: never read half-written
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, model_dir / WEIGHTS_FILE)


def place_weights(staged: Path, engine_dir: Path) -> None:
    """``staged`` (a whole ``model.safetensors``) into an engine's own directory on this machine:
    a hard link where the file system allows (else a copy), renamed into place."""
    tmp = engine_dir / "model.safetensors.tmp"  # not *.safetensors: never read half-written
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.link(staged, tmp)
    except OSError:  # another file system, or one without hard links
        shutil.copyfile(staged, tmp)
    os.replace(tmp, engine_dir / WEIGHTS_FILE)
