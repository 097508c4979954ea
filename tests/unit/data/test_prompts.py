import json

import pytest

from openaligner.data.prompts import EpochSampler, build_prompt_dataset, read_prompt_texts


def test_read_jsonl_and_errors(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "a b"}) + "\n\n" + json.dumps({"prompt": "c"}) + "\n")
    assert read_prompt_texts(p) == ["a b", "c"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1.*'prompt'"):
        read_prompt_texts(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_prompt_texts(bad)
    with pytest.raises(ValueError, match="does not exist"):
        read_prompt_texts(tmp_path / "nope.jsonl")


def test_too_long_and_empty_prompts_are_dropped_and_counted():
    ds = build_prompt_dataset(["a", "a b c d", "", "a b"], lambda s: [len(w) for w in s.split()], 3)
    assert ds.texts == ["a", "a b"]
    assert (ds.dropped_too_long, ds.dropped_empty, len(ds)) == (1, 1, 2)


def test_sampler_is_deterministic_resumable_and_reshuffles_each_epoch():
    s = EpochSampler(num_samples=10, batch_size=4, seed=3)
    assert s.steps_per_epoch == 2  # 2 leftover prompts per epoch are dropped
    it = s.batches(0)
    run = [next(it) for _ in range(5)]
    assert [e for e, _ in run] == [0, 0, 1, 1, 2]
    assert run[0][1] != run[2][1]  # epoch 1 is a new permutation
    assert len(set(run[0][1] + run[1][1])) == 8  # no repeats within an epoch
    # resuming after 3 steps (12 samples) continues exactly where the run was, mid-epoch 1
    resumed = s.batches(12)
    assert [next(resumed) for _ in range(2)] == run[3:5]
    # and at an epoch boundary (8 samples = 2 steps)
    assert next(s.batches(8)) == run[2]


def test_sampler_refuses_tiny_dataset():
    with pytest.raises(ValueError, match="cannot fill one batch"):
        next(EpochSampler(3, 4, 0).batches(0))
