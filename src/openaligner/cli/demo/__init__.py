"""``openaligner demo``: the whole RLHF pipeline on the built-in sorting task, end to end.

Owns the recipe: data → SFT → reward model → served reward model and critic → PPO (or a
critic-free estimator) → evaluation and report, each stage the command a user would run, from a
YAML file in the run directory. Its parts live beside it: ``presets``, ``stages``, ``processes``,
``evaluate`` and ``report``. Must not know how any command trains or serves.
Design notes: docs/demo.md, "Module notes".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from openaligner.cli.demo.evaluate import evaluate
from openaligner.cli.demo.presets import (
    ALGORITHMS,
    ENGINES,
    PRESETS,
    REWARDS,
    ROLLOUTS_PER_STEP,
    TINY_HEADS,
    Variant,
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
from openaligner.cli.demo.stages import make_data, reuse_problem, run_command, write_config


@dataclass
class DemoConfig:
    seed: int = 0  # seeds data, models, sampling and training
    quick: bool = False  # the CI-sized run (about 2 minutes); else the full run (under 10 minutes)
    output_dir: str = "runs/demo"  # run directory: data, configs, models, logs, plots, report.md
    host: str = "127.0.0.1"  # where the servers listen (loopback; their ports are free loopback ports)
    algorithm: str = "ppo"  # ppo (with a served critic) | grpo | rloo | reinforce (critic-free, 4 per prompt)
    reward: str = "model"  # model (the learned reward model) | gold (the gold scorer as a reward function)
    reuse_models: bool = False  # skip SFT/RM training: reuse this seed's models in output_dir (else refuse)
    # hf (the project's sampling loop) | vllm (train-ppo's rollout.engine=vllm: `make rollout-setup`)
    rollout_engine: str = "hf"
    rollout_python: str = ""  # the vllm engine's interpreter (rollout.vllm.python); "" = train-ppo's default
    # attention heads of the tiny models (hidden size 64); 0 = 4 with hf, 2 with vllm, whose CPU
    # attention refuses head size 16. model_heads=2 with hf trains the models the vllm run uses.
    model_heads: int = 0
    sft_steps: int = 0  # SFT optimizer steps; 0 = the preset of the mode
    rm_steps: int = 0  # reward-model optimizer steps; 0 = the preset of the mode
    ppo_steps: int = 0  # RL (PPO or critic-free) steps; 0 = the preset of the mode
    rl_lr: float = 0.0  # the policy's learning rate in the RL stage; 0 = the preset of the mode
    eval_samples: int = 256  # held-out prompts scored by the gold scorer before and after PPO
    server_start_timeout_s: float = 180.0  # how long to wait for each server to become ready

    def __post_init__(self) -> None:
        if min(self.sft_steps, self.rm_steps, self.ppo_steps) < 0 or self.eval_samples < 8:
            raise ValueError("step counts must be >= 0 (0 = preset) and eval_samples >= 8")
        if not self.rl_lr >= 0:  # also refuses NaN
            raise ValueError(f"rl_lr must be >= 0 (0 = the preset of the mode), got {self.rl_lr}")
        self.algorithm = self.algorithm.strip().lower()
        self.reward = self.reward.strip().lower()
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {', '.join(REWARDS)}, got {self.reward!r}")
        self.rollout_engine = self.rollout_engine.strip().lower()
        if self.rollout_engine not in ENGINES:
            raise ValueError(
                f"rollout_engine must be one of {', '.join(ENGINES)}, got {self.rollout_engine!r}"
            )
        if self.model_heads not in (0, 1, 2, 4):  # divisors of the hidden size 64 with a head size ≥ 16
            raise ValueError(
                f"model_heads must be 0 (the engine's default), 1, 2 or 4, got {self.model_heads}"
            )
        if self.rollout_engine == "vllm" and self.model_heads == 4:
            raise ValueError(
                "model_heads=4 is head size 16, which vLLM's CPU attention refuses: with rollout_engine=vllm "
                "use model_heads=2 (or 0, its default)"
            )

    @property
    def variant(self) -> Variant:
        return Variant(self.algorithm, self.reward, self.rollout_engine, self.rollout_python)

    @property
    def heads(self) -> int:
        """Attention heads of the tiny models: ``model_heads``, or the engine's default."""
        return self.model_heads or TINY_HEADS[self.rollout_engine]


SCHEMA = DemoConfig


def _engine_problem(python: str) -> str | None:
    """Why the vllm engine could not start with interpreter ``python`` ("" = train-ppo's default);
    None when the interpreter is there (whether it imports vllm is found out when it starts)."""
    from openaligner.rollout.engine import EngineSetupError
    from openaligner.rollout.vllm_config import VLLMConfig
    from openaligner.rollout.vllm_link import resolve_python

    try:
        resolve_python(python or VLLMConfig().python)
    except EngineSetupError as e:
        return str(e)
    return None


