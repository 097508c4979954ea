"""A LoRA policy's step on the vllm engine, two ways side by side: the merged adapted modules
pushed into the engine (what ``rollout.engine=vllm`` does) against the adapter itself served by
vLLM's LoRA support (``enable_lora``, a new ``LoRARequest`` per optimizer step).

Per round (one simulated optimizer step: every ``lora_B`` perturbed, as training moves them):

* **merged**: the trainer's side of the push (``CausalLMActor.inference_update_state_dict``, the
  adapted modules merged, written as ``model.safetensors`` in float32 to ``/dev/shm``), the
  engine's reload of it (``reload_weights``), then the rollout's generation;
* **adapter**: ``save_pretrained`` of the adapter (peft's own files, what ``train-ppo`` saves), then
  the rollout's generation under a new ``LoRARequest`` (the first generation with it loads it),
  then the same generation again with the adapter already loaded (what LoRA's compute costs,
  without the load).

The two engines run in their own processes (``--rollout-python``, vLLM's environment), started
once, and are driven in turn within each round, so that both see the same load. Workload: the
walkthrough's GRPO rollout (docs/real-model.md section 4): 2 reverse-text prompts × 4 responses,
24 new tokens (``ignore_eos``: every response the full budget, so both do the same work),
temperature 1; Gemma 3 270M converted by ``make real-model``, float32, ``lora.r=16, alpha=32`` on
every linear layer. Also checked, greedily: the adapter engine's tokens against the merged one's
(same weights, two computations), and against the base model (the adapter changes them).

Prints one JSON object (per variant the median and all seconds of each phase, and the ratio of
the step costs). Usage::

    python benchmarks/bench_vllm_lora.py --rollout-python .venv-rollout/bin/python [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = Path.home() / ".cache" / "openaligner" / "gemma-3-270m"
REPLY = "@@reply "  # the child's answers on stdout, among vLLM's own log lines


# ---------------------------------------------------------------- the engine side (vLLM's venv)


def child(args: argparse.Namespace) -> None:
    """One vLLM engine serving commands read as JSON lines on stdin (``lora`` or not)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    kwargs: dict[str, Any] = {
        "model": str(args.model),
        "skip_tokenizer_init": True,
        "generation_config": "vllm",
        "dtype": "float32",
        "enforce_eager": True,
        "seed": 0,
        "distributed_executor_backend": "uni",
    }
    if args.child == "lora":
        kwargs |= {"enable_lora": True, "max_lora_rank": 16, "max_loras": 1}
    llm = LLM(**kwargs)

    def answer(payload: dict[str, Any]) -> None:
        sys.stdout.write(REPLY + json.dumps(payload) + "\n")
        sys.stdout.flush()

    answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            return
        if cmd["op"] == "reload":
            t0 = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": cmd["path"]})
            llm.reset_prefix_cache()
            answer({"seconds": time.perf_counter() - t0})
        elif cmd["op"] == "generate":
            params = SamplingParams(
                temperature=cmd["temperature"],
                max_tokens=cmd["max_tokens"],
                ignore_eos=True,
                seed=cmd.get("seed"),
            )
            prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
            lora = None
            if cmd.get("adapter"):
                lora = LoRARequest(f"step{cmd['adapter_id']}", cmd["adapter_id"], cmd["adapter"])
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
            seconds = time.perf_counter() - t0
            answer({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]})


