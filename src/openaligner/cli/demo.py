"""``openaligner demo``: the built-in end-to-end run.

Today it trains the toy sequence task with the PPO math core (KL-shaped rewards, GAE,
whitening, clipped policy and value losses) and reports the score before and after.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table


@dataclass
class DemoConfig:
    seed: int = 0  # random seed of the run
    steps: int = 30  # PPO steps
    quick: bool = False  # fewer steps, for CI


SCHEMA = DemoConfig


def run(cfg: DemoConfig) -> int:
    from openaligner.tasks.toy_sequence import run_toy_ppo

    console = Console()
    steps = min(cfg.steps, 10) if cfg.quick else cfg.steps
    console.rule("[bold]openaligner demo: PPO math core on the toy sequence task")
    history = run_toy_ppo(steps=steps, seed=cfg.seed)
    table = Table("step", "score (share of target token)", "KL to initial policy", "value loss", "clip frac")
    for m in history:
        table.add_row(
            str(m.step), f"{m.score:.3f}", f"{m.kl:.3f}", f"{m.value_loss:.4f}", f"{m.clip_fraction:.3f}"
        )
    console.print(table)
    first, last = history[0].score, history[-1].score
    console.print(f"score {first:.3f} → {last:.3f} over {steps} PPO steps")
    return 0 if last > first else 1
