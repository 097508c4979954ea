"""One script that checks the GPU paths of openaligner on a machine with one CUDA GPU, in a few
minutes, and writes what it found as JSON and a Markdown table (``make gpu-check``).

Checks, in order (each ``ok``, ``skipped`` with a reason, or ``failed`` with the tail of its
error, and its seconds):

* ``gpu_tests``: ``pytest -m gpu`` (the tests that need CUDA);
* ``train_sft``, ``train_rm``: the commands under ``torchrun --nproc_per_node 1``, a tiny model,
  ``precision=bf16-mixed`` (fp32 masters, bf16 autocast: models/precision.py), 2 steps;
* ``serve_critic_train``: ``serve-critic`` under torchrun, ``runtime.precision=bf16-mixed``,
  answering a ``critic_infer`` and a ``critic_train`` request from the project's client;
* ``train_ppo``: ``train-ppo`` under torchrun against that server, bf16-mixed, 2 steps;
* ``nccl_fsdp``: a process group of world size 1 (NCCL on CUDA, gloo on the CPU) under torchrun:
  the project's collectives, and a tiny Llama sharded with FSDP2 layer by layer as
  models/sharding.py does, trained one bf16-autocast step and gathered with
  ``full_state_dict``, equal to the same step without FSDP. (The commands themselves join no
  process group at world size 1, ``distributed.init_from_env``, so they never reach NCCL or FSDP
  on one GPU: this check does.)
* ``ppo_hf``, ``ppo_vllm``: a PPO step of a random Qwen2 of Qwen2.5-0.5B's shape (64 prompts × 4
  samples × 256 new tokens) with each rollout engine (benchmarks/bench_rollout_engine.py,
  ``ppo_step``): rollout tokens/s, step seconds, weight-push seconds, actor-update MFU and the
  trainer's peak GPU memory.

Without CUDA (or with ``--dry``) it runs a dry mode, which CI runs (tests/integration/
test_gpu_check.py) so the script cannot rot: the same commands with tiny models on the CPU
(gloo, bf16 autocast on the CPU), ``gpu_tests`` skipped, and ``ppo_vllm`` skipped unless
``--with-vllm`` (the engine's start alone takes 50-90 s on this CPU; its CPU tests are the
``vllm`` tier).

    python benchmarks/gpu_check.py --out runs/gpu-check          # exits 1 if any check failed

Writes ``OUT/gpu_check.json``, ``OUT/gpu_check.md`` and each check's log under ``OUT/logs/``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench_rollout_engine import SHAPES, free_port, machine, ppo_step, stop_group, tail, wait_for

ROOT = Path(__file__).resolve().parents[1]
CHECKS = (
    "gpu_tests",
    "train_sft",
    "train_rm",
    "serve_critic_train",
    "train_ppo",
    "nccl_fsdp",
    "ppo_hf",
    "ppo_vllm",
)
"""Every check, in the order run; each appears once in the JSON."""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
TINY = ["tiny=gpt2", "tiny_seed=0"]
WORDS = ["sort", "the", "list", "now", "please", "of", "numbers", "add"]


@dataclass
class Check:
    """One check's outcome."""

    name: str
    status: str = "ok"  # ok | skipped | failed
    seconds: float = 0.0
    reason: str | None = None  # skipped: why
    error: str | None = None  # failed: the tail of the error or log
    details: dict[str, Any] = field(default_factory=dict)


class Skip(Exception):
    """A check that does not apply here; the message is the reason."""


@dataclass
class Plan:
    """What this run does: the mode and its sizes."""

    gpu: bool
    out: Path
    rollout_python: str
    with_vllm: bool
    env: dict[str, str]

    @property
    def device(self) -> str:
        return "cuda" if self.gpu else "cpu"

    @property
    def shape(self) -> str:
        return "0.5b" if self.gpu else "tiny"

    @property
    def workload(self) -> dict[str, int]:
        """prompts × samples × new tokens of the engines' PPO step."""
        if self.gpu:
            return {"prompts": 64, "samples": 4, "prompt_len": 32, "new_tokens": 256}
        return {"prompts": 4, "samples": 2, "prompt_len": 8, "new_tokens": 8}

    @property
    def critic_positions(self) -> int:
        w = self.workload
        return max(128, w["prompt_len"] + w["new_tokens"] + 8)


