"""What sharding (``parallel.strategy=fsdp``) saves per rank, against replicas (``ddp``).

For each Llama-shaped model and each strategy, one ``torchrun --nproc_per_node RANKS`` job on this
machine loads the model as the trainers do (replicas: every rank builds it, random float32
weights; shards: rank 0 alone builds it, the other ranks build a skeleton on the meta device and
receive their shards, :func:`openaligner.models.sharding.fill_from_leader`), applies the strategy
(:func:`openaligner.models.sharding.shard`), and runs three optimizer steps of the causal-LM loss
on a 2 × 64-token batch per rank with fused AdamW and clipping, as the trainers do. Each rank
reports:

* ``state_bytes`` — parameters + gradients + AdamW state it holds
  (:func:`~openaligner.models.sharding.training_state_bytes`: allocated tensor storage, what
  sharding divides);
* ``peak_rss`` — the process's peak resident memory (``VmHWM``: everything, activations,
  gathered layers, allocator caches, the framework and the model's construction included);
* ``phases`` — the peak and the current resident memory (GiB) within each phase: ``import``
  (torch, transformers, openaligner), ``load`` (build or skeleton), ``shard`` (+ receiving the
  shards), then ``forward``/``backward``/``step`` of each optimizer step (the peak is reset at each
  phase boundary through ``/proc/self/clear_refs``).

Prints one JSON object (per model and strategy: parameters, the figures of the rank that peaks
highest, seconds per step) and the ratios fsdp / ddp. Usage (the driver starts the torchrun jobs
itself): ``python benchmarks/bench_sharding_memory.py [--ranks 2] [--models 52M 74M 113M]
[--offload]`` (names are the parameter counts), ``--strategies fsdp`` to measure one strategy
only, ``--glibc-default`` to measure without the allocator policy sharded processes set
(:func:`~openaligner.models.sharding.return_large_frees_to_os`). Linux only (reads ``/proc``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS: dict[str, dict[str, int]] = {
    # name: Llama shape (vocabulary of a real tokenizer; sizes of small real models' widths)
    "19M": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "vocab_size": 32000},
    "52M": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "vocab_size": 32000},
    "74M": {"hidden_size": 640, "num_layers": 9, "num_heads": 10, "vocab_size": 32000},
    "113M": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "vocab_size": 32000},
    "292M": {"hidden_size": 1024, "num_layers": 24, "num_heads": 16, "vocab_size": 32000},
    "735M": {"hidden_size": 2048, "num_layers": 16, "num_heads": 16, "vocab_size": 32000},
    "1.3B": {"hidden_size": 2048, "num_layers": 28, "num_heads": 16, "vocab_size": 32000},
}
GIB = 2**30


def _resident_gib() -> dict[str, float]:
    """This process's peak (``VmHWM``) and current (``VmRSS``) resident memory, GiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {
        key: int(fields[name].split()[0]) * 1024 / GIB for key, name in (("peak", "VmHWM"), ("now", "VmRSS"))
    }


class _Phases:
    """Resident memory per phase: :meth:`end` records the phase's peak and resets the peak."""

    def __init__(self) -> None:
        self.rows: list[dict[str, object]] = []
        self.peak = 0.0

    def end(self, name: str) -> None:
        got = _resident_gib()
        self.peak = max(self.peak, got["peak"])
        self.rows.append({"phase": name, "peak_gib": round(got["peak"], 3), "now_gib": round(got["now"], 3)})
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to VmRSS


