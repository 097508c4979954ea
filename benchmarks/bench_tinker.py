"""What the Tinker API costs: the real ``tinker`` SDK driving ``serve-tinker`` against the same
work done in-process, on the same tiny model and data.

Measured (wall seconds, medians; the first repetition is warm-up and dropped):
1. ``forward_backward`` + ``optim_step`` of one batch (cross_entropy, LoRA) through the SDK, the
   same through the server's own ``TinkerModel`` in-process (no HTTP, protobuf, futures), and
   train-sft's step (``SFTObjective`` with the same LoRA, one batched forward) on the same rows;
2. ``asample``: ``samples`` prompts sampled at once by the SDK (num_samples=1 each, as the
   cookbook does) against the ``hf`` rollout engine called directly, one request per prompt and
   all prompts in one request;
3. the per-call overhead: a one-token ``forward`` through the SDK (the floor of any call), and
   the protobuf decode of the SDK's real request body and encode of its result.

    .venv/bin/python benchmarks/bench_tinker.py [--datums 16] [--steps 6] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def median_after_warmup(xs: list[float]) -> float:
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def batch_rows(spec: dict[str, Any]) -> list[list[int]]:
    """The rows the SDK client builds (same generator, same order): width + 1 ids each."""
    rng = random.Random(0)
    width = spec["prompt_tokens"] + spec["response_tokens"]
    return [[rng.randrange(3, spec["vocab"]) for _ in range(width + 1)] for _ in range(spec["datums"])]


def build_model_dir(directory: Path, spec: dict[str, Any]) -> None:
    from openaligner.models.builders import TinySize, build_tiny_causal_lm
    from openaligner.models.tokenizers import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    spec["vocab"] = len(tokenizer)
    size = TinySize(
        vocab_size=len(tokenizer),
        hidden_size=spec["hidden"],
        num_layers=spec["layers"],
        num_heads=4,
        max_positions=256,
    )
    build_tiny_causal_lm("llama", size, seed=0).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))


def load(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory))


def bench_direct(spec: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The server's own training path without the server: TinkerModel in-process."""
    import torch

    from openaligner.algorithms.tinker_losses import tinker_loss
    from openaligner.trainer.tinker_model import AdamStep, TinkerDatum, TinkerLora, TinkerModel

    model = TinkerModel(load(directory), TinkerLora(rank=spec["rank"], seed=0))
    p = spec["prompt_tokens"]
    datums = [
        TinkerDatum(
            tokens=torch.tensor(row[:-1]),
            inputs={
                "target_tokens": torch.tensor(row[1:]),
                "weights": torch.tensor([0.0] * (p - 1) + [1.0] * (len(row) - p), dtype=torch.float32),
            },
        )
        for row in batch_rows(spec)
    ]
    loss = tinker_loss("cross_entropy")
    step_s, losses = [], []
    for _ in range(spec["steps"]):
        started = time.perf_counter()
        _, metrics = model.forward_backward(datums, loss, {}, forward_only=False)
        model.optim_step(AdamStep(learning_rate=1e-4, eps=1e-8))
        step_s.append(time.perf_counter() - started)
        losses.append(metrics["loss:sum"])
    return {"step_s": step_s, "losses": losses, "targets": model.targets}


def bench_sft(spec: dict[str, Any], directory: Path, targets: list[str]) -> dict[str, Any]:
    """train-sft's step on the same rows: SFTObjective (one batched forward, the response tokens'
    mean NLL) on the model with the same LoRA adapters, then AdamW."""
    import torch

    from openaligner.models.lora import LoraConfig, add_lora
    from openaligner.trainer.sft import SFTObjective

    torch.manual_seed(0)
    model = add_lora(load(directory), LoraConfig(r=spec["rank"], alpha=32.0, target_modules=targets))
    model.train()
    objective = SFTObjective(model)
    rows = torch.tensor(batch_rows(spec))
    batch = {
        "tokens": rows,
        "lengths": torch.full((rows.shape[0],), rows.shape[1]),
        "prompt_lengths": torch.full((rows.shape[0],), spec["prompt_tokens"]),
    }
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    step_s = []
    for _ in range(spec["steps"]):
        started = time.perf_counter()
        nll, count, _ = objective.loss(batch)
        (nll / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - started)
    return {"step_s": step_s}


