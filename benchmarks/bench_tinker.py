"""What the Tinker API costs: the real ``tinker`` SDK driving ``serve-tinker`` against the same
work done in-process, on the same tiny model and data.

Measured (wall seconds, medians; the first repetition is warm-up and dropped):
1. ``forward_backward`` + ``optim_step`` of one batch (cross_entropy, LoRA) through the SDK, the
   same through the server's own ``TinkerModel`` in-process (no HTTP, protobuf, futures), and
   train-sft's step (``SFTObjective`` with the same LoRA, one batched forward) on the same rows;
2. ``asample``: ``samples`` prompts sampled at once by the SDK (num_samples=1 each, as the
   cookbook does; the server merges calls queued together into one generate, docs/tinker.md)
   against the server's service in-process (the same calls queued together: merged generates on
   its merged copy plus the scoring forward, no HTTP) and the ``hf`` rollout engine called
   directly (per-row streams, as the server's), one request per prompt and all in one request;
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
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
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


class Direct:
    """The server's own training path without the server: TinkerModel in-process."""

    def __init__(self, spec: dict[str, Any], directory: Path) -> None:
        import torch

        from openaligner.algorithms.tinker_losses import tinker_loss
        from openaligner.trainer.tinker_model import AdamStep, TinkerDatum, TinkerLora, TinkerModel

        self.model = TinkerModel(load(directory), TinkerLora(rank=spec["rank"], seed=0))
        p = spec["prompt_tokens"]
        self.datums = [
            TinkerDatum(
                tokens=torch.tensor(row[:-1]),
                inputs={
                    "target_tokens": torch.tensor(row[1:]),
                    "weights": torch.tensor([0.0] * (p - 1) + [1.0] * (len(row) - p), dtype=torch.float32),
                },
            )
            for row in batch_rows(spec)
        ]
        self.loss = tinker_loss("cross_entropy")
        self.adam = AdamStep(learning_rate=1e-4, eps=1e-8)

    def step(self) -> dict[str, float]:
        started = time.perf_counter()
        _, metrics = self.model.forward_backward(self.datums, self.loss, {}, forward_only=False)
        self.model.optim_step(self.adam)
        return {"s": time.perf_counter() - started, "loss": metrics["loss:sum"]}


class Sft:
    """train-sft's step on the same rows: SFTObjective (one batched forward, the response tokens'
    mean NLL) on the model with the same LoRA adapters, then AdamW."""

    def __init__(self, spec: dict[str, Any], directory: Path, targets: list[str]) -> None:
        import torch

        from openaligner.models.lora import LoraConfig, add_lora
        from openaligner.trainer.sft import SFTObjective

        torch.manual_seed(0)
        model = add_lora(load(directory), LoraConfig(r=spec["rank"], alpha=32.0, target_modules=targets))
        model.train()
        self.objective = SFTObjective(model)
        rows = torch.tensor(batch_rows(spec))
        self.batch = {
            "tokens": rows,
            "lengths": torch.full((rows.shape[0],), rows.shape[1]),
            "prompt_lengths": torch.full((rows.shape[0],), spec["prompt_tokens"]),
        }
        params = [q for q in model.parameters() if q.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def step(self) -> dict[str, float]:
        started = time.perf_counter()
        nll, count, _ = self.objective.loss(self.batch)
        (nll / count).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"s": time.perf_counter() - started}