def run(cfg: DemoConfig) -> int:
    """Run the six stages; 0 if RL raised the held-out gold score, 1 if not, 2 if ``reuse_models``
    found no models to reuse or the vllm engine has no interpreter, 130 if interrupted."""
    console = Console()
    preset = PRESETS["quick" if cfg.quick else "full"]
    variant = cfg.variant
    sft_steps = cfg.sft_steps or preset.sft_steps
    rm_steps = cfg.rm_steps or preset.rm_steps
    preset_steps, preset_lr = preset.rl_stage(variant.uses_critic)
    ppo_steps = cfg.ppo_steps or preset_steps
    rl_lr = cfg.rl_lr or preset_lr
    run_dir = Path(cfg.output_dir).resolve()
    configs, logs = run_dir / "configs", run_dir / "logs"
    if variant.engine == "vllm":  # refuse now, not after minutes of SFT and reward-model training
        problem = _engine_problem(variant.engine_python)
        if problem is not None:
            console.print(f"[bold red]rollout_engine=vllm[/]: {problem}")
            return 2
    sft_args = sft_overrides(run_dir, cfg.seed, sft_steps, cfg.heads)
    rm_args = rm_overrides(run_dir, cfg.seed, rm_steps)
    if cfg.reuse_models:
        problem = reuse_problem(run_dir / "sft", configs / "sft.yaml", "train-sft", sft_args)
        if problem is None and variant.needs_reward_model:
            problem = reuse_problem(run_dir / "rm", configs / "rm.yaml", "train-rm", rm_args)
        if problem is not None:
            console.print(
                f"[bold red]reuse_models=true[/]: {problem}. Run the demo once with the same seed, mode and "
                f"step counts in output_dir={cfg.output_dir} (reuse_models=false) to train them."
            )
            return 2
    for d in (configs, logs):
        d.mkdir(parents=True, exist_ok=True)
    times = StageTimes()
    servers = ServerProcesses(cfg.host, cfg.server_start_timeout_s)
    tag = variant.tag
    with sigterm_as_keyboard_interrupt():
        try:
            banner(console, 1, "data: the sorting task, its tokenizer and four data sets")
            with times("data"):
                example, answer = make_data(run_dir, cfg.seed, preset)
            console.print(f"  prompts like [bold]{example}[/] → gold answer [bold]{answer}[/]")

            if cfg.reuse_models:
                banner(console, 2, f"SFT: reusing the SFT model in {run_dir / 'sft'}")
            else:
                banner(console, 2, f"SFT: a tiny GPT-2 imitates mixed demonstrations ({sft_steps} steps)")
                sft_yaml = write_config(configs / "sft.yaml", "train-sft", sft_args)
                with times("sft"):
                    run_command("train-sft", sft_yaml)

            rm_metrics: dict[str, float] = {}
            if not variant.needs_reward_model:
                banner(console, 3, "reward model: not needed (the gold scorer gives the rewards, no critic)")
            elif cfg.reuse_models:
                banner(console, 3, f"reward model: reusing the reward model in {run_dir / 'rm'}")
            else:
                banner(
                    console,
                    3,
                    "reward model: Bradley–Terry on gold-labelled pairs with 10% label noise "
                    f"({rm_steps} steps)",
                )
                rm_yaml = write_config(configs / "rm.yaml", "train-rm", rm_args)
                with times("reward_model"):
                    run_command("train-rm", rm_yaml)
            if variant.needs_reward_model:
                rm_metrics = last_metrics(run_dir / "rm" / "metrics.jsonl", "val/")

            served = "the gold scorer as a reward function" if cfg.reward == "gold" else "reward model"
            where = " and critic in their own processes" if variant.uses_critic else " in its own process"
            banner(console, 4, f"serving: {served}{where}")
            reward_yaml = write_config(
                configs / f"serve_reward{tag}.yaml",
                "serve-reward",
                serve_reward_overrides(run_dir, cfg.host, 0, cfg.reward),
            )
            with times("server_start"):
                servers.start("serve-reward", reward_yaml, "reward_model", logs / f"serve_reward{tag}.log")
                if variant.uses_critic:
                    critic_yaml = write_config(
                        configs / f"serve_critic{tag}.yaml",
                        "serve-critic",
                        serve_critic_overrides(run_dir, cfg.host, 0, variant),
                    )
                    servers.start(
                        "serve-critic", critic_yaml, "critic_infer", logs / f"serve_critic{tag}.log"
                    )
                ports = servers.wait_ready()
            rm_port = ports[0]
            critic_port = ports[1] if variant.uses_critic else None
            critic_url = f"   critic  http://{cfg.host}:{critic_port}" if critic_port is not None else ""
            console.print(f"  reward  http://{cfg.host}:{rm_port}{critic_url}")

            per_step = (
                f"{ROLLOUTS_PER_STEP} rollouts"
                if variant.samples_per_prompt == 1
                else f"{variant.prompts_per_step} prompts × {variant.samples_per_prompt} rollouts"
            )
            banner(console, 5, f"{variant.title} ({ppo_steps} steps × {per_step})")
            ppo_yaml = write_config(
                configs / f"ppo{tag}.yaml",
                "train-ppo",
                ppo_overrides(run_dir, cfg.seed, ppo_steps, cfg.host, critic_port, rm_port, variant, rl_lr),
            )
            with times("ppo"):
                run_command("train-ppo", ppo_yaml)

            banner(console, 6, "evaluation against the gold scorer")
            with times("evaluation"):
                report = evaluate(run_dir, cfg.seed, cfg.eval_samples, cfg.host, rm_port, variant)
            times.stop()
        except KeyboardInterrupt:
            console.print("[bold red]interrupted[/]: stopping the servers")
            return 130
        finally:
            servers.stop()

    metrics_path = run_dir / variant.rl_dir / "logs" / "metrics.jsonl"
    plot = plot_ppo_curves(metrics_path, run_dir / f"ppo_curves{tag}.png", variant)
    mode = "quick" if cfg.quick else "full"
    reused = " (SFT and reward models reused)" if cfg.reuse_models else ""
    if cfg.heads != TINY_HEADS["hf"]:
        reused += f" ({cfg.heads} attention heads)"
    heading = f"{variant.title}: seed {cfg.seed}, {mode} mode{reused}, {cfg.eval_samples} held-out prompts."
    write_report(run_dir, variant, report, rm_metrics, times.seconds, plot, heading, metrics_path)
    print_summary(console, variant, report, times.seconds, run_dir)
    return 0 if gold_gain(report) > 0 else 1
