"""The demo's settings: data and step counts per mode, and what each stage's command is configured with.

Owns the numbers of the demo (sizes, learning rates, batch sizes, the KL penalty, ...) as the
dotted overrides each command's YAML is resolved from. Knows no process, model or report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Preset:
    n_sft: int  # SFT demonstrations
    n_pref: int  # preference pairs
    n_ppo: int  # PPO prompts
    sft_steps: int
    rm_steps: int
    ppo_steps: int


PRESETS = {
    "full": Preset(n_sft=4000, n_pref=3000, n_ppo=2048, sft_steps=800, rm_steps=400, ppo_steps=100),
    "quick": Preset(n_sft=3000, n_pref=2000, n_ppo=1024, sft_steps=400, rm_steps=200, ppo_steps=30),
}
ROLLOUTS_PER_STEP = 64
MAX_NEW_TOKENS = 8


def _tiny_model(seed: int) -> list[str]:
    return [
        "model.tiny=gpt2",
        "model.tiny_hidden_size=64",
        "model.tiny_num_layers=2",
        "model.tiny_num_heads=4",
        "model.tiny_max_positions=64",
        f"model.tiny_seed={seed}",
    ]


def sft_overrides(run_dir: Path, seed: int, steps: int) -> list[str]:
    return [
        *_tiny_model(seed),
        f"tokenizer.path={run_dir / 'tokenizer'}",
        f"data.train_path={run_dir / 'data' / 'sft.jsonl'}",
        "data.val_fraction=0.05",
        "optim.lr=3e-3",
        "optim.scheduler=cosine",
        "optim.min_lr=3e-4",
        "optim.warmup_steps=20",
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
        "optim.warmup_steps=10",
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


def serve_reward_overrides(run_dir: Path, host: str, port: int) -> list[str]:
    return [
        f"model.path={run_dir / 'rm'}",
        f"server.host={host}",
        f"server.port={port}",
        "server.inference_micro_batch_size=[16]",
        "server.model_forward_micro_batch_size=16",
        "threads=1",  # the actor trainer needs the cores most
    ]


def serve_critic_overrides(run_dir: Path, host: str, port: int) -> list[str]:
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
        f"checkpoint.dir={run_dir / 'critic'}",
        "threads=1",  # the actor trainer needs the cores most
    ]


def ppo_overrides(
    run_dir: Path, seed: int, steps: int, host: str, critic_port: int, rm_port: int
) -> list[str]:
    return [
        f"actor.path={run_dir / 'sft'}",
        f"tokenizer.path={run_dir / 'tokenizer'}",
        "device=cpu",
        f"data.train_path={run_dir / 'data' / 'ppo_prompts.jsonl'}",
        f"data.val_path={run_dir / 'data' / 'val_prompts.jsonl'}",
        "data.seq_length=64",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=100",
        f"trainer.num_rollout_samples={ROLLOUTS_PER_STEP}",
        "trainer.rollout_micro_batch_size=16",
        "trainer.global_batch_size=16",
        "trainer.micro_batch_size=16",
        "trainer.num_val_samples=64",
        "trainer.val_rollout_micro_batch_size=32",
        f"trainer.val_check_interval={max(steps // 5, 1)}",
        f"trainer.save_interval={max(steps // 5, 1)}",
        "trainer.initial_policy_kl_penalty=0.2",  # strong enough that PPO does not exploit the RM
        f"trainer.length.max_length={MAX_NEW_TOKENS}",
        f"trainer.seed={seed}",
        "trainer.sample_table_interval=10",
        "optim.lr=5e-4",
        "remote.combine_rm_and_critic_server=false",
        f"remote.critic.ip={host}",
        f"remote.critic.port={critic_port}",
        f"remote.reward_model.ip={host}",
        f"remote.reward_model.port={rm_port}",
        "remote.pad_to_length=64",
        f"exp.output_dir={run_dir / 'ppo'}",
        "exp.task_scorer=sorting",
        "exp.keep_last=1",
    ]
