"""The demo's algorithms compared: PPO, GRPO, RLOO and REINFORCE against the learned reward model
and against the gold scorer, over several seeds, on each seed's one SFT and reward model.

For every seed, ``openaligner demo seed=<s> output_dir=<out>/seed<s> algorithm=<a> reward=<r>``
runs in a child process (``--quick`` adds ``quick=true``); the first run of a seed trains its SFT
and reward models, every later one reuses them (``reuse_models=true``), so the algorithms differ
only in their RL stage. A run whose report is already in its run directory is read, not run again
(``--fresh`` starts over), so the runs can be spread over several invocations.

Per run: the held-out gold score of the trained and the SFT policy (sampled and greedy, as in the
report), the KL to the SFT policy, the RL stage's wall time, the first step whose training
rollouts' gold score (``rollout/score``) reaches ``--target`` (null if none) and the curve of
``rollout/score`` per step, the median RL step time, and what else ran: the share of the
machine's CPU time spent on other processes during the run (``/proc/stat`` less this run's own
CPU time) and the 1-minute load average before and after (kept in ``bench{tag}.json`` beside the
report). Then per
algorithm and reward: mean, standard deviation, median, min and max over seeds. Writes the JSON
to ``--json`` (and prints it) and plots the mean gold score of the rollouts per step, one panel
per reward, to ``--plot``. Usage::

    python benchmarks/bench_demo_algorithms.py [--seeds 0,1,2] [--rewards model,gold] \\
        [--algorithms ppo,grpo,rloo,reinforce] [--out runs/bench_demo] \\
        [--json runs/bench_demo/results.json] [--plot docs/images/demo_algorithms.png]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from openaligner.cli.demo.presets import ALGORITHMS, REWARDS, Variant


def demo_args(
    run_dir: Path, seed: int, variant: Variant, quick: bool, models: bool, model_heads: int
) -> list[str]:
    """The ``openaligner demo`` arguments of one run; ``models``: the seed's SFT (and reward) models
    exist and are reused. ``model_heads`` 0 is the demo's default for the variant's engine."""
    return [
        f"seed={seed}",
        f"output_dir={run_dir}",
        f"algorithm={variant.algorithm}",
        f"reward={variant.reward}",
        f"reuse_models={str(models).lower()}",
        f"rollout_engine={variant.engine}",
        *([f"model_heads={model_heads}"] if model_heads else []),
        *([f"rollout_python={variant.engine_python}"] if variant.engine_python else []),
        *(["quick=true"] if quick else []),
    ]


def shared_model_heads(engines: list[str], model_heads: int) -> int:
    """The heads every run's models get: ``model_heads`` when given; else 2 when ``vllm`` is among
    ``engines`` (its CPU attention refuses the ``hf`` default's head size 16, and the runs of one
    seed share their models, so every engine's runs must use the same); else 0 (the default)."""
    if model_heads:
        return model_heads
    return 2 if "vllm" in engines else 0


def run_demo(
    out: Path, seed: int, variant: Variant, quick: bool, target: float, log: Path, model_heads: int = 0
) -> dict[str, Any]:
    """One demo run (or its report, when already there) → the per-run record (module doc)."""
    run_dir = out / f"seed{seed}"
    report_path = run_dir / f"report{variant.tag}.json"
    # what the report does not hold: the load around the run, and the demo's wall time
    conditions_path = run_dir / f"bench{variant.tag}.json"
    if not report_path.is_file():
        models = (run_dir / "sft" / "config.json").is_file() and (
            not variant.needs_reward_model or (run_dir / "rm" / "config.json").is_file()
        )
        args = demo_args(run_dir, seed, variant, quick, models, model_heads)
        load_before, t0 = os.getloadavg()[0], time.perf_counter()
        busy0, ours0 = _busy_cpu_s(), _children_cpu_s()
        with log.open("ab") as f:
            proc = subprocess.run([sys.executable, "-m", "openaligner", "demo", *args], stdout=f, stderr=f)
        wall_s = time.perf_counter() - t0
        other_s = max(0.0, (_busy_cpu_s() - busy0) - (_children_cpu_s() - ours0))
        # exit 1 only says the gold score did not rise: the run and its report are complete
        if proc.returncode not in (0, 1) or not report_path.is_file():
            raise RuntimeError(f"`openaligner demo {' '.join(args)}` failed ({proc.returncode}); see {log}")
        conditions = {
            "demo_s": round(wall_s, 1),
            # CPU time the machine spent on anything but this demo run, as a share of all cores
            "other_cpu_share": round(other_s / (wall_s * (os.cpu_count() or 1)), 3),
            "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "reused_models": models,
        }
        conditions_path.write_text(json.dumps(conditions))
        print(f"seed {seed} {variant.algorithm}/{variant.reward}: {conditions}", file=sys.stderr, flush=True)
    conditions = json.loads(conditions_path.read_text()) if conditions_path.is_file() else {}
    steps = [m["timing/step_s"] for m in _jsonl(run_dir / variant.rl_dir / "logs" / "metrics.jsonl")]
    median_step = {"rl_step_median_s": round(statistics.median(steps), 3)} if steps else {}
    return record(json.loads(report_path.read_text()), seed, variant, target) | median_step | conditions


def _busy_cpu_s() -> float:
    """Seconds of CPU the whole machine has spent busy (all cores, /proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children (a demo run and the servers it started)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )


def record(report: dict[str, Any], seed: int, variant: Variant, target: float) -> dict[str, Any]:
    sft, rl = report["eval"]["sft"], report["eval"]["ppo"]
    curve = {int(step): round(float(score), 2) for step, score in report["rollout_score"]}
    return {
        "algorithm": variant.algorithm,
        "reward": variant.reward,
        "engine": variant.engine,
        "seed": seed,
        "gold": round(rl["gold"], 2),
        "gold_greedy": round(rl["gold_greedy"], 2),
        "gold_sft": round(sft["gold"], 2),
        "gold_greedy_sft": round(sft["gold_greedy"], 2),
        "reward_score": round(rl["rm_score"], 3),
        "kl_to_sft": round(rl["kl_to_sft"], 3),
        "rl_stage_s": round(report["seconds"]["ppo"], 1),
        "steps_to_target": first_step_at(curve, target),
        "curve": curve,
    }


def first_step_at(curve: dict[int, float], target: float) -> int | None:
    """The first step whose rollout gold score is at least ``target``; None if none is."""
    return next((step for step, score in sorted(curve.items()) if score >= target), None)


def group_name(run: dict[str, Any]) -> str:
    """``algorithm/reward``, with ``/engine`` appended for an engine other than ``hf``."""
    engine = run.get("engine", "hf")
    return f"{run['algorithm']}/{run['reward']}" + ("" if engine == "hf" else f"/{engine}")


def summarise(runs: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per :func:`group_name`: mean, sd, median, min, max of each of ``keys`` over seeds, and the
    seeds' steps to the target (None where a seed never reached it)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(group_name(r), []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for name, rs in groups.items():
        entry: dict[str, Any] = {"seeds": [r["seed"] for r in rs]}
        for key in keys:
            xs = [float(r[key]) for r in rs]
            entry[key] = {
                "mean": round(statistics.fmean(xs), 3),
                "sd": round(statistics.stdev(xs), 3) if len(xs) > 1 else 0.0,
                "median": round(statistics.median(xs), 3),
                "min": round(min(xs), 3),
                "max": round(max(xs), 3),
            }
        entry["steps_to_target"] = [r["steps_to_target"] for r in rs]
        out[name] = entry
    return out


def plot(
    runs: list[dict[str, Any]],
    rewards: list[str],
    algorithms: list[str],
    target: float,
    path: Path,
    engines: tuple[str, ...] = ("hf",),
) -> None:
    """Mean over seeds of the rollouts' gold score per step, one line per algorithm (and engine, when
    several), one panel per reward; the band spans the seeds' min and max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rewards), figsize=(6 * len(rewards), 4), sharey=True, squeeze=False)
    for ax, reward in zip(axes[0], rewards, strict=True):
        for algorithm, engine in [(a, e) for a in algorithms for e in engines]:
            curves = [
                r["curve"]
                for r in runs
                if (r["algorithm"], r["reward"], r.get("engine", "hf")) == (algorithm, reward, engine)
            ]
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            values = [[c[s] for c in curves] for s in steps]
            label = algorithm if len(engines) == 1 else f"{algorithm} ({engine})"
            (line,) = ax.plot(steps, [statistics.fmean(v) for v in values], lw=1.6, label=label)
            ax.fill_between(
                steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(), alpha=0.15
            )
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        against = "the learned reward model" if reward == "model" else "the gold scorer (reward=gold)"
        ax.set_title(f"trained against {against}", fontsize=10)
        ax.set_xlabel("RL step (64 responses each)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0][0].set_ylabel(
        f"gold score of the step's rollouts (mean of {len({r['seed'] for r in runs})} seeds)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--rewards", default=",".join(REWARDS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--engines", default="hf", help="rollout engines, e.g. hf,vllm")
    parser.add_argument(
        "--model-heads", type=int, default=0, help="the models' attention heads (0: 2 with vllm, else 4)"
    )
    parser.add_argument("--rollout-python", default="", help="the vllm engine's interpreter")
    parser.add_argument("--quick", action="store_true", help="the demo's quick mode (CI size)")
    parser.add_argument(
        "--out", type=Path, default=Path("runs/bench_demo"), help="one run directory per seed"
    )
    parser.add_argument(
        "--fresh", action="store_true", help="delete --out first instead of reading its reports"
    )
    parser.add_argument("--target", type=float, default=80.0, help="gold score whose first step is reported")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot here (e.g. docs/images/...)")
    ns = parser.parse_args()
    algorithms = ns.algorithms.split(",")
    rewards = ns.rewards.split(",")
    seeds = [int(s) for s in ns.seeds.split(",")]
    engines = ns.engines.split(",")
    model_heads = shared_model_heads(engines, ns.model_heads)
    if ns.fresh and ns.out.exists():
        shutil.rmtree(ns.out)
    ns.out.mkdir(parents=True, exist_ok=True)
    log = ns.out / "bench.log"

    runs = []
    for reward in rewards:
        for seed in seeds:
            for algorithm in algorithms:
                for engine in engines:
                    variant = Variant(
                        algorithm, reward, engine, ns.rollout_python if engine == "vllm" else ""
                    )
                    runs.append(run_demo(ns.out, seed, variant, ns.quick, ns.target, log, model_heads))

    import torch
    import transformers

    keys = ("gold", "gold_greedy", "gold_sft", "kl_to_sft", "reward_score", "rl_stage_s", "rl_step_median_s")
    result: dict[str, Any] = {
        "benchmark": "demo_algorithms",
        "command": " ".join(["python", *sys.argv]),
        "mode": "quick" if ns.quick else "full",
        "model_heads": model_heads,
        "target_gold": ns.target,
        "summary": summarise(runs, keys),
        "runs": runs,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "nvidia-pytriton": importlib.metadata.version("nvidia-pytriton"),
        },
    }
    text = json.dumps(result, indent=1)
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(text)
    if ns.plot is not None:
        plot(runs, rewards, algorithms, ns.target, ns.plot, tuple(engines))
    print(text)


if __name__ == "__main__":
    main()
