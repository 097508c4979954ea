"""What sharding (``parallel.strategy=fsdp``) saves per rank, against replicas (``ddp``).

For each Llama-shaped model and each strategy, one ``torchrun --nproc_per_node RANKS`` job on this
machine builds the model on every rank (random float32 weights), applies the strategy
(:func:`openaligner.models.sharding.shard`), and runs two optimizer steps of the causal-LM loss on
a 2 × 64-token batch per rank with fused AdamW, as the trainers do. Each rank reports:

* ``state_bytes`` — parameters + gradients + AdamW state it holds
  (:func:`~openaligner.models.sharding.training_state_bytes`: allocated tensor storage, what
  sharding divides);
* ``peak_rss`` — the process's peak resident memory (``ru_maxrss``: everything, activations,
  gathered layers, the framework and the model's construction included).

Prints one JSON object (per model and strategy: parameters, both figures per rank, seconds per
step) and the ratio fsdp / ddp. Usage (the driver starts the torchrun jobs itself):
``python benchmarks/bench_sharding_memory.py [--ranks 2] [--models 52M 113M] [--offload]``
(names are the parameter counts), ``--strategies fsdp`` to measure one strategy only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS: dict[str, dict[str, int]] = {
    # name: Llama shape (vocabulary of a real tokenizer; sizes of small real models' widths)
    "19M": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "vocab_size": 32000},
    "52M": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "vocab_size": 32000},
    "113M": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "vocab_size": 32000},
    "292M": {"hidden_size": 1024, "num_layers": 24, "num_heads": 16, "vocab_size": 32000},
    "735M": {"hidden_size": 2048, "num_layers": 16, "num_heads": 16, "vocab_size": 32000},
    "1.3B": {"hidden_size": 2048, "num_layers": 28, "num_heads": 16, "vocab_size": 32000},
}
GIB = 2**30


def _rank_job(model_name: str, strategy: str, offload: bool, out: Path) -> None:
    """One rank of one job (run under torchrun by the driver)."""
    import torch

    from openaligner import distributed as dp
    from openaligner.models.builders import TinySize, build_tiny_causal_lm
    from openaligner.models.sharding import ParallelConfig, shard, training_state_bytes
    from openaligner.trainer.optim import OptimConfig, build_optimizer
    from openaligner.trainer.optim_step import optimizer_step

    torch.set_num_threads(1)
    dp.init_from_env()
    size = TinySize(max_positions=128, **MODELS[model_name])
    parallel = ParallelConfig(strategy=strategy, offload=offload)
    model = shard(build_tiny_causal_lm("llama", size, seed=0), parallel)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, _ = build_optimizer(params, OptimConfig(lr=1e-5), 10)
    tokens = torch.randint(3, size.vocab_size, (2, 64), generator=torch.Generator().manual_seed(dp.rank()))
    no_scaler = torch.amp.GradScaler("cpu", enabled=False)
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer_step(params, optimizer, None, no_scaler, max_grad_norm=1.0, gradients="mean")
        seconds.append(time.perf_counter() - started)
    report = {
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": training_state_bytes(params, optimizer),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": seconds[-1],
    }
    Path(f"{out}.rank{dp.rank()}").write_text(json.dumps(report))
    dp.shutdown()


def _run(model_name: str, strategy: str, ranks: int, offload: bool, work: Path) -> dict[str, object]:
    out = work / f"{model_name}-{strategy}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    command += [__file__, "--rank-job", model_name, strategy, str(int(offload)), str(out)]
    subprocess.run(command, check=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    per_rank = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(ranks)]
    worst = max(per_rank, key=lambda r: r["state_bytes"]["total"])
    return {
        "params": worst["params"],
        "state_gib_per_rank": worst["state_bytes"]["total"] / GIB,
        "state_bytes_per_rank": worst["state_bytes"],
        "peak_rss_gib_per_rank": max(r["peak_rss"] for r in per_rank) / GIB,
        "step_s": max(r["step_s"] for r in per_rank),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["19M", "52M", "113M"], choices=sorted(MODELS))
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    parser.add_argument("--offload", action="store_true", help="also fsdp with parallel.offload=true")
    parser.add_argument("--rank-job", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        name, strategy, offload, out = args.rank_job
        _rank_job(name, strategy, bool(int(offload)), Path(out))
        return
    results: dict[str, dict[str, dict[str, object]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            ways = {s: (s, False) for s in args.strategies}
            if args.offload:
                ways["fsdp_offload"] = ("fsdp", True)
            row = {way: _run(name, s, args.ranks, off, Path(tmp)) for way, (s, off) in ways.items()}
            if "ddp" in row and "fsdp" in row:
                ddp_gib, fsdp_gib = row["ddp"]["state_gib_per_rank"], row["fsdp"]["state_gib_per_rank"]
                assert isinstance(ddp_gib, float) and isinstance(fsdp_gib, float)
                row["ratio_state_fsdp_over_ddp"] = {"value": fsdp_gib / ddp_gib}
            results[name] = row
            print(json.dumps({name: row}), flush=True)
    print(json.dumps({"ranks": args.ranks, "results": results}, indent=1))


if __name__ == "__main__":
    main()