def run_check(name: str, body: Callable[[], dict[str, Any] | None]) -> Check:
    """``body`` timed; :class:`Skip` makes it skipped, any other exception failed."""
    check = Check(name)
    t0 = time.perf_counter()
    try:
        check.details = body() or {}
    except Skip as skip:
        check.status, check.reason = "skipped", str(skip)
    except Exception as exc:
        check.status = "failed"
        check.error = "".join(traceback.format_exception_only(exc)).strip()[-3000:]
    check.seconds = round(time.perf_counter() - t0, 2)
    print(f"[gpu-check] {name}: {check.status} in {check.seconds:.1f} s {check.reason or ''}", flush=True)
    return check


def command(plan: Plan, name: str, cmd: list[str], timeout_s: float = 300) -> str:
    """Run ``cmd`` with its output in ``logs/<name>.log``; its output, or RuntimeError with the tail."""
    log = plan.out / "logs" / f"{name}.log"
    with log.open("w") as out:
        done = subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=plan.env, timeout=timeout_s, cwd=ROOT
        )
    text = log.read_text(errors="replace")
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[-12:])} exited {done.returncode}: {text[-2000:]}")
    return text


def expect(text: str, needle: str, what: str) -> None:
    if needle not in text:
        raise RuntimeError(f"{what}: {needle!r} not in its output: {text[-1500:]}")


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prompt(i: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 3))


# ----------------------------------------------------------------------------- the checks
def gpu_tests(plan: Plan) -> dict[str, Any]:
    if not plan.gpu:
        raise Skip("no CUDA device (dry mode): the gpu tests skip themselves here")
    log = plan.out / "logs" / "gpu_tests.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=plan.env, cwd=ROOT, timeout=300)
    if done.returncode == 5:
        raise Skip("no test carries the gpu marker")
    if done.returncode != 0:
        raise RuntimeError(f"pytest -m gpu exited {done.returncode}: {tail(log)}")
    return {"summary": tail(log, 300).strip().splitlines()[-1]}


def _common(plan: Plan) -> list[str]:
    return [f"device={plan.device}", "precision=bf16-mixed", "progress=false", "tensorboard=false"]


def _train_supervised(plan: Plan, name: str, rows: list[dict[str, str]], *expected: str) -> dict[str, Any]:
    """``openaligner train-{name}`` under torchrun, bf16-mixed, 2 steps on ``rows``; its output
    must hold ``precision bf16-mixed`` and every ``expected`` line."""
    data = write_jsonl(plan.out / f"{name}.jsonl", rows)
    text = command(
        plan,
        f"train_{name}",
        [
            *TORCHRUN,
            "-m",
            "openaligner",
            f"train-{name}",
            *(f"model.{t}" for t in TINY),
            f"data.train_path={data}",
            "trainer.max_steps=2",
            "trainer.global_batch_size=4",
            "trainer.micro_batch_size=4",
            f"output_dir={plan.out / name}",
            *_common(plan),
        ],
    )
    for line in ("precision bf16-mixed", *expected):
        expect(text, line, f"train-{name}")
    return {"precision": "bf16-mixed", "device": plan.device, "steps": 2}


def train_sft(plan: Plan) -> dict[str, Any]:
    rows = [{"prompt": _prompt(i), "response": _prompt(i + 3)} for i in range(16)]
    return _train_supervised(plan, "sft", rows, "model saved to")


def train_rm(plan: Plan) -> dict[str, Any]:
    rows = [{"prompt": _prompt(i), "chosen": WORDS[i % 8], "rejected": WORDS[(i + 1) % 8]} for i in range(16)]
    return _train_supervised(plan, "rm", rows)