def bench_engine(spec: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The hf rollout engine called directly, as the server's asample calls it."""
    import torch
    from transformers import AutoTokenizer

    from openaligner.models.actor import CausalLMActor
    from openaligner.models.generation import SamplingParams
    from openaligner.models.rollout_engine import HFRolloutEngine, RolloutRequest

    model = load(directory).eval()
    engine = HFRolloutEngine(CausalLMActor(model, AutoTokenizer.from_pretrained(str(directory)), init_policy=False))
    rng = random.Random(1)
    prompts = torch.tensor(
        [[rng.randrange(3, spec["vocab"]) for _ in range(spec["prompt_tokens"])] for _ in range(spec["samples"])]
    )
    sampling = SamplingParams(temperature=1.0, max_new_tokens=spec["response_tokens"], stop_token_ids=())

    def request(rows: torch.Tensor, seed: int) -> RolloutRequest:
        b = rows.shape[0]
        return RolloutRequest(
            prompts=rows,
            prompt_lengths=torch.full((b,), rows.shape[1]),
            sampling=sampling,
            seeds=torch.arange(b) + seed,
        )

    one_by_one, batched, tokens = [], [], []
    with torch.no_grad():
        for r in range(spec["sample_repeats"]):
            started = time.perf_counter()
            made = 0
            for i in range(prompts.shape[0]):
                out = engine.generate(request(prompts[i : i + 1], r * 1000 + i))
                made += int(out.sequence_lengths.sum()) - prompts.shape[1]
            one_by_one.append(time.perf_counter() - started)
            tokens.append(made)
            started = time.perf_counter()
            engine.generate(request(prompts, r))
            batched.append(time.perf_counter() - started)
    return {"one_by_one_s": one_by_one, "batched_s": batched, "tokens": tokens}


def bench_wire(body: bytes, spec: dict[str, Any]) -> dict[str, Any]:
    """The codec's share of one call: decode the SDK's body, encode a result of its size."""
    import torch

    from openaligner.servers.tinker import wire

    decode_s, encode_s = [], []
    for _ in range(spec["wire_repeats"]):
        started = time.perf_counter()
        decoded = wire.decode_forward_backward_request(body)
        decode_s.append(time.perf_counter() - started)
        outputs = [{"logprobs": torch.zeros(d.tokens.numel()), "elementwise_loss": torch.zeros(d.tokens.numel())} for d in decoded.datums]
        started = time.perf_counter()
        wire.encode_forward_backward_output(outputs, {"loss:sum": 1.0})
        encode_s.append(time.perf_counter() - started)
    return {"body_bytes": len(body), "decode_s": decode_s, "encode_s": encode_s}


def bench_sdk(spec: dict[str, Any], directory: Path, tinker_python: Path, work: Path) -> dict[str, Any]:
    """serve-tinker in a subprocess, driven by the SDK client in its own venv."""
    server = subprocess.Popen(
        [
            sys.executable, "-m", "openaligner", "serve-tinker", "server.port=0",
            f"checkpoint_dir={work / 'checkpoints'}", f"threads={spec['threads']}",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        url = None
        assert server.stdout is not None
        for line in server.stdout:
            m = re.search(r"tinker server ready at (http://\S+) ", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise RuntimeError("serve-tinker exited before it was ready")
        body_path = work / "fwdbwd.bin"
        done = subprocess.run(
            [str(tinker_python), str(Path(__file__).with_name("tinker_bench_client.py")), url, str(directory), json.dumps(spec), str(body_path)],
            capture_output=True, text=True, timeout=1800, env={**os.environ, "TINKER_TELEMETRY": "0"},
        )  # fmt: skip
        result = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if done.returncode or result is None:
            raise RuntimeError(f"the SDK client failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        out = json.loads(result[len("RESULT ") :])
        out["body"] = body_path.read_bytes()
        return out
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datums", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--sample-repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tinker-python", type=Path, default=Path(os.environ.get("OPENALIGNER_TINKER_PYTHON", REPO / ".venv-tinker" / "bin" / "python")))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not args.tinker_python.exists():
        sys.exit(f"the tinker SDK's virtualenv is missing ({args.tinker_python}): run `make tinker-setup`")

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    spec = {
        "datums": args.datums, "prompt_tokens": args.prompt_tokens, "response_tokens": args.response_tokens,
        "steps": args.steps, "samples": args.samples, "sample_repeats": args.sample_repeats, "calls": args.calls,
        "hidden": args.hidden, "layers": args.layers, "rank": args.rank, "threads": args.threads, "wire_repeats": 20,
    }  # fmt: skip
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        directory = work / "model"
        build_model_dir(directory, spec)
        sdk = bench_sdk(spec, directory, args.tinker_python, work)
        direct = bench_direct(spec, directory)
        sft = bench_sft(spec, directory, direct["targets"])
        engine = bench_engine(spec, directory)
        codec = bench_wire(sdk.pop("body"), spec)
    trained = spec["datums"] * (spec["prompt_tokens"] + spec["response_tokens"])
    step = {name: median_after_warmup(r["step_s"]) for name, r in (("sdk", sdk), ("direct", direct), ("sft", sft))}
    sample_tokens = sdk["sample_tokens"][-1]
    sample = {
        "sdk": median_after_warmup(sdk["sample_s"]),
        "engine_one_by_one": median_after_warmup(engine["one_by_one_s"]),
        "engine_batched": median_after_warmup(engine["batched_s"]),
    }
    report = {
        "spec": spec,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "load_1min": [load_before, os.getloadavg()[0]]},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__, "tinker": sdk["tinker_version"]},
        "train_step_s": step,
        "train_tokens_per_s": {k: trained / v for k, v in step.items()},
        "train_ratio": {"sdk_over_direct": step["sdk"] / step["direct"], "sdk_over_sft": step["sdk"] / step["sft"], "direct_over_sft": step["direct"] / step["sft"]},
        "losses": {"sdk": sdk["losses"], "direct": direct["losses"]},
        "sample_s": sample,
        "sample_tokens": {"sdk": sample_tokens, "engine": engine["tokens"][-1]},
        "sample_tokens_per_s": {k: sample_tokens / v for k, v in sample.items()},
        "call_floor_s": median_after_warmup(sdk["call_s"]),
        "wire": {"body_bytes": codec["body_bytes"], "decode_s": statistics.median(codec["decode_s"]), "encode_s": statistics.median(codec["encode_s"])},
    }  # fmt: skip
    report["overhead_share_of_sdk_step"] = (step["sdk"] - step["direct"]) / step["sdk"]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
