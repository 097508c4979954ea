"""SFT and preference data: tokenization layout, the loss mask of a chat example, dropping."""

from __future__ import annotations

import pytest

from openaligner.algorithms import response_mask
from openaligner.data.formats import PreferenceRecord, SFTRecord
from openaligner.data.preference import build_preference_pairs
from openaligner.data.render import LayoutError, Renderer, SequenceLayout
from openaligner.data.sft import build_sft_examples, collate_sft


def answer(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def sft(prompt, response: str) -> SFTRecord:
    return SFTRecord(prompt, answer(response), "d.jsonl:1")


def pref(prompt, chosen: str, rejected: str) -> PreferenceRecord:
    return PreferenceRecord(prompt, answer(chosen), answer(rejected), "d.jsonl:1")


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_sft_example_layout_bos_prompt_response_eos(tiny):
    tok = tiny.tokenizer
    (example,) = build_sft_examples([sft("ab", "c")], Renderer(tok, SequenceLayout()), 10)
    assert example.tokens == [2, *ids(tok, "abc"), 1]
    assert example.prompt_length == 3
    no_bos = Renderer(tok, SequenceLayout(add_bos=False))
    batch = collate_sft([example, *build_sft_examples([sft("a", "b")], no_bos, 10)], 0)
    assert batch["tokens"].tolist()[1] == [*ids(tok, "ab"), 1, 0, 0]
    assert batch["lengths"].tolist() == [5, 3] and batch["prompt_lengths"].tolist() == [3, 1]


def test_the_loss_mask_covers_exactly_the_assistant_response(chat_tokenizer):
    tok = chat_tokenizer
    conversation = ({"role": "system", "content": "s"}, {"role": "user", "content": "q"}, answer("x"))
    records = [sft(conversation, "ok"), sft("hi", "yes")]
    examples = build_sft_examples(records, Renderer(tok, SequenceLayout(chat_template=True)), 64)
    batch = collate_sft(examples, 0)
    width = batch["tokens"].shape[1]
    mask = response_mask(batch["prompt_lengths"], batch["lengths"], width - 1)  # [B, S-1] next-token
    for i, want in enumerate(["ok", "yes"]):
        targets = batch["tokens"][i, 1:][mask[i] > 0].tolist()
        assert targets == [*ids(tok, want), 101, 1]  # the answer, <|im_end|>, EOS: nothing of the prompt
        assert tok.decode(batch["tokens"][i, : examples[i].prompt_length]).endswith("<|im_start|>assistant\n")


def test_too_long_examples_are_dropped_not_truncated(tiny):
    tok = tiny.tokenizer
    r = Renderer(tok, SequenceLayout(add_bos=False, add_eos=False))
    assert len(build_sft_examples([sft("abc", "defg"), sft("a", "b")], r, 6)) == 1
    pairs = build_preference_pairs(
        [pref("a", "bb", "cccccc"), pref("a", "b", "c")], Renderer(tok, SequenceLayout()), 5
    )
    assert len(pairs) == 1
    assert pairs[0].chosen == [2, *ids(tok, "ab"), 1] and pairs[0].rejected == [2, *ids(tok, "ac"), 1]


def test_preference_sides_share_the_rendered_prompt(chat_tokenizer):
    r = Renderer(chat_tokenizer, SequenceLayout(chat_template=True))
    (pair,) = build_preference_pairs([pref("q", "good", "bad")], r, 64)
    prompt = r.prompt_ids("q")
    assert pair.chosen[: len(prompt)] == pair.rejected[: len(prompt)] == prompt
    assert pair.chosen[len(prompt) :] == [*ids(chat_tokenizer, "good"), 101, 1]


def test_rendering_errors_name_the_record(tiny):
    with pytest.raises(LayoutError, match=r"^d\.jsonl:1: a conversation \(messages\) needs a chat template"):
        conversation = ({"role": "user", "content": "q"},)
        build_sft_examples([sft(conversation, "a")], Renderer(tiny.tokenizer, SequenceLayout()), 64)
