"""The two rollout engines side by side: ``hf`` (the project's sampling loop) against ``vllm`` (a
vLLM engine in its own process, docs/rollout-engine.md), on the same random Qwen2-shaped model and
the same prompts, in one run. Prints JSON.

Measured, per engine:

* generation tokens/s: the median over ``--repeats`` batches of ``prompts × samples`` rows, each
  generating exactly ``--new-tokens`` tokens (stop ids banned until then), after one warm-up batch;
  the vllm engine's start (process, import of vLLM, model load) is excluded and reported apart;
* weight-push seconds (vllm): the median of ``--pushes`` pushes of changed weights, each the
  ``timing/weight_sync_s`` the engine reports for the next generate;
* with ``--transfers auto,collective``: the weight push by each ``rollout.vllm.weight_transfer``
  into one engine, pushes interleaved (auto, collective, auto, ...), the median of ``--pushes``
  each; ``--pushes-only`` skips the generation timings;
* with ``--ppo``: one PPO step each, ``openaligner train-ppo rollout.engine=<e>`` against a tiny
  ``serve-critic`` (2 steps; step 2 is the one reported, so vLLM's start and the first step's warm-up
  are outside it): step seconds, generate seconds, rollout tokens/s, actor-update seconds and MFU,
  and the trainer's peak GPU memory (null on the CPU).

``benchmarks/gpu_check.py`` runs the same PPO-step comparison (:func:`ppo_step`) on a GPU.

    .venv/bin/python benchmarks/bench_rollout_engine.py --shape small --ppo     # this CPU
    .venv/bin/python benchmarks/bench_rollout_engine.py --shape 0.5b --pushes-only \
        --transfers auto,collective                                              # push by push
    .venv/bin/python benchmarks/bench_rollout_engine.py --shape 0.5b --prompts 64 --samples 4 \\
        --new-tokens 256 --ppo                                                   # one CUDA GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flops import llama_shape, matmul_peak_flop_per_s
from openaligner.models.actor import CausalLMActor
from openaligner.models.generation import SamplingParams
from openaligner.models.precision import Precision
from openaligner.models.tokenizers import build_char_tokenizer
from openaligner.rollout.engine import RolloutRequest, row_seeds
from openaligner.rollout.hf_engine import HFRolloutEngine
from openaligner.rollout.vllm_config import VLLMConfig

ROOT = Path(__file__).resolve().parents[1]
PAD, EOS, BOS = 0, 1, 2  # the built-in char tokenizer's special ids (the CLI's tokenizer for these models)

# Qwen2 shapes: "0.5b" is Qwen2.5-0.5B's (494 M parameters: 24 layers of width 896, 14 query heads
# and 2 key/value heads of size 64, MLP 4,864, vocabulary 151,936, tied head). The smaller ones keep
# a head size vLLM's CPU attention accepts (32 or 64; it refuses 16).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        vocab_size=256,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1024,
        vocab_size=4096,
    ),
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
    ),
}


def qwen2_config(shape: str, max_positions: int) -> Qwen2Config:
    """A Qwen2 config of one of :data:`SHAPES`, with the char tokenizer's special ids."""
    return Qwen2Config(
        **SHAPES[shape],
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )


def build_qwen2(shape: str, max_positions: int, seed: int = 0) -> Qwen2ForCausalLM:
    """A random float32 Qwen2 of ``shape`` (seeded), in eval mode."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(qwen2_config(shape, max_positions)).eval()


def save_qwen2(shape: str, max_positions: int, out: Path, seed: int = 0) -> Path:
    """:func:`build_qwen2` saved as a Hugging Face directory (the actor.path of a train-ppo run),
    with the project's char tokenizer (one token per character; ids below every shape's vocabulary)."""
    build_qwen2(shape, max_positions, seed).save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    return out


def machine() -> dict[str, Any]:
    """What the figures were measured on: device, versions, the load average."""
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_1min": os.getloadavg()[0],
    }


def peak_flop_per_s(device: torch.device) -> float:
    """The device's measured matmul peak: bfloat16 8192² products on CUDA (what the bf16-mixed
    actor update runs), float32 on the CPU at its torch thread count (benchmarks/flops.py)."""
    if device.type != "cuda":
        return matmul_peak_flop_per_s(torch.get_num_threads())
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


# ----------------------------------------------------------------------------- generation
def _request(
    prompts: int, samples: int, prompt_len: int, new_tokens: int, vocab: int, seed: int
) -> RolloutRequest:
    """``prompts × samples`` rows (each prompt repeated ``samples`` times), every row generating
    exactly ``new_tokens`` tokens: the stop id is banned until then."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, vocab, (prompts, prompt_len), generator=g).repeat_interleave(samples, dim=0)
    rows = text.shape[0]
    sampling = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, stop_token_ids=(EOS,))
    return RolloutRequest(text, torch.full((rows,), prompt_len), sampling, row_seeds(seed, rows))


