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
    train_bpe_tokenizer,
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


# ---------------------------------------------------------------------------- trained byte-level BPE
CORPUS = ["sort 5 2 8 1 : 1 2 5 8", "the user asks and the assistant answers"] * 8
CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _chatml_bpe(**kwargs):
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    return train_bpe_tokenizer(
        CORPUS, 300, specials, eos_token="<|im_end|>", pad_token="<|endoftext|>", **kwargs
    )


def test_bpe_tokenizer_is_deterministic_with_specials_first_in_order():
    a, b = _chatml_bpe(), _chatml_bpe()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert [a.convert_ids_to_tokens(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (a.pad_token_id, a.eos_token_id, a.bos_token_id) == (0, 2, None)
    assert 256 + 3 < len(a) <= 300  # the bytes, the specials and some merges


def test_bpe_tokenizer_round_trips_any_text_and_keeps_special_tokens_whole():
    tok = _chatml_bpe()
    text = "<|im_start|>user\nsort 9 1 é ✓<|im_end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids[-1] == 2  # the turn markers are one id each
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nsort 9 1 é ✓"


def test_bpe_tokenizer_saves_with_its_chat_template_and_loads_offline(tmp_path):
    tok = _chatml_bpe(chat_template=CHATML)
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "sort 3 1"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\nsort 3 1<|im_end|>\n"
    assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 2)


def test_a_bpe_tokenizer_without_pad_token_is_padded_with_eos_once_loaded(tmp_path):
    tok = train_bpe_tokenizer(
        CORPUS, 300, ("<|endoftext|>",), eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    assert tok.pad_token_id is None
    tok.save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path).pad_token_id == tok.eos_token_id == 0


def test_bpe_tokenizer_refuses_unknown_roles_and_too_small_vocabularies():
    with pytest.raises(ValueError, match="not among the special tokens"):
        train_bpe_tokenizer(CORPUS, 300, ("<eos>",), eos_token="</s>")
    with pytest.raises(ValueError, match="no room"):
        train_bpe_tokenizer(CORPUS, 200, ("<eos>",), eos_token="<eos>")
