"""Peak memory of one actor step on a large-vocabulary model: the whole logits vs the output head
in chunks (``trainer.logits_chunk_mb``).

Each configuration runs in a fresh process (peak RSS is per process): load the policy (float32
masters, as train-ppo holds them), then one no-grad log-prob pass over the batch (what the
rollout and initial-policy passes do) and one training forward + backward of the policy loss's
inputs (log-probs and entropy, with gradient). Reported: the RSS after loading, the peak RSS, and
their difference (the step's own memory), with the seconds each phase took.

    .venv/bin/python benchmarks/bench_large_vocab.py --model /path/to/gemma-3-270m-hf
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(model_dir: str, chunk_mb: float | None, rows: int, width: int, lora: int) -> dict[str, object]:
    import torch
    from transformers import AutoModelForCausalLM

    from openaligner.models.actor import CausalLMActor
    from openaligner.models.lora import LoraConfig, add_lora

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        model = add_lora(model, LoraConfig(r=lora))
    actor = CausalLMActor(model, None, init_policy=False, logits_chunk_mb=chunk_mb)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    tokens = torch.randint(3, vocab, (rows, width))
    lengths = torch.full((rows,), width)
    loaded = _rss_mib()
    started = time.perf_counter()
    actor.get_inference_log_probs(tokens, lengths)
    scored = time.perf_counter()
    logprobs, entropy = actor.training_logprobs(tokens, lengths, first_position=width // 2)
    (logprobs.sum() + 0.01 * entropy.sum()).backward()
    trained = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "logits_chunk_mb": chunk_mb,
        "rows": rows,
        "width": width,
        "lora_r": lora,
        "vocab": vocab,
        "whole_logits_fp32_mib": rows * width * vocab * 4 / 2**20,
        "rss_loaded_mib": round(loaded),
        "rss_peak_mib": round(peak),
        "step_mib": round(peak - loaded),
        "logprob_pass_s": round(scored - started, 1),
        "train_forward_backward_s": round(trained - scored, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face causal-LM directory")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--width", type=int, default=128, help="tokens per row (prompt + response)")
    parser.add_argument("--lora", type=int, default=8, help="LoRA rank (0: every weight trains)")
    parser.add_argument("--out", default="bench_large_vocab.json")
    parser.add_argument("--child", nargs=2, metavar=("CHUNK_MB", "ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        chunk = None if args.child[0] == "none" else float(args.child[0])
        print(json.dumps(child(args.model, chunk, int(args.child[1]), args.width, args.lora)))
        return
    results = run_children(
        args.rows,
        lambda chunk, rows: [
            "--model",
            args.model,
            "--width",
            str(args.width),
            "--lora",
            str(args.lora),
            "--child",
            chunk,
            str(rows),
        ],
    )
    write_record(Path(args.out), results)


def run_children(all_rows: list[int], child_argv: Callable[[str, int], list[str]]) -> list[dict[str, object]]:
    """Run this script once per ``rows`` × chunk setting (``none``: the whole logits, ``256`` MiB) in
    a fresh process (peak RSS is per process), with ``child_argv(chunk, rows)`` as its arguments;
    each child prints its result as the last line of JSON. A child that fails gives its last error
    line instead. Every result is printed as it comes."""
    results = []
    for rows in all_rows:
        for chunk in ("none", "256"):
            done = subprocess.run(
                [sys.executable, sys.argv[0], *child_argv(chunk, rows)], capture_output=True, text=True
            )
            if done.returncode != 0:
                tail = done.stderr.strip().splitlines()[-1:] or ["?"]
                result: dict[str, object] = {"logits_chunk_mb": chunk, "rows": rows, "failed": tail[0]}
            else:
                result = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps(result), flush=True)
            results.append(result)
    return results


def write_record(out: Path, results: list[dict[str, object]]) -> None:
    """``results`` with the command, the machine and the versions, as JSON to ``out``."""
    import torch
    import transformers

    record = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "results": results,
    }
    out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