class CriticUnderTorchrun:
    """``serve-critic`` under torchrun (world size 1), bf16-mixed, started at once and waited for
    by :meth:`port`; its output in ``logs/serve_critic.log``. Its vocabulary is the engines' actor's."""

    def __init__(self, plan: Plan) -> None:
        self.plan, self.port_number = plan, free_port()
        self.log = plan.out / "logs" / "serve_critic.log"
        rows = 64 if plan.gpu else 8
        args = [
            *(f"model.{t}" for t in TINY),
            f"model.tiny_max_positions={plan.critic_positions}",
            # the engines' random actor samples any id of its vocabulary: the critic must read them all
            f"model.tiny_vocab_size={SHAPES[plan.shape]['vocab_size']}",
            f"server.port={self.port_number}",
            f"checkpoint.dir={plan.out / 'critic'}",
            f"train.global_batch_size={rows}",
            f"train.micro_batch_size={min(rows, 16)}",
            "optim.warmup_steps=0",
            "optim.scheduler=constant",
            "optim.lr=1e-3",
            "server.inference_micro_batch_size=[16]",
            "server.model_forward_micro_batch_size=16",
            f"runtime.device={plan.device}",
            "runtime.precision=bf16-mixed",
        ]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [*TORCHRUN, "-m", "openaligner", "serve-critic", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=plan.env,
                cwd=ROOT,
                start_new_session=True,
            )
        self.ready: str | None = None

    def port(self) -> int:
        if self.ready is None:
            self.ready = wait_for(self.log, self.proc, r"critic server ready at http://\S+", 300)
        return self.port_number

    def stop(self) -> None:
        stop_group(self.proc)


def serve_critic_train(plan: Plan, server: CriticUnderTorchrun) -> dict[str, Any]:
    from openaligner.clients.critic import CriticAddress, RemoteCriticConfig, RemoteGPTRMCriticClient

    port = server.port()
    g = torch.Generator().manual_seed(5)
    rows, width = 8, 20
    batch = {
        "response_tokens": torch.randint(4, 60, (rows, width), generator=g),
        "response_lengths": torch.tensor([20, 3, 7, 13, 9, 16, 20, 11]),
    }
    cfg = RemoteCriticConfig(pad_to_length=32, critic=CriticAddress(port=port), init_timeout_s=30)
    with RemoteGPTRMCriticClient(cfg) as client:
        rewards, values = client.infer_rm_critic(batch).result()
        mask = (torch.arange(width - 1)[None, :] < (batch["response_lengths"] - 1)[:, None]).float()
        data = {**batch, "returns": torch.ones(rows, width - 1), "values": values, "mask": mask}
        result = client.train(data).result()
    if not (torch.isfinite(rewards).all() and torch.isfinite(values).all()):
        raise RuntimeError("critic_infer answered non-finite rewards or values")
    if result.get("critic_step", 0) < 1:
        raise RuntimeError(f"critic_train did not step: {result}")
    expect(server.log.read_text(errors="replace"), "bf16-mixed", "serve-critic")
    return {"critic_step": result["critic_step"], "precision": "bf16-mixed", "device": plan.device}


