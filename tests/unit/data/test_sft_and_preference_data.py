"""SFT and preference data: JSONL reading, tokenization layout, dropping, holdout split."""

from __future__ import annotations

import json

import pytest

from openaligner.data.jsonl import read_records, split_holdout
from openaligner.data.preference import build_preference_pairs
from openaligner.data.sft import build_sft_examples, collate_sft


def _encode(text: str) -> list[int]:
    return [10 + ord(c) % 50 for c in text]


def test_sft_example_layout_bos_prompt_response_eos():
    (example,) = build_sft_examples([{"prompt": "ab", "response": "c"}], _encode, 10, bos_id=2, eos_id=1)
    assert example.tokens == [2, *_encode("ab"), *_encode("c"), 1]
    assert example.prompt_length == 3
    batch = collate_sft(
        [example, *build_sft_examples([{"prompt": "a", "response": "b"}], _encode, 10, None, 1)], 0
    )
    assert batch["tokens"].tolist()[1] == [*_encode("a"), *_encode("b"), 1, 0, 0]
    assert batch["lengths"].tolist() == [5, 3] and batch["prompt_lengths"].tolist() == [3, 1]


def test_too_long_examples_are_dropped_not_truncated():
    records = [{"prompt": "abc", "response": "defg"}, {"prompt": "a", "response": "b"}]
    assert len(build_sft_examples(records, _encode, 6, None, None)) == 1
    pairs = build_preference_pairs(
        [
            {"prompt": "a", "chosen": "bb", "rejected": "cccccc"},
            {"prompt": "a", "chosen": "b", "rejected": "c"},
        ],
        _encode,
        5,
        bos_id=2,
        eos_id=1,
    )
    assert len(pairs) == 1
    assert pairs[0].chosen == [2, *_encode("ab"), 1] and pairs[0].rejected == [2, *_encode("ac"), 1]


def test_read_records_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "p", "response": 3}) + "\n\n" + json.dumps({"prompt": "p"}) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:3.*missing \['response'\]"):
        read_records(path, ("prompt", "response"))
    path.write_text(json.dumps({"prompt": "p", "response": 3}) + "\n")
    assert read_records(path, ("prompt", "response")) == [{"prompt": "p", "response": "3"}]
    with pytest.raises(ValueError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl", ("prompt",))


def test_holdout_split_is_seeded_disjoint_and_complete():
    items = list(range(20))
    train, val = split_holdout(items, 0.25, seed=1)
    assert len(val) == 5 and sorted(train + val) == items
    assert split_holdout(items, 0.25, seed=1) == (train, val)
    assert split_holdout(items, 0.25, seed=2) != (train, val)
    assert split_holdout([1, 2], 0.1, seed=0)[1] != []
    assert split_holdout(items, 0.0, seed=0) == (items, [])
