"""Builders for tiny, seeded, randomly initialised models (GPT-2, Llama, GPT-NeoX and Mixtral).

Owns the one definition of "a tiny model" shared by tests, configs, docs and benchmarks, and the
special-token ids those models use (the local tokenizers' ``<pad>`` = 0, ``<eos>`` = 1,
``<bos>`` = 2, set explicitly because ``GPT2Config`` otherwise defaults them to 50256). Building is
deterministic for a given seed and does not touch the global RNG. Nothing is downloaded.
Must not know about training, serving or configs beyond plain arguments.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from openaligner.models.critic import CriticModel
from openaligner.models.reward import RewardModel
from openaligner.models.tokenizers import BOS_ID, EOS_ID, PAD_ID

TinyArch = Literal["gpt2", "llama", "gpt_neox", "mixtral"]
TINY_ARCHS: tuple[str, ...] = ("gpt2", "llama", "gpt_neox", "mixtral")


@dataclass(frozen=True)
class TinySize:
    """Dimensions of a tiny model. The defaults keep unit tests fast on 2 CPU cores."""

    vocab_size: int = 128  # token ids 0..vocab_size-1 (ids 0/1/2 are pad/eos/bos)
    hidden_size: int = 64  # model width (n_embd / hidden_size)
    num_layers: int = 2  # transformer blocks
    num_heads: int = 4  # attention heads; must divide hidden_size
    max_positions: int = 256  # longest sequence (prompt + response)
    intermediate_size: int | None = None  # MLP width; default 4*hidden (GPT-2, GPT-NeoX), else 2*hidden

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        if self.vocab_size <= BOS_ID:
            raise ValueError(f"vocab_size must exceed the special ids (0..{BOS_ID}), got {self.vocab_size}")


WORKLOAD_SIZE = TinySize(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4, max_positions=256)
"""The canonical benchmark model (/work/shared/bench/workload.md) with the GPT-2 architecture."""


def tiny_config(arch: TinyArch = "gpt2", size: TinySize = TinySize()) -> PretrainedConfig:
    """The config of a tiny ``arch`` model of ``size`` with pad/eos/bos = 0/1/2 and no dropout.

    ``gpt_neox`` is Pythia's layout (an untied ``embed_out`` head, parallel residual, partial
    rotary); ``mixtral`` is a sparse mixture of experts (4 experts, 2 per token), whose experts
    ``transformers`` 5 fuses in the module but stores one by one on disk.
    """
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=size.vocab_size,
            n_positions=size.max_positions,
            n_embd=size.hidden_size,
            n_layer=size.num_layers,
            n_head=size.num_heads,
            n_inner=size.intermediate_size,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            bos_token_id=BOS_ID,
        )
    if arch == "llama":
        return LlamaConfig(
            vocab_size=size.vocab_size,
            hidden_size=size.hidden_size,
            intermediate_size=size.intermediate_size or 2 * size.hidden_size,
            num_hidden_layers=size.num_layers,
            num_attention_heads=size.num_heads,
            num_key_value_heads=max(1, size.num_heads // 2),
            max_position_embeddings=size.max_positions,
            tie_word_embeddings=False,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            bos_token_id=BOS_ID,
        )
    if arch == "gpt_neox":
        return GPTNeoXConfig(
            vocab_size=size.vocab_size,
            hidden_size=size.hidden_size,
            intermediate_size=size.intermediate_size or 4 * size.hidden_size,
            num_hidden_layers=size.num_layers,
            num_attention_heads=size.num_heads,
            max_position_embeddings=size.max_positions,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=False,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            bos_token_id=BOS_ID,
        )
    if arch == "mixtral":
        return MixtralConfig(
            vocab_size=size.vocab_size,
            hidden_size=size.hidden_size,
            intermediate_size=size.intermediate_size or 2 * size.hidden_size,
            num_hidden_layers=size.num_layers,
            num_attention_heads=size.num_heads,
            num_key_value_heads=max(1, size.num_heads // 2),
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=size.max_positions,
            attention_dropout=0.0,
            tie_word_embeddings=False,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            bos_token_id=BOS_ID,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {TINY_ARCHS}")


def build_tiny_causal_lm(
    arch: TinyArch = "gpt2", size: TinySize = TinySize(), seed: int = 0
) -> PreTrainedModel:
    """A randomly initialised causal LM (float32, eval mode), identical for identical arguments."""
    with _seeded(seed):
        model = AutoModelForCausalLM.from_config(tiny_config(arch, size))
    return model.eval()


def build_tiny_sequence_classifier(
    arch: TinyArch = "gpt2", size: TinySize = TinySize(), seed: int = 0
) -> PreTrainedModel:
    """A randomly initialised one-label ``*ForSequenceClassification`` (the reward/critic layout)."""
    config = tiny_config(arch, size)
    config.num_labels = 1
    with _seeded(seed):
        model = AutoModelForSequenceClassification.from_config(config)
    return model.eval()


def build_tiny_reward_model(
    arch: TinyArch = "gpt2", size: TinySize = TinySize(), seed: int = 0
) -> RewardModel:
    """A tiny :class:`RewardModel` (eval mode)."""
    return RewardModel(build_tiny_sequence_classifier(arch, size, seed)).eval()


def build_tiny_critic(arch: TinyArch = "gpt2", size: TinySize = TinySize(), seed: int = 0) -> CriticModel:
    """A tiny :class:`CriticModel` (eval mode)."""
    return CriticModel(build_tiny_sequence_classifier(arch, size, seed)).eval()


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG for the block and restore the caller's RNG state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
