"""The trainer's side of a LoRA policy's weight push to the vllm engine it started: the whole
merged model (before) against only what the adapters change (after), side by side in one process.

A push after an optimizer step builds the tensors (``CausalLMActor.inference_state_dict``: a
merged copy of the whole model; ``inference_update_state_dict``: the adapted modules merged,
:func:`~openaligner.models.lora.merged_lora_blocks`) and writes them as ``model.safetensors`` in
the engine's dtype to a directory in ``/dev/shm`` (:func:`~openaligner.rollout.weights_file.write_weights`),
which the engine then reloads in place (not measured here: it needs the engine; it reads the
same bytes back). Model: ``--model`` (default the walkthrough's Gemma 3 270M converted by ``make
real-model``), float32, with ``lora.r=16, alpha=32`` on every linear layer (the walkthrough's
LoRA settings), adapters perturbed as training would. Reports per variant the median seconds over
``--repeats`` pushes, the tensors and bytes written, and the ratio. Prints one JSON object.
Usage: ``python benchmarks/bench_lora_push.py [--model DIR] [--repeats 5] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from openaligner.models.actor import CausalLMActor
from openaligner.models.lora import LoraConfig, add_lora
from openaligner.rollout.weights_file import WEIGHTS_FILE, write_weights

DEFAULT_MODEL = Path.home() / ".cache" / "openaligner" / "gemma-3-270m"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    peft_model = add_lora(model, LoraConfig(r=16, alpha=32))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=g))
    actor = CausalLMActor(peft_model, init_policy=False)
    trained = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    variants = {"whole": actor.inference_state_dict, "changed": actor.inference_update_state_dict}
    result: dict[str, Any] = {
        "model": str(args.model),
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "threads": args.threads,
        "trained_parameters": trained,
        "repeats": args.repeats,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        for _ in range(args.repeats):
            for name, state_of in variants.items():  # alternated, so that both see the same load
                t0 = time.perf_counter()
                state = state_of()
                assert state is not None
                write_weights(Path(tmp), state, torch.float32, tied)
                times[name].append(time.perf_counter() - t0)
                result[name] = {
                    "tensors": len(state),
                    "parameters": sum(t.numel() for t in state.values()),
                    "file_bytes": (Path(tmp) / WEIGHTS_FILE).stat().st_size,
                }
    for name, values in times.items():
        result[name]["median_s"] = statistics.median(values)
        result[name]["all_s"] = values
    result["ratio_changed_over_whole"] = result["changed"]["median_s"] / result["whole"]["median_s"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
