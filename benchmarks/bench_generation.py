"""Generation throughput: ``CausalLMActor.infer`` vs Hugging Face ``generate`` on the canonical workload.

Workload (/work/shared/bench/workload.md): GPT-2 (n_layer=4, n_embd=256, n_head=4, vocab 512,
n_positions=256), random init, fp32; 64 prompts of 32 ids drawn from 3..511 (seed 0); 64 new
tokens each, no stop, temperature 1.0 (plain sampling: no top-k, no top-p); median of 3 timed
runs after one warm-up; ``torch.set_num_threads(2)``. The runs of the engines are interleaved so
that load from other processes hits all of them alike.

Engines: ``openaligner_infer`` (``CausalLMActor.infer``: the GPT-2 decoder), ``openaligner_hf_forward``
(the same sampling loop through the model's Hugging Face forward, ``fast_path=False``: what every
other architecture gets), and Hugging Face ``generate`` with its default dynamic cache and with
``cache_implementation="static"``.

A second, non-canonical scenario ("early_stop") gives the same engines 8 stop ids (1.6 % of the
vocabulary), so responses end at different lengths (about 60 % end before 64 tokens); it is
timed per batch since the engines draw different samples.

``--profile`` adds, per engine, the top operators by self CPU time (``torch.profiler``), averaged
over ``--profile-runs`` more canonical runs per engine (interleaved like the timed runs).

Prints one JSON object. Usage:
``python benchmarks/bench_generation.py [--repeats 3] [--threads 2] [--profile]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import tokenizers
import torch
import transformers

from openaligner.models.actor import CausalLMActor
from openaligner.models.builders import WORKLOAD_SIZE, build_tiny_causal_lm
from openaligner.models.generation import SamplingParams, generate

BATCH, PROMPT_TOKENS, NEW_TOKENS = 64, 32, 64
STOP_IDS = tuple(range(100, 108))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", action="store_true", help="add the top operators of each engine")
    parser.add_argument("--top", type=int, default=12, help="operators listed per engine with --profile")
    parser.add_argument("--profile-runs", type=int, default=3, help="profiled runs per engine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    model = build_tiny_causal_lm("gpt2", WORKLOAD_SIZE, seed=0)
    torch.nn.Module.to(model, device)
    prompts = torch.randint(
        3, WORKLOAD_SIZE.vocab_size, (BATCH, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)
    ).to(device)
    lengths = torch.full((BATCH,), PROMPT_TOKENS, dtype=torch.long, device=device)
    actor = CausalLMActor(model, init_policy=False)

    def run_infer(stop_ids: tuple[int, ...]) -> Callable[[], int]:
        params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, stop_token_ids=stop_ids)

        def go() -> int:
            batch = {"text": prompts, "length": lengths}
            out = actor.infer(batch, params, torch.Generator(device).manual_seed(1))
            return int((out["response_lengths"] - out["prompt_lengths"]).sum())

        return go

    def run_hf_forward(stop_ids: tuple[int, ...]) -> Callable[[], int]:
        params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, stop_token_ids=stop_ids)

        def go() -> int:
            g = torch.Generator(device).manual_seed(1)
            out = generate(model, prompts, lengths, params, pad_id=actor.pad_id, generator=g, fast_path=False)
            return int((out.sequence_lengths - out.prompt_lengths).sum())

        return go

    def run_hf(cache: str | None, stop_ids: tuple[int, ...]) -> Callable[[], int]:
        def go() -> int:
            with torch.no_grad():
                out = model.generate(  # type: ignore[operator]
                    prompts,
                    attention_mask=torch.ones_like(prompts),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=0 if stop_ids else NEW_TOKENS,
                    eos_token_id=list(stop_ids) if stop_ids else None,
                    pad_token_id=0,
                    cache_implementation=cache,
                )
            response = out[:, PROMPT_TOKENS:]
            if not stop_ids:
                return response.numel()
            is_stop = torch.isin(response, torch.tensor(STOP_IDS, device=response.device))
            first = torch.where(is_stop.any(-1), is_stop.float().argmax(-1) + 1, response.shape[1])
            return int(first.sum())

        return go

    result: dict[str, object] = {
        "workload": f"GPT-2 4x256, vocab 512; {BATCH} prompts x {PROMPT_TOKENS} -> {NEW_TOKENS} new tokens",
        "device": str(device),
        "threads": args.threads,
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    for scenario, stop_ids in (("canonical", ()), ("early_stop", STOP_IDS)):
        engines = {
            "openaligner_infer": run_infer(stop_ids),
            "openaligner_hf_forward": run_hf_forward(stop_ids),
            "hf_generate": run_hf(None, stop_ids),
            "hf_generate_static_cache": run_hf("static", stop_ids),
        }
        result[scenario] = _measure(engines, args.repeats, device)
        if args.profile and scenario == "canonical":
            result["profile"] = _profile(engines, args.profile_runs, args.top)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=2))


def _measure(engines: dict[str, Callable[[], int]], repeats: int, device: torch.device) -> dict[str, object]:
    """Interleaved timing (the engines' order rotates each round); per engine the median seconds
    per batch and generated tokens/s."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[int]] = {name: [] for name in engines}
    for fn in engines.values():
        fn()  # warm-up
    names = list(engines)
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            fn = engines[name]
            _sync(device)
            start = time.perf_counter()
            n = fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
            tokens[name].append(n)
    out: dict[str, object] = {}
    for name, ts in times.items():
        median = statistics.median(ts)
        out[name] = {
            "median_s": round(median, 4),
            "generated_tokens": int(statistics.median(tokens[name])),
            "tokens_per_s": round(statistics.median(tokens[name]) / median, 1),
            "runs_s": [round(t, 4) for t in ts],
        }
    infer_s = statistics.median(times["openaligner_infer"])
    ours = times["openaligner_infer"]
    for key, peer in (("hf_generate", "hf_generate"), ("hf_generate_static", "hf_generate_static_cache")):
        # Ratio of the medians, and the median of the per-round ratios (each round runs the
        # engines back to back, so a round's ratio is less exposed to slow changes in load).
        out[f"speedup_vs_{key}"] = round(statistics.median(times[peer]) / infer_s, 3)
        paired = [theirs / mine for theirs, mine in zip(times[peer], ours, strict=True)]
        out[f"paired_speedup_vs_{key}"] = round(statistics.median(paired), 3)
    return out


def _profile(engines: dict[str, Callable[[], int]], runs: int, top: int) -> dict[str, object]:
    """Per engine, ``runs`` runs under ``torch.profiler`` (interleaved): the median wall time and
    the ``top`` operators by self CPU time, averaged per run."""
    from torch.profiler import ProfilerActivity, profile

    walls: dict[str, list[float]] = {name: [] for name in engines}
    self_us: dict[str, dict[str, float]] = {name: {} for name in engines}
    calls: dict[str, dict[str, int]] = {name: {} for name in engines}
    for _ in range(runs):
        for name, fn in engines.items():
            start = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            walls[name].append(time.perf_counter() - start)
            for event in prof.key_averages():
                self_us[name][event.key] = self_us[name].get(event.key, 0.0) + event.self_cpu_time_total
                calls[name][event.key] = calls[name].get(event.key, 0) + event.count
    out: dict[str, object] = {}
    for name in engines:
        total_us = sum(self_us[name].values())
        ranked = sorted(self_us[name].items(), key=lambda item: item[1], reverse=True)
        out[name] = {
            "profiled_runs": runs,
            "wall_s_median": round(statistics.median(walls[name]), 4),
            "self_cpu_ms_per_run": round(total_us / runs / 1e3, 1),
            "ops": [
                {
                    "name": key,
                    "self_ms_per_run": round(us / runs / 1e3, 1),
                    "share": round(us / total_us, 3),
                    "calls_per_run": calls[name][key] // runs,
                }
                for key, us in ranked[:top]
            ],
        }
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