def train_ppo(plan: Plan, server: CriticUnderTorchrun) -> dict[str, Any]:
    port = server.port()
    prompts = write_jsonl(plan.out / "ppo.jsonl", [{"prompt": _prompt(i)} for i in range(16)])
    out = plan.out / "ppo"
    text = command(
        plan,
        "train_ppo",
        [
            *TORCHRUN,
            "-m",
            "openaligner",
            "train-ppo",
            *(f"actor.{t}" for t in TINY),
            f"device={plan.device}",
            "precision=bf16-mixed",
            f"data.train_path={prompts}",
            "data.seq_length=48",
            "trainer.max_steps=2",
            "trainer.num_rollout_samples=8",
            "trainer.rollout_micro_batch_size=8",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=4",
            "trainer.val_check_interval=0",
            "trainer.save_interval=0",
            "trainer.length.max_length=8",
            f"remote.critic.port={port}",
            f"exp.output_dir={out}",
            "exp.progress=false",
            "exp.tensorboard=false",
        ],
    )
    expect(text, "precision: bf16-mixed", "train-ppo")
    steps = [json.loads(line)["step"] for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    if steps != [1, 2]:
        raise RuntimeError(f"train-ppo logged steps {steps}, expected [1, 2]")
    return {"steps": 2, "precision": "bf16-mixed", "device": plan.device}


def nccl_fsdp(plan: Plan) -> dict[str, Any]:
    report = plan.out / "nccl_fsdp.json"
    command(plan, "nccl_fsdp", [*TORCHRUN, __file__, "--fsdp-child", str(report)])
    return json.loads(report.read_text())


def _fsdp_child(report: Path) -> int:
    """Under torchrun (world size 1): a process group, the project's collectives, one FSDP2
    bf16-autocast training step equal to the same step without shards (see the module docstring)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import openaligner.distributed as dp
    from openaligner.models.builders import TinySize, build_tiny_causal_lm
    from openaligner.models.sharding import decoder_layers, full_state_dict, is_sharded

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        backend = dist.get_backend()
        values = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        if not torch.equal(dp.all_reduce_sum(values), values):
            raise RuntimeError("all_reduce_sum over one rank changed the tensor")
        if not torch.equal(dp.broadcast_tensor(values).cpu(), values):
            raise RuntimeError("broadcast_tensor over one rank changed the tensor")
        if not torch.equal(dp.all_gather_rows(values).cpu(), values):
            raise RuntimeError("all_gather_rows over one rank changed the rows")

        model = build_tiny_causal_lm("llama", TinySize(hidden_size=64, num_heads=2), seed=0).to(device)
        replica = copy.deepcopy(model)
        for layer in decoder_layers(model):  # as models/sharding.py's shard() does, at any world size
            fully_shard(layer)
        fully_shard(model, reshard_after_forward=True)
        if not is_sharded(model):
            raise RuntimeError("fully_shard left the model unsharded")
        tokens = torch.randint(3, 120, (4, 16), generator=torch.Generator().manual_seed(0)).to(device)
        losses = []
        for m in (model, replica):
            m.train()
            # SGD, not AdamW: AdamW's first step moves every weight by ±lr whatever its gradient's
            # size, so a gradient near 0 whose sign a GPU kernel's atomics flip would move it 2·lr
            opt = torch.optim.SGD(m.parameters(), lr=1e-2)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = m(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        state = full_state_dict(model)
        assert state is not None
        # Same fp32 masters, same bf16 kernels and no reduction across ranks at world size 1: the
        # step is the same arithmetic, so only the parameters' layout differs (measured on the CPU:
        # equal). On a GPU, atomics in backward kernels may reorder sums: a gradient then differs by
        # ~bf16 rounding (4e-3 relative), the weight by lr · 4e-3 · |g| < 1e-5 for |g| < 0.25.
        worst = max(
            float((state[k].float().cpu() - v.float().cpu()).abs().max())
            for k, v in replica.state_dict().items()
        )
        if worst > 1e-5 or abs(losses[0] - losses[1]) > 1e-5:
            raise RuntimeError(f"FSDP step differs from the plain step: max |Δw| {worst:.3g}, loss {losses}")
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        report.write_text(
            json.dumps(
                {
                    "backend": backend,
                    "world_size": dist.get_world_size(),
                    "loss": losses[0],
                    "max_abs_weight_diff": worst,
                    "peak_gpu_bytes": peak,
                }
            )
        )
    finally:
        dist.destroy_process_group()
    return 0


def ppo_engine(plan: Plan, engine: str, port: int) -> dict[str, Any]:
    if engine == "vllm":
        if not plan.gpu and not plan.with_vllm:
            raise Skip(
                "dry mode: the vllm engine's start takes 50-90 s on this CPU (--with-vllm runs it; "
                "its CPU tests are the vllm tier)"
            )
        if not Path(plan.rollout_python).exists():
            raise Skip(f"no rollout environment at {plan.rollout_python}: make rollout-setup")
    w = plan.workload
    result = ppo_step(
        engine,
        shape=plan.shape,
        workdir=plan.out / "engines",
        device=plan.device,
        precision="bf16-mixed",
        critic_port=port,
        rollout_python=plan.rollout_python,
        env=plan.env,
        **w,
    )
    return {"shape": plan.shape, **w, **result}


# ----------------------------------------------------------------------------- the run
def run(plan: Plan) -> list[Check]:
    """Every check of :data:`CHECKS`, in order."""
    (plan.out / "logs").mkdir(parents=True, exist_ok=True)
    (plan.out / "engines").mkdir(exist_ok=True)
    server = CriticUnderTorchrun(plan)  # loads while the first checks run
    try:
        checks = [
            run_check("gpu_tests", lambda: gpu_tests(plan)),
            run_check("train_sft", lambda: train_sft(plan)),
            run_check("train_rm", lambda: train_rm(plan)),
            run_check("nccl_fsdp", lambda: nccl_fsdp(plan)),
            run_check("serve_critic_train", lambda: serve_critic_train(plan, server)),
            run_check("train_ppo", lambda: train_ppo(plan, server)),
        ]
        for engine in ("hf", "vllm"):
            checks.append(run_check(f"ppo_{engine}", lambda e=engine: ppo_engine(plan, e, server.port())))  # type: ignore[misc]
    finally:
        server.stop()
    return sorted(checks, key=lambda c: CHECKS.index(c.name))


def markdown(result: dict[str, Any]) -> str:
    """The result as Markdown: one row per check, then the engines' PPO step."""
    lines = [
        f"# gpu-check ({result['mode']} mode): {result['machine']['device']}",
        "",
        f"torch {result['machine']['torch']}, Python {result['machine']['python']}, "
        f"total {result['total_s']:.0f} s, load {result['machine']['loadavg_1min']:.1f}",
        "",
        "| check | status | seconds | notes |",
        "|---|---|---|---|",
    ]
    for c in result["checks"]:
        note = c["reason"] or (c["error"] or "").splitlines()[0][:200] if c["status"] != "ok" else ""
        if c["status"] == "ok":
            note = ", ".join(f"{k}={v}" for k, v in c["details"].items() if not isinstance(v, dict))[:200]
        note = note.replace("|", "\\|")  # an error's text must not end the table cell
        lines.append(f"| {c['name']} | {c['status']} | {c['seconds']:.1f} | {note} |")
    engines = [c for c in result["checks"] if c["name"].startswith("ppo_") and c["status"] == "ok"]
    if engines:
        lines += [
            "",
            "PPO step 2 (step 1 warms up): rollout tokens/s = generated tokens / generate seconds "
            "(weight push included); MFU of the actor update against the measured matmul peak; peak "
            "GPU memory of the trainer's process (the vllm engine's own process is not in it).",
            "",
            "| engine | model | rows × new tokens | step s | generate s | rollout tokens/s | weight push s "
            "| actor update s | MFU | peak GPU GiB |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in engines:
            d = c["details"]
            sync = "—" if d["weight_sync_s"] is None else f"{d['weight_sync_s']:.2f}"
            peak = "—" if d["peak_gpu_bytes"] is None else f"{d['peak_gpu_bytes'] / 2**30:.1f}"
            lines.append(
                f"| {d['engine']} | {d['shape']} | {d['prompts'] * d['samples']} × {d['new_tokens']} "
                f"| {d['step_s']:.2f} | {d['generate_s']:.2f} | {d['rollout_tokens_per_s']:,.0f} | {sync} "
                f"| {d['actor_update_s']:.2f} | {d['actor_update_mfu']:.1%} | {peak} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    if "--fsdp-child" in sys.argv:
        return _fsdp_child(Path(sys.argv[sys.argv.index("--fsdp-child") + 1]))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON, Markdown and logs")
    parser.add_argument("--dry", action="store_true", help="the dry mode even when CUDA is available")
    parser.add_argument("--with-vllm", action="store_true", help="dry mode: also the vllm PPO step")
    parser.add_argument("--rollout-python", default=str(ROOT / ".venv-rollout" / "bin" / "python"))
    a = parser.parse_args()
    gpu = torch.cuda.is_available() and not a.dry
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not gpu:
        env["OMP_NUM_THREADS"] = "1"  # tiny models: more threads only contend on a small CPU
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    plan = Plan(gpu=gpu, out=a.out.resolve(), rollout_python=a.rollout_python, with_vllm=a.with_vllm, env=env)
    t0 = time.perf_counter()
    checks = run(plan)
    result = {
        "mode": "gpu" if gpu else "dry",
        "machine": machine(),
        "total_s": round(time.perf_counter() - t0, 1),
        "checks": [asdict(c) for c in checks],
    }
    (plan.out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    (plan.out / "gpu_check.md").write_text(markdown(result))
    print(markdown(result))
    return 1 if any(c.status == "failed" for c in checks) else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the servers on SIGTERM too
    raise SystemExit(main())
