"""Both rollout engines on the real model, side by side: the walkthrough's GRPO LoRA command.

Reads section 4 of docs/real-model.md — its ``serve-reward`` and GRPO ``train-ppo`` commands, as a
reader would run them — starts the reward server once, then runs the ``train-ppo`` command once per
engine (``hf`` first), each with ``actor.path=MODEL`` and only these settings added:
``trainer.max_steps=N``, validation and checkpoints past the run (``=100``), its own
``exp.output_dir`` and ``rollout.engine=ENGINE`` (and ``rollout.vllm.python`` when given). The
prompts are section 2's (``prompt_records(0, 512, False)`` and ``(0, 128, True)`` of 2–3 words),
written into ``--out``. Prints, per engine, the medians over the run's steps of each ``timing/*``
metric in its metrics.jsonl, the run's wall time (start included) and the peak RSS of its largest
process (the trainer's, or the engine's where that is larger: ``ru_maxrss`` of the waited
children), as a Markdown table, and writes them to ``--out``/engines.json.

    python benchmarks/bench_real_engines.py --model ~/.cache/openaligner/gemma-3-270m --steps 5 \\
        --rollout-python .venv-rollout/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_real_model import Server, _openaligner, write_data

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "real-model.md"
ENGINE_ADDED = ("trainer.max_steps", "trainer.val_check_interval", "trainer.save_interval")
COLUMNS = (  # (metrics key, column title)
    ("timing/step_s", "step"),
    ("timing/generate_s", "generate (push included for vllm)"),
    ("timing/logprobs_s", "rollout log-probs"),
    ("timing/init_logprobs_s", "initial-policy log-probs"),
    ("timing/train_s", "update"),
    ("timing/weight_sync_s", "weight push"),
)


def section_four_commands(text: str) -> tuple[list[str], list[str]]:
    """The argv of section 4's ``openaligner serve-reward`` and first ``openaligner train-ppo``
    commands (line continuations joined, shell redirections and ``&`` dropped).

    Raises:
        ValueError: the section or either command is missing (the docs moved: update this).
    """
    start = text.find("## 4. ")
    if start < 0:
        raise ValueError("docs/real-model.md has no section '## 4. '")
    body = text[start : text.find("\n## ", start + 1)]
    joined = re.sub(r"\\\n\s*", " ", body)
    found: dict[str, list[str]] = {}
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        for name in ("serve-reward", "train-ppo"):
            if line.startswith(f"openaligner {name} ") and name not in found:
                argv = shlex.split(line)
                found[name] = _without_redirections(argv)
    missing = [n for n in ("serve-reward", "train-ppo") if n not in found]
    if missing:
        raise ValueError(f"section 4 of docs/real-model.md has no {' or '.join(missing)} command")
    return found["serve-reward"], found["train-ppo"]


def _without_redirections(argv: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in (">", ">>", "2>", "<"):
            skip = True
        elif a in ("&", "2>&1") or a.startswith((">", "2>")):
            continue
        else:
            out.append(a)
    return out


def with_settings(argv: list[str], settings: dict[str, str]) -> list[str]:
    """``argv`` with each ``key=value`` of ``settings`` replacing the argument of that key (or
    appended when it has none); ``$SFT`` and other shell words stay only where not replaced."""
    out, seen = [], set()
    for a in argv:
        key = a.split("=", 1)[0]
        if "=" in a and key in settings:
            out.append(f"{key}={settings[key]}")
            seen.add(key)
        else:
            out.append(a)
    return out + [f"{k}={v}" for k, v in settings.items() if k not in seen]


def engine_settings(
    engine: str, model: Path, data: dict[str, Path], out: Path, port: int, steps: int, python: str
) -> dict[str, str]:
    """What one engine's run changes of section 4's train-ppo command (nothing else)."""
    s = {
        "actor.path": str(model),
        "data.train_path": str(data["train"]),
        "data.val_path": str(data["heldout"]),
        "remote.reward_model.port": str(port),
        "trainer.max_steps": str(steps),
        "trainer.val_check_interval": "100",
        "trainer.save_interval": "100",
        "exp.output_dir": str(out / engine),
        "rollout.engine": engine,
    }
    if engine == "vllm" and python:
        s["rollout.vllm.python"] = python
    return s


def summarise(metrics: Path) -> dict[str, float]:
    """Median over the run's step rows of each :data:`COLUMNS` key present (seconds); the step
    count as ``steps``; ``weight_push_min``/``_max`` where there were pushes."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing/step_s" in r]
    out: dict[str, float] = {"steps": float(len(steps))}
    for key, _ in COLUMNS:
        vals = [float(r[key]) for r in steps if key in r]
        if vals:
            out[key] = statistics.median(vals)
            if key == "timing/weight_sync_s":
                out["weight_push_min"], out["weight_push_max"] = min(vals), max(vals)
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    """The Markdown table of :func:`summarise`'s medians, wall time and peak RSS per engine."""
    head = ["engine", *[t for _, t in COLUMNS], "wall (incl. start)", "peak RSS (largest process)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for engine, r in results.items():
        cells = [f"`{engine}`"]
        for key, _ in COLUMNS:
            cells.append(f"{r[key]:.1f} s" if key in r else "—")
        cells += [f"{r['wall_s']:.0f} s", f"{r['peak_rss_gib']:.1f} GiB"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_child(cmd: list[str], log: Path) -> tuple[int, float, float]:
    """Run ``cmd`` in a child of its own (so that its ``ru_maxrss`` is this run's alone); return
    its exit code, wall seconds and peak RSS in GiB of its largest waited process."""
    probe = (
        "import json, resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "with open(sys.argv[1], 'w') as f:\n"
        "    rc = subprocess.call(sys.argv[2:], stdout=f, stderr=subprocess.STDOUT)\n"
        "print(json.dumps([rc, time.perf_counter() - t,"
        " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(log), *cmd], capture_output=True, text=True, check=True
    )
    rc, wall, maxrss_kib = json.loads(done.stdout.strip().splitlines()[-1])
    return int(rc), float(wall), maxrss_kib / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the converted model (make real-model)")
    parser.add_argument("--out", type=Path, default=Path("runs/engines"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument(
        "--rollout-python", default="", help="the vllm engine's interpreter (rollout.vllm.python)"
    )
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.model = args.model.expanduser().resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)  # the docs' commands name their paths from the repository's root
    serve, train = section_four_commands(DOC.read_text())
    write_data(args.out, 0, 128)  # section 2's train and held-out prompts (and the unseen words')
    data = {"train": args.out / "train.jsonl", "heldout": args.out / "heldout.jsonl"}
    # port 0: the server picks a free one and names it in its ready line
    server = Server(
        _openaligner(*with_settings(serve, {"server.port": "0"})[1:]), args.out / "serve_reward.log"
    )
    results: dict[str, dict[str, Any]] = {}
    try:
        port = server.port(timeout_s=300)
        for engine in args.engines.split(","):
            run_dir = args.out / engine
            if run_dir.exists():
                raise SystemExit(f"{run_dir} exists: remove it for a fresh run")
            settings = engine_settings(
                engine, args.model, data, args.out, port, args.steps, args.rollout_python
            )
            cmd = _openaligner(*with_settings(train, settings)[1:])
            print(f"{engine}: {shlex.join(cmd)}", flush=True)
            rc, wall, rss = run_child(cmd, args.out / f"{engine}.log")
            if rc != 0:
                raise SystemExit(f"{engine}: train-ppo exited {rc}; see {args.out / (engine + '.log')}")
            results[engine] = {
                **summarise(run_dir / "logs" / "metrics.jsonl"),
                "wall_s": wall,
                "peak_rss_gib": rss,
                "command": cmd,
            }
    finally:
        server.stop()
    results_meta = {"engines": results, "load_average": os.getloadavg(), "steps": args.steps}
    (args.out / "engines.json").write_text(json.dumps(results_meta, indent=1))
    print(table(results))
    if "hf" in results and "vllm" in results:
        print(f"vllm / hf step: {results['vllm']['timing/step_s'] / results['hf']['timing/step_s']:.2f}x")


if __name__ == "__main__":
    main()
