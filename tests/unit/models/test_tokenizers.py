"""Locally built tokenizers and offline loading."""

from __future__ import annotations

import pytest

from openaligner.models.tokenizers import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    build_char_tokenizer,
    build_word_tokenizer,
    load_tokenizer,
)


def test_char_tokenizer_ids_and_round_trip(tiny):
    tok = tiny.tokenizer
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (
        PAD_ID,
        EOS_ID,
        BOS_ID,
        UNK_ID,
    )
    assert len(tok) == 100
    text = "Hello, world!\n 42"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and min(ids) > UNK_ID
    assert tok.decode(ids) == text
    assert tok("é", add_special_tokens=False)["input_ids"] == [UNK_ID]


def test_save_load_round_trip(tiny, tmp_path):
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    text = "The quick brown fox."
    assert loaded(text)["input_ids"] == tiny.tokenizer(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id) == (PAD_ID, EOS_ID, BOS_ID)
    assert len(loaded) == len(tiny.tokenizer)


def test_batch_padding_is_right_side_with_pad_zero(tiny):
    batch = tiny.tokenizer(["ab", "abcd"], padding=True, add_special_tokens=False)
    assert batch["input_ids"][0][2:] == [PAD_ID, PAD_ID]
    assert batch["attention_mask"][0] == [1, 1, 0, 0]


def test_word_tokenizer():
    tok = build_word_tokenizer(["sort", "these", "3", "1"])
    ids = tok("sort these 3 9", add_special_tokens=False)["input_ids"]
    assert ids == [4, 5, 6, UNK_ID]
    assert tok.decode(ids[:3]) == "sort these 3"
    with pytest.raises(ValueError, match="collide"):
        build_word_tokenizer(["<eos>"])


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_char_tokenizer_builds_identically():
    a, b = build_char_tokenizer(), build_char_tokenizer()
    assert a.get_vocab() == b.get_vocab()
