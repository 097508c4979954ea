"""Tokenizers: load any Hugging Face tokenizer from a local directory, or build a tiny one in-process.

Owns the project's special-token convention for the locally built char and word tokenizers
(``<pad>`` = 0, ``<eos>`` = 1, ``<bos>`` = 2, ``<unk>`` = 3, ordinary symbols from 4), the small
trained byte-level BPE tokenizers that stand in for real models' tokenizers (any special tokens,
any chat template), and the offline loading rule (``local_files_only``: nothing is ever
downloaded). Must not know about models, datasets or training: callers decide whether to add
BOS/EOS (the tokenizers built here add nothing).
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
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


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str],
    *,
    eos_token: str,
    bos_token: str | None = None,
    pad_token: str | None = None,
    unk_token: str | None = None,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's scheme) trained on ``texts``; deterministic.

    Ids: ``special_tokens`` first, in the order given, then the 256 byte symbols, then the merges
    learnt from ``texts`` up to ``vocab_size`` ids. Every text encodes (bytes need no ``<unk>``),
    and ``decode`` restores it exactly. Special tokens written in a text encode as their one id
    (so a chat-formatted prompt keeps its turn markers).

    Args:
        special_tokens: every special token, id order; the named roles below must be among them,
            the others become extra special tokens (e.g. ``<|im_start|>``).
        eos_token, bos_token, pad_token, unk_token: which special token plays each role; None:
            the tokenizer has none (e.g. GPT-2 has no pad token, Qwen2 no BOS).
        chat_template: a Jinja chat template, saved with the tokenizer.

    Raises:
        ValueError: a role names a token not in ``special_tokens``, or ``vocab_size`` leaves no
            room for the byte symbols.
    """
    roles = {"eos_token": eos_token, "bos_token": bos_token, "pad_token": pad_token, "unk_token": unk_token}
    unknown = {k: v for k, v in roles.items() if v is not None and v not in special_tokens}
    if unknown:
        raise ValueError(f"{unknown} are not among the special tokens {list(special_tokens)}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(special_tokens) + len(alphabet):
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room for {len(special_tokens)} special tokens and "
            f"{len(alphabet)} byte symbols"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=alphabet,
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    named = {v for v in roles.values() if v is not None}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        extra_special_tokens=[t for t in special_tokens if t not in named],
        padding_side="right",
        chat_template=chat_template,
        **{k: v for k, v in roles.items() if v is not None},
    )


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
