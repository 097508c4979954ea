"""The demo's settings: data and step counts per mode, the algorithm and reward compared, and what
each stage's command is configured with.

Owns the numbers of the demo (sizes, learning rates, batch sizes, the KL penalty, ...) as the
dotted overrides each command's YAML is resolved from, and which stages and servers a choice of
algorithm and reward needs (:class:`Variant`). Knows no process, model or report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from openaligner.trainer.estimators import get_estimator


@dataclass(frozen=True)
class Preset:
    n_sft: int  # SFT demonstrations
    n_pref: int  # preference pairs
    n_ppo: int  # PPO prompts
    sft_steps: int
    rm_steps: int
    ppo_steps: int  # PPO's RL steps
    rl_lr: float  # PPO's policy learning rate
    critic_free_steps: int  # the RL steps of GRPO, RLOO and REINFORCE
    critic_free_lr: float  # their policy learning rate

    def rl_stage(self, uses_critic: bool) -> tuple[int, float]:
        """The RL stage's (steps, policy learning rate): PPO's, or the critic-free algorithms'."""
        if uses_critic:
            return self.ppo_steps, self.rl_lr
        return self.critic_free_steps, self.critic_free_lr


PRESETS = {
    # PPO: 300 steps at 2.5e-4 reached the goal gold >= 90 with KL <= 3 on seeds 0-2, where 100
    # steps at 5e-4 reached 81.7-87.9; the critic-free algorithms keep 100 steps at 5e-4, because
    # GRPO and REINFORCE fell at PPO's setting on seed 0 (GRPO 68.9, REINFORCE 59.4 at KL 10; docs/demo.md)
    "full": Preset(
        n_sft=4000,
        n_pref=3000,
        n_ppo=2048,
        sft_steps=800,
        rm_steps=400,
        ppo_steps=300,
        rl_lr=2.5e-4,
        critic_free_steps=100,
        critic_free_lr=5e-4,
    ),
    # the CI-sized run: few steps, so the larger rate (its gain is asserted by the test suite)
    "quick": Preset(
        n_sft=3000,
        n_pref=2000,
        n_ppo=1024,
        sft_steps=400,
        rm_steps=200,
        ppo_steps=30,
        rl_lr=5e-4,
        critic_free_steps=30,
        critic_free_lr=5e-4,
    ),
}
ROLLOUTS_PER_STEP = 64  # responses per RL step, for every algorithm
SAMPLES_PER_PROMPT = 4  # responses per prompt of the critic-free algorithms (16 prompts × 4)
MAX_NEW_TOKENS = 8
KL_PENALTY = 0.2  # β for every algorithm: strong enough that the policy does not exploit the RM

ALGORITHMS: dict[str, str] = {"ppo": "gae", "grpo": "grpo", "rloo": "rloo", "reinforce": "reinforce"}
"""The demo's ``algorithm`` → train-ppo's ``trainer.advantage_estimator``."""
REWARDS = ("model", "gold")
ENGINES = ("hf", "vllm")
"""The demo's ``rollout_engine`` → train-ppo's ``rollout.engine``."""
TINY_HEADS = {"hf": 4, "vllm": 2}
"""Attention heads of the tiny models per rollout engine when ``model_heads=0``: hidden size 64 over
4 heads is head size 16, which vLLM's CPU attention refuses; 2 heads (head size 32) it serves."""
GOLD_REWARD_FUNCTION = "openaligner.tasks.sorting:gold_reward"
"""The gold scorer as the reward function ``serve-reward`` serves with ``reward=gold``."""


