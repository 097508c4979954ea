"""Peak memory of one SFT forward + backward with Gemma 3's 262,144-token vocabulary: the whole
logits vs the output head in chunks (train-sft's ``trainer.logits_chunk_mb``).

The model is a random tiny one with that vocabulary (``gemma``: tied embeddings, as Gemma 3; hidden
64, 2 layers: ~17 M parameters, nearly all of them the embedding), so that the logits dominate the
step as they do for a real large-vocabulary model, and the measurement needs no download. Each
configuration runs in a fresh process (peak RSS is per process): build the model (float32, as
train-sft holds its masters), then ``SFTObjective.loss`` on a batch of ``rows`` × ``width`` tokens
(prompts of a quarter of the width) and its backward. Reported: the RSS before the step, the peak
RSS, their difference (the step's own memory) and the seconds the step took.

    .venv/bin/python benchmarks/bench_sft_large_vocab.py --rows 2 4 --width 512
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from bench_large_vocab import run_children, write_record  # this directory: sys.path[0]

VOCAB = 262_144  # Gemma 3's


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(chunk_mb: float | None, rows: int, width: int) -> dict[str, object]:
    import torch

    from openaligner.models.builders import TinySize, build_tiny_causal_lm
    from openaligner.models.output_head import check_output_head
    from openaligner.trainer.sft import SFTObjective

    torch.manual_seed(0)
    torch.set_num_threads(2)
    size = TinySize(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, max_positions=width)
    model = build_tiny_causal_lm("gemma", size)
    model.train()
    objective = SFTObjective(model, logits_chunk_mb=chunk_mb)
    tokens = torch.randint(3, VOCAB, (rows, width))
    batch = {
        "tokens": tokens,
        "lengths": torch.full((rows,), width),
        "prompt_lengths": torch.full((rows,), width // 4),
    }
    if chunk_mb is not None:  # the one-time 9-token head check, outside the measured step
        check_output_head(model)
        objective._head_checked = True
    loaded = _rss_mib()
    started = time.perf_counter()
    nll, count, _ = objective.loss(batch)
    (nll / count).backward()
    took = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "logits_chunk_mb": chunk_mb,
        "rows": rows,
        "width": width,
        "vocab": VOCAB,
        "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "whole_logits_fp32_mib": rows * (width - 1) * VOCAB * 4 / 2**20,
        "loss": round(float(nll / count), 6),
        "rss_before_step_mib": round(loaded),
        "rss_peak_mib": round(peak),
        "step_mib": round(peak - loaded),
        "step_s": round(took, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=512, help="tokens per row (prompt + response)")
    parser.add_argument("--out", default="bench_sft_large_vocab.json")
    parser.add_argument("--child", nargs=2, metavar=("CHUNK_MB", "ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        chunk = None if args.child[0] == "none" else float(args.child[0])
        print(json.dumps(child(chunk, int(args.child[1]), args.width)))
        return
    results = run_children(
        args.rows, lambda chunk, rows: ["--width", str(args.width), "--child", chunk, str(rows)]
    )
    write_record(Path(args.out), results)


if __name__ == "__main__":
    main()
