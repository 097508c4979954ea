"""The one tiny-model fixture shared by all tests: seeded 2-layer models and a char tokenizer.

Models are built once per session and handed out as deep copies, so a test may train or modify
what it gets without affecting other tests; a server's tests save one (with its tokenizer) as a
Hugging Face directory. Nothing is downloaded.
"""

from __future__ import annotations

import copy
import dataclasses
import signal
from functools import cache
from pathlib import Path

import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from chatml import CHATML
from openaligner.models.builders import (
    TinyArch,
    TinySize,
    build_tiny_causal_lm,
    build_tiny_sequence_classifier,
)
from openaligner.models.critic import CriticModel
from openaligner.models.reward import RewardModel
from openaligner.models.tokenizers import build_char_tokenizer

# A test run started in the background (`make test &`, some CI wrappers) inherits SIGINT as
# ignored, and so would every server and trainer the tests start: the Ctrl-C tests need it
# delivered. A handler set here is reset to the default in the processes the tests exec.
signal.signal(signal.SIGINT, signal.default_int_handler)


class TinyModels:
    """Factory of tiny seeded models whose vocabulary matches the char tokenizer (100 ids)."""

    def __init__(self) -> None:
        self.tokenizer: PreTrainedTokenizerFast = build_char_tokenizer()
        self.size = TinySize(vocab_size=len(self.tokenizer), hidden_size=64, num_layers=2, num_heads=4)

    def causal_lm(self, arch: TinyArch = "gpt2", seed: int = 0) -> PreTrainedModel:
        """A fresh copy of the seeded causal LM (eval mode)."""
        return copy.deepcopy(_causal_lm(arch, self.size, seed))

    def reward_model(self, arch: TinyArch = "gpt2", seed: int = 0) -> RewardModel:
        return RewardModel(copy.deepcopy(_classifier(arch, self.size, seed))).eval()

    def critic(self, arch: TinyArch = "gpt2", seed: int = 0) -> CriticModel:
        return CriticModel(copy.deepcopy(_classifier(arch, self.size, seed))).eval()

    def save_causal_lm(self, directory: Path, arch: TinyArch = "gpt2", seed: int = 0, **size: int) -> Path:
        """Save the seeded causal LM and a fresh char tokenizer into ``directory`` (a Hugging Face
        directory: ``from_pretrained`` and ``AutoTokenizer`` load it); returns ``directory``.
        ``size``: :class:`TinySize` fields that differ from :attr:`size` (e.g. ``num_heads=2``)."""
        tokenizer = build_char_tokenizer()
        model = build_tiny_causal_lm(arch, dataclasses.replace(self.size, **size), seed)
        model.save_pretrained(str(directory))
        tokenizer.save_pretrained(str(directory))
        return directory


@cache
def _causal_lm(arch: TinyArch, size: TinySize, seed: int) -> PreTrainedModel:
    return build_tiny_causal_lm(arch, size, seed)


@cache
def _classifier(arch: TinyArch, size: TinySize, seed: int) -> PreTrainedModel:
    return build_tiny_sequence_classifier(arch, size, seed)


@pytest.fixture(scope="session")
def tiny() -> TinyModels:
    return TinyModels()


@pytest.fixture
def chat_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh char tokenizer with ChatML's control tokens ``<|im_start|>`` = 100 and
    ``<|im_end|>`` = 101 (102 ids) and :data:`CHATML` as its chat template; tests may change it."""
    tok = build_char_tokenizer()
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.chat_template = CHATML
    return tok