class Child:
    """A :func:`child` process and its command channel."""

    def __init__(self, kind: str, args: argparse.Namespace, log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        # as the project starts its engine (rollout/vllm_link.py): the engine core in this process
        env |= {"PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        self.log = open(log, "w")  # noqa: SIM115 (kept open for the child's life)
        cmd = [args.rollout_python, "-I", __file__, f"--child={kind}", f"--model={args.model}"]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        self.kind = kind
        self.read()  # ready

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                reply: dict[str, Any] = json.loads(line[len(REPLY) :])
                return reply
            self.log.write(line)
        raise RuntimeError(f"the {self.kind} engine exited (rc {self.proc.wait()}); see {self.log.name}")

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.ask_quit()
        self.log.close()

    def ask_quit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


# ---------------------------------------------------------------- the trainer side (this venv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--rollout-python", default=".venv-rollout/bin/python")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="where the engines' logs go (default: a temp dir)")
    ap.add_argument("--child", choices=("merged", "lora"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openaligner.models.actor import CausalLMActor
    from openaligner.models.lora import LoraConfig, add_lora
    from openaligner.rollout.weights_file import write_weights
    from openaligner.tasks import reverse_text

    torch.set_num_threads(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-vllm-lora-"))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    records = reverse_text.prompt_records(0, 2, False)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in records for _ in range(4)]
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    peft_model = add_lora(model, LoraConfig(r=16, alpha=32))
    actor = CausalLMActor(peft_model, init_policy=False)
    g = torch.Generator().manual_seed(0)

    engines = {kind: Child(kind, args, out / f"{kind}.log") for kind in ("merged", "lora")}
    times: dict[str, dict[str, list[float]]] = {
        "merged": {"push_write": [], "push_reload": [], "generate": []},
        "adapter": {"save": [], "generate_with_load": [], "generate_loaded": []},
    }
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    greedy: dict[str, list[list[int]]] = {}
    try:
        greedy["base"] = engines["merged"].ask(
            op="generate", prompts=prompts[::4], temperature=0.0, max_tokens=24
        )["tokens"]
        with (
            tempfile.TemporaryDirectory(dir=shm) as push_dir,
            tempfile.TemporaryDirectory(dir=shm) as adapters,
        ):
            for k in range(args.rounds):
                with torch.no_grad():  # one optimizer step's change of the adapters
                    for name, p in peft_model.named_parameters():
                        if "lora_B" in name:
                            p.add_(0.004 * torch.randn(p.shape, generator=g))
                sample = {"prompts": prompts, "temperature": 1.0, "max_tokens": 24, "seed": k}
                # merged: push the adapted modules, reload, generate
                t0 = time.perf_counter()
                state = actor.inference_update_state_dict()
                assert state is not None
                write_weights(Path(push_dir), state, torch.float32, tied)
                times["merged"]["push_write"].append(time.perf_counter() - t0)
                times["merged"]["push_reload"].append(
                    engines["merged"].ask(op="reload", path=push_dir)["seconds"]
                )
                times["merged"]["generate"].append(engines["merged"].ask(op="generate", **sample)["seconds"])
                # adapter: save it, generate (loads it), generate again (loaded)
                step_dir = Path(adapters) / f"step{k}"
                t0 = time.perf_counter()
                peft_model.save_pretrained(str(step_dir))
                times["adapter"]["save"].append(time.perf_counter() - t0)
                lora = {"adapter": str(step_dir), "adapter_id": k + 1}
                times["adapter"]["generate_with_load"].append(
                    engines["lora"].ask(op="generate", **sample, **lora)["seconds"]
                )
                times["adapter"]["generate_loaded"].append(
                    engines["lora"].ask(op="generate", **sample, **lora)["seconds"]
                )
            last = {"adapter": str(Path(adapters) / f"step{args.rounds - 1}"), "adapter_id": args.rounds}
            greedy["merged"] = engines["merged"].ask(
                op="generate", prompts=prompts[::4], temperature=0.0, max_tokens=24
            )["tokens"]
            greedy["adapter"] = engines["lora"].ask(
                op="generate", prompts=prompts[::4], temperature=0.0, max_tokens=24, **last
            )["tokens"]
    finally:
        for engine in engines.values():
            engine.close()

    def same(a: list[list[int]], b: list[list[int]]) -> float:
        pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
        return sum(x == y for x, y in pairs) / len(pairs)

    def med(values: list[float]) -> float:
        return statistics.median(values)

    vllm_version = subprocess.run(
        [args.rollout_python, "-I", "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    step = {
        "merged": [sum(v) for v in zip(*times["merged"].values(), strict=True)],
        "adapter": [
            s + g
            for s, g in zip(times["adapter"]["save"], times["adapter"]["generate_with_load"], strict=True)
        ],
    }
    result: dict[str, Any] = {
        "model": str(args.model),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "versions": {"torch": torch.__version__, "vllm": vllm_version},
        "threads": args.threads,
        "rounds": args.rounds,
        "workload": "2 prompts x 4 responses, 24 new tokens (ignore_eos), temperature 1, float32, "
        "LoRA r=16 all-linear",
        "median_s": {v: {phase: med(x) for phase, x in phases.items()} for v, phases in times.items()},
        "all_s": times,
        "step_median_s": {v: med(x) for v, x in step.items()},
        "adapter_load_median_s": med(
            [
                a - b
                for a, b in zip(
                    times["adapter"]["generate_with_load"], times["adapter"]["generate_loaded"], strict=True
                )
            ]
        ),
        "ratio_adapter_over_merged_step": med(step["adapter"]) / med(step["merged"]),
        "greedy_tokens_same_adapter_vs_merged": same(greedy["adapter"], greedy["merged"]),
        "greedy_tokens_same_adapter_vs_base": same(greedy["adapter"], greedy["base"]),
        "logs": str(out),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
