"""Where a model and its tokenizer come from: a local Hugging Face directory, or a tiny built-in one.

The config dataclasses every command shares (SFT, RM, servers, PPO) and the functions that turn
them into a tokenizer, a causal LM, a reward model or a critic. Nothing is downloaded.

A command holds a model source under its own key (``model`` in train-sft, ``actor`` in
train-ppo), so the sections' load-time messages write ``{section}`` where that key belongs and the
config loader fills it in; functions called later take the key as ``key``. Problems found after
loading raise :class:`SourceError`, which the commands report as a start-up refusal.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar, cast

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from openaligner.models.builders import (
    TINY_ARCHS,
    TinyArch,
    TinySize,
    build_tiny_causal_lm,
    build_tiny_sequence_classifier,
)
from openaligner.models.critic import CriticModel
from openaligner.models.lora import adapter_directory_problem
from openaligner.models.positions import position_limit
from openaligner.models.precision import MASTER_DTYPE
from openaligner.models.reward import RewardModel
from openaligner.models.tokenizers import build_char_tokenizer, load_tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class SourceError(ValueError):
    """A model or tokenizer source that cannot be used, found after the config loaded; the message
    names the key, the value and the fix."""


@dataclass
class ModelSourceConfig:
    path: str | None = None  # local Hugging Face model directory; when set, the tiny.* keys are ignored
    tiny: str | None = (
        "gpt2"  # built-in random model if no path: a TINY_ARCHS name (gpt2, qwen2, ...); null: none
    )
    tiny_vocab_size: int = 0  # tiny model vocabulary; 0 = the tokenizer's length
    tiny_hidden_size: int = 64  # tiny model width
    tiny_num_layers: int = 2  # tiny model transformer blocks
    tiny_num_heads: int = 4  # tiny model attention heads (must divide the width)
    tiny_max_positions: int = 256  # tiny model longest sequence
    tiny_seed: int = 0  # seed of the tiny model's random initialisation

    def __post_init__(self) -> None:
        # {section}: this section's key in the command's schema (model, actor, ...), see above
        # tiny=None with no path names no model: loading it is refused (require_model), so that a
        # command can default to "nothing chosen" (the servers never serve a model nobody named).
        if self.path is None and self.tiny is not None and self.tiny not in TINY_ARCHS:
            raise ValueError(
                f"{{section}}.tiny must be one of {TINY_ARCHS} (or set {{section}}.path), got {self.tiny!r}"
            )
        problem = adapter_directory_problem(self.path) if self.path is not None else None
        if problem is not None:
            raise ValueError(f"{{section}}.path={self.path!r} {problem}")
        if self.path is not None:
            check_model_dir(self.path, "{section}.path")

    @property
    def tiny_arch(self) -> TinyArch:
        """``tiny`` as the builders' architecture name (validated above).

        Raises:
            SourceError: ``tiny`` is None (see :func:`require_model`).
        """
        if self.tiny is None:
            raise SourceError("no model is named: set its path=<HF directory> or tiny=gpt2")
        return cast(TinyArch, self.tiny)

    def tiny_size(self, vocab_size: int) -> TinySize:
        """The tiny model's dimensions; ``vocab_size`` fills in ``tiny_vocab_size=0``."""
        return TinySize(
            vocab_size=self.tiny_vocab_size or vocab_size,
            hidden_size=self.tiny_hidden_size,
            num_layers=self.tiny_num_layers,
            num_heads=self.tiny_num_heads,
            max_positions=self.tiny_max_positions,
        )


def check_model_dir(path: str, key: str) -> None:
    """Refuse (``ValueError``, naming ``key``) a ``path`` that is not a Hugging Face model directory:
    one that does not exist, a file, or a directory without ``config.json``."""
    p = Path(path)
    if not p.exists():
        raise ValueError(
            f"{key}={path!r} does not exist; set {key} to a Hugging Face model directory (with config.json)"
        )
    if not p.is_dir():
        raise ValueError(
            f"{key}={path!r} is a file, not a Hugging Face model directory; set {key} to the directory "
            "holding config.json and the weights"
        )
    if not (p / "config.json").is_file():
        raise ValueError(f"{key}={path!r} is not a Hugging Face model directory (no config.json)")


@dataclass
class TokenizerSourceConfig:
    path: str | None = None  # local tokenizer directory; unset = model.path when it holds one, else built-in
    builtin: str = (
        "char"  # built-in tokenizer for tiny models: char (<pad>=0, <eos>=1, <bos>=2, printable ASCII)
    )

    def __post_init__(self) -> None:
        if self.builtin != "char":
            raise ValueError(f"{{section}}.builtin must be 'char', got {self.builtin!r}")
        if self.path is not None and not Path(self.path).is_dir():
            raise ValueError(f"{{section}}.path={self.path!r} is not a directory")


