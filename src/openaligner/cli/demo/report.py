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

from openaligner.cli.demo.presets import ALGORITHMS, Variant
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


def reward_label(variant: Variant) -> str:
    """What the reward server's score is: the learned reward model's, or the gold function's."""
    return "reward-model score" if variant.reward == "model" else "gold function reward (0–1)"


def plot_ppo_curves(metrics_path: Path, path: Path, variant: Variant) -> Path | None:
    """Plot gold score, reward, KL and length per RL step from ``metrics_path`` into ``path``;
    ``None`` (no file written) when there are no metrics."""
    metrics = _records(metrics_path)
    if not metrics:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("rollout/score", "gold score of rollouts (0–100)"),
        ("rollout/rewards", reward_label(variant)),
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
        ax.set_xlabel(f"{variant.algorithm.upper()} step")
        ax.grid(alpha=0.3)
    fig.suptitle(variant.title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(
    run_dir: Path,
    variant: Variant,
    report: Evaluation,
    rm_metrics: dict[str, float],
    seconds: dict[str, float],
    plot: Path | None,
    heading: str,
    metrics_path: Path,
) -> None:
    """Write ``report{tag}.md`` (``heading`` under the title, the tables, the plot, the commands to
    re-run each stage) and ``report{tag}.json`` (``algorithm``, ``reward``, ``rollout_engine``,
    ``eval``, ``rm``, ``seconds`` and ``rollout_score``: ``[step, gold score of the step's
    rollouts]`` per RL step from ``metrics_path``) into ``run_dir`` (``tag``: :attr:`Variant.tag`)."""
    sft, rl = report["sft"], report["ppo"]
    name = variant.algorithm.upper()
    rows = [
        ("gold score, sampled (0–100)", "gold"),
        ("gold score, greedy", "gold_greedy"),
        (reward_label(variant), "rm_score"),
        ("KL to the SFT policy (nats / response)", "kl_to_sft"),
        ("response length (tokens)", "response_tokens"),
        ("properly ended", "properly_ended"),
    ]
    if rm_metrics:
        rm_line = "Reward model on held-out pairs: " + ", ".join(
            f"{k.removeprefix('val/')} {v:.3f}" for k, v in rm_metrics.items()
        )
    else:
        rm_line = "No reward model: the gold scorer gave the rewards."
    if variant.reward == "gold":
        rm_line += " The reward score above is the served gold function's, not a learned model's."
    tag = variant.tag
    configs = run_dir / "configs"
    servers = [f"openaligner serve-reward {configs / f'serve_reward{tag}.yaml'} &"]
    if variant.uses_critic:
        servers.append(f"openaligner serve-critic {configs / f'serve_critic{tag}.yaml'} &")
    trainers = [f"openaligner train-sft {configs / 'sft.yaml'}"]
    if variant.needs_reward_model:
        trainers.append(f"openaligner train-rm {configs / 'rm.yaml'}")
    lines = [
        "# openaligner demo report",
        "",
        f"Algorithm: **{variant.algorithm}** (trainer.advantage_estimator={ALGORITHMS[variant.algorithm]}); "
        f"reward: **{variant.reward}** ({_reward_words(variant)}).",
        "",
        heading,
        "",
        f"| metric | SFT policy | {name} policy |",
        "|---|---|---|",
        *[f"| {label} | {sft[k]:.3f} | {rl[k]:.3f} |" for label, k in rows],
        "",
        f"Gold-score gain: **{gold_gain(report):+.1f} points** (sampled).",
        "",
        rm_line,
        "",
        "| stage | seconds |",
        "|---|---|",
        *[f"| {k} | {v:.1f} |" for k, v in seconds.items()],
        "",
    ]
    if plot is not None:
        lines += [f"![{name} curves]({plot.name})", ""]
    lines += [
        "## Re-run any stage on its own",
        "",
        "```bash",
        *trainers,
        *servers,
        f"openaligner train-ppo {configs / f'ppo{tag}.yaml'}",
        "```",
        "",
    ]
    (run_dir / f"report{tag}.md").write_text("\n".join(lines))
    curve = [
        [m["step"], m["rollout/score"]] for m in _records(metrics_path) if m.get("rollout/score") is not None
    ]
    (run_dir / f"report{tag}.json").write_text(
        json.dumps(
            {
                "algorithm": variant.algorithm,
                "reward": variant.reward,
                "rollout_engine": variant.engine,
                "eval": report,
                "rm": rm_metrics,
                "seconds": seconds,
                "rollout_score": curve,
            },
            indent=1,
        )
    )


def print_summary(
    console: Console, variant: Variant, report: Evaluation, seconds: dict[str, float], run_dir: Path
) -> None:
    """The SFT-vs-RL table, the gold-score gain and where the report is."""
    name = variant.algorithm.upper()
    table = Table(title=f"openaligner demo: SFT policy vs {variant.title}, on held-out prompts")
    table.add_column("metric")
    table.add_column("SFT", justify="right")
    table.add_column(name, justify="right")
    for label, key in [
        ("gold score (0–100)", "gold"),
        ("gold score, greedy", "gold_greedy"),
        (reward_label(variant), "rm_score"),
        ("KL to SFT (nats)", "kl_to_sft"),
        ("response tokens", "response_tokens"),
    ]:
        table.add_row(label, f"{report['sft'][key]:.2f}", f"{report['ppo'][key]:.2f}")
    console.print(table)
    gain = gold_gain(report)
    color = "green" if gain > 0 else "red"
    console.print(
        f"algorithm {variant.algorithm}, reward {variant.reward}, rollout engine {variant.engine}: "
        f"gold-score gain [bold {color}]{gain:+.1f}[/] points; total {seconds.get('total', 0):.0f} s"
    )
    console.print(f"report: {run_dir / f'report{variant.tag}.md'}")


def gold_gain(report: Evaluation) -> float:
    """The trained (RL) policy's sampled gold score minus the SFT policy's, in points."""
    return report["ppo"]["gold"] - report["sft"]["gold"]


def _reward_words(variant: Variant) -> str:
    if variant.reward == "model":
        return "the Bradley–Terry reward model learned from noisy preferences"
    return "the gold scorer itself, served as a reward function"


def _records(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path) if path.is_file() else []
