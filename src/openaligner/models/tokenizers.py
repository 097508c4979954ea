"""Tokenizers: load any Hugging Face tokenizer from a local directory, or build a tiny one in-process.

Owns the project's special-token convention for locally built tokenizers (``<pad>`` = 0,
``<eos>`` = 1, ``<bos>`` = 2, ``<unk>`` = 3, ordinary symbols from 4) and the offline loading
rule (``local_files_only``: nothing is ever downloaded). Must not know about models, datasets or
training: callers decide whether to add BOS/EOS (the tokenizers built here add nothing).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<bos>", "<unk>")
"""Special tokens of locally built tokenizers, in id order."""

DEFAULT_ALPHABET = string.printable[:95] + "\n"
"""Digits, ASCII letters, punctuation, space and newline: 96 symbols, so a char tokenizer has 100 ids."""


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a Hugging Face tokenizer saved in ``path`` (``AutoTokenizer``, offline).

    A tokenizer without a pad token gets its EOS token as pad (the usual decoder-only setup),
    so batch padding always works.

    Raises:
        FileNotFoundError: ``path`` is not a directory.
    """
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory {p} does not exist; pass a saved Hugging Face tokenizer"
        )
    tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    if tok.pad_token_id is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one id per character of ``alphabet``, specials first.

    ``decode`` concatenates characters (no spaces inserted). Characters outside ``alphabet``
    map to ``<unk>``. Vocabulary size is ``len(SPECIAL_TOKENS) + len(set(alphabet))``.
    """
    symbols = list(dict.fromkeys(alphabet))
    vocab = _vocab(symbols)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return _wrap(tok)


def build_word_tokenizer(words: Sequence[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over whitespace-separated ``words``; ``decode`` joins with spaces."""
    vocab = _vocab(list(dict.fromkeys(words)))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _wrap(tok)


def _vocab(symbols: list[str]) -> dict[str, int]:
    clash = [s for s in symbols if s in SPECIAL_TOKENS]
    if clash:
        raise ValueError(f"symbols {clash} collide with the special tokens {SPECIAL_TOKENS}")
    names = list(SPECIAL_TOKENS) + symbols
    return {s: i for i, s in enumerate(names)}


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="right",
    )