def require_model(src: ModelSourceConfig, key: str = "model") -> None:
    """Refuse (:class:`SourceError`) a source that names no model: no ``path`` and ``tiny`` null."""
    if src.path is None and src.tiny is None:
        raise SourceError(f"no model is named: set {key}.path=<HF directory> or {key}.tiny=gpt2")


def resolve_tokenizer(
    model: ModelSourceConfig, tokenizer: TokenizerSourceConfig, key: str = "model"
) -> PreTrainedTokenizerBase:
    """``tokenizer.path``, else the tokenizer saved with ``model.path``, else the built-in one
    (only for tiny models: a real model needs its own tokenizer). ``key`` names ``model`` in
    messages (e.g. ``actor``).

    Raises:
        SourceError: ``model.path`` holds no tokenizer and ``tokenizer.path`` is unset, or
            ``model`` names no model.
    """
    found = find_tokenizer(model, tokenizer, key)
    if found is None:
        raise SourceError(f"{key}.path={model.path!r} holds no tokenizer; set tokenizer.path")
    return found


def find_tokenizer(
    model: ModelSourceConfig, tokenizer: TokenizerSourceConfig, key: str = "model"
) -> PreTrainedTokenizerBase | None:
    """As :func:`resolve_tokenizer`, but None where that refuses a ``model.path`` without a
    tokenizer (a server can still take token ids). A ``tokenizer.path`` that does not load
    raises whatever loading raised.

    Raises:
        SourceError: ``model`` names no model.
    """
    require_model(model, key)
    if tokenizer.path is not None:
        return load_tokenizer(tokenizer.path)
    if model.path is not None:
        if any((Path(model.path) / f).is_file() for f in _TOKENIZER_FILES):
            return load_tokenizer(model.path)
        return None
    return build_char_tokenizer()


def tokenizer_id_count(tokenizer: PreTrainedTokenizerBase) -> int:
    """How many ids ``tokenizer`` can emit: one more than its highest id. ``len(tokenizer)`` counts
    its tokens, which is the same for a vocabulary numbered without gaps; one with gaps emits ids
    beyond it."""
    highest = max(tokenizer.get_vocab().values(), default=-1)
    return max(len(tokenizer), highest + 1)


def check_vocab(
    tokenizer: PreTrainedTokenizerBase, model: nn.Module, key: str = "model", fix: str | None = None
) -> None:
    """Refuse (:class:`SourceError`) a tokenizer that can emit an id ``model`` (a HF model, from the
    source at ``key``) has no embedding row for: a forward on such an id would index past the
    table (an IndexError on CPU, a device-side assert on CUDA) whenever it first turns up. An
    embedding table larger than the tokenizer is fine (many models pad it to a multiple of 64 or
    128). Call it before the model is sharded or given adapters.

    Args:
        key: the model's key, in the message (``model``, ``actor``, ``reward_model``).
        fix: what to do instead, in the message; default: the model's own tokenizer, or for a
            tiny model a ``{key}.tiny_vocab_size`` that covers the tokenizer.
    """
    embedding = getattr(model, "get_input_embeddings")()  # noqa: B009 (untyped HF API)
    rows = int(embedding.weight.shape[0])
    ids = tokenizer_id_count(tokenizer)
    if ids > rows:
        fix = fix or (
            f"use the tokenizer the model was trained with (a tiny model: raise {key}.tiny_vocab_size "
            f"to at least {ids})"
        )
        raise SourceError(
            f"the tokenizer has {ids} token ids (0..{ids - 1}) but {key} embeds only {rows} "
            f"(its embedding table's rows): ids {rows}..{ids - 1} have no embedding; {fix}"
        )


def source_position_limit(src: ModelSourceConfig, key: str = "model") -> int | None:
    """The longest sequence the model ``src`` names can take, read without loading weights: from
    ``config.json`` (through ``AutoConfig``, so that architecture defaults apply; as plain JSON for
    an architecture transformers does not know), or ``tiny_max_positions``. None: no stated limit.

    Raises:
        SourceError: ``config.json`` is not valid JSON, or ``src`` names no model.
    """
    require_model(src, key)
    if src.path is None:
        return src.tiny_max_positions
    try:
        return position_limit(AutoConfig.from_pretrained(src.path, local_files_only=True))
    except (OSError, ValueError, KeyError):
        pass
    config_file = Path(src.path) / "config.json"
    try:
        return position_limit(SimpleNamespace(**json.loads(config_file.read_text())))
    except (OSError, ValueError, TypeError) as e:
        raise SourceError(
            f"{key}.path={src.path!r}: its config.json cannot be read as a model config ({e})"
        ) from None