def _timed(engine: Any, request: RolloutRequest, device: torch.device) -> tuple[float, int]:
    """Seconds of one generate and the tokens it generated."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = engine.generate(request)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, int((out.sequence_lengths - out.prompt_lengths).sum())


def bench_generation(
    shape: str,
    *,
    prompts: int,
    samples: int,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    pushes: int,
    rollout_python: str | None,
) -> dict[str, Any]:
    """Generation tokens/s of both engines on one model and request (docstring of the module).

    ``rollout_python`` None or missing: the vllm engine is skipped, with the reason.
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = build_qwen2(shape, prompt_len + new_tokens + 8).to(device)
    precision = Precision("bf16-mixed", "cuda") if cuda else Precision()
    actor = CausalLMActor(model, init_policy=False, precision=precision)
    request = _request(prompts, samples, prompt_len, new_tokens, model.config.vocab_size, seed=0)
    result: dict[str, Any] = {
        "shape": shape,
        "parameters": sum(p.numel() for p in model.parameters()),
        "rows": prompts * samples,
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "dtype": "bf16-mixed (hf) / bfloat16 (vllm)" if cuda else "float32",
    }
    result["hf"] = _engine_runs(HFRolloutEngine(actor), request, repeats, device)
    if rollout_python is None or not Path(rollout_python).exists():
        result["vllm"] = {"skipped": f"no rollout environment at {rollout_python} (make rollout-setup)"}
        return result
    from openaligner.rollout.vllm_engine import VLLMRolloutEngine

    cfg = VLLMConfig(
        python=rollout_python,
        dtype="bfloat16" if cuda else "float32",
        enforce_eager=not cuda,
        gpu_memory_utilization=0.4 if cuda else 0.0,
        max_model_len=prompt_len + new_tokens + 8,
        start_timeout_s=900,
    )
    engine = VLLMRolloutEngine(actor, cfg)
    t0 = time.perf_counter()
    with engine:
        engine.start()
        start_s = time.perf_counter() - t0
        runs = _engine_runs(engine, request, repeats, device)
        runs["start_s"] = start_s
        runs["weight_push_s"] = _pushes(engine, actor, pushes, request, device)
    result["vllm"] = runs
    result["vllm_vs_hf"] = runs["tokens_per_s"] / result["hf"]["tokens_per_s"]
    return result


def _engine_runs(engine: Any, request: RolloutRequest, repeats: int, device: torch.device) -> dict[str, Any]:
    """One warm-up generate, then the median of ``repeats``."""
    warm_s, _ = _timed(engine, request, device)
    seconds, tokens = [], 0
    for _ in range(repeats):
        s, tokens = _timed(engine, request, device)
        seconds.append(s)
    median = statistics.median(seconds)
    return {
        "warmup_s": warm_s,
        "seconds": seconds,
        "median_s": median,
        "tokens": tokens,
        "tokens_per_s": tokens / median,
    }


def _pushes(
    engine: Any, actor: CausalLMActor, pushes: int, request: RolloutRequest, device: torch.device
) -> dict[str, Any]:
    """Median seconds of ``pushes`` weight pushes, each of changed weights followed by a one-row
    generate (the push happens lazily, before the engine's next generate)."""
    one = RolloutRequest(request.prompts[:1], request.prompt_lengths[:1], request.sampling, request.seeds[:1])
    seconds = []
    g = torch.Generator(device=device).manual_seed(1)
    for version in range(1, pushes + 1):
        with torch.no_grad():
            for p in actor.model.parameters():
                p.add_(torch.randn(p.shape, generator=g, device=device) * 1e-3)
        engine.update_weights(actor, version)
        _timed(engine, one, device)
        seconds.append(engine.pop_metrics()["timing/weight_sync_s"])
    return {"seconds": seconds, "median_s": statistics.median(seconds)}


