"""``openaligner demo``: the whole RLHF pipeline on the built-in sorting task, end to end.

Stages: (1) data and tokenizer → (2) SFT → (3) reward model on gold-labelled noisy preferences
→ (4) reward model and critic served by separate processes on free loopback ports → (5) PPO
against the *learned* reward model → (6) evaluation against the gold scorer and a report with
plots. Every stage runs the same command a user would (``train-sft``, ``train-rm``,
``serve-reward``, ``serve-critic``, ``train-ppo``) from a YAML file written into the run
directory, so each can be re-run on its own. Servers are stopped on exit, Ctrl-C included.

This module is the recipe; its parts live beside it: ``presets`` (sizes and each command's
settings), ``stages`` (data, YAML, running a command), ``processes`` (the servers), ``evaluate``
and ``report``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from openaligner.cli.demo.evaluate import evaluate
from openaligner.cli.demo.presets import (
    PRESETS,
    ROLLOUTS_PER_STEP,
    ppo_overrides,
    rm_overrides,
    serve_critic_overrides,
    serve_reward_overrides,
    sft_overrides,
)
from openaligner.cli.demo.processes import ServerProcesses, sigterm_as_keyboard_interrupt
from openaligner.cli.demo.report import (
    StageTimes,
    banner,
    gold_gain,
    last_metrics,
    plot_ppo_curves,
    print_summary,
    write_report,
)
from openaligner.cli.demo.stages import make_data, run_command, write_config
from openaligner.servers.transport.triton import free_loopback_port


@dataclass
class DemoConfig:
    seed: int = 0  # seeds data, models, sampling and training
    quick: bool = False  # the CI-sized run (about 2 minutes); else the full run (under 10 minutes)
    output_dir: str = "runs/demo"  # run directory: data, configs, models, logs, plots, report.md
    host: str = "127.0.0.1"  # where the servers listen (loopback; their ports are free loopback ports)
    sft_steps: int = 0  # SFT optimizer steps; 0 = the preset of the mode
    rm_steps: int = 0  # reward-model optimizer steps; 0 = the preset of the mode
    ppo_steps: int = 0  # PPO steps; 0 = the preset of the mode
    eval_samples: int = 256  # held-out prompts scored by the gold scorer before and after PPO
    server_start_timeout_s: float = 180.0  # how long to wait for each server to become ready

    def __post_init__(self) -> None:
        if min(self.sft_steps, self.rm_steps, self.ppo_steps) < 0 or self.eval_samples < 8:
            raise ValueError("step counts must be >= 0 (0 = preset) and eval_samples >= 8")


SCHEMA = DemoConfig


def run(cfg: DemoConfig) -> int:
    """Run the six stages; 0 if PPO raised the held-out gold score, 1 if not, 130 if interrupted."""
    console = Console()
    preset = PRESETS["quick" if cfg.quick else "full"]
    sft_steps = cfg.sft_steps or preset.sft_steps
    rm_steps = cfg.rm_steps or preset.rm_steps
    ppo_steps = cfg.ppo_steps or preset.ppo_steps
    run_dir = Path(cfg.output_dir).resolve()
    configs, logs = run_dir / "configs", run_dir / "logs"
    for d in (configs, logs):
        d.mkdir(parents=True, exist_ok=True)
    times = StageTimes()
    servers = ServerProcesses(cfg.host, cfg.server_start_timeout_s)
    with sigterm_as_keyboard_interrupt():
        try:
            banner(console, 1, "data: the sorting task, its tokenizer and four data sets")
            with times("data"):
                example, answer = make_data(run_dir, cfg.seed, preset)
            console.print(f"  prompts like [bold]{example}[/] → gold answer [bold]{answer}[/]")

            banner(console, 2, f"SFT: a tiny GPT-2 imitates mixed demonstrations ({sft_steps} steps)")
            sft_yaml = write_config(
                configs / "sft.yaml", "train-sft", sft_overrides(run_dir, cfg.seed, sft_steps)
            )
            with times("sft"):
                run_command("train-sft", sft_yaml)

            banner(
                console,
                3,
                f"reward model: Bradley–Terry on gold-labelled pairs with 10% label noise ({rm_steps} steps)",
            )
            rm_yaml = write_config(configs / "rm.yaml", "train-rm", rm_overrides(run_dir, cfg.seed, rm_steps))
            with times("reward_model"):
                run_command("train-rm", rm_yaml)
            rm_metrics = last_metrics(run_dir / "rm" / "metrics.jsonl", "val/")

            banner(console, 4, "serving: reward model and critic in their own processes")
            rm_port, critic_port = free_loopback_port(), free_loopback_port()
            reward_yaml = write_config(
                configs / "serve_reward.yaml",
                "serve-reward",
                serve_reward_overrides(run_dir, cfg.host, rm_port),
            )
            critic_yaml = write_config(
                configs / "serve_critic.yaml",
                "serve-critic",
                serve_critic_overrides(run_dir, cfg.host, critic_port),
            )
            with times("server_start"):
                servers.start("serve-reward", reward_yaml, rm_port, "reward_model", logs / "serve_reward.log")
                servers.start(
                    "serve-critic", critic_yaml, critic_port, "critic_infer", logs / "serve_critic.log"
                )
                servers.wait_ready()
            console.print(
                f"  reward model  http://{cfg.host}:{rm_port}   critic  http://{cfg.host}:{critic_port}"
            )

            banner(
                console,
                5,
                f"PPO against the learned reward model ({ppo_steps} steps × {ROLLOUTS_PER_STEP} rollouts)",
            )
            ppo_yaml = write_config(
                configs / "ppo.yaml",
                "train-ppo",
                ppo_overrides(run_dir, cfg.seed, ppo_steps, cfg.host, critic_port, rm_port),
            )
            with times("ppo"):
                run_command("train-ppo", ppo_yaml)

            banner(console, 6, "evaluation against the gold scorer")
            with times("evaluation"):
                report = evaluate(run_dir, cfg.seed, cfg.eval_samples, cfg.host, rm_port)
            times.stop()
        except KeyboardInterrupt:
            console.print("[bold red]interrupted[/]: stopping the servers")
            return 130
        finally:
            servers.stop()

    plot = plot_ppo_curves(run_dir / "ppo" / "logs" / "metrics.jsonl", run_dir / "ppo_curves.png")
    heading = (
        f"Seed {cfg.seed}, {'quick' if cfg.quick else 'full'} mode, {cfg.eval_samples} held-out prompts."
    )
    write_report(run_dir, report, rm_metrics, times.seconds, plot, heading)
    print_summary(console, report, times.seconds, run_dir)
    return 0 if gold_gain(report) > 0 else 1
