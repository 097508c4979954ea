"""What the demo shows: stage banners and times, the PPO curves, ``report.md`` / ``report.json`` and
the console summary.

Owns the report's layout and wording. Knows the metric names the trainers log and the run
directory's layout; computes no metric itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from openaligner.io.metrics import PhaseTimer, read_jsonl

Evaluation = dict[str, dict[str, float]]
"""``{"sft": metrics, "ppo": metrics}`` (see :func:`openaligner.cli.demo.evaluate.evaluate`)."""

_STAGES = 6


class StageTimes(PhaseTimer):
    """Wall-clock seconds per stage (``with times("sft"): ...``), in the order the stages ran."""

    def stop(self) -> None:
        """Record ``total``: the seconds since this object was made."""
        self.seconds["total"] = time.perf_counter() - self.start


def banner(console: Console, n: int, text: str) -> None:
    console.rule(f"[bold cyan]stage {n}/{_STAGES}[/]  {text}")


def last_metrics(path: Path, prefix: str) -> dict[str, float]:
    """The ``prefix``-ed metrics of the last record of the JSONL metrics file ``path`` that has
    any (empty when there is none, or no file)."""
    rows = [r for r in _records(path) if any(k.startswith(prefix) for k in r)]
    return {k: v for k, v in rows[-1].items() if k.startswith(prefix)} if rows else {}


def plot_ppo_curves(metrics_path: Path, path: Path) -> Path | None:
    """Plot gold score, reward, KL and length per PPO step from ``metrics_path`` into ``path``;
    ``None`` (no file written) when there are no metrics."""
    metrics = _records(metrics_path)
    if not metrics:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("rollout/score", "gold score of rollouts (0–100)"),
        ("rollout/rewards", "learned reward-model score"),
        ("rollout/init_policy_kl", "KL to the SFT policy (per token)"),
        ("rollout/generation_length", "response length (tokens)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, title) in zip(axes, panels, strict=True):
        pts = [(m["step"], m[key]) for m in metrics if m.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), lw=1.5)
        val_key = key.replace("rollout/", "val/")
        vpts = [(m["step"], m[val_key]) for m in metrics if m.get(val_key) is not None]
        if vpts:
            ax.plot(*zip(*vpts, strict=True), "o--", lw=1, label="validation")
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(
    run_dir: Path,
    report: Evaluation,
    rm_metrics: dict[str, float],
    seconds: dict[str, float],
    plot: Path | None,
    heading: str,
) -> None:
    """Write ``report.md`` (``heading`` under the title, the tables, the plot, the commands to
    re-run each stage) and ``report.json`` (``eval``, ``rm``, ``seconds``) into ``run_dir``."""
    sft, ppo = report["sft"], report["ppo"]
    rows = [
        ("gold score, sampled (0–100)", "gold"),
        ("gold score, greedy", "gold_greedy"),
        ("reward-model score", "rm_score"),
        ("KL to the SFT policy (nats / response)", "kl_to_sft"),
        ("response length (tokens)", "response_tokens"),
        ("properly ended", "properly_ended"),
    ]
    lines = [
        "# openaligner demo report",
        "",
        heading,
        "",
        "| metric | SFT policy | PPO policy |",
        "|---|---|---|",
        *[f"| {label} | {sft[k]:.3f} | {ppo[k]:.3f} |" for label, k in rows],
        "",
        f"Gold-score gain: **{gold_gain(report):+.1f} points** (sampled).",
        "",
        "Reward model on held-out pairs: "
        + ", ".join(f"{k.removeprefix('val/')} {v:.3f}" for k, v in rm_metrics.items()),
        "",
        "| stage | seconds |",
        "|---|---|",
        *[f"| {k} | {v:.1f} |" for k, v in seconds.items()],
        "",
    ]
    if plot is not None:
        lines += [f"![PPO curves]({plot.name})", ""]
    lines += [
        "## Re-run any stage on its own",
        "",
        "```bash",
        f"openaligner train-sft {run_dir / 'configs' / 'sft.yaml'}",
        f"openaligner train-rm {run_dir / 'configs' / 'rm.yaml'}",
        f"openaligner serve-reward {run_dir / 'configs' / 'serve_reward.yaml'} &",
        f"openaligner serve-critic {run_dir / 'configs' / 'serve_critic.yaml'} &",
        f"openaligner train-ppo {run_dir / 'configs' / 'ppo.yaml'}",
        "```",
        "",
    ]
    (run_dir / "report.md").write_text("\n".join(lines))
    (run_dir / "report.json").write_text(
        json.dumps({"eval": report, "rm": rm_metrics, "seconds": seconds}, indent=1)
    )


def print_summary(console: Console, report: Evaluation, seconds: dict[str, float], run_dir: Path) -> None:
    """The SFT-vs-PPO table, the gold-score gain and where the report is."""
    table = Table(title="openaligner demo: SFT policy vs PPO policy on held-out prompts")
    table.add_column("metric")
    table.add_column("SFT", justify="right")
    table.add_column("PPO", justify="right")
    for label, key in [
        ("gold score (0–100)", "gold"),
        ("gold score, greedy", "gold_greedy"),
        ("reward-model score", "rm_score"),
        ("KL to SFT (nats)", "kl_to_sft"),
        ("response tokens", "response_tokens"),
    ]:
        table.add_row(label, f"{report['sft'][key]:.2f}", f"{report['ppo'][key]:.2f}")
    console.print(table)
    gain = gold_gain(report)
    color = "green" if gain > 0 else "red"
    console.print(
        f"gold-score gain [bold {color}]{gain:+.1f}[/] points; total {seconds.get('total', 0):.0f} s"
    )
    console.print(f"report: {run_dir / 'report.md'}")


def gold_gain(report: Evaluation) -> float:
    """The PPO policy's sampled gold score minus the SFT policy's, in points."""
    return report["ppo"]["gold"] - report["sft"]["gold"]


def _records(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path) if path.is_file() else []