def bench_transfers(shape: str, *, pushes: int, transfers: list[str], rollout_python: str) -> dict[str, Any]:
    """Weight-push seconds of each ``rollout.vllm.weight_transfer`` in ``transfers`` into one vllm
    engine on a random Qwen2 of ``shape``: pushes interleaved across the transfers (so load
    drifts hit all alike), each of changed weights followed by a one-row generate; per transfer
    the seconds, their median, and each median over the first transfer's."""
    import dataclasses

    from openaligner.rollout.vllm_engine import VLLMRolloutEngine

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = build_qwen2(shape, 64).to(device)
    actor = CausalLMActor(model, init_policy=False)
    request = _request(1, 1, 8, 4, model.config.vocab_size, seed=0)
    cfg = VLLMConfig(
        python=rollout_python,
        dtype="bfloat16" if cuda else "float32",
        enforce_eager=not cuda,
        gpu_memory_utilization=0.4 if cuda else 0.0,
        max_model_len=64,
        start_timeout_s=900,
    )
    seconds: dict[str, list[float]] = {t: [] for t in transfers}
    g = torch.Generator(device=device).manual_seed(1)
    with VLLMRolloutEngine(actor, cfg) as engine:
        engine.generate(request)
        for version in range(1, pushes + 1):
            for t in transfers:
                engine.cfg = dataclasses.replace(cfg, weight_transfer=t)
                with torch.no_grad():
                    for p in actor.model.parameters():
                        p.add_(torch.randn(p.shape, generator=g, device=device) * 1e-3)
                engine.update_weights(actor, version)
                _timed(engine, request, device)
                seconds[t].append(engine.pop_metrics()["timing/weight_sync_s"])
    medians = {t: statistics.median(v) for t, v in seconds.items()}
    return {
        "shape": shape,
        "parameters": sum(p.numel() for p in model.parameters()),
        "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "dtype": cfg.dtype,
        "seconds": seconds,
        "median_s": medians,
        "vs_first": {t: medians[t] / medians[transfers[0]] for t in transfers},
    }


