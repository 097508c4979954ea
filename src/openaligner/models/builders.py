"""Builders for tiny, seeded, randomly initialised models of ten Hugging Face architectures.

Owns the one definition of "a tiny model" shared by tests, configs, docs and benchmarks: its
dimensions, the architecture features each tiny config keeps switched on (GQA, tied embeddings,
sliding windows, experts, ...), and the special-token ids written into the config (by default the
local tokenizers' ``<pad>`` = 0, ``<eos>`` = 1, ``<bos>`` = 2, set explicitly because e.g.
``GPT2Config`` otherwise defaults them to 50256; :class:`SpecialIds` takes another tokenizer's).
Building is deterministic for a given seed and does not touch the global RNG. Nothing is downloaded.
Must not know about training, serving or configs beyond plain arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Gemma2Config,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OPTConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

from openaligner.models.critic import CriticModel
from openaligner.models.reward import RewardModel
from openaligner.models.tokenizers import BOS_ID, EOS_ID, PAD_ID

TinyArch = Literal[
    "gpt2", "llama", "gpt_neox", "mixtral", "qwen2", "mistral", "gemma", "gemma2", "phi3", "opt"
]
TINY_ARCHS: tuple[str, ...] = get_args(TinyArch)


@dataclass(frozen=True)
class TinySize:
    """Dimensions of a tiny model. The defaults keep unit tests fast on 2 CPU cores."""

    vocab_size: int = 128  # token ids 0..vocab_size-1 (ids 0/1/2 are pad/eos/bos by default)
    hidden_size: int = 64  # model width (n_embd / hidden_size)
    num_layers: int = 2  # transformer blocks
    num_heads: int = 4  # attention heads; must divide hidden_size
    max_positions: int = 256  # longest sequence (prompt + response)
    intermediate_size: int | None = None  # MLP width; default 4*hidden (GPT-2, GPT-NeoX, OPT), else 2*hidden
    sliding_window: int = 8  # attention window of mistral and gemma2: shorter than test sequences, so it acts

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        if self.vocab_size <= BOS_ID:
            raise ValueError(f"vocab_size must exceed the special ids (0..{BOS_ID}), got {self.vocab_size}")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class SpecialIds:
    """The special-token ids a tiny model's config states; they must be its tokenizer's."""

    pad: int | None = PAD_ID  # None: the tokenizer has no pad token (GPT-2's has none)
    eos: int = EOS_ID
    bos: int | None = BOS_ID  # None: the tokenizer has no BOS token (Qwen2's has none)

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> SpecialIds:
        """The ids of ``tokenizer``, which must have an EOS token."""
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token; a causal LM needs one to end responses")
        return cls(pad=tokenizer.pad_token_id, eos=int(tokenizer.eos_token_id), bos=tokenizer.bos_token_id)

    def config_kwargs(self, vocab_size: int) -> dict[str, int | None]:
        """``pad_token_id`` / ``eos_token_id`` / ``bos_token_id``, checked against ``vocab_size``."""
        ids = {"pad_token_id": self.pad, "eos_token_id": self.eos, "bos_token_id": self.bos}
        outside = {k: v for k, v in ids.items() if v is not None and not 0 <= v < vocab_size}
        if outside:
            raise ValueError(f"special ids {outside} lie outside the vocabulary of {vocab_size} ids")
        return ids


WORKLOAD_SIZE = TinySize(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4, max_positions=256)
"""The canonical benchmark model (/work/shared/bench/workload.md) with the GPT-2 architecture."""


def tiny_config(
    arch: TinyArch = "gpt2", size: TinySize = TinySize(), ids: SpecialIds = SpecialIds()
) -> PretrainedConfig:
    """The config of a tiny ``arch`` model of ``size`` with the special ``ids`` and no dropout.

    Each keeps the feature its family is known by switched on: ``llama``, ``mistral``, ``qwen2``,
    ``gemma2`` and ``mixtral`` use grouped-query attention (half as many key/value heads as query
    heads), ``gemma`` multi-query attention (one); ``qwen2``, ``gemma``, ``gemma2``, ``opt`` and
    ``gpt2`` tie the LM head to the input embedding; ``mistral`` (every layer) and ``gemma2``
    (every other layer) attend within ``size.sliding_window`` tokens; ``mixtral`` is a sparse
    mixture of experts (4 experts, 2 per token; ``transformers`` 5 fuses them in the module but
    stores them one by one on disk); ``gpt_neox`` is Pythia's layout (untied ``embed_out`` head,
    parallel residual, partial rotary); ``phi3`` fuses query/key/value and gate/up projections;
    ``opt`` has learned positions offset by 2; ``gemma`` and ``gemma2`` scale the embedding by
    √hidden and ``gemma2`` soft-caps attention and final logits.
    """
    build = _CONFIGS.get(arch)
    if build is None:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {TINY_ARCHS}")
    return build(size, ids.config_kwargs(size.vocab_size))


def _gpt2(size: TinySize, ids: dict[str, Any]) -> PretrainedConfig:
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
        **ids,
    )


def _decoder(size: TinySize, *, ffn: int = 2, **specific: Any) -> dict[str, Any]:
    """The keys the Llama-style configs share (sizes, no attention dropout), plus ``specific``:
    the ones that make the family what it is."""
    return {
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size or ffn * size.hidden_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "max_position_embeddings": size.max_positions,
        "attention_dropout": 0.0,
        **specific,
    }


def _gqa(size: TinySize) -> int:
    """Grouped-query attention: half as many key/value heads as query heads."""
    return max(1, size.num_heads // 2)


def _llama(size: TinySize, ids: dict[str, Any]) -> PretrainedConfig:
    return LlamaConfig(**_decoder(size, num_key_value_heads=_gqa(size), tie_word_embeddings=False), **ids)


def _gpt_neox(size: TinySize, ids: dict[str, Any]) -> PretrainedConfig:
    return GPTNeoXConfig(**_decoder(size, ffn=4, hidden_dropout=0.0, tie_word_embeddings=False), **ids)


def _mixtral(size: TinySize, ids: dict[str, Any]) -> PretrainedConfig:
    experts: dict[str, Any] = {"num_local_experts": 4, "num_experts_per_tok": 2}
    return MixtralConfig(
        **_decoder(size, num_key_value_heads=_gqa(size), tie_word_embeddings=False, **experts), **ids
    )


def _qwen2(size: TinySize, ids: dict[str, Any]) -> PretrainedConfig:
    specific: dict[str, Any] = {
        "num_key_value_heads": _gqa(size),
        "use_sliding_window": False,
        "tie_word_embeddings": True,
    }
    return Qwen2Config(**_decoder(size, **specific), **ids)


def _mistral(size: TinySize, ids: dict[str, Any]) -> PretrainedConfig:
    specific: dict[str, Any] = {"num_key_value_heads": _gqa(size), "head_dim": size.head_dim}
    window: dict[str, Any] = {"sliding_window": size.sliding_window, "tie_word_embeddings": False}
    return MistralConfig(**_decoder(size, **specific, **window), **ids)


def _gemma(size: TinySize, ids: dict[str, Any]) -> PretrainedConfig:
    specific: dict[str, Any] = {
        "num_key_value_heads": 1,
        "head_dim": size.head_dim,
        "tie_word_embeddings": True,
    }
    return GemmaConfig(**_decoder(size, **specific), **ids)


def _gemma2(size: TinySize, ids: dict[str, Any]) -> PretrainedConfig:
    specific: dict[str, Any] = {
        "num_key_value_heads": _gqa(size),
        "head_dim": size.head_dim,
        "query_pre_attn_scalar": size.head_dim,
        "sliding_window": size.sliding_window,
        "tie_word_embeddings": True,
    }
    return Gemma2Config(**_decoder(size, **specific), **ids)


def _phi3(size: TinySize, ids: dict[str, Any]) -> PretrainedConfig:
    specific: dict[str, Any] = {
        "num_key_value_heads": size.num_heads,
        "original_max_position_embeddings": size.max_positions,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "tie_word_embeddings": False,
    }
    return Phi3Config(**_decoder(size, **specific), **ids)


def _opt(size: TinySize, ids: dict[str, Any]) -> PretrainedConfig:
    return OPTConfig(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        ffn_dim=size.intermediate_size or 4 * size.hidden_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        max_position_embeddings=size.max_positions,
        word_embed_proj_dim=size.hidden_size,
        do_layer_norm_before=True,
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=0.0,
        tie_word_embeddings=True,
        **ids,
    )


_CONFIGS: dict[str, Callable[[TinySize, dict[str, Any]], PretrainedConfig]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "gpt_neox": _gpt_neox,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "mistral": _mistral,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "phi3": _phi3,
    "opt": _opt,
}


def build_tiny_causal_lm(
    arch: TinyArch = "gpt2", size: TinySize = TinySize(), seed: int = 0, *, ids: SpecialIds = SpecialIds()
) -> PreTrainedModel:
    """A randomly initialised causal LM (float32, eval mode), identical for identical arguments."""
    with _seeded(seed):
        model = AutoModelForCausalLM.from_config(tiny_config(arch, size, ids))
    return model.eval()


def build_tiny_sequence_classifier(
    arch: TinyArch = "gpt2", size: TinySize = TinySize(), seed: int = 0, *, ids: SpecialIds = SpecialIds()
) -> PreTrainedModel:
    """A randomly initialised one-label ``*ForSequenceClassification`` (the reward/critic layout)."""
    config = tiny_config(arch, size, ids)
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
