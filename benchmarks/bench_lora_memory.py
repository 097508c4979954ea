"""What LoRA saves in training memory and on disk, full fine-tuning against ``lora.r`` adapters.

For each model, with and without LoRA (``target_modules=[all-linear]``, as the commands default):
trained parameters, the bytes of their gradients and of AdamW's state (read from the optimizer
after one real step of the SFT loss on one 2 × 64-token batch, float32 masters as every command
trains), and the bytes of a checkpoint's model directory (``model.safetensors`` against
``adapter_model.safetensors``). Weights themselves are the same in both (the base is frozen, not
dropped), and activations are not counted (LoRA keeps them: the backward still runs through every
layer). Models: the canonical benchmark GPT-2 (/work/shared/bench/workload.md), the same shape as
a Llama, and GPT-2 small's shape (124 M parameters; random weights). Prints one JSON object.
Usage: ``python benchmarks/bench_lora_memory.py [--ranks 8 16] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

MIB = 2**20


def _models() -> dict[str, Any]:
    from openaligner.models.builders import WORKLOAD_SIZE, TinySize, build_tiny_causal_lm

    gpt2_small = TinySize(vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12, max_positions=1024)
    return {
        "workload_gpt2_4x256": lambda: build_tiny_causal_lm("gpt2", WORKLOAD_SIZE),
        "workload_llama_4x256": lambda: build_tiny_causal_lm("llama", WORKLOAD_SIZE),
        "gpt2_small_shape_124M": lambda: build_tiny_causal_lm("gpt2", gpt2_small),
    }


def _measure(model: torch.nn.Module, work: Path) -> dict[str, float]:
    from openaligner.algorithms import next_token_logprobs
    from openaligner.models.precision import save_pretrained_as
    from openaligner.trainer.optim import OptimConfig, build_optimizer

    optimizer, _ = build_optimizer(model.parameters(), OptimConfig(lr=1e-4), None)
    tokens = torch.randint(3, 500, (2, 64), generator=torch.Generator().manual_seed(0))
    (-next_token_logprobs(model(input_ids=tokens).logits, tokens).mean()).backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in trained if p.grad is not None)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    save_pretrained_as(model, work)  # what a checkpoint's model directory holds
    files = [f for f in work.iterdir() if f.suffix == ".safetensors"]
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "trained_parameters": sum(p.numel() for p in trained),
        "grad_mib": grad_bytes / MIB,
        "adamw_state_mib": sum(t.numel() * t.element_size() for t in state) / MIB,
        "checkpoint_weights_mib": sum(f.stat().st_size for f in files) / MIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from openaligner.models.lora import LoraConfig, add_lora

    results: dict[str, Any] = {}
    for name, build in _models().items():
        rows: dict[str, Any] = {}
        with tempfile.TemporaryDirectory() as tmp:
            rows["full"] = _measure(build(), Path(tmp) / "full")
            for r in args.ranks:
                torch.manual_seed(0)
                rows[f"lora_r{r}"] = _measure(add_lora(build(), LoraConfig(r=r)), Path(tmp) / f"r{r}")
        full = rows["full"]
        for key, row in rows.items():
            if key != "full":
                row["adamw_state_vs_full"] = row["adamw_state_mib"] / full["adamw_state_mib"]
        results[name] = rows
    report = {"threads": args.threads, "target_modules": ["all-linear"], "models": results}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
