"""Where a model comes from: a local Hugging Face directory, or a tiny seeded built-in architecture.

One small config dataclass shared by every command (SFT, RM, servers, PPO), plus the functions
that turn it into a causal LM, a reward model or a critic. Nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from openaligner.models.builders import (
    TINY_ARCHS,
    TinySize,
    build_tiny_causal_lm,
    build_tiny_sequence_classifier,
)
from openaligner.models.critic import CriticModel
from openaligner.models.reward import RewardModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSourceConfig:
    """A model: ``path`` to a Hugging Face directory, or (when null) a tiny built-in architecture."""

    path: str | None = None  # local HF directory (config.json + *.safetensors); null = tiny model
    tiny_arch: str = "gpt2"  # tiny model architecture when path is null: gpt2 | llama
    tiny_vocab_size: int = 128  # tiny model vocabulary (must cover the tokenizer)
    tiny_hidden_size: int = 64  # tiny model width
    tiny_num_layers: int = 2  # tiny model depth
    tiny_num_heads: int = 4  # tiny model attention heads
    tiny_max_positions: int = 256  # tiny model longest sequence
    seed: int = 0  # tiny model initialisation seed
    dtype: str = "float32"  # float32 | bfloat16 | float16 (bf16 pays off on GPUs, not on CPUs without AMX)
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N

    def __post_init__(self) -> None:
        if self.path is None and self.tiny_arch not in TINY_ARCHS:
            raise ValueError(f"model.tiny_arch must be one of {TINY_ARCHS}, got {self.tiny_arch!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def tiny_size(self) -> TinySize:
        return TinySize(
            vocab_size=self.tiny_vocab_size,
            hidden_size=self.tiny_hidden_size,
            num_layers=self.tiny_num_layers,
            num_heads=self.tiny_num_heads,
            max_positions=self.tiny_max_positions,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def load_causal_lm(src: ModelSourceConfig) -> PreTrainedModel:
    """The causal LM ``src`` names, on its device and dtype, in eval mode."""
    model: PreTrainedModel
    if src.path is not None:
        model = AutoModelForCausalLM.from_pretrained(src.path, local_files_only=True, dtype=src.torch_dtype)
    else:
        model = build_tiny_causal_lm(src.tiny_arch, src.tiny_size, seed=src.seed)  # type: ignore[arg-type]
    # nn.Module.to: transformers' typed wrapper of .to rejects dtype/device arguments under mypy.
    torch.nn.Module.to(model, device=src.torch_device(), dtype=src.torch_dtype)
    return model.eval()


def load_reward_model(src: ModelSourceConfig) -> RewardModel:
    """A :class:`RewardModel` from ``src`` (an HF directory in the reward/critic layout, or tiny)."""
    if src.path is not None:
        model = RewardModel.from_pretrained(src.path, dtype=src.torch_dtype)
    else:
        model = RewardModel(build_tiny_sequence_classifier(src.tiny_arch, src.tiny_size, seed=src.seed))  # type: ignore[arg-type]
    return model.to(device=src.torch_device()).eval()


def load_critic(src: ModelSourceConfig) -> CriticModel:
    """A :class:`CriticModel` from ``src``; a reward-model directory initialises the critic."""
    if src.path is not None:
        model = CriticModel.from_pretrained(src.path, dtype=src.torch_dtype)
    else:
        model = CriticModel(build_tiny_sequence_classifier(src.tiny_arch, src.tiny_size, seed=src.seed))  # type: ignore[arg-type]
    return model.to(device=src.torch_device()).eval()