class Engine:
    """The hf rollout engine called directly, as the server's asample calls it."""

    def __init__(self, spec: dict[str, Any], directory: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        from openaligner.models.actor import CausalLMActor
        from openaligner.models.generation import SamplingParams
        from openaligner.rollout.hf_engine import HFRolloutEngine

        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        actor = CausalLMActor(load(directory).eval(), tokenizer, init_policy=False)
        self.engine = HFRolloutEngine(actor, per_row_streams=True)
        rng = random.Random(1)
        width = spec["prompt_tokens"]
        self.prompts = torch.tensor(
            [[rng.randrange(3, spec["vocab"]) for _ in range(width)] for _ in range(spec["samples"])]
        )
        self.sampling = SamplingParams(
            temperature=1.0, max_new_tokens=spec["response_tokens"], stop_token_ids=()
        )
        self.round = 0

    def _generate(self, rows: Any, seed: int) -> int:
        import torch

        from openaligner.rollout.engine import RolloutRequest

        b, p = rows.shape
        out = self.engine.generate(
            RolloutRequest(
                prompts=rows,
                prompt_lengths=torch.full((b,), p),
                sampling=self.sampling,
                seeds=torch.arange(b) + seed,
            )
        )
        return int(out.sequence_lengths.sum()) - b * p

    def one_by_one(self) -> dict[str, float]:
        import torch

        self.round += 1
        started = time.perf_counter()
        with torch.no_grad():
            made = sum(
                self._generate(self.prompts[i : i + 1], self.round * 1000 + i)
                for i in range(len(self.prompts))
            )
        return {"s": time.perf_counter() - started, "tokens": made}

    def batched(self) -> dict[str, float]:
        import torch

        self.round += 1
        started = time.perf_counter()
        with torch.no_grad():
            made = self._generate(self.prompts, self.round)
        return {"s": time.perf_counter() - started, "tokens": made}


class Service:
    """serve-tinker's service in-process (no HTTP, protobuf or polling): a LoRA model as the SDK
    client creates it, a snapshot sampler of it, and ``asample`` calls of every prompt queued
    together (held behind a gate job until all are queued, as a burst of calls reaches a server:
    merged into as few generates as ``max_batch_rows`` allows), each with its scoring forward."""

    def __init__(self, spec: dict[str, Any], directory: Path, work: Path) -> None:
        from openaligner.algorithms.tinker_losses import tinker_loss
        from openaligner.servers.tinker.service import TinkerService

        self.service = TinkerService({"m": directory}, work / "service-checkpoints", tinker_loss)
        session = self.service.create_session({})["session_id"]
        made = self.service.create_model(
            {
                "session_id": session,
                "model_seq_id": 0,
                "base_model": "m",
                "lora_config": {"rank": spec["rank"], "seed": 0},
            }
        )
        model_id = self._wait(made)["model_id"]
        saved = self.service.save_weights_for_sampler(
            {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 0, "kind": "snapshot"}
        )
        self.sampler = self._wait(saved)["sampling_session_id"]
        rng = random.Random(1)
        self.prompts = [
            [rng.randrange(3, spec["vocab"]) for _ in range(spec["prompt_tokens"])]
            for _ in range(spec["samples"])
        ]
        self.max_tokens = spec["response_tokens"]

    def _wait(self, future: dict[str, Any]) -> Any:
        job = self.service.jobs.get(future["request_id"])
        assert job is not None
        return job.result(timeout=600)

    def batched(self) -> dict[str, float]:
        gate = threading.Event()
        self.service.jobs.submit(lambda: gate.wait(600))
        futures = [
            self.service.asample(
                {
                    "sampling_session_id": self.sampler,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": p}]},
                    "num_samples": 1,
                    "sampling_params": {"max_tokens": self.max_tokens, "temperature": 1.0, "stop": []},
                },
                lambda seqs, _plp: seqs,
            )
            for p in self.prompts
        ]
        started = time.perf_counter()
        gate.set()
        made = sum(len(self._wait(f)[0].tokens) for f in futures)
        return {"s": time.perf_counter() - started, "tokens": made}

    def close(self) -> None:
        self.service.close()


def bench_wire(body: bytes, repeats: int) -> dict[str, Any]:
    """The codec's share of one call: decode the SDK's body, encode a result of its size."""
    import torch

    from openaligner.servers.tinker import wire

    decode_s, encode_s = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        decoded = wire.decode_forward_backward_request(body)
        decode_s.append(time.perf_counter() - started)
        outputs = [
            {"logprobs": torch.zeros(d.tokens.numel()), "elementwise_loss": torch.zeros(d.tokens.numel())}
            for d in decoded.datums
        ]
        started = time.perf_counter()
        wire.encode_forward_backward_output(outputs, {"loss:sum": 1.0})
        encode_s.append(time.perf_counter() - started)
    return {
        "body_bytes": len(body),
        "decode_s": statistics.median(decode_s),
        "encode_s": statistics.median(encode_s),
    }


class Sdk:
    """serve-tinker in a subprocess, driven by the SDK client in its own venv, one command at a
    time."""

    def __init__(self, spec: dict[str, Any], directory: Path, tinker_python: Path, work: Path) -> None:
        self.server = subprocess.Popen(
            [
                sys.executable, "-m", "openaligner", "serve-tinker", "server.port=0",
                f"checkpoint_dir={work / 'checkpoints'}", f"threads={spec['threads']}",
                *spec.get("serve_overrides", []),
            ],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            self._start_client(spec, directory, tinker_python, work)
        except BaseException:
            self.server.kill()
            raise

    def _start_client(self, spec: dict[str, Any], directory: Path, tinker_python: Path, work: Path) -> None:
        assert self.server.stdout is not None
        url = None
        for line in self.server.stdout:
            m = re.search(r"tinker server ready at (http://\S+) ", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise RuntimeError("serve-tinker exited before it was ready")
        # keep reading its log, or a full pipe would block the server mid-run
        threading.Thread(target=self.server.stdout.read, daemon=True).start()
        self.body_path = work / "fwdbwd.bin"
        client = Path(__file__).with_name("tinker_bench_client.py")
        self.client = subprocess.Popen(
            [str(tinker_python), str(client), url, str(directory), json.dumps(spec), str(self.body_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "TINKER_TELEMETRY": "0"},
        )  # fmt: skip
        if self._line() != "READY":
            raise RuntimeError("the SDK client did not start")

    def _line(self) -> str:
        assert self.client.stdout is not None
        line = self.client.stdout.readline()
        if not line:
            raise RuntimeError(f"the SDK client exited (code {self.client.poll()})")
        return line.strip()

    def run(self, command: str) -> dict[str, Any]:
        assert self.client.stdin is not None
        self.client.stdin.write(command + "\n")
        self.client.stdin.flush()
        return json.loads(self._line())

    def close(self) -> dict[str, Any]:
        try:
            return self.run("quit")
        finally:
            for proc in (self.client, self.server):
                if proc.poll() is None:
                    proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


def interleaved(rounds: int, runners: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """``rounds`` rounds, each running every runner once, the order rotated by one each round:
    the machine's load then falls on all of them alike, and each round gives paired ratios."""
    names = list(runners)
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            results[n].append(runners[n]())
    return results


def paired_ratio(results: dict[str, list[dict[str, Any]]], a: str, b: str) -> float:
    """Median over rounds (the first dropped: warm-up) of a's seconds over b's."""
    pairs = [x["s"] / y["s"] for x, y in zip(results[a][1:], results[b][1:], strict=True)]
    return statistics.median(pairs)


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
    parser.add_argument(
        "--tinker-python",
        type=Path,
        default=Path(os.environ.get("OPENALIGNER_TINKER_PYTHON", REPO / ".venv-tinker" / "bin" / "python")),
    )
    parser.add_argument(
        "--serve-override", action="append", default=[], help="a serve-tinker override, repeatable"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not args.tinker_python.exists():
        sys.exit(f"the tinker SDK's virtualenv is missing ({args.tinker_python}): run `make tinker-setup`")

    import torch
    import transformers

    # a SIGTERM (timeout, Ctrl-C's cousin) unwinds through the finally blocks, so that the
    # server and the SDK client this run started are stopped with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(args.threads)
    spec = {
        "datums": args.datums,
        "prompt_tokens": args.prompt_tokens,
        "response_tokens": args.response_tokens,
        "steps": args.steps,
        "samples": args.samples,
        "sample_repeats": args.sample_repeats,
        "calls": args.calls,
        "hidden": args.hidden,
        "layers": args.layers,
        "rank": args.rank,
        "serve_overrides": args.serve_override,
        "threads": args.threads,
        "wire_repeats": 20,
    }
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        directory = work / "model"
        build_model_dir(directory, spec)
        sdk = Sdk(spec, directory, args.tinker_python, work)
        try:
            direct = Direct(spec, directory)
            sft = Sft(spec, directory, direct.model.targets)
            engine = Engine(spec, directory)
            service = Service(spec, directory, work)
            train = interleaved(
                args.steps, {"sdk": lambda: sdk.run("train"), "direct": direct.step, "sft": sft.step}
            )
            sample = interleaved(
                args.sample_repeats,
                {
                    "sdk": lambda: sdk.run("sample"),
                    "service": service.batched,
                    "engine_one_by_one": engine.one_by_one,
                    "engine_batched": engine.batched,
                },
            )
            calls = [sdk.run("call")["s"] for _ in range(args.calls)]
            service.close()
        finally:
            versions = sdk.close()
        codec = bench_wire(sdk.body_path.read_bytes(), 20)
    trained = spec["datums"] * (spec["prompt_tokens"] + spec["response_tokens"])
    step = {k: median_after_warmup([x["s"] for x in v]) for k, v in train.items()}
    sample_s = {k: median_after_warmup([x["s"] for x in v]) for k, v in sample.items()}
    sample_tokens = {k: v[-1]["tokens"] for k, v in sample.items()}
    report = {
        "spec": spec,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_1min": [load_before, os.getloadavg()[0]],
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tinker": versions["tinker_version"],
        },
        "train_step_s": step,
        "train_tokens_per_s": {k: trained / v for k, v in step.items()},
        "train_paired_ratio": {
            "sdk_over_direct": paired_ratio(train, "sdk", "direct"),
            "sdk_over_sft": paired_ratio(train, "sdk", "sft"),
            "direct_over_sft": paired_ratio(train, "direct", "sft"),
        },
        "losses_sum": {
            "sdk": [x["loss"] for x in train["sdk"]],
            "direct": [x["loss"] for x in train["direct"]],
        },
        "sample_s": sample_s,
        "sample_tokens": sample_tokens,
        "sample_tokens_per_s": {k: sample_tokens[k] / v for k, v in sample_s.items()},
        "sample_paired_ratio": {
            "sdk_over_engine_one_by_one": paired_ratio(sample, "sdk", "engine_one_by_one"),
            "sdk_over_engine_batched": paired_ratio(sample, "sdk", "engine_batched"),
            "sdk_over_service": paired_ratio(sample, "sdk", "service"),
            "service_over_engine_batched": paired_ratio(sample, "service", "engine_batched"),
        },
        "call_floor_s": median_after_warmup(calls),
        "wire": codec,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
