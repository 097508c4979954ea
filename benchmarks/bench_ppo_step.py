"""PPO step time on the canonical workload, end to end, against TRL's PPO trainer in the same run.

Workload (/work/shared/bench/workload.md): policy, initial policy, critic and reward model are the
canonical GPT-2 (n_layer=4, n_embd=256, n_head=4, vocab 512, n_positions=256, random init, seed
0, fp32); 512 prompts of exactly 32 token ids from 3..511 (seed 0); one PPO step = 64 prompts →
64 responses of exactly 64 new tokens (no stop token, temperature 1), 4 minibatches of 16, 1 PPO
epoch, KL coefficient 0.05, lr 1e-5. The critic (combined with the reward model) is served by
``openaligner serve-critic`` in a child process, on this machine, over HTTP; the actor is
:class:`PPOTrainer` in this process with ``torch.set_num_threads(--threads)``, dropping to
``--overlap-threads`` (default: threads − server threads) for the log-prob passes and the update
while the server works on the same cores (``server_overlap_threads``); rollouts are generated
``--rollout-micro-batch`` responses at a time (64, as TRL does by default).

``--estimators gae,grpo,rloo,reinforce,reinforce_pp`` also runs the critic-free estimators on the
same workload, one after the other in each round (``trainer.advantage_estimator``): the same 64
responses of 64 new tokens per step, as 16 prompts × 4 responses (``n_samples_per_prompt=4``, for
``reinforce_pp`` too), the same minibatches, KL coefficient (at the estimator's default place) and
lr; the reward model is served alone by ``openaligner serve-reward`` (no critic) and read through
the critic-free client. Each gets the same report as PPO, plus its step-time ratio to PPO's.

Then, unless ``--peer none``, the same workload on Hugging Face TRL's PPO trainer
(``bench_trl_ppo.py``, in a child process of ``--peer-python``, which needs the ``bench`` extra:
``make bench-setup``). ``--rounds N`` repeats the pair N times, one after the other.

Reports, per system, the median step time over steps 2..N (``--steps``, default 6), tokens/s =
64 × (32 + 64) / step time and the phase split (median per phase); for openaligner also the share
of the step spent waiting on the server and the actor update's FLOP/s (``flops.py``: 6·N + 12·L·d·S
per token, 64 × 96 tokens) against the best fp32 2048² matmul measured at the start and the end
of the run; and the step-time ratio openaligner / TRL, of the medians and of the fastest steps, per
pair and as the median over the pairs. Prints one JSON object. Usage:
``python benchmarks/bench_ppo_step.py [--steps 6] [--threads 2] [--server-threads 1] [--rounds 1]
[--estimators gae] [--peer trl|none]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from flops import gpt2_shape, matmul_peak_flop_per_s

PROMPTS, PROMPT_TOKENS, NEW_TOKENS, ROLLOUTS = 512, 32, 64, 64
SAMPLES_PER_PROMPT = 4  # responses per prompt of the critic-free estimators (16 prompts × 4 = 64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(
    estimator: str, model_dir: Path, ckpt_dir: Path, threads: int, log: Path
) -> tuple[subprocess.Popen[bytes], int]:
    """PPO (``gae``): ``serve-critic`` with the reward model combined; a critic-free estimator:
    ``serve-reward`` alone. Returns the process and its port once it answers ready."""
    port = _free_port()
    args = [
        f"model.path={model_dir}",
        f"server.port={port}",
        "server.inference_micro_batch_size=[16]",
        "server.model_forward_micro_batch_size=16",
        f"threads={threads}",
    ]
    if estimator == "gae":
        command, model = "serve-critic", "critic_infer"
        args += [
            f"checkpoint.dir={ckpt_dir}",
            "train.global_batch_size=64",
            "train.micro_batch_size=16",
            "optim.lr=1e-5",
            "optim.warmup_steps=0",
            "optim.scheduler=constant",
        ]
    else:
        command, model = "serve-reward", "reward_model"
    proc = subprocess.Popen(
        [sys.executable, "-m", "openaligner", command, *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/v2/models/{model}/ready"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text())
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(log.read_text())


def run_openaligner(
    steps: int,
    threads: int,
    server_threads: int,
    rollout_micro_batch: int,
    overlap_threads: int | None,
    estimator: str = "gae",
) -> dict[str, Any]:
    """``steps`` steps of PPOTrainer with ``estimator`` against a served critic (``gae``) or reward
    model (the critic-free ones); the result dict (module doc)."""
    torch.set_num_threads(threads)
    from openaligner.clients.critic import (
        CriticAddress,
        RemoteCriticConfig,
        RemoteGPTRMCriticClient,
        RewardModelAddress,
    )
    from openaligner.clients.reward_only import RemoteRewardOnlyClient
    from openaligner.config import load_config
    from openaligner.io.metrics import MetricsLogger
    from openaligner.models.actor import CausalLMActor
    from openaligner.models.builders import WORKLOAD_SIZE, build_tiny_causal_lm, build_tiny_reward_model
    from openaligner.trainer.ppo import ActorOptim, PPOTrainer, Prompts, RunOutputs
    from openaligner.trainer.ppo_config import PPOConfig
    from openaligner.trainer.rollout import PromptLoader, make_prompt_collate

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 512, (PROMPTS, PROMPT_TOKENS), generator=g).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_tiny_reward_model("gpt2", WORKLOAD_SIZE, seed=0).save_pretrained(work / "rm")
        server, port = _start_server(
            estimator, work / "rm", work / "critic", server_threads, work / "server.log"
        )
        per_prompt = 1 if estimator == "gae" else SAMPLES_PER_PROMPT
        try:
            cfg = load_config(
                PPOConfig,
                None,
                [
                    f"advantage_estimator={estimator}",
                    f"num_rollout_samples={ROLLOUTS // per_prompt}",
                    f"n_samples_per_prompt={per_prompt}",
                    f"rollout_micro_batch_size={rollout_micro_batch}",
                    "global_batch_size=16",
                    "micro_batch_size=16",
                    "ppo_epochs=1",
                    "initial_policy_kl_penalty=0.05",
                    f"length.max_length={NEW_TOKENS}",
                    f"length.min_length={NEW_TOKENS}",
                    "sampling.stop_token_ids=[]",
                    # No response ends (no stop token), and all of them are trained on, as in TRL.
                    "gate_unfinished=false",
                    "val_check_interval=0",
                    "save_interval=0",
                    f"max_steps={steps}",
                    "seed=0",
                ],
            )
            actor = CausalLMActor(build_tiny_causal_lm("gpt2", WORKLOAD_SIZE, seed=0))
            optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-5, fused=True)  # as train-ppo
            width = PROMPT_TOKENS + NEW_TOKENS
            if estimator == "gae":
                remote = RemoteCriticConfig(critic=CriticAddress(port=port), pad_to_length=width)
                client: RemoteGPTRMCriticClient | RemoteRewardOnlyClient = RemoteGPTRMCriticClient(remote)
            else:
                remote = RemoteCriticConfig(reward_model=RewardModelAddress(port=port), pad_to_length=width)
                client = RemoteRewardOnlyClient(remote)
            with client:
                trainer = PPOTrainer(
                    cfg,
                    actor,
                    ActorOptim(optimizer),
                    Prompts(
                        train=PromptLoader(prompts, ROLLOUTS // per_prompt, 0, True),
                        val=None,
                        collate=make_prompt_collate(0),
                    ),
                    client,
                    RunOutputs(logger=MetricsLogger(work / "logs", tensorboard=False), progress=False),
                    server_overlap_threads=overlap_threads,
                )
                history = trainer.fit()
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)

    measured = history[1:]  # steps 2..N
    step_s = statistics.median(m["timing/step_s"] for m in measured)
    phases = sorted({k for m in measured for k in m if k.startswith("timing/") and k.endswith("_s")})
    split = {k.removeprefix("timing/"): statistics.median(m.get(k, 0.0) for m in measured) for k in phases}
    waiting = split.get("critic_wait_s", 0.0) + split.get("critic_train_wait_s", 0.0)
    shape = gpt2_shape(actor.model.config)
    seq = PROMPT_TOKENS + NEW_TOKENS
    update_flops = shape.train_flops_per_token(seq) * ROLLOUTS * seq
    return {
        "benchmark": "ppo_step",
        "estimator": estimator,
        "prompts_x_responses": f"{ROLLOUTS // per_prompt} x {per_prompt}",
        "steps_measured": len(measured),
        "median_step_s": round(step_s, 3),
        "min_step_s": round(min(m["timing/step_s"] for m in measured), 3),
        "tokens_per_s": round(ROLLOUTS * seq / step_s, 1),
        "phase_median_s": {k: round(v, 3) for k, v in split.items() if k not in ("step_s", "tokens_per_s")},
        "server_wait_share": round(waiting / step_s, 4),
        "actor_update_gflop": round(update_flops / 1e9, 2),
        "actor_update_gflop_per_s": round(update_flops / split["train_s"] / 1e9, 1),
        "all_step_s": [round(m["timing/step_s"], 3) for m in history],
        "threads": threads,
        "server_threads": server_threads,
        "rollout_micro_batch": rollout_micro_batch,
        "server_overlap_threads": overlap_threads,
    }


def run_peer(python: str, steps: int, threads: int) -> dict[str, Any]:
    """TRL's PPO step (``bench_trl_ppo.py``) in a child process of ``python``; its result dict."""
    script = Path(__file__).with_name("bench_trl_ppo.py")
    proc = subprocess.run(
        [python, str(script), "--steps", str(steps), "--threads", str(threads)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{script.name} failed (exit {proc.returncode}); TRL comes with the bench extra "
            f"(`make bench-setup`, or `--peer none` to skip it):\n{proc.stderr[-3000:]}"
        )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--server-threads", type=int, default=1)
    parser.add_argument("--rollout-micro-batch", type=int, default=64, help="responses per generation call")
    parser.add_argument(
        "--overlap-threads",
        type=int,
        default=None,
        help="actor threads while the server works (default: threads - server threads; 0: unchanged)",
    )
    parser.add_argument("--peer", choices=("trl", "none"), default="trl")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter with the bench extra")
    parser.add_argument("--rounds", type=int, default=1, help="openaligner then the peer, this many times")
    parser.add_argument(
        "--estimators",
        default="gae",
        help="comma-separated trainer.advantage_estimator values, run in this order each round",
    )
    ns = parser.parse_args()
    import transformers

    overlap_threads = (
        max(1, ns.threads - ns.server_threads) if ns.overlap_threads is None else ns.overlap_threads or None
    )

    # The update runs on overlap_threads cores while the critic trains: its peak is measured too.
    peak_threads = sorted({ns.threads, overlap_threads or ns.threads})
    peaks = {t: [matmul_peak_flop_per_s(t)] for t in peak_threads}
    estimators = ns.estimators.split(",")
    rounds = []
    for _ in range(ns.rounds):
        runs = {
            e: run_openaligner(
                ns.steps, ns.threads, ns.server_threads, ns.rollout_micro_batch, overlap_threads, e
            )
            for e in estimators
        }
        peer = run_peer(ns.peer_python, ns.steps, ns.threads) if ns.peer == "trl" else None
        rounds.append((runs, peer))
    for t in peak_threads:
        peaks[t].append(matmul_peak_flop_per_s(t))
    peak = {t: max(p) for t, p in peaks.items()}

    result: dict[str, Any] = {
        "benchmark": "ppo_step",
        "matmul_peak_gflop_per_s": {f"{t}_threads": round(p / 1e9, 1) for t, p in peak.items()},
        "matmul_peak_start_end_gflop_per_s": {
            f"{t}_threads": [round(x / 1e9, 1) for x in p] for t, p in peaks.items()
        },
        "rounds": [],
    }
    for runs, peer in rounds:
        for run in runs.values():
            achieved = run["actor_update_gflop_per_s"] * 1e9
            run["actor_update_peak_fraction"] = {
                f"of_{t}_thread_peak": round(achieved / p, 3) for t, p in peak.items()
            }
        entry: dict[str, Any] = {}
        ours = runs.get("gae")
        if ours is not None:
            entry["openaligner"] = ours
        critic_free = {e: r for e, r in runs.items() if e != "gae"}
        if critic_free:
            entry["critic_free"] = critic_free
            if ours is not None:
                entry["step_time_ratio_vs_ppo"] = {
                    e: round(r["median_step_s"] / ours["median_step_s"], 3) for e, r in critic_free.items()
                }
        if peer is not None and ours is not None:
            entry["trl"] = peer
            entry["step_time_ratio_vs_trl"] = round(ours["median_step_s"] / peer["median_step_s"], 3)
            entry["min_step_time_ratio_vs_trl"] = round(ours["min_step_s"] / peer["min_step_s"], 3)
        result["rounds"].append(entry)
    if ns.peer == "trl" and "gae" in estimators:
        # Load from other jobs drifts between the runs of a pair: the median over pairs is the figure.
        for key in ("step_time_ratio_vs_trl", "min_step_time_ratio_vs_trl"):
            result[f"median_{key}"] = round(statistics.median(e[key] for e in result["rounds"]), 3)
    result["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    result["versions"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "nvidia-pytriton": importlib.metadata.version("nvidia-pytriton"),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