@dataclass(frozen=True)
class Variant:
    """Which algorithm trains the policy against which reward, and what that needs.

    ``ppo`` with ``model`` is the demo's original run and keeps its file names (``ppo/``,
    ``configs/ppo.yaml``, ``report.md``, ...); every other variant's RL stage writes beside it with
    its :attr:`tag` appended (``ppo-grpo-gold/``, ``configs/ppo-grpo-gold.yaml``,
    ``report-grpo-gold.md``), so that variants can share one run directory's SFT and reward models.
    The ``vllm`` engine appends ``-vllm`` (``ppo-vllm/``, ``ppo-grpo-gold-vllm/``), so that both
    engines' RL stages can share them too.
    """

    algorithm: str = "ppo"  # a key of ALGORITHMS
    reward: str = "model"  # model (the learned reward model) | gold (the gold scorer as a function)
    engine: str = "hf"  # what generates the RL stage's rollouts: one of ENGINES
    engine_python: str = ""  # the vllm engine's interpreter (rollout.vllm.python); "" = train-ppo's default

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {', '.join(REWARDS)}, got {self.reward!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"rollout_engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")

    @property
    def uses_critic(self) -> bool:
        """Whether the algorithm's estimator trains a critic (served by ``serve-critic``): PPO's."""
        return get_estimator(ALGORITHMS[self.algorithm]).needs_critic

    @property
    def needs_reward_model(self) -> bool:
        """The reward model is trained when it gives the rewards or PPO's critic starts from it."""
        return self.reward == "model" or self.uses_critic

    @property
    def samples_per_prompt(self) -> int:
        return 1 if self.uses_critic else SAMPLES_PER_PROMPT

    @property
    def prompts_per_step(self) -> int:
        """Prompts per RL step: every algorithm trains on ``ROLLOUTS_PER_STEP`` responses a step."""
        return ROLLOUTS_PER_STEP // self.samples_per_prompt

    @property
    def tag(self) -> str:
        """Appended to the RL stage's file names; empty for the original ``ppo``/``model``/``hf`` run."""
        base = "" if (self.algorithm, self.reward) == ("ppo", "model") else f"-{self.algorithm}-{self.reward}"
        return base + ("" if self.engine == "hf" else f"-{self.engine}")

    @property
    def rl_dir(self) -> str:
        """The RL stage's output directory inside the run directory."""
        return f"ppo{self.tag}"

    @property
    def title(self) -> str:
        """E.g. ``GRPO against the gold scorer``."""
        against = "the learned reward model" if self.reward == "model" else "the gold scorer"
        engine = "" if self.engine == "hf" else f" ({self.engine} rollouts)"
        return f"{self.algorithm.upper()} against {against}{engine}"


def _tiny_model(seed: int, heads: int) -> list[str]:
    return [
        "model.tiny=gpt2",
        "model.tiny_hidden_size=64",
        "model.tiny_num_layers=2",
        f"model.tiny_num_heads={heads}",
        "model.tiny_max_positions=64",
        f"model.tiny_seed={seed}",
    ]


def sft_overrides(run_dir: Path, seed: int, steps: int, heads: int = TINY_HEADS["hf"]) -> list[str]:
    """train-sft's settings; ``heads``: attention heads of the tiny GPT-2 (the reward model and
    critic start from it, so they have as many)."""
    return [
        *_tiny_model(seed, heads),
        f"tokenizer.path={run_dir / 'tokenizer'}",
        f"data.train_path={run_dir / 'data' / 'sft.jsonl'}",
        "data.val_fraction=0.05",
        "optim.lr=3e-3",
        "optim.scheduler=cosine",
        "optim.min_lr=3e-4",
        f"optim.warmup_steps={min(20, steps // 10)}",  # shorter than the run, or it is refused
        f"trainer.max_steps={steps}",
        "trainer.global_batch_size=64",
        "trainer.micro_batch_size=64",
        f"trainer.val_check_interval={steps}",
        f"trainer.save_interval={steps}",
        "trainer.keep_last=1",
        f"trainer.seed={seed}",
        f"output_dir={run_dir / 'sft'}",
        "device=cpu",
    ]


def rm_overrides(run_dir: Path, seed: int, steps: int) -> list[str]:
    return [
        f"model.path={run_dir / 'sft'}",  # the reward model starts from the SFT backbone
        f"tokenizer.path={run_dir / 'tokenizer'}",
        f"data.train_path={run_dir / 'data' / 'preferences.jsonl'}",
        "data.val_fraction=0.1",
        "optim.lr=1e-3",
        "optim.scheduler=cosine",
        "optim.min_lr=1e-4",
        f"optim.warmup_steps={min(10, steps // 10)}",  # shorter than the run, or it is refused
        f"trainer.max_steps={steps}",
        "trainer.global_batch_size=64",
        "trainer.micro_batch_size=64",
        f"trainer.val_check_interval={steps}",
        f"trainer.save_interval={steps}",
        "trainer.keep_last=1",
        f"trainer.seed={seed}",
        f"output_dir={run_dir / 'rm'}",
        "device=cpu",
    ]


