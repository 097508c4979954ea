"""A tiny BERT reward-model directory as a user brings one (a module of its own, as ``chatml.py``):
``config.json`` + ``model.safetensors`` of a seeded 2-layer ``BertForSequenceClassification``
(one label) and a WordPiece tokenizer (``[PAD] [UNK] [CLS] [SEP] [MASK]``, no BOS/EOS) over the
sorting task's words. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["sort", ":", *[str(d) for d in range(10)], "yes", "no", "q", "?", "!", ".", "sure", "nope"]


def tiny_bert_tokenizer(directory: Path) -> BertTokenizerFast:
    """A WordPiece tokenizer with BERT's special tokens, saved in ``directory``."""
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    tok = BertTokenizerFast(vocab=vocab, do_lower_case=True)
    assert len(tok) == len(vocab)
    tok.save_pretrained(str(directory))
    return tok


def tiny_bert_classifier(vocab_size: int, seed: int = 0, *, pad_id: int = 0) -> BertForSequenceClassification:
    """A seeded 2-layer, 32-wide BERT sequence classifier with one label (pooler + head)."""
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=pad_id,
        hidden_dropout_prob=0.0,  # deterministic: a test model learns its few pairs in a few steps
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(seed)
    return BertForSequenceClassification(config).eval()


def tiny_bert_dir(directory: Path, seed: int = 0) -> Path:
    """``directory`` holding the tiny BERT classifier and its tokenizer."""
    tok = tiny_bert_tokenizer(directory)
    tiny_bert_classifier(len(tok), seed).save_pretrained(str(directory))
    return directory
