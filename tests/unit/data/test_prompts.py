"""PPO prompts: reading, rendering, dropping; the resumable epoch sampler."""

import json

import pytest

from openaligner.data.formats import PromptRecord
from openaligner.data.prompts import EpochSampler, build_prompt_dataset, read_prompts
from openaligner.data.render import Renderer, SequenceLayout


def test_read_text_and_conversation_prompts_and_errors(tmp_path):
    p = tmp_path / "p.jsonl"
    user = {"role": "user", "content": "c"}
    p.write_text(json.dumps({"prompt": "a b"}) + "\n\n" + json.dumps({"messages": [user]}) + "\n")
    assert [r.prompt for r in read_prompts(p)] == ["a b", (user,)]
    assert read_prompts(p)[1].where == f"{p}:3"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: missing field \['prompt', 'messages'\]"):
        read_prompts(bad)
    assert [r.prompt for r in read_prompts(bad, prompt_key="text")] == ["x"]
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_prompts(bad)
    with pytest.raises(ValueError, match="does not exist"):
        read_prompts(tmp_path / "nope.jsonl")


def test_too_long_and_empty_prompts_are_dropped_and_counted(tiny):
    records = [PromptRecord(t, "p.jsonl:1") for t in ["a", "abcd", "", "ab"]]
    ds = build_prompt_dataset(records, Renderer(tiny.tokenizer, SequenceLayout(add_bos=False)), 3)
    assert ds.sources == ["a", "ab"]
    assert ds.prompts == [list(tiny.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in ("a", "ab")]
    assert (ds.dropped_too_long, ds.dropped_empty, len(ds)) == (1, 1, 2)
    with_bos = build_prompt_dataset(records, Renderer(tiny.tokenizer, SequenceLayout()), 3)
    assert with_bos.prompts[0][0] == tiny.tokenizer.bos_token_id and with_bos.dropped_empty == 0


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