def serve_reward_overrides(run_dir: Path, host: str, port: int, reward: str) -> list[str]:
    served = (
        [f"model.path={run_dir / 'rm'}"] if reward == "model" else [f"reward.function={GOLD_REWARD_FUNCTION}"]
    )
    return [
        *served,
        f"server.host={host}",
        f"server.port={port}",
        "server.inference_micro_batch_size=[16]",
        "server.model_forward_micro_batch_size=16",
        "threads=1",  # the actor trainer needs the cores most
    ]


def serve_critic_overrides(run_dir: Path, host: str, port: int, variant: Variant) -> list[str]:
    return [
        f"model.path={run_dir / 'rm'}",  # the critic starts from the reward model
        f"server.host={host}",
        f"server.port={port}",
        "server.combine_rm_and_critic_server=false",  # rewards come from the reward server
        "server.inference_micro_batch_size=[16]",
        "server.model_forward_micro_batch_size=16",
        "train.global_batch_size=64",
        "train.micro_batch_size=64",
        "optim.lr=5e-4",
        "optim.scheduler=constant",
        "optim.warmup_steps=0",
        "optim.weight_decay=0.0",
        f"checkpoint.dir={run_dir / ('critic' + variant.tag)}",
        "threads=1",  # the actor trainer needs the cores most
    ]


def ppo_overrides(
    run_dir: Path,
    seed: int,
    steps: int,
    host: str,
    critic_port: int | None,
    rm_port: int,
    variant: Variant,
    lr: float,
) -> list[str]:
    """train-ppo's settings; ``critic_port`` is None for the critic-free algorithms (no critic server);
    ``lr``: the policy's learning rate (the mode's :meth:`Preset.rl_stage` unless the demo is given one)."""
    critic = (
        [f"remote.critic.ip={host}", f"remote.critic.port={critic_port}"] if critic_port is not None else []
    )
    # the hf engine is train-ppo's default: its YAML is the one the demo wrote before engines existed
    engine = [] if variant.engine == "hf" else [f"rollout.engine={variant.engine}"]
    if variant.engine == "vllm" and variant.engine_python:
        engine.append(f"rollout.vllm.python={variant.engine_python}")
    return [
        f"actor.path={run_dir / 'sft'}",
        f"tokenizer.path={run_dir / 'tokenizer'}",
        "device=cpu",
        *engine,
        f"data.train_path={run_dir / 'data' / 'ppo_prompts.jsonl'}",
        f"data.val_path={run_dir / 'data' / 'val_prompts.jsonl'}",
        "data.seq_length=64",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=100",
        f"trainer.advantage_estimator={ALGORITHMS[variant.algorithm]}",
        f"trainer.num_rollout_samples={variant.prompts_per_step}",
        f"trainer.n_samples_per_prompt={variant.samples_per_prompt}",
        "trainer.rollout_micro_batch_size=16",
        "trainer.global_batch_size=16",
        "trainer.micro_batch_size=16",
        "trainer.num_val_samples=64",
        "trainer.val_rollout_micro_batch_size=32",
        f"trainer.val_check_interval={max(steps // 5, 1)}",
        f"trainer.save_interval={max(steps // 5, 1)}",
        f"trainer.initial_policy_kl_penalty={KL_PENALTY}",
        f"trainer.length.max_length={MAX_NEW_TOKENS}",
        f"trainer.seed={seed}",
        "trainer.sample_table_interval=10",
        f"optim.lr={lr}",
        "remote.combine_rm_and_critic_server=false",
        *critic,
        f"remote.reward_model.ip={host}",
        f"remote.reward_model.port={rm_port}",
        "remote.pad_to_length=64",
        f"exp.output_dir={run_dir / variant.rl_dir}",
        "exp.task_scorer=sorting",
        "exp.keep_last=1",
    ]