def _rank_job(model_name: str, strategy: str, offload: bool, glibc_default: bool, out: Path) -> None:
    """One rank of one job (run under torchrun by the driver)."""
    phases = _Phases()
    import torch

    from openaligner import distributed as dp
    from openaligner.models import sharding
    from openaligner.models.builders import TinySize, build_tiny_causal_lm
    from openaligner.models.sharding import ParallelConfig, training_state_bytes
    from openaligner.trainer.optim import OptimConfig, build_optimizer
    from openaligner.trainer.optim_step import optimizer_step

    if glibc_default:
        sharding.return_large_frees_to_os = lambda: False  # measure without the policy
    torch.set_num_threads(1)
    dp.init_from_env()
    phases.end("import")
    size = TinySize(max_positions=128, **MODELS[model_name])
    parallel = ParallelConfig(strategy=strategy, offload=offload)
    with torch.device("meta") if sharding.builds_skeleton(parallel) else contextlib.nullcontext():
        model = build_tiny_causal_lm("llama", size, seed=0)
    phases.end("load")
    state = sharding.state_to_share(model, parallel)
    model = sharding.shard(model, parallel)
    sharding.fill_from_leader(model, state, parallel, offload=offload)
    del state  # rank 0's whole weights, as the trainers drop them once shared
    phases.end("shard")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, _ = build_optimizer(params, OptimConfig(lr=1e-5), 10)
    tokens = torch.randint(3, size.vocab_size, (2, 64), generator=torch.Generator().manual_seed(dp.rank()))
    no_scaler = torch.amp.GradScaler("cpu", enabled=False)
    seconds = []
    for step in range(3):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        phases.end(f"forward{step}")
        loss.backward()
        phases.end(f"backward{step}")
        optimizer_step(params, optimizer, None, no_scaler, max_grad_norm=1.0, gradients="mean")
        phases.end(f"step{step}")
        seconds.append(time.perf_counter() - started)
    report = {
        "params": sum(p.numel() for p in model.parameters()),  # a shard's numel is the whole tensor's
        "state_bytes": training_state_bytes(params, optimizer),
        "peak_rss": phases.peak * GIB,
        "phases": phases.rows,
        "step_s": seconds[-1],
    }
    Path(f"{out}.rank{dp.rank()}").write_text(json.dumps(report))
    dp.shutdown()


def _run(
    model_name: str, strategy: str, ranks: int, offload: bool, glibc_default: bool, work: Path
) -> dict[str, object]:
    out = work / f"{model_name}-{strategy}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    command += [
        __file__,
        "--rank-job",
        model_name,
        strategy,
        str(int(offload)),
        str(int(glibc_default)),
        str(out),
    ]
    subprocess.run(command, check=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    per_rank = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(ranks)]
    worst = max(per_rank, key=lambda r: r["state_bytes"]["total"])
    highest = max(per_rank, key=lambda r: r["peak_rss"])
    return {
        "params": worst["params"],
        "state_gib_per_rank": worst["state_bytes"]["total"] / GIB,
        "state_bytes_per_rank": worst["state_bytes"],
        "peak_rss_gib_per_rank": [round(r["peak_rss"] / GIB, 3) for r in per_rank],
        "phases_of_highest_rank": highest["phases"],
        "step_s": max(r["step_s"] for r in per_rank),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["19M", "52M", "74M", "113M"], choices=sorted(MODELS))
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    parser.add_argument("--offload", action="store_true", help="also fsdp with parallel.offload=true")
    parser.add_argument(
        "--glibc-default", action="store_true", help="without the allocator policy sharded processes set"
    )
    parser.add_argument("--rank-job", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        name, strategy, offload, glibc_default, out = args.rank_job
        _rank_job(name, strategy, bool(int(offload)), bool(int(glibc_default)), Path(out))
        return
    results: dict[str, dict[str, dict[str, object]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            ways = {s: (s, False) for s in args.strategies}
            if args.offload:
                ways["fsdp_offload"] = ("fsdp", True)
            row = {
                way: _run(name, s, args.ranks, off, args.glibc_default, Path(tmp))
                for way, (s, off) in ways.items()
            }
            if "ddp" in row and "fsdp" in row:
                ddp_gib, fsdp_gib = row["ddp"]["state_gib_per_rank"], row["fsdp"]["state_gib_per_rank"]
                assert isinstance(ddp_gib, float) and isinstance(fsdp_gib, float)
                row["ratio_state_fsdp_over_ddp"] = {"value": fsdp_gib / ddp_gib}
                ddp_rss, fsdp_rss = row["ddp"]["peak_rss_gib_per_rank"], row["fsdp"]["peak_rss_gib_per_rank"]
                assert isinstance(ddp_rss, list) and isinstance(fsdp_rss, list)
                row["ratio_peak_rss_fsdp_over_ddp"] = {"value": max(fsdp_rss) / max(ddp_rss)}
            results[name] = row
            print(json.dumps({name: row}), flush=True)
    print(json.dumps({"ranks": args.ranks, "results": results}, indent=1))


if __name__ == "__main__":
    main()
