"""Generation throughput: ``GPTActorModel.infer`` vs Hugging Face ``generate`` on the canonical workload.

Workload (/work/shared/bench/workload.md): GPT-2 (n_layer=4, n_embd=256, n_head=4, vocab 512,
n_positions=256), random init, fp32; 64 prompts of 32 ids drawn from 3..511 (seed 0); 64 new
tokens each, no stop, temperature 1.0 (plain sampling: no top-k, no top-p); median of 3 timed
runs after one warm-up; ``torch.set_num_threads(2)``. The runs of the two engines are
interleaved so that load from other processes hits both alike.

Prints one JSON object. Usage: ``python benchmarks/bench_generation.py [--repeats 3] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import tokenizers
import torch
import transformers

from openaligner.models.actor import GPTActorModel
from openaligner.models.builders import WORKLOAD_SIZE, build_tiny_causal_lm
from openaligner.models.generation import SamplingParams

BATCH, PROMPT_TOKENS, NEW_TOKENS = 64, 32, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    model = build_tiny_causal_lm("gpt2", WORKLOAD_SIZE, seed=0).to(device)
    prompts = torch.randint(
        3, WORKLOAD_SIZE.vocab_size, (BATCH, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)
    )
    prompts = prompts.to(device)
    lengths = torch.full((BATCH,), PROMPT_TOKENS, dtype=torch.long, device=device)
    actor = GPTActorModel(model, init_policy=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, stop_token_ids=())

    def run_infer() -> None:
        out = actor.infer(
            {"text": prompts, "length": lengths}, params, torch.Generator(device).manual_seed(1)
        )
        assert int(out["response_lengths"].min()) == PROMPT_TOKENS + NEW_TOKENS

    def run_hf(cache: str | None) -> Callable[[], None]:
        def go() -> None:
            with torch.no_grad():
                out = model.generate(
                    prompts,
                    attention_mask=torch.ones_like(prompts),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    pad_token_id=0,
                    cache_implementation=cache,
                )
            assert out.shape == (BATCH, PROMPT_TOKENS + NEW_TOKENS)

        return go

    engines: dict[str, Callable[[], None]] = {
        "openaligner_infer": run_infer,
        "hf_generate": run_hf(None),
        "hf_generate_static_cache": run_hf("static"),
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    for fn in engines.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in engines.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)

    generated = BATCH * NEW_TOKENS
    result: dict[str, object] = {
        "workload": f"GPT-2 4x256, vocab 512; {BATCH} prompts x {PROMPT_TOKENS} -> {NEW_TOKENS} new tokens",
        "device": str(device),
        "threads": args.threads,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    for name, ts in times.items():
        median = statistics.median(ts)
        result[name] = {
            "median_s": round(median, 4),
            "tokens_per_s": round(generated / median, 1),
            "runs_s": ts,
        }
    infer_s = statistics.median(times["openaligner_infer"])
    result["ratio_vs_hf_generate"] = round(statistics.median(times["hf_generate"]) / infer_s, 3)
    result["ratio_vs_hf_generate_static"] = round(
        statistics.median(times["hf_generate_static_cache"]) / infer_s, 3
    )
    print(json.dumps(result, indent=2))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