def position_limit_key(src: ModelSourceConfig, key: str = "model") -> str:
    """Where the limit of :func:`source_position_limit` comes from, as the user would set it."""
    return f"{key}.path" if src.path is not None else f"{key}.tiny_max_positions"


def pick_device(name: str) -> torch.device:
    """The device ``name`` means for this process: ``auto`` → CUDA when available, else CPU;
    ``cuda`` (``auto`` included) → the current CUDA device, which under torchrun is this rank's
    (:func:`openaligner.distributed.init_from_env` selects it); anything else as given."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def load_causal_lm(
    src: ModelSourceConfig,
    vocab_size: int,
    device: torch.device,
    dtype: torch.dtype = MASTER_DTYPE,
    *,
    skeleton: bool = False,
) -> PreTrainedModel:
    """The causal LM ``src`` names (tiny ones sized to ``vocab_size`` unless set), eval mode.

    Its weights are ``dtype`` whatever the checkpoint was stored in: float32 by default, the master
    weights a trained model needs (:mod:`openaligner.models.precision`). With ``skeleton`` the same
    model is built on the meta device instead, its structure without any weight read or drawn
    (``device`` is ignored): a rank that receives its shards from rank 0
    (:func:`openaligner.models.sharding.fill_from_leader`).
    """
    model: PreTrainedModel
    with torch.device("meta") if skeleton else nullcontext():
        if src.path is not None and skeleton:
            config = AutoConfig.from_pretrained(src.path, local_files_only=True)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        elif src.path is not None:
            model = AutoModelForCausalLM.from_pretrained(src.path, local_files_only=True, dtype=dtype)
        else:
            model = build_tiny_causal_lm(src.tiny_arch, src.tiny_size(vocab_size), seed=src.tiny_seed)
    # nn.Module.to: transformers' typed wrapper of .to rejects a device argument under mypy.
    nn.Module.to(model, torch.device("meta") if skeleton else device, dtype)
    return model.eval()


def load_reward_model(
    src: ModelSourceConfig,
    vocab_size: int,
    device: torch.device,
    standardization: tuple[float, float] | None = None,
    dtype: torch.dtype = MASTER_DTYPE,
    *,
    skeleton: bool = False,
) -> RewardModel:
    """A :class:`RewardModel` from ``src`` (an HF directory in the reward/critic layout, or tiny);
    backbone in ``dtype`` (float32 master weights by default), head in float32."""
    return _scalar_head_model(RewardModel, src, vocab_size, device, standardization, dtype, skeleton)


def load_critic(
    src: ModelSourceConfig,
    vocab_size: int,
    device: torch.device,
    standardization: tuple[float, float] | None = None,
    dtype: torch.dtype = MASTER_DTYPE,
    *,
    skeleton: bool = False,
) -> CriticModel:
    """A :class:`CriticModel` from ``src``; a reward-model directory initialises the critic.
    Backbone in ``dtype`` (float32 master weights by default), head in float32."""
    return _scalar_head_model(CriticModel, src, vocab_size, device, standardization, dtype, skeleton)


_S = TypeVar("_S", RewardModel, CriticModel)


def _scalar_head_model(
    cls: type[_S],
    src: ModelSourceConfig,
    vocab_size: int,
    device: torch.device,
    standardization: tuple[float, float] | None,
    dtype: torch.dtype,
    skeleton: bool,
) -> _S:
    """A reward model or critic from ``src``, eval mode (see :func:`load_causal_lm` for ``skeleton``).

    Raises:
        SourceError: ``src.path`` holds a classifier that cannot be this model (e.g. an encoder as
            the critic, or a classifier with neither a ``score`` head nor an encoder's own).
    """
    with torch.device("meta") if skeleton else nullcontext():
        if src.path is not None:
            try:
                if skeleton:
                    config = AutoConfig.from_pretrained(src.path, local_files_only=True, num_labels=1)
                    hf = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
                    model = cls(hf, standardization=standardization)
                else:
                    model = cls.from_pretrained(src.path, dtype=dtype, standardization=standardization)
            except ValueError as e:  # what the model classes refuse, as a start-up refusal
                raise SourceError(f"{src.path}: {e}") from None
        else:
            hf = build_tiny_sequence_classifier(src.tiny_arch, src.tiny_size(vocab_size), seed=src.tiny_seed)
            model = cls(nn.Module.to(hf, dtype=dtype), standardization=standardization)
    return model.to(torch.device("meta") if skeleton else device).eval()
