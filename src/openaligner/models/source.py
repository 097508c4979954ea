"""Where a model and its tokenizer come from: a local Hugging Face directory, or a tiny built-in one.

The config dataclasses every command shares (SFT, RM, servers, PPO) and the functions that turn
them into a tokenizer, a causal LM, a reward model or a critic. Nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from openaligner.models.builders import (
    TINY_ARCHS,
    TinyArch,
    TinySize,
    build_tiny_causal_lm,
    build_tiny_sequence_classifier,
)
from openaligner.models.critic import CriticModel
from openaligner.models.precision import MASTER_DTYPE
from openaligner.models.reward import RewardModel
from openaligner.models.tokenizers import build_char_tokenizer, load_tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclass
class ModelSourceConfig:
    path: str | None = None  # local Hugging Face model directory; when set, the tiny.* keys are ignored
    tiny: str = "gpt2"  # built-in random model when path is unset: gpt2 or llama
    tiny_vocab_size: int = 0  # tiny model vocabulary; 0 = the tokenizer's length
    tiny_hidden_size: int = 64  # tiny model width
    tiny_num_layers: int = 2  # tiny model transformer blocks
    tiny_num_heads: int = 4  # tiny model attention heads (must divide the width)
    tiny_max_positions: int = 256  # tiny model longest sequence
    tiny_seed: int = 0  # seed of the tiny model's random initialisation

    def __post_init__(self) -> None:
        if self.path is None and self.tiny not in TINY_ARCHS:
            raise ValueError(f"model.tiny must be one of {TINY_ARCHS} (or set model.path), got {self.tiny!r}")
        if self.path is not None and not (Path(self.path) / "config.json").is_file():
            raise ValueError(
                f"model.path={self.path!r} is not a Hugging Face model directory (no config.json)"
            )

    @property
    def tiny_arch(self) -> TinyArch:
        """``tiny`` as the builders' architecture name (validated above)."""
        return "llama" if self.tiny == "llama" else "gpt2"

    def tiny_size(self, vocab_size: int) -> TinySize:
        """The tiny model's dimensions; ``vocab_size`` fills in ``tiny_vocab_size=0``."""
        return TinySize(
            vocab_size=self.tiny_vocab_size or vocab_size,
            hidden_size=self.tiny_hidden_size,
            num_layers=self.tiny_num_layers,
            num_heads=self.tiny_num_heads,
            max_positions=self.tiny_max_positions,
        )


@dataclass
class TokenizerSourceConfig:
    path: str | None = None  # local tokenizer directory; unset = model.path when it holds one, else built-in
    builtin: str = (
        "char"  # built-in tokenizer for tiny models: char (<pad>=0, <eos>=1, <bos>=2, printable ASCII)
    )

    def __post_init__(self) -> None:
        if self.builtin != "char":
            raise ValueError(f"tokenizer.builtin must be 'char', got {self.builtin!r}")
        if self.path is not None and not Path(self.path).is_dir():
            raise ValueError(f"tokenizer.path={self.path!r} is not a directory")


def resolve_tokenizer(model: ModelSourceConfig, tokenizer: TokenizerSourceConfig) -> PreTrainedTokenizerBase:
    """``tokenizer.path``, else the tokenizer saved with ``model.path``, else the built-in one
    (only for tiny models: a real model needs its own tokenizer)."""
    if tokenizer.path is not None:
        return load_tokenizer(tokenizer.path)
    if model.path is not None:
        if any((Path(model.path) / f).is_file() for f in _TOKENIZER_FILES):
            return load_tokenizer(model.path)
        raise ValueError(f"model.path={model.path!r} holds no tokenizer; set tokenizer.path")
    return build_char_tokenizer()


def check_vocab(tokenizer: PreTrainedTokenizerBase, model: nn.Module) -> None:
    """Refuse a tokenizer whose ids ``model`` (a HF model) cannot embed."""
    embedding = getattr(model, "get_input_embeddings")()  # noqa: B009 (untyped HF API)
    model_vocab_size = int(embedding.weight.shape[0])
    if len(tokenizer) > model_vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model embeds only {model_vocab_size}; "
            "use a matching tokenizer (or raise model.tiny_vocab_size)"
        )


def pick_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU; anything else as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_causal_lm(
    src: ModelSourceConfig, vocab_size: int, device: torch.device, dtype: torch.dtype = MASTER_DTYPE
) -> PreTrainedModel:
    """The causal LM ``src`` names (tiny ones sized to ``vocab_size`` unless set), eval mode.

    Its weights are ``dtype`` whatever the checkpoint was stored in: float32 by default, the master
    weights a trained model needs (:mod:`openaligner.models.precision`).
    """
    model: PreTrainedModel
    if src.path is not None:
        model = AutoModelForCausalLM.from_pretrained(src.path, local_files_only=True, dtype=dtype)
    else:
        model = build_tiny_causal_lm(src.tiny_arch, src.tiny_size(vocab_size), seed=src.tiny_seed)
    # nn.Module.to: transformers' typed wrapper of .to rejects a device argument under mypy.
    nn.Module.to(model, device, dtype)
    return model.eval()


def load_reward_model(
    src: ModelSourceConfig,
    vocab_size: int,
    device: torch.device,
    standardization: tuple[float, float] | None = None,
    dtype: torch.dtype = MASTER_DTYPE,
) -> RewardModel:
    """A :class:`RewardModel` from ``src`` (an HF directory in the reward/critic layout, or tiny);
    backbone in ``dtype`` (float32 master weights by default), head in float32."""
    if src.path is not None:
        model = RewardModel.from_pretrained(src.path, dtype=dtype, standardization=standardization)
    else:
        hf = build_tiny_sequence_classifier(src.tiny_arch, src.tiny_size(vocab_size), seed=src.tiny_seed)
        model = RewardModel(nn.Module.to(hf, dtype=dtype), standardization=standardization)
    return model.to(device).eval()


def load_critic(
    src: ModelSourceConfig,
    vocab_size: int,
    device: torch.device,
    standardization: tuple[float, float] | None = None,
    dtype: torch.dtype = MASTER_DTYPE,
) -> CriticModel:
    """A :class:`CriticModel` from ``src``; a reward-model directory initialises the critic.
    Backbone in ``dtype`` (float32 master weights by default), head in float32."""
    if src.path is not None:
        model = CriticModel.from_pretrained(src.path, dtype=dtype, standardization=standardization)
    else:
        hf = build_tiny_sequence_classifier(src.tiny_arch, src.tiny_size(vocab_size), seed=src.tiny_seed)
        model = CriticModel(nn.Module.to(hf, dtype=dtype), standardization=standardization)
    return model.to(device).eval()