# ----------------------------------------------------------------------------- PPO step
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def critic_server(
    workdir: Path, max_positions: int, env: dict[str, str], train_rows: int = 64, extra: tuple[str, ...] = ()
) -> Iterator[int]:
    """A tiny combined reward model + critic (``openaligner serve-critic model.tiny=gpt2``) in its
    own process group; yields its port and stops it (SIGTERM, then SIGKILL) afterwards.
    ``train_rows``: the critic's global batch (a train request is padded to a multiple of it);
    ``extra``: more ``key=value`` settings."""
    port = free_port()
    log = workdir / "serve-critic.log"
    args = [
        "model.tiny=gpt2",
        f"model.tiny_max_positions={max_positions}",
        f"server.port={port}",
        f"checkpoint.dir={workdir / 'critic'}",
        f"train.global_batch_size={train_rows}",
        f"train.micro_batch_size={min(train_rows, 16)}",
        "optim.warmup_steps=0",
        "optim.scheduler=constant",
        "server.inference_micro_batch_size=[16]",
        "server.model_forward_micro_batch_size=16",
        "server.max_queue_delay_microseconds=0",
        *extra,
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "openaligner", "serve-critic", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        wait_for(log, proc, r"critic server ready at http://\S+", 240)
        yield port
    finally:
        stop_group(proc)


def wait_for(log: Path, proc: subprocess.Popen[Any], pattern: str, timeout_s: float) -> str:
    """The first match of ``pattern`` in ``log`` while ``proc`` runs.

    Raises:
        RuntimeError: the process ended first, or ``timeout_s`` passed; with the log's tail.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(pattern, log.read_text(errors="replace"))
        if match:
            return match.group(0)
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name}: exited {proc.returncode} before ready: {tail(log)}")
        time.sleep(0.2)
    raise RuntimeError(f"{log.name}: not ready within {timeout_s:.0f} s: {tail(log)}")


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tail(path: Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def write_prompts(path: Path, count: int, chars: int) -> Path:
    """``count`` distinct prompts of ``chars`` characters (the char tokenizer: one token each)."""
    words = ["sort", "the", "list", "now", "please", "of", "numbers", "add", "reverse", "text"]
    rows = []
    for i in range(count):
        text = " ".join(words[(i * 7 + k * 3) % len(words)] for k in range(chars))
        rows.append(json.dumps({"prompt": f"{i} {text}"[:chars]}))
    path.write_text("\n".join(rows) + "\n")
    return path


def ppo_step(
    engine: str,
    *,
    shape: str,
    workdir: Path,
    prompts: int,
    samples: int,
    prompt_len: int,
    new_tokens: int,
    device: str,
    precision: str,
    critic_port: int,
    rollout_python: str,
    env: dict[str, str],
    timeout_s: float = 600,
) -> dict[str, Any]:
    """Two PPO steps of ``openaligner train-ppo rollout.engine=<engine>`` on a saved random
    Qwen2 of ``shape``, in a child process (:func:`_ppo_child`); step 2's figures.

    Returns: ``step_s``, ``generate_s``, ``weight_sync_s`` (vllm), ``rollout_tokens_per_s``
    (generated tokens / generate seconds), ``actor_update_s``, ``actor_update_mfu`` (training
    FLOPs of the update, benchmarks/flops.py, over its seconds and the device's measured matmul
    peak), ``peak_gpu_bytes`` (the trainer's torch.cuda.max_memory_allocated; None on the CPU;
    the vllm engine's own process is not in it), ``wall_s`` (the child's, start-up included).

    Raises:
        RuntimeError: the run failed; with its output's tail.
    """
    run = workdir / f"ppo-{engine}"
    run.mkdir(parents=True, exist_ok=True)
    positions = prompt_len + new_tokens + 8
    model_dir = workdir / f"qwen2-{shape}"
    if not (model_dir / "config.json").exists():
        save_qwen2(shape, positions, model_dir)
    # two steps in one pass; prompt_len - 1 characters + the BOS
    data = write_prompts(workdir / "prompts.jsonl", 2 * prompts, prompt_len - 1)
    rows = prompts * samples
    args = [
        "train-ppo",
        f"actor.path={model_dir}",
        f"device={device}",
        f"precision={precision}",
        f"data.train_path={data}",
        f"data.seq_length={prompt_len + new_tokens}",
        "trainer.max_steps=2",
        f"trainer.num_rollout_samples={prompts}",
        f"trainer.n_samples_per_prompt={samples}",
        f"trainer.rollout_micro_batch_size={rows}",
        f"trainer.global_batch_size={rows}",
        f"trainer.micro_batch_size={min(rows, 16)}",
        f"trainer.forward_micro_batch_size={min(rows, 32)}",
        "trainer.val_check_interval=0",
        "trainer.save_interval=0",
        "trainer.sample_table_interval=0",
        "trainer.rollout_log_rows=0",
        f"trainer.length.max_length={new_tokens}",
        f"trainer.length.min_length={new_tokens}",
        "trainer.gate_unfinished=false",  # fixed-length responses (none ends) are all trained on
        f"remote.critic.port={critic_port}",
        f"exp.output_dir={run / 'out'}",
        "exp.progress=false",
        "exp.tensorboard=false",
        f"rollout.engine={engine}",
    ]
    if engine == "vllm":
        gpu = device.startswith("cuda")
        args += [
            f"rollout.vllm.python={rollout_python}",
            f"rollout.vllm.dtype={'bfloat16' if gpu else 'float32'}",
            f"rollout.vllm.enforce_eager={str(not gpu).lower()}",
            f"rollout.vllm.gpu_memory_utilization={0.35 if gpu else 0.0}",
            f"rollout.vllm.max_model_len={positions}",
            "rollout.vllm.start_timeout_s=600",
        ]
        if gpu:  # bf16 engine vs bf16-mixed trainer: ~1e-2 apart (docs/rollout-engine.md, Checks)
            args.append("rollout.vllm.max_logprob_diff=0.5")
    report, log = run / "child.json", run / "train-ppo.log"
    t0 = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, __file__, "--ppo-child", str(report), "--", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=timeout_s,
        )
    wall = time.perf_counter() - t0
    if done.returncode != 0 or not report.exists():
        raise RuntimeError(f"train-ppo rollout.engine={engine} exited {done.returncode}: {tail(log)}")
    child = json.loads(report.read_text())
    rows_metrics = [
        json.loads(line) for line in (run / "out" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    last = rows_metrics[-1]
    config = qwen2_config(shape, positions)
    update_tokens = rows * (prompt_len + new_tokens)
    flops = llama_shape(config).train_flops_per_token(prompt_len + new_tokens) * update_tokens
    update_s = last["timing/train_s"]
    return {
        "engine": engine,
        "step": last["step"],
        "step_s": last["timing/step_s"],
        "generate_s": last["timing/generate_s"],
        "weight_sync_s": last.get("timing/weight_sync_s"),
        "rollout_tokens_per_s": rows * new_tokens / last["timing/generate_s"],
        "actor_update_s": update_s,
        "actor_update_mfu": flops / update_s / child["peak_flop_per_s"],
        "peak_flop_per_s": child["peak_flop_per_s"],
        "peak_gpu_bytes": child["peak_gpu_bytes"],
        "engine_logprob_diff_mean": last.get("rollout/engine_logprob_diff_mean"),
        "wall_s": wall,
    }


def _ppo_child(report: Path, args: list[str]) -> int:
    """Run ``openaligner <args>`` in this process, then write its peak GPU memory and this device's
    matmul peak to ``report`` (JSON)."""
    from openaligner.cli.main import main

    code = main(args)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    if code == 0:
        report.write_text(json.dumps({"peak_gpu_bytes": peak, "peak_flop_per_s": peak_flop_per_s(device)}))
    return code


def main() -> int:
    if "--ppo-child" in sys.argv:
        at = sys.argv.index("--ppo-child")
        return _ppo_child(Path(sys.argv[at + 1]), sys.argv[at + 3 :])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    parser.add_argument("--ppo", action="store_true", help="also one PPO step with each engine")
    parser.add_argument(
        "--transfers", default="", help="comma-separated weight_transfer values to time push by push"
    )
    parser.add_argument("--pushes-only", action="store_true", help="skip the generation timings")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench-rollout-engine"))
    parser.add_argument("--rollout-python", default=str(ROOT / ".venv-rollout" / "bin" / "python"))
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    out: dict[str, Any] = {"machine": machine(), "command": " ".join(sys.argv)}
    if not a.pushes_only:
        out["generation"] = bench_generation(
            a.shape,
            prompts=a.prompts,
            samples=a.samples,
            prompt_len=a.prompt_tokens,
            new_tokens=a.new_tokens,
            repeats=a.repeats,
            pushes=a.pushes,
            rollout_python=a.rollout_python,
        )
    if a.transfers:
        transfers = a.transfers.split(",")
        out["transfers"] = bench_transfers(
            a.shape, pushes=a.pushes, transfers=transfers, rollout_python=a.rollout_python
        )
    if a.ppo:
        cuda = torch.cuda.is_available()
        a.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(a.threads)}
        positions = a.prompt_tokens + a.new_tokens + 8
        vocab = f"model.tiny_vocab_size={SHAPES[a.shape]['vocab_size']}"  # the critic reads any sampled id
        with critic_server(a.workdir, positions, env, min(a.prompts * a.samples, 64), (vocab,)) as port:
            out["ppo"] = {
                engine: ppo_step(
                    engine,
                    shape=a.shape,
                    workdir=a.workdir,
                    prompts=a.prompts,
                    samples=a.samples,
                    prompt_len=a.prompt_tokens,
                    new_tokens=a.new_tokens,
                    device="cuda" if cuda else "cpu",
                    precision="bf16-mixed" if cuda else "fp32",
                    critic_port=port,
                    rollout_python=a.rollout_python,
                    env=env,
                )
                for engine in ("hf", "vllm")
            }
    out["machine"]["loadavg_1min_after"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
